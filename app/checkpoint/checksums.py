"""Checksums of the pieces a checkpoint holds, recorded as they are written and checked as they are read back.

The readers check sizes (sources.py check_complete), and a size that is right says nothing of the bytes: a failing
disk, a filesystem bug, or a copy tool that sizes its file first and is cut short leave a checkpoint that reads well
and holds zeros or noise. Resumed, it trained on from weights no run had (a loss of 5.99 where the run had reached
4.31); converted, its logits were "verified" against themselves. Each rank records the XXH3 checksum of every piece it
writes (a full file: its pieces of each tensor, writers.py; a sharded folder: each block DCP stores), and a reader
checks every recorded piece it reads whole: a resume on the layout that saved the checkpoint reads every piece whole,
one on another layout the pieces within its ranks' shares, a conversion every piece of the model.

XXH3 (the xxhash package, which datasets installs too) hashes at memory speed: about 5 GB/s on one core of this
project's CI machine, more on a server's, for a rank's share of the state that is written at disk speed anyway. A
checkpoint written before checksums existed is read unchecked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import torch
import xxhash

Table = dict[str, list[tuple[int, int, str]]]
"""name -> (start, numel, checksum) of every piece of the tensor, flattened, that was written on its own."""

CHECKSUMS_KEY = "checksums"
"""Where a full file's header holds the table (beside the training metadata)."""
CHECKSUMS_FILE = "checksums.json"
"""Where a sharded folder holds it."""

UNWRITTEN = "0" * 16
"""The checksum a table made before the writing holds: as long as any (full files reserve the table's place in
their header, and fill it in once every piece is written)."""


def checksum(data: torch.Tensor) -> str:
    """The XXH3 64-bit checksum of a host tensor's bytes, as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(memoryview(data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))


def unwritten(writers: dict[str, list[tuple[int, int, int]]]) -> Table:
    """The table of a full file before its pieces are written, from the writers' (rank, start, numel) of each."""
    return {name: [(start, numel, UNWRITTEN) for _, start, numel in pieces] for name, pieces in writers.items()}


def encode(table: Table) -> str:
    return json.dumps({name: [list(piece) for piece in pieces] for name, pieces in table.items()},
                      separators=(",", ":"))


def decode(text: str) -> Table:
    return {name: [(int(start), int(numel), str(value)) for start, numel, value in pieces]
            for name, pieces in json.loads(text).items()}


def merged(tables: Iterable[dict[tuple[str, int], tuple[int, str]]], names: Iterable[str]) -> Table:
    """Every rank's (name, start) -> (numel, checksum) as one table, each tensor's pieces in order of start."""
    table: Table = {name: [] for name in names}
    for recorded in tables:
        for (name, start), (numel, value) in recorded.items():
            table[name].append((start, numel, value))
    return {name: sorted(pieces) for name, pieces in table.items()}


def check_pieces(table: Table, name: str, first: int, data: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, numel) of every recorded piece of `name` that lies within elements [first, first + numel) read
    into `data` (host memory, flattened, in the stored dtype) and does not hold the bytes that were written."""
    stop = first + data.numel()
    return [(start, numel) for start, numel, value in table.get(name, ())
            if first <= start and start + numel <= stop and numel
            and checksum(data[start - first:start - first + numel]) != value]
