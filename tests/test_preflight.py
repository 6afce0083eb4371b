"""Preflight: every bad input is refused before any worker starts, all at once, one line each, nothing touched."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from app.training.preflight import preflight
from app.training.preflight.environment import world_size
from arguments import parse_config
from tests.conftest import TinySetup, interpreter, run_environment, run_script, train_args


def digest(folder: Path) -> str:
    hashed = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        hashed.update(str(path.relative_to(folder)).encode() + (path.read_bytes() if path.is_file() else b""))
    return hashed.hexdigest()


@pytest.fixture(scope="module")
def bad(tiny: TinySetup, tmp_path_factory) -> dict[str, Path]:
    """Broken inputs of every kind, and a run folder with a checkpoint that must survive every refusal."""
    root = tmp_path_factory.mktemp("bad")
    splits = datasets.load_from_disk(str(tiny.data))
    datasets.DatasetDict({"train": splits["train"]}).save_to_disk(str(root / "no_validation"))
    text = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict({"train": text, "validation": text}).save_to_disk(str(root / "no_input_ids"))
    ragged = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [1, 2]]})
    datasets.DatasetDict({"train": ragged, "validation": ragged}).save_to_disk(str(root / "ragged"))
    examples = datasets.Dataset.from_dict({"input_ids": [[1, 5, 6, 2]], "labels": [[-100, -100, 6, 2]]})
    for name, stats in {"supervised_without_stats": None, "stats_of_a_list": "[]",
                        "stats_of_another_format": '{"format": "images"}', "stats_without_format": '{"x": 1}'}.items():
        datasets.DatasetDict({"train": examples, "validation": examples}).save_to_disk(str(root / name))
        if stats is not None:
            (root / name / "stats.json").write_text(stats)
    datasets.DatasetDict({"train": splits["train"].select(range(0)), "validation": splits["validation"]}).save_to_disk(
        str(root / "empty_train"))  # a selection of no rows, saved as it is: datasets' reader ends in an IndexError
    shutil.copytree(tiny.data, root / "cut_short")
    arrow = min((root / "cut_short" / "train").glob("data-*.arrow"))  # not a cache file another test left beside it
    arrow.write_bytes(arrow.read_bytes()[:5000])  # a copy interrupted
    config = json.loads((tiny.model_config / "config.json").read_text()) | {"num_attention_heads": 3}
    (root / "three_heads").mkdir()
    (root / "three_heads" / "config.json").write_text(json.dumps(config))  # 64 wide: no multiple of 3
    for name, changes in {"short_positions": {"max_position_embeddings": 16}, "small_vocab": {"vocab_size": 100},
                          "wider": {"hidden_size": 96}}.items():
        AutoConfig.from_pretrained(tiny.model_config, **changes).save_pretrained(root / name)
    AutoConfig.for_model("bart", d_model=768, encoder_attention_heads=12, decoder_attention_heads=12, encoder_layers=1,
                         decoder_layers=1, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=512,
                         max_position_embeddings=64).save_pretrained(root / "bart_base_heads")
    AutoConfig.for_model("gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512).save_pretrained(root / "gemma2")
    AutoConfig.for_model("jetmoe", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                         kv_channels=16, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64,
                         vocab_size=512).save_pretrained(root / "jetmoe")
    AutoConfig.for_model("bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=512).save_pretrained(root / "bert")  # an encoder, built as a causal LM
    (root / "corrupt.ckpt").write_bytes(b"\x80\x04 not a checkpoint")
    torch.save({"step": 4, "model_config": AutoConfig.from_pretrained(root / "wider").to_dict()},
               root / "other_model.ckpt")
    torch.save({"step": 4, "model_config": AutoConfig.from_pretrained(tiny.model_config, hidden_act="gelu").to_dict()},
               root / "other_activation.ckpt")
    run = root / "run" / "checkpoints"
    run.mkdir(parents=True)
    torch.save({"step": 4, "model_config": AutoConfig.from_pretrained(tiny.model_config).to_dict()},
               run / "step-00000004.ckpt")
    retokenized = root / "retokenized_run"  # a run whose kept tokenizer gives two tokens each other's ids
    (retokenized / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "step-00000004.ckpt", retokenized / "checkpoints")
    shutil.copytree(tiny.tokenizer, retokenized / "tokenizer")
    vocabulary = json.loads((retokenized / "tokenizer" / "tokenizer.json").read_text())
    ids = vocabulary["model"]["vocab"]
    last, before_last = sorted(ids, key=ids.get)[-2:][::-1]
    ids[last], ids[before_last] = ids[before_last], ids[last]
    (retokenized / "tokenizer" / "tokenizer.json").write_text(json.dumps(vocabulary))
    torch.save({"step": 4, "model_config": AutoConfig.from_pretrained(tiny.model_config).to_dict(),
                "tokenizer": str(retokenized / "tokenizer")}, root / "lone_checkpoint.ckpt")
    (root / "a_file").write_text("not a folder")
    (root / "nest" / "checkpoints").mkdir(parents=True)
    (root / "earlier_run" / "samples").mkdir(parents=True)  # a run that saved no checkpoint, or a user's folder
    for name in ("config.yaml", "metrics.csv", "samples/step-00000004.jsonl"):
        (root / "earlier_run" / name).write_text("kept\n")
    metadata = json.dumps({"step": 4, "model_config": AutoConfig.from_pretrained(tiny.model_config).to_dict()})
    for name, pickled in {"unsafe_folder": b"cos\nsystem\n(S'true'\ntR.", "truncated_folder": b"\x80\x04\x95"}.items():
        (root / name).mkdir()
        (root / name / "training.json").write_text(metadata)
        (root / name / ".metadata").write_bytes(pickled)
    return {path.stem: path for path in root.iterdir()}


CASES = {
    "missing data": (dict(train_data_dir="/nonexistent/data"), "--train_data_dir /nonexistent/data: no such folder"),
    "a weight that is no number": (dict(train_data_dir="{ragged}:abc"), "--train_data_dir {ragged}:abc: no such "
                                   "folder; create it with prepare_data.py (a weight is a number: 'abc' is not one)"),
    "no validation split": (dict(train_data_dir="{no_validation}"), "missing split(s) validation"),
    "no input_ids": (dict(train_data_dir="{no_input_ids}"), "has no rows of input_ids (text data; columns: ['text'])"),
    "ragged rows": (dict(train_data_dir="{ragged}"), "rows have different lengths"),
    # trained as text blocks, prompts and all, without a word:
    "supervised data without stats.json": (dict(train_data_dir="{supervised_without_stats}"),
                                           "would be read as text blocks (it has no stats.json), but its labels say it "
                                           "holds supervised or seq2seq examples"),
    "supervised data whose stats.json names no format": (dict(train_data_dir="{stats_without_format}"),
                                                         "would be read as text blocks (its stats.json names no other "
                                                         "format), but its labels say"),
    "a data file cut short": (dict(train_data_dir="{cut_short}"), "its dataset files cannot be read ("),
    "a config transformers refuses": (dict(model_config="{three_heads}"),
                                      "cannot load its config (Class validation error for validator "
                                      "'validate_architecture': ValueError: The hidden size (64) is not a multiple of "
                                      "the number of attention heads (3)); fix its config.json"),
    "a split saved without a file": (dict(train_data_dir="{empty_train}"), "a split of it holds no data file"),
    # tracebacks (AttributeError, KeyError):
    "stats.json of a list": (dict(train_data_dir="{stats_of_a_list}"), "its stats.json is not a JSON object; prepare "
                             "it again with prepare_data.py"),
    "stats.json of another format": (dict(train_data_dir="{stats_of_another_format}"),
                                     "its stats.json names the format 'images', not one of text, text_documents, "
                                     "supervised_packed"),
    "blocks too long": (dict(model_config="{short_positions}"), "exceed the model's max_position_embeddings (16); "
                        "prepare the data with a smaller --block_size, or raise max_position_embeddings "
                        "(--model_overrides) where the model's RoPE scaling covers them"),
    "an override of no field": (dict(model_overrides='{{"rope_thet": 1e6}}'),
                                "--model_overrides: rope_thet: not a field of the llama config; its fields: "),
    "an override the config refuses": (dict(model_overrides='{{"rope_parameters": {{"rope_type": "yarn"}}}}'),
                                       "--model_overrides: the llama config refuses them (\"Missing required keys in "
                                       "`rope_parameters` for 'rope_type'='yarn': {{'factor'}}\")"),
    "an override of values that do not go together": (dict(model_overrides='{{"num_attention_heads": 3}}'),
                                                       "--model_overrides: the llama config refuses them ("),
    "an eval_only run into a run's folder": (dict(out_dir="{earlier_run}", eval_only=True),
                                             "earlier_run already holds config.yaml, metrics.csv, "
                                             "samples/step-00000004.jsonl, which --eval_only true would replace with "
                                             "its metrics.csv and summary.json; give it an --out_dir of its own"),
    "an override that reshapes pretrained weights": (
        dict(model_config=None, init_from="{run}", model_overrides='{{"intermediate_size": 256}}'),
        "--model_overrides changes the weights of --init_from {run}/checkpoints/step-00000004.ckpt "
        "(model.layers.0.mlp.gate_proj.weight (128, 64) -> (256, 64) and more: a shape, or a weight tied or untied), "
        "which load only as they are"),
    "an override that ties a checkpoint's weights": (
        dict(model_config=None, init_from="{run}", model_overrides='{{"tie_word_embeddings": true}}'),
        "--model_overrides changes the weights of --init_from {run}/checkpoints/step-00000004.ckpt (lm_head.weight: "),
    "an override the model's code refuses": (dict(model_overrides='{{"hidden_act": "nonexistent"}}'),
                                             "--model_overrides: the llama config refuses them ("),
    "an override the model cannot run with": (dict(model_overrides='{{"num_key_value_heads": 3}}'),
                                              "--model_overrides: the llama model does not run with them ("),
    "ids beyond vocab": (dict(model_config="{small_vocab}", tokenizer=None), "but the model's vocab_size is 100"),
    "missing model config": (dict(model_config="/nonexistent/config"), "--model_config /nonexistent/config"),
    "missing tokenizer": (dict(tokenizer="/nonexistent/tokenizer"), "--tokenizer /nonexistent/tokenizer"),
    "unknown wrap class": (dict(auto_wrap_policy="[GPT2Block]"),
                           "its layer classes: LlamaDecoderLayer; its other classes: LlamaAttention"),
    "global batch": (dict(global_batch_size=12, gradient_accumulation_steps=None), "--global_batch_size 12"),
    "data below one step": (dict(micro_batch_size=400), "fewer than one optimizer step"),
    "warmup beyond the epochs": (dict(max_step=None, warmup_steps=10000), "--warmup_steps (10000) exceeds the run's"),
    "warmup beyond the token budget": (dict(max_step=None, max_tokens=1024, warmup_steps=10),
                                       "--warmup_steps (10) exceeds the run's 2 optimizer steps (--max_tokens 1,024 at "
                                       "512 tokens per step): lower it, or give a larger --max_tokens"),
    "a profile after the run": (dict(profile_steps="25:26"), "--profile_steps 25:26: the run ends at step 24; give "
                                                             "steps up to it"),
    "missing checkpoint": (dict(resume=True, checkpoint="/nonexistent.ckpt"), "--checkpoint /nonexistent.ckpt"),
    "corrupt checkpoint": (dict(resume=True, checkpoint="{corrupt}"), "not a readable checkpoint"),
    "other model's checkpoint": (dict(resume=True, checkpoint="{other_model}"), "is from a different model"),
    "checkpoint of another config of the same shapes": (dict(resume=True, checkpoint="{other_activation}"),
                                                        "was trained with another config than --model_config "),
    "sharded folder that would run code": (dict(resume=True, checkpoint="{unsafe_folder}"),
                                           "os.system is not what a checkpoint's metadata holds; pick another one"),
    "sharded folder cut short": (dict(resume=True, checkpoint="{truncated_folder}"),
                                 ".metadata: not readable (UnpicklingError): the folder is incomplete; pick another"),
    "out_dir is a file": (dict(out_dir="{a_file}"), "is a file; give a folder"),
    "a data file for the data folder": (dict(train_data_dir="{a_file}"),  # it said "no such folder"
                                        "a file, not the folder prepare_data.py writes; create it with prepare_data"),
    "out_dir inside a file": (dict(out_dir="{a_file}/run"), "/run: {a_file} is a file; give a folder"),
    "checkpoints without resume": (dict(out_dir="{run}"), "already holds checkpoints; add --resume true"),
    "out_dir in the data folder": (dict(out_dir="{ragged}/run", train_data_dir="{ragged}"),
                                   "--out_dir {ragged}/run lies in the data folder {ragged}: the run would write"),
    # checkpoints and best.json were written among the dataset's files
    "the data folder where the run writes": (dict(out_dir="{nest}", train_data_dir="{nest}/checkpoints"),
                                             "--train_data_dir {nest}/checkpoints is a folder the run writes in"),
    "an earlier run's files without resume": (dict(out_dir="{earlier_run}"), "earlier_run already holds config.yaml, "
                                              "metrics.csv, samples/step-00000004.jsonl (of an earlier run, or yours)"),
    # replaced, under Slurm (whose scripts always resume): a user's config.yaml, metrics.csv and summary.json
    "a user's files with resume": (dict(out_dir="{earlier_run}", resume=True), "earlier_run holds config.yaml, "
                                   "metrics.csv, samples/step-00000004.jsonl, which --resume true would replace, but "
                                   "its config.yaml is not one a run of train.py wrote"),
    "wandb online without key": (dict(wandb_mode="online"), "--wandb_mode online needs WANDB_API_KEY"),
    "checkpoints uploaded to a disabled W&B": (dict(log_model=True), "--log_model true uploads checkpoints to Weights"),
    "offline artifacts of checkpoints that are deleted": (dict(wandb_mode="offline", log_model="all", keep_last_n=1),
                                                          "--log_model all with --keep_last_n 1: offline, W&B's"),
    "an encoder as a causal LM": (dict(model_config="{bert}"),  # it learnt to copy the next token: val_loss 0.12
                                  "--model_config: a bert model built as a causal LM reads the tokens after each "
                                  "position, so it would learn to copy the next token; train a decoder model"),
    "an attention the model has not": (dict(model_config="{gemma2}"),
                                       "--attn_implementation sdpa: a gemma2 model does not support it ("),
    "activation checkpointing the model class has not": (
        dict(model_config="{jetmoe}", strategy="ddp", gradient_checkpointing=True),
        "--gradient_checkpointing true: a jetmoe model has no activation checkpointing of its own, which --strategy "
        "ddp uses (JetMoeForCausalLM does not support activation checkpointing); use --strategy fsdp"),
    "model folder without weights": (dict(model_config=None, model_name="{wider}"),
                                     "the folder holds no weights (*.safetensors or *.bin); to train from its"),
    "FlashAttention without its kernels": (dict(attn_implementation="flash_attention_2"),
                                           "flash_attention_2 needs the flash-attn package and a CUDA GPU"),
    "a GPU asked for where there is none": (dict(accelerator="gpu"), "--accelerator gpu: no CUDA GPU is visible here"),
    "Cut Cross-Entropy on CPU": (dict(loss_kernel="cut_cross_entropy"), "--loss_kernel cut_cross_entropy is a Triton "
                                 "kernel for CUDA GPUs and this run is on cpu: drop it"),
    "negative lr": (dict(lr=-1.0), "--lr must be positive"),
    "a checkpoint as the model config": (dict(model_config="{lone_checkpoint}"), "--model_config {lone_checkpoint} "
                                         "is a checkpoint of train.py; start a new run from its weights with "
                                         "--init_from {lone_checkpoint}"),
    "a run folder as the model": (dict(model_config=None, model_name="{retokenized_run}"),
                                  "--model_name {retokenized_run} is a run folder of train.py; start a new run from "
                                  "its weights with --init_from {retokenized_run}, or continue it with --resume true"),
    "a freeze pattern that is no regular expression": (dict(freeze="['(']"), "--freeze '(': not a regular expression"),
    "a freeze pattern that names nothing": (dict(freeze="[embed, emb_tokens]"), "--freeze 'emb_tokens' names no "
                                            "parameter of the llama model (its names: model.embed_tokens.weight, "),
    "freezing everything": (dict(freeze="['.']"), "--freeze names every parameter of the model: nothing would train"),
    "a resume with another freeze": (dict(out_dir="{run}", resume=True, freeze="[embed]"),
                                     "was trained with --freeze None, not ['embed']: its optimizer holds the state of "
                                     "the parameters that trained; resume with the same --freeze, or start a new "
                                     "phase"),
    "init_from nowhere": (dict(model_config=None, init_from="/nonexistent/run"),
                          "--init_from /nonexistent/run: no such file or folder"),
    "init_from a model folder": (dict(model_config=None, init_from="{wider}"),
                                 "--init_from {wider} is a Hugging Face model folder; give it as --model_name"),
    "init_from a folder without checkpoints": (dict(model_config=None, init_from="{earlier_run}"),
                                               "--init_from {earlier_run}: neither a checkpoint nor a run folder "
                                               "holding one that reads whole; give a checkpoint of train.py"),
    "init_from with the data of another tokenizer": (
        dict(model_config=None, init_from="{retokenized_run}"),
        "not with --init_from {retokenized_run}/checkpoints/step-00000004.ckpt's tokenizer"),
    "init_from a checkpoint copied out of its run, with the data of another tokenizer": (
        dict(model_config=None, init_from="{lone_checkpoint}"),  # the tokenizer it recorded, then
        "not with --init_from {lone_checkpoint}'s tokenizer"),
    "init_from and model_config": (dict(init_from="{run}"), "give exactly one of --model_name (fine-tune a "
                                   "pretrained model), --model_config (train from scratch) and --init_from"),
    "fsdp option with ddp": (dict(strategy="ddp", sharding_strategy="NO_SHARD"),
                             "applies only to --strategy fsdp or fsdp2"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_input_is_refused_with_one_line_naming_it(case, tiny, bad, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    overrides, expected = CASES[case]
    overrides = {k: v.format(**bad) if isinstance(v, str) else v for k, v in overrides.items()}
    expected = expected.format(**bad)
    out_dir = Path(overrides.pop("out_dir", tmp_path / "out"))
    before = digest(bad["run"])
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, out_dir, **overrides)))
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert any(expected in line for line in errors), errors
    assert all(line.startswith("error: ") for line in errors)
    assert digest(bad["run"]) == before
    assert not (tmp_path / "out").exists()


def test_intervals_given_as_a_share_of_the_run_become_its_steps(tiny, tmp_path, capsys) -> None:
    """The Hugging Face Trainer reads save_steps 0.05 as every 5% of the run (seed 003 saves so): it was refused as
    "expected an integer". The run, its config.yaml and its checkpoints hold the steps."""
    inputs = preflight(parse_config(train_args(tiny, tmp_path / "out", max_step=40, save_step_interval=0.25,
                                               eval_step_interval=0.1, log_interval=1e3, warmup_steps=0.03)))
    cfg = inputs.config
    assert (cfg.save_step_interval, cfg.eval_step_interval, cfg.log_interval, cfg.warmup_steps) == (10, 4, 1000, 2)
    assert all(isinstance(value, int) for value in (cfg.save_step_interval, cfg.eval_step_interval, cfg.log_interval,
                                                    cfg.warmup_steps))
    said = capsys.readouterr().out
    assert "--warmup_steps 0.03: 2 steps of the run's 40" in said, "the Trainer's warmup_ratio, rounded up as it does"
    assert "--save_step_interval 0.25: every 10 steps of the run's 40" in said
    assert "--eval_step_interval 0.1: every 4 steps of the run's 40" in said and "--log_interval" not in said


def test_a_sharded_checkpoint_given_as_the_model_is_named_once_as_such(tiny, bad, tmp_path, capsys) -> None:
    """It was also said to be a model folder without weights, to be given as --model_config; and a missing path
    ending in .ckpt was called a checkpoint."""
    for given, said in ((bad["truncated_folder"], "is a checkpoint of train.py; start a new run from its weights"),
                        (tmp_path / "gone.ckpt", "no such"),
                        (Path(tiny.model_config) / "config.json", "is a file; give the folder of the model's "
                                                                  "config.json and weights")):
        with pytest.raises(SystemExit):
            preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=given)))
        errors = [line for line in capsys.readouterr().err.splitlines() if "--model_name" in line]
        assert len(errors) == 1 and said in errors[0], errors


def test_a_size_of_0_in_the_config_or_its_overrides_is_one_line(tiny, tmp_path, capsys) -> None:
    """hidden_size 0 ended every rank in FSDP's assertion after the launch, max_position_embeddings 0 trained, and
    0 attention heads was a ZeroDivisionError traceback."""
    def refusal(**options) -> str:
        with pytest.raises(SystemExit):
            preflight(parse_config(train_args(tiny, tmp_path / "out", **options)))
        (line,) = capsys.readouterr().err.splitlines()  # vocab_size 0: transformers' and torch's warnings before it
        return line

    for override in ({"hidden_size": 0}, {"max_position_embeddings": 0}, {"vocab_size": 0}):
        (name, value), = override.items()
        assert refusal(model_overrides=json.dumps(override)) == (
            f"error: --model_overrides: {name} {value}: a model's sizes and counts are positive")
    assert refusal(model_overrides=json.dumps({"num_attention_heads": 0})).startswith(
        "error: --model_overrides: the llama config refuses them (")
    linear = {"rope_type": "linear", "rope_theta": 10000.0}  # a factor of 0 trained to NaN at step 1
    assert refusal(model_overrides=json.dumps({"rope_parameters": linear | {"factor": 0}})) == (
        "error: --model_overrides: `rope_parameters`'s factor field must be a float or int >= 1, got 0 (transformers' "
        "check of RoPE, which builds the model anyway)")
    assert refusal(model_overrides=json.dumps({"model_type": "gpt2"})) == (
        "error: --model_overrides: model_type names the model's class, which a llama config keeps; give "
        "--model_config a config of the other type")
    assert "Unrecognized keys in `rope_parameters`" in refusal(model_overrides=json.dumps(
        {"rope_parameters": linear | {"factor": 2.0, "factr": 2.0}}))
    (tmp_path / "zero").mkdir()
    config = json.loads((Path(tiny.model_config) / "config.json").read_text())
    (tmp_path / "zero" / "config.json").write_text(json.dumps(config | {"intermediate_size": 0}))
    assert refusal(model_config=tmp_path / "zero") == (f"error: --model_config {tmp_path / 'zero'}: intermediate_size "
                                                       "0: a model's sizes and counts are positive")
    assert not (tmp_path / "out").exists()


def test_model_overrides_change_the_config_the_run_builds_and_records(tiny, bad, tmp_path, capsys) -> None:
    """A longer context for a model whose positions end short of the data: --model_overrides raises them, with a
    RoPE scaling, without a copy of the model's folder to edit. A mapping is merged into the config's: the yarn
    scaling keeps the model's own rope_theta (replaced whole, it became the class's default: 10,000 for Llama-3's
    500,000), and the start says every field that changed."""
    config = json.loads((bad["short_positions"] / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500000.0
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "config.json").write_text(json.dumps(config))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    inputs = preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=tmp_path / "long",
                                               model_overrides=json.dumps({"max_position_embeddings": 64,
                                                                           "rope_parameters": yarn}))))
    assert inputs.model_config.max_position_embeddings == 64
    assert inputs.model_config.rope_parameters == yarn | {"rope_theta": 500000.0}, "the model's own theta"
    assert inputs.config.model_overrides == {"max_position_embeddings": 64, "rope_parameters": yarn}
    assert "--model_overrides: max_position_embeddings 16 -> 64, rope_parameters {" in capsys.readouterr().out


def test_documents_kept_apart_in_raw_text_blocks_reach_the_model_as_packed_examples(tiny, tmp_path) -> None:
    """--document_masking: raw text whose blocks restart positions at each document is batched as packed examples
    are, in the layout the probe of the run's model chose, and a block's documents do not attend to each other."""
    from app.data.formats import LAYOUTS
    from app.prepare import PrepareArgs, prepare, stdlib_corpus_paths

    documents = tmp_path / "documents.jsonl"
    documents.write_text("".join(json.dumps({"text": part}) + "\n" for path in sorted(
        Path(stdlib_corpus_paths(("json",))[0]).glob("*.py")) for part in path.read_text().split("\n\n")))
    data = tmp_path / "apart"
    prepare(PrepareArgs(input=[str(documents)], tokenizer=str(tiny.tokenizer), block_size=32, document_masking=True,
                        output_dir=str(data)))
    inputs = preflight(parse_config(train_args(tiny, tmp_path / "out", train_data_dir=data)))
    assert json.loads((data / "stats.json").read_text())["format"] == "text_documents"
    assert inputs.packed_layout in LAYOUTS
    from transformers import AutoModelForCausalLM

    from app.data import load_data

    loaded = load_data(str(data), inputs.packed_layout)
    row = next(row for row in loaded.train.with_format(None) if row["position_ids"].count(0) > 1)
    second = row["position_ids"].index(0, 1)  # the block's second document (or piece of one), to the third's start
    end = row["position_ids"].index(0, second + 1) if row["position_ids"].count(0) > 2 else len(row["input_ids"])
    batch = loaded.format.collate([{name: torch.tensor(row[name]) for name in row} | {"trained_tokens": 0}])
    model = AutoModelForCausalLM.from_config(inputs.model_config).eval()
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.inputs.items() if k != "labels"}, use_cache=False  # as it trains
                       ).logits[0, second:end]
        alone = model(input_ids=torch.tensor([row["input_ids"][second:end]])).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


def test_a_refused_run_says_none_of_its_notes(tiny, tmp_path, capsys) -> None:
    """"--resume true: no checkpoint in ... yet, starting from step 0" came before the refusal, as if the run had
    started; the notes of a run that starts are said as before."""
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", resume=True, eval_samples=3)))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: --eval_samples"), captured
    preflight(parse_config(train_args(tiny, tmp_path / "out", resume=True)))
    assert "--resume true: no checkpoint in" in capsys.readouterr().out


def test_resume_takes_over_the_files_of_a_run_that_saved_no_checkpoint(tiny, tmp_path) -> None:
    """Its config.yaml is one train.py wrote: --resume true starts that run again from step 0 there (a user's files
    of the same names are refused: test_bad_input_is_refused_with_one_line_naming_it)."""
    cfg = parse_config(train_args(tiny, tmp_path / "out", resume=True))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.yaml").write_text(cfg.to_yaml())
    (tmp_path / "out" / "metrics.csv").write_text("step,train_loss\n1,6.0\n")
    assert preflight(cfg).resume_from is None


def test_a_checkpoint_of_another_run_is_refused_where_out_dir_holds_a_run_of_its_own(tmp_path) -> None:
    """Resumed there, the run set that run's newer checkpoints aside and rewrote its metrics.csv and config.yaml. A
    job that continues another run's checkpoint and was preempted before its first save starts again with the same
    command (its config.yaml names that checkpoint); a copy of the run's own checkpoint names its out_dir."""
    from types import SimpleNamespace

    from app.training.preflight.resume import holds_another_run

    base, run = tmp_path / "base", tmp_path / "run"
    checkpoint = base / "checkpoints" / "step-00000004.ckpt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"x")
    saved_in_base = {"config": {"out_dir": "base"}, "cwd": str(tmp_path)}
    run.mkdir()
    (run / "metrics.csv").write_text("step\n")
    problems: list[str] = []

    def refused(out_dir: Path, path: Path = checkpoint, metadata: dict = saved_in_base) -> bool:
        return holds_another_run(SimpleNamespace(out_dir=str(out_dir)), path, metadata, problems)

    (run / "config.yaml").write_text(f"checkpoint: {checkpoint}\nlr: 0.001\n")
    assert not refused(run), "an earlier start of the same command"
    (run / "config.yaml").write_text(f"checkpoint: {tmp_path / 'other.ckpt'}\n")
    assert refused(run)
    assert not refused(base) and not refused(tmp_path / "new") and not refused(run, metadata=saved_in_base | {
        "config": {"out_dir": str(run)}}), "its own, a new folder, a copy of the run's own checkpoint"
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step-00000008.ckpt").write_bytes(b"x")
    assert refused(run)
    assert problems == [
        f"--checkpoint {checkpoint} is not of the run in --out_dir {run}, which holds config.yaml, metrics.csv of "
        "another run: resuming it there would replace them; give a new or empty --out_dir",
        f"--checkpoint {checkpoint} is not of the run in --out_dir {run}, which holds checkpoints up to step 8: to "
        "continue that run, resume without --checkpoint (its newest is taken); to continue this checkpoint, give a "
        "new or empty --out_dir"]


def test_the_attention_check_refuses_only_an_attention_the_model_class_lacks(bad) -> None:
    """Built from the run's own config: a twin with 4 heads made BART-base's 12 decoder heads fail to divide its
    width (refused under both attentions), and Mamba's twin could not be made at all (a traceback)."""
    from types import SimpleNamespace

    from transformers import MambaConfig

    from app.training.preflight.model import check_attention_supported

    for config in (AutoConfig.from_pretrained(bad["bart_base_heads"]),
                   MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2)):
        problems: list[str] = []
        assert check_attention_supported(SimpleNamespace(attn_implementation="eager", trust_remote_code=False), config,
                                         problems) and not problems, (config.model_type, problems)
    problems = []
    assert not check_attention_supported(SimpleNamespace(attn_implementation="sdpa", trust_remote_code=False),
                                         AutoConfig.from_pretrained(bad["gemma2"]), problems)
    assert problems == ["--attn_implementation sdpa: a gemma2 model does not support it (Gemma2ForCausalLM does not "
                        "support an attention implementation through torch.nn.functional.scaled_dot_product_attention "
                        "yet); use --attn_implementation eager"]


def test_flash_attention_is_refused_for_a_model_class_without_it(tiny) -> None:
    """T5 has no FlashAttention path: on GPUs with flash-attn every rank ended in a ValueError traceback. Asked of
    the class, not built with it (that needs the kernels), so it is said on any machine."""
    from types import SimpleNamespace

    from transformers import T5Config

    from app.training.preflight.model import check_attention_supported

    flash = SimpleNamespace(attn_implementation="flash_attention_2", trust_remote_code=False)
    problems: list[str] = []
    assert check_attention_supported(flash, AutoConfig.from_pretrained(tiny.model_config), problems) and not problems
    t5 = T5Config(vocab_size=512, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    assert not check_attention_supported(flash, t5, problems)
    assert problems == ["--attn_implementation flash_attention_2: a t5 model does not support it "
                        "(T5ForConditionalGeneration has no FlashAttention path in transformers); use "
                        "--attn_implementation sdpa"]


def test_activation_checkpointing_is_refused_only_where_the_strategy_needs_the_models_own(tiny, bad) -> None:
    """ddp, fsdp2 and one device ask transformers, which JetMoE and CTRL lack; FSDP1's wrapper takes any layer class,
    so it is named where it can wrap the model (CTRL has no _no_split_modules to wrap by default)."""
    from types import SimpleNamespace

    from transformers import CTRLConfig

    from app.training.preflight.model import check_activation_checkpointing

    def problems(config, strategy: str, checkpointing: bool = True) -> list[str]:
        found: list[str] = []
        check_activation_checkpointing(SimpleNamespace(gradient_checkpointing=checkpointing, strategy=strategy,
                                                       gradient_checkpointing_every=1, trust_remote_code=False,
                                                       auto_wrap_policy=None), config, found)
        return found

    jetmoe, ctrl = AutoConfig.from_pretrained(bad["jetmoe"]), CTRLConfig(n_embd=64, dff=128, n_layer=2, n_head=4)
    assert problems(jetmoe, "fsdp") == [] and problems(jetmoe, "ddp", checkpointing=False) == []
    assert problems(AutoConfig.from_pretrained(tiny.model_config), "fsdp2") == []
    assert "use --strategy fsdp (its checkpoint wrapper" in problems(jetmoe, "single_device")[0]
    assert problems(ctrl, "fsdp2") == ["--gradient_checkpointing true: a ctrl model has no activation checkpointing "
                                       "of its own, which --strategy fsdp2 uses (CTRLLMHeadModel does not support "
                                       "activation checkpointing); use --gradient_checkpointing false"]


def test_compile_on_cpu_without_a_cpp_compiler_is_refused_in_one_line(tiny, tmp_path, capsys, monkeypatch) -> None:
    """Inductor's own search for the compiler it builds CPU kernels with; every rank ended in an InductorError."""
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", (None, str(tmp_path / "no-such-g++")))
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, tmp_path / "out", compile=True)))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --compile true on CPU builds its kernels with a C++ compiler, and torch finds none here (No working "
        f"C++ compiler found in torch._inductor.config.cpp.cxx: (None, '{tmp_path / 'no-such-g++'}')); install g++ "
        "(or set CXX to a compiler), or use --compile false"]


def test_compile_on_gpus_without_a_c_compiler_for_triton_is_refused(tiny, tmp_path, monkeypatch) -> None:
    """Triton builds each kernel's launcher with $CC, else gcc, else clang (triton/runtime/build.py): without one
    (PyTorch's CUDA runtime images) every rank ended in "Failed to find C compiler" at its first compiled forward."""
    from app.training.preflight import environment as checks

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    monkeypatch.setattr(checks, "resolve_accelerator", lambda cfg: "cuda")
    problems: list[str] = []
    checks.check_runs_here(parse_config(train_args(tiny, tmp_path / "out", compile=True)), problems)
    assert any(p.startswith("--compile true on GPUs builds Triton's kernel launchers with a C compiler") for p in
               problems), problems
    monkeypatch.setenv("CC", "/usr/bin/cc")
    problems.clear()
    checks.check_runs_here(parse_config(train_args(tiny, tmp_path / "out", compile=True)), problems)
    assert not any("--compile" in p for p in problems), problems


def test_compile_on_gpus_takes_the_models_own_loss_unless_the_chunked_one_is_asked_for(tiny, tmp_path,
                                                                                      monkeypatch) -> None:
    """Compiled on an H200, transformers' loss fused into the graph gave 41.2% MFU against the chunked loss's 36.3%
    (docs/performance.md): the default follows; an explicit --chunked_loss true is kept, and CPUs keep the chunked
    loss, which the CPU benchmark found faster."""
    from app.training.preflight import model as checks

    config = AutoConfig.from_pretrained(tiny.model_config)
    chosen = {}
    for accelerator in ("cpu", "cuda"):
        monkeypatch.setattr(checks, "resolve_accelerator", lambda cfg: accelerator)
        for asked in (None, True, False):
            options = {} if asked is None else {"chunked_loss": asked}
            cfg = parse_config(train_args(tiny, tmp_path / "out", compile=True, **options))
            chosen[accelerator, asked] = checks.check_chunked_loss(cfg, config)
    assert chosen == {("cpu", None): True, ("cpu", True): True, ("cpu", False): False,
                      ("cuda", None): False, ("cuda", True): True, ("cuda", False): False}


def test_cut_cross_entropy_on_gpus_needs_its_package_the_chunked_loss_and_a_head_without_bias(tiny, tmp_path,
                                                                                             monkeypatch) -> None:
    """Each refused in one line before any rank starts (its import in the first forward, or its backward's assertion
    of 16-bit embeddings under 32-true, ended every rank in a traceback); planning a GPU run needs no package."""
    from app.training.preflight import model as checks

    monkeypatch.setattr(checks, "resolve_accelerator", lambda cfg: "cuda")
    installed = importlib.util.find_spec("cut_cross_entropy") is not None and importlib.util.find_spec("triton")
    llama, codegen = AutoConfig.from_pretrained(tiny.model_config), AutoConfig.for_model(
        "codegen", vocab_size=300, n_embd=64, n_layer=1, n_head=4, rotary_dim=8)

    def problems(config, chunked_loss: bool, **options) -> list[str]:
        found: list[str] = []
        cfg = parse_config(train_args(tiny, tmp_path / "out", loss_kernel="cut_cross_entropy", **options))
        checks.check_loss_kernel(cfg, config, chunked_loss, found)
        return found

    assert problems(llama, True, precision="bf16-mixed") == ([] if installed else [
        "--loss_kernel cut_cross_entropy needs the cut-cross-entropy package (and Triton, which CUDA builds of torch "
        "bring): pip install cut-cross-entropy==25.1.1"])
    assert problems(llama, True, estimate_memory=True, precision="bf16-true") == []
    assert problems(llama, True, estimate_memory=True, precision="32-true") == [
        "--loss_kernel cut_cross_entropy computes in bf16 or fp16 only (its backward refuses fp32): use --precision "
        "bf16-mixed or bf16-true, not 32-true"]
    assert problems(llama, False, estimate_memory=True, precision="bf16-mixed") == [
        "--loss_kernel cut_cross_entropy computes the chunked loss, which this run does not take (see the note "
        "above): drop it, or take the chunked loss (--chunked_loss true)"]
    assert problems(codegen, True, estimate_memory=True, precision="bf16-mixed") == [
        "--loss_kernel cut_cross_entropy: a codegen model's output layer adds a bias, which Cut Cross-Entropy's "
        "kernel has no place for: drop it"]


def test_label_smoothing_and_the_z_loss_are_refused_where_the_loss_cannot_add_them(tiny, tmp_path,
                                                                                    monkeypatch) -> None:
    """Cut Cross-Entropy's kernel computes the plain cross-entropy; a mixture of experts whose model does not show its
    router loss's coefficient would lose its router loss in a loss computed from its logits (every one transformers
    5.23 holds shows it, Mixtral here; a model of remote code may not: the stand-in below)."""
    from app.training.preflight import model as checks

    mixtral = AutoConfig.for_model("mixtral", vocab_size=300, hidden_size=64, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   num_local_experts=2, output_router_logits=True)

    def problems(config, **options) -> list[str]:
        found: list[str] = []
        checks.check_loss_terms(parse_config(train_args(tiny, tmp_path / "out", **options)), config, found)
        return found

    assert problems(mixtral, z_loss=1e-4, label_smoothing=0.1) == []
    assert problems(mixtral, label_smoothing=0.1, loss_kernel="cut_cross_entropy") == [
        "--label_smoothing 0.1: --loss_kernel cut_cross_entropy computes the plain cross-entropy; drop it (the "
        "default, torch, adds them)"]
    monkeypatch.setattr(checks, "router_coefficient", lambda model: None)
    assert problems(mixtral) == []
    assert problems(mixtral, z_loss=1e-4) == [
        "--z_loss 0.0001: a mixtral model adds its router's loss at a coefficient it does not show, which a loss "
        "computed from its logits must add too: drop them"]


def test_every_problem_is_reported_at_once_by_the_cli_without_traceback(tiny, bad, tmp_path) -> None:
    args = train_args(tiny, bad["run"], model_config=bad["small_vocab"], tokenizer="/nonexistent/tokenizer",
                      auto_wrap_policy="[GPT2Block]")
    before = digest(bad["run"])
    python, variables = interpreter()
    result = run_script([python, "train.py", *args], 120, run_environment(variables | {"LOCAL_RANK": "0"}))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = result.stderr.strip().splitlines()
    for expected in ("vocab_size is 100", "--tokenizer /nonexistent/tokenizer", "--auto_wrap_policy GPT2Block",
                     "already holds checkpoints"):
        assert any(expected in line for line in errors), errors
    assert digest(bad["run"]) == before


LAUNCHER_VARIABLES = ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "MASTER_ADDR", "NODE_RANK")


def test_several_nodes_without_a_launcher_are_refused_in_one_line(tiny, tmp_path, capsys, monkeypatch) -> None:
    """`--num_nodes 2` typed on one machine (or in a Slurm script without srun) would wait for the other nodes."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    args = train_args(tiny, tmp_path / "out", num_nodes=2)
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(args))
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: --num_nodes 2: nothing starts the other nodes"), errors
    assert all(launcher in errors[0] for launcher in ("srun", "torchrun", "MASTER_ADDR", "NODE_RANK"))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # Lightning's own multi-node variables: started by hand
    monkeypatch.setenv("NODE_RANK", "0")
    assert preflight(parse_config(args)).plan.world_size == 4


def test_a_launcher_that_started_another_number_of_processes_is_refused_in_one_line(tiny, tmp_path, capsys,
                                                                                    monkeypatch) -> None:
    """torchrun with 2 processes and --devices 1 (auto on CPUs): an IndexError on every rank; srun with 2 tasks: a
    ValueError under ddp, one rank waiting under fsdp; a stale NODE_RANK=1: every rank waited 10 minutes."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def refusals(**options) -> list[str]:
        with pytest.raises(SystemExit) as exit_info:
            preflight(parse_config(train_args(tiny, tmp_path / "out", **options)))
        assert exit_info.value.code == 2
        return capsys.readouterr().err.strip().splitlines()

    def refusal(**options) -> str:
        (line,) = refusals(**options)
        return line

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert refusal(devices=1) == ("error: --devices 1 --num_nodes 1: 1 ranks, but torchrun (WORLD_SIZE) started 2 "
                                  "processes; give --devices (processes per node) and --num_nodes whose product is 2")
    assert preflight(parse_config(train_args(tiny, tmp_path / "out", devices=2))).plan.world_size == 2
    # The right product split the wrong way: torchrun --nnodes 2 --nproc_per_node 1 given --num_nodes 1 --devices 2
    # trained with HYBRID_SHARD's "node" spanning both and the shared-out_dir check skipped; --nnodes 2
    # --nproc_per_node 2 given --num_nodes 4 --devices 1 ended every rank in an IndexError
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # nodes given different --nproc_per_node: "a product of 3"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert refusal(devices=2, num_nodes=2) == (
        "error: torchrun started 3 processes on 2 nodes, 2 on this one: the nodes' torchrun were given different "
        "--nproc_per_node; give every node the same")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert refusals(devices=2) == [
        "error: --num_nodes 1: torchrun started the run on 2 nodes (GROUP_WORLD_SIZE); give --num_nodes 2",
        "error: --devices 2: torchrun started 1 processes on each node (LOCAL_WORLD_SIZE); give --devices 1"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert refusals(devices=1, num_nodes=4) == [
        "error: --num_nodes 4: torchrun started the run on 2 nodes (GROUP_WORLD_SIZE); give --num_nodes 2",
        "error: --devices 1: torchrun started 2 processes on each node (LOCAL_WORLD_SIZE); give --devices 2"]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert preflight(parse_config(train_args(tiny, tmp_path / "out", devices=2, num_nodes=2))).plan.world_size == 4
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    # train.py in the job's batch script, not under srun: it waited out --rendezvous_timeout_min and exited 5 (which
    # the scripts requeue), or with one task per node was told to give --devices 1
    assert refusal(devices=4) == ("error: train.py runs in the job's allocation (its batch script, or an salloc "
                                  "shell), not under srun, and no other process of the run is started: run it as "
                                  "`srun python train.py ...` (slurm/train.sbatch), in a job submitted with --nodes "
                                  "and --ntasks-per-node (one task per device)")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert refusal(devices=2) == ("error: --devices 2: srun started 4 processes on each node (SLURM_NTASKS_PER_NODE); "
                                  "give --devices 4")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2,1")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert refusal(devices=2, num_nodes=2) == (
        "error: srun started different numbers of processes on the nodes (SLURM_TASKS_PER_NODE=2,1): every node "
        "needs as many ranks; ask for them per node (--ntasks-per-node)")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")  # sized with --ntasks alone: Lightning's RuntimeError on every rank
    assert refusal(devices=2, num_nodes=2) == (
        "error: srun started 3 tasks of a job sized without --ntasks-per-node, and Lightning (SLURMEnvironment) "
        "refuses such a job on every rank; submit it with --nodes and --ntasks-per-node (one task per device)")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert preflight(parse_config(train_args(tiny, tmp_path / "out", devices=2, num_nodes=2))).plan.world_size == 4
    for name in ("SLURM_TASKS_PER_NODE", "SLURM_NNODES", "SLURM_JOB_NAME", "SLURM_STEP_ID"):
        monkeypatch.delenv(name)
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NODE_RANK", "1")
    assert refusal(devices=2) == ("error: NODE_RANK=1 is set, but --num_nodes 1 has no node 1: unset NODE_RANK, or "
                                  "give the run's --num_nodes")
    monkeypatch.delenv("NODE_RANK")
    monkeypatch.setenv("LOCAL_RANK", "0")  # a shell that kept torchrun's: it waited out the rendezvous, then exit 5
    assert refusal(devices=2) == ("error: LOCAL_RANK=0 is set here, and Lightning then starts none of the run's other "
                                  "1 process itself (it takes them as started by hand): unset LOCAL_RANK (left in "
                                  "this shell by another launcher)")
    from lightning_fabric.plugins.environments import MPIEnvironment

    monkeypatch.setattr(MPIEnvironment, "detect", staticmethod(lambda: True))  # mpirun, whose wrapper exported it
    assert preflight(parse_config(train_args(tiny, tmp_path / "out", devices=2))).plan.world_size == 2
    assert preflight(parse_config(train_args(tiny, tmp_path / "out", devices=1))).plan.world_size == 1


def test_a_tpu_run_without_torch_xla_is_refused_before_any_rank_starts(tiny, tmp_path, capsys) -> None:
    """`--accelerator tpu` passed every check and ended each rank in a ModuleNotFoundError; it also left out the
    layer classes --tpu wraps, as the two spellings were read apart."""
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, tmp_path / "out", accelerator="tpu", devices=1)))
    assert exit_info.value.code == 2
    assert "error: --accelerator tpu needs torch_xla, which this Python lacks" in capsys.readouterr().err
    assert parse_config(train_args(tiny, tmp_path / "out", accelerator="tpu")).tpu is True


def test_a_warmup_that_fills_the_run_says_that_the_rate_never_decays(tiny, tmp_path, capsys) -> None:
    """40 warmup steps of a 40-step run: --min_lr went unused, and --print_config described a cosine decay that
    never happened."""
    preflight(parse_config(train_args(tiny, tmp_path / "out", max_step=None, warmup_steps=40)))
    assert ("--warmup_steps 40 fills the run's 40 optimizer steps: the rate rises to --lr and ends there, never "
            "decaying to --min_lr") in capsys.readouterr().out


def test_fsdp_no_sync_without_accumulation_says_it_is_not_used(tiny, tmp_path, capsys) -> None:
    """Accepted and ignored without a word, as no other option that nothing reads is."""
    preflight(parse_config(train_args(tiny, tmp_path / "out", fsdp_no_sync=True, gradient_accumulation_steps=1)))
    assert "--fsdp_no_sync true is not used: each step is one micro-batch per rank" in capsys.readouterr().out


def test_single_device_plans_one_rank_whatever_gpus_are_visible(tiny, tmp_path, monkeypatch) -> None:
    """--strategy single_device --devices auto on a node of 4 GPUs planned 4 ranks for its one process: each step
    trained a quarter of its rows and divided the loss by the tokens of all four."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cfg = parse_config(train_args(tiny, tmp_path / "out", strategy="single_device", devices="auto",
                                  accelerator="auto", gradient_accumulation_steps=1))
    assert world_size(cfg) == 1
    assert world_size(replace(cfg, strategy="fsdp")) == 4


def test_a_tpu_run_with_devices_auto_plans_the_tpu_cores_not_the_gpus(tiny, tmp_path, monkeypatch) -> None:
    """`--accelerator tpu --devices auto` counted CUDA GPUs (none on a TPU host): one rank planned for the eight
    processes Lightning's XLA launcher starts, so every batch and loss normalisation was planned for one rank."""
    from lightning_fabric.accelerators import XLAAccelerator
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(XLAAccelerator, "auto_device_count", staticmethod(lambda: 8))
    cfg = parse_config(train_args(tiny, tmp_path / "out", accelerator="tpu", devices="auto", num_nodes=2))
    assert world_size(cfg) == 16


def test_wandb_follows_its_environment_unless_a_flag_says_otherwise(tiny, tmp_path, capsys, monkeypatch) -> None:
    """docker/run.sh forwards WANDB_MODE; the project's own default used to override it (offline, always)."""
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    resolved = preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode=None))).config
    assert (resolved.wandb_mode, resolved.project) == ("disabled", "fsdp-trainer")
    assert capsys.readouterr().out.count("Weights & Biases: off") == 1
    preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode=None, project="team-runs", run_name="a")))
    assert "Weights & Biases: off, so --project, --run_name are not read (--wandb_mode offline or online" in (
        capsys.readouterr().out), "--project alone reads as logging to W&B: it logged nowhere, its note unnamed"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode=None))).config.wandb_mode == "disabled"
    assert "Weights & Biases" not in capsys.readouterr().out, "WANDB_MODE=disabled is a choice: nothing to say"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "theirs")
    monkeypatch.setenv("WANDB_NAME", "run-7")
    resolved = preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode=None))).config
    assert (resolved.wandb_mode, resolved.project, resolved.run_name) == ("offline", "theirs", "run-7")
    capsys.readouterr()
    flagged = preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode="disabled", project="mine"))).config
    assert (flagged.wandb_mode, flagged.project) == ("disabled", "mine")
    out = capsys.readouterr().out
    assert "Weights & Biases" not in out, "a choice was made: nothing to say"
    assert "WANDB_MODE=offline is not used: --wandb_mode disabled (a flag or a config file) decides" in out, (
        "a config's wandb_mode silenced the environment's without a word (every demo config had one)")
    assert "WANDB_PROJECT=theirs is not used: --project mine" in out and "WANDB_NAME" not in out
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode=None)))
    assert "error: WANDB_MODE=sometimes is not one of online, offline, disabled" in capsys.readouterr().err


def test_a_malformed_wandb_key_is_refused_in_one_line_that_does_not_show_it(tiny, tmp_path, capsys,
                                                                           monkeypatch) -> None:
    """wandb.init raised "AuthenticationError: WANDB_API_KEY invalid" in a traceback, after config.yaml, metrics.csv
    and the tokenizer were written to --out_dir, and the rerun with the key fixed was refused for those files."""
    monkeypatch.setenv("WANDB_API_KEY", "abc123")
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode="online")))
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == ["error: WANDB_API_KEY: API key must have 40+ characters, has 6. Copy it again from "
                      "https://wandb.ai/authorize, or use --wandb_mode offline"]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def wandb_server(tmp_path, monkeypatch):
    """A W&B server address on this machine, logged in to as `wandb login --host` does (a netrc entry for it), with
    wandb's settings kept out of the user's own. wandb reads its settings once per process (as the preflight, the
    first to ask, does in a run): the test's settings are read afresh (wandb.teardown) and forgotten after it."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import wandb
    from wandb.sdk.lib.wbauth import wbnetrc

    class Answers(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(404)  # any answer: the server is there
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", url)
    wbnetrc.write_netrc_auth(host=url, api_key="a" * 40)
    wandb.teardown()
    yield url
    server.shutdown()
    wandb.teardown()


def test_a_wandb_login_is_found_as_wandb_finds_it_and_an_unreachable_server_is_one_line(
        tiny, tmp_path, capsys, monkeypatch, wandb_server) -> None:
    """`wandb login` writes a netrc entry for wandb's server, which since wandb 0.31 is not api.wandb.ai: the
    preflight looked for that name and refused every logged-in user. And without network wandb.init retried for
    1 min 46 s, then raised a traceback after the run's files were written."""
    cfg = parse_config(train_args(tiny, tmp_path / "out", wandb_mode="online"))
    assert preflight(cfg).config.wandb_mode == "online"
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nothing listens on
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
    import wandb
    from wandb.sdk.lib.wbauth import wbnetrc

    wbnetrc.write_netrc_auth(host=os.environ["WANDB_BASE_URL"], api_key="a" * 40)
    wandb.teardown()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        preflight(cfg)
    closed.close()
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.startswith(f"error: --wandb_mode online: {os.environ['WANDB_BASE_URL']} cannot be reached (") and \
        error.endswith("); use --wandb_mode offline (then `wandb sync` the run's wandb folder from a machine with "
                       "internet access)"), error
    assert not (tmp_path / "out").exists()


def test_a_wandb_server_address_with_a_password_is_reached_and_never_shown(tiny, tmp_path, capsys, monkeypatch,
                                                                          wandb_server) -> None:
    """WANDB_BASE_URL=http://user:password@host: the probe took `user:password@host` for a host name and refused a
    server that answered, printing the password; without a key the refusal printed it too."""
    import wandb

    with_password = wandb_server.replace("http://", "http://bob:hunter2@")
    monkeypatch.setenv("WANDB_BASE_URL", with_password)
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    wandb.teardown()
    cfg = parse_config(train_args(tiny, tmp_path / "out", wandb_mode="online"))
    assert preflight(cfg).config.wandb_mode == "online"
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    wandb.teardown()
    with pytest.raises(SystemExit):
        preflight(cfg)
    captured = capsys.readouterr()
    assert f"(for {wandb_server})" in captured.err and "hunter2" not in captured.out + captured.err, captured.err


def test_tensorboard_without_its_package_is_refused_in_one_line_before_any_rank_starts(tiny, tmp_path, capsys,
                                                                                        monkeypatch) -> None:
    """Fabric's TensorBoardLogger raised ModuleNotFoundError on every rank as the loggers were made; its line names
    the package pinned in requirements.txt."""
    from app.training.preflight.tensorboard_option import TENSORBOARDX
    from tests.conftest import ROOT

    assert TENSORBOARDX in (ROOT / "requirements.txt").read_text().splitlines()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboardX", "tensorboard") else find_spec(name, *a))
    assert not preflight(parse_config(train_args(tiny, tmp_path / "out"))).config.tensorboard, "off: nothing needed"
    with pytest.raises(SystemExit) as refused:
        preflight(parse_config(train_args(tiny, tmp_path / "out", tensorboard=True)))
    assert refused.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        f"error: --tensorboard true needs the tensorboardX package: pip install {TENSORBOARDX} (or pip install -r "
        "requirements.txt), or drop --tensorboard"]
    assert not (tmp_path / "out").exists()


def test_what_wandb_needs_is_checked_before_anything_is_written(tiny, tmp_path, capsys, monkeypatch) -> None:
    """wandb missing, or a WANDB_DIR that cannot be made, was a traceback from wandb.init, after the run's files."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("WANDB_DIR", str(a_file / "wandb"))
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode="offline")))
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: WANDB_DIR={a_file / 'wandb'}: {a_file} is not a folder; unset it (W&B then writes to --out_dir) or "
        "name a folder this run can write"]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode="offline")))
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --wandb_mode offline needs the wandb package: pip install -r requirements.txt, or use --wandb_mode "
        "disabled"]
    # installed, but it does not import (a protobuf too old for it): a traceback on rank 0 after the run's files
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "wandb" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode="offline")))
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --wandb_mode offline: the wandb package does not import (ModuleNotFoundError: import of wandb halted; "
        "None in sys.modules); reinstall it (pip install -r requirements.txt), or use --wandb_mode disabled"]
    monkeypatch.undo()
    # names wandb.init refuses, after the run's files were written: asked of wandb's own settings first
    monkeypatch.setenv("WANDB_RUN_ID", "bad/id")
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode="offline", project="team/proj")))
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --project 'team/proj': W&B refuses it (Invalid project name 'team/proj': cannot contain characters "
        "'/,\\\\,#,?,%,:', found '/'); give another",
        "error: WANDB_RUN_ID 'bad/id': W&B refuses it (Run ID cannot contain the characters: :;,#?/'); give another"]
    assert not (tmp_path / "out").exists()
    monkeypatch.delenv("WANDB_RUN_ID")
    monkeypatch.setenv("WANDB_FINISH_TIMEOUT", "abc")  # "could not start the run (1 validation error for Settings)"
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", wandb_mode="offline")))
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: a WANDB_* variable: W&B refuses finish_timeout (WANDB_FINISH_TIMEOUT='abc': Input should be a valid "
        "number, unable to parse string as a number); fix or unset it, or use --wandb_mode disabled"]
    assert not (tmp_path / "out").exists()


def test_a_checkpoints_estimate_counts_a_tied_weight_under_each_name_it_is_written(tiny, tmp_path) -> None:
    """A checkpoint writes Llama's tied output layer beside its embedding (their moments once): the estimate of the
    free space a run needs counted it once."""
    from app.training.preflight import out_dir as checks

    config = AutoConfig.from_pretrained(tiny.model_config)
    config.tie_word_embeddings = True
    unique = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    embedding = config.vocab_size * config.hidden_size
    cfg = parse_config(train_args(tiny, tmp_path / "out"))
    assert checks.estimated_checkpoint_bytes(config, cfg) == (unique + embedding + 2 * unique) * 4


def test_an_out_dir_holding_a_file_where_the_run_makes_a_folder_is_refused(tiny, tmp_path) -> None:
    """A file named `checkpoints` in --out_dir: the run trained until its first save, then failed to write there,
    saying that the checkpoints saved before were kept (there were none)."""
    from app.training.preflight import out_dir as checks

    cfg = parse_config(train_args(tiny, tmp_path / "out"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").write_text("notes")
    problems: list[str] = []
    checks.check_out_dir(cfg, None, problems)
    assert problems == [f"--out_dir {cfg.out_dir} holds checkpoints as a file, where a run makes a folder of that "
                        "name; move it away, or choose another --out_dir"]


def test_the_space_a_failed_save_left_counts_as_free(tiny, tmp_path, monkeypatch) -> None:
    """A save that filled the disk left its hidden .partial checkpoint, which the run removes as it starts: counted as
    used, it made the resume's preflight refuse the folder ("0.0 GB free, one checkpoint needs about 0.0 GB")."""
    from collections import namedtuple

    from app.training.preflight import out_dir as checks

    cfg = parse_config(train_args(tiny, tmp_path / "out"))
    config = AutoConfig.from_pretrained(tiny.model_config)
    needed = checks.estimated_checkpoint_bytes(config, cfg)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda path: usage(needed * 4, needed * 3, needed - 5_000))
    problems: list[str] = []
    checks.check_out_dir(cfg, config, problems)
    assert problems == [f"--out_dir {cfg.out_dir}: {checks.size(needed - 5_000)} free, one checkpoint needs about "
                        f"{checks.size(needed)}; free space or choose another folder"]
    assert checks.size(needed).endswith(" MB"), "a small model's checkpoint is not 0.0 GB"
    leftover = tmp_path / "out" / "checkpoints" / ".step-00000012.ckpt.partial"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(bytes(10_000))
    problems.clear()
    checks.check_out_dir(cfg, config, problems)
    assert problems == []

    # A save killed just after sizing its file leaves a sparse one: its size is not space its removal frees.
    (leftover / "__0_0.distcp").unlink()
    with open(leftover / "__1_0.distcp", "wb") as sized:
        sized.truncate(10_000_000)
    checks.check_out_dir(cfg, config, problems)
    assert len(problems) == 1 and problems[0].endswith("free space or choose another folder")


@pytest.mark.parametrize("variables, reports", [
    ({}, True), ({"LOCAL_RANK": "1"}, False), ({"LOCAL_RANK": "0", "RANK": "2"}, True),  # by hand: every node's log
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}, False),  # srun: one
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, True),  # log, all nodes
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}, True),  # python train.py --devices 2 in an allocation (salloc)
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "LOCAL_RANK": "1"}, False),  # ... its second rank
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "LOCAL_RANK": "0", "RANK": "4"}, False),  # torchrun in a job
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "LOCAL_RANK": "0", "RANK": "0"}, True)])
def test_the_preflights_notes_come_once_per_log(monkeypatch, variables, reports) -> None:
    """A 2-node Slurm job's log held each note twice (once per node's first process)."""
    from app.tasks import launching_process

    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert launching_process() is reports


def test_a_wandb_server_whose_certificate_this_check_cannot_verify_answered(monkeypatch) -> None:
    """A private CA that wandb's requests take from REQUESTS_CA_BUNDLE: the probe's urllib cannot verify it, and a
    reachable server was refused as unreachable."""
    import ssl
    import urllib.error
    import urllib.request

    from app.training.preflight.wandb_options import unreachable_reason

    def private_ca(*args, **kwargs):
        raise urllib.error.URLError(ssl.SSLCertVerificationError(1, "certificate verify failed"))

    monkeypatch.setattr(urllib.request, "urlopen", private_ca)
    assert unreachable_reason("https://wandb.example.org") is None


def test_wandb_settings_that_do_not_load_are_one_line(monkeypatch) -> None:
    """wandb's settings refused WANDB_BASE_URL (or its settings file) with a pydantic traceback in the preflight."""
    import wandb

    from app.training.preflight.wandb_options import check_wandb_online

    monkeypatch.setenv("WANDB_BASE_URL", "api wandb")
    wandb.teardown()
    problems: list[str] = []
    try:
        check_wandb_online(problems)
    finally:
        monkeypatch.undo()
        wandb.teardown()
    assert problems == ["--wandb_mode online: wandb's settings do not load (1 validation error for Settings); fix "
                        "the WANDB_* variable or the settings file it names, or use --wandb_mode offline"]


def incomplete_rope(tiny: TinySetup, folder: Path) -> Path:
    """The tiny config with Llama-3.1's rope_scaling written without its frequency factors, as hand-edited configs
    and older exports have it."""
    AutoConfig.from_pretrained(tiny.model_config).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(config | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0},
                                                             "rope_theta": 500000.0}))
    return folder


def test_a_config_transformers_finds_incomplete_is_one_line_not_a_key_error(tiny, tmp_path, capsys) -> None:
    """transformers raises KeyError for a rope_scaling it finds incomplete: a traceback from train.py, even for
    --estimate_memory."""
    model = incomplete_rope(tiny, tmp_path / "model")
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=model)))
    errors = capsys.readouterr().err.strip().splitlines()
    assert any(line.startswith(f"error: --model_config {model}: cannot load its config (") and "low_freq_factor" in line
               for line in errors), errors


def test_a_config_that_ties_weights_its_files_hold_apart_is_refused(tiny, tmp_path, capsys) -> None:
    """transformers loaded them untied (a warning per rank) and the run trained a model its recorded config said was
    tied: convert_to_hf.py then failed its verification, with no flag to convert it."""
    from transformers import AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny.model_config, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    model.config.tie_word_embeddings = True
    model.save_pretrained(tmp_path / "mistied")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=tmp_path / "mistied")))
    assert (f"error: --model_name {tmp_path / 'mistied'}: its config ties lm_head.weight and model.embed_tokens.weight "
            "(tie_word_embeddings true), but its weights hold them as different tensors; set \"tie_word_embeddings\": "
            "false in its config.json if they were trained apart") in capsys.readouterr().err.splitlines()
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config, tie_word_embeddings=True)
                                     ).save_pretrained(tmp_path / "tied")  # one tensor stored: nothing to compare
    preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=tmp_path / "tied")))


def test_a_model_that_ships_its_own_code_is_refused_naming_trust_remote_code(tiny, tmp_path, capsys) -> None:
    """transformers' reason ends with `trust_remote_code=True` on a line the one-line message left out, and the
    advice was "check the name, or log in for gated models"."""
    model = tmp_path / "custom"
    AutoConfig.from_pretrained(tiny.model_config).save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "custom-llama",
                                                            "auto_map": {"AutoConfig": "configuration.Custom"}}))
    (model / "configuration.py").write_text("from transformers import LlamaConfig\n\n\nclass Custom(LlamaConfig):\n"
                                            "    model_type = 'custom-llama'\n")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=model)))
    errors = capsys.readouterr().err.strip().splitlines()
    assert f"error: --model_name {model}: cannot load its config (it ships Python code of its own, which runs only " \
           "with --trust_remote_code true: read it first)" in errors, errors
