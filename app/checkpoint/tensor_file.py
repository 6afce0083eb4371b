"""A full checkpoint's file: the safetensors layout, written as a stream and read region by region.

Layout (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range (plus `__metadata__`, string to string), then the raw bytes. Files written
here open with the `safetensors` library, and files it writes open here. Two things the library cannot do, and
the reason this module exists:
- write tensors one at a time as rank 0 gathers them, so that rank 0 never holds the whole state (an 8B model's
  weights and AdamW moments are 96 GB in fp32);
- read a region of a tensor (a rank's rows) straight into the tensor that receives it with plain reads: the
  library memory-maps the file, and mapped pages count in every reading process's resident memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import BinaryIO

import torch

DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
HEADER_ALIGNMENT = 8


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Byte offset of its data from the start of the file."""

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


def layout(tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict[str, str]) -> bytes:
    """The header for tensors stored back to back in the given order: write it first, then each tensor's bytes."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in tensors:
        size = prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(encoded)) + encoded


def write_tensor(handle: BinaryIO, tensor: torch.Tensor) -> None:
    """Append one tensor's bytes (C order, as the header says); the tensor must be on the CPU."""
    data = tensor.detach().contiguous()
    handle.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))


def read_header(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tensors of a file and its string metadata; ValueError when the file is not in this layout."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is too short to be a checkpoint")
        (length,) = struct.unpack("<Q", prefix)
        if length > 100_000_000:
            raise ValueError(f"{path} does not start with a safetensors header")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} has no readable safetensors header ({error})") from None
    data_start = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    entries = {name: Entry(DTYPES[info["dtype"]], tuple(info["shape"]), data_start + info["data_offsets"][0])
               for name, info in header.items()}
    return entries, metadata


def read_into(handle: BinaryIO, entry: Entry, first: int, target: torch.Tensor) -> None:
    """Fill `target` (contiguous, on the CPU, of the stored dtype) with `target.numel()` elements of the stored
    tensor, flattened, from element `first` on: one seek and one read into the target's own memory."""
    handle.seek(entry.begin + first * entry.dtype.itemsize)
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    if handle.readinto(view) != len(view):
        raise ValueError("checkpoint file ended early: it is truncated")


def elements_per_row(entry: Entry) -> int:
    return prod(entry.shape[1:])


def read_region(handle: BinaryIO, entry: Entry, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """A region of the stored tensor: its rows are read whole, then the other dimensions are cut."""
    if not entry.shape:
        scalar = torch.empty((), dtype=entry.dtype)
        read_into(handle, entry, 0, scalar)
        return scalar
    rows = torch.empty((lengths[0], *entry.shape[1:]), dtype=entry.dtype)
    read_into(handle, entry, offsets[0] * elements_per_row(entry), rows)
    return rows[(slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:])))]


def whole_rows(entry: Entry, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
    """True when a region spans whole rows, i.e. is one contiguous byte range of the file."""
    return all(o == 0 and n == size for o, n, size in zip(offsets[1:], lengths[1:], entry.shape[1:]))


def read_tensors(path: Path, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors, one at a time, each in fresh memory."""
    entries, _ = read_header(path)
    with open(path, "rb") as handle:
        for name in names:
            entry = entries[name]
            yield name, read_region(handle, entry, (0,) * len(entry.shape), entry.shape)
