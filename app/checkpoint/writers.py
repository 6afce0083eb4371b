"""Writing this rank's part of a checkpoint: who writes which piece, then one full file or a sharded folder.

The ranks first agree, in one exchange, which rank writes each distinct piece of every tensor: the lowest rank
holding it (pieces are either distinct or, where ranks replicate them under DDP, NO_SHARD or HYBRID_SHARD, equal),
and that the pieces cover every tensor exactly once. A rank then keeps only the pieces it writes (`Snapshot`): views
of the training state (for a background save, --async_save, until the next update: handover.py), or host copies of
those on a GPU.
- full: rank 0 writes the file's header and sizes the file; every rank on rank 0's machine then writes its own
  pieces at their place in the file, all at once; ranks on other machines send theirs to rank 0 (point to point, in
  the same order on both sides, into one reused buffer), which writes them. No rank holds more than its own state.
- sharded: every rank writes its pieces with torch.distributed.checkpoint (DCP) as the rectangular blocks they
  make up (state.py), one file per rank (dcp_blocks.py); DCP checks that the blocks of every tensor cover it exactly
  once.
Both write whole disk blocks past the page cache (direct_io.py). The exchanges run over a gloo process group made
for checkpoints (CPU tensors, on GPU machines too, so the same code runs everywhere), which also lets a background
writer talk to the other ranks while training uses the default group.
"""

from __future__ import annotations

import hashlib
import json
import socket
import warnings
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from math import prod
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from app.checkpoint.checksums import (CHECKSUMS_FILE, CHECKSUMS_KEY, Table, checksum, encode, merged,
                                      unwritten, with_metadata)
from app.checkpoint.dcp_blocks import BlocksWriter
from app.checkpoint.direct_io import ALIGN, DirectFile
from app.checkpoint.failures import StorageFailure
from app.checkpoint.handover import Handover
from app.checkpoint.state import LocalState, Part, Piece, blocks
from app.checkpoint.tensor_file import layout

METADATA_KEY = "training"
SHARDED_METADATA = "training.json"

Writers = dict[str, list[tuple[int, int, int]]]
"""name -> (rank, start, numel) of every distinct piece of the tensor, in order of start."""

Written = dict[tuple[str, int], tuple[int, str]]
"""(name, start) -> (numel, checksum) of every piece a rank wrote (checksums.py)."""


def distributed(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(rank, world size) in the checkpoint group; (0, 1) without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def barrier(group: Optional[dist.ProcessGroup]) -> None:
    if distributed(group)[1] > 1:
        dist.barrier(group=group)


def gathered(value: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every rank's `value` on rank 0 (empty on the others). Collective."""
    rank, world_size = distributed(group)
    if world_size == 1:
        return [value]
    values: list[Any] = [None] * world_size if rank == 0 else []
    dist.gather_object(value, values if rank == 0 else None, group_dst=0, group=group)
    return values


def lowest_holders(layouts: list[dict[str, list[tuple[int, int]]]], shapes: dict[str, tuple[int, ...]]) -> Writers:
    """Each distinct (start, numel) region of every tensor, from the lowest rank holding it, in order of start;
    the tensors in rank 0's order (every rank names every tensor, holding a piece of it or not). RuntimeError when
    the regions do not cover a tensor exactly once."""
    chosen: dict[str, dict[tuple[int, int], int]] = {name: {} for name in layouts[0]}
    for rank, layout_of_rank in enumerate(layouts):
        for name, regions in layout_of_rank.items():
            for region in regions:
                chosen[name].setdefault(region, rank)
    writers = {name: sorted(((rank, start, numel) for (start, numel), rank in regions.items()), key=lambda w: w[1])
               for name, regions in chosen.items()}
    for name, pieces in writers.items():
        covered = 0
        for _, start, numel in pieces:
            if start != covered:
                raise RuntimeError(f"the ranks' pieces of {name} do not tile it: elements from {covered} to {start}")
            covered += numel
        if covered != prod(shapes[name]):
            raise RuntimeError(f"the ranks' pieces of {name} cover {covered} of its {prod(shapes[name])} elements")
    return writers


@dataclass(frozen=True)
class WritePlan:
    """What the ranks agreed before writing a checkpoint."""

    writers: Writers
    same_machine: frozenset[int]
    """The ranks on rank 0's machine, which write their pieces of a full file themselves."""
    header: bytes
    """A full file's header: the tensors, in the order of `writers`, the metadata, and the checksums' table with
    its place reserved (checksums.py). Its length is a multiple of the disk block, so each piece's place within a
    block is the same at every save, whatever the metadata."""


def agree_plan(state: LocalState, metadata: dict[str, Any], group: Optional[dist.ProcessGroup]) -> WritePlan:
    """The plan, made on rank 0 from every rank's layout and machine, and sent to all. Collective."""
    rank, world_size = distributed(group)
    held = {name: [(piece.start, piece.data.numel()) for piece in part.pieces] for name, part in state.parts.items()}
    reports: list[Any] = [(socket.gethostname(), held)]
    if world_size > 1:
        reports = [None] * world_size
        dist.gather_object((socket.gethostname(), held), reports if rank == 0 else None, group_dst=0, group=group)
    plan: list[Any] = [None]
    if rank == 0:
        writers = lowest_holders([layout_of_rank for _, layout_of_rank in reports], state.shapes())
        header = layout(((name, state.parts[name].shape, state.parts[name].dtype) for name in writers),
                        {METADATA_KEY: json.dumps(metadata),
                         CHECKSUMS_KEY: encode(with_metadata(unwritten(writers), json.dumps(metadata)))},
                        data_alignment=ALIGN)
        same_machine = frozenset(r for r, (host, _) in enumerate(reports) if host == reports[0][0])
        plan = [WritePlan(writers, same_machine, header)]
    if world_size > 1:
        dist.broadcast_object_list(plan, group_src=0, group=group)
    return plan[0]


@dataclass
class Snapshot:
    """What this rank writes of one checkpoint: its pieces (views, or copies once `staged`) and the plan."""

    parts: dict[str, Part]
    plan: WritePlan
    own: dict[str, dict[int, torch.Tensor]]
    """name -> start -> the data of each piece this rank writes."""
    metadata: dict[str, Any]
    group: Optional[dist.ProcessGroup]
    sharded: bool
    handover: Optional[Handover] = None
    """For a background save: the pieces it writes from the training state until the next update."""

    @classmethod
    def take(cls, state: LocalState, metadata: dict[str, Any], group: Optional[dist.ProcessGroup],
             sharded: bool) -> "Snapshot":
        """This rank's pieces to write (for a sharded checkpoint, cut into the blocks DCP stores), as views of the
        training state, and the metadata as plain data. Collective."""
        metadata = json.loads(json.dumps(metadata))
        plan = agree_plan(state, metadata, group)
        rank, _ = distributed(group)
        own: dict[str, dict[int, torch.Tensor]] = {}
        for name, part in state.parts.items():
            mine = {start for writer, start, _ in plan.writers[name] if writer == rank}
            pieces = [piece for piece in part.pieces if piece.start in mine]
            if sharded:
                pieces = [block for piece in pieces for block in block_pieces(part.shape, piece)]
            own[name] = {piece.start: piece.data for piece in pieces}
        return cls(state.parts, plan, own, metadata, group, sharded)

    def for_background(self, area: "StagingArea") -> "Snapshot":
        """The snapshot a background write takes: its pieces that lie in host memory as their bytes lie in the file
        (at the same offset within a disk block: a sharded file's blocks, dcp_blocks.py) are written from the
        training state until the next update, which copies into `area` those not yet written (handover.py)."""
        phases = self.block_phases()
        live = {key: data for key, data in self.pieces().items() if lies_as_in_the_file(data, phases[key])}
        return replace(self, handover=Handover(live, partial(area.copy, phases=phases)))

    def staged(self, area: "StagingArea") -> "Snapshot":
        """The same snapshot with the pieces it does not write from the training state copied into `area`, where
        they lie as in the file: host memory that training does not change (a disk writes only from host memory; a
        full file's pieces would otherwise go to the disk through one more copy, direct_io.py)."""
        away = {key: data for key, data in self.pieces().items() if self.copied(key, data)}
        own = {name: dict(pieces) for name, pieces in self.own.items()}
        for (name, start), copy in area.copy(away, self.block_phases()).items():
            own[name][start] = copy
        return replace(self, own=own)

    def copied(self, key: tuple[str, int], data: torch.Tensor) -> bool:
        """Whether a save copies the piece into host memory of its own before writing it: a background save those
        it does not hand over (handover.py), a synchronous one those in a GPU's memory (it writes the others from
        the training state, which waits for it)."""
        if self.handover is not None:
            return key not in self.handover.live
        return data.device.type != "cpu"

    def reserve(self, area: "StagingArea") -> None:
        """`area`'s memory for copies of every piece (the pieces of a run are the same at every save)."""
        area.copy(self.pieces(), self.block_phases())

    def pieces(self) -> dict[tuple[str, int], torch.Tensor]:
        return {(name, start): data for name, pieces in self.own.items() for start, data in pieces.items()}

    def piece(self, name: str, start: int) -> AbstractContextManager[torch.Tensor]:
        """The data of a piece to write, valid within the `with` block (a background save's handover)."""
        if self.handover is not None and (name, start) in self.handover.live:
            return self.handover.reading((name, start))
        return nullcontext(self.own[name][start])

    def block_phases(self) -> dict[tuple[str, int], int]:
        """(name, start) -> where the piece's bytes begin within a disk block of the file this rank writes: a
        sharded file places each block where it lies in memory (dcp_blocks.py), a full file's layout is fixed."""
        if self.sharded:
            return {key: data.data_ptr() % ALIGN for key, data in self.pieces().items()}
        begins = self.tensor_offsets()
        return {(name, start): (begins[name] + start * self.parts[name].dtype.itemsize) % ALIGN
                for name, pieces in self.own.items() for start in pieces}

    def write(self, path: Path) -> None:
        """The checkpoint at `path` (a file, or a folder when sharded). Collective over the group; raises SaveFailed
        on every rank alike, once every rank is through the save's exchanges, when the storage refused any rank's
        part (failures.py)."""
        failure = StorageFailure(distributed(self.group)[0], path)
        if self.sharded:
            self.write_sharded(path, failure)
        else:
            self.write_full(path, failure)
        failure.raise_agreed(self.group)

    def write_full(self, path: Path, failure: StorageFailure) -> None:
        """Rank 0 writes the header and sizes the file, then the ranks of its machine write their pieces into it
        at once, and rank 0 the pieces the other machines send. Collective over the group."""
        rank, _ = distributed(self.group)
        begins = self.tensor_offsets()
        if rank == 0:
            failure.attempt(self.write_header, path, begins[None])
        barrier(self.group)
        written: Written = {}
        if rank in self.plan.same_machine:
            written = self.write_pieces(path, begins, rank, failure)
        else:
            for name, pieces in self.plan.writers.items():
                for writer, start, _ in pieces:
                    if writer == rank:  # rank 0 writes it, and records its checksum
                        with self.piece(name, start) as data:
                            dist.send(data.to("cpu"), group_dst=0, group=self.group)
        tables = gathered((written, failure.message is not None), self.group)
        if rank == 0 and not any(failed for _, failed in tables):
            failure.attempt(self.fill_in_checksums, path, merged((table for table, _ in tables), self.plan.writers))

    def write_header(self, path: Path, size: int) -> None:
        """A new file of `size` bytes that begins with the header (rank 0)."""
        with open(path, "wb") as handle:
            handle.write(self.plan.header)
            handle.truncate(size)

    def fill_in_checksums(self, path: Path, table: Table) -> None:
        """Write the checksums into the place the header reserved for them (rank 0, before the file is made
        durable): the same length, so nothing else moves."""
        metadata = json.dumps(self.metadata)
        reserved = json.dumps(encode(with_metadata(unwritten(self.plan.writers), metadata))).encode()  # the header's
        filled = json.dumps(encode(with_metadata(table, metadata))).encode()
        if len(filled) != len(reserved) or self.plan.header.count(reserved) != 1:
            raise RuntimeError("the checksums do not fit the place the header reserved for them")
        with open(path, "r+b") as handle:
            handle.seek(self.plan.header.index(reserved))
            handle.write(filled)

    def tensor_offsets(self) -> dict[Optional[str], int]:
        """Where each tensor's bytes begin in the full file, and (under None) where the file ends."""
        begins: dict[Optional[str], int] = {}
        position = len(self.plan.header)
        for name in self.plan.writers:
            begins[name] = position
            position += self.parts[name].numel * self.parts[name].dtype.itemsize
        begins[None] = position
        return begins

    def write_pieces(self, path: Path, begins: dict[Optional[str], int], rank: int,
                     failure: StorageFailure) -> Written:
        """This rank's pieces at their place in the file at `path`; on rank 0 also those of the ranks on other
        machines, received (still received once a write failed: their senders wait for that). Returns the checksum of
        each piece written."""
        received = Receiver(self.group)
        written: Written = {}
        file = failure.attempt(DirectFile, path)
        try:
            for name, pieces in self.plan.writers.items():
                dtype = self.parts[name].dtype
                for writer, start, numel in pieces:
                    if writer == rank and failure.message is None and file is not None:
                        with self.piece(name, start) as data:
                            host = data.to("cpu")
                            written[(name, start)] = (numel, checksum(host))
                            failure.attempt(file.write_at, begins[name] + start * dtype.itemsize, bytes_of(host))
                    elif rank == 0 and writer not in self.plan.same_machine:
                        data = received.piece(writer, numel, dtype)
                        if failure.message is None and file is not None:
                            written[(name, start)] = (numel, checksum(data))
                            failure.attempt(file.write_at, begins[name] + start * dtype.itemsize, bytes_of(data))
        finally:
            if file is not None:
                try:
                    file.close()
                except OSError as error:
                    failure.keep(error)
        return written

    def layout_key(self) -> str:
        """The same on every rank, and at every save of a run; different for any other tensors, dtypes or writers."""
        layout_of_tensors = [(name, str(part.dtype), part.shape, self.plan.writers[name])
                             for name, part in self.parts.items()]
        return hashlib.sha256(json.dumps(layout_of_tensors).encode()).hexdigest()

    def sharded_blocks(self) -> list[tuple[str, int, tuple[int, ...], torch.Tensor]]:
        """(name, start, offsets, data shaped as the block) of every block this rank writes, in the order it writes
        them; rank 0 also writes the one empty block of each tensor without elements."""
        rank, _ = distributed(self.group)
        found = []
        for name, part in self.parts.items():
            for start, data in self.own[name].items():
                ((offsets, sizes),) = blocks(part.shape, start, start + data.numel())
                found.append((name, start, offsets, data.view(sizes)))
            if part.numel == 0 and rank == 0:
                found.append((name, 0, (0,) * len(part.shape), torch.empty(part.shape, dtype=part.dtype)))
        return found

    def write_sharded(self, folder: Path, failure: StorageFailure) -> None:
        """Every rank writes its blocks into its own file, rank 0 the metadata. Collective."""
        rank, world_size = distributed(self.group)
        written: dict[str, TensorBlocks] = {}
        starts: dict[tuple[str, tuple[int, ...]], int] = {}
        for name, start, offsets, block in self.sharded_blocks():
            written.setdefault(name, TensorBlocks(self.parts[name].shape, {})).blocks[offsets] = block
            starts[(name, offsets)] = start

        @contextmanager
        def reading(name: str, offsets: tuple[int, ...]) -> Iterator[torch.Tensor]:
            block = written[name].blocks[offsets]
            if block.numel() == 0:  # the block of a tensor without elements: no data to read
                yield block
                return
            with self.piece(name, starts[(name, offsets)]) as data:
                yield data.view(block.shape)

        writer = BlocksWriter(folder, list(starts), reading)
        try:
            with warnings.catch_warnings():  # one process without a group writes alone, as DCP's warning assumes
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
                dcp.save({}, storage_writer=writer, planner=BlocksPlanner(written, self.layout_key()),
                         process_group=self.group, no_dist=world_size == 1 and not dist.is_initialized())
        except CheckpointException as error:  # raised on every rank alike, with every failed rank's error
            if not all(isinstance(failed, OSError) for failed, _ in error.failures.values()):
                raise
            if rank in error.failures:
                failure.keep(error.failures[rank][0])
        checksums = {(name, starts[(name, offsets)]): value for (name, offsets), value in writer.checksums.items()}
        tables = gathered((checksums, failure.message is not None), self.group)
        if rank == 0 and not any(failed for _, failed in tables):
            table = with_metadata(merged((t for t, _ in tables), self.parts), json.dumps(self.metadata))
            failure.attempt((folder / CHECKSUMS_FILE).write_text, encode(table))
            failure.attempt((folder / SHARDED_METADATA).write_text, json.dumps(self.metadata))


def lies_as_in_the_file(data: torch.Tensor, phase: int) -> bool:
    """Whether the disk can write `data` from its own memory: in host memory (not a GPU's), at the offset `phase`
    within a page that its bytes have within a disk block of the file."""
    return data.device.type == "cpu" and data.data_ptr() % ALIGN == phase


def bytes_of(data: torch.Tensor) -> memoryview:
    return memoryview(data.view(torch.uint8).numpy())


def block_pieces(shape: tuple[int, ...], piece: Piece) -> list[Piece]:
    """A piece cut into the blocks it makes up, each one range of the flattened tensor."""
    found, start = [], piece.start
    for _, sizes in blocks(shape, piece.start, piece.start + piece.data.numel()):
        count = prod(sizes)
        found.append(Piece(start, piece.data[start - piece.start:start - piece.start + count]))
        start += count
    return found


class StagingArea:
    """Host memory for copies of the pieces this rank writes (those on a GPU; in the background also those in host
    memory that the next update finds unwritten), made once and reused by every save of the run (the pieces are the
    same all run): a copy then goes into memory already in use, not an allocation that the operating system fills
    page by page (pinned memory on a GPU machine, for fast device-to-host copies: one copy per piece at the card's
    bandwidth, where a synchronous save once copied each piece into memory allocated for it, which CUDA copies into
    through a pinned buffer of its own, and then into the disk's aligned buffer).
    Each piece sits at the place within a memory page that its bytes have within a disk block of the file, so the
    background write sends its whole blocks to the disk from here, with no further copy (direct_io.py).

    All the pieces share one allocation, the arena, carved into them and pinned at its exact size (`pin_exactly`):
    torch's pinned allocator rounds every request up to a power of two, so a pinned buffer per piece held up to
    twice the state (an 8B model under fsdp2 on 8 ranks: 14.3 GiB pinned per rank for 11.2 GiB of state), and one
    arena from it would have held 16 GiB. A piece not seen before (or of another shape) makes a new arena for every
    piece known so far; a run's pieces are the same at every save, and `Snapshot.reserve` shows them all at
    start-up."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.arena: Optional[torch.Tensor] = None

    def copy(self, pieces: dict[tuple[str, int], torch.Tensor],
             phases: dict[tuple[str, int], int]) -> dict[tuple[str, int], torch.Tensor]:
        """Copies of the pieces, each `phases[key]` bytes past a page boundary."""
        if not all(self.holds(key, data, phases[key]) for key, data in pieces.items()):
            known = {key: (buffer, buffer.data_ptr() % ALIGN) for key, buffer in self.buffers.items()}
            self.carve(known | {key: (data, phases[key]) for key, data in pieces.items()})
        return {key: self.buffers[key].copy_(data) for key, data in pieces.items()}

    def holds(self, key: tuple[str, int], data: torch.Tensor, phase: int) -> bool:
        buffer = self.buffers.get(key)
        return (buffer is not None and buffer.shape == data.shape and buffer.dtype == data.dtype
                and (buffer.numel() == 0 or buffer.data_ptr() % ALIGN == phase))

    def carve(self, pieces: dict[tuple[str, int], tuple[torch.Tensor, int]]) -> None:
        """One arena (pinned when a piece is on a GPU) holding a buffer like each piece at its phase."""
        offsets, size = {}, 0
        for key, (data, phase) in pieces.items():
            offsets[key] = size + (phase - size) % ALIGN
            size = offsets[key] + data.numel() * data.element_size()
        self.buffers = {}  # the old arena is freed before the new one is made
        self.arena = None
        arena = torch.empty(size + ALIGN, dtype=torch.uint8)
        if any(data.is_cuda for data, _ in pieces.values()):
            pin_exactly(arena)
        base = (-arena.data_ptr()) % ALIGN
        for key, (data, _) in pieces.items():
            self.buffers[key] = (torch.empty(data.shape, dtype=data.dtype) if data.numel() == 0 else
                                 torch.frombuffer(arena.numpy(), dtype=data.dtype, count=data.numel(),
                                                  offset=base + offsets[key]).view(data.shape))
        self.arena = arena


def pin_exactly(tensor: torch.Tensor) -> None:
    """Page-lock a host tensor's memory for fast device-to-host copies, exactly its size, until it is freed: CUDA
    registers the memory the tensor has (cudaHostRegister, as torch's own checkpoint stager does in
    torch/distributed/checkpoint/_state_dict_stager.py), where `pin_memory=True` asks torch's caching host
    allocator, which rounds every request up to a power of two (ATen/core/CachingHostAllocator.h) and keeps what
    it pinned for reuse. RuntimeError when CUDA refuses (not that much memory can be locked)."""
    cudart, pointer = torch.cuda.cudart(), tensor.data_ptr()
    error = int(cudart.cudaHostRegister(pointer, tensor.numel() * tensor.element_size(), 1))  # ...Portable
    if error:
        raise RuntimeError(f"CUDA could not pin {tensor.numel() * tensor.element_size() / 2**30:.1f} GiB of host "
                           f"memory (cudaHostRegister: CUDA error {error})")
    weakref.finalize(tensor, cudart.cudaHostUnregister, pointer)  # before the memory is freed


class Receiver:
    """Pieces from the other ranks, each received into one buffer reused for all of them."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def piece(self, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        data = self.buffer[:nbytes].view(dtype)
        dist.recv(data, group_src=rank, group=self.group)
        return data


@dataclass
class TensorBlocks:
    """This rank's blocks of one tensor, (offsets) -> data, as DCP plans them (its `_Checkpointable` protocol)."""

    shape: tuple[int, ...]
    blocks: dict[tuple[int, ...], torch.Tensor]

    def __create_write_items__(self, name: str, _: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(name, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                                 sizes=data.shape),
                                                      properties=TensorProperties(dtype=data.dtype),
                                                      size=torch.Size(self.shape)))
                for offsets, data in self.blocks.items()]


class BlocksPlanner(DefaultSavePlanner):
    """DCP's save planner for `TensorBlocks`. Every save of a run writes the same blocks, so DCP caches the plans:
    from the second save on, the ranks send its coordinator no plans, and it neither merges nor checks them again
    (0.03 s of Python per save on rank 0 of the 170M benchmark model, held under the GIL a background save shares
    with training). DCP keys its cache by the planner's class and compares the local plans' blocks but not their
    dtypes, so the key here is the layout's (`Snapshot.layout_key`): another run in the same process never reuses a
    plan that is not its own."""

    def __init__(self, written: dict[str, TensorBlocks], layout_key: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, enable_plan_caching=True)
        self._cached_plans_key = f"{type(self).__name__}-{layout_key}"
        self.written = written

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Optional[StorageMeta] = None,
                       is_coordinator: bool = False) -> None:
        """The blocks come from the planner rather than through dcp.save, which logs each key of its state dict
        (0.3 ms a key, 250 per rank here)."""
        super().set_up_planner(self.written, storage_meta, is_coordinator)

