"""A full checkpoint's file: the safetensors layout, its header written first and the tensors' bytes streamed after.

Layout (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range (plus `__metadata__`, string to string), then the raw bytes. Files written
here open with the `safetensors` library, and files it writes open here. Two things the library cannot do, and
the reason this module exists:
- write tensors piece by piece as rank 0 receives them, so that rank 0 never holds the whole state (an 8B model's
  weights and AdamW moments are 96 GB in fp32);
- read a range of a tensor (a rank's piece) straight into the tensor that receives it with plain reads
  (sources.py): the library memory-maps the file, and mapped pages count in every reading process's resident memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from pathlib import Path

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


def layout(tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict[str, str],
           data_alignment: int = HEADER_ALIGNMENT) -> bytes:
    """The header for tensors stored back to back in the given order: write it first, then each tensor's bytes.
    It is padded so that the bytes begin at a multiple of `data_alignment` (a multiple of 8)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in tensors:
        size = prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % data_alignment)
    return struct.pack("<Q", len(encoded)) + encoded


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
