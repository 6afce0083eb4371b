"""Saving and loading a run's `state` (model, optimizer, counters, random states) in either checkpoint format.

- full (--state_dict_type full): one file in the safetensors layout, tensors under the names of state.py and the
  rest as JSON in its metadata, streamed by rank 0 from every rank's pieces (writers.py).
- sharded (--state_dict_type sharded): a torch.distributed.checkpoint folder, every rank writing its pieces, and
  `training.json`.
A save takes this rank's part of the state (state_dicts.py: views of FSDP's flat shards, of FSDP2's local shards, or
of the whole tensors), writes it under a temporary name and publishes it atomically (files.py). A load reads, on
every rank, exactly the elements of its pieces from any checkpoint (sources.py), whatever strategy and world size
wrote it; checkpoints of earlier versions (legacy.py) load too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from app.checkpoint import legacy
from app.checkpoint.checksums import (CHECKSUMS_FILE, CHECKSUMS_KEY, FORMAT_WITH_CHECKSUMS, decode, metadata_problem,
                                      tensor_pieces)
from app.checkpoint.failures import StorageFailure
from app.checkpoint.files import list_checkpoints, remove_leftovers, temporary_path
from app.checkpoint.sources import CheckpointError, check_complete, open_source
from app.checkpoint.state import MODEL_PREFIX, CheckpointMismatch, check_fits
from app.checkpoint.state_dicts import local_state
from app.checkpoint.tensor_file import read_header
from app.checkpoint.writers import METADATA_KEY, SHARDED_METADATA, Snapshot, distributed

FORMAT = FORMAT_WITH_CHECKSUMS
TENSORS = ("model", "optimizer")


def metadata_of(state: dict[str, Any]) -> dict[str, Any]:
    """Everything in `state` but the model and the optimizer: plain JSON data."""
    return {"format": FORMAT} | {key: value for key, value in state.items() if key not in TENSORS}


def identity(metadata: dict[str, Any]) -> str:
    """A digest of a checkpoint's metadata (its counters, options, every rank's random states, the checksums of its
    tensors): copies of one checkpoint share it; checkpoints of one step written by other runs, or by another stretch
    of the same run, do not."""
    return hashlib.sha256(json.dumps(metadata, sort_keys=True, default=str).encode()).hexdigest()[:12]


def begin_save(path: Path, group: Optional[dist.ProcessGroup]) -> Path:
    """Clear what interrupted saves left; returns the temporary name to write to. Collective over `group` (rank 0
    works, the others wait); SaveFailed on every rank when the storage refuses it."""
    rank, _ = distributed(group)
    failure = StorageFailure(rank, path.parent)
    if rank == 0:
        failure.attempt(clear_for_saving, path.parent)
    failure.raise_agreed(group)
    return temporary_path(path)


def clear_for_saving(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    remove_leftovers(folder)


def snapshot(state: dict[str, Any], sharded: bool, group: Optional[dist.ProcessGroup]) -> Snapshot:
    """What this rank writes of `state`, as views of the training state. Collective."""
    return Snapshot.take(local_state(state["model"], state["optimizer"]), metadata_of(state), group, sharded=sharded)


def load_checkpoint(path: Path, model: Any, optimizer: Any, model_only: bool = False
                    ) -> tuple[dict[str, Any], set[tuple[str, int]]]:
    """Read every piece of the model's and optimizer's tensors this rank holds (of the model's alone when
    `model_only`: a new run from a checkpoint's weights, --init_from), in place, and return the checkpoint's metadata
    and the (name, start) of the recorded pieces read whole, and so checked. Each rank reads on its own. Raises
    CheckpointError, before reading any tensor, when the checkpoint is another model's."""
    local = local_state(model, optimizer)
    parts = {name: part for name, part in local.parts.items() if wanted(name, model_only)}
    label = str(path) if model_only else f"--checkpoint {path}"  # the caller names --init_from
    try:
        with open_source(path, local.parameter_order) as source:
            stored = {name: value for name, value in source.shapes().items() if wanted(name, model_only)}
            check_fits(stored, {name: part.shape for name, part in parts.items()}, label)
            for name, part in parts.items():
                for piece in part.pieces:
                    source.read_elements_into(name, piece.start, piece.data)
            verified = source.verified
    except CheckpointMismatch as error:
        raise CheckpointError(str(error)) from None
    return read_metadata(path), verified


def wanted(name: str, model_only: bool) -> bool:
    """Whether a checkpoint's tensor `name` is read: every one, or the model's alone."""
    return not model_only or name.startswith(MODEL_PREFIX)


def load_on_every_rank(path: Path, model: Any, optimizer: Any, model_only: bool = False
                       ) -> tuple[dict[str, Any], Optional[str]]:
    """`load_checkpoint` on every rank, then a check of the recorded pieces no rank read whole (another layout than
    the one that saved, checksums.py), shared out among the ranks; and why the checkpoint could not be read whole (a
    piece whose checksum differs: it is corrupt), the same on every rank: the others would otherwise wait in their
    next collective for the rank that failed. The metadata is empty when it could not. Collective."""
    try:
        (saved, verified), unreadable = load_checkpoint(path, model, optimizer, model_only), None
    except CheckpointError as error:
        saved, verified, unreadable = {}, set(), str(error)
    found = every_rank((unreadable, verified))
    problem = next((problem for problem, _ in found if problem), None)
    if problem is None:
        read_whole = set().union(*(pieces for _, pieces in found))
        problem = next((problem for problem in every_rank(check_unread_pieces(path, read_whole, model_only))
                        if problem), None)
    return (saved, None) if problem is None else ({}, problem)


def check_unread_pieces(path: Path, read_whole: set[tuple[str, int]], model_only: bool = False) -> Optional[str]:
    """Read again and check this rank's share of the recorded pieces that no rank read whole (of the model's alone
    when `model_only`); why one is corrupt."""
    rank, world_size = distributed(None)
    try:
        with open_source(path) as source:
            unread = [piece for piece in tensor_pieces(source.checksums)
                      if piece[:2] not in read_whole and wanted(piece[0], model_only)]
            for name, start, numel, value in unread[rank::world_size]:
                source.check_piece(name, start, numel, value)
    except CheckpointError as error:
        return str(error)
    return None


def every_rank(value: Any) -> list[Any]:
    """`value` of every rank, in rank order (this rank's alone without a process group). Collective."""
    if distributed(None)[1] == 1:
        return [value]
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, value)
    return found


def load_last_good_checkpoint(out_dir: str | Path, before_step: int, model: Any, optimizer: Any,
                              say: Callable[[str], None], also: Optional[Path] = None
                              ) -> Optional[tuple[Path, dict[str, Any]]]:
    """The last good checkpoint from before `before_step` (last_good_checkpoint) that every rank reads whole,
    loaded in place, and its metadata; one that does not (a checksum differs) is passed over for the one before it,
    with a line (`say`). None when none is left. Collective: rank 0 chooses."""
    broken: frozenset[Path] = frozenset()
    while True:
        chosen = [last_good_checkpoint(out_dir, before_step, broken, say, also) if distributed(None)[0] == 0
                  else None]
        if distributed(None)[1] > 1:
            dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
        if path is None:
            return None
        saved, unreadable = load_on_every_rank(path, model, optimizer)
        if unreadable is None:
            return path, saved
        say(f"not rolling back to {unreadable}; trying an earlier checkpoint")
        broken |= {path}


def last_good_checkpoint(out_dir: str | Path, before_step: int, passing_over: frozenset[Path] = frozenset(),
                         say: Callable[[str], None] = lambda line: None, also: Optional[Path] = None
                         ) -> Optional[Path]:
    """Where a rollback returns to (spike guard): the latest checkpoint saved before `before_step` whose validation
    loss, where it records one, is no higher than the lowest of those measured on the same validation rows as the
    latest's: a checkpoint from a stretch where the loss had begun to rise is passed over for an earlier one. So are
    those in `passing_over` (found corrupt). Losses measured on other rows (before a resume that added a folder or
    changed the evaluation's batches) do not compare: a folder added at a resume raised val_loss by its own rows, and
    a rollback discarded every step trained since, back to the checkpoint before that resume. One whose metadata
    cannot be read (not what was saved, its checksums lost) is passed over, with a line (`say`): it ended the
    rollback in a traceback, even where an earlier one was chosen. `also` (the checkpoint this run resumed from)
    is one too, wherever it lies: a run resumed into a new --out_dir had nothing to roll back to until it saved."""
    paths: list[tuple[Optional[int], Path]] = list(list_checkpoints(out_dir).items())
    if also is not None and also.exists() and also.resolve() not in {path.resolve() for _, path in paths}:
        paths.append((None, also))  # its step is in its metadata
    candidates, metadata = {}, {}
    for step, path in paths:
        if (step is None or step < before_step) and path not in passing_over:
            try:
                saved = read_metadata(path)
            except CheckpointError as error:
                say(f"not rolling back to {error}; trying an earlier checkpoint")
                continue
            if saved["step"] < before_step and saved["step"] not in candidates:
                candidates[saved["step"]], metadata[saved["step"]] = path, saved
    if not candidates:
        return None
    measured = validation_measured(metadata[max(metadata)])
    comparable = {step: saved["val_loss"] for step, saved in metadata.items()
                  if saved.get("val_loss") is not None and validation_measured(saved) == measured}
    good = [step for step in candidates if step not in comparable or comparable[step] <= min(comparable.values())]
    return candidates[max(good)]


def validation_measured(metadata: dict[str, Any]) -> str:
    """The validation rows a checkpoint's val_loss was measured on: of each data folder (wherever it lies, however
    it is named when it is the only one), its first --eval_iters x evaluation batch x ranks rows
    (app/evaluation/validation.py), which another layout with the same product reads too. A checkpoint that records
    no folders' rows: its data and those three numbers."""
    config = metadata.get("config") or {}
    folders, ranks = metadata.get("data_folders"), len(metadata.get("rng") or [])
    batch = config.get("eval_batch_size") or config.get("micro_batch_size")
    if folders and all(isinstance(folder, dict) and "validation_rows" in folder for folder in folders) and \
            config.get("eval_iters") and batch and ranks:
        own = {"path"} if len(folders) > 1 else {"path", "name"}
        read = [[{key: value for key, value in folder.items() if key not in own},
                 min(folder["validation_rows"], config["eval_iters"] * batch * ranks)] for folder in folders]
        return json.dumps(read, sort_keys=True, default=str)
    return json.dumps([folders or config.get("train_data_dir"), config.get("eval_iters"), batch, ranks],
                      sort_keys=True, default=str)


def validation_measured_by(config: dict[str, Any], data_folders: list, world_size: int) -> str:
    """`validation_measured` of a run about to train: what its checkpoints will record."""
    return validation_measured({"config": config, "data_folders": data_folders, "rng": [None] * world_size})


def is_checkpoint(path: Path) -> bool:
    """A checkpoint of any format and version (rather than a run folder or a folder of checkpoints)."""
    return path.is_file() or (path / SHARDED_METADATA).is_file() or (path / legacy.SHARDED_METADATA).is_file()


def is_full_file(path: Path) -> bool:
    """A full checkpoint of this version (not a sharded folder, not an earlier version's torch.save file)."""
    return path.is_file() and not legacy.is_torch_save_file(path)


def read_metadata(path: Path) -> dict[str, Any]:
    """The checkpoint's counters, options and random states, without reading any weights (no code runs).
    Raises CheckpointError when it is not a readable checkpoint."""
    try:
        if path.is_dir() and not (path / SHARDED_METADATA).is_file():
            return legacy.metadata(legacy.load_sharded_metadata(path))
        if not path.is_dir() and not is_full_file(path):
            return legacy.metadata(legacy.load_torch_save(path))
        text, table = stored_metadata(path)
        metadata = json.loads(text)
    except Exception as error:  # a missing, truncated, foreign or unsafe file is the same user error
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(error).__name__})") from None
    check_metadata(path, metadata, text, table)
    return metadata


def stored_metadata(path: Path) -> tuple[str, Optional[str]]:
    """The metadata's JSON text and the checksums' table (None where there is none) of a checkpoint of this
    project's format, a sharded folder or a full file."""
    if path.is_dir():
        table = path / CHECKSUMS_FILE
        return (path / SHARDED_METADATA).read_text(), table.read_text() if table.is_file() else None
    header = read_header(path)[1]
    return header[METADATA_KEY], header.get(CHECKSUMS_KEY)


def check_metadata(path: Path, metadata: dict[str, Any], text: str, table: Optional[str]) -> None:
    """Raise CheckpointError when the checksums' table of a format that always has one is missing or unreadable (a
    copy cut short), or the metadata is not what was saved (checksums.py)."""
    where = path / CHECKSUMS_FILE if path.is_dir() else path
    if table is None:
        if metadata.get("format") == FORMAT_WITH_CHECKSUMS:
            raise CheckpointError(f"{where}: the checksums of its pieces are missing: the checkpoint is incomplete")
        return
    try:
        problem = metadata_problem(decode(table), text)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{where}: the checksums of its pieces are not readable ({type(error).__name__}): the "
                              "checkpoint is incomplete") from None
    if problem:
        raise CheckpointError(f"{path}: {problem}")


def broken_checkpoint(path: Path) -> Optional[str]:
    """Why the checkpoint at `path` cannot be read whole, its path first: its metadata unreadable, or a file its index
    names missing or shorter than the bytes recorded there (a copy cut short, a rank's file lost, a failing disk).
    From the index and the files' sizes alone, no tensor read: bytes changed in place go unseen. None when whole.
    A file that vanishes while it is checked (another run of the same out_dir pruning it, --keep_last_n) or cannot
    be opened is a reason too: it ended the preflight of that other run in a FileNotFoundError traceback."""
    try:
        read_metadata(path)
        check_complete(path)
    except (CheckpointError, ValueError) as error:
        return str(error)
    except OSError as error:
        return f"{path}: not readable ({error.strerror or type(error).__name__})"
    return None


def stored_tensor_shapes(path: Path, parameter_order: Optional[list[str]] = None
                         ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor a checkpoint holds, without reading them (`parameter_order` names
    the numbered optimizer state of earlier DDP checkpoints, which is left out without it)."""
    with open_source(path, parameter_order) as source:
        return source.shapes()


def read_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every stored tensor whose name starts with `prefix`, whole and in its stored dtype, in one process."""
    tensors = {}
    with open_source(path) as source:
        for name, (dtype, shape) in source.shapes().items():
            if name.startswith(prefix):
                tensors[name] = torch.empty(shape, dtype=dtype)
                source.read_elements_into(name, 0, tensors[name])
    return tensors


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's weights under their Hugging Face names (conversion)."""
    return {name.removeprefix(MODEL_PREFIX): tensor for name, tensor in read_tensors(path, MODEL_PREFIX).items()}
