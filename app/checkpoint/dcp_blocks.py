"""A rank's file of a sharded checkpoint, in torch.distributed.checkpoint's (DCP) format, written without torch.save.

DCP stores each block of a tensor as the bytes `torch.save(block)` writes, at an offset its metadata records, and
its reader gives those bytes to torch.load. torch.save costs about 0.1 ms of Python per block (it pickles the
block's description and writes some 40 small zip records around its data), for the 300-400 blocks a rank of the
170M benchmark model writes at every save: time held under the GIL, which a background save (--async_save) shares
with training. The bytes around the data depend only on the block's dtype and shape (the data record's place in the
archive is fixed, and the zip CRC-32, which no reader checks, is off), so `framing` makes them once per dtype and
shape and `write_block` writes them around each block's data again: the bytes torch.save writes, in three writes.
DCP records where each block lies in its file, so blocks need not follow each other: zero bytes before a large
block place its data at the offset within a disk block that it has in memory, and its whole disk blocks then go to
the disk from the training state itself (direct_io.py), whether the save is made now or in the background.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from app.checkpoint.checksums import checksum
from app.checkpoint.direct_io import ALIGN, IN_PLACE_BYTES, DirectStream, address_of


@contextmanager
def without_crc32() -> Iterator[None]:
    """torch.save without the zip records' CRC-32: torch.load never checks it, nor do the readers of sources.py; with
    it, the bytes around a block's data would depend on the data. (A process-wide setting.)"""
    computed = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(computed)


class FramingRecorder(io.RawIOBase):
    """What torch.save writes around the data of `data_address`: the bytes before it and after it."""

    def __init__(self, data_address: int, nbytes: int) -> None:
        super().__init__()
        self.data_address, self.nbytes = data_address, nbytes
        self.before, self.after = bytearray(), bytearray()
        self.data_seen = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        with memoryview(data).cast("B") as view:
            if self.nbytes and len(view) == self.nbytes and address_of(view) == self.data_address:
                self.data_seen = True
            else:
                (self.after if self.data_seen else self.before).extend(view)
            return len(view)


@functools.cache
def framing(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The bytes torch.save writes before and after a contiguous tensor's data (of a tensor whose storage is exactly
    its data, as DCP saves every block), from torch.save of an uninitialized tensor: its memory is never read."""
    sample = torch.empty(shape, dtype=dtype)
    recorder = FramingRecorder(sample.data_ptr(), sample.nbytes)
    with without_crc32():
        torch.save(sample, recorder)
    if sample.nbytes and not recorder.data_seen:
        raise RuntimeError(f"torch.save wrote the data of a {dtype} tensor of shape {shape} in pieces: update "
                           "app/checkpoint/dcp_blocks.py for this version of torch")
    return bytes(recorder.before), bytes(recorder.after)


def write_block(stream: io.RawIOBase, block: torch.Tensor) -> str:
    """The bytes of `torch.save(block)` (with the CRC-32 off), from the block's own memory; returns the checksum of
    its data (checksums.py)."""
    before, after = framing(block.dtype, tuple(block.shape))
    host = block.detach().cpu().contiguous()
    stream.write(before)
    stream.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
    stream.write(after)
    return checksum(host)


def padding(position: int, block: torch.Tensor) -> int:
    """Zero bytes to write at `position` before `block` so that its data lies in the file at the offset within a disk
    block it has in memory: for blocks large enough to be written from their own memory, in host memory."""
    if block.device.type != "cpu" or block.nbytes < IN_PLACE_BYTES:
        return 0
    before, _ = framing(block.dtype, tuple(block.shape))
    return (block.data_ptr() - position - len(before)) % ALIGN


Reading = Callable[[str, tuple[int, ...]], AbstractContextManager[torch.Tensor]]
"""(name, offsets) -> the block's data, valid within the `with` block (a background save's handover.py)."""


class BlocksWriter(FileSystemWriter):
    """DCP's FileSystemWriter for one file per rank, its blocks written by `write_block` through a `DirectStream`, in
    the order `order` gives their (name, offsets), rather than each by torch.save."""

    def __init__(self, path: str | Path, order: list[tuple[str, tuple[int, ...]]], reading: Reading) -> None:
        super().__init__(path, single_file_per_rank=True)
        self.order = {key: position for position, key in enumerate(order)}
        self.reading = reading
        self.checksums: dict[tuple[str, tuple[int, ...]], tuple[int, str]] = {}
        """(name, offsets) -> (numel, checksum) of every block written."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        with DirectStream(Path(self.path) / file_name) as stream:
            for item in sorted(plan.items, key=self.position):
                with self.reading(item.index.fqn, tuple(item.index.offset)) as block:
                    stream.write(bytes(padding(stream.tell(), block)))
                    begin = stream.tell()
                    value = write_block(stream, block)
                    if block.numel():
                        self.checksums[(item.index.fqn, tuple(item.index.offset))] = (block.numel(), value)
                length = stream.tell() - begin
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(file_name, begin, length)))
        written: Future[list[WriteResult]] = Future()
        written.set_result(results)
        return written

    def position(self, item: WriteItem) -> int:
        return self.order[(item.index.fqn, tuple(item.index.offset))]
