"""Checksums of the pieces a checkpoint holds, recorded as they are written and checked as they are read back.

The readers check sizes (sources.py check_complete), and a size that is right says nothing of the bytes: a failing
disk, a filesystem bug, or a copy tool that sizes its file first and is cut short leave a checkpoint that reads well
and holds zeros or noise. Resumed, it trained on from weights no run had (a loss of 5.99 where the run had reached
4.31); converted, its logits were "verified" against themselves. Each rank records the XXH3 checksum of every piece it
writes (a full file: its pieces of each tensor, writers.py; a sharded folder: each block DCP stores), and a reader
checks every recorded piece it reads whole: a resume on the layout that saved the checkpoint reads every piece whole,
one on another layout the pieces within its ranks' shares, a conversion every piece of the model.

The metadata (step, position in the data, random states, the spike guard's record) has an entry of its own,
METADATA_ENTRY: a flipped digit of the position resumed a run on other rows without a word. A resume on another
layout (fsdp2's row halves of what fsdp or DDP wrote as one piece) reads no piece whole: the ranks then share out
the pieces none of them read whole, and read each again, a bounded buffer at a time (io.py load_on_every_rank).

XXH3 (the xxhash package, which datasets installs too) hashes at memory speed: about 5 GB/s on one core of this
project's CI machine, more on a server's, for a rank's share of the state that is written at disk speed anyway. A
checkpoint written before checksums existed is read unchecked; one of FORMAT_WITH_CHECKSUMS without its table is
incomplete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Optional

import torch
import xxhash

Table = dict[str, list[tuple[int, int, str]]]
"""name -> (start, numel, checksum) of every piece of the tensor, flattened, that was written on its own."""

CHECKSUMS_KEY = "checksums"
"""Where a full file's header holds the table (beside the training metadata)."""
CHECKSUMS_FILE = "checksums.json"
"""Where a sharded folder holds it."""

METADATA_ENTRY = "<metadata>"
"""The table's entry for the checkpoint's metadata: one piece, the bytes of its JSON text as written."""
FORMAT_WITH_CHECKSUMS = "fsdp-trainer/3"
"""The checkpoint format whose every checkpoint has the table (io.py FORMAT); earlier ones may lack it."""

UNWRITTEN = "0" * 16
"""The checksum a table made before the writing holds: as long as any (full files reserve the table's place in
their header, and fill it in once every piece is written)."""


def checksum(data: torch.Tensor) -> str:
    """The XXH3 64-bit checksum of a host tensor's bytes, as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(memoryview(data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))


def with_metadata(table: Table, metadata_text: str) -> Table:
    """The table with the metadata's entry (its JSON text as the checkpoint holds it)."""
    data = metadata_text.encode()
    return table | {METADATA_ENTRY: [(0, len(data), xxhash.xxh3_64_hexdigest(data))]}


def metadata_problem(table: Table, metadata_text: str) -> Optional[str]:
    """Why the metadata's text is not what was written (None when it is, or the table has no entry for it)."""
    recorded = table.get(METADATA_ENTRY)
    if recorded and with_metadata({}, metadata_text)[METADATA_ENTRY] != recorded:
        return "its metadata (step, position in the data, random states) are not what was saved (their checksum " \
               "differs): the checkpoint is corrupt"
    return None


def tensor_pieces(table: Table) -> list[tuple[str, int, int, str]]:
    """Every recorded piece of a tensor, as (name, start, numel, checksum), in one order on every rank."""
    return [(name, start, numel, value) for name, pieces in sorted(table.items()) if name != METADATA_ENTRY
            for start, numel, value in pieces]


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


def pieces_within(table: Table, name: str, first: int, stop: int) -> list[tuple[int, int, str]]:
    """The recorded pieces of `name` that lie whole within elements [first, stop)."""
    return [(start, numel, value) for start, numel, value in table.get(name, ())
            if first <= start and start + numel <= stop and numel]


def check_pieces(table: Table, name: str, first: int, data: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, numel) of every recorded piece of `name` that lies within elements [first, first + numel) read
    into `data` (host memory, flattened, in the stored dtype) and does not hold the bytes that were written."""
    return [(start, numel) for start, numel, value in pieces_within(table, name, first, first + data.numel())
            if checksum(data[start - first:start - first + numel]) != value]
