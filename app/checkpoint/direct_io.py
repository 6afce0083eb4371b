"""Checkpoint bytes written past the page cache (O_DIRECT), because a buffered write costs the training its CPU.

A buffered write copies every byte into page-cache memory the kernel first allocates and zeroes, then writes it
back from kernel threads: on this project's 2-core machine a buffered 1 GB write plus fsync took 5-6 s and cost two
busy processes 30% of their compute while it ran, where the same write with O_DIRECT took 0.8 s and cost them 1-2%
(the disk's DMA moves the bytes; the CPU only copies them once, into an aligned buffer). That is the cost of every
synchronous save, and the whole cost of a background one (--async_save).

O_DIRECT needs the memory, the file offset and the length aligned to the disk's block. `DirectFile.write_at` therefore
writes the whole blocks of a range from the memory itself when it is aligned like the file (a sharded save places its
large blocks that way, a background save stages its copies that way), else through an aligned bounce buffer, and the
bytes before the range's first block boundary and after its last one through the page cache, so ranks writing
neighbouring ranges of one file never write the same block both ways. Where the filesystem refuses O_DIRECT (tmpfs, some
network filesystems), or refuses a write, everything goes through the page cache: slower, never wrong. Durability is
unchanged: the file is fsynced before it is published (files.py), which flushes both kinds of write. Resume reads the
same way (`DirectReader`).
"""

from __future__ import annotations

import ctypes
import errno
import io
import mmap
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Optional

import numpy

ALIGN = max(4096, mmap.PAGESIZE)
"""Block and page size the direct writes are aligned to (a page, so no page-cache page is written both ways)."""
BOUNCE_BYTES = 16 << 20
GIL_FREE_COPY_BYTES = 1 << 16
IN_PLACE_BYTES = 1 << 20
"""DirectStream writes at least this large are candidates to go to the disk from their own memory."""


class _OpenedTwice:
    """A file opened through the page cache (`buffered`) and with O_DIRECT (`direct`: None where the filesystem
    refuses it, and from the first transfer a device refuses on)."""

    def __init__(self, path: Path, flags: int) -> None:
        self.buffered = os.open(path, flags)
        try:
            self.direct: Optional[int] = open_direct(path, flags)
        except OSError:
            os.close(self.buffered)
            raise

    def stop_direct(self) -> None:
        if self.direct is not None:
            direct, self.direct = self.direct, None
            os.close(direct)


class DirectFile(_OpenedTwice):
    """Positional writes into an existing file, whole blocks with O_DIRECT, the rest through the page cache."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, os.O_WRONLY)
        self.bounce = mmap.mmap(-1, BOUNCE_BYTES)  # page-aligned; pages never written cost nothing

    def write_at(self, offset: int, data: memoryview) -> None:
        data = data.cast("B")
        first_block = -(-offset // ALIGN) * ALIGN
        last_block = (offset + len(data)) // ALIGN * ALIGN
        if self.direct is None or first_block >= last_block:
            write_fully(self.buffered, data, offset)
            return
        write_fully(self.buffered, data[:first_block - offset], offset)
        in_place = address_of(data[first_block - offset:]) % ALIGN == 0
        with memoryview(self.bounce) as bounce:
            for start in range(first_block, last_block, BOUNCE_BYTES):
                chunk = data[start - offset:min(start + BOUNCE_BYTES, last_block) - offset]
                if in_place:
                    self.write_blocks(chunk, start)
                    continue
                with bounce[:len(chunk)] as aligned:
                    copy_into(aligned, chunk)
                    self.write_blocks(aligned, start)
        write_fully(self.buffered, data[last_block - offset:], last_block)

    def write_blocks(self, aligned: memoryview, offset: int) -> None:
        """`aligned`'s memory, `offset` and length all on block boundaries."""
        if self.direct is not None and unless_refused(partial(write_fully, self.direct, aligned, offset)) is not None:
            return
        self.stop_direct()  # no O_DIRECT, or a device wanting more than ALIGN: the page cache from here on
        write_fully(self.buffered, aligned, offset)

    def fileno(self) -> int:
        return self.buffered

    def close(self) -> None:
        self.stop_direct()
        self.bounce.close()
        os.close(self.buffered)

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exception: object) -> None:
        self.close()


def open_direct(path: Path, flags: int) -> Optional[int]:
    """A second descriptor of `path` for O_DIRECT writes (or reads), or None where the platform or filesystem has
    none."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as error:
        if error.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


class DirectReader(_OpenedTwice):
    """Ranges of one file read past the page cache: the whole disk blocks covering a range, with O_DIRECT, into an
    aligned buffer, then the range copied out. Where the filesystem refuses O_DIRECT, or refuses a read, through the
    page cache. Why: a resume on a fresh node reads every byte of its part once, and on this project's VM reading
    through the page cache was kernel CPU work that two ranks reading one file at once slowed each other with (two
    processes reading 1 GB each: 1.1-2.9 s buffered, 1.4-1.6 s with O_DIRECT at a third of the CPU). The readers of
    every file of a checkpoint share one `bounce` buffer (of BOUNCE_BYTES), however many rank files it has."""

    def __init__(self, path: Path, bounce: mmap.mmap) -> None:
        super().__init__(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # read front to back where it is read: twice the read-ahead
            os.posix_fadvise(self.buffered, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.bounce = bounce

    def read_into(self, offset: int, view: memoryview) -> int:
        """Bytes [offset, offset + len(view)) into `view`; how many there were (fewer past the end of the file)."""
        view = view.cast("B")
        stop = offset + len(view)
        position = offset // ALIGN * ALIGN
        with memoryview(self.bounce) as bounce:
            while self.direct is not None and position < stop:
                wanted = min(BOUNCE_BYTES, -(-(stop - position) // ALIGN) * ALIGN)
                count = unless_refused(partial(read_fully, self.direct, bounce[:wanted], position, direct=True))
                if count is None:
                    self.stop_direct()  # a device wanting more than ALIGN: the page cache from here on
                    break
                begin, end = max(offset, position), min(stop, position + count)
                if end > begin:
                    copy_into(view[begin - offset:end - offset], bounce[begin - position:end - position])
                if count < wanted:  # the end of the file
                    return max(end - offset, 0)
                position += count
        done = min(max(position - offset, 0), len(view))
        return done + read_fully(self.buffered, view[done:], offset + done)

    def close(self) -> None:
        self.stop_direct()
        os.close(self.buffered)


def read_fully(descriptor: int, data: memoryview, offset: int, direct: bool = False) -> int:
    """How many bytes there were: fewer only at the end of the file, where a direct read ends on a partial block."""
    done = 0
    while done < len(data):
        count = os.preadv(descriptor, [data[done:]], offset + done)
        done += count
        if count == 0 or (direct and count % ALIGN):
            break
    return done


def copy_into(destination: memoryview, source: memoryview) -> None:
    """`destination[:] = source`, large copies without the GIL: a background save copies 1 GB per rank, which under
    the GIL would stall the training thread between its operations for milliseconds at a time."""
    if len(source) < GIL_FREE_COPY_BYTES:
        destination[:] = source
        return
    ctypes.memmove(address_of(destination), address_of(source), len(source))  # ctypes releases the GIL


def address_of(view: memoryview) -> int:
    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data


def unless_refused(transfer: Callable[[], int]) -> Optional[int]:
    """The bytes an O_DIRECT transfer moved, or None where the device refuses it (EINVAL: its blocks are larger than
    ALIGN)."""
    try:
        return transfer()
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return None


def write_fully(descriptor: int, data: memoryview, offset: int) -> int:
    done = 0
    while done < len(data):
        done += os.pwrite(descriptor, data[done:], offset + done)
    return done


class DirectStream(io.RawIOBase):
    """A new file written front to back, as a rank's file of a sharded checkpoint is (dcp_blocks.py). Small writes
    gather in an aligned buffer that is written whole, so they cost no system call each. A large write whose memory
    lies like its place in the file (the same offset within a block, as dcp_blocks.py places large blocks) goes
    to the disk from where it lies. Closing writes the rest and fsyncs."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        path.open("wb").close()
        self.file = DirectFile(path)
        self.buffer = mmap.mmap(-1, BOUNCE_BYTES)
        self.filled = 0
        self.buffer_offset = 0
        """Where the buffer's bytes go in the file (on a block boundary until closing): every byte before is written."""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        with memoryview(data).cast("B") as view:
            if len(view) >= IN_PLACE_BYTES and (address_of(view) - self.tell()) % ALIGN == 0:
                self.write_in_place(view)
            else:
                self.gather(view)
            return len(view)

    def gather(self, view: memoryview) -> None:
        written = 0
        while written < len(view):
            count = min(len(view) - written, BOUNCE_BYTES - self.filled)
            with memoryview(self.buffer)[self.filled:self.filled + count] as free:
                copy_into(free, view[written:written + count])
            self.filled += count
            written += count
            if self.filled == BOUNCE_BYTES:
                self.write_buffer()

    def write_in_place(self, view: memoryview) -> None:
        """`view`'s bytes up to the next block boundary complete the buffer's last block; its whole blocks then go
        to the disk from its own memory, and the rest starts the buffer again."""
        head = -self.tell() % ALIGN
        self.gather(view[:head])
        self.write_buffer()
        whole = (len(view) - head) // ALIGN * ALIGN
        self.file.write_at(self.buffer_offset, view[head:head + whole])
        self.buffer_offset += whole
        self.gather(view[head + whole:])

    def write_buffer(self) -> None:
        whole_blocks = self.filled // ALIGN * ALIGN
        with memoryview(self.buffer) as buffer:
            with buffer[:whole_blocks] as blocks:
                self.file.write_blocks(blocks, self.buffer_offset)
            with buffer[whole_blocks:self.filled] as rest:
                self.file.write_at(self.buffer_offset + whole_blocks, rest)
        self.buffer_offset += self.filled
        self.filled = 0

    def tell(self) -> int:
        return self.buffer_offset + self.filled

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.write_buffer()
            os.fsync(self.file.fileno())
        finally:
            self.file.close()
            self.buffer.close()
            super().close()

