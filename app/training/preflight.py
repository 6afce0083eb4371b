"""Checks of every input, in the launching process, before any worker starts or any file is written.

Each check appends one line per problem (naming the flag and what to do); all problems are reported together and
the run exits with status 2. What the checks resolve along the way (the model config, the FSDP layer classes, the
checkpoint to resume from) is returned, so the workers never re-derive it differently.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import pyarrow as pa
import pyarrow.compute as pc
import torch
import yaml
from datasets import DatasetDict, load_from_disk
from lightning_fabric.accelerators import XLAAccelerator
from lightning_fabric.plugins.environments import (LSFEnvironment, MPIEnvironment, SLURMEnvironment,
                                                   TorchElasticEnvironment)
from torch.nn import Module
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.utils import is_flash_attn_2_available

from app.checkpoint import (CheckpointError, checkpoint_dir, latest_checkpoint, read_metadata, run_tokenizer_dir,
                            stored_tensor_shapes)
from app.checkpoint.files import RUN_CONFIG_FILE, list_checkpoints, run_folder_of
from app.checkpoint.sources import check_complete
from app.checkpoint.state import CheckpointMismatch, check_fits, expected_shapes
from app.choices import SHARDED_STRATEGIES
from app.cli import first_line
from app.data import DataFormat
from app.data.formats import Layout
from app.data.identity import folder_identity, identity_difference, same_folder_by_path
from app.data.mixture import Source, describe, epoch_rows, first_folder, parse_sources
from app.distributed.precision import (bf16_moment_problem, bf16_rounding_note, bf16_support_problem,
                                      fp32_modules_problem, weights_dtype)
from app.distributed.strategy import resolve_accelerator, without_srun_hint
from app.evaluation.samples import samples_written
from app.exit_codes import EXIT_BAD_INPUT
from app.hub import (TOKENIZER_ADVICE, missing_model_problem, quiet_hub, tokenizer_difference,
                     unloadable_tokenizer)
from app.huggingface.convert import changed_fields
from app.metrics.loggers import METRICS_FILE, ROWS_FILE, RUN_ID_FILE, SUMMARY_FILE
from app.model.build import (checkpoints_through_transformers, enable_activation_checkpointing, load_model_config,
                             meta_model, model_class, model_source, resolve_wrap_classes)
from app.model.isolation import (LOCAL_ATTENTION_NAMES, TwinUnavailable, decoder_inputs_error,
                                 decoder_tells_positions_apart, probe_isolation)
from app.model.loss import probe_chunked_loss
from app.optimization.optimizer import grouped_parameter_names, no_decay_names
from app.optimization.schedule import TrainingPlan, accumulation_steps, make_plan, scale_for_batch, steps_to_finish
from app.reliability.spikes import QUARANTINE_FILE

if TYPE_CHECKING:
    from arguments import Config

SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads")


@dataclass
class RunInputs:
    """What the preflight resolved, passed to every rank."""

    config: Config
    """The options, with --lr and --min_lr resolved for the global batch (--lr_scaling)."""
    model_config: PretrainedConfig
    wrap_classes: set[type[Module]]
    plan: TrainingPlan
    tokenizer: Optional[str]
    resume_from: Optional[Path]
    resume_step: Optional[int] = None
    """The step the checkpoint resumed from holds (its metadata's; a copied checkpoint's name may say nothing)."""
    packed_layout: Layout = "position_ids"
    """How packed examples reach the model so that they stay apart (app/model/isolation.py)."""
    chunked_loss: bool = False
    """Whether the loss is computed in chunks without the full logits (app/model/loss.py)."""
    mixture: str = ""
    """A mixture's folders, one line each (app/data/mixture.py describe); empty for one folder."""
    target_block_size: int = 0
    """Seq2seq data's longest target, for the memory planner; 0 for the other formats."""
    data_folders: list[dict] = field(default_factory=list)
    """What identifies each data folder (app/data/identity.py), recorded by every checkpoint for a resume anywhere."""


@dataclass
class Resume:
    """The checkpoint a run continues from, and what it says about the run that wrote it."""

    path: Path
    metadata: dict


@dataclass
class DataFacts:
    format: DataFormat
    train_rows: int
    validation_rows: int
    block_size: int
    """The longest row (every row, for block formats)."""
    mean_row_tokens: float
    mean_target_tokens: float
    """Of seq2seq data's targets; 0 for the other formats, whose labels are their inputs."""
    max_token_id: int
    target_block_size: int = 0
    """Seq2seq data's longest target; 0 for the other formats."""
    target_start: Optional[int] = None
    """The token every train target of seq2seq data begins with (a BOS the tokenizer adds); None when they differ."""
    sources: Optional[list[Source]] = None
    """A mixture's folders (app/data/mixture.py), with `source_rows` their train rows; None for one folder."""
    source_rows: Optional[list[int]] = None
    identities: list[dict] = field(default_factory=list)
    """Each folder's identity (app/data/identity.py), in the order of --train_data_dir."""


def launching_process() -> bool:
    """True in the process the user started (or local rank 0 under torchrun/srun): the one that reports."""
    return (os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0") == "0"


def note(message: str) -> None:
    if launching_process():
        print(message, flush=True)


def world_size(cfg: Config) -> int:
    """The run's ranks: --devices x --num_nodes; `auto` counts the visible GPUs, or the TPU cores under --tpu as
    Lightning's XLA launcher does (one process for single_device, whose plan once counted every GPU of the node and
    trained a 1/N share of each step)."""
    if cfg.strategy == "single_device":
        return 1
    if cfg.devices != "auto":
        return cfg.devices * cfg.num_nodes
    if cfg.tpu:
        local = XLAAccelerator.auto_device_count()
    else:
        local = torch.cuda.device_count() if cfg.accelerator in ("auto", "gpu", "cuda") else 0
    return max(local, 1) * cfg.num_nodes


def check_data(cfg: Config, problems: list[str]) -> Optional[DataFacts]:
    """The facts of --train_data_dir's folder, or of a mixture's folders together (app/data/mixture.py)."""
    try:
        sources = parse_sources(cfg.train_data_dir)
    except ValueError as error:
        problems.append(str(error))
        return None
    facts = [check_folder(Path(source.path), problems, mixed=len(sources) > 1) for source in sources]
    if any(fact is None for fact in facts):
        return None
    together = mixture_facts(sources, facts, problems, cfg.trust_remote_code) if len(sources) > 1 else facts[0]
    identities = [folder_identity(source.name, source.path, fact.train_rows, fact.validation_rows)
                  for source, fact in zip(sources, facts)]
    return replace(together, identities=identities) if together is not None else None


def reads_data(cfg: Config) -> bool:
    """Whether the preflight reads --train_data_dir: always for a run; for a plan with --block_size only when its
    folders are there. That plan takes its blocks from --block_size, so a config naming a folder not prepared yet
    (configs/demo.yaml before `make demo`) must not stop it; a folder that is there still gives its rows."""
    if not cfg.train_data_dir:
        return False
    if not (cfg.estimate_memory and cfg.block_size):
        return True
    try:
        missing = [source.path for source in parse_sources(cfg.train_data_dir) if not Path(source.path).is_dir()]
    except ValueError:
        return True  # check_data says why
    if missing:
        note(f"--estimate_memory: planning blocks of --block_size {cfg.block_size} tokens without --train_data_dir "
             f"({', '.join(missing)}: not prepared yet)")
    return not missing


def mixture_facts(sources: list[Source], facts: list[DataFacts], problems: list[str],
                  trust_remote_code: bool = False) -> Optional[DataFacts]:
    """One format, one block length (rows of blocks are stacked into one tensor) and one tokenizer for every folder
    of a mixture; the facts of the mixture: the rows of its epoch (one pass over its first folder), rows of the
    weighted mean."""
    def differ(what: str, values: list) -> bool:
        if len(set(values)) > 1:
            listed = ", ".join(f"{source.name}: {value}" for source, value in zip(sources, values))
            problems.append(f"--train_data_dir: a mixture's folders must hold one {what} ({listed}); prepare them "
                            "alike")
        return len(set(values)) > 1

    if differ("format", [fact.format.name for fact in facts]):
        return None
    if not facts[0].format.padded and differ("block length", [fact.block_size for fact in facts]):
        return None
    def bundled(source: Source) -> PreTrainedTokenizerBase:
        return AutoTokenizer.from_pretrained(str(Path(source.path) / "tokenizer"), trust_remote_code=trust_remote_code)

    first = bundled(sources[0])
    for source in sources[1:]:
        difference = tokenizer_difference(bundled(source), first)
        if difference:
            problems.append(f"--train_data_dir: {source.path} was prepared with another tokenizer than "
                            f"{sources[0].path} ({difference}); prepare every folder of a mixture with one tokenizer")
            return None
    weights = [float(source.weight) for source in sources]
    return DataFacts(format=facts[0].format, train_rows=epoch_rows([s.weight for s in sources],
                                                                   [fact.train_rows for fact in facts]),
                     validation_rows=sum(fact.validation_rows for fact in facts),
                     block_size=max(fact.block_size for fact in facts),
                     mean_row_tokens=sum(w * fact.mean_row_tokens for w, fact in zip(weights, facts)),
                     mean_target_tokens=sum(w * fact.mean_target_tokens for w, fact in zip(weights, facts)),
                     max_token_id=max(fact.max_token_id for fact in facts),
                     target_block_size=max(fact.target_block_size for fact in facts),
                     target_start=facts[0].target_start if len({f.target_start for f in facts}) == 1 else None,
                     sources=sources,
                     source_rows=[fact.train_rows for fact in facts])


def check_data_resume(cfg: Config, data: Optional[DataFacts], resume: Optional[Resume], problems: list[str]) -> None:
    """A resumed run reads the checkpoint's folders in their order: its position counts rows of that order, a
    mixture's positions and seeds are kept per folder name and its quarantined rows are numbered folder after folder.
    Weights may change and folders may be added at the end of a mixture's (not to a run of one folder, whose position
    counts rows of another order: its rows were read again from the start). Folders are compared by what they hold
    (app/data/identity.py), not by path: a preempted run resumes on another node, mount or working directory. The
    order is drawn from --seed: resumed with another, the rest of the epoch repeated rows it had trained and skipped
    others, without a word."""
    if resume is None or data is None:
        return
    seed = (resume.metadata.get("config") or {}).get("seed")
    if seed is not None and seed != cfg.seed:
        problems.append(f"--seed {cfg.seed}: the checkpoint's run orders its data by --seed {seed}, which a resume "
                        f"continues (another seed repeats rows it trained and skips others); give --seed {seed}")
    before = recorded_folders(resume.metadata)
    if not before:
        return
    now = data.identities
    listed = ", ".join(folder["path"] for folder in before)
    keep = "a resumed run keeps those folders in that order, wherever they lie (weights may change, folders may be " \
           "added after them)"
    if len(now) < len(before):
        problems.append(f"--train_data_dir: the checkpoint was trained on {listed}; {keep}")
        return
    if len(now) > 1 and resume.metadata.get("mixture") is None:  # a run of one folder, resumed as a mixture
        problems.append(f"--train_data_dir: the checkpoint was trained on {listed} alone, in an order a mixture does "
                        "not continue (a mixture draws each folder's rows in an order of its own): the resumed run "
                        "would read that folder again from its start; resume on that folder alone, or start the "
                        "mixture as a new run from the checkpoint's weights (convert_to_hf.py, then --model_name)")
        return
    for place, (saved, given) in enumerate(zip(before, now), start=1):
        why = folder_mismatch(saved, given, mixture=len(before) > 1)
        if why:
            problems.append(f"--train_data_dir: {given['path']} is not folder {place} the checkpoint was trained on "
                            f"({saved['path']}): {why}; {keep}")
            return


def recorded_folders(metadata: dict) -> list[dict]:
    """The checkpoint's folders: their identities, or for a checkpoint that records none (before data_folders) their
    names and paths from its --train_data_dir, relative ones taken from where it was trained (`cwd`)."""
    if metadata.get("data_folders"):
        return metadata["data_folders"]
    spec = (metadata.get("config") or {}).get("train_data_dir")
    try:
        sources = parse_sources(spec) if spec else []
    except ValueError:
        return []
    trained_in = Path(metadata.get("cwd") or ".")
    return [{"name": source.name, "path": str(trained_in / source.path)} for source in sources]


def folder_mismatch(saved: dict, given: dict, mixture: bool) -> Optional[str]:
    """Why `given` cannot stand for the checkpoint's folder `saved`; None when it can."""
    if mixture and saved["name"] != given["name"]:
        return (f"the mixture keeps its position and seeds per name and this one was named {saved['name']} (name it: "
                f"{saved['name']}=FOLDER:WEIGHT)")
    if "stats_sha256" in saved:
        return identity_difference(saved, given)
    if not same_folder_by_path(Path(saved["path"]), Path(given["path"])):
        return "another folder (this checkpoint records paths only: give that folder, or one of its name if it moved)"
    return None


def check_folder(path: Path, problems: list[str], mixed: bool = False) -> Optional[DataFacts]:
    flag = f"--train_data_dir {path}"
    if not path.is_dir():
        weight = path.name.rpartition(":")[2] if ":" in path.name else ""
        problems.append(f"{flag}: no such folder; create it with prepare_data.py"
                        + (f" (a weight is a number: {weight!r} is not one)" if weight and path.parent.joinpath(
                            path.name.rpartition(":")[0]).is_dir() else ""))
        return None
    try:
        splits = load_from_disk(str(path))
        data_format = DataFormat.of(path)
    except (FileNotFoundError, ValueError) as error:
        problems.append(f"{flag}: not a dataset saved with save_to_disk ({error}); create it with prepare_data.py")
        return None
    missing = [s for s in ("train", "validation") if not isinstance(splits, DatasetDict) or s not in splits]
    if missing:
        problems.append(f"{flag}: missing split(s) {', '.join(missing)}; prepare_data.py writes train and validation")
        return None
    lengths, max_ids = set(), []
    for name in ("train", "validation"):
        split = splits[name]
        absent = [column for column in data_format.columns if column not in split.column_names]
        if absent or (len(split) == 0 and name == "train"):
            problems.append(f"{flag}: split {name} has no rows of {', '.join(absent or data_format.columns)} "
                            f"({data_format.name} data; columns: {split.column_names}); prepare it again")
            return None
        if len(split) == 0:
            note(f"{flag} has no validation rows (prepared with --val_fraction 0): "
                 + ("it is not validated on its own" if mixed else "the run trains without evaluating"))
            continue
        row_lengths = pc.list_value_length(split.data.column("input_ids"))
        lengths |= {pc.min(row_lengths).as_py(), pc.max(row_lengths).as_py()}
        max_ids.append(pc.max(pc.list_flatten(split.data.column("input_ids"))).as_py())
    if len(lengths) != 1 and not data_format.padded:
        problems.append(f"{flag}: rows have different lengths {sorted(lengths)}; pack them into blocks with prepare_data.py")
        return None
    train = splits["train"].data
    mean_tokens = {column: pc.mean(pc.list_value_length(train.column(column))).as_py()
                   for column in ("input_ids", "labels") if column in train.column_names}
    return DataFacts(format=data_format, train_rows=len(splits["train"]),
                     validation_rows=len(splits["validation"]), block_size=max(lengths),
                     mean_row_tokens=mean_tokens["input_ids"],
                     mean_target_tokens=mean_tokens["labels"] if data_format.encoder_decoder else 0.0,
                     max_token_id=max(max_ids),
                     target_block_size=longest_target(splits) if data_format.encoder_decoder else 0,
                     target_start=common_first_target(train) if data_format.encoder_decoder else None)


def common_first_target(train: pa.Table) -> Optional[int]:
    """The token every target (labels) of the train split begins with; None when they begin with different ones."""
    first = pc.unique(pc.list_element(train.column("labels"), 0))
    return first[0].as_py() if len(first) == 1 else None


def longest_target(splits: DatasetDict) -> int:
    """Seq2seq data's longest target (labels), in either split: both go through the decoder."""
    return max(pc.max(pc.list_value_length(split.data.column("labels"))).as_py() or 0 for split in splits.values())


def check_model(cfg: Config, problems: list[str]) -> Optional[PretrainedConfig]:
    """The model's config; a Hub id that is neither cached nor reachable is refused at once, with the prefetch.py
    command, instead of after a minute of huggingface_hub's retries."""
    flag = "--model_name" if cfg.model_name else "--model_config"
    missing = missing_model_problem(flag, model_source(cfg))
    if missing:
        problems.append(missing)
        return None
    try:
        with quiet_hub():
            return load_model_config(cfg)
    except (OSError, ValueError) as error:
        problems.append(f"{flag} {model_source(cfg)}: cannot load its config ({first_line(error)}); "
                        "check the name, or log in for gated models")
        return None


def check_runs_here(cfg: Config, problems: list[str]) -> None:
    """What the ranks would otherwise find only after the launch, each with a traceback: no GPU for --accelerator
    gpu, no FlashAttention for --attn_implementation flash_attention_2, no C++ compiler for --compile on CPU, a
    --model_name folder without weights.
    Planning (--estimate_memory) needs none of them, so a GPU run can be planned on a laptop."""
    if cfg.estimate_memory:
        return
    if resolve_accelerator(cfg) == "cuda" and not torch.cuda.is_available():
        problems.append(f"--accelerator {cfg.accelerator}: no CUDA GPU is visible here (torch.cuda.is_available() is "
                        "False); run on a machine with GPUs, or use --accelerator cpu")
    if cfg.attn_implementation == "flash_attention_2" and not is_flash_attn_2_available():
        problems.append("--attn_implementation flash_attention_2 needs the flash-attn package and a CUDA GPU, and "
                        "transformers finds them not both here; install flash-attn on a GPU machine, or use "
                        "--attn_implementation sdpa (FlashAttention kernels on GPUs as well)")
    if cfg.compile and resolve_accelerator(cfg) == "cpu":
        missing = missing_cpp_compiler()
        if missing:
            problems.append(f"--compile true on CPU builds its kernels with a C++ compiler, and torch finds none here "
                            f"({missing}); install g++ (or set CXX to a compiler), or use --compile false")
    if cfg.compile and resolve_accelerator(cfg) == "cuda" and not triton_c_compiler():
        problems.append("--compile true on GPUs builds Triton's kernel launchers with a C compiler, and there is "
                        "none here ($CC, gcc or clang; PyTorch's CUDA runtime Docker images long had none); install "
                        "gcc, or use --compile false")
    folder = Path(cfg.model_name) if cfg.model_name else None
    if folder and folder.is_dir() and not any(any(folder.glob(pattern)) for pattern in ("*.safetensors", "*.bin")):
        problems.append(f"--model_name {folder}: the folder holds no weights (*.safetensors or *.bin); to train "
                        f"from its config.json alone, give it as --model_config {folder}")


def missing_cpp_compiler() -> Optional[str]:
    """Why torch.compile's CPU kernels could not be built here, by inductor's own search ($CXX, else g++), or None:
    without a compiler every rank ended in a 100-line InductorError traceback at its first forward. Imported only
    for --compile (2 s)."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as error:
        return first_line(error)
    return None


def triton_c_compiler() -> Optional[str]:
    """The C compiler Triton builds each kernel's launcher with, found as triton/runtime/build.py finds it ($CC, else
    gcc, else clang): without one every rank ended in "Failed to find C compiler" at its first compiled forward."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def check_attention_supported(cfg: Config, model_config: PretrainedConfig, problems: list[str]) -> bool:
    """Whether the model class takes --attn_implementation at all (Gemma-2 has no SDPA path in transformers): built
    weightless from the run's own config, as the ranks would build it, where every rank would otherwise end in a
    ValueError traceback. FlashAttention is asked of the class only (T5 has none): building with it needs its
    kernels, and whether they are here is check_runs_here's."""
    flash = cfg.attn_implementation == "flash_attention_2"
    try:
        asked = None if flash else cfg.attn_implementation
        with torch.device("meta"):  # a copy of the config: the model records the attention it was asked for
            model = model_class(model_config).from_config(copy.deepcopy(model_config), attn_implementation=asked,
                                                          trust_remote_code=cfg.trust_remote_code)
    except Exception as error:  # noqa: BLE001 (only an attention the class lacks is this check's to refuse)
        if flash or not (isinstance(error, ValueError) and "attention implementation" in str(error)):
            return True
        others = [other for other in ("sdpa", "eager") if other != cfg.attn_implementation]
        problems.append(f"--attn_implementation {cfg.attn_implementation}: a {model_config.model_type} model does "
                        f"not support it ({first_line(error).split('. ')[0]}); use --attn_implementation {others[0]}")
        return False
    if flash and not model._supports_flash_attn:  # what transformers checks first when asked for it
        problems.append(f"--attn_implementation flash_attention_2: a {model_config.model_type} model does not support "
                        f"it ({type(model).__name__} has no FlashAttention path in transformers); use "
                        f"--attn_implementation {model.config._attn_implementation}")
        return False
    return True


def check_activation_checkpointing(cfg: Config, model_config: PretrainedConfig, problems: list[str]) -> None:
    """--gradient_checkpointing where it is transformers' own (app/model/build.py), tried on the model built weightless
    from the run's config: a class without it (CTRL, JetMoE) ended every rank in a ValueError traceback after the
    launch. FSDP1's checkpoint wrapper takes any layer class, so --strategy fsdp is named where it can wrap this one."""
    if not checkpoints_through_transformers(cfg):
        return
    try:
        model = meta_model(model_config, cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 (a model that cannot be built is another check's to refuse)
        return
    try:
        enable_activation_checkpointing(model)
    except ValueError as error:
        try:
            resolve_wrap_classes(model_config, cfg.auto_wrap_policy, cfg.trust_remote_code)
            instead = "--strategy fsdp (its checkpoint wrapper takes every layer class), or "
        except ValueError:
            instead = ""
        reason = first_line(error).rstrip(".")
        problems.append(f"--gradient_checkpointing true: a {model_config.model_type} model has no activation "
                        f"checkpointing of its own, which --strategy {cfg.strategy} uses ({reason}); use {instead}"
                        "--gradient_checkpointing false")


def check_model_fits_data(cfg: Config, model_config: PretrainedConfig, data: DataFacts, problems: list[str]) -> None:
    if data.format.encoder_decoder != bool(model_config.is_encoder_decoder):
        kind = "an encoder-decoder model" if model_config.is_encoder_decoder else "a causal LM"
        wanted = ("--source_field/--target_field" if model_config.is_encoder_decoder
                  else "--prompt_field/--response_field or --messages_field (raw text: --text_field)")
        problems.append(f"--train_data_dir holds {data.format.name} data but {model_source(cfg)} is {kind}; "
                        f"prepare the data with {wanted}, or train a matching model")
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if max_positions:
        problems += positions_problems(data, max_positions)
    if data.max_token_id >= model_config.vocab_size:
        problems.append(f"--train_data_dir holds token id {data.max_token_id} but the model's vocab_size is "
                        f"{model_config.vocab_size}; tokenize with the model's tokenizer")


def positions_problems(data: DataFacts, max_positions: int) -> list[str]:
    """Rows longer than a model's learned positions end the run at the first batch (IndexError on every rank). An
    encoder-decoder's (BART's) encoder reads the sources and its decoder the targets, each from position 0: both
    must fit, and prepare_data.py cuts them with --max_source_length and --max_target_length, not --block_size."""
    if not data.format.encoder_decoder:
        lengths = [("blocks", data.block_size, "a smaller --block_size")]
    else:
        lengths = [("sources", data.block_size, f"--max_source_length {max_positions} or less"),
                   ("targets", data.target_block_size, f"--max_target_length {max_positions} or less")]
    return [f"--train_data_dir {what} of {length} tokens exceed the model's max_position_embeddings ({max_positions}); "
            f"prepare the data with {advice}" for what, length, advice in lengths if length > max_positions]


def windowed(model_config: PretrainedConfig) -> bool:
    """Whether some layers attend within a window (Mistral, GPT-OSS, Gemma-2/3): a block mask given in its place would
    drop the window."""
    return any(isinstance(getattr(model_config, name, None), int) for name in LOCAL_ATTENTION_NAMES)


def check_packed_isolation(cfg: Config, model_config: PretrainedConfig, data: DataFacts,
                           problems: list[str]) -> Layout:
    """Packed examples must never attend to each other: the layout that keeps them apart in the run's own model
    class and attention implementation, found by a probe (app/model/isolation.py); refused when there is none."""
    if data.format.name != "supervised_packed" or model_config.is_encoder_decoder:  # the latter refused above
        return "position_ids"
    attention, kind = cfg.attn_implementation, model_config.model_type
    try:
        found = probe_isolation(model_config, attention, cfg.trust_remote_code)
    except TwinUnavailable as error:
        problems.append(f"--train_data_dir {cfg.train_data_dir} holds packed examples, but whether a {kind} model "
                        f"keeps them apart cannot be probed ({error}); prepare the data with --packing false")
        return "position_ids"
    except Exception as error:  # the implementation does not run here (FlashAttention without a GPU) or at all
        problems.append(f"--attn_implementation {attention}: a {kind} model cannot run with it here, so packed "
                        f"examples cannot be checked to stay apart ({first_line(error)}); use --attn_implementation "
                        "sdpa, or a machine where it runs")
        return "position_ids"
    if found.layout is None:
        others = [other for other in ("sdpa", "eager") if other != attention and isolates(model_config, other, cfg)]
        instead = f"use --attn_implementation {others[0]}, or " if others else ""
        problems.append(f"--train_data_dir {cfg.train_data_dir} holds packed examples, but a {kind} model with "
                        f"--attn_implementation {attention} lets them attend to each other (probed: an example's "
                        f"logits change by {found.leak:.0%} when packed) and takes no mask that stops it"
                        f"{' while keeping its sliding window' if windowed(model_config) else ''}; "
                        f"{instead}prepare the data with --packing false")
    elif found.layout != "position_ids":
        note(f"packed examples: a {kind} model with --attn_implementation {attention} would let them attend to each "
             f"other as prepared (probed: an example's logits change by {found.leak:.0%} when packed); they are "
             f"kept apart as {found.layout} (docs/supervised.md#packing)")
    return found.layout or "position_ids"


def check_chunked_loss(cfg: Config, model_config: PretrainedConfig) -> bool:
    """--chunked_loss where the run's model class gives the same loss through it (app/model/loss.py's probe), and
    not in fp16: the chunked loss computes its gradients before backward's loss scaling, and fp16 products of
    unscaled gradients lose the small ones (rare tokens' rows of the output weight) that the scaler exists to keep.
    Unless asked for, not under --compile on GPUs either: there the compiled model's own loss was faster (41.2%
    against 36.3% MFU on an H200) and held 2.1 GB more at 8K tokens of a 128K vocabulary."""
    if cfg.chunked_loss is None and cfg.compile and resolve_accelerator(cfg) == "cuda":
        note("--chunked_loss: with --compile on GPUs the model's own loss is compiled into its graph, faster than the "
             "chunked loss for a little more memory; --chunked_loss true keeps it chunked")
        return False
    if cfg.chunked_loss is False:
        return False
    if cfg.precision.startswith("16"):
        note(f"--chunked_loss: --precision {cfg.precision} keeps the model's own loss (fp16 gradients need the loss "
             "scaling that the chunked loss would come before); its logits are materialised")
        return False
    try:
        if probe_chunked_loss(model_config, cfg.attn_implementation, cfg.trust_remote_code):
            return True
        reason = "it changes the logits after its output layer"
    except Exception as error:  # a model the probe cannot build or run here: its own loss is the safe choice
        reason = f"probing it failed: {first_line(error)}"
    note(f"--chunked_loss: a {model_config.model_type} model keeps its own loss ({reason}); its logits are "
         "materialised")
    return False


def check_decoder_start(cfg: Config, model_config: PretrainedConfig, data: DataFacts, problems: list[str]) -> None:
    """The token an encoder-decoder's decoder starts from. Without one in the config, a T5 cannot build its decoder's
    inputs and generation samples cannot start: each rank ended in a traceback after the launch; refused here. A
    decoder without absolute positions (T5) that starts from the token every target begins with (the BOS of a
    tokenizer that adds one) trains to a normal-looking validation loss but generates nothing (ROUGE 0): refused.
    A model the probe cannot build or run here is not refused."""
    if not model_config.is_encoder_decoder:
        return
    start = getattr(model_config, "decoder_start_token_id", None)
    if start is None:
        problems += missing_decoder_start(cfg, model_config)
        return
    if not data.format.encoder_decoder or data.target_start != start:
        return
    try:
        if decoder_tells_positions_apart(model_config, cfg.attn_implementation, cfg.trust_remote_code):
            return
    except Exception:  # noqa: BLE001 (not this check's to refuse)
        return
    problems.append(f"--train_data_dir: every target begins with token {start}, the decoder_start_token_id of "
                    f"{model_source(cfg)}: a {model_config.model_type} decoder reads it at its first two positions "
                    f"and cannot tell them apart, so it learns to write it for ever and generates nothing; set "
                    f"decoder_start_token_id to the pad token ({data.format.pad_token_id}) in the model's config")


def missing_decoder_start(cfg: Config, model_config: PretrainedConfig) -> list[str]:
    """The refusal of a config without decoder_start_token_id where the model class needs one to build its
    decoder's inputs from the labels, in training and generation alike (mBART builds them from the labels alone)."""
    try:
        error = decoder_inputs_error(model_config, cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 (a model the probe cannot build here: not this check's to refuse)
        error = None
    if not error:
        return []
    flag = "--model_name" if cfg.model_name else "--model_config"
    return [f"{flag} {model_source(cfg)}: its config names no decoder_start_token_id, the token the "
            f"{model_config.model_type} decoder starts from, which training needs; add it to the model's config.json "
            "(T5 starts from its pad token, BART from </s>)"]


def isolates(model_config: PretrainedConfig, attention: str, cfg: Config) -> bool:
    """Whether another attention implementation would keep packed examples apart (to name it when refusing)."""
    try:
        return probe_isolation(model_config, attention, cfg.trust_remote_code).layout is not None
    except Exception:
        return False


def resolve_tokenizer(cfg: Config, model_config: Optional[PretrainedConfig], problems: list[str]) -> Optional[str]:
    """--tokenizer, else the data folder's tokenizer/, else the pretrained model's; checked to load and to fit.

    Training reads token ids and needs no tokenizer: one that is only a default and does not load is left out
    (the converter then asks for --tokenizer); one given with --tokenizer must load.
    """
    bundled = Path(first_folder(cfg.train_data_dir) if cfg.train_data_dir else "") / "tokenizer"
    name = cfg.tokenizer or (str(bundled) if bundled.is_dir() else cfg.model_name)
    if name is None:
        return None
    missing = missing_model_problem("--tokenizer" if cfg.tokenizer else "--model_name", name)
    if missing:
        if name != cfg.model_name:  # the model's own is check_model's line already
            problems.append(missing)
        return None
    try:
        with quiet_hub():
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as error:
        if cfg.tokenizer is None:
            note(f"no tokenizer recorded with this run: {unloadable_tokenizer(name, error)}")
            return None
        problems.append(f"--tokenizer {unloadable_tokenizer(name, error)}; {TOKENIZER_ADVICE}")
        return None
    if model_config is not None and len(tokenizer) > model_config.vocab_size:
        problems.append(f"--tokenizer {name} has {len(tokenizer)} tokens, more than the model's vocab_size "
                        f"{model_config.vocab_size}; use the tokenizer the data was prepared with")
    if cfg.tokenizer and bundled.is_dir():
        difference = tokenizer_difference(tokenizer, AutoTokenizer.from_pretrained(
            bundled, trust_remote_code=cfg.trust_remote_code))
        if difference:
            problems.append(f"--tokenizer {name} is not the tokenizer --train_data_dir was prepared with ({bundled}): "
                            f"{difference}; drop --tokenizer (the run records the data's), or prepare the data with it")
    return name


def check_run_tokenizer(cfg: Config, tokenizer: Optional[str], problems: list[str]) -> None:
    """The run keeps a copy of its tokenizer in out_dir/tokenizer/ (run.py keep_tokenizer_with_run); one already
    there (a resumed run's, or an earlier attempt's) must be the same tokenizer: it is never replaced."""
    kept = run_tokenizer_dir(cfg.out_dir)
    if tokenizer is None or not kept.exists():
        return
    try:
        difference = tokenizer_difference(AutoTokenizer.from_pretrained(str(kept),
                                                                        trust_remote_code=cfg.trust_remote_code),
                                          AutoTokenizer.from_pretrained(tokenizer,
                                                                        trust_remote_code=cfg.trust_remote_code))
    except (OSError, ValueError) as error:
        difference = f"it does not load ({first_line(error)})"
    if difference:
        problems.append(f"--out_dir {cfg.out_dir}: {kept} is not the run's tokenizer {tokenizer} ({difference}); "
                        "move it away (it is never replaced), or choose another --out_dir")


def check_samples(cfg: Config, data: DataFacts, tokenizer: Optional[str], problems: list[str],
                  model_config: Optional[PretrainedConfig] = None) -> None:
    positions = getattr(model_config, "max_position_embeddings", None) if model_config is not None else None
    if cfg.eval_samples and positions and cfg.eval_max_new_tokens >= positions:
        room = ("passes the decoder's" if model_config.is_encoder_decoder  # its source has the encoder's own
                else "leaves no room for a prompt in the model's")
        problems.append(f"--eval_max_new_tokens {cfg.eval_max_new_tokens} {room} {positions} positions "
                        "(max_position_embeddings); lower it")
    if cfg.eval_samples and not data.format.supervised:
        problems.append(f"--eval_samples {cfg.eval_samples} needs prompts and references (supervised or seq2seq data), "
                        f"but --train_data_dir {cfg.train_data_dir} holds raw text; drop it or prepare pairs")
    if cfg.eval_samples and not data.validation_rows:
        problems.append(f"--eval_samples {cfg.eval_samples} takes its prompts from the validation split, but "
                        f"--train_data_dir {cfg.train_data_dir} has none; drop it or prepare with --val_fraction > 0")
    if cfg.eval_samples and tokenizer is None:
        problems.append(f"--eval_samples {cfg.eval_samples} decodes the samples with the run's tokenizer: give --tokenizer")


def planned_blocks(cfg: Config) -> DataFacts:
    """Stand-in data for --estimate_memory --block_size without a data folder: blocks of that length, enough rows
    for one step."""
    rows = cfg.global_batch_size or world_size(cfg) * cfg.micro_batch_size * (cfg.gradient_accumulation_steps or 1)
    return DataFacts(format=DataFormat("text", 0), train_rows=rows, validation_rows=0, block_size=cfg.block_size,
                     mean_row_tokens=cfg.block_size, mean_target_tokens=0.0, max_token_id=0)


def check_plan(cfg: Config, data: DataFacts, resume: Optional[Resume], problems: list[str]) -> Optional[TrainingPlan]:
    """The batch arithmetic. A resumed run keeps its checkpoint's global batch unless --global_batch_size is given:
    the accumulation follows the devices and micro batch it resumes with."""
    kept = resume is not None and cfg.global_batch_size is None
    global_batch_size = resume.metadata["global_batch_size"] if kept else cfg.global_batch_size
    try:
        accumulation = accumulation_steps(world_size=world_size(cfg), micro_batch_size=cfg.micro_batch_size,
                                          gradient_accumulation_steps=None if kept else cfg.gradient_accumulation_steps,
                                          global_batch_size=global_batch_size)
        plan = make_plan(train_rows=data.train_rows, block_size=data.block_size, row_tokens=data.mean_row_tokens,
                         target_tokens=data.mean_target_tokens, world_size=world_size(cfg),
                         micro_batch_size=cfg.micro_batch_size, accumulation=accumulation,
                         number_epochs=cfg.number_epochs, max_step=cfg.max_step)
    except ValueError as error:
        problems.append(f"--resume: the checkpoint's global batch of {global_batch_size} sequences does not split "
                        f"into --micro_batch_size {cfg.micro_batch_size} on {world_size(cfg)} ranks; choose a micro "
                        "batch and device count that divide it, or give --global_batch_size" if kept else str(error))
        return None
    if resume is not None:
        if changed_epochs(cfg, data, resume.metadata, problems):
            return None
        if cfg.max_step is not None and cfg.max_step < resume.metadata["step"]:
            problems.append(f"--max_step {cfg.max_step}: the checkpoint is at step {resume.metadata['step']} "
                            "already; give a larger --max_step to train on, or convert the checkpoint as it is")
            return None
        plan = plan_from_checkpoint(cfg, resume.metadata, plan)
        note_what_changed(cfg, resume.metadata, plan)
        note_validation_rows(cfg, data, resume.metadata, plan)
    if cfg.warmup_steps > plan.max_step and not cfg.estimate_memory:  # a plan needs no schedule (nor real data)
        problems.append(f"--warmup_steps ({cfg.warmup_steps}) exceeds the run's {plan.max_step} optimizer steps "
                        f"(--number_epochs {cfg.number_epochs} at {plan.global_batch_size} sequences per step): "
                        "lower it, or give --max_step")
    elif cfg.warmup_steps == plan.max_step and cfg.lr_decay and not cfg.estimate_memory:
        note(f"--warmup_steps {cfg.warmup_steps} fills the run's {plan.max_step} steps: the rate rises to --lr and "
             "ends there, never decaying to --min_lr (fewer warmup steps leave some for the decay)")
    if not cfg.estimate_memory:
        note_rows_left_out(plan)
    return plan


def note_rows_left_out(plan: TrainingPlan) -> None:
    """An epoch is its whole steps: the rows that fill no last step are left out of it (other rows each epoch, as
    the order is drawn anew). Said when they are 5% of the rows or more: on a small fine-tuning set a third of the
    data went untrained in a one-epoch run, without a word."""
    left_out = plan.train_rows - plan.steps_per_epoch * plan.global_batch_size
    if plan.steps_per_epoch and left_out >= plan.train_rows / 20:
        note(f"each epoch trains {plan.steps_per_epoch * plan.global_batch_size:,} of its {plan.train_rows:,} rows: "
             f"the other {left_out:,} ({left_out / plan.train_rows:.0%}) fill no whole step of "
             f"{plan.global_batch_size} sequences (other rows each epoch); a global batch that divides "
             f"{plan.train_rows:,} trains them all")


def plan_from_checkpoint(cfg: Config, saved: dict, plan: TrainingPlan) -> TrainingPlan:
    """A resumed run that ends after --number_epochs counts the steps left from the checkpoint's position at its
    own global batch: the checkpoint's step count, made at another global batch, would end it early or late. For the
    same epochs it finishes the checkpoint's learning-rate schedule over those steps (TrainingPlan.schedule_step).
    Given another end, it recounts the schedule to that end in this run's steps, where the data trained so far
    stands among them: the checkpoint's step count, made at another global batch, put a run at 8x the batch and
    one more epoch 62% through its cosine after 18% of its data (the rate fell 56% in one step).
    A mixture's epoch and position count its rows alike (the first folder's weight is the checkpoint's: see
    changed_epochs)."""
    if cfg.max_step is not None:
        return plan
    left = steps_to_finish(plan, epoch=saved["epoch"], position=saved["position"], number_epochs=cfg.number_epochs)
    resumed = replace(plan, max_step=saved["step"] + left)
    before = saved.get("config") or {}
    if before.get("max_step") is not None or before.get("number_epochs") != cfg.number_epochs:
        length = steps_to_finish(plan, epoch=0, position=0, number_epochs=cfg.number_epochs)
        if length - left == saved["step"]:
            return resumed
        return replace(resumed, resumed_schedule=(saved["step"], length - left, length))
    schedule = saved.get("schedule") or {"step": saved["step"], "length": saved["step"] + steps_to_finish(
        replace(plan, micro_batch_size=saved["global_batch_size"], world_size=1, accumulation=1),
        epoch=saved["epoch"], position=saved["position"], number_epochs=cfg.number_epochs)}
    if (schedule["step"], schedule["length"]) == (saved["step"], resumed.max_step):
        return resumed
    return replace(resumed, resumed_schedule=(saved["step"], schedule["step"], schedule["length"]))


def changed_epochs(cfg: Config, data: DataFacts, saved: dict, problems: list[str]) -> bool:
    """A mixture's epoch is a pass over its first folder, counted in rows of the mixture at that folder's weight
    (mixture.epoch_rows): resumed with another weight for it, the checkpoint's epoch and position count other rows,
    and the run would end after more or fewer passes than --number_epochs says, its schedule jumping at the resume.
    Refused unless --max_step says where the run ends."""
    if cfg.max_step is not None or data.sources is None:
        return False
    try:
        before = parse_sources((saved.get("config") or {}).get("train_data_dir") or "")[0].weight
    except ValueError:
        return False
    now = data.sources[0].weight
    if before == now:
        return False
    problems.append(f"--train_data_dir: the first folder ({data.sources[0].name}) was {float(before):.1%} of every "
                    f"step and is {float(now):.1%} at this resume, and --number_epochs counts passes over it at the "
                    "checkpoint's share; give --max_step to say where the resumed run ends")
    return True


def note_what_changed(cfg: Config, saved: dict, plan: TrainingPlan) -> None:
    """Say how the resumed run's layout differs from the checkpoint's (the samples it trains on do not)."""
    before = saved.get("config") or {}
    saved_world = len(saved.get("rng") or []) or None
    changes = [f"{name} {old} -> {new}" for name, old, new in (
        ("ranks", saved_world, plan.world_size), ("micro batch", before.get("micro_batch_size"), plan.micro_batch_size))
        if old is not None and old != new]
    if saved["global_batch_size"] != plan.global_batch_size:
        changes.append(f"global batch {saved['global_batch_size']} -> {plan.global_batch_size} sequences")
    if changes:
        note(f"--resume: {', '.join(changes)}; {plan.global_batch_size} sequences per step as {plan.accumulation} "
             f"accumulation x {plan.micro_batch_size} micro batch x {plan.world_size} ranks, continuing at sample "
             f"{saved['position']} of epoch {saved['epoch']}")
    if cfg.gradient_accumulation_steps not in (None, plan.accumulation) and cfg.global_batch_size is None:
        note(f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} is not used: the checkpoint's global "
             f"batch of {plan.global_batch_size} is kept (give --global_batch_size to change it)")


TRAINING_OPTIONS = ("precision", "reduce_dtype", "lr", "min_lr", "lr_decay", "warmup_steps", "weight_decay", "beta1",
                    "beta2", "grad_clip", "max_step", "number_epochs", "spike_guard")
"""The options whose change at a resume changes how the steps after it train (the batch is said apart)."""


def note_changed_options(cfg: Config, saved: dict) -> None:
    """Say which of TRAINING_OPTIONS the resume changes: a new --lr or --warmup_steps took effect at the resumed step
    (the rate went from 1.65e-3 to 8.33e-3 at once) and another --precision stored the weights and moments in bf16
    from then on, with only the usual resume lines."""
    before = saved.get("config") or {}
    changes = [f"{name} {before[name]} -> {getattr(cfg, name)}" for name in TRAINING_OPTIONS
               if name in before and before[name] != getattr(cfg, name)]
    if changes:
        note(f"--resume: changed since the checkpoint: {', '.join(changes)}; the steps after step {saved['step']} "
             "train with the new values")


def note_validation_rows(cfg: Config, data: DataFacts, saved: dict, plan: TrainingPlan) -> None:
    """--eval_iters counts batches per rank, so a resume on other ranks or another evaluation batch reads other
    validation rows: val_loss moves at the resume for that alone, and best.json compares losses of other rows. A
    mixture reads up to that many rows of each folder (its folders' own counts are not at hand: their sum bounds
    each)."""
    before, saved_world = saved.get("config") or {}, len(saved.get("rng") or [])
    if not (before.get("eval_iters") and saved_world and data.validation_rows):
        return
    batch_then = before.get("eval_batch_size") or before.get("micro_batch_size") or 0
    batch_now = cfg.eval_batch_size or cfg.micro_batch_size
    limit_then = before["eval_iters"] * batch_then * saved_world
    limit_now = cfg.eval_iters * batch_now * plan.world_size
    if limit_then == limit_now or data.validation_rows <= min(limit_then, limit_now):
        return
    mixture = data.sources is not None
    then, now = (limit_then, limit_now) if mixture else (min(data.validation_rows, limit)
                                                          for limit in (limit_then, limit_now))
    per_batch = batch_now * plan.world_size
    same = (-(-then // per_batch) if then == data.validation_rows  # all of them
            else then // per_batch if then % per_batch == 0 else None)
    rows = "rows of each folder" if mixture else "rows"
    note(f"--resume: validation reads {'up to ' if mixture else ''}{now:,} {rows} ({cfg.eval_iters} batches of "
         f"{batch_now} on each of {plan.world_size} ranks), the checkpoint's run read {then:,}: val_loss moves at "
         "this resume for that alone, and best.json compares it with losses of the other rows"
         + (f"; --eval_iters {same} reads the same rows" if same else ""))


def resolve_learning_rates(cfg: Config, plan: Optional[TrainingPlan]) -> Config:
    """--lr and --min_lr moved to the global batch by --lr_scaling, said once; the run uses the resolved values."""
    if cfg.lr_scaling == "none" or plan is None:
        return cfg
    lr, min_lr = (scale_for_batch(value, rule=cfg.lr_scaling, global_batch_size=plan.global_batch_size,
                                  reference_batch_size=cfg.reference_batch_size) for value in (cfg.lr, cfg.min_lr))
    note(f"--lr_scaling {cfg.lr_scaling}: lr {cfg.lr:.3g} -> {lr:.3g}, min_lr {cfg.min_lr:.3g} -> {min_lr:.3g} for "
         f"a global batch of {plan.global_batch_size} (--reference_batch_size {cfg.reference_batch_size})")
    return replace(cfg, lr=lr, min_lr=min_lr, lr_scaling="none", reference_batch_size=None)


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def estimated_checkpoint_bytes(model_config: PretrainedConfig, cfg: Config) -> int:
    """Weights plus AdamW's two moments, all in the weights' dtype: what one full checkpoint holds."""
    model = meta_model(model_config, cfg.trust_remote_code)
    parameters = sum(p.numel() for p in model.parameters())
    return parameters * 3 * torch.finfo(weights_dtype(cfg.precision)).bits // 8


def check_out_dir(cfg: Config, model_config: Optional[PretrainedConfig], problems: list[str]) -> None:
    out_dir = Path(cfg.out_dir)
    ancestor = existing_ancestor(out_dir)
    if not ancestor.is_dir():  # the folder, or one it would be made in (else the first rank fails to create it)
        where = "" if ancestor == out_dir.absolute() else f": {ancestor}"
        problems.append(f"--out_dir {out_dir}{where} is a file; give a folder")
        return
    if not os.access(ancestor, os.W_OK):
        problems.append(f"--out_dir {out_dir}: {ancestor} is not writable; choose a folder you can write to")
        return
    if model_config is not None:
        needed, free = estimated_checkpoint_bytes(model_config, cfg), shutil.disk_usage(ancestor).free
        if free < needed:
            problems.append(f"--out_dir {out_dir}: {free / 1e9:.1f} GB free, one checkpoint needs about "
                            f"{needed / 1e9:.1f} GB; free space or choose another folder")
    data_folder = data_folder_holding(cfg, out_dir)
    if data_folder:
        problems.append(f"--out_dir {out_dir} lies in the data folder {data_folder}: the run would write its "
                        "checkpoints among the data (and prepare_data.py --overwrite refuses such a folder); choose "
                        "a folder outside it")
    written = files_a_new_run_replaces(out_dir)
    if written and not cfg.resume and not latest_checkpoint(out_dir):  # with checkpoints: resolve_resume's line
        problems.append(f"--out_dir {out_dir} already holds {', '.join(written)} (of an earlier run, or yours), which "
                        "a new run would overwrite; it holds no checkpoint, so nothing of that run can be continued: "
                        "choose another --out_dir, or add --resume true to start that run again from step 0 there, "
                        "replacing those files (this refusal changed nothing)")


def data_folder_holding(cfg: Config, out_dir: Path) -> Optional[Path]:
    """The --train_data_dir folder that is `out_dir` or holds it, if any."""
    try:
        folders = [Path(source.path).resolve() for source in parse_sources(cfg.train_data_dir or "")]
    except ValueError:  # check_data's line
        return None
    out_dir = out_dir.resolve()
    return next((folder for folder in folders if folder == out_dir or folder in out_dir.parents), None)


def files_a_new_run_replaces(out_dir: Path) -> list[str]:
    """The files in `out_dir` that a run starting there writes over: those of an earlier run that saved no checkpoint
    (--save_step_interval 0, or stopped before its first save), or a user's of the same names. Only a run asked to
    continue (--resume true) takes them over: metrics.csv keeps its rows up to the step resumed from."""
    if not out_dir.is_dir():
        return []
    names = [name for name in (RUN_CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, ROWS_FILE, QUARANTINE_FILE, RUN_ID_FILE)
             if (out_dir / name).exists()]
    samples = samples_written(out_dir)
    return names + ([f"{samples[0].parent.name}/{samples[0].name}"] if samples else [])


def check_checkpoint_matches(cfg: Config, path: Path, model_config: Optional[PretrainedConfig],
                             problems: list[str]) -> Optional[dict]:
    """The checkpoint's metadata when it is this model's, checked tensor by tensor; None after a problem."""
    flag = f"--checkpoint {path}"
    try:
        metadata = read_metadata(path)
    except CheckpointError as error:
        problems.append(f"{flag}: {str(error).split(': ', 1)[1]}; pick another one")
        return None
    try:
        check_complete(path)
    except (CheckpointError, ValueError) as error:
        problems.append(f"{flag}: {str(error).replace(str(path.parent) + os.sep, '')}; pick another one")
        return None
    if not isinstance(metadata.get("step"), int) or "model_config" not in metadata:
        problems.append(f"{flag}: not a checkpoint written by train.py (no step/model_config); pick another one")
        return None
    if model_config is None:
        return metadata
    saved, current = metadata["model_config"], model_config.to_dict()
    differing = [k for k in SHAPE_KEYS if saved.get(k) != current.get(k)]
    if differing:
        k = differing[0]
        problems.append(f"{flag} is from a different model ({k} {saved.get(k)} != {current.get(k)}); "
                        "resume with the model it was trained with")
        return None
    try:
        changes = changed_fields(saved, model_config)
    except (KeyError, ValueError, TypeError):  # a recorded config that no longer loads: the shapes decide
        changes = []
    if changes:
        source = "--model_name" if cfg.model_name else "--model_config"
        problems.append(f"{flag} was trained with another config than {source} {model_source(cfg)} gives: "
                        f"{', '.join(changes[:3])}{' and more' if len(changes) > 3 else ''}; the resumed steps "
                        "would train another model; resume with the config it was trained with")
        return None
    model = meta_model(model_config, cfg.trust_remote_code)
    decayed, exempt = grouped_parameter_names(model, no_decay_names(model))
    try:
        check_fits(stored_tensor_shapes(path, decayed + exempt), expected_shapes(model, decayed + exempt), flag)
    except CheckpointMismatch as error:
        problems.append(f"{error}; resume with the model it was trained with")
        return None
    except ValueError as error:
        problems.append(f"{flag}: {error}; pick another one")
        return None
    return metadata


def resolve_resume(cfg: Config, model_config: Optional[PretrainedConfig], problems: list[str]) -> Optional[Resume]:
    if not cfg.resume:
        if latest_checkpoint(cfg.out_dir) and not cfg.estimate_memory:
            problems.append(f"--out_dir {cfg.out_dir} already holds checkpoints; add --resume true to continue that "
                            "run, or choose another --out_dir (nothing is overwritten)")
        return None
    if not cfg.checkpoint:
        return resolve_latest(cfg, model_config, problems)
    path = Path(cfg.checkpoint)
    if not path.exists():
        problems.append(f"--checkpoint {path}: no such file or folder")
        return None
    metadata = check_checkpoint_matches(cfg, path, model_config, problems)
    if metadata is None or holds_another_run(cfg, path, metadata, problems):
        return None
    if relaunched_after(cfg, path, metadata):
        return resolve_latest(cfg, model_config, problems)
    return Resume(path, metadata)


def relaunched_after(cfg: Config, checkpoint: Path, metadata: dict) -> bool:
    """The run in out_dir was started from this --checkpoint (its config.yaml says so) and has saved newer
    checkpoints since: this is that start's command again (a Slurm requeue, or --config out_dir/config.yaml), and it
    continues from the newest. Taken literally, every relaunch went back to the checkpoint, set the newer ones aside
    and replaced the rolled-back copies of the same steps an earlier rollback had kept."""
    newest = max(list_checkpoints(cfg.out_dir), default=0)
    if started_from(Path(cfg.out_dir)) != checkpoint.resolve() or newest <= metadata["step"]:
        return False
    note(f"--checkpoint {checkpoint}: this run started from it and has saved up to step {newest} since; continuing "
         f"from step {newest} (to go back to it again, give a copy of it under another name)")
    return True


def holds_another_run(cfg: Config, checkpoint: Path, metadata: dict, problems: list[str]) -> bool:
    """A checkpoint of another run resumed into an --out_dir that holds a run of its own: the resumed run would set
    that run's checkpoints aside and rewrite its metrics.csv and config.yaml, one mistyped path making two runs one,
    and a job script that names --checkpoint would go back to it at every requeue. A checkpoint is the run's own
    where it lies in out_dir/checkpoints or was saved by a run in out_dir (a copy elsewhere, under a name of the
    user's); an earlier start of the same command that saved nothing (preempted before its first save) is taken
    over."""
    out_dir = Path(cfg.out_dir)
    if not out_dir.exists() or any(folder is not None and folder.resolve() == out_dir.resolve()
                                   for folder in (run_folder_of(checkpoint), saved_out_dir(metadata))):
        return False
    if latest_checkpoint(out_dir):
        problems.append(f"--checkpoint {checkpoint} is not of the run in --out_dir {out_dir}, which holds checkpoints "
                        f"up to step {max(list_checkpoints(out_dir))}: to continue that run, resume without "
                        "--checkpoint (its newest is taken); to continue this checkpoint, give a new or empty --out_dir")
        return True
    written = files_a_new_run_replaces(out_dir)
    if not written or started_from(out_dir) == checkpoint.resolve():
        return False
    problems.append(f"--checkpoint {checkpoint} is not of the run in --out_dir {out_dir}, which holds "
                    f"{', '.join(written[:3])} of another run: resuming it there would replace them; give a new or "
                    "empty --out_dir")
    return True


def saved_out_dir(metadata: dict) -> Optional[Path]:
    """The --out_dir of the run that saved a checkpoint, as its options record it."""
    recorded = (metadata.get("config") or {}).get("out_dir")
    return Path(metadata.get("cwd") or ".") / recorded if recorded else None


def started_from(out_dir: Path) -> Optional[Path]:
    """The --checkpoint the run in `out_dir` was started with, as its config.yaml records it."""
    try:
        recorded = yaml.safe_load((out_dir / RUN_CONFIG_FILE).read_text()).get("checkpoint")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return Path(recorded).resolve() if recorded else None


VANISHED_READS = 5
"""How many checkpoints in a row may vanish while the preflight reads them before it gives up."""


def resolve_latest(cfg: Config, model_config: Optional[PretrainedConfig], problems: list[str]) -> Optional[Resume]:
    """The newest checkpoint in out_dir, checked. A run still writing that folder (the same job submitted twice; the
    lock refuses the second once its ranks start) deletes its older checkpoints as it saves (--keep_last_n): one
    that vanished while it was read is taken as gone and the newest is read again, so that the second run ends in
    the lock's line instead of a FileNotFoundError from the middle of a read (seen in CI)."""
    for _ in range(VANISHED_READS):
        path = latest_checkpoint(cfg.out_dir)
        if path is None:
            note(f"--resume true: no checkpoint in {checkpoint_dir(cfg.out_dir)} yet, starting from step 0")
            return None
        found: list[str] = []
        try:
            metadata = check_checkpoint_matches(cfg, path, model_config, found)
        except Exception:  # FileNotFoundError, or a sharded folder's reader meeting a missing piece
            if path.exists():
                raise
            continue
        if path.exists():
            problems.extend(found)
            return Resume(path, metadata) if metadata is not None else None
    problems.append(f"--resume true: {VANISHED_READS} checkpoints in {checkpoint_dir(cfg.out_dir)} were deleted while "
                    "they were read; another run is writing --out_dir: wait for it to end, or choose another --out_dir")
    return None


def check_precision(cfg: Config, model_config: Optional[PretrainedConfig], problems: list[str]) -> None:
    """On a GPU without bf16 (V100, T4) a bf16 run would emulate it slowly or fail inside a worker, and a model
    that needs float32 modules overflows in fp16: refuse both here."""
    if model_config is not None:
        problem = fp32_modules_problem(cfg.precision, meta_model(model_config, cfg.trust_remote_code))
        if problem:
            problems.append(problem)
    moment = bf16_moment_problem(cfg.precision, cfg.beta2)
    if moment:
        problems.append(moment)
    if resolve_accelerator(cfg) == "cuda" and torch.cuda.is_available():
        problem = bf16_support_problem(cfg.precision, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
        if problem:
            problems.append(problem)


def check_devices(cfg: Config, problems: list[str]) -> None:
    """CPU offloading moves shards from an accelerator to the host; on CPU processes there is nowhere to offload
    from, and torch failed inside every rank (FSDP1 pinning memory, FSDP2's policy) after the run had written its
    files. TPUs need torch_xla, which Lightning asks for only inside every rank."""
    if cfg.cpu_offload and resolve_accelerator(cfg) == "cpu":
        problems.append(f"--cpu_offload true with --strategy {cfg.strategy} needs GPUs: on CPU processes the shards "
                        "already live in host memory; drop --cpu_offload")
    if cfg.tpu and importlib.util.find_spec("torch_xla") is None:
        problems.append(f"--accelerator tpu needs torch_xla, which this Python lacks: install the torch_xla release "
                        f"of torch {torch.__version__.split('+')[0]}")


def check_offloaded_accumulation(cfg: Config, plan: TrainingPlan, problems: list[str]) -> None:
    """FSDP1 with CPU offloading does not add a micro-batch's reduced gradient to the offloaded one: it copies it over
    (torch's FSDP documents gradient accumulation outside no_sync() with CPU offloading as unsupported;
    `FlatParamHandle.prepare_gradient_for_backward` leaves an offloaded gradient out of the sum), so every step would
    train on its last micro-batch alone. Inside no_sync (--fsdp_no_sync) the gradients add up unsharded."""
    if cfg.cpu_offload and cfg.strategy == "fsdp" and plan.accumulation > 1 and not cfg.fsdp_no_sync:
        problems.append(f"--cpu_offload true with {plan.accumulation} micro-batches per step: FSDP1 keeps only the "
                        "last one's offloaded gradient; add --fsdp_no_sync true (gradients add up unsharded until the "
                        "last micro-batch), or use --strategy fsdp2")


def launched_on_every_node() -> bool:
    """True when something starts the ranks of every node: a launcher Lightning detects (Slurm's srun, torchrun,
    LSF's jsrun, MPI), or Lightning's manual multi-node variables (MASTER_ADDR and NODE_RANK set on each node)."""
    with without_srun_hint():
        detected = any(environment.detect() for environment in
                       (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment, MPIEnvironment))
    return detected or {"MASTER_ADDR", "NODE_RANK"} <= os.environ.keys()


def check_launcher(cfg: Config, problems: list[str]) -> None:
    """Without a launcher for the other nodes, a multi-node run would wait for them until the rendezvous timeout. A
    launcher that started another number of processes than --devices x --num_nodes ended every rank in a traceback
    (an IndexError, Lightning's ValueError) or left one waiting for the others; a NODE_RANK beyond --num_nodes left
    every rank waiting until --rendezvous_timeout_min."""
    if cfg.num_nodes > 1 and not launched_on_every_node():
        problems.append(f"--num_nodes {cfg.num_nodes}: nothing starts the other nodes here; run train.py on every "
                        "node with srun (slurm/train.sbatch), torchrun --nnodes (slurm/train-torchrun.sbatch), or "
                        "by hand with MASTER_ADDR, MASTER_PORT and each node's NODE_RANK set; or use --num_nodes 1")
    started = launcher_processes()
    if started and started[1] != world_size(cfg):
        launcher, processes = started
        problems.append(f"--devices {cfg.devices} --num_nodes {cfg.num_nodes}: {world_size(cfg)} ranks, but {launcher} "
                        f"started {processes} processes; give --devices (processes per node) and --num_nodes whose "
                        f"product is {processes}")
    node_rank = os.environ.get("NODE_RANK", "0")
    if node_rank.isdigit() and int(node_rank) >= cfg.num_nodes:
        problems.append(f"NODE_RANK={node_rank} is set, but --num_nodes {cfg.num_nodes} has no node {node_rank}: "
                        "unset NODE_RANK, or give the run's --num_nodes")


def launcher_processes() -> Optional[tuple[str, int]]:
    """The launcher Lightning will take the ranks from (torchrun first: it may run inside a Slurm job) and how many
    processes it started; None without one."""
    with without_srun_hint():
        if TorchElasticEnvironment.detect():
            return "torchrun (WORLD_SIZE)", TorchElasticEnvironment().world_size()
        if SLURMEnvironment.detect():
            return "srun (SLURM_NTASKS)", SLURMEnvironment().world_size()
    return None


WANDB_MODES = ("online", "offline", "disabled")


def resolve_wandb(cfg: Config, problems: list[str]) -> Config:
    """--wandb_mode, --project, --entity and --run_name when given, else WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY and
    WANDB_NAME (what docker/run.sh forwards and wandb's users set), else disabled: a run without a choice writes
    nothing to out_dir/wandb, and says so in one line."""
    note_unused_wandb_variables(cfg)
    mode = cfg.wandb_mode or os.environ.get("WANDB_MODE") or "disabled"
    mode = wandb_mode_name(mode)
    if mode not in WANDB_MODES:
        problems.append(f"WANDB_MODE={mode} is not one of {', '.join(WANDB_MODES)}; set one, or give --wandb_mode")
        mode = "disabled"
    if not cfg.wandb_mode and not os.environ.get("WANDB_MODE"):
        note("Weights & Biases: off (--wandb_mode offline or online, or WANDB_MODE, to log there)")
    return replace(cfg, wandb_mode=mode, project=cfg.project or os.environ.get("WANDB_PROJECT") or "fsdp-trainer",
                   entity=cfg.entity or os.environ.get("WANDB_ENTITY"),
                   run_name=cfg.run_name or os.environ.get("WANDB_NAME"))


def wandb_mode_name(mode: str) -> str:
    return {"dryrun": "offline", "run": "online"}.get(mode, mode)  # wandb's older names


WANDB_VARIABLES = {"wandb_mode": "WANDB_MODE", "project": "WANDB_PROJECT", "entity": "WANDB_ENTITY",
                   "run_name": "WANDB_NAME"}


def note_unused_wandb_variables(cfg: Config) -> None:
    """An option (a flag or a config file: every demo config said `wandb_mode: disabled`) wins over the variable of
    the environment; say so where they differ, or `WANDB_MODE=offline` on a node without network goes unheard."""
    for option, variable in WANDB_VARIABLES.items():
        given, environment = getattr(cfg, option), os.environ.get(variable)
        if given and environment and wandb_mode_name(str(given)) != wandb_mode_name(environment):
            note(f"{variable}={environment} is not used: --{option} {given} (a flag or a config file) decides")


def note_wandb_history(cfg: Config, resume_step: int) -> None:
    """A resume from an older checkpoint logs its steps again. metrics.csv drops the abandoned rows; the W&B run it
    continues keeps them (W&B cannot cut a run's history: its rewind is a private preview), so say which."""
    out_dir, continued = Path(cfg.out_dir), os.environ.get("WANDB_RUN_ID")
    if cfg.wandb_mode == "disabled" or not (continued or (out_dir / RUN_ID_FILE).is_file()):
        return
    try:
        with open(out_dir / METRICS_FILE, newline="") as handle:
            logged = [int(row["step"]) for row in csv.DictReader(handle) if (row.get("step") or "").isdigit()]
    except (OSError, KeyError, csv.Error):
        return
    abandoned = sorted(step for step in logged if step > resume_step)
    if abandoned:
        note(f"--resume: the Weights & Biases run keeps steps {abandoned[0]}-{abandoned[-1]}, logged after step "
             f"{resume_step} by the stretch this resume abandons, beside the ones logged again (W&B cannot cut a "
             "run's history); metrics.csv drops them")


def check_wandb(cfg: Config, problems: list[str]) -> None:
    netrc = Path.home() / ".netrc"
    logged_in = "WANDB_API_KEY" in os.environ or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())
    if cfg.wandb_mode == "online" and not logged_in:
        problems.append("--wandb_mode online needs WANDB_API_KEY or `wandb login`; or use --wandb_mode offline")
    if cfg.log_model and cfg.wandb_mode == "disabled":
        problems.append(f"--log_model {str(cfg.log_model).lower()} uploads checkpoints to Weights & Biases, which this "
                        "run does not use; give --wandb_mode online (or offline, synced later), or drop --log_model")


def preflight(cfg: Config) -> RunInputs:
    """Check everything; exit with status 2 and one line per problem, or return what the run needs."""
    problems: list[str] = []
    cfg = resolve_wandb(cfg, problems)
    data = check_data(cfg, problems) if reads_data(cfg) else None
    model_config = check_model(cfg, problems)
    check_runs_here(cfg, problems)
    wrap_classes: set[type[Module]] = set()
    if model_config is not None and (cfg.strategy in SHARDED_STRATEGIES or cfg.tpu):
        try:
            wrap_classes = resolve_wrap_classes(model_config, cfg.auto_wrap_policy, cfg.trust_remote_code)
        except ValueError as error:
            problems.append(str(error))
    packed_layout: Layout = "position_ids"
    attention_works = model_config is not None and check_attention_supported(cfg, model_config, problems)
    if attention_works:
        check_activation_checkpointing(cfg, model_config, problems)
    if model_config is not None and data is not None:
        check_model_fits_data(cfg, model_config, data, problems)
        if attention_works:
            packed_layout = check_packed_isolation(cfg, model_config, data, problems)
            check_decoder_start(cfg, model_config, data, problems)
    chunked_loss = check_chunked_loss(cfg, model_config) if attention_works else False
    resume = resolve_resume(cfg, model_config, problems)
    check_data_resume(cfg, data, resume, problems)
    plan = check_plan(cfg, data or planned_blocks(cfg), resume, problems) if data or cfg.block_size else None
    if plan is not None:
        check_offloaded_accumulation(cfg, plan, problems)
        if cfg.fsdp_no_sync and plan.accumulation == 1 and not cfg.estimate_memory:
            note("--fsdp_no_sync true is not used: each step is one micro-batch per rank, with nothing to accumulate")
    tokenizer = resolve_tokenizer(cfg, model_config, problems)
    if data is not None:
        check_samples(cfg, data, tokenizer, problems, model_config)
    if not cfg.estimate_memory:  # planning writes nothing
        check_out_dir(cfg, model_config, problems)
        check_run_tokenizer(cfg, tokenizer, problems)
    check_precision(cfg, model_config, problems)
    check_devices(cfg, problems)
    if not cfg.estimate_memory:  # planning logs nothing and starts no node: it plans a cluster from a laptop
        check_wandb(cfg, problems)
        check_launcher(cfg, problems)
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    cfg = resolve_learning_rates(cfg, plan)
    if resume is not None:
        note_changed_options(cfg, resume.metadata)
        note_wandb_history(cfg, resume.metadata["step"])
    rounding = bf16_rounding_note(cfg.precision, cfg.lr, cfg.weight_decay)
    if rounding:
        note(rounding)
    return RunInputs(config=cfg, model_config=model_config, wrap_classes=wrap_classes,
                     plan=plan, tokenizer=tokenizer, resume_from=resume.path if resume else None,
                     resume_step=resume.metadata["step"] if resume else None,
                     packed_layout=packed_layout, chunked_loss=chunked_loss,
                     mixture=describe(data.sources, data.source_rows) if data and data.sources else "",
                     target_block_size=data.target_block_size if data else 0,
                     data_folders=data.identities if data else [])
