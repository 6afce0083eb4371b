"""A save that the storage refuses (a full disk, a quota, a read-only or vanished mount) ends the run in one line.

A rank whose write fails cannot simply raise: the other ranks would wait for it in the save's next exchange (a full
file's pieces sent to rank 0, the closing barrier) until a timeout, and the run ended with one rank's traceback and
the others' "connection closed by peer". So a rank that meets a storage error keeps it (`StorageFailure`), goes on
through every exchange of the save without writing, and the ranks then agree: every rank raises the same
`SaveFailed`, naming the first rank's error, at the same point of the save.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from app.folders import storage_error

T = TypeVar("T")


class SaveFailed(Exception):
    """The storage refused a checkpoint: raised on every rank alike, its message one line. `published`: the
    checkpoint itself was written and renamed into place, and what follows it (best.json, --keep_last_n) failed."""

    def __init__(self, message: str, published: bool = False) -> None:
        super().__init__(message)
        self.published = published

    def advice(self) -> str:
        if self.published:
            return "The run stopped there; make room (or move the run folder), then continue with --resume true"
        return ("The checkpoints saved before it are kept; the steps since the last one are lost. Make room there "
                "(or move the run folder), then continue with --resume true")


class StorageFailure:
    """The first storage error this rank met while saving; the save's later writes are skipped once one is kept."""

    def __init__(self, rank: int, writing: Path) -> None:
        self.rank, self.writing = rank, writing
        self.message: Optional[str] = None

    def attempt(self, action: Callable[..., T], *args: object) -> Optional[T]:
        """`action(*args)`, unless a storage error came before; None when it fails (the error is kept)."""
        if self.message is None:
            try:
                return action(*args)
            except OSError as error:
                self.keep(error)
        return None

    def keep(self, error: OSError) -> None:
        if self.message is None:
            self.message = f"rank {self.rank} on {socket.gethostname()}: {storage_error(error, self.writing)}"

    def raise_agreed(self, group: Optional[dist.ProcessGroup], published: bool = False) -> None:
        """SaveFailed on every rank when any rank kept an error (the lowest such rank's). Collective over `group`,
        and a barrier: every rank has finished its part of the save when it returns."""
        messages = [self.message]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            messages = [None] * dist.get_world_size(group)
            dist.all_gather_object(messages, self.message, group=group)
        first = next((message for message in messages if message), None)
        if first:
            raise SaveFailed(first, published)
