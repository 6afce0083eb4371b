"""Saving a checkpoint now, or (--async_save) staging it and writing it while training goes on.

A background save has two halves:
1. staging, at the step that saves, on every rank: the state is copied to host memory away from the tensors the
   next steps change. Full format: rank 0 gathers every whole tensor (it holds the whole training state in host
   RAM until the file is written); sharded: every rank copies its own shards (torch.distributed.checkpoint's
   async_save).
2. writing, in a background thread: the file or folder under its temporary name, fsync, the atomic rename, then
   whatever follows publishing (best.json, --keep_last_n) on rank 0.
The next save, an upload and the end of the run wait for the write; a crash before the rename leaves the previous
checkpoints and a temporary name that resume never takes (files.py). The background half of a sharded save talks
to the other ranks over a process group of its own, so that its collectives never interleave with training's.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from app.checkpoint.files import make_durable, publish
from app.checkpoint.io import (SHARDED_METADATA, begin_save, metadata_of, no_process_group, save_checkpoint,
                               stage_full, write_staged_full)
from app.checkpoint.state import TrainingState

if TYPE_CHECKING:
    from lightning import Fabric


class CheckpointSaver:
    """Writes checkpoints in the run's format, synchronously or in the background."""

    def __init__(self, fabric: Fabric, sharded: bool, background: bool) -> None:
        self.fabric, self.sharded, self.background = fabric, sharded, background
        self.pending: Optional[Future] = None
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if background else None
        self.group = (dist.new_group(backend="gloo") if background and sharded and not no_process_group()
                      else None)

    def save(self, path: Path, state: dict[str, Any], published: Callable[[], None]) -> None:
        """Save `state` to `path`; `published` runs on rank 0 once the checkpoint is visible. Collective."""
        self.wait()
        if not self.background:
            save_checkpoint(self.fabric, path, state, self.sharded)
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
            staged = stage_full(tensors, rank0)

            def write() -> None:
                if rank0:
                    write_staged_full(temporary, staged, metadata)

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
