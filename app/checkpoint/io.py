"""Saving and loading a run's `state` (model, optimizer, counters, random states) in either checkpoint format.

- full (--state_dict_type full): one file in the safetensors layout, tensors under the names of state.py and the
  rest as JSON in its metadata. Rank 0 gathers one tensor at a time (gather.py) and streams it into the file, so it
  never holds more than one whole tensor; on resume each rank reads only the rows of its own shard (reader.py).
- sharded (--state_dict_type sharded): a torch.distributed.checkpoint folder, every rank writing its shards, and
  `training.json`.
Both load into any strategy at any world size: through torch's state dicts and DCP (state.py), or, for a full file
under FSDP, straight into each rank's flat shards (fsdp_shards.py). Checkpoints of earlier versions (legacy.py)
load too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import closing, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from app.checkpoint import legacy
from app.model import strategy_module
from app.checkpoint.files import make_durable, publish, remove_leftovers, temporary_path
from app.checkpoint.gather import Piece, RankZeroGather, pieces_of
from app.checkpoint.reader import FileSource, MemorySource, SourceReader
from app.checkpoint.fsdp_shards import load_into_shards, local_pieces
from app.checkpoint.state import MODEL_PREFIX, CheckpointMismatch, TrainingState, check_fits, global_shape
from app.checkpoint.tensor_file import layout, read_header, read_tensors, write_tensor

if TYPE_CHECKING:
    from lightning import Fabric

FORMAT = "fsdp-trainer/2"
METADATA_KEY = "training"
SHARDED_METADATA = "training.json"
TENSORS = ("model", "optimizer")


class CheckpointError(ValueError):
    """The checkpoint cannot be read, or holds another model's state: one line for the user."""


def no_process_group() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def metadata_of(state: dict[str, Any]) -> dict[str, Any]:
    """Everything in `state` but the model and the optimizer: plain JSON data."""
    return {"format": FORMAT} | {key: value for key, value in state.items() if key not in TENSORS}


def write_full(path: Path, tensors: dict[str, Any], pieces: dict[str, Optional[list[Piece]]],
               metadata: dict[str, Any], rank0: bool, group: Optional[dist.ProcessGroup]) -> None:
    """Stream the tensors into one file on rank 0, each gathered whole from the ranks' `pieces` over `group` just
    before it is written: rank 0 never holds more than one whole tensor. Collective: every rank calls it."""
    gather = RankZeroGather(pieces, group)
    with open(path, "wb") if rank0 else nullcontext() as handle:
        if rank0:
            handle.write(layout(((name, global_shape(value), value.dtype) for name, value in tensors.items()),
                                {METADATA_KEY: json.dumps(metadata)}))
        for name, value in tensors.items():
            whole = gather.whole(name, value, pieces[name])
            if rank0:
                write_tensor(handle, whole)


def write_sharded(folder: Path, tensors: dict[str, Any], metadata: dict[str, Any], rank0: bool) -> None:
    """Every rank writes its own shards (DCP), rank 0 the metadata. Collective."""
    dcp.save(tensors, storage_writer=FileSystemWriter(str(folder), single_file_per_rank=True),
             no_dist=no_process_group())
    if rank0:
        (folder / SHARDED_METADATA).write_text(json.dumps(metadata))


def begin_save(fabric: Fabric, path: Path) -> Path:
    """Clear what interrupted saves left; returns the temporary name to write to. Collective."""
    if fabric.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(path.parent)
    fabric.barrier()
    return temporary_path(path)


def save_checkpoint(fabric: Fabric, path: Path, state: dict[str, Any], sharded: bool,
                    group: Optional[dist.ProcessGroup]) -> None:
    """Write `state` to a temporary name beside `path`, then publish it atomically on rank 0. Collective; `group`
    carries the full format's gather."""
    temporary = begin_save(fabric, path)
    tensors = TrainingState.of(state["model"], state["optimizer"]).tensors()
    if sharded:
        write_sharded(temporary, tensors, metadata_of(state), fabric.is_global_zero)
    else:
        pieces = {name: pieces_of(value, copy=False) for name, value in tensors.items()}
        write_full(temporary, tensors, pieces, metadata_of(state), fabric.is_global_zero, group)
    fabric.barrier()
    if fabric.is_global_zero:
        make_durable(temporary)
        publish(temporary, path)
    fabric.barrier()


@contextmanager
def storage_reader(path: Path, parameter_order: Optional[list[str]] = None) -> Iterator[StorageReader]:
    """DCP's reader for any checkpoint: a sharded folder, a full file, or an earlier version's torch.save file."""
    if path.is_dir():
        yield FileSystemReader(str(path))
        return
    source = (MemorySource(legacy.tensors(legacy.load_torch_save(path), parameter_order))
              if legacy.is_torch_save_file(path) else FileSource(path))
    try:
        yield SourceReader(source)
    finally:
        source.close()


def stored_shapes(reader: StorageReader) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    entries = reader.read_metadata().state_dict_metadata
    return {name: (entry.properties.dtype, tuple(entry.size)) for name, entry in entries.items()
            if isinstance(entry, TensorStorageMetadata)}


def load_checkpoint(path: Path, model: Any, optimizer: Any) -> dict[str, Any]:
    """Load the model's and optimizer's tensors (each rank its own part) and return the checkpoint's metadata.
    Collective. Raises CheckpointError, before reading any tensor, when the checkpoint is another model's."""
    try:
        pieces = local_pieces(strategy_module(model)) if is_full_file(path) else []
        if pieces:
            with closing(FileSource(path)) as source:
                load_into_shards(source, strategy_module(model), optimizer, pieces, f"--checkpoint {path}")
        else:
            load_through_state_dicts(path, model, optimizer)
    except CheckpointMismatch as error:
        raise CheckpointError(str(error)) from None
    return read_metadata(path)


def is_full_file(path: Path) -> bool:
    """A full checkpoint of this version (not a sharded folder, not an earlier version's torch.save file)."""
    return path.is_file() and not legacy.is_torch_save_file(path)


def load_through_state_dicts(path: Path, model: Any, optimizer: Any) -> None:
    """The general route: torch's state dicts for any strategy, filled by DCP from any checkpoint."""
    training = TrainingState.of(model, optimizer)
    targets = training.tensors()
    with storage_reader(path, training.parameter_order()) as reader:
        check_fits(stored_shapes(reader), {name: global_shape(value) for name, value in targets.items()},
                   f"--checkpoint {path}")
        dcp.load(targets, storage_reader=reader, no_dist=no_process_group())
    training.apply(model, optimizer)


def read_metadata(path: Path) -> dict[str, Any]:
    """The checkpoint's counters, options and random states, without reading any weights (no code runs).
    Raises CheckpointError when it is not a readable checkpoint."""
    try:
        if path.is_dir():
            if (path / SHARDED_METADATA).is_file():
                return json.loads((path / SHARDED_METADATA).read_text())
            return legacy.metadata(legacy.load_sharded_metadata(path))
        if is_full_file(path):
            return json.loads(read_header(path)[1][METADATA_KEY])
        return legacy.metadata(legacy.load_torch_save(path))
    except Exception as error:  # a missing, truncated, foreign or unsafe file is the same user error
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(error).__name__})") from None


def stored_tensor_shapes(path: Path, parameter_order: Optional[list[str]] = None
                         ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor a checkpoint holds, without reading them (`parameter_order` names
    the numbered optimizer state of earlier DDP checkpoints, which is left out without it)."""
    with storage_reader(path, parameter_order) as reader:
        return stored_shapes(reader)


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's weights under their Hugging Face names, in their stored dtype, in one process (conversion)."""
    if path.is_file() and legacy.is_torch_save_file(path):
        return legacy.load_torch_save(path)["model"]
    shapes = {name: shape for name, shape in stored_tensor_shapes(path).items() if name.startswith(MODEL_PREFIX)}
    if path.is_dir():
        weights = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape) in shapes.items()}
        dcp.load(weights, storage_reader=FileSystemReader(str(path)), no_dist=True)
    else:
        weights = dict(read_tensors(path, shapes))
    return {name.removeprefix(MODEL_PREFIX): tensor for name, tensor in weights.items()}
