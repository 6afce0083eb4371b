"""Reading ranges of elements of stored tensors from any checkpoint, straight into the tensors that receive them.

Every checkpoint stores each tensor's elements, in C order, as raw bytes in one or more extents:
- a full checkpoint file (tensor_file.py): one extent per tensor;
- a sharded folder (torch.distributed.checkpoint, DCP): each block a rank wrote is a torch.save archive whose one
  storage record holds the block's bytes uncompressed; a block of whole rows, or of part of one row, is one range of
  the flattened tensor (state.py). Reading the record's bytes directly, rather than through DCP's reader (torch.load
  of every block, then a copy into the target), takes a rank's shard at the speed of a plain read.
A rank asks for the range of each tensor its piece covers (`read_elements_into`), whichever layout the writer had.
Checkpoints of earlier versions written with torch.save are read from memory (`MemorySource`).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
import zipfile
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, BinaryIO, Iterator, NoReturn, Optional, Protocol

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from app.checkpoint import legacy
from app.checkpoint.checksums import CHECKSUMS_FILE, CHECKSUMS_KEY, Table, check_pieces, decode, pieces_within
from app.checkpoint.direct_io import BOUNCE_BYTES, DirectReader
from app.checkpoint.state import flat_range
from app.checkpoint.tensor_file import read_header
from app.checkpoint.writers import SHARDED_METADATA

VERIFY_BYTES = 64 << 20
"""The buffer a piece read again only to check it goes through (check_piece): a piece may be a whole embedding."""


class CheckpointError(ValueError):
    """The checkpoint cannot be read, or holds another model's state: one line for the user."""


Shapes = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class TensorSource(Protocol):
    checksums: Table
    """The recorded pieces' checksums (empty for a checkpoint written without them)."""
    verified: set[tuple[str, int]]
    """(name, start) of the recorded pieces read whole, and checked, so far."""

    def shapes(self) -> Shapes:
        """Every stored tensor's dtype and whole shape."""

    def read_elements_into(self, name: str, first: int, target: torch.Tensor) -> None:
        """Fill `target` with `target.numel()` elements of tensor `name`, flattened, from element `first` on."""

    def check_piece(self, name: str, start: int, numel: int, value: str) -> None:
        """Raise CheckpointError when the recorded piece's bytes are not those saved."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class Extent:
    """Elements [start, start + numel) of a stored tensor, flattened, as raw bytes from `offset` in file `path`."""

    start: int
    numel: int
    path: Path
    offset: int


class RawSource:
    """Tensors stored as raw bytes, each in one or more extents: plain seeks and reads into the target's memory,
    each recorded piece read whole checked against its checksum (checksums.py; none for earlier checkpoints)."""

    def __init__(self, shapes: Shapes, extents: dict[str, list[Extent]], checksums: Optional[Table] = None) -> None:
        self._shapes, self.extents, self.checksums = shapes, extents, checksums or {}
        self.verified: set[tuple[str, int]] = set()
        """(name, start) of every recorded piece read whole, and checked, so far."""
        self.handles: dict[Path, BinaryIO] = {}
        self.readers: dict[Path, DirectReader] = {}
        self.bounce: Optional[mmap.mmap] = None

    def shapes(self) -> Shapes:
        return self._shapes

    def read_elements_into(self, name: str, first: int, target: torch.Tensor) -> None:
        dtype = self._shapes[name][0]
        direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        buffer = target.view(-1) if direct else torch.empty(target.numel(), dtype=dtype)
        self.read_range(name, first, buffer)
        for start, numel in check_pieces(self.checksums, name, first, buffer)[:1]:
            raise CheckpointError(self.corrupt(name, start, numel))
        self.verified |= {(name, start) for start, _, _ in pieces_within(self.checksums, name, first,
                                                                           first + buffer.numel())}
        if not direct:
            target.copy_(buffer.view(target.shape))

    def read_range(self, name: str, first: int, buffer: torch.Tensor) -> None:
        """Elements [first, first + numel) of `name`, flattened, into `buffer` (in the stored dtype), unchecked."""
        dtype = self._shapes[name][0]
        stop, covered = first + buffer.numel(), 0
        for extent in self.extents_of(name):
            begin, end = max(first, extent.start), min(stop, extent.start + extent.numel)
            if begin < end:
                self.read(extent.path, extent.offset + (begin - extent.start) * dtype.itemsize,
                          buffer[begin - first:end - first])
                covered += end - begin
        if covered != buffer.numel():
            raise CheckpointError(f"{name}: elements {first} to {stop} are not all stored: the checkpoint is "
                                  "incomplete")

    def check_piece(self, name: str, start: int, numel: int, value: str) -> None:
        """Read a recorded piece again, VERIFY_BYTES at a time, and raise CheckpointError when its checksum differs:
        for the pieces no rank read whole (a resume on another layout)."""
        dtype = self._shapes[name][0]
        step = max(VERIFY_BYTES // dtype.itemsize, 1)
        buffer, hasher = torch.empty(min(step, numel), dtype=dtype), xxhash.xxh3_64()
        for begin in range(start, start + numel, step):
            part = buffer[:min(step, start + numel - begin)]
            self.read_range(name, begin, part)
            hasher.update(memoryview(part.view(torch.uint8).numpy()))
        if hasher.hexdigest() != value:
            raise CheckpointError(self.corrupt(name, start, numel))

    def corrupt(self, name: str, start: int, numel: int) -> str:
        where = next(e.path for e in self.extents_of(name) if e.start <= start < e.start + e.numel)
        return (f"{where}: elements {start} to {start + numel} of {name} are not the bytes that were saved (their "
                "checksum differs): the checkpoint is corrupt")

    def extents_of(self, name: str) -> list[Extent]:
        return self.extents[name]

    def read(self, path: Path, offset: int, target: torch.Tensor) -> None:
        """Tensor bytes, past the page cache (direct_io.py)."""
        if self.bounce is None:
            self.bounce = mmap.mmap(-1, BOUNCE_BYTES)  # page-aligned; made once for every file of the checkpoint
        if path not in self.readers:
            self.readers[path] = DirectReader(path, self.bounce) if path.is_file() else missing_file(path)
        view = memoryview(target.view(torch.uint8).numpy())
        if self.readers[path].read_into(offset, view) != len(view):
            raise CheckpointError(f"{path} ended early: the checkpoint is truncated")

    def handle(self, path: Path) -> BinaryIO:
        """The open file for the small reads that locate tensor bytes (no read-ahead of the bytes around them, which
        `read` reads past the page cache)."""
        if path not in self.handles:
            self.handles[path] = open(path, "rb") if path.is_file() else missing_file(path)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.handles[path].fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        return self.handles[path]

    def close(self) -> None:
        for handle in [*self.handles.values(), *self.readers.values()]:
            handle.close()
        self.handles.clear()
        self.readers.clear()
        if self.bounce is not None:
            with suppress(BufferError):  # a read stopped midway (Ctrl-C) still holds a view of it
                self.bounce.close()
            self.bounce = None


def file_source(path: Path) -> RawSource:
    """A full checkpoint file: every tensor whole, back to back after the header."""
    entries, metadata = read_header(path)
    shapes = {name: (entry.dtype, entry.shape) for name, entry in entries.items()}
    extents = {name: [Extent(0, prod(entry.shape), path, entry.begin)] for name, entry in entries.items()}
    return RawSource(shapes, extents, decode(metadata[CHECKSUMS_KEY]) if CHECKSUMS_KEY in metadata else None)


class FolderSource(RawSource):
    """A DCP folder: each tensor's blocks as extents, located in the rank files when first read."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.metadata = read_dcp_metadata(folder)
        entries = {name: entry for name, entry in self.metadata.state_dict_metadata.items()
                   if isinstance(entry, TensorStorageMetadata)}
        checksums = folder / CHECKSUMS_FILE
        super().__init__({name: (entry.properties.dtype, tuple(entry.size)) for name, entry in entries.items()}, {},
                         decode(checksums.read_text()) if checksums.is_file() else None)
        self.entries = entries

    def extents_of(self, name: str) -> list[Extent]:
        if name not in self.extents:
            entry = self.entries[name]
            self.extents[name] = [self.extent(name, tuple(entry.size), entry.properties.dtype, tuple(chunk.offsets),
                                              tuple(chunk.sizes)) for chunk in entry.chunks]
        return self.extents[name]

    def extent(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, offsets: tuple[int, ...],
               sizes: tuple[int, ...]) -> Extent:
        start, numel = flat_range(shape, offsets, sizes)
        stored = self.metadata.storage_data[MetadataIndex(name, torch.Size(offsets))]
        path = stored_file(self.folder, stored.relative_path)
        try:
            data = record_data_offset(self.handle(path), stored.offset, stored.length, numel * dtype.itemsize)
        except (zipfile.BadZipFile, struct.error, EOFError) as error:  # a file cut short or overwritten there
            raise CheckpointError(f"{path}: the record of {name} at byte {stored.offset} is damaged "
                                  f"({type(error).__name__}): the checkpoint is corrupt") from None
        return Extent(start, numel, path, data)


METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | {str(dtype).removeprefix("torch.") for dtype in vars(torch).values()
                         if isinstance(dtype, torch.dtype)},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}
"""What a DCP folder's `.metadata` pickle may build: DCP's records of tensors and where their bytes are."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name not in METADATA_CLASSES.get(module, ()):
            raise ValueError(f"{module}.{name} is not what a checkpoint's metadata holds")
        return super().find_class(module, name)


def stored_file(folder: Path, name: str) -> Path:
    """The rank file a DCP `.metadata` names: a plain file name within the folder, the only kind DCP writes. A name
    that leads elsewhere (`../x`, `/etc/x`) would read another file's bytes as the checkpoint's, and a conversion
    would put them into the model it may push to the Hub."""
    if Path(name).name != name or name in ("", ".", ".."):
        raise CheckpointError(f"{folder / '.metadata'} names {name!r} for a tensor's bytes, outside the folder: not a "
                              "checkpoint this program wrote")
    return folder / name


def missing_file(path: Path) -> NoReturn:
    raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")


def read_dcp_metadata(folder: Path) -> Metadata:
    """A DCP folder's `.metadata`, unpickled with only DCP's own classes (DCP's reader unpickles anything: a
    downloaded checkpoint could run code)."""
    path = folder / ".metadata"
    try:
        with open(path, "rb") as handle:
            metadata = MetadataUnpickler(handle).load()
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    except (OSError, EOFError, pickle.UnpicklingError) as error:
        raise ValueError(f"{path}: not readable ({type(error).__name__}): the folder is incomplete") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path}: not the metadata of a torch.distributed.checkpoint folder")
    return metadata


def record_data_offset(handle: BinaryIO, offset: int, length: int, nbytes: int) -> int:
    """Where the bytes of the one tensor a torch.save archive at [offset, offset + length) holds begin in the file:
    its single storage record, stored uncompressed, of exactly the tensor's size (so a dense, unshared tensor)."""
    with zipfile.ZipFile(FileSlice(handle, offset, length)) as archive:
        storages = [info for info in archive.infolist() if "/data/" in info.filename]
    if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED or storages[0].file_size != nbytes:
        raise ValueError(f"the block at byte {offset} of {handle.name} is not one tensor of {nbytes} bytes")
    record = storages[0]
    handle.seek(offset + record.header_offset + 26)
    name_length, extra_length = struct.unpack("<HH", handle.read(4))
    return offset + record.header_offset + 30 + name_length + extra_length


class FileSlice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a file of their own (for zipfile)."""

    def __init__(self, handle: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self.handle, self.offset, self.length, self.position = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(base + position, 0), self.length)
        return self.position

    def readinto(self, buffer) -> int:  # type: ignore[override]
        wanted = min(len(buffer), self.length - self.position)
        self.handle.seek(self.offset + self.position)
        count = self.handle.readinto(memoryview(buffer)[:wanted])
        self.position += count
        return count


class MemorySource:
    """Tensors already in memory (an earlier version's torch.save file, memory-mapped)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.checksums: Table = {}  # written before checksums existed
        self.verified: set[tuple[str, int]] = set()

    def shapes(self) -> Shapes:
        return {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in self.tensors.items()}

    def read_elements_into(self, name: str, first: int, target: torch.Tensor) -> None:
        target.copy_(self.tensors[name].reshape(-1)[first:first + target.numel()].view(target.shape))

    def check_piece(self, name: str, start: int, numel: int, value: str) -> None:
        raise AssertionError("an earlier version's file records no checksums")

    def close(self) -> None:
        self.tensors.clear()


def check_complete(path: Path) -> None:
    """Raise CheckpointError when a file the checkpoint's index names is missing or shorter than the bytes it records
    there (a copy cut short, a rank's file lost), from the index and file sizes alone: a resume found it only once
    every rank had started and was reading, and ended in a traceback on each."""
    if path.is_dir():
        if not (path / ".metadata").is_file():
            if (path / SHARDED_METADATA).is_file():
                raise CheckpointError(f"{path / '.metadata'} is missing: the checkpoint is incomplete")
            return  # an earlier version's folder: its reader says what is missing
        ends: dict[Path, int] = {}
        for stored in read_dcp_metadata(path).storage_data.values():
            file = stored_file(path, stored.relative_path)
            ends[file] = max(ends.get(file, 0), stored.offset + stored.length)
    elif legacy.is_torch_save_file(path):
        return
    else:
        entries, _ = read_header(path)
        ends = {path: max((entry.begin + prod(entry.shape) * entry.dtype.itemsize for entry in entries.values()),
                          default=0)}
    for file, end in ends.items():
        if not file.is_file():
            missing_file(file)
        if file.stat().st_size < end:
            raise CheckpointError(f"{file} ended early: the checkpoint is truncated")


@contextmanager
def open_source(path: Path, parameter_order: Optional[list[str]] = None) -> Iterator[TensorSource]:
    """The tensors of any checkpoint: a sharded folder, a full file, or an earlier version's torch.save file (whose
    numbered optimizer state `parameter_order` names; without it, that state is left out). A file that vanishes as it
    is opened (the run saving to the folder pruned it, --keep_last_n) is CheckpointError, as one missing."""
    try:
        if path.is_dir():
            source: TensorSource = FolderSource(path)
        elif legacy.is_torch_save_file(path):
            source = MemorySource(legacy.tensors(legacy.load_torch_save(path), parameter_order))
        else:
            source = file_source(path)
    except FileNotFoundError as error:
        missing_file(Path(error.filename or path))
    try:
        yield source
    finally:
        source.close()
