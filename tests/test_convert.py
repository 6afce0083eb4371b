"""convert_to_hf.py: checkpoints written by train.py become Hugging Face folders with the same logits."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import transformers
from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

import app.huggingface.convert as converter
from app.hub import hub_commit
from app.checkpoint.checksums import decode, encode, with_metadata
from app.exit_codes import EXIT_CORRUPT_CHECKPOINT
from app.huggingface.convert_cli import main as convert_main
from app.huggingface.generate import GenerateArgs, generate
from app.huggingface.generate_cli import main as generate_main
from app.huggingface.prefetch import main as prefetch_main
from tests.conftest import overwrite_in_place, read_checkpoint, run_entry, run_train, train_args
from tests.test_prepare_supervised import LLAMA3_TEMPLATE, SPECIAL_TOKENS

SHORT = dict(max_step=8, warmup_steps=2, eval_step_interval=4, save_step_interval=4)


def trained(tiny, out_dir: Path, **overrides: object) -> Path:
    result = run_train(train_args(tiny, out_dir, **SHORT, **overrides))
    assert result.returncode == 0, result.stderr[-3000:]
    return out_dir


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory) -> Path:
    return trained(tiny, tmp_path_factory.mktemp("full"))


@pytest.fixture(scope="module")
def sharded_run(tiny, tmp_path_factory) -> Path:
    return trained(tiny, tmp_path_factory.mktemp("sharded"), state_dict_type="sharded")


def earlier_checkpoint(run: Path, model: torch.nn.Module, step: int = 3, **metadata: object) -> Path:
    """A run folder holding one checkpoint of `model` in an earlier version's torch.save form, which conversion
    reads as it reads today's: any model and metadata in a second, without a train.py run."""
    path = run / "checkpoints" / f"step-{step:08d}.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "step": step, "epoch": 0, "model_config": model.config.to_dict(),
                "config": {}} | metadata, path)
    return run


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=64)


def trained_like(model_type: str, vocab_size: int) -> torch.nn.Module:
    """A tiny model whose every weight is far from what its initialisation draws (as training leaves them)."""
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **SMALL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for seed, parameter in enumerate(model.parameters()):
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(seed)) / 4)
    return model


def convert(*argv: object) -> None:
    convert_main([str(a) for a in argv])


def refused(capsys, *argv: object) -> str:
    with pytest.raises(SystemExit) as exit_info:
        convert(*argv)
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("convert_to_hf.py: error: "), errors
    assert errors[0].endswith("; see convert_to_hf.py --help"), errors
    return errors[0]


def probe() -> torch.Tensor:
    return torch.randint(400, (2, 24), generator=torch.Generator().manual_seed(1))


def reference_logits(tiny, checkpoint: Path) -> torch.Tensor:
    """Logits of transformers' own model holding the checkpoint's weights."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    model.load_state_dict(read_checkpoint(checkpoint)["model"])
    with torch.no_grad():
        return model.eval()(input_ids=probe()).logits


def test_float32_round_trip_gives_identical_logits_and_generates(tiny, full_run, tmp_path) -> None:
    convert("--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
    assert torch.equal(logits, reference_logits(tiny, full_run / "checkpoints" / "step-00000008.ckpt"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def load(path):\n    return json.loads(path.read_text())\n"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    generated = model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > 1


def test_the_generation_config_is_the_base_models_own_or_stops_at_the_tokenizers_eos(tiny, full_run,
                                                                                     tmp_path) -> None:
    """A model trained from scratch gets one from its config, stopping at EOS; one trained from a base model keeps
    the base's (sampling defaults, and an end-of-turn that only the generation config names, as Gemma's instruction
    models and Phi-3 keep theirs), with EOS added."""
    eos = AutoTokenizer.from_pretrained(tiny.tokenizer).eos_token_id
    convert("--checkpoint", full_run, "--output_dir", tmp_path / "scratch", "--dtype", "float32")
    assert json.loads((tmp_path / "scratch" / "generation_config.json").read_text())["eos_token_id"] == eos
    base = tmp_path / "base"
    AutoConfig.from_pretrained(tiny.model_config).save_pretrained(base)
    GenerationConfig(eos_token_id=[7], do_sample=True, temperature=0.6, top_p=0.9).save_pretrained(base)
    convert("--checkpoint", full_run, "--output_dir", tmp_path / "based", "--dtype", "float32", "--model_name", base)
    kept = json.loads((tmp_path / "based" / "generation_config.json").read_text())
    assert (kept["eos_token_id"], kept["do_sample"], kept["temperature"], kept["top_p"]) == ([7, eos], True, 0.6, 0.9)


def test_a_model_trained_from_a_config_is_written_with_its_tokenizers_bos_and_eos(tiny, tmp_path, capsys) -> None:
    """A config file's ids (here 5 and 6, pieces of the tokenizer's vocabulary) beside a tokenizer whose BOS and EOS
    are 1 and 2: config.json kept them and the converted model stopped generating at piece 6."""
    model = trained_like("llama", len(AutoTokenizer.from_pretrained(tiny.tokenizer)))
    model.config.bos_token_id, model.config.eos_token_id = 5, 6
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer))
    convert("--checkpoint", run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "convert_to_hf.py: note: the model config's special tokens are not the tokenizer's: bos_token_id 5 -> 1 " \
           "('<s>'), eos_token_id 6 -> 2 ('</s>') written to config.json and generation_config.json" \
           in capsys.readouterr().out


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_weights_come_through_unchanged(tiny, tmp_path, model_type) -> None:
    """Gemma's embedding owns a buffer no state dict holds (embed_scale); restoring it must not re-initialise the
    embedding (nor the lm_head tied to it)."""
    model = trained_like(model_type, len(AutoTokenizer.from_pretrained(tiny.tokenizer)))
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer))
    convert("--checkpoint", run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    trained = model.state_dict()
    assert written and all(torch.equal(tensor, trained[name]) for name, tensor in written.items())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=probe()).logits, model(input_ids=probe()).logits)


def test_a_folder_whose_tokenizer_autotokenizer_loads_as_another_class_is_refused(tiny, tmp_path, capsys) -> None:
    """transformers picks a qwen2 folder's tokenizer class itself (Qwen2Tokenizer), whatever tokenizer_config.json
    names: over the SentencePiece tokenizer that --vocab_size trains, it encoded every prompt otherwise, and the
    converted model, its weights and logits verified, generated blanks."""
    from types import SimpleNamespace

    from app.training.preflight.tokenizer import resolve_tokenizer

    model = trained_like("qwen2", len(AutoTokenizer.from_pretrained(tiny.tokenizer)))
    cfg = SimpleNamespace(tokenizer=str(tiny.tokenizer), train_data_dir=None, trust_remote_code=False, model_name=None,
                          model_config="config.json", init_from=None)
    resolve_tokenizer(cfg, model.config, [])  # said when training starts, not only hours later
    assert capsys.readouterr().out.startswith("convert_to_hf.py will refuse this run's checkpoints: the tokenizer of a "
                                              "converted folder, as AutoTokenizer loads it (as Qwen2Tokenizer")
    resolve_tokenizer(cfg, trained_like("llama", model.config.vocab_size).config, [])
    assert capsys.readouterr().out == ""
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer))
    with pytest.raises(SystemExit) as exit_info:
        convert("--checkpoint", run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    assert exit_info.value.code == 1 and not (tmp_path / "hf").exists()
    assert ("as AutoTokenizer loads it (as Qwen2Tokenizer: transformers picks that class for model type qwen2, "
            "whatever tokenizer_config.json names), encodes 'def load(path):\\n'... otherwise from token 3 on"
            ) in capsys.readouterr().err


@pytest.mark.parametrize("model_type, extra", [("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
                                               ("gpt_neox", dict(rotary_pct=0.25)),
                                               ("codegen", dict(rotary_dim=8, bos_token_id=1, eos_token_id=2))])
def test_architectures_that_transformers_writes_under_older_names_convert(tiny, tmp_path, model_type, extra) -> None:
    """transformers 5 writes Mixtral's fused experts one by one (block_sparse_moe.experts.N.w1) and GPT-NeoX's output
    layer as embed_out, renaming them back on loading; the weight check looked the checkpoint's names up in the files
    and refused every such conversion ("the checkpoint's model.layers.0.mlp.gate.weight is not in it"). CodeGen's
    config has no pad_token_id at all: the conversion ended in an AttributeError traceback."""
    config = AutoConfig.for_model(model_type, vocab_size=len(AutoTokenizer.from_pretrained(tiny.tokenizer)),
                                  **SMALL, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer))
    convert("--checkpoint", run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert reloaded.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=probe()).logits, model(input_ids=probe()).logits)


def test_a_mixture_of_experts_converts_to_bfloat16_though_rounding_flips_its_experts(tiny, tmp_path, capsys) -> None:
    """bf16's rounding changes which experts a Mixtral routes some tokens to; the logits were compared with those of
    the fp32 weights to 5e-2 of the largest, and this conversion was refused ("only to 4.5e-01"). They are now
    compared in the checkpoint's dtype, exactly, with those of the weights rounded to the written dtype."""
    config = AutoConfig.for_model("mixtral", vocab_size=len(AutoTokenizer.from_pretrained(tiny.tokenizer)), **SMALL,
                                  num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for matrix in (parameter for parameter in model.parameters() if parameter.dim() > 1):
            matrix.mul_(4)  # weights grown in training: larger activations, closer routing calls
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer))
    convert("--checkpoint", run, "--output_dir", tmp_path / "hf", "--dtype", "bfloat16")
    moved = re.search(r"verified \(max relative difference 0\.0e\+00; in bfloat16 the logits move by up to (\S+) ",
                      capsys.readouterr().out)
    assert moved and float(moved.group(1)) > 5e-2, "the case the old tolerance refused"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        converter.round_parameters(model, torch.bfloat16)
        assert torch.equal(reloaded(input_ids=probe()).logits, model(input_ids=probe()).logits)


def test_a_cast_is_verified_in_the_checkpoints_dtype_and_logits_beyond_the_written_dtype_are_refused(
        full_run, tmp_path, monkeypatch, capsys) -> None:
    """After a cast the folder, loaded in the checkpoint's dtype, must reproduce exactly the logits of the rounded
    weights (a config that changes them is caught as without a cast); in float16 logits that overflow are refused."""
    computed = []

    def changed(at: int, by: float):
        @torch.no_grad()
        def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
            computed.append(model)
            return model(input_ids=ids).logits.float() * (by if len(computed) == at else 1)
        return logits_of

    for at, by, said in ((4, 1.001, "reproduces the logits of"), (3, float("inf"), "in float16 the model's logits "
                                                                                  "are not finite")):
        computed.clear()
        monkeypatch.setattr(converter, "logits_of", changed(at, by))
        with pytest.raises(SystemExit) as exit_info:
            convert("--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--dtype", "float16")
        assert exit_info.value.code == 1 and not (tmp_path / "hf").exists()
        assert said in capsys.readouterr().err and len(computed) == at


def test_a_tensor_the_written_files_lack_fails_verification_even_when_loading_would_initialise_it_alike(
        tiny, tmp_path, monkeypatch, capsys) -> None:
    """A norm weight still at its initial ones, dropped from the written files: from_pretrained initialises it to
    ones again, so a check against the loaded model alone saw nothing missing ("weights and logits verified"),
    while loaders that need every tensor (vLLM, llama.cpp) fail on the folder."""
    from safetensors.torch import save_file
    from transformers import PreTrainedModel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config)).eval()
    assert torch.all(model.model.norm.weight == 1)
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer))
    save_pretrained = PreTrainedModel.save_pretrained

    def losing_the_norm(self, folder, *args, **kwargs):
        save_pretrained(self, folder, *args, **kwargs)
        written = load_file(Path(folder) / "model.safetensors")
        del written["model.norm.weight"]
        save_file(written, Path(folder) / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", losing_the_norm)
    with pytest.raises(SystemExit) as exit_info:
        convert("--checkpoint", run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    assert exit_info.value.code == 1 and not (tmp_path / "hf").exists()
    assert "loading it initialises model.norm.weight, which its files lack; nothing was written" in \
        capsys.readouterr().err


def test_a_weight_changed_while_building_the_model_fails_verification(tiny, tmp_path, monkeypatch, capsys) -> None:
    """The logits reference is the model built from the checkpoint, so a weight changed while building it (here:
    the buffers restored by re-initialising their whole module, as conversion once did) changes both logits; the
    written tensors are compared with the checkpoint's own and the conversion fails, leaving no folder."""
    model = trained_like("gemma", len(AutoTokenizer.from_pretrained(tiny.tokenizer)))
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer))

    def on_the_module_itself(model: torch.nn.Module, module: torch.nn.Module, names: list[str]) -> None:
        for name in names:
            module.register_buffer(name, torch.empty_like(module.get_buffer(name), device="cpu"), persistent=False)
        model._init_weights(module)

    monkeypatch.setattr(converter, "initialise_buffers", on_the_module_itself)
    with pytest.raises(SystemExit) as exit_info:
        convert("--checkpoint", run, "--output_dir", tmp_path / "hf", "--dtype", "bfloat16")
    assert exit_info.value.code == 1 and not (tmp_path / "hf").exists()
    assert "embed_tokens.weight differs from the checkpoint's" in capsys.readouterr().err


def test_generate_stops_at_an_end_of_turn_that_only_the_generation_config_names(tiny, tmp_path) -> None:
    """A chat model whose config's EOS is </s> and whose turns end with <|eot_id|>, named only in
    generation_config.json; its greedy answer reaches <|eot_id|> as its third token or so (two rows of its output
    layer swapped to make it): `python generate.py --chat true` stops there instead of at --max_new_tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = LLAMA3_TEMPLATE
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(tiny.model_config, vocab_size=len(tokenizer))).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "def f(x):"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    greedy = model.generate(**prompt, max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, prompt["input_ids"].shape[1]:].tolist()
    at = next(i for i in range(1, 8) if greedy[i] not in greedy[:i] and eot not in greedy[:i + 1])
    with torch.no_grad():
        head = model.lm_head.weight
        head[[greedy[at], eot]] = head[[eot, greedy[at]]]
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, eot])
    model.save_pretrained(tmp_path / "chat")
    tokenizer.save_pretrained(tmp_path / "chat")
    assert model.config.eos_token_id == tokenizer.eos_token_id != eot
    written = generate(GenerateArgs(str(tmp_path / "chat"), prompt="def f(x):", chat=True, temperature=0,
                                    max_new_tokens=12))
    assert written.endswith(f"({at + 1} new tokens, stopped at <|eot_id|>)"), written


def test_a_stop_token_forced_at_the_limit_is_the_limit_not_a_stop() -> None:
    """BART's generation config forces </s> into the last place --max_new_tokens leaves: generate.py said
    "stopped at </s>" for a model that never chose to stop."""
    from types import SimpleNamespace

    from app.huggingface.generate import why_it_stopped

    tokenizer = SimpleNamespace(convert_ids_to_tokens=lambda token: {2: "</s>"}[token])
    bart, llama = SimpleNamespace(eos_token_id=2, forced_eos_token_id=2), SimpleNamespace(eos_token_id=[2, 9])
    assert why_it_stopped([5, 6, 7, 2], bart, tokenizer, max_new_tokens=4) == "--max_new_tokens reached"
    assert why_it_stopped([5, 6, 2], bart, tokenizer, max_new_tokens=4) == "stopped at </s>"
    assert why_it_stopped([5, 6, 7, 2], llama, tokenizer, max_new_tokens=4) == "stopped at </s>"
    assert why_it_stopped([5, 6, 7, 8], llama, tokenizer, max_new_tokens=4) == "--max_new_tokens reached"


def test_bfloat16_conversion_is_within_tolerance(tiny, full_run, tmp_path, capsys) -> None:
    convert("--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--dtype", "bfloat16")
    assert re.search(r"weights and logits verified \(max relative difference 0\.0e\+00; in bfloat16 the logits move by "
                     r"up to \d\.\de-0[23] of the largest\)", capsys.readouterr().out)
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
    reference = reference_logits(tiny, full_run / "checkpoints" / "step-00000008.ckpt")
    assert ((logits - reference).abs().max() / reference.abs().max()).item() < 5e-2
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], "safetensors wrote its weights readable by no one else"


def test_sharded_checkpoint_converts_to_the_same_weights_as_the_full_one(full_run, sharded_run, tmp_path) -> None:
    assert (sharded_run / "checkpoints" / "step-00000008.ckpt").is_dir()
    convert("--checkpoint", full_run, "--output_dir", tmp_path / "full", "--dtype", "float32")
    convert("--checkpoint", sharded_run / "checkpoints" / "step-00000008.ckpt", "--output_dir", tmp_path / "sharded",
            "--dtype", "float32")
    full, sharded = (load_file(tmp_path / name / "model.safetensors") for name in ("full", "sharded"))
    assert full.keys() == sharded.keys() and all(torch.equal(full[k], sharded[k]) for k in full)


def test_model_card_records_origin_and_training(full_run, tmp_path) -> None:
    convert("--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    card = (tmp_path / "hf" / "README.md").read_text()
    checkpoint = read_checkpoint(full_run / "checkpoints" / "step-00000008.ckpt")
    assert "| Step | 8 (epoch 0) |" in card and f"{checkpoint['val_loss']:.4f}" in card
    assert "| lr | 0.003 |" in card and "trained from scratch" in card and "| Sequence length (tokens) | 32 |" in card
    assert "pipeline_tag: text-generation" in card
    assert "| Training data | data |" in card and str(full_run.parent.parent) not in card, "a user's paths, published"
    assert f"## Framework versions\n\n- torch {torch.__version__}\n- transformers {transformers.__version__}\n" in card


def test_the_base_model_folder_is_never_the_output_even_with_overwrite(tiny, tmp_path, capsys) -> None:
    """--overwrite true replaces a model folder, and the pretrained folder a run started from is one: converting
    into it by mistake deleted the base model."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    model.save_pretrained(tmp_path / "base")
    before = folder_digest(tmp_path / "base")
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer),
                             config={"model_name": str(tmp_path / "base")})
    capsys.readouterr()  # save_pretrained's progress bar
    assert "is the base model folder the run started from" in refused(
        capsys, "--checkpoint", run, "--output_dir", tmp_path / "base", "--overwrite", "true")
    assert folder_digest(tmp_path / "base") == before
    assert "give one of --model_name and --model_config" in refused(  # the generation config came from the other
        capsys, "--checkpoint", run, "--output_dir", tmp_path / "hf", "--model_name", tmp_path / "base",
        "--model_config", tiny.model_config)


def test_a_relative_base_model_is_read_where_training_ran_or_a_note_says_it_was_not(tiny, tmp_path, monkeypatch,
                                                                                     capsys) -> None:
    """A run records --model_name as typed: `base`, relative to where training ran. When the checkpoint records that
    folder (cwd), the base's generation config is read from there; when not, a note says what was used instead,
    and the card never names a path as a Hub model (base_model: is for owner/name ids)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    base = tmp_path / "where-training-ran" / "base"
    AutoConfig.from_pretrained(tiny.model_config).save_pretrained(base)
    GenerationConfig(eos_token_id=[7], do_sample=True, temperature=0.6).save_pretrained(base)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    eos = AutoTokenizer.from_pretrained(tiny.tokenizer).eos_token_id
    monkeypatch.chdir(tmp_path)
    run = earlier_checkpoint(tmp_path / "recorded", model, tokenizer=str(tiny.tokenizer),
                             config={"model_name": "base"}, cwd=str(base.parent))
    convert("--checkpoint", run, "--output_dir", "recorded-hf", "--dtype", "float32")
    assert json.loads((tmp_path / "recorded-hf" / "generation_config.json").read_text())["eos_token_id"] == [7, eos]
    card = (tmp_path / "recorded-hf" / "README.md").read_text()
    assert "| Base model | base (local folder) |" in card and "base_model:" not in card
    assert str(tmp_path) not in card, "the card is published: local paths show their last names only"
    capsys.readouterr()
    run = earlier_checkpoint(tmp_path / "unrecorded", model, tokenizer=str(tiny.tokenizer),
                             config={"model_name": "base"})
    convert("--checkpoint", run, "--output_dir", "unrecorded-hf", "--dtype", "float32")
    assert "note: the generation config of the base model base could not be read" in capsys.readouterr().out
    assert json.loads((tmp_path / "unrecorded-hf" / "generation_config.json").read_text())["eos_token_id"] == eos
    card = (tmp_path / "unrecorded-hf" / "README.md").read_text()
    assert "| Base model | base (not found from here" in card and "base_model:" not in card
    assert (converter.hub_id("me/base"), converter.hub_id("base"), converter.hub_id("../models/x")) == ("me/base",
                                                                                                       None, None)


def test_the_generation_config_and_card_are_the_revision_trained_when_main_has_moved(tiny, tmp_path, monkeypatch,
                                                                                      capsys) -> None:
    """A run from a Hub id records the commit it loaded; a later prefetch moved `main` to another commit, whose
    generation config (sampling on, another stop) was written beside the weights of the first, without a word. A
    cache folder given as --model_name (prefetch.py --revision's advice) was carded as a local folder, no base_model."""
    from transformers import AutoConfig as Config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--tiny"
    trained, later = "a" * 40, "b" * 40
    for commit, stops in ((trained, [7]), (later, [9])):
        Config.from_pretrained(tiny.model_config).save_pretrained(repo / "snapshots" / commit)
        GenerationConfig(eos_token_id=stops, do_sample=commit == later).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(later)
    assert hub_commit("org/tiny") == later, "what train.py records: the commit from_pretrained reads"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    eos = AutoTokenizer.from_pretrained(tiny.tokenizer).eos_token_id
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer), config={"model_name": "org/tiny"},
                             base_revision=trained)
    convert("--checkpoint", run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    written = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (written["eos_token_id"], written.get("do_sample", False)) == ([7, eos], False)
    card = (tmp_path / "hf" / "README.md").read_text()
    assert f"| Base model | org/tiny (revision {trained}) |" in card and "base_model: org/tiny" in card
    # a run started from that run's checkpoint (--init_from) keeps its base model: stop tokens, sampling, the card
    from app.training.preflight import inherited_base
    from app.training.preflight.resume import ChosenCheckpoint

    first = tmp_path / "run1" / "checkpoints" / "step-00000004.ckpt"
    assert inherited_base(ChosenCheckpoint(first, {"config": {"model_name": "org/tiny"}, "base_revision": trained})) \
        == {"base_model": "org/tiny", "base_revision": trained}
    run = earlier_checkpoint(tmp_path / "phase-2", model, tokenizer=str(tiny.tokenizer), base_model="org/tiny",
                             base_revision=trained, config={"init_from": str(first)})
    convert("--checkpoint", run, "--output_dir", tmp_path / "phase-2-hf", "--dtype", "float32")
    assert json.loads((tmp_path / "phase-2-hf" / "generation_config.json").read_text())["eos_token_id"] == [7, eos]
    assert (f"| Base model | org/tiny (revision {trained}), continued from the train.py checkpoint step-00000004.ckpt "
            "of run run1 |") in (tmp_path / "phase-2-hf" / "README.md").read_text()
    (repo / "snapshots" / trained / "generation_config.json").unlink()  # many repositories have none
    capsys.readouterr()
    convert("--checkpoint", run, "--output_dir", tmp_path / "none-hf", "--dtype", "float32")
    said = capsys.readouterr().out
    assert "is neither cached nor on the Hub" not in said and "generation config of the base model org/tiny could " \
        "not be read" in said, "the revision is here, without a generation config: one note, that one"
    run = earlier_checkpoint(tmp_path / "folder-run", model, tokenizer=str(tiny.tokenizer),
                             config={"model_name": str(repo / "snapshots" / trained)}, versions={"torch": "0.0-test"})
    convert("--checkpoint", run, "--output_dir", tmp_path / "folder-hf", "--dtype", "float32")
    card = (tmp_path / "folder-hf" / "README.md").read_text()
    assert f"| Base model | org/tiny (revision {trained}) |" in card and "base_model: org/tiny" in card
    assert "## Framework versions\n\n- torch 0.0-test\n" in card, "the versions that trained it, not converted it"


def test_the_card_reports_the_checkpoints_global_batch() -> None:
    """After a resume with another layout the run's config and the checkpoint disagree: the checkpoint's counts."""
    run = {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "devices": 2, "num_nodes": 1}
    assert dict(converter.hyperparameters(run, 32))["batch (sequences per step)"] == 32
    assert dict(converter.hyperparameters(run))["batch (sequences per step)"].startswith("4 per device")
    assert "lr decay" not in dict(converter.hyperparameters(run | {"lr_decay": True}))  # the usual cosine
    wsd = run | {"lr_decay": True, "lr_decay_type": "sqrt", "lr_decay_ratio": 0.2}
    assert dict(converter.hyperparameters(wsd))["lr decay"] == "sqrt over the last 0.2 of the steps"
    overridden = dict(converter.hyperparameters(run | {"model_overrides": {"max_position_embeddings": 32768}}))
    assert overridden["model config overrides"] == '{"max_position_embeddings": 32768}'
    assert dict(converter.hyperparameters(run | {"max_tokens": 2 * 10**9}))["max_tokens"] == 2 * 10**9
    assert "max_tokens" not in dict(converter.hyperparameters(run | {"max_tokens": None}))
    linear = run | {"lr_decay": True, "lr_decay_type": "linear", "lr_decay_ratio": 1.0}
    assert dict(converter.hyperparameters(linear))["lr decay"] == "linear over the last 1 of the steps"


def test_all_converts_every_checkpoint_of_a_run(full_run, tmp_path) -> None:
    convert("--checkpoint", full_run / "checkpoints", "--all", "true", "--output_dir", tmp_path / "all",
            "--dtype", "float32")
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["step-00000004", "step-00000008"]
    generate_main([str(tmp_path / "all" / "step-00000008"), "--prompt", "def", "--max_new_tokens", "2"])
    # it was refused as "a train.py checkpoint or run folder" for its name


def test_overwrite_replaces_an_earlier_conversion(full_run, tmp_path, capsys) -> None:
    """What --overwrite true is for: converting again into the same model folder (other folders are refused)."""
    convert("--checkpoint", full_run / "checkpoints" / "step-00000004.ckpt", "--output_dir", tmp_path / "hf")
    convert("--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--overwrite", "true")
    assert "step-00000008.ckpt" in (tmp_path / "hf" / "README.md").read_text()
    (tmp_path / "linked").symlink_to(tmp_path / "hf")  # a model folder linked to other storage stays linked
    convert("--checkpoint", full_run / "checkpoints" / "step-00000004.ckpt", "--output_dir", tmp_path / "linked",
            "--overwrite", "true")
    assert (tmp_path / "linked").is_symlink() and "step-00000004.ckpt" in (tmp_path / "hf" / "README.md").read_text()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf", "linked"], "staging folders left behind"
    (tmp_path / "hf" / "NOTES.txt").write_text("mine")  # deleted with the folder, and myrun/ with all it held
    (tmp_path / "hf" / "original").mkdir()
    assert refused(capsys, "--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--overwrite", "true") == (
        f"convert_to_hf.py: error: --output_dir {tmp_path / 'hf'}: --overwrite true would also delete NOTES.txt, "
        "original, which a conversion does not write; move them out of it, or choose another folder; see "
        "convert_to_hf.py --help")


def test_an_output_dir_on_read_only_storage_is_one_line_before_any_work(full_run, read_only_folder, capsys) -> None:
    """The staging folder's mkdir came before the storage errors were turned into one line: a traceback."""
    assert refused(capsys, "--checkpoint", full_run, "--output_dir", read_only_folder / "hf") == (
        f"convert_to_hf.py: error: --output_dir {read_only_folder / 'hf'}: {read_only_folder} is not writable; "
        "choose a folder you can write to; see convert_to_hf.py --help")


def folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(path.name.encode() + (path.read_bytes() if path.is_file() else b""))
    return digest.hexdigest()


def test_the_model_card_gives_the_step_its_validation_loss_was_measured_at() -> None:
    """A checkpoint saved at a stop (or between evaluations) carries the last loss measured, once the base model's
    step-0 loss, shown as the fine-tuned model's."""
    assert converter.validation_row(6.41398, 0, 9) == "6.4140 at step 0 (not evaluated at step 9)"
    assert converter.validation_row(3.2, 8, 8) == "3.2000"
    assert converter.validation_row(None, None, 8) == "not evaluated"


def test_a_truncated_checkpoint_or_a_missing_rank_file_is_one_line_and_writes_nothing(full_run, sharded_run, tiny,
                                                                                     tmp_path, capsys) -> None:
    """Their headers read well: the tensors' bytes are first read while writing the model, where a ValueError or a
    FileNotFoundError ended the conversion in a traceback (exit 1). A resume from them started every rank, which
    each ended in that traceback: the preflight now refuses them from the files' sizes."""
    truncated = tmp_path / "step-00000008.ckpt"
    data = (full_run / "checkpoints" / "step-00000008.ckpt").read_bytes()
    truncated.write_bytes(data[:len(data) // 5])  # the model comes first, then the optimizer state
    assert refused(capsys, "--checkpoint", truncated, "--output_dir", tmp_path / "hf").startswith(
        f"convert_to_hf.py: error: --checkpoint {truncated} ended early: the checkpoint is truncated; pick another")
    incomplete = tmp_path / "sharded" / "step-00000008.ckpt"
    shutil.copytree(sharded_run / "checkpoints" / "step-00000008.ckpt", incomplete)
    rank_file = incomplete / "__1_0.distcp"  # the second rank's pieces
    rank_file.unlink()
    assert refused(capsys, "--checkpoint", incomplete, "--output_dir", tmp_path / "hf").startswith(
        f"convert_to_hf.py: error: --checkpoint {rank_file} is missing: the checkpoint is incomplete; pick another")
    cut = tmp_path / "cut" / "step-00000008.ckpt"
    shutil.copytree(sharded_run / "checkpoints" / "step-00000008.ckpt", cut)
    os.truncate(cut / "__0_0.distcp", 20_000)  # a BadZipFile traceback from the middle of the conversion
    assert refused(capsys, "--checkpoint", cut, "--output_dir", tmp_path / "hf").startswith(
        f"convert_to_hf.py: error: --checkpoint {cut / '__0_0.distcp'} ended early: the checkpoint is truncated")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cut", "sharded", "step-00000008.ckpt"]
    for checkpoint, problem in [(truncated, "step-00000008.ckpt ended early: the checkpoint is truncated"),
                                (incomplete, "step-00000008.ckpt/__1_0.distcp is missing: the checkpoint is incomplete")]:
        resumed = run_train(train_args(tiny, tmp_path / "resumed", **SHORT | {"max_step": 12}, resume=True,
                                       checkpoint=checkpoint))  # every rank read to that piece, then a traceback
        assert (resumed.returncode, resumed.stderr.strip()) == (
            2, f"error: --checkpoint {checkpoint}: {problem}; pick another one"), resumed.stderr[-2000:]


def test_a_resume_passes_over_a_newest_checkpoint_that_does_not_read_whole_and_what_failed_saves_left(
        sharded_run, tiny, tmp_path) -> None:
    """Checkpoints are published by a rename once written, so one that does not read whole is the storage's doing:
    a requeued job stopped at it (exit 2, naming a --checkpoint it was not given). A failed save's leftover (a full
    disk) stayed until the next save, its space counted as used by the preflight, which refused the resume."""
    run = tmp_path / "run"
    shutil.copytree(sharded_run, run)
    os.truncate(run / "checkpoints" / "step-00000008.ckpt" / "__1_0.distcp", 1_000)
    leftover = run / "checkpoints" / ".step-00000012.ckpt.partial"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(bytes(10_000))
    resumed = run_train(train_args(tiny, run, **SHORT | {"max_step": 5, "save_step_interval": 0}, resume=True,
                                   state_dict_type="sharded"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("--resume true: step-00000008.ckpt (step-00000008.ckpt/__1_0.distcp ended early: the checkpoint is "
            "truncated); continuing from step-00000004.ckpt, the newest checkpoint that reads whole") in resumed.stdout
    assert (run / "checkpoints" / "rolled-back" / "step-00000008.ckpt").is_dir(), "set aside, not deleted"
    assert not leftover.exists(), "removed as the run starts, with no save to come"


def test_bytes_changed_in_place_are_found_by_their_checksums_at_conversion_and_resume(full_run, sharded_run, tiny,
                                                                                      tmp_path, capsys) -> None:
    """Sizes say nothing of the bytes: a checkpoint whose embeddings were zeroed resumed at a loss of 5.99 where the
    run stood at 4.31, and converted with "logits verified" (against itself). Each piece a rank writes is recorded
    with its checksum, and checked as it is read."""
    name = "model.model.embed_tokens.weight"
    for kind, run in (("full", full_run), ("sharded", sharded_run)):
        copy = tmp_path / kind
        shutil.copytree(run, copy)
        changed = overwrite_in_place(copy / "checkpoints" / "step-00000008.ckpt", name)
        error = refused(capsys, "--checkpoint", copy, "--output_dir", tmp_path / f"hf-{kind}")
        assert error.startswith(f"convert_to_hf.py: error: --checkpoint {changed}: elements 0 to ") and (
            f"of {name} are not the bytes that were saved (their checksum differs): the checkpoint is corrupt; "
            "pick another one") in error, error
        assert not (tmp_path / f"hf-{kind}").exists()
    # --resume true chose it: moved aside (exit 8, which the Slurm scripts requeue), the next attempt resumes from
    # the one before it (a requeued job stopped at it with exit 2 every time)
    resume = train_args(tiny, tmp_path / "sharded", **SHORT | {"max_step": 12}, resume=True, state_dict_type="sharded")
    resumed = run_train(resume)
    checkpoints = tmp_path / "sharded" / "checkpoints"
    assert resumed.returncode == EXIT_CORRUPT_CHECKPOINT, resumed.stderr[-3000:]
    assert resumed.stderr.count("the checkpoint is corrupt") == 1, resumed.stderr[-3000:]
    assert resumed.stderr.strip().endswith(
        f"moved it to {checkpoints / 'rolled-back' / 'step-00000008.ckpt'}: run the same command again to resume from "
        f"the checkpoint before it (the newest: {checkpoints / 'step-00000004.ckpt'}); the Slurm scripts requeue")
    again = run_train(resume)
    assert again.returncode == 0 and "resumed from" in again.stdout and "step-00000004.ckpt at step 4" in again.stdout
    # named by --checkpoint: the user's, refused and left where it is
    named = checkpoints / "rolled-back" / "step-00000008.ckpt"
    refused_resume = run_train(train_args(tiny, tmp_path / "named", **SHORT | {"max_step": 12}, resume=True,
                                          checkpoint=named))
    assert refused_resume.returncode == 2 and named.is_dir(), refused_resume.stderr[-3000:]
    assert "resume from an earlier checkpoint with --checkpoint" in refused_resume.stderr


def test_bad_inputs_are_refused_in_one_line_and_touch_nothing(full_run, sharded_run, tiny, tmp_path, capsys) -> None:
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    before = folder_digest(existing)
    corrupt = tmp_path / "step-00000001.ckpt"
    corrupt.write_bytes(b"not a checkpoint")
    wider = tmp_path / "wider"
    AutoConfig.from_pretrained(tiny.model_config, hidden_size=96).save_pretrained(wider)
    good = full_run / "checkpoints" / "step-00000008.ckpt"
    out = tmp_path / "out"
    unsafe = tmp_path / "step-00000002.ckpt"
    unsafe.mkdir()
    model_config = AutoConfig.from_pretrained(tiny.model_config).to_dict()
    (unsafe / "training.json").write_text(json.dumps({"step": 2, "model_config": model_config}))
    (unsafe / ".metadata").write_bytes(f"cos\nsystem\n(S'touch {tmp_path / 'ran'}'\ntR.".encode())
    assert "no such file" in refused(capsys, "--checkpoint", tmp_path / "missing.ckpt", "--output_dir", out)
    assert "not a readable checkpoint" in refused(capsys, "--checkpoint", corrupt, "--output_dir", out)
    message = refused(capsys, "--checkpoint", unsafe, "--output_dir", out)
    assert "os.system is not what a checkpoint's metadata holds" in message and not (tmp_path / "ran").exists()
    message = refused(capsys, "--checkpoint", good, "--output_dir", out, "--model_config", wider)
    assert "model.embed_tokens.weight of shape (400, 64)" in message and "(400, 96)" in message
    assert "is not empty" in refused(capsys, "--checkpoint", good, "--output_dir", existing)
    data_before = folder_digest(tiny.data)
    for folder in (existing, tiny.data):  # a folder of the user's, a data folder: --overwrite would delete them
        assert "--overwrite true replaces only an empty folder or a model folder" in refused(
            capsys, "--checkpoint", good, "--output_dir", folder, "--overwrite", "true")
    assert folder_digest(tiny.data) == data_before
    assert "--dtype" in refused(capsys, "--checkpoint", good, "--output_dir", out, "--dtype", "int8")
    assert refused(capsys, "--checkpoint", good, "--output_dir", out, "--max_shard_size", "5G").startswith(
        "convert_to_hf.py: error: --max_shard_size 5G: not a size in TB, GB, MB or KB")  # was: after the whole work
    no_config = tmp_path / "no-config" / "step-00000008.ckpt"  # one that recorded none: a TypeError traceback
    shutil.copytree(sharded_run / "checkpoints" / "step-00000008.ckpt", no_config)
    training = json.dumps(json.loads((no_config / "training.json").read_text()) | {"model_config": None})
    (no_config / "training.json").write_text(training)
    table = decode((no_config / "checksums.json").read_text())  # as such a checkpoint records it
    (no_config / "checksums.json").write_text(encode(with_metadata(table, training)))
    assert refused(capsys, "--checkpoint", no_config, "--output_dir", out).startswith(
        f"convert_to_hf.py: error: --checkpoint {no_config}: its model_config cannot be loaded")
    assert folder_digest(existing) == before and not out.exists()


def test_an_output_dir_over_the_checkpoint_or_its_run_is_refused_even_with_overwrite(tiny, tmp_path, monkeypatch,
                                                                                    capsys) -> None:
    """--overwrite replaces --output_dir, so one that is or holds the checkpoint or its run folder, or lies inside
    the checkpoint or checkpoints/, would delete them: refused, compared as resolved paths (relative, through a
    link), and nothing is touched. A folder inside the run folder beside checkpoints/ deletes nothing: accepted."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    run = earlier_checkpoint(tmp_path / "runs" / "x", model, tokenizer=str(tiny.tokenizer))
    checkpoint = run / "checkpoints" / "step-00000003.ckpt"
    (tmp_path / "link").symlink_to(run)
    before = folder_digest(tmp_path / "runs")
    monkeypatch.chdir(run)
    cases = {".": "is the run folder", tmp_path / "link": "is the run folder", "checkpoints": "holds the checkpoint",
             tmp_path / "runs": "holds the checkpoint", "checkpoints/hf": "lies inside the run's checkpoints folder",
             checkpoint: "is the checkpoint", tmp_path / "link" / "checkpoints" / "step-00000003.ckpt" / "hf":
             "lies inside the checkpoint"}
    for output, relation in cases.items():
        assert relation in refused(capsys, "--checkpoint", checkpoint, "--output_dir", output, "--overwrite", "true")
    message = refused(capsys, "--checkpoint", run, "--all", "true", "--output_dir", "checkpoints",
                      "--overwrite", "true")
    assert "step-00000003 lies inside the run's checkpoints folder" in message
    assert folder_digest(tmp_path / "runs") == before
    convert("--checkpoint", checkpoint, "--output_dir", "hf", "--dtype", "float32")
    assert (run / "hf" / "model.safetensors").is_file() and checkpoint.is_file()


def test_an_architecture_given_at_conversion_must_be_the_one_trained(tiny, tmp_path, capsys) -> None:
    """Shapes fitting is not enough: a tie would replace the trained lm_head with the embedding, another rope_theta
    or rms_norm_eps changes the model, and the logits check, run on the model so built, cannot tell. Fields that
    change neither weights nor logits (generation's token ids) may change."""
    model = trained_like("llama", len(AutoTokenizer.from_pretrained(tiny.tokenizer)))
    run = earlier_checkpoint(tmp_path / "run", model, tokenizer=str(tiny.tokenizer))
    configs = {}
    rope = {"rope_type": "default", "rope_theta": 5e5}
    for name, change in {"tied": dict(tie_word_embeddings=True), "eos": dict(eos_token_id=5),
                         "rope": dict(rms_norm_eps=1e-5, rope_parameters=rope)}.items():
        configs[name] = tmp_path / name
        AutoConfig.for_model(**(model.config.to_dict() | change)).save_pretrained(configs[name])
    out = tmp_path / "hf"
    message = refused(capsys, "--checkpoint", run, "--output_dir", out, "--model_config", configs["tied"])
    assert "in tie_word_embeddings (False -> True): it would change the trained model" in message
    message = refused(capsys, "--checkpoint", run, "--output_dir", out, "--model_name", configs["rope"])
    assert "rms_norm_eps (1e-06 -> 1e-05), rope_parameters (" in message and "drop --model_name" in message
    unrecorded = earlier_checkpoint(tmp_path / "unrecorded", model, tokenizer=str(tiny.tokenizer), model_config=None)
    message = refused(capsys, "--checkpoint", unrecorded, "--output_dir", out, "--model_config", configs["tied"])
    assert "ties lm_head.weight and model.embed_tokens.weight, but --checkpoint" in message and not out.exists()
    convert("--checkpoint", run, "--output_dir", out, "--model_config", configs["eos"], "--dtype", "float32")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 5


def test_cli_refusal_has_no_traceback(tmp_path) -> None:
    result = run_entry(["convert_to_hf.py", "--checkpoint", str(tmp_path / "none"), "--output_dir",
                        str(tmp_path / "out")])
    assert result.returncode == 2 and "Traceback" not in result.stderr and "--checkpoint" in result.stderr


def test_push_uploads_through_huggingface_hub_without_leaking_the_token(full_run, tmp_path, monkeypatch, capsys) -> None:
    token = "hf_secretTOKEN1234567890"
    monkeypatch.setenv("HF_TOKEN", token)
    calls = {}
    in_repo = ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "chat_template.jinja", "notes.md", ".gitattributes", "step-4/model.safetensors",
               "adapter/adapter_model.safetensors", "onnx/model.bin", "x/chat_template.jinja", "odd[1]*.bin"]
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.setdefault("create", (repo_id, kw)))
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, **kw: in_repo)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: calls.setdefault("upload", kw) and "commit-url")
    convert("--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--dtype", "float32",
            "--push_to_hub", "me/tiny", "--private", "true", "--commit_message", "first")
    assert calls["create"] == ("me/tiny", {"private": True, "exist_ok": True})
    assert calls["upload"]["repo_id"] == "me/tiny" and Path(calls["upload"]["folder_path"]) == tmp_path / "hf"
    assert calls["upload"]["commit_message"] == "first"
    # matched as huggingface_hub matches them (_prepare_folder_deletions)
    deleted = filter_repo_objects(in_repo, allow_patterns=calls["upload"]["delete_patterns"])
    assert list(deleted) == ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                             "pytorch_model.bin", "chat_template.jinja", "odd[1]*.bin"], \
        "an earlier push's top-level weights go (in another sharding they were what loaded); subfolders stay"
    output = capsys.readouterr()
    assert token not in output.out + output.err
    assert all(token.encode() not in p.read_bytes() for p in (tmp_path / "hf").iterdir())


def test_an_upload_that_fails_keeps_the_verified_folder_and_says_how_to_push_it(full_run, tmp_path, monkeypatch,
                                                                                capsys) -> None:
    """The Hub unreachable after the conversion: one line and exit 1, not a traceback that hides the verified folder."""
    from app.huggingface.prefetch import TransportError

    def unreachable(self, repo_id, **kw):
        raise TransportError("[Errno -2] Name or service not known")

    monkeypatch.setenv("HF_TOKEN", "hf_secretTOKEN1234567890")
    monkeypatch.setattr(HfApi, "create_repo", unreachable)
    with pytest.raises(SystemExit) as exit_info:
        convert("--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--dtype", "float32",
                "--push_to_hub", "me/tiny", "--private", "true", "--revision", "dev")
    assert exit_info.value.code == 1
    errors = capsys.readouterr().err
    (line,) = [line for line in errors.splitlines() if "error" in line.lower()]
    assert "Traceback" not in errors
    assert line.startswith("convert_to_hf.py: error: --push_to_hub me/tiny: cannot reach") and \
        line.endswith(f"The verified folder {tmp_path / 'hf'} is kept: push it without converting again with "
                      f"`hf upload me/tiny {tmp_path / 'hf'} --private --revision dev --commit-message "
                      "'Upload hf'`, then delete the repository's top-level weights of an earlier push that the "
                      "folder does not hold"), line  # as asked: without --private, hf upload may make a public
    # repository; not `--delete '*.safetensors'`, which deletes every subfolder's weights too
    assert "prefetch.py" not in line, "prefetch.py downloads: nothing to do with an upload"
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert "Writing model shards" not in errors and "Loading weights" not in errors, "progress bars in a log"


def test_a_push_with_hf_hub_offline_is_refused_before_the_conversion(full_run, tmp_path, monkeypatch, capsys) -> None:
    """Compute nodes are told to set HF_HUB_OFFLINE=1: the push failed in a traceback after the whole conversion."""
    monkeypatch.setenv("HF_TOKEN", "hf_secretTOKEN1234567890")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert refused(capsys, "--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--push_to_hub", "me/tiny") \
        .startswith("convert_to_hf.py: error: --push_to_hub me/tiny: HF_HUB_OFFLINE is set, so nothing can be uploaded")
    assert not (tmp_path / "hf").exists()


def test_a_push_to_a_malformed_repo_id_is_refused_before_the_conversion(full_run, tmp_path, capsys) -> None:
    """huggingface_hub refused "not a repo//x" only when uploading: after the whole conversion, with exit 1."""
    line = refused(capsys, "--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--push_to_hub", "not a repo//x",
                   "--dry_run", "true")
    assert line == ("convert_to_hf.py: error: --push_to_hub not a repo//x: not a Hub id; expected owner/name (or a "
                    "name of your own account); see convert_to_hf.py --help")
    assert not (tmp_path / "hf").exists()


def test_dry_run_lists_the_files_and_sends_nothing(full_run, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: pytest.fail("dry run uploaded"))
    convert("--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--dtype", "float32",
            "--push_to_hub", "me/tiny", "--dry_run", "true")
    listing = capsys.readouterr().out
    assert "would upload to me/tiny" in listing and "model.safetensors" in listing and "config.json" in listing


def test_a_run_converts_on_its_own_once_its_data_folder_moved(tiny, moved_run, tmp_path, capsys) -> None:
    """The checkpoint records the tokenizer's path only; the run keeps a copy in out_dir/tokenizer/, which the
    converter takes once that path is gone. It failed with "--tokenizer .../node-a/data/tokenizer: cannot load it",
    blaming a flag the user never gave."""
    assert read_checkpoint(moved_run.out_dir / "checkpoints" / "step-00000002.ckpt")["tokenizer"] == str(
        moved_run.trained_on / "tokenizer")
    run = tmp_path / "run"
    shutil.copytree(moved_run.out_dir, run)
    convert("--checkpoint", run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    written, prepared = (AutoTokenizer.from_pretrained(path) for path in (tmp_path / "hf", tiny.tokenizer))
    assert written.get_vocab() == prepared.get_vocab()
    capsys.readouterr()
    shutil.rmtree(run / "tokenizer")
    assert refused(capsys, "--checkpoint", run, "--output_dir", tmp_path / "hf2").endswith(
        f"the run's tokenizer {moved_run.trained_on / 'tokenizer'} no longer exists and {run / 'tokenizer'} has "
        "none; give --tokenizer PATH; see convert_to_hf.py --help")


def test_a_copied_checkpoint_whose_run_tokenizer_is_gone_is_refused_not_given_the_base_models(tiny, tmp_path) -> None:
    """A checkpoint copied out of its run, its data folder gone: the base model's tokenizer was taken without a word,
    and a chat run's converted model lost its chat template and the end of turn it stops at. The base model's is
    the run's own only when the run recorded no other."""
    copied = tmp_path / "step-00000002.ckpt"
    gone = tmp_path / "gone" / "tokenizer"
    run = {"model_name": str(tiny.tokenizer), "train_data_dir": str(tmp_path / "gone")}
    args = converter.Args(checkpoint=str(copied), output_dir=str(tmp_path / "hf"))
    with pytest.raises(converter.BadInput, match=f"the run's tokenizer {gone} no longer exists and the checkpoint "
                                                  "lies in no run folder"):
        converter.resolve_tokenizer(args, {"tokenizer": str(gone), "config": run}, copied)
    assert converter.resolve_tokenizer(args, {"tokenizer": None, "config": run}, copied) == str(tiny.tokenizer)


def test_a_tokenizer_already_in_out_dir_is_never_replaced_by_another(tiny, moved_run, tmp_path, capfd) -> None:
    from app.training.preflight import preflight
    from arguments import parse_config

    run = tmp_path / "run"
    shutil.copytree(moved_run.out_dir, run)
    other = AutoTokenizer.from_pretrained(tiny.tokenizer)
    other.add_special_tokens({"additional_special_tokens": ["<|other|>"]})
    shutil.rmtree(run / "tokenizer")
    other.save_pretrained(run / "tokenizer")
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, run, train_data_dir=moved_run.data, tokenizer=None, resume=True)))
    assert exit_info.value.code == 2
    assert f"{run / 'tokenizer'} is not the run's tokenizer" in capfd.readouterr().err
    assert "<|other|>" in AutoTokenizer.from_pretrained(run / "tokenizer").get_vocab(), "left as it was"


def test_generate_keeps_the_first_space_of_a_continuation_under_a_tokenizer_that_strips_it(tiny, tmp_path) -> None:
    """Llama-2's, Mistral's and CodeLlama's tokenizers strip a leading space when decoding: the new tokens decoded
    alone printed `def parse(is` where the model wrote `def parse( is`. Its greedy first token is made `▁is` (two
    rows of its output layer swapped)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer, add_prefix_space=True)
    spaced = tokenizer.convert_tokens_to_ids("▁is")
    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(tiny.model_config)).eval()
    prompt = tokenizer("def parse(", return_tensors="pt")
    first = model.generate(**prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1].item()
    with torch.no_grad():
        model.lm_head.weight[[first, spaced]] = model.lm_head.weight[[spaced, first]]
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    output = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[0]
    assert output[prompt["input_ids"].shape[1]].item() == spaced
    assert not tokenizer.decode(output[prompt["input_ids"].shape[1]:]).startswith(" "), "the tokenizer strips it"
    written = generate(GenerateArgs(str(tmp_path / "model"), prompt="def parse(", temperature=0, max_new_tokens=6))
    assert written.splitlines()[0] == tokenizer.decode(output, skip_special_tokens=True)
    assert written.startswith("def parse( is")


def test_generate_refuses_chat_for_a_model_without_a_chat_template_in_one_line(tiny, tmp_path, capsys) -> None:
    """`generate.py MODEL --chat true` on a model whose tokenizer has no chat template ended in transformers'
    ValueError traceback, exit 1."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    model.save_pretrained(tmp_path / "plain")
    AutoTokenizer.from_pretrained(tiny.tokenizer).save_pretrained(tmp_path / "plain")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(tmp_path / "plain"), "--chat", "true"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"generate.py: error: MODEL {tmp_path / 'plain'} has no chat template; drop --chat; see generate.py --help"]
    model.save_pretrained(tmp_path / "weights-only")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        generate_main([str(tmp_path / "weights-only")])
    assert capsys.readouterr().err.startswith(  # was transformers' "Couldn't instantiate the backend tokenizer"
        f"generate.py: error: MODEL {tmp_path / 'weights-only'} has none (no tokenizer.json")


def test_generate_keeps_special_token_text_in_a_prompt_as_text_as_training_did(tiny) -> None:
    """`x = "</s>"` in a prompt became an end of sequence in its middle, which no training example holds
    (prepare_data.py splits special-token text, and sanitises it in chats): the answers changed."""
    from app.huggingface.generate import model_input
    from app.prepare.tokenizer import encode_texts

    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    config = AutoConfig.from_pretrained(tiny.model_config)
    prompt = 'x = "</s>"'
    plain = model_input(tokenizer, prompt, False, config)["input_ids"][0].tolist()
    assert plain == encode_texts(tokenizer, [prompt], [])[0] and tokenizer.eos_token_id not in plain
    chat = model_input(tokenizer, prompt, True, config)["input_ids"][0].tolist()
    assert tokenizer.eos_token_id not in chat


def test_generate_refuses_weights_it_cannot_load_an_empty_prompt_and_a_missing_gpu_in_one_line(tiny, tmp_path,
                                                                                                 capsys) -> None:
    """A folder whose model.safetensors was cut short (an interrupted copy) or is missing ended in a SafetensorError
    or OSError traceback; an empty prompt under a tokenizer without BOS in a reshape RuntimeError."""
    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny.tokenizer, add_bos_token=False).save_pretrained(folder)

    def refusal(*argv: str) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            generate_main([str(folder), *argv])
        assert exit_info.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        return line

    assert refusal("--prompt", "") == ("generate.py: error: --prompt is empty and the tokenizer adds no BOS token to "
                                       "begin with: give some text; see generate.py --help")
    if not torch.cuda.is_available():
        assert "--device cuda: no CUDA GPU is visible here; give --device cpu" in refusal("--device", "cuda")
    for device in ("gpu0", "mps", "meta"):  # mps and meta: a RuntimeError traceback
        assert f"--device {device}: not a device generate.py runs on; give auto, cpu, cuda or cuda:N" in refusal(
            "--device", device)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert refusal("--max_new_tokens", "8").startswith(f"generate.py: error: MODEL {folder}: its weights do not load (")
    weights.unlink()
    assert refusal("--max_new_tokens", "8").startswith(f"generate.py: error: MODEL {folder}: its weights do not load (")


def test_generate_says_what_to_do_with_a_run_a_checkpoint_or_a_data_folder(full_run, tiny, capsys) -> None:
    """transformers' reasons ("Couldn't instantiate the backend tokenizer", "not a valid JSON file") said nothing
    of converting first."""
    checkpoint = full_run / "checkpoints" / "step-00000008.ckpt"
    for given in (full_run, checkpoint):
        with pytest.raises(SystemExit):
            generate_main([str(given)])
        assert capsys.readouterr().err.startswith(
            f"generate.py: error: MODEL {given} is a train.py checkpoint or run folder: convert it first (python "
            f"convert_to_hf.py --checkpoint {given} --output_dir DIR), then give DIR")
    convert = f"python convert_to_hf.py --checkpoint {full_run}"
    for given, message in ((full_run / "checkpoints", f"is a train.py checkpoint folder or run folder: convert it "
                                                      f"first ({convert} "),
                           (full_run / "checkpoints" / ".step-00000010.ckpt.partial", "is what a checkpoint save left "
                            f"unfinished; convert a finished checkpoint ({convert} --output_dir DIR takes the "
                            "latest)")):
        given.mkdir(exist_ok=True)  # each was "Should have a model_type key in its config.json"
        with pytest.raises(SystemExit):
            generate_main([str(given)])
        assert capsys.readouterr().err.startswith(f"generate.py: error: MODEL {given} {message}")
    (full_run / "checkpoints" / ".step-00000010.ckpt.partial").rmdir()
    with pytest.raises(SystemExit):
        generate_main([str(tiny.data)])
    assert f"MODEL {tiny.data} is a prepared data folder" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, message", [
    ("--max_new_tokens", "0", "--max_new_tokens must be at least 1, got 0"),
    ("--max_source_length", "0", "--max_source_length must be at least 1, got 0"),
    ("--temperature", "-1", "--temperature must be 0 (greedy) or at least 0.0001, got -1.0"),
    ("--seed", str(2**64), f"--seed {2**64} must be between 0 and 4294967295"),  # was numpy's OverflowError
    ("--prompt", "caf\udce9", "--prompt is not UTF-8 text (byte '\\udce9' at character 3); give it in UTF-8"),
])
def test_generate_refuses_numbers_generate_cannot_take_in_one_line(tmp_path, capsys, option, value, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(tmp_path), option, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"generate.py: error: {message}; see generate.py --help"


@pytest.mark.parametrize("main, heading", [(generate_main, "Generation:"), (prefetch_main, "Repositories:")])
def test_help_groups_are_named_like_the_other_commands(main, heading, capsys) -> None:
    """A dataclass without a docstring showed its generated signature as the help group's heading."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    help_text = capsys.readouterr().out
    assert exit_info.value.code == 0 and f"\n{heading}\n" in help_text and "Args(" not in help_text, help_text


def test_a_tokenizer_that_encodes_otherwise_is_refused_another_chat_template_is_not(full_run, tiny, tmp_path,
                                                                                       capsys) -> None:
    """Of the same size as the run's, another vocabulary passed the size check and the logits verified (they do not
    involve the tokenizer): the converted model generated blank lines. A chat template of the user's is a choice."""
    good = full_run / "checkpoints" / "step-00000008.ckpt"
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny.tokenizer, swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    assert len(AutoTokenizer.from_pretrained(swapped)) == len(AutoTokenizer.from_pretrained(tiny.tokenizer))
    message = refused(capsys, "--checkpoint", good, "--output_dir", tmp_path / "out", "--tokenizer", swapped)
    assert f"--tokenizer {swapped} is not the tokenizer the run trained with" in message, message
    assert "(its vocabulary differs)" in message and not (tmp_path / "out").exists()
    templated = AutoTokenizer.from_pretrained(tiny.tokenizer)
    templated.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    templated.save_pretrained(tmp_path / "templated")
    convert("--checkpoint", good, "--output_dir", tmp_path / "out", "--tokenizer", tmp_path / "templated",
            "--dtype", "float32")
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == templated.chat_template


def test_a_model_tokenizer_or_config_that_cannot_be_had_is_one_line_at_once(full_run, tmp_path, capsys,
                                                                              monkeypatch) -> None:
    """Offline, transformers waited out a minute of the Hub's retries (12 "Retrying in Ns" lines) before the line,
    and a missing --model_config folder was answered with a rule about repository names."""
    from app import hub

    hub.hub_reachable.cache_clear()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    good = full_run / "checkpoints" / "step-00000008.ckpt"
    for flag, name, expected in (("--tokenizer", "meta-llama/Meta-Llama-3-8B", "no Hub model of that name in the "
                                  "Hugging Face cache, while HF_HUB_OFFLINE is set"),
                                 ("--model_name", "nosuch/model", "python prefetch.py --model nosuch/model"),
                                 ("--model_config", str(tmp_path / "nonexistent" / "cfg"), "no such folder")):
        message = refused(capsys, "--checkpoint", good, "--output_dir", tmp_path / "out", flag, name)
        assert message.startswith(f"convert_to_hf.py: error: {flag} {name}: ") and expected in message, message
    hub.hub_reachable.cache_clear()


def test_the_uploads_options_without_push_to_hub_are_refused_not_ignored(full_run, tmp_path, capsys) -> None:
    """--dry_run without --push_to_hub converted the whole model; --private, --revision and --commit_message did
    nothing."""
    good = full_run / "checkpoints" / "step-00000008.ckpt"
    message = refused(capsys, "--checkpoint", good, "--output_dir", tmp_path / "out", "--dry_run", "true")
    assert message.startswith("convert_to_hf.py: error: --dry_run applies to an upload: add --push_to_hub REPO_ID")
    message = refused(capsys, "--checkpoint", good, "--output_dir", tmp_path / "out", "--private", "true",
                      "--revision", "v2")
    assert "--private and --revision apply to an upload" in message and not (tmp_path / "out").exists()


def test_a_model_config_that_ships_code_runs_none_of_it_without_trust_remote_code(full_run, tmp_path, capsys,
                                                                                  monkeypatch) -> None:
    """AutoConfig was asked without the flag, so transformers asked "Do you wish to run the custom code? [y/N]" and a
    "y" (typed, or piped by `yes |`) ran the folder's Python."""
    marker = tmp_path / "ran"
    remote = tmp_path / "remote"
    remote.mkdir()
    shipped = {"model_type": "shipped", "auto_map": {"AutoConfig": "configuration_shipped.ShippedConfig"}}
    (remote / "config.json").write_text(json.dumps(shipped))
    (remote / "configuration_shipped.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nfrom transformers import PretrainedConfig\n\n\n"
        "class ShippedConfig(PretrainedConfig):\n    model_type = 'shipped'\n")
    monkeypatch.setattr("builtins.input", lambda *args: "y")  # a user who answers the prompt
    good = full_run / "checkpoints" / "step-00000008.ckpt"
    for flag in ("--model_config", "--model_name"):
        message = refused(capsys, "--checkpoint", good, "--output_dir", tmp_path / "out", flag, remote)
        assert "runs only with --trust_remote_code true" in message, message
    assert not marker.exists(), "the folder's code ran"


def test_a_folder_whose_logits_differ_from_the_checkpoints_is_not_written(full_run, tmp_path, monkeypatch,
                                                                          capsys) -> None:
    """The logit check is what catches a config that changes the logits with every tensor intact (rope_theta, the
    attention): switched off, every test still passed. Here the written folder's logits are made to differ."""
    computed = []

    @torch.no_grad()
    def second_differs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        computed.append(model)
        logits = model(input_ids=ids).logits.float()
        return logits + 1e-3 if len(computed) == 2 else logits

    monkeypatch.setattr(converter, "logits_of", second_differs)
    with pytest.raises(SystemExit) as exit_info:
        convert("--checkpoint", full_run, "--output_dir", tmp_path / "hf", "--dtype", "float32")
    error = capsys.readouterr().err
    assert exit_info.value.code == 1 and not (tmp_path / "hf").exists(), error
    assert f"verification failed: {tmp_path / 'hf'} reproduces the logits of" in error and "(allowed 0e+00)" in error


def test_an_output_disk_that_refuses_the_model_is_one_line_and_leaves_nothing(full_run, tmp_path, capsys) -> None:
    """A full disk (here a file size limit: EFBIG, as a quota's or a full disk's ENOSPC) ended in safetensors'
    traceback."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        error = refused(capsys, "--checkpoint", full_run / "checkpoints" / "step-00000008.ckpt",
                        "--output_dir", tmp_path / "hf")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert error.startswith(f"convert_to_hf.py: error: --output_dir {tmp_path / 'hf'}: the model could not be "
                            "written (") and "nothing was written: make room, then run again" in error, error
    assert sorted(os.listdir(tmp_path)) == [], "no folder, no staging leftover"


def test_a_checkpoint_that_vanishes_as_it_is_opened_is_missing_not_a_traceback(tmp_path) -> None:
    """convert_to_hf.py on the folder of a run still saving: its --keep_last_n pruned the checkpoint after the
    conversion had planned from it, and the reopening ended in a FileNotFoundError traceback (3 tries in 4)."""
    from app.checkpoint.sources import CheckpointError, open_source

    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'step-00000008.ckpt'} is missing: the checkpoint is "):
        with open_source(tmp_path / "step-00000008.ckpt"):
            pass


@pytest.mark.slow
def test_ctrl_c_while_converting_is_one_line_130_and_leaves_nothing(full_run, tmp_path) -> None:
    """Ctrl-C gave some 50 lines of chained tracebacks (KeyboardInterrupt, then a BufferError from closing the
    checkpoint's read buffer) and exit 1, which a wrapper takes for a failed conversion."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT, run_environment

    out = tmp_path / "hf"
    process = subprocess.Popen([sys.executable, str(ROOT / "convert_to_hf.py"), "--checkpoint",
                                str(full_run / "checkpoints" / "step-00000008.ckpt"), "--output_dir", str(out)],
                               cwd=ROOT, env=run_environment(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not [path for path in tmp_path.iterdir() if path.name.startswith(".hf.partial-")]:
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert (process.returncode, stderr) == (130, f"convert_to_hf.py: stopped by SIGINT; {out} holds a model folder "
                                                 "only where one was written and verified whole (the one being "
                                                 "written is removed)\n")
    assert list(tmp_path.iterdir()) == [], "no folder, no staging leftover"


@pytest.mark.parametrize("status", [401, 403])
def test_a_push_the_hub_refuses_names_the_token_not_a_retry(status) -> None:
    """A read-only or invalid token, or a namespace the token cannot write to, was "try again later"."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    from app.huggingface.prefetch import describe_hub_error

    response = httpx.Response(status, request=httpx.Request("POST", "https://huggingface.co/api/repos/create"))
    line = describe_hub_error("--push_to_hub", "me/x", HfHubHTTPError("refused", response=response), upload=True)
    assert line == (f"--push_to_hub me/x: the Hub refused the token (HTTP {status}): this needs a write token "
                    "(HF_TOKEN) with rights to that namespace")


def test_a_stop_during_the_push_says_the_folder_is_kept_and_how_to_push_it(full_run, tmp_path) -> None:
    """Ctrl-C while the Hub took the upload said only that the output holds verified folders: nothing said the push
    had not happened, nor how to push without converting again (the rerun is refused for the folder that exists).
    Here a Hub that accepts and never answers."""
    import signal
    import socket
    import subprocess
    import sys

    from tests.conftest import ROOT

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    env = {**os.environ, "HF_TOKEN": "hf_" + "x" * 34, "HF_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
           "HF_HUB_OFFLINE": "0"}
    started = subprocess.Popen([sys.executable, str(ROOT / "convert_to_hf.py"), "--checkpoint", str(full_run),
                                "--output_dir", str(tmp_path / "hf"), "--push_to_hub", "me/tiny"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert started.stdout is not None
    for line in started.stdout:  # verified and published: the push comes next
        if "weights and logits verified" in line:
            break
    silent.settimeout(60)
    pushing, _ = silent.accept()  # the push asks the Hub
    started.send_signal(signal.SIGINT)
    _, err = started.communicate(timeout=60)
    pushing.close()
    silent.close()
    assert started.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith(
        f"convert_to_hf.py: stopped by SIGINT; the verified folder {tmp_path / 'hf'} is kept, but not pushed (or in "
        f"part): push it without converting again with `hf upload me/tiny {tmp_path / 'hf'} --commit-message"), err


def test_a_run_folder_says_when_its_best_checkpoint_or_an_unfinished_save_is_not_the_one_converted(tmp_path,
                                                                                                 capsys) -> None:
    """`--checkpoint RUN` converts the latest checkpoint: the run's best by validation loss (best.json), and a later
    save that never finished (its .partial left by a kill), went unmentioned."""
    from app.huggingface.convert import note_other_checkpoints

    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for step in (4, 6):
        (folder / f"step-{step:08d}.ckpt").write_bytes(b"")
    (folder / "best.json").write_text(json.dumps({"checkpoint": "step-00000004.ckpt", "step": 4, "val_loss": 2.5}))
    (folder / ".step-00000008.ckpt.partial").write_bytes(b"")
    note_other_checkpoints(folder, 6)
    assert capsys.readouterr().out.splitlines() == [
        "convert_to_hf.py: note: converting the latest checkpoint (step 6); the run's best by validation loss is step "
        f"4 (val_loss 2.5000, best.json): give --checkpoint {folder / 'step-00000004.ckpt'} to convert it",
        "convert_to_hf.py: note: the save of step 8 did not finish (a .partial file is left): the latest whole "
        "checkpoint is step 6"]
    (folder / "best.json").write_text(json.dumps({"checkpoint": "step-00000006.ckpt", "step": 6, "val_loss": 2.4}))
    (folder / ".step-00000008.ckpt.partial").unlink()
    note_other_checkpoints(folder, 6)
    assert capsys.readouterr().out == ""
