"""Encoder-decoder models (seed 002's system): a T5 from a config trains under FSDP on 2 processes, generates in
lockstep, converts to a folder AutoModelForSeq2SeqLM loads with identical logits, and padding never counts.

Data: the standard library's code -> docstring summary pairs as source -> target, the tiny tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, BartConfig, MBartConfig, T5Config

from app.data import load_data
from app.evaluation.samples import decoding_for
from app.huggingface.generate import model_input
from app.prepare import PrepareArgs, prepare
from app.training.preflight import preflight
from arguments import parse_config
from tests.conftest import (generate_through_the_application, read_checkpoint, run_entry, run_train,
                            stop_where_lengths_differ, train_args)
from tests.test_training import assert_succeeded, read_metrics


@pytest.fixture(scope="module")
def summaries(tiny, pairs, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("seq2seq") / "data"
    prepare(PrepareArgs(input=[str(pairs)], source_field="code", target_field="summary", tokenizer=str(tiny.tokenizer),
                        max_source_length=128, max_target_length=32, val_fraction=0.1, output_dir=str(folder)))
    return folder


@pytest.fixture(scope="module")
def t5_config(tiny, tmp_path_factory) -> Path:
    """A 2+2-layer T5, 64 wide; its decoder starts from </s>, its pad token (as configs/t5-demo's: the targets begin
    with <s>); embeddings tied, as T5's always are."""
    folder = tmp_path_factory.mktemp("t5")
    t5_with_decoder_start(tiny, 2).save_pretrained(folder)
    return folder


def t5_with_decoder_start(tiny, decoder_start_token_id: int) -> T5Config:
    vocab = len(AutoTokenizer.from_pretrained(tiny.tokenizer))
    return T5Config(vocab_size=vocab, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
                    decoder_start_token_id=decoder_start_token_id, bos_token_id=1, eos_token_id=2, pad_token_id=2)


@pytest.fixture(scope="module")
def t5_run(tiny, summaries, t5_config, tmp_path_factory) -> Path:
    """FSDP (T5Block units) over 2 processes, 8 steps, generation samples at every evaluation."""
    out_dir = tmp_path_factory.mktemp("t5-run")
    assert_succeeded(run_train(train_args(tiny, out_dir, model_config=t5_config, train_data_dir=summaries, max_step=8,
                                          eval_step_interval=8, eval_samples=4, eval_max_new_tokens=6)))
    return out_dir


@pytest.mark.slow
def test_t5_trains_under_fsdp_and_samples_are_scored(t5_run) -> None:
    metrics = read_metrics(t5_run)
    assert metrics[8]["train_loss"] < metrics[1]["train_loss"] - 0.5
    assert metrics[8]["val_loss"] < metrics[0]["val_loss"]
    for step in (0, 8):
        assert {f"sample_{key}" for key in ("rouge1", "rouge2", "rougeL", "rougeLsum", "length")} <= set(metrics[step])
        assert len((t5_run / "samples" / f"step-{step:08d}.jsonl").read_text().splitlines()) == 4


@pytest.mark.slow
def test_t5_trains_with_activation_checkpointing_under_fsdp_with_the_same_losses(tiny, summaries, t5_config, t5_run,
                                                                              tmp_path) -> None:
    """T5's decoder kept a key/value cache in training (its stacks read their own copies of the config, which
    still said use_cache), and FSDP's checkpoint wrapper then saw other tensors on recomputation: a CheckpointError
    at the first backward (configs/t5-3b-wikihow.yaml's combination)."""
    assert_succeeded(run_train(train_args(tiny, tmp_path, model_config=t5_config, train_data_dir=summaries, max_step=8,
                                          eval_step_interval=8, gradient_checkpointing=True)))
    checkpointed, straight = read_metrics(tmp_path), read_metrics(t5_run)
    for step in range(1, 9):
        assert checkpointed[step]["train_loss"] == pytest.approx(straight[step]["train_loss"], rel=1e-5), step


@pytest.mark.slow
def test_t5_trains_under_fsdp2_with_the_losses_of_fsdp_and_without_torchs_view_warning(tiny, summaries, t5_config,
                                                                                       t5_run, tmp_path) -> None:
    """fsdp2 shards T5's shared embedding apart from its blocks; its losses step for step equal fsdp's, so the
    gradients do too. T5's attention returns a view of the relative-position bias that fsdp2's hooks see: torch
    warns "returned a view tensor" at every step, about a case (an in-place change of that view) T5 never makes."""
    result = run_train(train_args(tiny, tmp_path, model_config=t5_config, train_data_dir=summaries, max_step=8,
                                  eval_step_interval=8, strategy="fsdp2"))
    assert_succeeded(result)
    assert "view tensor" not in result.stderr, result.stderr
    fsdp2, fsdp = read_metrics(tmp_path), read_metrics(t5_run)
    for step in range(1, 9):
        assert fsdp2[step]["train_loss"] == pytest.approx(fsdp[step]["train_loss"], rel=1e-5), step
    assert fsdp2[8]["val_loss"] == pytest.approx(fsdp[8]["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_t5_converts_to_a_folder_with_identical_logits_that_generates(t5_run, tiny, tmp_path) -> None:
    """The folder's tokenizer also ends a source with the EOS that ended every training source: the SentencePiece
    tokenizer of --vocab_size adds none, and a user's `tokenizer(source)` gave the model sources it never saw."""
    folder = tmp_path / "hf"
    result = run_entry(["convert_to_hf.py", "--checkpoint", str(t5_run), "--output_dir", str(folder), "--dtype",
                        "float32"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "logits verified (max relative difference 0.0e+00)" in result.stdout
    card = (folder / "README.md").read_text()  # it said text-generation, and the first source's length as a block
    assert "AutoModelForSeq2SeqLM.from_pretrained" in card and "pipeline_tag: text2text-generation" in card
    assert "| Sequence length (tokens) | sources up to 128, targets up to 32 |" in card
    generated = run_entry(["generate.py", str(folder), "--prompt", "def f(x):\n    return x", "--max_new_tokens", "5",
                           "--temperature", "0"])
    assert generated.returncode == 0 and "-->" in generated.stdout, generated.stderr[-2000:]
    tokenizer, config = AutoTokenizer.from_pretrained(folder), T5Config.from_pretrained(folder)
    assert tokenizer.pad_token_id == config.pad_token_id is not None, "padding=True raised for a batch of sources"
    assert 0 in tokenizer(["def f(x):", "def g(x, y):\n    return x"], padding=True)["attention_mask"][0]
    source = "def f(x):\n    return x"
    assert tokenizer(source)["input_ids"] == AutoTokenizer.from_pretrained(tiny.tokenizer)(source)["input_ids"] + [
        tokenizer.eos_token_id]
    assert tokenizer.model_max_length == 128, "the sources' length in training, what a truncating tokenizer reads"
    assert json.loads((folder / "trained_lengths.json").read_text()) == {"max_source_length": 128}, "generate.py's"


def test_a_pretrained_t5_is_read_into_the_shards_with_its_exact_weights(tiny, summaries, tmp_path) -> None:
    """T5's one embedding under four names (shared, both stacks' embed_tokens, lm_head), stored once: the meta
    route reads it into the one tensor FSDP holds, instead of every rank loading the whole model first."""
    from app.model.build import deferred_init
    from tests.test_model_loading import STILL

    torch.manual_seed(0)
    AutoModelForSeq2SeqLM.from_config(t5_with_decoder_start(tiny, 2)).save_pretrained(tmp_path / "pretrained")
    reference = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "pretrained")
    args = train_args(tiny, tmp_path / "run", model_config=None, model_name=tmp_path / "pretrained",
                      train_data_dir=summaries, **STILL)
    assert deferred_init(parse_config(args), reference.config) is not None, "the meta route, not the plain one"
    assert_succeeded(run_train(args))
    saved = read_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000001.ckpt")["model"]
    assert saved.keys() == reference.state_dict().keys()
    assert all(torch.equal(saved[name], tensor) for name, tensor in reference.state_dict().items())


def test_t5_converts_to_float16_keeping_the_modules_transformers_keeps_in_float32(t5_run, tmp_path) -> None:
    """T5's `wo` stays float32 when transformers loads it in float16: written cast down, it was loaded back as float32
    holding rounded values, and the weight check refused the conversion ("its ...wo.weight differs")."""
    from safetensors.torch import load_file

    result = run_entry(["convert_to_hf.py", "--checkpoint", str(t5_run), "--output_dir", str(tmp_path / "hf"),
                        "--dtype", "float16"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "weights and logits verified (max relative difference 0.0e+00; in float16 the logits move" in result.stdout
    dtypes = {name: tensor.dtype for name, tensor in load_file(tmp_path / "hf" / "model.safetensors").items()}
    assert {dtype for name, dtype in dtypes.items() if ".wo." in name} == {torch.float32}
    assert {dtype for name, dtype in dtypes.items() if ".wo." not in name} == {torch.float16}


def test_generate_reads_a_source_as_training_read_it(tiny, t5_config, tmp_path) -> None:
    """generate.py gave an encoder-decoder its source as the tokenizer alone encodes it: without the EOS that ends
    every prepared source (the trained SentencePiece tokenizer adds none), and 30 of 60 greedy summaries of a T5
    trained for 250 steps changed."""
    source = "def f(x):\n    return x"
    (tmp_path / "pair.jsonl").write_text(json.dumps({"code": source, "summary": "Return x."}) + "\n")
    prepare(PrepareArgs(input=[str(tmp_path / "pair.jsonl")], source_field="code", target_field="summary",
                        tokenizer=str(tiny.tokenizer), max_source_length=128, max_target_length=32, val_fraction=0,
                        output_dir=str(tmp_path / "data")))
    prepared = load_from_disk(tmp_path / "data")["train"][0]["input_ids"]
    inputs = model_input(AutoTokenizer.from_pretrained(tiny.tokenizer), source, False,
                         T5Config.from_pretrained(t5_config))
    assert inputs["input_ids"].tolist() == [prepared]
    assert inputs["attention_mask"].tolist() == [[1] * len(prepared)]


def test_generate_cuts_a_source_where_training_cut_it_and_says_so(tiny, t5_config, tmp_path, capsys) -> None:
    """generate.py read a source longer than the --max_source_length the model trained on whole: 7 of 9 summaries of
    such sources differed from the run's samples (which read them as prepared), unsaid."""
    from app.cli import UsageError
    from app.huggingface.generate import trained_sources
    from app.huggingface.generate_cli import GenerateArgs

    long, short = "def f(x):\n    return x + " + " + ".join(f"y{i}" for i in range(40)), "def g():\n    pass"
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"code": code, "summary": "Add."}) + "\n"
                                                  for code in (long, short)))
    prepare(PrepareArgs(input=[str(tmp_path / "pairs.jsonl")], source_field="code", target_field="summary",
                        tokenizer=str(tiny.tokenizer), max_source_length=16, max_target_length=32, val_fraction=0,
                        output_dir=str(tmp_path / "data")))
    prepared = load_from_disk(tmp_path / "data")["train"]["input_ids"]
    tokenizer, config = AutoTokenizer.from_pretrained(tiny.tokenizer), T5Config.from_pretrained(t5_config)
    whole = [model_input(tokenizer, code, False, config)["input_ids"][0].tolist() for code in (long, short)]
    assert len(whole[0]) > 16 and prepared[0] != whole[0]
    given = GenerateArgs(model="t5", max_source_length=16)
    assert sorted(trained_sources(tokenizer, config, whole, given)) == sorted(prepared)
    assert "note: 1 of 2 sources is longer than 16 tokens: cut to them before their end, keeping the EOS " \
        "(--max_source_length)" in capsys.readouterr().err
    tokenizer.model_max_length = 16  # a Hub tokenizer's own limit (T5's 512) says nothing of how the model trained
    assert trained_sources(tokenizer, config, whole, GenerateArgs(model=str(tmp_path))) == whole
    (tmp_path / "trained_lengths.json").write_text('{"max_source_length": 16}\n')  # as convert_to_hf.py records it
    assert sorted(trained_sources(tokenizer, config, whole, GenerateArgs(model=str(tmp_path)))) == sorted(prepared)
    assert "(the --max_source_length the model trained with, from its trained_lengths.json" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--max_source_length applies to an encoder-decoder's sources"):
        trained_sources(tokenizer, AutoConfig.from_pretrained(tiny.model_config), whole, given)


def test_generate_refuses_a_prompt_or_an_answer_past_the_models_positions_in_one_line(tiny, tmp_path, capsys) -> None:
    """BART's learned positions: a source longer than the encoder's, or an answer longer than the decoder's, ended
    in an IndexError traceback; a decoder-only model's prompt and answer share its positions."""
    from app.huggingface.generate_cli import main as generate_main

    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer)
    bart = BartConfig(vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=64,
                      decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2,
                      max_position_embeddings=32, pad_token_id=tokenizer.eos_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id)
    AutoModelForSeq2SeqLM.from_config(bart).save_pretrained(tmp_path / "bart")
    tokenizer.save_pretrained(tmp_path / "bart")
    capsys.readouterr()
    for argv, expected in (
            (["--prompt", "def parse(line): return line.split() " * 8], "tokens, more than the 32 the model's encoder "
                                                                         "reads (max_position_embeddings); shorten it"),
            (["--prompt", "def f(", "--max_new_tokens", "40"], "--max_new_tokens 40 passes the decoder's 32 "
                                                               "positions (max_position_embeddings); give at most 31")):
        with pytest.raises(SystemExit) as exit_info:
            generate_main([str(tmp_path / "bart"), *argv])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1 and expected in lines[0], lines
    generate_main([str(tmp_path / "bart"), "--prompt", "def f(", "--max_new_tokens", "31"])  # the most it can write
    assert " new tokens, " in capsys.readouterr().out


def test_padding_never_counts_in_the_loss(summaries, t5_config) -> None:
    """A padded batch's mean loss times its trained tokens equals the sum of each example's own loss x tokens."""
    data = load_data(summaries)
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(T5Config.from_pretrained(t5_config)).eval()
    rows = data.train.__getitems__(list(range(6)))
    batch = data.format.collate(rows)
    assert (batch.inputs["attention_mask"] == 0).any() and (batch.inputs["labels"] == -100).any(), "padding"
    with torch.no_grad():
        padded = model(**batch.inputs).loss * batch.trained_tokens
        alone = sum(model(input_ids=row["input_ids"][None], labels=row["labels"][None]).loss * len(row["labels"])
                    for row in rows)
    assert batch.trained_tokens == sum(len(row["labels"]) for row in rows)
    assert padded.item() == pytest.approx(alone.item(), rel=1e-5)


@pytest.mark.slow
def test_t5_samples_under_fsdp_equal_transformers_generate_with_different_lengths(tiny, summaries, t5_config,
                                                                                  tmp_path) -> None:
    """A pretrained T5 (randomly initialised, attention and feed-forward weights x3, otherwise it repeats one token
    whatever it reads), set up by the application on 2 FSDP ranks."""
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(T5Config.from_pretrained(t5_config)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(part in name for part in ("SelfAttention", "EncDecAttention", "DenseReluDense")):
                parameter.mul_(3)
    model.save_pretrained(tmp_path / "t5")
    data = load_data(summaries)
    samples = data.format.samples(data.validation, 4)
    greedy = [model.generate(torch.tensor([s.prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                             pad_token_id=2)[0, 1:].tolist() for s in samples]
    stop_id, expected = stop_where_lengths_differ(greedy)
    assert generate_through_the_application(tiny, summaries, tmp_path / "t5", stop_id, 4, 10, tmp_path) == expected


def refusals(tiny, out_dir: Path, capsys, **overrides: object) -> list[str]:
    """The lines of the preflight's refusal of train.py with these options (exit 2)."""
    capsys.readouterr()  # what the fixtures printed
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, out_dir, **overrides)))
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_t5_in_float16_is_refused_naming_a_precision_without_bfloat16(tiny, summaries, t5_config, tmp_path,
                                                                      capsys) -> None:
    """T5 keeps its feed-forward output in float32 under fp16; 16-bit training casts it down and overflows, then
    stops on a non-finite loss advising bf16, which a V100 or T4 lacks."""
    (line,) = refusals(tiny, tmp_path, capsys, model_config=t5_config, train_data_dir=summaries, precision="16-mixed")
    assert line.startswith("error: --precision 16-mixed: T5ForConditionalGeneration keeps wo in float32") and \
        "use --precision 32-true, or bf16-mixed" in line, line


def test_neftune_on_an_encoder_decoder_is_refused_in_one_line(tiny, summaries, t5_config, tmp_path, capsys) -> None:
    """T5's one embedding table embeds sources and targets: NEFTune's noise on both is not what it is defined as."""
    (line,) = refusals(tiny, tmp_path, capsys, model_config=t5_config, train_data_dir=summaries,
                       neftune_noise_alpha=5)
    assert line == ("error: --neftune_noise_alpha: a t5 model embeds its sources and its targets with one table, "
                    "and NEFTune's noise is for a causal model's inputs; drop it"), line


def test_data_for_another_kind_of_model_is_refused_naming_the_options_that_prepare_the_right_kind(
        tiny, summaries, t5_config, tmp_path, capsys) -> None:
    causal = " ".join(refusals(tiny, tmp_path, capsys, train_data_dir=summaries))
    assert "holds seq2seq data but" in causal and "is a causal LM; prepare the data with --prompt_field/--response_" \
        "field or --messages_field (raw text: --text_field)" in causal, causal
    (line,) = refusals(tiny, tmp_path, capsys, model_config=t5_config)
    assert "holds text data but" in line and "prepare the data with --source_field/--target_field" in line, line


def test_sources_and_targets_beyond_learned_positions_are_refused_naming_their_lengths(tiny, summaries, tmp_path,
                                                                                       capsys) -> None:
    """BART's decoder reads the targets from position 0 of its learned positions: targets longer than them ended
    the run at its first batch with an IndexError on every rank (only the sources were checked, and the refusal
    named --block_size, which seq2seq data does not have)."""
    vocab = len(AutoTokenizer.from_pretrained(tiny.tokenizer))
    BartConfig(vocab_size=vocab, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16,
               bos_token_id=1, eos_token_id=2, pad_token_id=2, decoder_start_token_id=2,
               forced_bos_token_id=None).save_pretrained(tmp_path / "bart")
    lines = refusals(tiny, tmp_path / "run", capsys, model_config=tmp_path / "bart", train_data_dir=summaries)
    assert [line.split(" tokens exceed ")[0] for line in lines] == [
        "error: --train_data_dir sources of up to 128", "error: --train_data_dir targets of up to 32"], lines
    assert lines[0].endswith("(16); prepare the data with --max_source_length 16 or less"), lines
    assert lines[1].endswith("(16); prepare the data with --max_target_length 16 or less"), lines


def test_a_t5_decoder_starting_from_the_token_every_target_begins_with_is_refused(tiny, summaries, tmp_path,
                                                                                   capsys) -> None:
    """The tokenizer puts <s> in front of every target; a T5 whose decoder also starts from <s> reads it at its first
    two positions and, without absolute positions, cannot tell them apart: a run trained to a normal validation
    loss (3.15 after 120 steps) and generated only <s>, empty summaries scored ROUGE 0, with no word said."""
    t5_with_decoder_start(tiny, 1).save_pretrained(tmp_path / "t5")
    (line,) = refusals(tiny, tmp_path / "run", capsys, model_config=tmp_path / "t5", train_data_dir=summaries)
    assert line.startswith("error: --train_data_dir: every target begins with token 1, the decoder_start_token_id of")
    assert line.endswith("set decoder_start_token_id to the pad token (2) in the model's config"), line


def test_an_encoder_decoder_config_without_a_decoder_start_is_refused_where_it_is_needed(tiny, summaries, tmp_path,
                                                                                         capsys) -> None:
    """T5Config() names no decoder_start_token_id: every rank ended in an AttributeError after the launch. mBART builds
    its decoder's inputs from the labels alone, in training and in generation samples: it is not refused."""
    vocab = len(AutoTokenizer.from_pretrained(tiny.tokenizer))
    T5Config(vocab_size=vocab, d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4, eos_token_id=2,
             pad_token_id=2).save_pretrained(tmp_path / "t5")
    tiny_mbart(vocab).save_pretrained(tmp_path / "mbart")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "run", model_config=tmp_path / "t5",
                                          train_data_dir=summaries)))
    printed = capsys.readouterr()
    (t5,) = printed.err.strip().splitlines()
    assert "--chunked_loss" not in printed.out, "a note on the loss (its probe failing alike) read as going ahead"
    assert t5 == (f"error: --model_config {tmp_path / 't5'}: its config names no decoder_start_token_id, the token the "
                  "t5 decoder starts from, which training needs; add it to the model's config.json (T5 starts from "
                  "its pad token, BART from </s>)")
    preflight(parse_config(train_args(tiny, tmp_path / "run", model_config=tmp_path / "mbart",
                                      train_data_dir=summaries, eval_samples=2)))
    tiny_mbart(vocab, max_position_embeddings=256).save_pretrained(tmp_path / "mbart-256")
    (long,) = refusals(tiny, tmp_path / "run", capsys, model_config=tmp_path / "mbart-256", train_data_dir=summaries,
                       eval_samples=2, eval_max_new_tokens=300)
    assert long == ("error: --eval_max_new_tokens 300 passes the decoder's 256 positions (max_position_embeddings); "
                    "lower it"), "an encoder-decoder's source is no prompt in the decoder's positions"


def tiny_mbart(vocab: int, pad_token_id: int = 2, **overrides) -> MBartConfig:
    return MBartConfig(vocab_size=vocab, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                       decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, bos_token_id=0,
                       eos_token_id=2, pad_token_id=pad_token_id, **overrides)


@pytest.mark.parametrize("model_config, start", [
    (T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4, decoder_start_token_id=0, pad_token_id=0), 0),
    (BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=64, decoder_ffn_dim=64, decoder_start_token_id=2, pad_token_id=1), 2),
    (tiny_mbart(100, pad_token_id=1, decoder_start_token_id=2), 40),
], ids=["t5", "bart", "mbart"])
def test_generation_samples_start_the_decoder_where_its_training_inputs_start(model_config, start) -> None:
    """mbart-large-cc25's targets end with the target language's code, and its decoder's inputs in training start
    with it (the labels shifted right behind their last token); samples started from decoder_start_token_id
    instead, and the model wrote in no language it was trained for. T5 and BART start from decoder_start_token_id."""
    reference = [5, 6, 7, 2, 40]  # "words </s> ro_RO" for mBART
    first = decoding_for(model_config).first([[9, 8, 2]], [reference])
    assert first["decoder_input_ids"].tolist() == [[start]]
    assert first["input_ids"].tolist() == [[9, 8, 2]] and "attention_mask" not in first
    other_language = [5, 6, 2, 41]  # a multilingual mixture's other target code
    together = decoding_for(model_config).first([[9, 8, 2], [7, 2]], [reference, other_language])
    assert together["input_ids"].tolist() == [[9, 8, 2], [7, 2, 0]], "sources padded on the right"
    assert together["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert together["decoder_input_ids"].tolist() == ([[40], [41]] if start == 40 else [[start], [start]]), (
        "each row from its own reference's start")
