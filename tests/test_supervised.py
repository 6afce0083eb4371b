"""Supervised fine-tuning: packed examples never see each other, the loss of a step is normalised over all the
trained tokens of all its micro-batches and ranks, generation samples run in lockstep under FSDP, and the
learning rate follows the global batch.

Data: the standard library's code -> docstring summary pairs, prepared by prepare_data.py with the tiny tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rouge_score.tokenizers import DefaultTokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, FalconConfig, Lfm2Config, Mamba2Config
from transformers.utils import is_flash_attn_2_available

from app.data import IGNORE_INDEX, load_data
from app.data.formats import Sample, packed_examples
from app.data.order import StepBatches, epoch_permutation, step_rows
from app.evaluation.samples import (CAUSAL, ROUGE_KEYS, RougeWords, SampleEvaluator, fit_to_context,
                                    generate_samples, generation_batches, keeps_last_logits, pads_apart,
                                    sample_metrics, write_samples)
from app.evaluation.validation import EvaluationStopped
from app.model.isolation import probe_isolation
from app.optimization.schedule import make_plan
from app.prepare import PrepareArgs, prepare
from app.training.preflight import preflight
from arguments import parse_config
from tests.conftest import (ONE_PROCESS, ROOT, generate_through_the_application, run_entry, run_train,
                            stop_where_lengths_differ, train_args)
from tests.helpers.flash_attention_on_cpu import flash_attention_on_cpu
from tests.test_prepare_supervised import LLAMA3_TEMPLATE, SPECIAL_TOKENS
from tests.test_training import assert_succeeded, read_metrics

BLOCK = 256


def prepared(tiny, pairs: Path, folder: Path, packing: bool) -> Path:
    prepare(PrepareArgs(input=[str(pairs)], prompt_field="code", response_field="summary", tokenizer=str(tiny.tokenizer),
                        block_size=BLOCK, val_fraction=0.1, packing=packing, output_dir=str(folder)))
    return folder


@pytest.fixture(scope="module")
def packed(tiny, pairs, tmp_path_factory) -> Path:
    return prepared(tiny, pairs, tmp_path_factory.mktemp("packed") / "data", packing=True)


@pytest.fixture(scope="module")
def padded(tiny, pairs, tmp_path_factory) -> Path:
    return prepared(tiny, pairs, tmp_path_factory.mktemp("padded") / "data", packing=False)


@pytest.fixture(scope="module")
def pretrained(tiny, tmp_path_factory) -> Path:
    """A 'pretrained' tiny Llama with room for the examples' positions, so that every strategy starts from it."""
    folder = tmp_path_factory.mktemp("pretrained-512")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny.model_config, max_position_embeddings=2 * BLOCK)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_an_example_packed_with_others_gets_the_logits_it_gets_alone(packed, pretrained) -> None:
    """SDPA with position_ids restarting at every example (the batch the training path builds) isolates them. As in
    train.py's build_model, without the KV cache: with a cache, transformers does not look for packed examples."""
    data = load_data(packed)
    model = AutoModelForCausalLM.from_pretrained(pretrained, attn_implementation="sdpa", use_cache=False).eval()
    row = next(i for i in range(len(data.train)) if (data.train[i]["position_ids"] == 0).sum() >= 3)
    batch = data.format.collate(data.train.__getitems__([row]))
    assert set(batch.inputs) == {"input_ids", "labels", "position_ids"}
    with torch.no_grad():
        packed_logits = model(input_ids=batch.inputs["input_ids"], position_ids=batch.inputs["position_ids"]).logits[0]
        starts = (batch.inputs["position_ids"][0] == 0).nonzero().flatten().tolist() + [BLOCK]
        for start, end in zip(starts, starts[1:]):
            alone = model(input_ids=batch.inputs["input_ids"][:, start:end]).logits[0]
            assert torch.allclose(packed_logits[start:end], alone, atol=1e-5, rtol=1e-5)


def falcon_folder(tiny, folder: Path, **changes: object) -> Path:
    """A 'pretrained' 2-layer Falcon over the tiny tokenizer: its masks ignore position_ids in transformers 5.23."""
    torch.manual_seed(0)
    config = FalconConfig(vocab_size=len(AutoTokenizer.from_pretrained(tiny.tokenizer)), hidden_size=64,
                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2 * BLOCK, **changes)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def summed_losses_alone(model: torch.nn.Module, split) -> tuple[float, int]:
    """Every packed example of the split run alone: its summed token losses over trained tokens, and their count."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in split.with_format(None):
            for example in packed_examples(row):
                logits = model(input_ids=torch.tensor([example.input_ids])).logits[0]
                targets = torch.tensor(example.labels[1:])
                total += torch.nn.functional.cross_entropy(logits[:-1], targets, ignore_index=IGNORE_INDEX,
                                                           reduction="sum").item()
                tokens += int((targets != IGNORE_INDEX).sum())
    return total, tokens


@pytest.mark.slow
def test_a_falcon_trains_on_packed_examples_that_never_see_each_other(tiny, packed, tmp_path) -> None:
    """Falcon's own masks let packed examples attend to each other (1e-2 off in the validation loss); the probe
    finds it and the run feeds a block-diagonal mask: the step-0 validation loss over packed rows of several
    examples, 4 rows per batch on 2 FSDP ranks, equals each example's loss alone."""
    model = falcon_folder(tiny, tmp_path / "falcon")
    result = run_train(train_args(tiny, tmp_path / "out", model_config=None, model_name=model, train_data_dir=packed,
                                  tokenizer=None, max_step=1, warmup_steps=0, eval_iters=100, eval_batch_size=4,
                                  micro_batch_size=2))
    assert_succeeded(result)
    assert "kept apart as boolean_mask" in result.stdout
    falcon = AutoModelForCausalLM.from_pretrained(model).eval()
    total, tokens = summed_losses_alone(falcon, load_data(packed).validation)
    assert read_metrics(tmp_path / "out")[0]["val_loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_flash_attention_2_sees_packed_examples_alone_in_the_layout_the_probe_chose(packed, pretrained) -> None:
    """transformers' FlashAttention-2 code (reference kernels on the CPU): a batch of 4 packed rows in the layout the
    probe chooses gives the loss of every example alone; as prepared, it does not."""
    with flash_attention_on_cpu():
        model = AutoModelForCausalLM.from_pretrained(pretrained, attn_implementation="flash_attention_2").eval()
        model.config.use_cache = False
        assert probe_isolation(model.config, "flash_attention_2").layout == "one_row"
        total, _ = summed_losses_alone(model, load_data(packed).validation.select(range(4)))
        with torch.no_grad():
            for layout, isolated in (("one_row", True), ("position_ids", False)):
                data = load_data(packed, layout)
                batch = data.format.collate(data.validation.__getitems__(list(range(4))))
                summed = model(**batch.inputs).loss.item() * batch.trained_tokens
                assert (summed == pytest.approx(total, rel=1e-5)) == isolated, layout


def test_a_model_that_cannot_keep_packed_examples_apart_is_refused_in_one_line(tiny, packed, tmp_path,
                                                                               capsys) -> None:
    """Falcon with ALiBi takes no mask of ours: refused before any worker starts, naming what works."""
    model = falcon_folder(tiny, tmp_path / "falcon-alibi", alibi=True)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=model,
                                          train_data_dir=packed, tokenizer=None)))
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert "holds packed examples, but a falcon model with --attn_implementation sdpa lets them attend to each " \
           "other" in errors[0] and errors[0].endswith("prepare the data with --packing false"), errors


def test_a_model_whose_convolutions_read_across_packed_examples_is_refused_in_one_line(tiny, packed, tmp_path,
                                                                                      capsys) -> None:
    """LFM2's short convolutions mix an example's first tokens with the previous example's last, whatever the mask:
    its random twin's logits moved by 6e-4, under the probe's tolerance of 1e-3, and the run trained on leaking
    examples (a validation loss of 6.003643 where the examples alone gave 6.003561)."""
    vocabulary = len(AutoTokenizer.from_pretrained(tiny.tokenizer))
    Lfm2Config(vocab_size=vocabulary, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
               max_position_embeddings=512).save_pretrained(tmp_path / "lfm2")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=tmp_path / "lfm2",
                                          train_data_dir=packed, tokenizer=None)))
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert "holds packed examples, but a lfm2 model with --attn_implementation sdpa lets them attend to each other " \
           "(probed: an example's logits change by 0.0" in errors[0], errors
    assert errors[0].endswith("prepare the data with --packing false"), errors


def test_a_state_space_model_whose_isolation_cannot_be_probed_is_refused_naming_packing(tiny, packed, tmp_path,
                                                                                        capsys) -> None:
    """Mamba-2 has no attention heads to make the probe's small twin of: the probe's failure was reported as an
    attention implementation that does not run here, with advice that went in a circle (use sdpa; use eager)."""
    Mamba2Config(vocab_size=512).save_pretrained(tmp_path / "mamba2")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=tmp_path / "mamba2",
                                          attn_implementation="eager", train_data_dir=packed, tokenizer=None)))
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and errors[:1] == [  # then: its 8B weights would not fit this disk
        f"error: --train_data_dir {packed} holds packed examples, but whether a mamba2 model keeps them apart cannot "
        "be probed (a mamba2 config has no attention heads to narrow it by, and its small twin would be 4096 wide); "
        "prepare the data with --packing false"], errors


def test_a_model_whose_sliding_window_a_block_mask_would_drop_is_refused_in_one_line(tiny, packed, tmp_path,
                                                                                     capsys) -> None:
    """GPT-OSS's eager masks read no position restarts, and a block-diagonal mask replaces its sliding-window masks:
    packed examples longer than the window (128 tokens) trained with full attention where the model slides."""
    from transformers import GptOssConfig

    GptOssConfig(vocab_size=len(AutoTokenizer.from_pretrained(tiny.tokenizer)), hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                 num_experts_per_tok=2, sliding_window=128, max_position_embeddings=2 * BLOCK,
                 layer_types=["sliding_attention", "full_attention"]).save_pretrained(tmp_path / "gpt-oss")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=tmp_path / "gpt-oss",
                                          attn_implementation="eager", train_data_dir=packed, tokenizer=None)))
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert "but a gpt_oss model with --attn_implementation eager lets them attend to each other" in errors[0] and \
        "takes no mask that stops it while keeping its sliding window" in errors[0], errors


def phi3_longrope(tiny, folder: Path, original: int) -> Path:
    """A tiny Phi-3 whose longrope switches to its long factors past `original` positions (Phi-3-mini-128k: 4096)."""
    from transformers import Phi3Config

    Phi3Config(vocab_size=len(AutoTokenizer.from_pretrained(tiny.tokenizer)), hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * BLOCK,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=original,
               rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                "long_factor": [4.0] * 8}).save_pretrained(folder)
    return folder


def test_longrope_past_its_original_positions_is_refused_where_a_micro_batch_mixes_lengths(tiny, packed, padded,
                                                                                          tmp_path, capsys) -> None:
    """transformers picks a longrope model's factors from the largest position of the whole micro-batch: a short
    example packed with one past original_max_position_embeddings trained with the long factors, which it never
    gets alone (the probe's examples are too short to see it). Refused where micro-batches can mix such lengths;
    blocks no longer than the limit, or examples one per micro-batch, train as they run alone."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(phi3_longrope(tiny, tmp_path / "phi3", 64)))
    short, long = torch.randint(5, 300, (1, 20)), torch.randint(5, 300, (1, 100))
    with torch.no_grad():
        alone = model(input_ids=short).logits
        packed_with_long = model(input_ids=torch.cat([long, short], 1), position_ids=torch.cat(
            [torch.arange(100), torch.arange(20)])[None]).logits[:, 100:]
    assert (alone - packed_with_long).abs().max() > 1e-3, "transformers' longrope: why this is refused"

    def errors(data: Path, original: int, **options: object) -> list[str]:
        capsys.readouterr()
        try:
            preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=phi3_longrope(
                tiny, tmp_path / f"phi3-{original}", original), train_data_dir=data, tokenizer=None, **options)))
        except SystemExit:
            pass
        return [line for line in capsys.readouterr().err.splitlines() if "longrope" in line]

    (refused,) = errors(packed, 64)
    assert refused.startswith(f"error: --train_data_dir {packed} packs examples of up to ") and refused.endswith(
        "past the 64 positions of a phi3 model's longrope (original_max_position_embeddings): transformers then gives "
        "every example of the micro-batch the long factors, which a short one does not get alone; prepare the data "
        "with --block_size 64 or less, or with --packing false and train with --micro_batch_size 1 "
        "--eval_batch_size 1"), refused
    assert "a short example gets the long factors" in errors(padded, 64)[0]
    assert errors(padded, 64, micro_batch_size=1, eval_batch_size=1, gradient_accumulation_steps=8) == []
    assert errors(packed, BLOCK) == [], "examples within the original positions never switch"
    from types import SimpleNamespace

    from app.data.formats import DataFormat
    from app.training.preflight.model import check_length_dependent_rope, samples_pad_apart

    problems: list[str] = []  # an --eval_data_dir folder evaluated with the long factors measured another model
    check_length_dependent_rope(SimpleNamespace(train_data_dir="short", micro_batch_size=4, eval_batch_size=None),
                                AutoConfig.from_pretrained(tmp_path / "phi3-64"), SimpleNamespace(
                                    format=DataFormat.of(packed), longest_example=40, evaluated_longest={"held": 100}),
                                problems)
    assert [problem.split(", past")[0] for problem in problems] == [
        "--eval_data_dir held packs examples of up to 100 tokens with shorter ones"]

    cfg = SimpleNamespace(eval_samples=4, estimate_memory=False, attn_implementation="sdpa", trust_remote_code=False)
    assert not samples_pad_apart(cfg, AutoConfig.from_pretrained(tmp_path / "phi3")), (
        "a batch whose longest prompt crosses the limit gives every row the long factors: one at a time")


def test_flash_attention_where_it_is_missing_is_one_line_for_packed_data_and_no_line_for_a_plan(
        tiny, packed, pretrained, tmp_path, capsys) -> None:
    """The packing probe could not run it either, and said so in a second line for the same cause; planning a GPU run
    on a machine without flash-attn was refused for that second reason."""
    if is_flash_attn_2_available():
        pytest.skip("flash-attn is installed here")
    options = dict(model_config=None, model_name=pretrained, train_data_dir=packed, tokenizer=None,
                   attn_implementation="flash_attention_2")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", **options)))
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "flash_attention_2 needs the flash-attn package and a CUDA GPU" in errors[0], errors
    preflight(parse_config(train_args(tiny, tmp_path / "plan", estimate_memory=True, **options)))
    assert "error" not in capsys.readouterr().err


def test_a_tokenizer_other_than_the_datas_is_refused(tiny, packed, pretrained, tmp_path, capsys) -> None:
    """The data was prepared with the default chat template saved in its tokenizer/; the tiny tokenizer given with
    --tokenizer has none, and the converted model would carry it: prompts rendered unlike training."""
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=pretrained,
                                          train_data_dir=packed, tokenizer=tiny.tokenizer)))
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: --tokenizer {tiny.tokenizer} is not the tokenizer --train_data_dir was prepared with "
                    f"({packed / 'tokenizer'}): its chat template differs; drop --tokenizer (the run records the "
                    "data's), or prepare the data with it")


def test_data_tokenized_for_another_model_than_the_pretrained_one_is_refused(tiny, pretrained, tmp_path,
                                                                           capsys) -> None:
    """Ids of another tokenizer all fit the model's vocabulary: the run trained without a word, and the converted
    folder shipped the data's tokenizer beside the model's weights. The model's own tokenizer is compared now; the
    same tokenizer saved with the model passes."""
    model = tmp_path / "model"
    shutil.copytree(pretrained, model)
    tokenizer = json.loads((tiny.tokenizer / "tokenizer.json").read_text())
    vocabulary = tokenizer["model"]["vocab"]
    first, second = [token for token, i in vocabulary.items() if i in (300, 301)]
    vocabulary[first], vocabulary[second] = vocabulary[second], vocabulary[first]
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tiny.tokenizer / name).exists():
            shutil.copy(tiny.tokenizer / name, model)
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    args = train_args(tiny, tmp_path / "out", model_config=None, model_name=model, tokenizer=None)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        preflight(parse_config(args))
    (line,) = capsys.readouterr().err.strip().splitlines()
    moved = next(token for token, i in vocabulary.items() if i == 300)
    assert line == (f"error: --train_data_dir was tokenized with {tiny.data / 'tokenizer'}, not with --model_name "
                    f"{model}'s tokenizer: {moved!r} is id 300 for the model and 301 in the data; prepare the data "
                    f"with --tokenizer {model}")
    with pytest.raises(SystemExit):  # the data's own tokenizer named with --tokenizer skipped the comparison
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=model,
                                          tokenizer=tiny.data / "tokenizer")))
    assert capsys.readouterr().err.strip().splitlines() == [line]
    shutil.copy(tiny.tokenizer / "tokenizer.json", model)
    preflight(parse_config(args))
    assert "tokenized with" not in capsys.readouterr().err
    with_chat_tokens = AutoTokenizer.from_pretrained(tiny.tokenizer)
    with_chat_tokens.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    with_chat_tokens.save_pretrained(model)  # the model's (its embeddings resized): plain text needs none of them
    preflight(parse_config(args))
    output = capsys.readouterr()
    assert "tokenized with" not in output.err and f"--train_data_dir's tokenizer ({tiny.data / 'tokenizer'}) lacks 2 " \
           f"tokens of --model_name {model}'s (<|im_start|>, <|im_end|>): the run keeps the data's tokenizer, so the " \
           "converted model will not have them" in output.out


def test_a_data_tokenizer_larger_than_the_model_names_itself_and_says_embeddings_are_not_resized(tiny, tmp_path,
                                                                                                 capsys) -> None:
    """Chat tokens added to a tokenizer (ids past the model's vocabulary): the lines named --tokenizer, a flag the
    user had not given, and sent them to the tokenizer the data was prepared with, the very one in use; and the
    data's ids past the vocabulary and the tokenizer's size were two lines of the same advice."""
    AutoConfig.from_pretrained(tiny.model_config, vocab_size=300).save_pretrained(tmp_path / "narrow")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=tmp_path / "narrow", tokenizer=None)))
    errors = capsys.readouterr().err.strip().splitlines()
    assert "error: --train_data_dir holds token id 399 but the model's vocab_size is 300; raise vocab_size in " \
           "--model_config to at least 400, or prepare the data with a tokenizer that fits" in errors, errors
    assert not any("has 400 tokens" in line for line in errors), errors
    narrow = tmp_path / "narrow-pretrained"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "narrow")).save_pretrained(narrow)
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=narrow,
                                          tokenizer=None)))
    errors = capsys.readouterr().err.strip().splitlines()
    assert "error: --train_data_dir holds token id 399 but the model's vocab_size is 300; train.py does not resize " \
           "the model's embeddings: save the model with room for them first (resize_token_embeddings, then " \
           "save_pretrained), or prepare the data with a tokenizer that fits" in errors, errors


def test_samples_asked_of_raw_text_are_refused_for_that_alone(tiny, tmp_path, capsys) -> None:
    """The cause in one line: a second line about --eval_max_new_tokens and the model's positions followed from it."""
    capsys.readouterr()
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", eval_samples=2)))
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --eval_samples 2 needs prompts and references (supervised or seq2seq data), but --train_data_dir "
        f"{tiny.data} holds raw text; drop it or prepare pairs"]


def test_micro_batches_of_a_step_hold_different_numbers_of_trained_tokens(padded) -> None:
    """What makes a mean of micro-batch means wrong, and the runs below meaningful."""
    data = load_data(padded)
    plan = make_plan(train_rows=len(data.train), block_size=BLOCK, world_size=2, micro_batch_size=4, accumulation=2,
                     number_epochs=1, max_step=None)
    order = epoch_permutation(len(data.train), seed=7, epoch=0)
    counts = {int(data.train_trained_tokens[rows].sum()) for rank in (0, 1)
              for rows in list(StepBatches(step_rows(order, plan, 0), plan, rank=rank))[:2]}
    assert len(counts) == 4, counts


def run_supervised(tiny, data: Path, pretrained: Path, out_dir: Path, **overrides: object) -> dict[int, dict]:
    options = dict(model_config=None, model_name=pretrained, train_data_dir=data, tokenizer=None, max_step=3,
                   warmup_steps=0, eval_step_interval=3, eval_iters=100, eval_batch_size=16) | overrides
    result = run_train(train_args(tiny, out_dir, **options))
    assert_succeeded(result)
    return read_metrics(out_dir)


@pytest.fixture(scope="module")
def two_ranks(tiny, padded, pretrained, tmp_path_factory) -> Path:
    """FSDP, 2 ranks x 2 accumulated micro-batches of 4 padded examples, generation samples, sqrt LR scaling."""
    out_dir = tmp_path_factory.mktemp("two-ranks")
    run_supervised(tiny, padded, pretrained, out_dir, micro_batch_size=4, gradient_accumulation_steps=2,
                   eval_samples=4, eval_max_new_tokens=8, lr_scaling="sqrt", reference_batch_size=4)
    return out_dir


@pytest.mark.slow
def test_loss_is_normalised_over_the_trained_tokens_of_the_whole_step(tiny, padded, pretrained, two_ranks,
                                                                      tmp_path) -> None:
    """2 ranks x 2 micro-batches with unequal masks give the gradients of 1 process on the whole batch of 16."""
    single = run_supervised(tiny, padded, pretrained, tmp_path, strategy="single_device", devices=1,
                            micro_batch_size=16, gradient_accumulation_steps=1, lr_scaling="sqrt",
                            reference_batch_size=4)
    sharded = read_metrics(two_ranks)
    for step in (1, 2, 3):
        assert sharded[step]["train_loss"] == pytest.approx(single[step]["train_loss"], rel=1e-5)
        assert sharded[step]["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-5)
    assert sharded[3]["val_loss"] == pytest.approx(single[3]["val_loss"], rel=1e-5)


def test_validation_loss_is_the_mean_over_trained_tokens_only(padded, pretrained, two_ranks) -> None:
    """The step-0 validation loss equals transformers' summed token losses over every trained token of the split
    (prompt tokens and padding excluded), divided by their number."""
    data = load_data(padded)
    model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in data.validation:
            labels = row["labels"][None]
            logits = model(input_ids=row["input_ids"][None]).logits
            total += torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE_INDEX,
                                                       reduction="sum").item()
            tokens += int((labels[0, 1:] != IGNORE_INDEX).sum())
    assert read_metrics(two_ranks)[0]["val_loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_generation_samples_are_written_and_scored_at_each_evaluation(two_ranks) -> None:
    metrics = read_metrics(two_ranks)
    for step in (0, 3):
        lines = (two_ranks / "samples" / f"step-{step:08d}.jsonl").read_text().splitlines()
        assert len(lines) == 4 and set(json.loads(lines[0])) == {"prompt", "reference", "generated"}
        assert json.loads(lines[0])["prompt"].startswith("### User:\n") and json.loads(lines[0])["reference"]
        assert {"sample_exact_match", "sample_rougeL", "sample_length"} <= set(metrics[step])
        assert 0 <= metrics[step]["sample_rougeL"] <= 1 and 1 <= metrics[step]["sample_length"] <= 8


def test_neftune_noises_training_alone_under_fsdp(tiny, padded, pretrained, two_ranks, tmp_path) -> None:
    """--neftune_noise_alpha 5, the run of `two_ranks` otherwise: the same validation before training (no noise in
    evaluation), other training losses (noise on every rank's embeddings), and the loss still falls. Resumed from
    step 2, step 3 draws the same noise: the same loss."""
    options = dict(micro_batch_size=4, gradient_accumulation_steps=2, lr_scaling="sqrt", reference_batch_size=4,
                   neftune_noise_alpha=5, save_step_interval=2)
    noised = run_supervised(tiny, padded, pretrained, tmp_path / "noised", **options)
    clean = read_metrics(two_ranks)
    assert noised[0]["val_loss"] == clean[0]["val_loss"]
    assert all(noised[step]["train_loss"] != clean[step]["train_loss"] for step in (1, 2, 3))
    assert noised[3]["val_loss"] < noised[0]["val_loss"]
    resumed = run_supervised(tiny, padded, pretrained, tmp_path / "resumed", resume=True,
                             checkpoint=tmp_path / "noised" / "checkpoints" / "step-00000002.ckpt", **options)
    assert resumed[3]["train_loss"] == pytest.approx(noised[3]["train_loss"], rel=1e-6)


def test_label_smoothing_and_the_z_loss_train_alike_chunked_or_not_and_leave_validation_alone(
        tiny, padded, pretrained, two_ranks, tmp_path) -> None:
    """--label_smoothing 0.1 --z_loss 1e-3, the run of `two_ranks` otherwise, through the chunked loss and through
    the model's logits (--chunked_loss false): the same validation before training as without them (the plain
    cross-entropy), the same training losses in both paths, other ones than without them, and the loss falls."""
    options = dict(micro_batch_size=4, gradient_accumulation_steps=2, lr_scaling="sqrt", reference_batch_size=4,
                   label_smoothing=0.1, z_loss=1e-3)
    chunked = run_supervised(tiny, padded, pretrained, tmp_path / "chunked", **options)
    materialised = run_supervised(tiny, padded, pretrained, tmp_path / "materialised", chunked_loss=False, **options)
    clean = read_metrics(two_ranks)
    for run in (chunked, materialised):
        assert run[0]["val_loss"] == pytest.approx(clean[0]["val_loss"], rel=1e-6)
        assert run[3]["val_loss"] < run[0]["val_loss"]
    for step in (1, 2, 3):
        assert chunked[step]["train_loss"] == pytest.approx(materialised[step]["train_loss"], rel=1e-5), step
        assert chunked[step]["train_loss"] != pytest.approx(clean[step]["train_loss"], rel=1e-3), step


def test_samples_load_a_tokenizer_with_custom_code_under_trust_remote_code(tiny, padded, pretrained, tmp_path) -> None:
    """The preflight and the model loaded it with --trust_remote_code, the samples' evaluator without: every rank
    asked "Do you wish to run the custom code? [y/N]" and ended in a traceback (at once under Slurm, with no stdin).
    convert_to_hf.py and generate.py had no --trust_remote_code: such a run could not be converted."""
    custom = tmp_path / "tokenizer"
    shutil.copytree(padded / "tokenizer", custom)
    (custom / "custom_tokenizer.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    settings = json.loads((custom / "tokenizer_config.json").read_text())
    settings |= {"tokenizer_class": "CustomTokenizer",
                 "auto_map": {"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]}}
    (custom / "tokenizer_config.json").write_text(json.dumps(settings))
    result = run_train(train_args(tiny, tmp_path / "run", model_config=None, model_name=pretrained,
                                  train_data_dir=padded, tokenizer=custom, trust_remote_code=True, max_step=1,
                                  eval_samples=1, eval_max_new_tokens=2, **ONE_PROCESS))
    assert_succeeded(result)
    assert (tmp_path / "run" / "samples" / "step-00000000.jsonl").is_file()

    def script(*argv: object) -> subprocess.CompletedProcess:
        return run_entry(list(map(str, argv)), 120)

    refused = script("convert_to_hf.py", "--checkpoint", tmp_path / "run", "--output_dir", tmp_path / "hf")
    assert (refused.returncode, refused.stderr.strip()) == (2, (
        f"convert_to_hf.py: error: --checkpoint {tmp_path / 'run'}: the run's tokenizer "
        f"{tmp_path / 'run' / 'tokenizer'} does not load (it ships Python code of its own, which runs only with --trust_remote_code true: read it "
        "first); see convert_to_hf.py --help")), "the data folder's plain tokenizer was taken in its place"
    converted = script("convert_to_hf.py", "--checkpoint", tmp_path / "run", "--output_dir", tmp_path / "hf",
                       "--trust_remote_code", "true")
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert (tmp_path / "hf" / "custom_tokenizer.py").is_file(), "the folder loads on its own"
    written = script("generate.py", tmp_path / "hf", "--max_new_tokens", 2, "--trust_remote_code", "true")
    assert written.returncode == 0 and "2 new tokens" in written.stdout, written.stderr[-3000:]


def test_sample_scores_are_the_mean_over_samples_of_rouge_f_measures() -> None:
    generated = ["Return the cat.", "the the"]
    references = ["Return the cat on the mat.", "the the"]
    metrics = sample_metrics(generated, references, lengths=[4, 2])
    # 1: 3 of 3 words in 6 (F 2/3), 2 of 2 bigrams in 5 (F 4/7), the longest common subsequence is 3 words; 2: equal.
    assert metrics["sample_rouge1"] == pytest.approx((2 / 3 + 1) / 2)
    assert metrics["sample_rouge2"] == pytest.approx((4 / 7 + 1) / 2)
    assert metrics["sample_rougeL"] == metrics["sample_rougeLsum"] == pytest.approx((2 / 3 + 1) / 2)
    assert metrics["sample_exact_match"] == 0.5 and metrics["sample_length"] == 3


ENGLISH = ["The cats were running quickly, weren't they?", "foo_bar abc123 x9 Running2day -- e.g. 3.14",
           "Return the HTTP status code that was sent with the response."]


def test_rouge_reads_every_script_and_stems_english_words_as_rouge_score_does() -> None:
    """rouge_score's own tokenizer keeps only [a-z0-9]: a Cyrillic or Chinese answer equal to its reference scored
    0 while exact match was 1. CJK is scored character by character, as multilingual ROUGE does."""
    stemmed = DefaultTokenizer(use_stemmer=True)
    assert all(RougeWords().tokenize(text) == stemmed.tokenize(text) for text in ENGLISH)
    same = sample_metrics(["Кошка сидит на окне.", "我爱北京天安门", "Ελληνικά κείμενα"],
                          ["Кошка сидит на окне.", "我爱北京天安门", "ελληνικά Κείμενα"], lengths=[5, 7, 4])
    assert all(same[f"sample_{key}"] == 1.0 for key in ROUGE_KEYS) and same["sample_exact_match"] == pytest.approx(2 / 3)
    part = sample_metrics(["我爱北京"], ["我爱北京天安门"], lengths=[4])
    assert part["sample_rouge1"] == pytest.approx(2 * 4 / (4 + 7))  # 4 of 7 characters: precision 1, recall 4/7


def test_rouge_keeps_the_marks_of_a_word_in_its_word() -> None:
    """Devanagari's vowel signs, Arabic's harakat and Hebrew's points are marks, not letters: words were split at
    them and the marks dropped, and "kutub accha ho" scored 1.0 against "kitaab acchi hai" in every ROUGE."""
    words = RougeWords()
    assert words.tokenize("किताब अच्छी है") == ["किताब", "अच्छी", "है"] and words.tokenize("مَكْتَبَة") == ["مَكْتَبَة"]
    assert words.tokenize("ภาษา ง่าย")[-3:] == ["ง่", "า", "ย"], "Thai: a character with its marks, as CJK"
    different = sample_metrics(["कुतूब अच्छा हो"], ["किताब अच्छी है"], lengths=[3])
    assert all(different[f"sample_{key}"] == 0.0 for key in ROUGE_KEYS)


def test_rouge_lsum_scores_a_multi_line_summary_sentence_by_sentence() -> None:
    """Summaries are written one sentence per line: rougeLsum matches each reference line on its own (the ROUGE
    that published summarization results report), rougeL the whole text as one sequence."""
    scores = sample_metrics(["the dog ran\nthe cat sat on the mat"], ["the cat sat on the mat\nthe dog ran"], [9])
    assert scores["sample_rougeLsum"] == 1.0 and scores["sample_rougeL"] == pytest.approx(6 / 9)
    # On one line, as T5's vocabulary writes every summary, sentences are split as run_summarization.py splits them
    # (rougeLsum equalled rougeL: 0.5 for run_summarization's 0.8333).
    one_line = sample_metrics(["Then the dog came. The cat sat on the mat."],
                              ["The cat sat on the mat. It was happy there. Then the dog came."], [11])
    assert one_line["sample_rougeL"] == pytest.approx(0.5) and one_line["sample_rougeLsum"] == pytest.approx(5 / 6)
    # Chinese, Hindi and Arabic full stops end a sentence too, with no space after them in Chinese: rougeLsum there
    # was rougeL (0.556 for two sentences swapped).
    for first, second in (("天气很好。", "我们去公园！"), ("यह अच्छा है। ", "वह भी॥"), ("هل هو جيد؟ ", "نعم ۔")):
        swapped = sample_metrics([first + second], [second.strip() + " " + first.strip()], [4])
        assert swapped["sample_rougeLsum"] == 1.0 and swapped["sample_rougeL"] < 1.0, (first, swapped)


def test_samples_stop_at_eos_or_the_templates_end_of_turn_never_at_a_cut_references_last_token(tiny) -> None:
    """An example cut to the block (--too_long truncate) ends its reference with an ordinary token, which must not
    stop every sample; the template's end-of-turn, which no reference may show, must."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = LLAMA3_TEMPLATE
    cut = Sample(prompt=[1, 5, 6], reference=[7, 8, 9])
    evaluator = SampleEvaluator([cut], tokenizer, CAUSAL, max_new_tokens=4, out_dir=Path("unused"))
    assert evaluator.stop_ids == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>")}


def test_sample_prompts_keep_a_templates_role_markers_and_texts_scored_do_not(tiny) -> None:
    """Llama-3's role markers are special tokens: decoded without them, the samples' prompts ran the roles into the
    text ("code.user def ..."); the generated text and the references, which ROUGE scores, stay without."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = LLAMA3_TEMPLATE
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "def f(): pass"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    evaluator = SampleEvaluator([Sample(prompt=ids, reference=ids)], tokenizer, CAUSAL, max_new_tokens=4,
                                out_dir=Path("unused"))
    assert evaluator.text(ids, special=True) == (
        "<|start_header_id|>user<|end_header_id|>\n\ndef f(): pass<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\n")
    assert "<|" not in evaluator.text(ids) and tokenizer.bos_token not in evaluator.text(ids, special=True)


def test_learning_rate_scaling_is_resolved_and_recorded(tiny, two_ranks) -> None:
    """sqrt(16 / 4) x 3e-3: the configuration records the value the run used."""
    config = yaml.safe_load((two_ranks / "config.yaml").read_text())
    assert config["lr"] == pytest.approx(6e-3) and config["min_lr"] == pytest.approx(6e-4)
    assert config["lr_scaling"] == "none"
    assert read_metrics(two_ranks)[3]["lr"] == pytest.approx(6e-4), "the cosine ends at the scaled --min_lr"


@pytest.mark.slow
def test_greedy_samples_under_fsdp_equal_transformers_generate_and_ranks_stop_at_different_lengths(
        tiny, packed, pretrained, tmp_path) -> None:
    data = load_data(packed)
    samples = data.format.samples(data.validation, 4)
    model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    greedy = [model.generate(torch.tensor([s.prompt]), max_new_tokens=10, do_sample=False)[0, len(s.prompt):].tolist()
              for s in samples]
    stop_id, expected = stop_where_lengths_differ(greedy)
    assert generate_through_the_application(tiny, packed, pretrained, stop_id, 4, 10, tmp_path) == expected


def test_a_ranks_samples_go_through_together_padded_with_the_tokens_each_gets_alone(packed, pretrained) -> None:
    """Every generated token is one forward, which under FSDP gathers every weight: a rank's prompts went one at a
    time, and its evaluation gathered the model once per token of every prompt. Padded on the left into one batch,
    they make as many forwards as their longest answer, give each prompt the greedy tokens it gets alone, and compute
    logits only at each row's last position."""
    from lightning_fabric import Fabric

    data = load_data(packed)
    samples = data.format.samples(data.validation, 4)
    assert len({len(sample.prompt) for sample in samples}) > 1, "prompts of different lengths, padded"
    model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    forwards, logit_rows = [], []
    model.register_forward_hook(lambda module, args, kwargs, output: forwards.append(1), with_kwargs=True)
    model.lm_head.register_forward_hook(lambda module, args, output: logit_rows.append(output.shape[1]))
    fabric = Fabric(accelerator="cpu", devices=1)

    def generate(budget: int) -> list[list[int]]:
        forwards.clear()
        return generate_samples(fabric, model, samples, decoding=CAUSAL, max_new_tokens=6, stop_ids={-1},
                                token_budget=budget)

    one_at_a_time = generate(0)
    assert len(forwards) == 4 * 6
    assert generate(4 * (max(len(sample.prompt) for sample in samples) + 6)) == one_at_a_time and len(forwards) == 6
    assert set(logit_rows) == {1}, "the last position's logits only"
    assert keeps_last_logits(fabric.setup_module(model)), "read through Fabric's wrapper, as a run holds the model"
    assert pads_apart(AutoConfig.from_pretrained(pretrained), "sdpa")


def test_generation_batches_fill_one_blocks_tokens_longest_prompts_first() -> None:
    """A run's budget is the tokens of one prompt of a whole block with its answer, which generation held alone
    before (the keys and values of an evaluation batch's tokens held 2.9 times validation's memory)."""
    from types import SimpleNamespace

    from app.training.run import samples_token_budget

    assert generation_batches([5, 30, 10, 28], max_new_tokens=2, token_budget=64) == [[1, 3], [2, 0]]
    assert generation_batches([5, 30, 10, 28], max_new_tokens=2, token_budget=0) == [[1], [3], [2], [0]]
    assert generation_batches([100], max_new_tokens=2, token_budget=64) == [[0]], "alone when even one is larger"
    assert generation_batches([30, 30], max_new_tokens=10, token_budget=64) == [[0], [1]], "answers count too"
    inputs = SimpleNamespace(samples_pad_apart=True, plan=SimpleNamespace(block_size=256))
    assert samples_token_budget(SimpleNamespace(eval_max_new_tokens=16), inputs) == 272
    unpadded = SimpleNamespace(samples_pad_apart=False, plan=inputs.plan)
    assert samples_token_budget(SimpleNamespace(eval_max_new_tokens=16), unpadded) == 0


def test_models_whose_logits_padding_changes_generate_one_prompt_at_a_time() -> None:
    """A state-space model reads the padding as text; GPT-2's learned positions need the padded rows' own."""
    from transformers import GPT2Config, MambaConfig

    from unittest import mock

    from app.evaluation import samples

    assert not pads_apart(MambaConfig(vocab_size=400, hidden_size=64, state_size=8, num_hidden_layers=2), "eager")
    assert pads_apart(GPT2Config(n_embd=64, n_layer=2, n_head=4), "eager")
    with mock.patch.object(samples, "two_tokens_logits", side_effect=TypeError("no attention_mask")):
        assert not pads_apart(GPT2Config(n_embd=64, n_layer=2, n_head=4), "eager"), "a forward refusing the padding"


def test_a_stop_signal_cuts_the_generation_of_samples_short_at_the_next_token(packed, pretrained) -> None:
    """Generation samples can take minutes at each evaluation, and a stop signal during them waited for their end:
    past a preemption's grace period. Each generated token's collective now carries the stop too, so every rank
    leaves at the same token."""
    from lightning_fabric import Fabric

    data = load_data(packed)
    model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    asked = []

    def stopping() -> bool:  # a signal arrives as the third token is generated
        asked.append(True)
        return len(asked) == 3

    with pytest.raises(EvaluationStopped):
        generate_samples(Fabric(accelerator="cpu", devices=1), model, data.format.samples(data.validation, 2),
                         decoding=CAUSAL, max_new_tokens=20, stop_ids={-1}, stopping=stopping)
    assert len(asked) == 3


def test_a_mixture_keeps_where_responses_lie_and_takes_a_folder_without_validation(tiny, pairs, tmp_path) -> None:
    """Samples of data whose prompts are trained come from the response spans prepare_data.py recorded; a mixture
    dropped them (an empty prompt, the whole example as the reference). And a last folder prepared with
    --val_fraction 0 ended the run at its first evaluation (IndexError)."""
    common = dict(input=[str(pairs)], prompt_field="code", response_field="summary", tokenizer=str(tiny.tokenizer),
                  block_size=BLOCK)
    prepare(PrepareArgs(**common, train_on_prompt=True, output_dir=str(tmp_path / "trained-prompts")))
    prepare(PrepareArgs(**common, val_fraction=0.0, output_dir=str(tmp_path / "replay")))
    alone = load_data(tmp_path / "trained-prompts")
    mixed = load_data(f"{tmp_path / 'trained-prompts'}:1,{tmp_path / 'replay'}:1")
    expected = alone.format.samples(alone.validation, 3)
    assert all(sample.prompt for sample in expected)
    assert mixed.format.samples(mixed.validation, 3) == expected
    assert list(mixed.validation_splits()) == ["trained-prompts"]


def test_prompts_are_cut_from_the_left_so_that_prompt_and_answer_fit_the_models_positions() -> None:
    """GPT-2's learned positions end at n_positions: a prompt of 502 tokens and 16 new ones in 512 positions ended the
    run at its evaluation. Encoder-decoders read their source whole."""
    from transformers import GPT2Config, T5Config

    samples = [Sample(prompt=list(range(502)), reference=[7]), Sample(prompt=[1, 2, 3], reference=[8])]
    cut = fit_to_context(samples, GPT2Config(n_positions=512), max_new_tokens=16)
    assert cut == [Sample(prompt=list(range(6, 502)), reference=[7]), samples[1]]
    assert fit_to_context(samples, T5Config(), max_new_tokens=16) == samples


def test_show_samples_prints_the_last_evaluations_samples_next_to_their_references(tmp_path) -> None:
    for step, answer in ((10, "an early answer"), (20, "Return the header.")):
        write_samples(tmp_path / "samples" / f"step-{step:08d}.jsonl", ["def parse_header(\n    line):"],
                      ["Return the header."], [answer])
    result = subprocess.run([sys.executable, "show_samples.py", str(tmp_path), "1"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:4] == [f"{tmp_path / 'samples' / 'step-00000020.jsonl'}:",
                                              "  prompt     def parse_header( line):",
                                              "  reference  Return the header.", "  generated  Return the header."]
    assert not list((tmp_path / "samples").glob(".*")), "written whole, under a temporary name then renamed"
    latest = tmp_path / "samples" / "step-00000020.jsonl"
    for text, problem in (('{"prompt": "def f(', "not readable as train.py's samples"),  # a JSONDecodeError traceback
                          ('{"text": "x"}\n', "not train.py's samples"), ("", "not train.py's samples"),
                          ('{"prompt": 1, "reference": null, "generated": "c"}\n', "not train.py's samples"),
                          ('{"prompt": "p", "reference": null, "generated": "c"}\n', "not train.py's samples")):
        latest.write_text(text)
        result = subprocess.run([sys.executable, "show_samples.py", str(tmp_path)], cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2 and result.stderr.startswith(f"show_samples.py: error: {latest}: {problem}"), \
            result.stderr
    result = subprocess.run([sys.executable, "show_samples.py", str(tmp_path / "nosuch")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"RUN {tmp_path / 'nosuch'}: no such folder" in result.stderr, result.stderr


def test_show_samples_prints_any_script_under_a_locale_that_cannot_encode_it(tmp_path) -> None:
    """Under a GBK or Latin-1 locale a Thai sample or an emoji was a UnicodeEncodeError traceback (exit 1)."""
    write_samples(tmp_path / "samples" / "step-00000010.jsonl", ["\u0e2a\u0e27\u0e31 caf\u00e9"], ["\U0001f44d"],
                  ["\u6211\ufffd\x07\x1b[2J"])  # an untrained model's BEL and a terminal's escape: shown, not run
    result = subprocess.run([sys.executable, "show_samples.py", str(tmp_path)], cwd=ROOT, capture_output=True,
                            timeout=60, env={**os.environ, "PYTHONIOENCODING": "latin-1"})
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode("latin-1").splitlines()[1:4] == [
        "  prompt     \\u0e2a\\u0e27\\u0e31 caf\u00e9", "  reference  \\U0001f44d",
        "  generated  \\u6211\\ufffd\\x07\\x1b[2J"]


def test_references_longer_than_the_generation_limit_are_named() -> None:
    """Their generations stop before they could match: ROUGE stays low for that alone, which nothing said."""
    from app.data.formats import Sample
    from app.evaluation.samples import references_past

    samples = [Sample(prompt=[1, 2], reference=list(range(n))) for n in (5, 13, 21, 12)]
    assert references_past(samples, 12) == (
        "note: 2 of the 4 sample references are longer than --eval_max_new_tokens 12 (the longest 21 tokens): their "
        "generations stop before they could match; raise it for scores that can reach them")
    assert references_past(samples, 21) is None
    closed = [Sample(prompt=[1, 2], reference=[*range(3, 15), 2])]  # 12 tokens of text and EOS
    assert references_past(closed, 12, stops={2}) is None and references_past(closed, 11, stops={2}) is not None


def test_samples_whose_references_were_cut_when_prepared_are_passed_over_and_said() -> None:
    """`--too_long truncate` cuts a response at the block: 7 of 20 validation samples of a code-summary run were
    scored against references like "E" (one token), and 100 samples asked of a split of 28 scored 28, unsaid."""
    from app.data.formats import Sample
    from app.evaluation.samples import sample_notes, whole_samples

    eos = 2
    candidates = [Sample([1, 5], [7, 8, eos]), Sample([1, 6], [9]), Sample([1, 7], [4, eos]), Sample([1, 8], [3, 3])]
    assert whole_samples(candidates, 2, {eos}) == ([candidates[0], candidates[2]], 1)
    assert whole_samples(candidates, 5, {eos}) == ([candidates[0], candidates[2]], 2)
    assert sample_notes(5, 2, 2) == [
        "note: --eval_samples passed over 2 validation examples whose references were cut when the data was prepared "
        "(--too_long truncate): no generation could match them",
        "note: --eval_samples 5: the validation split holds 2 whole examples to score"]
    # references that end with another turn end than the tokenizer's: nothing is taken for cut
    assert whole_samples(candidates, 3, {99}) == (candidates[:3], 0)
    endless = (Sample([1], [5]) for _ in iter(int, 1))  # a split of millions: found out within max(10 N, 1000)
    assert whole_samples(endless, 3, {eos}) == ([Sample([1], [5])] * 3, 0)
    assert sample_notes(3, 3, 0) == []
    assert sample_notes(3, 3, 0, cut_prompts=2) == [
        "note: --eval_samples: 2 prompts are cut from the left to leave --eval_max_new_tokens of the model's positions "
        "to the answer"], "a chat prompt so cut loses its header, unsaid"


def test_show_samples_shows_the_end_of_a_long_prompt_where_a_chat_asks_its_question() -> None:
    """The first 110 characters of a chat prompt were the template's header, never the question."""
    from app.evaluation.show import shortened

    prompt = "<|start_header_id|>user<|end_header_id|> " + "x = 1; " * 40 + "what does this do?<|eot_id|>"
    shown = shortened(prompt)
    assert len(shown) == 110 and shown.startswith("<|start_header_id|>") and shown.endswith("do?<|eot_id|>")
    assert shortened("def f(x):") == "def f(x):"



def test_show_samples_keeps_answers_of_several_lines_in_their_column_and_refuses_two_counts(tmp_path) -> None:
    """An answer of several lines (code) printed its later lines at the margin; `RUN 1 --count 2` showed 1 without a
    word; a samples file given as RUN was "no such folder"."""
    from app.cli import UsageError
    from app.evaluation.show import parse_show_args, show

    write_samples(tmp_path / "samples" / "step-00000004.jsonl", ["def f("], ["x):\n    return x"], ["y):\n    pass"])
    assert show(tmp_path, 1).splitlines()[2:6] == ["  reference  x):", "                 return x",
                                                  "  generated  y):", "                 pass"]
    for argv, problem in (([str(tmp_path), "1", "--count", "2"], "N 1 and --count 2: give one of them"),
                          ([str(tmp_path), "--count=0"], "--count 0: give at least 1"),
                          ([str(tmp_path), "0"], "N 0: give at least 1")):
        with pytest.raises(UsageError, match=problem):
            parse_show_args(argv)
    with pytest.raises(UsageError, match="a file; give the run's folder"):
        show(tmp_path / "samples" / "step-00000004.jsonl", 1)
    many = tmp_path / "many"
    write_samples(many / "samples" / "step-00000004.jsonl", ["def f("] * 3000, ["x"] * 3000, ["y"] * 3000)
    piped = subprocess.run(f"{sys.executable} show_samples.py {many} 3000 | head -1", shell=True, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)  # the reader closes the pipe early
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr


def test_a_longrope_answer_that_crosses_the_original_positions_computes_its_cache_again_as_transformers_does(
        ) -> None:
    """Past original_max_position_embeddings every position of a longrope model takes the long factors, and
    transformers' Phi-3 generation computes the cache of the positions before again: the samples kept it, and
    differed from the converted model's answers from the token that crossed it (the 8th of these)."""
    from lightning_fabric import Fabric
    from transformers import Phi3Config, Phi3ForCausalLM

    from app.evaluation.samples import decoding_for

    config = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                        original_max_position_embeddings=16,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                         "long_factor": [4.0] * 8})
    torch.manual_seed(1)
    model = Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for matrix in (parameter for parameter in model.parameters() if parameter.dim() > 1):
            matrix.mul_(4)
    prompt = list(range(10, 20))
    ours = generate_samples(Fabric(accelerator="cpu", devices=1), model, [Sample(prompt=prompt, reference=prompt)],
                            decoding=decoding_for(config), max_new_tokens=12, stop_ids={-1})[0]
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert ours == theirs, (ours, theirs)


def test_samples_of_a_state_space_model_step_with_its_own_cache() -> None:
    """Mamba's outputs carry `cache_params`, not `past_key_values`: --eval_samples ended such a run at its first
    evaluation with an AttributeError. Greedy tokens equal transformers' generate."""
    from lightning_fabric import Fabric
    from transformers import MambaConfig, MambaForCausalLM

    from app.evaluation.samples import generate_in_lockstep

    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(vocab_size=400, hidden_size=64, state_size=8, num_hidden_layers=2)).eval()
    with torch.no_grad():
        for matrix in (parameter for parameter in model.parameters() if parameter.dim() > 1):
            matrix.mul_(8)  # far from the initialisation: every token another
    prompt = [5, 9, 13, 2, 7]
    ours, = generate_in_lockstep(Fabric(accelerator="cpu", devices=1), model, [Sample(prompt=prompt, reference=prompt)],
                                 decoding=CAUSAL, max_new_tokens=6, stop_ids={-1})
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert ours == theirs and len(set(ours)) > 3, (ours, theirs)
