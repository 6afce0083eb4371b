"""Checkpoint bytes written past the page cache (app/checkpoint/direct_io.py): the file is exact whatever the ranges'
alignment, order and writers, and the whole blocks really go through O_DIRECT where the filesystem takes it."""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import random
from pathlib import Path

import numpy
import pytest
import torch

from app.checkpoint import direct_io
from app.checkpoint.direct_io import ALIGN, BOUNCE_BYTES, IN_PLACE_BYTES, DirectFile, DirectStream, open_direct


def empty_at_phase(shape: tuple[int, ...], dtype: torch.dtype, phase: int) -> torch.Tensor:
    """An uninitialized tensor whose data begins `phase` bytes past a page boundary, as StagingArea places pieces."""
    memory = torch.empty(numpy.prod(shape) * dtype.itemsize + ALIGN, dtype=torch.uint8)
    skip = (phase - memory.data_ptr()) % ALIGN
    return torch.frombuffer(memory.numpy(), dtype=dtype, count=int(numpy.prod(shape)), offset=skip).view(shape)

SIZE = BOUNCE_BYTES * 2 + 3 * ALIGN + 123
"""More than two bounce buffers, and not a whole number of blocks."""


def unaligned_ranges(size: int, seed: int) -> list[tuple[int, int]]:
    """Consecutive ranges covering [0, size): tiny ones inside a block, ones across a few blocks, larger ones."""
    generator, ranges, start = random.Random(seed), [], 0
    while start < size:
        length = generator.choice([1, 7, ALIGN - 1, ALIGN + 5, 3 * ALIGN + 17, BOUNCE_BYTES + 11])
        ranges.append((start, min(start + length, size)))
        start += length
    return ranges


def write_ranges(path: Path, expected: bytes, ranges: list[tuple[int, int]]) -> None:
    with DirectFile(path) as file:
        for start, stop in ranges:
            file.write_at(start, memoryview(expected)[start:stop])


def test_two_processes_writing_neighbouring_unaligned_ranges_in_any_order_make_the_exact_file(tmp_path) -> None:
    expected = random.Random(0).randbytes(SIZE)
    path = tmp_path / "file"
    with open(path, "wb") as handle:
        handle.truncate(SIZE)
    ranges = unaligned_ranges(SIZE, seed=1)
    random.Random(2).shuffle(ranges)
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=write_ranges, args=(path, expected, ranges[rank::2])) for rank in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert path.read_bytes() == expected


def test_a_stream_of_writes_of_any_size_makes_the_exact_file_and_tells_its_position(tmp_path) -> None:
    expected = random.Random(3).randbytes(SIZE)
    path = tmp_path / "stream"
    with DirectStream(path) as stream:
        for start, stop in unaligned_ranges(SIZE, seed=4):
            assert stream.tell() == start
            assert stream.write(expected[start:stop]) == stop - start
    assert path.read_bytes() == expected


def test_memory_placed_like_the_file_is_written_from_where_it_lies_and_other_memory_through_the_bounce_buffer(
        tmp_path, monkeypatch) -> None:
    """A background save stages each piece at the place within a page that its bytes have within a disk block
    (StagingArea): its whole blocks then go to the disk with no copy."""
    expected = random.Random(8).randbytes(SIZE)
    offset = 3 * ALIGN + 1000
    path = tmp_path / "file"
    with open(path, "wb") as handle:
        handle.truncate(offset + SIZE)
    staged = empty_at_phase((SIZE,), torch.uint8, offset % ALIGN)
    staged.numpy()[:] = numpy.frombuffer(expected, dtype=numpy.uint8)
    assert staged.data_ptr() % ALIGN == offset % ALIGN
    copied = []
    real_copy = direct_io.copy_into
    monkeypatch.setattr(direct_io, "copy_into",
                        lambda into, source: copied.append(len(source)) or real_copy(into, source))
    with DirectFile(path) as file:
        file.write_at(offset, memoryview(staged.numpy()))
        assert copied == []
        assert path.read_bytes()[offset:] == expected
        file.write_at(offset + 8, memoryview(staged.numpy())[:-8])
        assert sum(copied) > SIZE - 2 * ALIGN
    assert path.read_bytes()[offset:] == expected[:8] + expected[:-8]


def test_a_stream_writes_large_writes_lying_like_the_file_from_where_they_lie(
        tmp_path, monkeypatch) -> None:
    head, large = random.Random(9).randbytes(1000), random.Random(10).randbytes(IN_PLACE_BYTES + 3 * ALIGN + 5)
    placed = empty_at_phase((len(large),), torch.uint8, len(head) % ALIGN)
    placed.numpy()[:] = numpy.frombuffer(large, dtype=numpy.uint8)
    copied = []
    real_copy = direct_io.copy_into
    monkeypatch.setattr(direct_io, "copy_into",
                        lambda into, source: copied.append(len(source)) or real_copy(into, source))
    path = tmp_path / "stream"
    with DirectStream(path) as stream:
        stream.write(head)
        stream.write(memoryview(placed.numpy()))
        stream.write(large)  # lies elsewhere: through the buffer
    assert path.read_bytes() == head + large + large
    assert sum(copied) < len(head) + 2 * ALIGN + len(large) + ALIGN


def test_whole_blocks_go_through_o_direct_where_the_filesystem_takes_it(tmp_path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    with DirectFile(path) as file:
        assert file.direct is not None


def test_a_device_refusing_a_direct_write_gets_the_bytes_through_the_page_cache(tmp_path, monkeypatch) -> None:
    """Devices whose blocks are larger than ALIGN refuse the write with EINVAL: the same bytes, buffered."""
    expected = random.Random(5).randbytes(SIZE)
    path = tmp_path / "file"
    path.write_bytes(bytes(SIZE))
    real_pwrite = os.pwrite
    with DirectFile(path) as file:
        refused = file.direct

        def pwrite(descriptor: int, data, offset: int) -> int:
            if descriptor == refused:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(descriptor, data, offset)

        monkeypatch.setattr(direct_io.os, "pwrite", pwrite)
        for start, stop in unaligned_ranges(SIZE, seed=6):
            file.write_at(start, memoryview(expected)[start:stop])
        assert file.direct is None
    assert path.read_bytes() == expected


def test_a_filesystem_without_o_direct_is_written_through_the_page_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.delattr(direct_io.os, "O_DIRECT")
    path = tmp_path / "file"
    path.write_bytes(b"")
    assert open_direct(path, os.O_WRONLY) is None
    expected = random.Random(7).randbytes(3 * ALIGN + 5)
    with DirectStream(path) as stream:
        stream.write(expected)
    assert path.read_bytes() == expected


@pytest.mark.parametrize("refusal", ["none", "no O_DIRECT", "EINVAL"])
def test_ranges_of_any_alignment_read_back_exactly_and_past_the_end_of_the_file_fewer(tmp_path, monkeypatch,
                                                                                  refusal) -> None:
    """Resume reads its pieces past the page cache (DirectReader); where the filesystem has no O_DIRECT, or the
    device refuses a read, through it: the same bytes either way. Reads of another file in between, through the same
    buffer (as the rank files of a sharded folder share one), change nothing."""
    expected, other = random.Random(11).randbytes(SIZE), random.Random(14).randbytes(3 * ALIGN + 9)
    path = tmp_path / "file"
    path.write_bytes(expected)
    (tmp_path / "other").write_bytes(other)
    if refusal == "no O_DIRECT":
        monkeypatch.delattr(direct_io.os, "O_DIRECT")
    bounce = mmap.mmap(-1, BOUNCE_BYTES)
    reader, other_reader = direct_io.DirectReader(path, bounce), direct_io.DirectReader(tmp_path / "other", bounce)
    if refusal == "EINVAL":
        real_preadv, refused = os.preadv, reader.direct

        def preadv(descriptor: int, buffers, offset: int) -> int:
            if descriptor == refused:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_preadv(descriptor, buffers, offset)

        monkeypatch.setattr(direct_io.os, "preadv", preadv)
    ranges = unaligned_ranges(SIZE, seed=12)
    random.Random(13).shuffle(ranges)
    try:
        for start, stop in ranges + [(0, SIZE)]:
            into = bytearray(stop - start)
            assert reader.read_into(start, memoryview(into)) == stop - start
            assert into == expected[start:stop], (start, stop)
            into = bytearray(ALIGN + 3)
            assert other_reader.read_into(7, memoryview(into)) == ALIGN + 3 and into == other[7:ALIGN + 10]
        for start in (SIZE - 5, SIZE - ALIGN - 3, SIZE, SIZE + 7):
            into = bytearray(BOUNCE_BYTES + 100)
            count = reader.read_into(start, memoryview(into))
            assert count == max(SIZE - start, 0) and into[:count] == expected[start:]
        direct = open_direct(path, os.O_RDONLY)
        if direct is not None:
            os.close(direct)
        assert (reader.direct is not None) == (refusal == "none" and direct is not None)
    finally:
        reader.close()
        other_reader.close()
        bounce.close()
