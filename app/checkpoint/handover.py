"""A background save (--async_save) writing pieces of the training state from where they lie, until the next update.

Copying a rank's state before writing it costs as much CPU as writing it (on the benchmark machine, 0.06-0.09 s per
GB against 0.05-0.1 s for the O_DIRECT write), CPU that training loses. Pieces that lie in host memory as their
bytes lie in the file (a sharded file's blocks, placed so: dcp_blocks.py) therefore go to the disk from the training
state itself while the next step's forward and backward run, which only read them. (A full file's layout is fixed:
its pieces, which rarely lie so, are copied at once to where they go to the disk from without another copy.) The
weight update that follows changes them, so it first calls `freeze`: that waits for the piece being written, copies
the pieces not yet written into host memory of their own, and the writer goes on from the copies. On the benchmark
machine the write ends long before the update, which then copies nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, Hashable, Optional

import torch

Pieces = dict[Hashable, torch.Tensor]


class Handover:
    """Pieces the writer thread reads from the training state (`live`) until `freeze`, then from copies `copy`
    makes of those it has not read yet."""

    def __init__(self, live: Pieces, copy: Callable[[Pieces], Pieces]) -> None:
        self.live, self.copy = live, copy
        self.done: set[Hashable] = set()
        self.frozen = False
        self.copies: Optional[Pieces] = None
        self.reading_live = False
        self.changed = threading.Condition()

    @contextmanager
    def reading(self, key: Hashable) -> Iterator[torch.Tensor]:
        """The piece to write, valid until the block ends (the writer thread, one piece at a time)."""
        with self.changed:
            self.changed.wait_for(lambda: not self.frozen or self.copies is not None)
            source = self.copies[key] if self.copies is not None else self.live[key]
            self.reading_live = self.copies is None
        try:
            yield source
        finally:
            with self.changed:
                self.reading_live = False
                self.done.add(key)
                self.changed.notify_all()

    def freeze(self) -> None:
        """Until no piece is read from the training state any more (the training thread, before it changes it)."""
        with self.changed:
            if self.frozen:
                return
            self.frozen = True
            self.changed.wait_for(lambda: not self.reading_live)
            rest = {key: data for key, data in self.live.items() if key not in self.done}
        copies: Pieces = {}
        try:
            copies = self.copy(rest) if rest else {}
        finally:  # a failed copy fails the write (a missing piece) rather than leaving the writer waiting
            with self.changed:
                self.copies = copies
                self.changed.notify_all()
