"""Saving a checkpoint now, or (--async_save) writing it while training goes on.

Both take the same snapshot of what each rank writes (writers.py) and write it the same way; a background save
differs in two things:
1. what it writes from: the pieces a rank writes (and nothing else: under DDP only rank 0 writes the state) that lie
   in host memory as their bytes lie in the file (a sharded file's blocks) are written from the training state
   itself while the next step's forward and backward run, which only read them; that step's optimizer update, which
   changes them, first copies those not yet written (`before_update`, handover.py). The other pieces (a full file's,
   and those in a GPU's memory) are copied to host memory at once, in the background thread (on a GPU into pinned
   memory, on the default stream after the kernels queued before the save, so the copy reads what the step that
   saved left), and the update waits for that copy. The host memory for these copies is made once, when
   the run starts, and reused by every save: a machine without it fails at start-up rather than hours later. A
   synchronous save on a GPU copies its pieces into pinned memory of the same kind, made at its first save;
2. writing, in a background thread: the file or folder, then fsync, the atomic rename and what follows publishing
   (best.json, --keep_last_n) on rank 0.
The next save, an upload and the end of the run wait for the write; a crash before the rename leaves the previous
checkpoints and a temporary name that resume never takes (files.py). A write the storage refuses raises SaveFailed on
every rank alike (failures.py): a synchronous save at once, a background one at the next step (`failed` rides on the
step's verdict) or at the next `wait`. The exchanges of a save run over a gloo process
group of their own (made once per run), so that a background write's never interleave with training's collectives.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch.distributed as dist

from app.checkpoint.failures import SaveFailed, StorageFailure
from app.checkpoint.files import make_durable, publish, remove
from app.checkpoint.handover import Handover
from app.checkpoint.io import begin_save, snapshot
from app.checkpoint.writers import Snapshot, StagingArea
from app.cli import first_line

if TYPE_CHECKING:
    from lightning_fabric import Fabric


class CheckpointSaver:
    """Writes checkpoints of `state` in the run's format, synchronously or in the background."""

    def __init__(self, fabric: Fabric, state: dict[str, Any], sharded: bool, background: bool) -> None:
        self.fabric, self.sharded, self.background = fabric, sharded, background
        self.pending: Optional[Future] = None
        self.staging_copy: Optional[Future] = None
        self.handover: Optional[Handover] = None
        self.group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if background else None
        self.staging = StagingArea() if background or fabric.device.type != "cpu" else None
        if background:
            snapshot(state, sharded, self.group).reserve(self.staging)

    def save(self, path: Path, state: dict[str, Any], published: Callable[[], None]) -> None:
        """Save `state` to `path`; `published` runs on rank 0 once the checkpoint is visible. Collective; raises
        SaveFailed on every rank alike when the storage refuses it (what it wrote is removed), here or, for a
        background write, from `wait`."""
        self.wait()
        temporary = begin_save(path, self.group)
        taken = snapshot(state, self.sharded, self.group)
        rank = self.fabric.global_rank

        def write_and_publish(staged: Snapshot) -> None:
            try:
                staged.write(temporary)
                failure = StorageFailure(rank, temporary)
                if rank == 0:
                    failure.attempt(make_durable, temporary)
                    failure.attempt(publish, temporary, path)
                failure.raise_agreed(self.group)  # every rank returns once the checkpoint is published
            except SaveFailed as error:
                if rank == 0 and temporary.exists():
                    with suppress(OSError):
                        remove(temporary)
                raise SaveFailed(f"the checkpoint {path} was not saved: {error}") from None
            after = StorageFailure(rank, path.parent)
            if rank == 0:
                after.attempt(published)
            try:
                after.raise_agreed(self.group, published=True)
            except SaveFailed as error:
                raise SaveFailed(f"the checkpoint {path} was saved, but not what follows it (best.json, "
                                 f"--keep_last_n): {error}", published=True) from None

        if self.writer is None:
            write_and_publish(self.staged_on_device(taken))
            return
        taken = taken.for_background(self.staging)
        self.handover = taken.handover
        copy = self.staging_copy = self.writer.submit(taken.staged, self.staging)
        self.pending = self.writer.submit(lambda: write_and_publish(copy.result()))

    def staged_on_device(self, taken: Snapshot) -> Snapshot:
        """A synchronous save's pieces in a GPU's memory copied into the pinned staging arena, made at the first save
        (a run that never saves pins nothing) and reused by the next; where the machine cannot pin that much, the
        save copies piece by piece, as it did before the arena, and says so once."""
        if self.staging is None:
            return taken
        try:
            return taken.staged(self.staging)
        except RuntimeError as error:  # the pinned allocation failed (torch.OutOfMemoryError, CUDA's errors)
            self.staging = None
            print(f"warning: rank {self.fabric.global_rank} could not pin host memory for its checkpoint pieces "
                  f"({first_line(error)}); its saves copy them from the GPU piece by piece", file=sys.stderr,
                  flush=True)
            return taken

    def failed(self) -> bool:
        """Whether the background write has ended in an error. The step's verdict carries it (the ranks may see
        it at different steps), and every rank then meets it in `wait`: a write that failed (a full disk) ends the run
        at the step it is seen, not at the next save, which may be hours of training later."""
        return self.pending is not None and self.pending.done() and self.pending.exception() is not None

    def before_update(self) -> None:
        """Until the background save no longer reads the state that the optimizer step about to run changes."""
        if self.staging_copy is not None:
            copy, self.staging_copy = self.staging_copy, None
            copy.result()
        if self.handover is not None:
            handover, self.handover = self.handover, None
            handover.freeze()

    def wait(self) -> None:
        """Until the background write is published (re-raising its error, if it failed)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self.writer is not None:
            self.writer.shutdown()
