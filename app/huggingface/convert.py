"""Checkpoint → Hugging Face model folder (weights, config, generation config, tokenizer, model card), verified by
reloading it.

Memory: the model is built on the meta device and the checkpoint's model tensors are read (never its optimizer
state) into one copy that is assigned into it, so at most one copy of the weights exists; it is cast to --dtype
tensor by tensor. Logits on a fixed input are taken from that model in the checkpoint's dtype, the model is written
and freed, and the folder is reloaded with `from_pretrained` and must reproduce them (exactly when the dtype is
unchanged). Every written tensor must also equal the checkpoint's own, read again tensor by tensor and cast to
--dtype: the logits cannot see a weight changed while the model was built, since their reference is that model.
The tokenizer, as `AutoTokenizer` loads it from the folder, must encode and decode probe texts as training did
(check_folder_tokenizer): the logits never involve it. The folder is written under a hidden temporary name and only renamed into place after these checks, so a failed
conversion never leaves or replaces an output folder.

generation_config.json is the base model's own when it has one (its sampling defaults and stop tokens: Gemma's
instruction models and Phi-3 keep their end-of-turn there only), else made from the model config; either way it
stops at the tokenizer's EOS and at the chat template's end-of-turn, where training taught the model to stop.
"""

from __future__ import annotations

import copy
import errno
import gc
import json
import math
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError
from tokenizers.processors import TemplateProcessing
from torch.nn import Module
from transformers import (AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)
from transformers.models.auto import tokenization_auto

from app.checkpoint import (CheckpointError, broken_checkpoint, checkpoint_dir, is_checkpoint, list_checkpoints,
                            read_metadata, read_model_weights, run_folder_of, run_tokenizer_dir, stored_tensor_shapes)
from app.checkpoint.files import BEST_FILE, publish, read_best
from app.checkpoint.sources import open_source
from app.checkpoint.state import MODEL_PREFIX
from app.cli import UsageError, first_line
from app.folders import NO_ROOM, prepared_tokenizer, real_folder, staging_folder, unusable_folder
from app.hub import (CHAT_TEMPLATE_DIFFERS, CONFIG_ERRORS, REMOTE_CODE, TOKENIZER_ADVICE, hub_reachable, is_hub_id,
                     load_problem, missing_model_problem, tokenizer_difference, unloadable_tokenizer, why_unreachable)
from app.huggingface.convert_cli import Args
from app.huggingface.generate import TRAINED_LENGTHS_FILE, source_input
from app.huggingface.prefetch import PrefetchError, reported_as
from app.huggingface.upload import describe_upload, login_problem, push_folder
from app.model.build import meta_model, model_class, tied_names
from app.prepare.chat_template import end_of_turn_id
from app.prepare.tokenizer import document_frame

EXIT_VERIFY_FAILED = 1
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name: what the card may name as base_model
REPO_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # owner/name or an early Hub model's bare name (gpt2)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Model config fields a --model_config / --model_name at conversion may change: they change neither the weights nor
# the logits (where the file came from, outputs and caching, dtype of loading, label names, the token ids that
# generation starts, pads and stops at). Any other difference from the config the run recorded is refused.
HARMLESS_FIELDS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "return_dict",
    "output_attentions", "output_hidden_states", "id2label", "label2id", "problem_type", "finetuning_task",
    "task_specific_params", "tokenizer_class", "prefix", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id"})


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
    trust_remote_code: bool = False

    @property
    def step(self) -> int:
        return self.metadata["step"]


class BadInput(UsageError):
    """A user error, reported as one line with exit status 2."""


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
    note_other_checkpoints(found[max(found)].parent, max(found))
    return [(found[max(found)], output)]


UNFINISHED_SAVE = re.compile(r"^\.step-(\d+)\.ckpt\.partial")
"""What a save that did not finish leaves (app/checkpoint/files.py begin_save): hidden, beside the checkpoints."""


def note_other_checkpoints(folder: Path, latest: int) -> None:
    """A run folder converts its latest checkpoint: say so where the run's best by validation loss (best.json) is
    another, or where a later save did not finish; the command named the latest alone."""
    best = read_best(folder.parent)
    if best and best["step"] != latest and (folder / best["checkpoint"]).exists():
        print(f"convert_to_hf.py: note: converting the latest checkpoint (step {latest}); the run's best by validation "
              f"loss is step {best['step']} (val_loss {best['val_loss']:.4f}, {BEST_FILE}): give --checkpoint "
              f"{folder / best['checkpoint']} to convert it", flush=True)
    unfinished = sorted(int(found.group(1)) for entry in folder.iterdir()
                        if (found := UNFINISHED_SAVE.match(entry.name)))
    if unfinished and unfinished[-1] > latest:
        print(f"convert_to_hf.py: note: the save of step {unfinished[-1]} did not finish (a .partial file is left): "
              f"the latest whole checkpoint is step {latest}", flush=True)


# ---- reading what a checkpoint holds --------------------------------------------------------------------------

def checked_metadata(path: Path) -> dict[str, Any]:
    """The checkpoint's metadata (app.checkpoint's read_metadata), refused in one line when it is none of train.py's
    or does not read whole (a sharded folder's file cut short ended the conversion in a BadZipFile traceback)."""
    broken = broken_checkpoint(path)
    if broken:
        raise BadInput(f"--checkpoint {broken}; pick another one")
    metadata = read_metadata(path)
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
        raise BadInput(f"--checkpoint {path}: unreadable checkpoint ({type(error).__name__}); pick another "
                       "one") from None
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
        config = (AutoConfig.from_pretrained(source, trust_remote_code=args.trust_remote_code) if source  # no prompt
                  else config_from_dict(metadata["model_config"]))
    except CONFIG_ERRORS as error:  # TypeError also: a checkpoint that recorded none
        flag = f"--model_config {args.model_config}" if args.model_config else f"--model_name {args.model_name}"
        where = flag if source else f"--checkpoint {args.checkpoint}: its model_config"
        advice = "fix its config.json, or give another --model_config" if source else "give --model_config"
        raise BadInput(f"{where} cannot be loaded ({load_problem(error)}); {advice}") from None
    config.use_cache = True
    return config


def resolve_tokenizer(args: Args, metadata: dict[str, Any], checkpoint: Path) -> str:
    """--tokenizer; else the run's: the first that loads of the copy train.py keeps in the run folder
    (`<run>/tokenizer`: the one it trained with, even after the data folder was prepared again, moved or deleted),
    what it recorded (a path or hub id), the data folder's tokenizer/, and the trained model's only when the run
    recorded no other: a checkpoint copied away from its run whose data folder was gone took the base model's
    tokenizer without a word, and the converted chat model lost its chat template and the end of turn it stops at."""
    return args.tokenizer or runs_tokenizer(args, metadata, checkpoint)


def runs_tokenizer(args: Args, metadata: dict[str, Any], checkpoint: Path) -> str:
    """The run's tokenizer (resolve_tokenizer without --tokenizer)."""
    run = metadata.get("config") or {}
    from app.data.mixture import first_folder  # not at the top: app.data imports datasets, which conversion needs not

    recorded = from_where_trained(metadata, metadata.get("tokenizer"))
    folder = run_folder_of(checkpoint)
    kept = run_tokenizer_dir(folder) if folder else None
    bundled = prepared_tokenizer(first_folder(run["train_data_dir"])) if run.get("train_data_dir") else None
    candidates = [str(kept) if kept and kept.is_dir() else None, recorded,
                  str(bundled) if bundled and bundled.is_dir() else None,
                  run.get("model_name") if recorded in (None, run.get("model_name")) else None]
    names = list(dict.fromkeys(c for c in candidates if c))
    if not names:
        raise BadInput(f"--checkpoint {args.checkpoint} records no tokenizer; give --tokenizer")
    for name in names:  # the first that loads; one that needs its own code stops here, not at the next candidate
        problem = tokenizer_problem(name, args.trust_remote_code)
        if problem is None:
            return name
        if problem == REMOTE_CODE:
            raise BadInput(f"--checkpoint {args.checkpoint}: the run's tokenizer {name} does not load ({problem})")
    if not recorded:
        return names[0]  # check_tokenizer says why it does not load
    state = ("no longer exists" if not Path(recorded).exists() and not HUB_ID.fullmatch(recorded)
             else f"does not load ({tokenizer_problem(recorded, args.trust_remote_code)})")
    where = f"{kept} has none" if kept else "the checkpoint lies in no run folder (<run>/checkpoints/)"
    raise BadInput(f"--checkpoint {args.checkpoint}: the run's tokenizer {recorded} {state} and {where}; give "
                   "--tokenizer PATH")


def tokenizer_problem(name: str, trust_remote_code: bool) -> Optional[str]:
    """Why the tokenizer `name` does not load; None when it does. A Hub id is asked of the Hub once, briefly
    (app/hub.py): transformers asked without a timeout."""
    if missing_model_problem("--tokenizer", name):  # its line names a flag: here the name is the run's
        return (f"no such folder, nor a Hub model of that name in the Hugging Face cache while {why_unreachable()}"
                if is_hub_id(name) else "no such folder")
    try:
        AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        return load_problem(error)
    return None


def from_where_trained(metadata: dict[str, Any], path: Optional[str]) -> Optional[str]:
    """A relative path the run recorded that is not there from here, taken from where training ran when the
    checkpoint records it (`cwd`)."""
    if not path or Path(path).is_absolute() or Path(path).exists():
        return path
    where = metadata.get("cwd") or (metadata.get("config") or {}).get("cwd")
    return str(Path(where) / path) if where and (Path(where) / path).exists() else path


def recorded_base_model(metadata: dict[str, Any]) -> Optional[str]:
    """The run's --model_name (for a run started with --init_from, the base model its checkpoint's run recorded); a
    relative path that is not there from here is taken from where training ran, when the checkpoint records it
    (`cwd`), so the base model's generation config and name are found."""
    return from_where_trained(metadata, metadata.get("base_model") or (metadata.get("config") or {}).get("model_name"))


def hub_id(base: Optional[str]) -> Optional[str]:
    """`base` when it names a Hub repository (owner/name, no such local path), for the card's base_model: field."""
    return base if base and HUB_ID.fullmatch(base) and not Path(base).exists() else None


SNAPSHOT = re.compile(r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<revision>[0-9a-f]{40})/?$")
"""A folder of the Hugging Face cache: the repository and commit it holds (what prefetch.py --revision prints)."""


def hub_origin(base: Optional[str], metadata: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
    """The Hub repository a base model comes from and the commit trained, when known: a Hub id with the commit the
    run recorded (a later prefetch moves `main`: the generation config read at `main` was another revision's), or
    a folder of the cache, whose path names both (the card called it a local folder)."""
    snapshot = SNAPSHOT.search(base) if base else None
    if snapshot:
        return f"{snapshot['owner']}/{snapshot['name']}", snapshot["revision"]
    if hub_id(base):
        return base, metadata.get("base_revision") if base == recorded_base_model(metadata) else None
    return None, None


def first_mismatch(expected: dict[str, torch.Size], stored: dict[str, tuple[torch.Size, torch.dtype]]) -> Optional[str]:
    """The first key the checkpoint lacks, has with another shape, or has in excess; None when they fit."""
    for name, shape in expected.items():
        if name not in stored:
            return f"has no {name} (shape {tuple(shape)})"
        if stored[name][0] != shape:
            return f"has {name} of shape {tuple(stored[name][0])}, the config expects {tuple(shape)}"
    extra = next((name for name in stored if name not in expected), None)
    return f"has {extra}, which the config does not have" if extra else None


def check_weights_fit(path: Path, config: PretrainedConfig, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                      trust_remote_code: bool) -> None:
    expected = {name: tensor.shape for name, tensor in meta_model(config, trust_remote_code).state_dict().items()}
    problem = first_mismatch(expected, shapes)
    if problem:
        raise BadInput(f"--checkpoint {path} does not fit the model config: it {problem}; "
                       "give the --model_config or --model_name it was trained with")


def override_flag(args: Args) -> str:
    return f"--model_config {args.model_config}" if args.model_config else f"--model_name {args.model_name}"


def changed_fields(recorded: dict[str, Any], config: PretrainedConfig) -> list[str]:
    """`field (recorded -> given)` for every field other than HARMLESS_FIELDS that the two configs set differently."""
    before, after = config_from_dict(recorded).to_dict(), config.to_dict()
    return [f"{name} ({before.get(name)!r} -> {after.get(name)!r})" for name in sorted(before.keys() | after.keys())
            if name not in HARMLESS_FIELDS and before.get(name) != after.get(name)]


def check_override(args: Args, metadata: dict[str, Any], config: PretrainedConfig) -> None:
    """An architecture given at conversion must be the one the run trained: the shapes fitting is not enough (another
    rope_theta, norm epsilon or a tie would change the model, and the logits check, run on that model, would pass).
    A checkpoint that records no loadable config is what the flags are for: nothing to compare with."""
    try:
        changes = changed_fields(metadata["model_config"], config)
    except (KeyError, ValueError, TypeError):
        return
    if changes:
        flag = override_flag(args)
        raise BadInput(f"{flag} differs from the config the run recorded in its checkpoint in {', '.join(changes)}: "
                       f"it would change the trained model; drop {flag.split()[0]} to convert with the recorded one "
                       "(edit the written config.json afterwards to change a field on purpose)")


def check_ties_keep_weights(args: Args, path: Path, config: PretrainedConfig,
                            shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    """A config that ties the lm_head to the embedding keeps only the embedding: refused when the checkpoint holds
    the two as different tensors (an untied run), whose trained lm_head would silently be replaced."""
    groups = {tuple(sorted([name, *others])) for name, others in tied_names(config, args.trust_remote_code).items()
              if others}
    with open_source(path) as source:
        for names in groups:
            stored = [n for n in names if n in shapes]
            tensors = []
            for name in stored:
                tensors.append(torch.empty(shapes[name][0], dtype=shapes[name][1]))
                source.read_elements_into(MODEL_PREFIX + name, 0, tensors[-1])
            if any(not torch.equal(tensors[0], other) for other in tensors[1:]):
                raise BadInput(f"{override_flag(args)} ties {' and '.join(stored)}, but --checkpoint {path} holds "
                               "them as different tensors (an untied run): the trained one would be replaced; give "
                               "a config with tie_word_embeddings false")


def check_tokenizer(name: str, config: PretrainedConfig, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise BadInput(f"--tokenizer {unloadable_tokenizer(name, error)}; {TOKENIZER_ADVICE}") from None
    if len(tokenizer) > config.vocab_size:
        raise BadInput(f"--tokenizer {name} has {len(tokenizer)} tokens, more than the model's vocab_size "
                       f"{config.vocab_size}; give the tokenizer the model was trained with")
    return tokenizer


def check_given_tokenizer(args: Args, metadata: dict[str, Any], checkpoint: Path,
                          given: PreTrainedTokenizerBase) -> None:
    """--tokenizer must encode as the run's tokenizer did: another vocabulary of the same size passed the size check,
    the logits verified (they do not involve the tokenizer) and the converted model generated nothing but blank lines.
    Another chat template is the user's to choose. Without a run's tokenizer to compare with, it is taken as given."""
    try:
        runs = runs_tokenizer(args, metadata, checkpoint)
        trained_with = AutoTokenizer.from_pretrained(runs, trust_remote_code=args.trust_remote_code)
    except (BadInput, OSError, ValueError):
        return
    difference = tokenizer_difference(given, trained_with)
    if difference and difference != CHAT_TEMPLATE_DIFFERS:
        raise BadInput(f"--tokenizer {args.tokenizer} is not the tokenizer the run trained with, {runs} "
                       f"({difference}); drop --tokenizer, or give one that encodes as that one does")


def check_output_dir(output: Path, overwrite: bool) -> None:
    """An output folder that exists must be empty, or with --overwrite a model folder: --overwrite replaces the whole
    folder, so a data folder, another run or a folder of the user's named by mistake would be deleted with it."""
    if output.exists() and not output.is_dir():
        raise BadInput(f"--output_dir {output} is a file; give a folder")
    unusable = unusable_folder(real_folder(output).absolute().parent)  # written beside it (a link's target)
    if unusable:
        raise BadInput(f"--output_dir {output}: {unusable}; choose a folder you can write to")
    if not output.is_dir() or not any(output.iterdir()):
        return
    if not overwrite:
        raise BadInput(f"--output_dir {output} is not empty; choose another folder or add --overwrite true "
                       "(it is replaced only after the new model is verified)")
    if not is_model_folder(output):
        raise BadInput(f"--output_dir {output}: --overwrite true replaces only an empty folder or a model folder "
                       f"(with {MODEL_CONFIG_FILE} and {' or '.join(WEIGHT_FILES)} weights), and this is neither; "
                       "choose another folder")
    others = sorted(path.name for path in output.iterdir()
                    if path.is_dir() or not any(path.match(pattern) for pattern in CONVERSION_FILES))
    if others:
        raise BadInput(f"--output_dir {output}: --overwrite true would also delete {', '.join(others[:5])}"
                       f"{' and more' if len(others) > 5 else ''}, which a conversion does not write; move them out "
                       "of it, or choose another folder")


MODEL_CONFIG_FILE = "config.json"
WEIGHT_FILES = ("*.safetensors", "*.bin")
CONVERSION_FILES = (MODEL_CONFIG_FILE, "generation_config.json", "README.md", TRAINED_LENGTHS_FILE, *WEIGHT_FILES,
                    "*.index.json",
                    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template.*", "vocab.*",
                    "merges.txt", "*.model", "*.spm", "*.tiktoken")
"""What save_pretrained writes for a model and its tokenizer (of any kind), and the model card: all that --overwrite
may delete. A model folder downloaded or cloned from the Hub holds more (original/, LICENSE, .git), and so may the
user's own notes."""


def check_not_the_base_model(output: Path, base_model: Optional[str]) -> None:
    """The pretrained folder the run started from is a model folder, which --overwrite true would replace: refused."""
    if base_model and Path(base_model).is_dir() and output.resolve() == Path(base_model).resolve():
        raise BadInput(f"--output_dir {output} is the base model folder the run started from (--model_name); "
                       "choose another folder (--overwrite true would replace it)")


def is_model_folder(folder: Path) -> bool:
    """A Hugging Face model folder, such as an earlier conversion wrote: its config and weights."""
    return (folder / MODEL_CONFIG_FILE).is_file() and any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES)


def check_apart_from_checkpoint(output: Path, checkpoint: Path) -> None:
    """Refuse an output folder that is or holds the checkpoint or its run folder, or lies inside the checkpoint or
    the run's checkpoints/ (paths resolved): --overwrite replaces the output folder, so it would delete them. A
    folder inside the run folder but not under checkpoints/ (`<run>/hf`) deletes nothing and is accepted."""
    checkpoint = checkpoint.resolve()
    guarded = [("the checkpoint", checkpoint, ("is", "holds", "lies inside"))]
    if checkpoint.parent.name == checkpoint_dir(".").name:
        guarded += [("the run folder", checkpoint.parent.parent, ("is", "holds")),
                    ("the run's checkpoints folder", checkpoint.parent, ("lies inside",))]
    target = output.resolve()
    relations = {"is": lambda path: target == path, "holds": lambda path: path.is_relative_to(target),
                 "lies inside": lambda path: target.is_relative_to(path)}
    for relation, applies in relations.items():
        for what, path, guarded_against in guarded:
            if relation in guarded_against and applies(path):
                raise BadInput(f"--output_dir {output} {relation} {what} {path}; choose a folder apart from it "
                               "(--overwrite true would delete it)")


def shard_size_problem(max_shard_size: str) -> Optional[str]:
    """A --max_shard_size that save_pretrained would refuse only after the model was loaded and verified."""
    from huggingface_hub.serialization._base import parse_size_to_int  # what save_pretrained's sharding reads it with

    try:
        parse_size_to_int(max_shard_size)
    except ValueError:
        return f"--max_shard_size {max_shard_size}: not a size in TB, GB, MB or KB (e.g. 5GB, 500MB)"
    return None


def given_model_problem(args: Args) -> Optional[str]:
    """A --model_name, --model_config or --tokenizer that is no folder here nor a Hub model that can be had, in one
    line at once: offline, transformers waited out a minute of the Hub's retries first, and a missing folder was
    answered with a rule about repository names."""
    if args.model_name and args.model_config:  # the architecture from one, the generation config from the other
        return ("give one of --model_name and --model_config: each names the architecture to write the weights "
                "with")
    given = {"--model_name": args.model_name, "--model_config": args.model_config, "--tokenizer": args.tokenizer}
    return next(filter(None, (missing_model_problem(flag, name) for flag, name in given.items() if name)), None)


def plan(args: Args) -> list[Job]:
    """Resolve and check every checkpoint to convert; raises BadInput before anything is written."""
    problem = login_problem(args) or shard_size_problem(args.max_shard_size) or given_model_problem(args)
    if problem:
        raise BadInput(problem)
    pairs = select_checkpoints(args)
    if args.push_to_hub and len(pairs) > 1:
        raise BadInput("--push_to_hub uploads one model: drop --all, or push each step's folder separately")
    jobs = []
    for checkpoint, output in pairs:
        check_apart_from_checkpoint(output, checkpoint)
        check_output_dir(output, args.overwrite)
        metadata = checked_metadata(checkpoint)
        config = resolve_model_config(args, metadata)
        shapes = stored_shapes(checkpoint)
        check_weights_fit(checkpoint, config, shapes, args.trust_remote_code)
        if args.model_config or args.model_name:
            check_override(args, metadata, config)
            check_ties_keep_weights(args, checkpoint, config, shapes)
        tokenizer = resolve_tokenizer(args, metadata, checkpoint)
        loaded = check_tokenizer(tokenizer, config, args.trust_remote_code)
        if args.tokenizer:
            check_given_tokenizer(args, metadata, checkpoint, loaded)
        base_model = args.model_name or recorded_base_model(metadata)
        check_not_the_base_model(output, base_model)
        if not (base_model or args.model_config):
            take_the_tokenizers_special_ids(config, loaded)
        jobs.append(Job(checkpoint, output, metadata, config, tokenizer, shapes, base_model, args.trust_remote_code))
    return jobs


# ---- building, verifying and writing the model -----------------------------------------------------------------

def load_weights(job: Job) -> dict[str, torch.Tensor]:
    """The model tensors in their stored dtype, read once (no optimizer state is read)."""
    return read_model_weights(job.checkpoint)


def restore_non_persistent_buffers(model: PreTrainedModel) -> None:
    """Recompute buffers no state dict holds (rotary inv_freq, Gemma's embed_scale) with transformers' own
    initialisation of them. Never on the module itself: `_init_weights` initialises the whole module, and Gemma's
    embedding owns embed_scale, so its trained weight (and the lm_head tied to it) would be drawn afresh."""
    missing: dict[Module, list[str]] = {}
    for name, buffer in model.named_buffers():
        module_name, _, buffer_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if buffer.is_meta and buffer_name in module._non_persistent_buffers_set:
            missing.setdefault(module, []).append(buffer_name)
    for module, names in missing.items():
        initialise_buffers(model, module, names)
    still_meta = [name for name, tensor in model.state_dict(keep_vars=True).items() if tensor.is_meta]
    still_meta += [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if still_meta:
        raise RuntimeError(f"{still_meta[0]} was not restored from the checkpoint")


def initialise_buffers(model: PreTrainedModel, module: Module, names: list[str]) -> None:
    """Run `_init_weights` on a stand-in of `module` whose parameters and other buffers are on the meta device (no
    memory, nothing to overwrite), then take only the buffers `names` from it."""
    stand_in = copy.copy(module)
    stand_in._parameters = {name: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                                             p.requires_grad)
                            for name, p in module._parameters.items()}
    stand_in._buffers = {name: None if b is None else torch.empty_like(b, device="cpu" if name in names else "meta")
                         for name, b in module._buffers.items()}
    model._init_weights(stand_in)
    for name in names:
        module.register_buffer(name, stand_in._buffers[name], persistent=False)


def model_from_checkpoint(job: Job) -> PreTrainedModel:
    """The model with the checkpoint's tensors assigned in place (no copy), ready to run."""
    model = meta_model(job.model_config, job.trust_remote_code)
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


def kept_in_fp32(model: Module, dtype: torch.dtype) -> list[str]:
    """The modules transformers keeps in float32 when it loads the model in `dtype` (router biases under bfloat16;
    T5's `wo` under float16 too), which a folder written in `dtype` keeps so: cast down, they were loaded back as
    float32 holding rounded values, and the weight check refused every such conversion."""
    kept = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        kept += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return kept


def is_kept(name: str, kept: list[str]) -> bool:
    return any(re.search(rf"(^|\.){re.escape(pattern)}($|\.)", name) for pattern in kept)


def round_parameters(model: Module, dtype: torch.dtype) -> None:
    """Each parameter rounded to `dtype` and back, in place: the values a folder written in `dtype` holds, in the
    dtype the model computes in (its buffers, which from_pretrained computes afresh, are left as they are; so are
    the modules kept in float32)."""
    kept = kept_in_fp32(model, dtype)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not is_kept(name, kept):
                parameter.copy_(parameter.to(dtype))


def cast_keeping_fp32(model: Module, dtype: torch.dtype) -> None:
    """The model in `dtype`, but for the modules transformers keeps in float32 (kept_in_fp32)."""
    kept = kept_in_fp32(model, dtype)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if is_kept(name, kept) else dtype)


def logits_difference(reference: torch.Tensor, reloaded: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest absolute reference logit."""
    scale = reference.abs().max().clamp_min(1e-12)
    return float((reference - reloaded).abs().max() / scale)


def checkpoint_dtype(job: Job) -> torch.dtype:
    dtypes = {dtype for _, dtype in job.shapes.values()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def hyperparameters(run: dict[str, Any], global_batch_size: Optional[int] = None) -> list[tuple[str, Any]]:
    """The card's training settings; the batch is the checkpoint's own global batch (a resume may have changed the
    layout the run's config records), else what that config gives."""
    batch = global_batch_size or run.get("global_batch_size") or (
        f"{run.get('micro_batch_size')} per device x {run.get('gradient_accumulation_steps') or 1} accumulation "
        f"x {run.get('devices')} devices x {run.get('num_nodes', 1)} nodes")
    names = ("lr", "min_lr", "warmup_steps", "weight_decay", "max_step", "precision", "seed")
    given = [("max_tokens", run["max_tokens"])] if run.get("max_tokens") else []
    given += [("frozen parameters", ", ".join(run["freeze"]))] if run.get("freeze") else []
    given += [("model config overrides", json.dumps(run["model_overrides"]))] if run.get("model_overrides") else []
    return [("batch (sequences per step)", batch)] + [(n, run.get(n)) for n in names] + decay_rows(run) + given


def decay_rows(run: dict[str, Any]) -> list[tuple[str, str]]:
    """The learning rate's decay when it is not the cosine over every step after warmup (warmup-stable-decay, a
    linear or sqrt shape); none for that usual one, or without a decay."""
    shape, ratio = run.get("lr_decay_type", "cosine"), run.get("lr_decay_ratio", 1)
    if not run.get("lr_decay") or (shape, ratio) == ("cosine", 1):
        return []
    return [("lr decay", f"{shape} over the last {ratio:g} of the steps")]


def base_model_row(base: Optional[str], run: dict[str, Any], repo: Optional[str], revision: Optional[str]) -> str:
    """The base model (for a run started with --init_from, the one its checkpoint's run started from), and that
    checkpoint by its folders' names alone: `org/tiny (revision ...), continued from step-00001000.ckpt of run
    llama3`."""
    origin = base_origin(base, run, repo, revision)
    if not run.get("init_from"):
        return origin
    start = Path(run["init_from"])
    checkpoint = start.name + (f" of run {folder.name}" if (folder := run_folder_of(start)) else "")
    return f"{origin}, continued from the train.py checkpoint {checkpoint}" if base else \
        f"a train.py checkpoint: {checkpoint}"


def base_origin(base: Optional[str], run: dict[str, Any], repo: Optional[str], revision: Optional[str]) -> str:
    if not base:
        return f"none: trained from scratch from {folder_names(str(run.get('model_config')))}"
    if repo:
        return f"{repo} (revision {revision})" if revision else repo
    if Path(base).exists():
        return f"{folder_names(base)} (local folder)"
    return f"{folder_names(base)} (not found from here; not an owner/name Hub id)"


def folder_names(paths: str) -> str:
    """Local paths as their last names only: the card is published with --push_to_hub (public unless --private),
    and `/home/jdoe/projects/...` told the world a user name and a cluster's layout."""
    return re.sub(r"[^\s,]*/", "", paths)


def validation_row(val_loss: Optional[float], measured_at: Optional[int], step: int) -> str:
    """The checkpoint's last validation loss, with the step it was measured at when that is not the checkpoint's
    (a stop, or saves between evaluations): a card once gave the base model's step-0 loss as the fine-tuned one's."""
    if val_loss is None:
        return "not evaluated"
    if measured_at is not None and measured_at != step:
        return f"{val_loss:.4f} at step {measured_at} (not evaluated at step {step})"
    return f"{val_loss:.4f}"


def model_card(job: Job, dtype: str, lengths: Optional[str]) -> str:
    """README.md of the output folder: where the model comes from and how it was trained. The Hub's pipeline tag is
    text2text-generation for an encoder-decoder (text-generation named a T5 a causal model)."""
    run = job.metadata.get("config") or {}
    base = recorded_base_model(job.metadata)
    val_loss = job.metadata.get("val_loss")
    task = "text2text-generation" if job.model_config.is_encoder_decoder else "text-generation"
    lines = ["---", "library_name: transformers", f"pipeline_tag: {task}"]
    repo, revision = hub_origin(base, job.metadata)
    lines += [f"base_model: {repo}"] if repo else []
    lines += ["tags:", "- fsdp-trainer", "---", "", f"# {job.output_dir.name}", "",
              f"Trained with fsdp-trainer (Lightning Fabric + FSDP) and converted from `{job.checkpoint.name}` "
              f"at optimizer step {job.step}.", "",
              "| | |", "|---|---|",
              f"| Base model | {base_model_row(base, run, repo, revision)} |",
              f"| Architecture | {job.model_config.model_type}, {sum(s.numel() for s, _ in job.shapes.values()):,} "
              "parameters |",
              f"| Training data | {folder_names(str(run.get('train_data_dir')))} |",
              f"| Sequence length (tokens) | {lengths} |",
              f"| Step | {job.step} (epoch {job.metadata.get('epoch')}) |",
              f"| Validation loss | {validation_row(val_loss, job.metadata.get('val_loss_step'), job.step)} |",
              f"| Weights dtype | {dtype} |"]
    lines += [f"| {name} | {value} |" for name, value in hyperparameters(run, job.metadata.get("global_batch_size"))]
    auto_class = model_class(job.model_config).__name__
    lines += ["", "## Usage", "", "```python", f"from transformers import {auto_class}, AutoTokenizer", "",
              'tokenizer = AutoTokenizer.from_pretrained("<this folder or repo>")',
              f'model = {auto_class}.from_pretrained("<this folder or repo>")', "```", ""]
    versions = job.metadata.get("versions") or {}  # of the run that wrote the checkpoint (none before they were kept)
    if versions:
        lines += ["## Framework versions", "", *(f"- {name} {number}" for name, number in versions.items()), ""]
    return "\n".join(lines)


def data_stats(run: dict[str, Any]) -> dict[str, Any]:
    """The run's data folder's stats.json, when it is still there ({} otherwise)."""
    from app.data.formats import read_stats
    from app.data.mixture import first_folder

    try:
        return read_stats(first_folder(run["train_data_dir"])) if run.get("train_data_dir") else {}
    except (OSError, ValueError):
        return {}


def sequence_lengths_of(run: dict[str, Any]) -> Optional[str]:
    """The lengths the model trained at, from the data folder's stats.json when it is still there: the block size,
    or an encoder-decoder's longest source and target (the first row's length, read before, was one source's)."""
    stats = data_stats(run)
    if stats.get("max_source_length"):
        return f"sources up to {stats['max_source_length']}, targets up to {stats.get('max_target_length')}"
    block = stats.get("block_size")
    if not block:
        return None
    return f"{block}" if stats.get("packing", True) else f"examples up to {block}, one per row"


def keep_source_length(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig,
                       run: dict[str, Any]) -> Optional[int]:
    """The length an encoder-decoder's training sources were cut to (prepare_data.py --max_source_length), when the
    data folder is still there: its tokenizer takes it as model_max_length (what a tokenizer's truncation reads),
    and the folder records it in TRAINED_LENGTHS_FILE, from which generate.py cuts sources as the run's samples read
    them. It read them whole, and 7 of 9 summaries of sources longer than the 128 tokens trained on differed from the
    run's (ROUGE-1 0.166 against the run's 0.207). A Hub tokenizer's own model_max_length (T5's 512) says nothing of
    how a model was trained, so generate.py reads the record, not it."""
    trained = data_stats(run).get("max_source_length")
    if not (config.is_encoder_decoder and isinstance(trained, int) and trained > 0):
        return None
    tokenizer.model_max_length = trained
    return trained


def generation_config(job: Job, tokenizer: Any) -> GenerationConfig:
    """The base model's generation config (its sampling defaults, its stop tokens) when it has one, else one made
    from the model config; its eos_token_id also lists the tokenizer's EOS and the chat template's end-of-turn."""
    config, problem = None, None
    if job.base_model and not Path(job.base_model).exists() and not REPO_NAME.fullmatch(job.base_model):
        problem = "no such folder from here, and not a Hub id"
    elif job.base_model:
        problem = missing_model_problem("--model_name", job.base_model)  # the Hub asked once, briefly (app/hub.py)
        try:
            config = None if problem else trained_generation_config(job)
        except (OSError, ValueError) as error:  # none in the folder or repo, no such folder, the Hub out of reach
            problem = first_line(error)[:160]
    if problem:
        print(f"convert_to_hf.py: note: the generation config of the base model {job.base_model} could not be read "
              f"({problem}); generation_config.json is made from the model config", flush=True)
    config = config or GenerationConfig.from_model_config(job.model_config)
    own = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    stops = [i for i in dict.fromkeys([*own, tokenizer.eos_token_id, end_of_turn_id(tokenizer)]) if i is not None]
    config.eos_token_id = stops[0] if len(stops) == 1 else stops
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    return config


def trained_generation_config(job: Job) -> GenerationConfig:
    """The base model's generation config at the commit the run trained from, else (that commit no longer in the
    cache, nor the Hub in reach) at the revision its name loads today, said."""
    repo, revision = hub_origin(job.base_model, job.metadata)
    if revision and repo == job.base_model:
        if isinstance(try_to_load_from_cache(repo, "config.json", revision=revision), str) or hub_reachable():
            return GenerationConfig.from_pretrained(job.base_model, revision=revision)  # none there: its own note
        print(f"convert_to_hf.py: note: the base model {repo} at the revision trained ({revision}) is neither "
              "cached nor on the Hub from here: its generation config is read at the revision its name loads today",
              flush=True)
    return GenerationConfig.from_pretrained(job.base_model)


def give_pad_token(tokenizer: Any, config: PretrainedConfig) -> None:
    """The model's pad token (an encoder-decoder's padded batches and decoder start) on a tokenizer without one, as
    prepare_data.py's trained SentencePiece tokenizer is: the converted folder could not pad a batch of sources
    (`padding=True` raised), for a summarization pipeline or Seq2SeqTrainer alike."""
    pad = getattr(config, "pad_token_id", None)  # absent from some configs (CodeGen's) in transformers 5
    if tokenizer.pad_token is None and isinstance(pad, int) and 0 <= pad < len(tokenizer):
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)


TOKENIZER_PROBES = ("def load(path):\n    return json.loads(path.read_text())\n",
                    "Hello,  world!\t¿Qué tal? 你好 🙂")


@dataclass(frozen=True)
class Encoding:
    ids: list[int]
    decoded: str


def trained_encoding(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, text: str) -> Encoding:
    """`text` as training gave it to the model, and those tokens decoded: an encoder-decoder's source as
    prepare_data.py framed every source (ending with one EOS), a causal model's prompt as the tokenizer encodes it
    (its own BOS)."""
    if config.is_encoder_decoder:
        ids = source_input(tokenizer, text)["input_ids"][0].tolist()
    else:
        ids = tokenizer(text, split_special_tokens=True)["input_ids"]
    return Encoding(ids, tokenizer.decode(ids))


def take_the_tokenizers_special_ids(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """A model trained from a config file (no base model) carries the file's BOS and EOS ids, whatever its tokenizer:
    Llama's defaults 1 and 2 beside a tokenizer whose EOS is 399 were written to config.json, and
    generation_config.json stopped at token 2, the piece '#'. The tokenizer's ids are written instead, as the
    Trainer's `align_special_tokens` does, and said. A pretrained model keeps its own (Llama-3-Instruct's stops),
    and a --model_config given here is written as given."""
    changed = []
    for kind in ("bos", "eos"):
        own, ours = getattr(config, f"{kind}_token_id", None), getattr(tokenizer, f"{kind}_token_id")
        if ours is not None and own != ours and not (isinstance(own, list) and ours in own):
            setattr(config, f"{kind}_token_id", ours)
            changed.append(f"{kind}_token_id {own} -> {ours} ({tokenizer.convert_ids_to_tokens(ours)!r})")
    if changed:
        print(f"convert_to_hf.py: note: the model config's special tokens are not the tokenizer's: "
              f"{', '.join(changed)} written to config.json and generation_config.json", flush=True)


def end_sources_with_eos(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig) -> None:
    """An encoder-decoder trained on sources that prepare_data.py ended with an EOS the tokenizer does not add (the
    SentencePiece tokenizer it trains adds BOS only; T5's own adds EOS): the saved tokenizer adds it too, so that a
    user's `tokenizer(source)` gives the model sources like those it learnt from (without the EOS, 30 of 60 greedy
    summaries of a T5 trained for 250 steps changed)."""
    frame = document_frame(tokenizer)
    if not (config.is_encoder_decoder and frame.appended and getattr(tokenizer, "is_fast", False)):
        return

    def framed(sequence: str, type_id: int) -> str:
        name = tokenizer.convert_ids_to_tokens
        return " ".join([*(f"{name(i)}:{type_id}" for i in frame.prefix), f"${sequence}:{type_id}",
                         *(f"{name(i)}:{type_id}" for i in frame.suffix + frame.appended)])

    specials = dict.fromkeys(frame.prefix + frame.suffix + frame.appended)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=framed("A", 0), pair=f"{framed('A', 0)} {framed('B', 1)}",
        special_tokens=[(tokenizer.convert_ids_to_tokens(i), i) for i in specials])


def autotokenizer_difference(folder: Path, model_type: str, trained_class: type, expected: dict[str, Encoding],
                             trust_remote_code: bool) -> Optional[str]:
    """How the tokenizer that `AutoTokenizer` loads from a model folder encodes or decodes the `expected` texts
    otherwise than training did; None when alike. transformers picks the class of some model types' tokenizers
    itself (Qwen2's, Phi-3's), whatever tokenizer_config.json names, and Qwen2Tokenizer laid its byte-level rules
    over a SentencePiece vocabulary: every prompt became other tokens, and the verified model generated blanks."""
    loaded = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    chosen = (f" (as {type(loaded).__name__}: transformers picks that class for model type {model_type}, whatever "
              "tokenizer_config.json names)" if type(loaded) is not trained_class else "")
    for text, trained in expected.items():
        got = loaded(text, split_special_tokens=True)["input_ids"]
        if got != trained.ids:
            k = next((i for i, (a, b) in enumerate(zip(got, trained.ids)) if a != b), min(len(got), len(trained.ids)))
            return (f"as AutoTokenizer loads it{chosen}, encodes {text[:16]!r}... otherwise from token {k} on "
                    f"({got[k:k + 4]} where the run's tokenizer gives {trained.ids[k:k + 4]})")
        if loaded.decode(trained.ids) != trained.decoded:
            return (f"as AutoTokenizer loads it{chosen}, decodes its tokens as {loaded.decode(trained.ids)[:24]!r}..., "
                    f"not {trained.decoded[:24]!r}...")
    return None


def converted_tokenizer_problem(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig,
                                trust_remote_code: bool) -> Optional[str]:
    """What a converted folder of this model and tokenizer would load otherwise (autotokenizer_difference), found
    before training: only for the model types whose tokenizer class transformers picks itself."""
    if config.model_type not in getattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", ()):
        return None
    expected = {text: trained_encoding(tokenizer, config, text) for text in TOKENIZER_PROBES}
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        config.save_pretrained(folder)
        return autotokenizer_difference(Path(folder), config.model_type, type(tokenizer), expected, trust_remote_code)


def check_folder_tokenizer(job: Job, folder: Path, trained_class: type, expected: dict[str, Encoding]) -> None:
    """The tokenizer the written folder gives `AutoTokenizer` must encode and decode as training did."""
    difference = autotokenizer_difference(folder, job.model_config.model_type, trained_class, expected,
                                          job.trust_remote_code)
    if difference:
        raise VerificationFailed(
            f"verification failed: the tokenizer of {job.output_dir}, {difference}; nothing was written. A "
            f"{job.model_config.model_type} model converts with a tokenizer of the class that model type loads: "
            "train it with one")


def write_model(job: Job, dtype: str, max_shard_size: str, folder: Path) -> tuple[torch.Tensor, torch.Tensor, Module,
                                                                                Optional[str]]:
    """Write the folder; return the logits of the checkpoint's weights as stored, those of the written weights in
    the checkpoint's dtype (the same without a cast), the model the folder loads as, and what loading it found
    missing or left over (None when nothing). Its tokenizer is checked here (VerificationFailed)."""
    model = model_from_checkpoint(job)
    ids = probe_ids(job.model_config)
    as_stored = written = logits_of(model, ids)
    if casts(job, dtype):
        round_parameters(model, DTYPES[dtype])
        written = logits_of(model, ids)
    cast_keeping_fp32(model, DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer, trust_remote_code=job.trust_remote_code)
    expected = {text: trained_encoding(tokenizer, job.model_config, text) for text in TOKENIZER_PROBES}
    give_pad_token(tokenizer, job.model_config)
    end_sources_with_eos(tokenizer, job.model_config)
    source_length = keep_source_length(tokenizer, job.model_config, job.metadata.get("config") or {})
    model.generation_config = generation_config(job, tokenizer)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    readable_as_the_other_files(folder)
    del model
    gc.collect()
    tokenizer.save_pretrained(folder)
    if source_length:
        (folder / TRAINED_LENGTHS_FILE).write_text(json.dumps({"max_source_length": source_length}) + "\n")
    check_folder_tokenizer(job, folder, type(tokenizer), expected)
    (folder / "README.md").write_text(model_card(job, dtype, sequence_lengths_of(job.metadata.get("config") or {})))
    reloaded, loading = load_folder(job, folder, DTYPES[dtype])
    return as_stored, written, reloaded, loading_problem(loading)


def load_folder(job: Job, folder: Path, dtype: torch.dtype) -> tuple[Module, dict[str, Any]]:
    """The written folder as a user loads it, in `dtype`, and transformers' loading info."""
    model, loading = model_class(job.model_config).from_pretrained(
        folder, dtype=dtype, trust_remote_code=job.trust_remote_code, output_loading_info=True)
    return model.eval(), loading


def casts(job: Job, dtype: str) -> bool:
    return checkpoint_dtype(job) != DTYPES[dtype]


def readable_as_the_other_files(folder: Path) -> None:
    """safetensors creates its files readable by their owner alone (0600) where every other file of the folder gets
    0666 less the umask: a serving account, or a colleague sharing the group, could not read the weights."""
    umask = os.umask(0)
    os.umask(umask)
    for weights in folder.glob("*.safetensors"):
        weights.chmod(0o666 & ~umask)


def loading_problem(loading: dict[str, Any]) -> Optional[str]:
    """What transformers' loading of the written folder reports (after its renaming of older names): a tensor the
    model needs and the files lack, which it initialises silently (a norm weight of ones would then equal the
    checkpoint's), or one the files hold and the model does not read."""
    missing, unexpected = sorted(loading.get("missing_keys") or ()), sorted(loading.get("unexpected_keys") or ())
    if missing:
        return f"loading it initialises {missing[0]}, which its files lack" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    if unexpected:
        return f"its files hold {unexpected[0]}, which the model does not read"
    return None


def first_weight_difference(job: Job, reloaded: Module) -> Optional[str]:
    """The first checkpoint tensor the written folder, loaded as a user loads it (`reloaded`), does not hold as
    stored, cast to the written dtype (exactly when it is the stored one, else to its rounding); None when every one
    is there and nothing else is. Compared with the loaded model rather than the files' names: transformers writes
    some architectures under older names than its modules' (Mixtral's experts one by one, GPT-NeoX's embed_out) and
    renames them on loading. The logits cannot tell: their reference is the model built here, so a weight changed
    while building it (a buffer restored by re-initialising its module, a tie that replaced a trained lm_head)
    changes both sides."""
    loaded, aliases = reloaded.state_dict(), tied_names(job.model_config, job.trust_remote_code)
    seen = set()
    with open_source(job.checkpoint) as source:
        for key, (dtype, shape) in source.shapes().items():
            if not key.startswith(MODEL_PREFIX):
                continue
            name = key.removeprefix(MODEL_PREFIX)
            held = next((n for n in [name, *aliases.get(name, [])] if n in loaded), None)
            if held is None:
                return f"the checkpoint's {name} is not in it"
            seen |= {name, *aliases.get(name, [])}
            stored = torch.empty(shape, dtype=dtype)
            source.read_elements_into(key, 0, stored)
            tensor = loaded[held]
            if tensor.shape != stored.shape or not torch.equal(tensor, stored.to(tensor.dtype)):
                where = name if held == name else f"{held} (tied to {name})"
                return f"its {where} differs from the checkpoint's {name}"
    extra = next((name for name in loaded if name not in seen), None)
    return f"it holds {extra}, which the checkpoint does not" if extra else None


def convert(job: Job, dtype: str, max_shard_size: str) -> tuple[float, Optional[float]]:
    """Write and verify one model folder (every tensor against the checkpoint's, then the logits); return the logits
    difference and, after a cast, how far the cast moved them. Exit 1 (folder untouched) if it fails, 2 if the
    checkpoint's tensors cannot be read.

    The logits are compared in the checkpoint's dtype, where the written folder must reproduce exactly those of the
    checkpoint's weights rounded to --dtype: compared in --dtype with the stored weights' logits, the rounding's own
    effect had to be allowed for (5e-2 of the largest logit in bf16), which a flipped top-k expert of a small
    Mixtral exceeded (5.5e-2) and a large model's 32 layers can. That effect is said, and refused only where the
    logits in --dtype are not finite (beyond float16's range)."""
    output_dir = real_folder(job.output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = staging_folder(output_dir)
    temporary.mkdir()
    try:
        as_stored, written, reloaded, problem = write_model(job, dtype, max_shard_size, temporary)
        problem = problem or first_weight_difference(job, reloaded)
        if problem:
            raise VerificationFailed(f"verification failed: {job.output_dir} would not hold the weights of "
                                     f"{job.checkpoint}: {problem}; nothing was written")
        ids, cast = probe_ids(job.model_config), None
        if casts(job, dtype):
            cast = logits_difference(as_stored, logits_of(reloaded, ids))
            if not math.isfinite(cast):
                raise VerificationFailed(f"verification failed: in {dtype} the model's logits are not finite (its "
                                         "values exceed the dtype's range); convert with --dtype bfloat16 or float32; "
                                         "nothing was written")
            del reloaded
            gc.collect()
            reloaded, _ = load_folder(job, temporary, checkpoint_dtype(job))
        difference = logits_difference(written, logits_of(reloaded, ids))
        if difference != 0:
            raise VerificationFailed(f"verification failed: {job.output_dir} reproduces the logits of "
                                     f"{job.checkpoint} only to {difference:.2e} (allowed 0e+00); nothing was written")
        publish(temporary, output_dir)
        return difference, cast
    except CheckpointError as error:  # the tensors' bytes are first read here: a truncated file, a rank's missing
        raise BadInput(f"--checkpoint {error}; pick another one") from None
    except (OSError, SafetensorError) as error:  # the output's disk full (safetensors' own error), a quota, EFBIG
        if isinstance(error, OSError) and error.errno not in STORAGE_REFUSALS:
            raise
        raise BadInput(f"--output_dir {job.output_dir}: the model could not be written ({first_line(error)}); "
                       "nothing was written: make room, then run again") from None
    finally:
        if temporary.exists():
            shutil.rmtree(temporary)


STORAGE_REFUSALS = NO_ROOM | {errno.EFBIG, errno.EROFS}
"""What the output's storage answers a write it refuses: one line, not a traceback (not EIO, which reading the
checkpoint may meet too)."""


class VerificationFailed(Exception):
    """The written folder does not reproduce the checkpoint's logits: exit status 1."""


class PushFailed(Exception):
    """The Hub could not be reached or refused the upload, after a verified conversion: exit status 1."""


def upload_command(folder: Path, args: Args) -> str:
    """The `hf upload` command that pushes `folder` as --push_to_hub would have: private, to its branch, with its
    message (without --private, `hf upload` may create a public repository). Not its deletions: `hf upload
    --delete '*.safetensors'` also deletes every subfolder's weights (app/huggingface/upload.py stale_model_files)."""
    words = ["hf", "upload", args.push_to_hub, str(folder)]
    if args.private:
        words.append("--private")
    if args.revision:
        words += ["--revision", args.revision]
    return shlex.join(words + ["--commit-message", args.commit_message or f"Upload {folder.name}"])


def run(args: Args, pushing: Callable[[str], None] = lambda said: None) -> None:
    """Convert and verify each checkpoint, then push the folder when asked; `pushing` is told, once the push
    begins, what a stop would leave (the verified folder, and the command that pushes it)."""
    jobs = plan(args)
    for job in jobs:
        difference, cast = convert(job, args.dtype, args.max_shard_size)
        moved = f"; in {args.dtype} the logits move by up to {cast:.1e} of the largest" if cast is not None else ""
        print(f"{job.checkpoint} (step {job.step}) -> {job.output_dir} [{args.dtype}], "
              f"weights and logits verified (max relative difference {difference:.1e}{moved})", flush=True)
    if args.push_to_hub:
        folder = jobs[0].output_dir
        if args.dry_run:
            print(describe_upload(folder, args))
        else:
            pushing(f"the verified folder {folder} is kept, but not pushed (or in part): push it without converting "
                    f"again with `{upload_command(folder, args)}`")
            try:
                with reported_as("--push_to_hub", args.push_to_hub, upload=True):
                    url = push_folder(folder, args, default_message=f"Upload {folder.name} (step {jobs[0].step})")
            except PrefetchError as error:
                raise PushFailed(f"{error}. The verified folder {folder} is kept: push it without converting again "
                                 f"with `{upload_command(folder, args)}`, then delete the repository's top-level "
                                 "weights of an earlier push that the folder does not hold") from None
            print(f"pushed {folder} to {args.push_to_hub}: {url}")
