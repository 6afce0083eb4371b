"""Checkpoint → Hugging Face model folder (weights, config, generation config, tokenizer, model card), verified by
reloading it.

Memory: the model is built on the meta device and the checkpoint's model tensors are read (never its optimizer
state) into one copy that is assigned into it, so at most one copy of the weights exists; it is cast to --dtype tensor by tensor. Logits on a fixed input are taken from that model in the
checkpoint's dtype, the model is written and freed, and the folder is reloaded with `from_pretrained` and must
reproduce them (exactly when the dtype is unchanged). The folder is written under a hidden temporary name and
only renamed into place after that check, so a failed conversion never leaves or replaces an output folder.

generation_config.json is the base model's own when it has one (its sampling defaults and stop tokens: Gemma's
instruction models and Phi-3 keep their end-of-turn there only), else made from the model config; either way it
stops at the tokenizer's EOS and at the chat template's end-of-turn, where training taught the model to stop.
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from jsonargparse import ArgumentParser
from torch.nn import Module
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedModel

from app.checkpoint import (CheckpointError, checkpoint_dir, is_checkpoint, list_checkpoints,
                            read_metadata as read_checkpoint_metadata, read_model_weights, stored_tensor_shapes)
from app.checkpoint.files import publish
from app.checkpoint.state import MODEL_PREFIX
from app.cli import UsageError, command_parser, parse, run_command
from app.huggingface.upload import HubArgs, describe_upload, login_problem, push_folder
from app.model.build import meta_model, model_class
from app.prepare.chat_template import end_of_turn_id

EXIT_VERIFY_FAILED = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Largest logit difference accepted after a cast, relative to the largest reference logit (|logit|): bf16 keeps
# 8 mantissa bits (relative rounding 2^-9 per weight), fp16 keeps 11; errors accumulate over layers.
CAST_TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@dataclass
class ConvertArgs:
    """Conversion"""

    checkpoint: str
    """A checkpoint file, a sharded checkpoint folder, a checkpoints/ folder or a run folder (its latest checkpoint)."""
    output_dir: str
    """Folder to write the Hugging Face model to (with --all: one step-NNNNNNNN subfolder per checkpoint)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the written weights."""
    all: bool = False
    """Convert every checkpoint of the folder given as --checkpoint, not only the latest."""
    overwrite: bool = False
    """Replace a non-empty --output_dir (only after the new folder has been written and verified)."""
    max_shard_size: str = "5GB"
    """Largest safetensors file; bigger models are split into several with an index."""
    model_name: Optional[str] = None
    """Take the architecture from this hub id or folder instead of the checkpoint's recorded config."""
    model_config: Optional[str] = None
    """Take the architecture from this config.json (or folder holding one) instead of the checkpoint's."""
    tokenizer: Optional[str] = None
    """Tokenizer to save with the model; default: the one the run recorded (--tokenizer, data folder, model)."""


@dataclass
class Args(HubArgs, ConvertArgs):
    """Every option of convert_to_hf.py, flat."""


@dataclass
class Job:
    """One checkpoint to convert, with everything resolved before any work starts."""

    checkpoint: Path
    output_dir: Path
    metadata: dict[str, Any]
    model_config: PretrainedConfig
    tokenizer: str
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = field(repr=False)
    base_model: Optional[str] = None
    """The model training started from (--model_name of the run, or of this command): its generation config."""

    @property
    def step(self) -> int:
        return self.metadata["step"]


class BadInput(UsageError):
    """A user error, reported as one line with exit status 2."""


def build_parser() -> ArgumentParser:
    return command_parser("convert_to_hf.py", "Convert a train.py checkpoint into a Hugging Face model folder, verify "
                                              "it, and optionally push it to the Hub.", [ConvertArgs, HubArgs])


def parse_args(argv: Optional[list[str]] = None) -> Args:
    namespace = parse(build_parser(), argv)
    return Args(**{f.name: namespace[f.name] for f in fields(Args)})


# ---- finding checkpoints -------------------------------------------------------------------------------------

def checkpoints_in(folder: Path) -> dict[int, Path]:
    """Checkpoints by step in a run folder or in its checkpoints/ folder."""
    if folder.name == checkpoint_dir(".").name and not (folder / checkpoint_dir(".").name).is_dir():
        folder = folder.parent
    return list_checkpoints(folder)


def select_checkpoints(args: Args) -> list[tuple[Path, Path]]:
    """(checkpoint, output folder) pairs for --checkpoint, --output_dir and --all."""
    path, output = Path(args.checkpoint), Path(args.output_dir)
    if not path.exists():
        raise BadInput(f"--checkpoint {path}: no such file or folder")
    if is_checkpoint(path):
        if args.all:
            raise BadInput(f"--all converts a folder of checkpoints, but --checkpoint {path} is one checkpoint")
        return [(path, output)]
    found = checkpoints_in(path)
    if not found:
        raise BadInput(f"--checkpoint {path}: no step-*.ckpt checkpoint in it; give a checkpoint or a run folder")
    if args.all:
        return [(found[step], output / f"step-{step:08d}") for step in sorted(found)]
    return [(found[max(found)], output)]


# ---- reading what a checkpoint holds --------------------------------------------------------------------------

def read_metadata(path: Path) -> dict[str, Any]:
    try:
        metadata = read_checkpoint_metadata(path)
    except CheckpointError as error:
        raise BadInput(f"--checkpoint {error}; pick another one") from None
    if not isinstance(metadata, dict) or not isinstance(metadata.get("step"), int):
        raise BadInput(f"--checkpoint {path}: not a checkpoint written by train.py (no step); pick another one")
    return metadata


def stored_shapes(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name → (shape, dtype) of every model tensor, without reading the weights."""
    try:
        stored = stored_tensor_shapes(path)
    except ValueError as error:  # what the readers found wrong, e.g. a sharded folder's metadata
        raise BadInput(f"--checkpoint {path}: {error}; pick another one") from None
    except Exception as error:  # a truncated or foreign file
        raise BadInput(f"--checkpoint {path}: unreadable checkpoint ({type(error).__name__}); pick another one") from None
    shapes = {name.removeprefix(MODEL_PREFIX): (torch.Size(shape), dtype) for name, (dtype, shape) in stored.items()
              if name.startswith(MODEL_PREFIX)}
    if not shapes:
        raise BadInput(f"--checkpoint {path}: holds no model weights; pick another one")
    return shapes


def config_from_dict(saved: dict[str, Any]) -> PretrainedConfig:
    values = dict(saved)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def resolve_model_config(args: Args, metadata: dict[str, Any]) -> PretrainedConfig:
    """--model_config, else --model_name, else the config the run recorded; use_cache back on for generation."""
    source = args.model_config or args.model_name
    try:
        config = AutoConfig.from_pretrained(source) if source else config_from_dict(metadata["model_config"])
    except (OSError, ValueError, KeyError) as error:
        flag = f"--model_config {args.model_config}" if args.model_config else f"--model_name {args.model_name}"
        where = flag if source else f"--checkpoint {args.checkpoint}: its model_config"
        raise BadInput(f"{where} cannot be loaded ({str(error).splitlines()[0]}); give --model_config") from None
    config.use_cache = True
    return config


def resolve_tokenizer(args: Args, metadata: dict[str, Any]) -> str:
    """--tokenizer, else what the run recorded, else the data folder's tokenizer/, else the trained model's."""
    run = metadata.get("config") or {}
    from app.data.mixture import first_folder  # not at the top: app.data imports datasets, which conversion needs not

    bundled = Path(first_folder(run["train_data_dir"])) / "tokenizer" if run.get("train_data_dir") else None
    candidates = [args.tokenizer, metadata.get("tokenizer"),
                  str(bundled) if bundled and bundled.is_dir() else None, run.get("model_name")]
    name = next((c for c in candidates if c), None)
    if name is None:
        raise BadInput(f"--checkpoint {args.checkpoint} records no tokenizer; give --tokenizer")
    return name


def first_mismatch(expected: dict[str, torch.Size], stored: dict[str, tuple[torch.Size, torch.dtype]]) -> Optional[str]:
    """The first key the checkpoint lacks, has with another shape, or has in excess; None when they fit."""
    for name, shape in expected.items():
        if name not in stored:
            return f"has no {name} (shape {tuple(shape)})"
        if stored[name][0] != shape:
            return f"has {name} of shape {tuple(stored[name][0])}, the config expects {tuple(shape)}"
    extra = next((name for name in stored if name not in expected), None)
    return f"has {extra}, which the config does not have" if extra else None


def check_weights_fit(path: Path, config: PretrainedConfig, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    expected = {name: tensor.shape for name, tensor in meta_model(config).state_dict().items()}
    problem = first_mismatch(expected, shapes)
    if problem:
        raise BadInput(f"--checkpoint {path} does not fit the model config: it {problem}; "
                       "give the --model_config or --model_name it was trained with")


def check_tokenizer(name: str, config: PretrainedConfig) -> None:
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise BadInput(f"--tokenizer {name}: cannot load it ({str(error).splitlines()[0]}); "
                       "give a tokenizer folder or hub id") from None
    if len(tokenizer) > config.vocab_size:
        raise BadInput(f"--tokenizer {name} has {len(tokenizer)} tokens, more than the model's vocab_size "
                       f"{config.vocab_size}; give the tokenizer the model was trained with")


def check_output_dir(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise BadInput(f"--output_dir {output} is a file; give a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise BadInput(f"--output_dir {output} is not empty; choose another folder or add --overwrite true "
                       "(it is replaced only after the new model is verified)")


def plan(args: Args) -> list[Job]:
    """Resolve and check every checkpoint to convert; raises BadInput before anything is written."""
    problem = login_problem(args)
    if problem:
        raise BadInput(problem)
    pairs = select_checkpoints(args)
    if args.push_to_hub and len(pairs) > 1:
        raise BadInput("--push_to_hub uploads one model: drop --all, or push each step's folder separately")
    jobs = []
    for checkpoint, output in pairs:
        check_output_dir(output, args.overwrite)
        metadata = read_metadata(checkpoint)
        config = resolve_model_config(args, metadata)
        shapes = stored_shapes(checkpoint)
        check_weights_fit(checkpoint, config, shapes)
        tokenizer = resolve_tokenizer(args, metadata)
        check_tokenizer(tokenizer, config)
        base_model = args.model_name or (metadata.get("config") or {}).get("model_name")
        jobs.append(Job(checkpoint, output, metadata, config, tokenizer, shapes, base_model))
    return jobs


# ---- building, verifying and writing the model -----------------------------------------------------------------

def load_weights(job: Job) -> dict[str, torch.Tensor]:
    """The model tensors in their stored dtype, read once (no optimizer state is read)."""
    return read_model_weights(job.checkpoint)


def restore_non_persistent_buffers(model: PreTrainedModel) -> None:
    """Recompute buffers no state dict holds (rotary inv_freq) with transformers' own initialisation of them."""
    owners = set()
    for name, buffer in list(model.named_buffers()):
        module_name, _, buffer_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if buffer.is_meta and buffer_name in module._non_persistent_buffers_set:
            module.register_buffer(buffer_name, torch.empty_like(buffer, device="cpu"), persistent=False)
            owners.add(module)
    for module in owners:
        model._init_weights(module)
    still_meta = [name for name, tensor in model.state_dict(keep_vars=True).items() if tensor.is_meta]
    still_meta += [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if still_meta:
        raise RuntimeError(f"{still_meta[0]} was not restored from the checkpoint")


def model_from_checkpoint(job: Job) -> PreTrainedModel:
    """The model with the checkpoint's tensors assigned in place (no copy), ready to run."""
    model = meta_model(job.model_config)
    model.load_state_dict(load_weights(job), strict=True, assign=True)
    if getattr(job.model_config, "tie_word_embeddings", False):
        model.tie_weights()
    restore_non_persistent_buffers(model)
    return model.eval()


def probe_ids(config: PretrainedConfig) -> torch.Tensor:
    """A fixed batch of token ids (2 x up to 32), the same on every run and machine."""
    length = min(32, getattr(config, "max_position_embeddings", 32) or 32)
    return torch.randint(config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits_of(model: Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of a fixed input; an encoder-decoder's decoder reads the same ids."""
    decoder = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
    return model(input_ids=ids, **decoder).logits.float()


def tolerance(stored: torch.dtype, target: torch.dtype) -> float:
    """0 (exact) when no cast happens, else the tolerance of the less precise of the two dtypes."""
    if stored == target:
        return 0.0
    return max(CAST_TOLERANCE.get(stored, 0.0), CAST_TOLERANCE[target])


def logits_difference(reference: torch.Tensor, reloaded: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest absolute reference logit."""
    scale = reference.abs().max().clamp_min(1e-12)
    return float((reference - reloaded).abs().max() / scale)


def checkpoint_dtype(job: Job) -> torch.dtype:
    dtypes = {dtype for _, dtype in job.shapes.values()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def hyperparameters(run: dict[str, Any]) -> list[tuple[str, Any]]:
    batch = run.get("global_batch_size") or (
        f"{run.get('micro_batch_size')} per device x {run.get('gradient_accumulation_steps') or 1} accumulation "
        f"x {run.get('devices')} devices x {run.get('num_nodes', 1)} nodes")
    names = ("lr", "min_lr", "warmup_steps", "weight_decay", "max_step", "precision", "seed")
    return [("batch (sequences per step)", batch)] + [(n, run.get(n)) for n in names]


def model_card(job: Job, dtype: str, block_size: Optional[int]) -> str:
    """README.md of the output folder: where the model comes from and how it was trained."""
    run = job.metadata.get("config") or {}
    base = run.get("model_name")
    val_loss = job.metadata.get("val_loss")
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    lines += [f"base_model: {base}"] if base and not Path(base).exists() else []
    lines += ["tags:", "- fsdp-trainer", "---", "", f"# {job.output_dir.name}", "",
              f"Trained with fsdp-trainer (Lightning Fabric + FSDP) and converted from `{job.checkpoint.name}` "
              f"at optimizer step {job.step}.", "",
              "| | |", "|---|---|",
              f"| Base model | {base or 'none: trained from scratch from ' + str(run.get('model_config'))} |",
              f"| Architecture | {job.model_config.model_type}, {sum(s.numel() for s, _ in job.shapes.values()):,} "
              "parameters |",
              f"| Training data | {run.get('train_data_dir')} |",
              f"| Block size (tokens) | {block_size} |",
              f"| Step | {job.step} (epoch {job.metadata.get('epoch')}) |",
              f"| Final validation loss | {'%.4f' % val_loss if val_loss is not None else 'not evaluated'} |",
              f"| Weights dtype | {dtype} |"]
    lines += [f"| {name} | {value} |" for name, value in hyperparameters(run)]
    auto_class = model_class(job.model_config).__name__
    lines += ["", "## Usage", "", "```python", f"from transformers import {auto_class}, AutoTokenizer", "",
              'tokenizer = AutoTokenizer.from_pretrained("<this folder or repo>")',
              f'model = {auto_class}.from_pretrained("<this folder or repo>")', "```", ""]
    return "\n".join(lines)


def block_size_of(run: dict[str, Any]) -> Optional[int]:
    """The training block size, read from the data folder's train split when it is still there."""
    from app.data.mixture import first_folder

    data = first_folder(run["train_data_dir"]) if run.get("train_data_dir") else None
    if not data or not Path(data).is_dir():
        return None
    from datasets import load_from_disk

    try:
        return len(load_from_disk(data)["train"][0]["input_ids"])
    except (FileNotFoundError, KeyError, ValueError):
        return None


def generation_config(job: Job, tokenizer: Any) -> GenerationConfig:
    """The base model's generation config (its sampling defaults, its stop tokens) when it has one, else one made
    from the model config; its eos_token_id also lists the tokenizer's EOS and the chat template's end-of-turn."""
    config = None
    if job.base_model:
        try:
            config = GenerationConfig.from_pretrained(job.base_model)
        except (OSError, ValueError):  # none in the folder or repo, or the Hub out of reach: made below
            config = None
    config = config or GenerationConfig.from_model_config(job.model_config)
    own = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    stops = [i for i in dict.fromkeys([*own, tokenizer.eos_token_id, end_of_turn_id(tokenizer)]) if i is not None]
    config.eos_token_id = stops[0] if len(stops) == 1 else stops
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    return config


def write_model(job: Job, dtype: str, max_shard_size: str, folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the folder; return (logits of the checkpoint's weights, logits of the written folder)."""
    model = model_from_checkpoint(job)
    ids = probe_ids(job.model_config)
    reference = logits_of(model, ids)
    model.to(DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer)
    model.generation_config = generation_config(job, tokenizer)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    del model
    gc.collect()
    tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text(model_card(job, dtype, block_size_of(job.metadata.get("config") or {})))
    reloaded = model_class(job.model_config).from_pretrained(folder, dtype=DTYPES[dtype]).eval()
    return reference, logits_of(reloaded, ids)


def convert(job: Job, dtype: str, max_shard_size: str) -> float:
    """Write and verify one model folder; return the logits difference. Exit 1 (folder untouched) if it fails."""
    job.output_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{job.output_dir.name}.", suffix=".partial", dir=job.output_dir.parent))
    try:
        reference, reloaded = write_model(job, dtype, max_shard_size, temporary)
        difference, allowed = logits_difference(reference, reloaded), tolerance(checkpoint_dtype(job), DTYPES[dtype])
        if not difference <= allowed:
            raise VerificationFailed(f"verification failed: {job.output_dir} reproduces the logits of "
                                     f"{job.checkpoint} only to {difference:.2e} (allowed {allowed:.0e}); "
                                     "nothing was written")
        publish(temporary, job.output_dir)
        return difference
    finally:
        if temporary.exists():
            shutil.rmtree(temporary)


class VerificationFailed(Exception):
    """The written folder does not reproduce the checkpoint's logits: exit status 1."""


def run(args: Args) -> None:
    jobs = plan(args)
    for job in jobs:
        difference = convert(job, args.dtype, args.max_shard_size)
        print(f"{job.checkpoint} (step {job.step}) -> {job.output_dir} [{args.dtype}], "
              f"logits verified (max relative difference {difference:.1e})", flush=True)
    if args.push_to_hub:
        folder = jobs[0].output_dir
        if args.dry_run:
            print(describe_upload(folder, args))
        else:
            url = push_folder(folder, args, default_message=f"Upload {folder.name} (step {jobs[0].step})")
            print(f"pushed {folder} to {args.push_to_hub}: {url}")


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: one line on stderr and exit 2 for bad input, exit 1 when verification fails."""
    try:
        run_command("convert_to_hf.py", lambda: run(parse_args(argv)))
    except VerificationFailed as error:
        print(f"convert_to_hf.py: error: {error}", file=sys.stderr)
        sys.exit(EXIT_VERIFY_FAILED)
