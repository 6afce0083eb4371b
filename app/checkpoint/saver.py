"""Saving a checkpoint now, or (--async_save) staging it and writing it while training goes on.

A background save has two halves:
1. staging, at the step that saves, on every rank: each rank copies its own shards of the state to host memory,
   away from the tensors the next steps change (with DDP or one device, rank 0 copies the whole state).
2. writing, in a background thread: full format, rank 0 gathers one whole tensor at a time from the staged pieces
   and streams it into the file (gather.py); sharded, every rank writes its shards (torch.distributed.checkpoint's
   async_save); then fsync, the atomic rename and what follows publishing (best.json, --keep_last_n) on rank 0.
The next save, an upload and the end of the run wait for the write; a crash before the rename leaves the previous
checkpoints and a temporary name that resume never takes (files.py). The gathers and the background half of a
save talk to the other ranks over a gloo process group of their own (made once per run), so that their
collectives never interleave with training's, and run on CPU tensors on any machine.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from app.checkpoint.files import make_durable, publish
from app.checkpoint.gather import pieces_of
from app.checkpoint.io import (SHARDED_METADATA, begin_save, metadata_of, no_process_group, save_checkpoint,
                               write_full)
from app.checkpoint.state import TrainingState

if TYPE_CHECKING:
    from lightning import Fabric


def staged_value(value: Any, whole_here: bool) -> torch.Tensor:
    """A copy of a tensor this rank writes whole; else only its shape and dtype (its pieces are staged apart)."""
    if whole_here:
        return value.detach().to("cpu", copy=True)
    return torch.empty(tuple(value.size()), dtype=value.dtype, device="meta")


class CheckpointSaver:
    """Writes checkpoints in the run's format, synchronously or in the background."""

    def __init__(self, fabric: Fabric, sharded: bool, background: bool) -> None:
        self.fabric, self.sharded, self.background = fabric, sharded, background
        self.pending: Optional[Future] = None
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if background else None
        self.group = None if no_process_group() else dist.new_group(backend="gloo")

    def save(self, path: Path, state: dict[str, Any], published: Callable[[], None]) -> None:
        """Save `state` to `path`; `published` runs on rank 0 once the checkpoint is visible. Collective."""
        self.wait()
        if not self.background:
            save_checkpoint(self.fabric, path, state, self.sharded, self.group)
            if self.fabric.is_global_zero:
                published()
            return
        temporary = begin_save(self.fabric, path)
        tensors = TrainingState.of(state["model"], state["optimizer"]).tensors()
        metadata = json.loads(json.dumps(metadata_of(state)))  # a snapshot: training goes on changing `state`
        rank0 = self.fabric.is_global_zero
        if self.sharded:
            written = dcp.async_save(tensors, storage_writer=FileSystemWriter(str(temporary), single_file_per_rank=True),
                                     process_group=self.group, no_dist=no_process_group())

            def write() -> None:
                written.result()
                if rank0:
                    (temporary / SHARDED_METADATA).write_text(json.dumps(metadata))
        else:
            pieces = {name: pieces_of(value, copy=True) for name, value in tensors.items()}
            staged = {name: staged_value(value, pieces[name] is None and rank0) for name, value in tensors.items()}

            def write() -> None:
                write_full(temporary, staged, pieces, metadata, rank0, self.group)

        def write_and_publish() -> None:
            write()
            if rank0:
                make_durable(temporary)
                publish(temporary, path)
                published()

        self.pending = self.writer.submit(write_and_publish)

    def wait(self) -> None:
        """Until the background write is published (re-raising its error, if it failed)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self.writer is not None:
            self.writer.shutdown()
