"""torch.distributed.checkpoint (DCP) reading from a single full checkpoint, each rank reading only its own shard.

DCP plans the load: every rank asks for the regions of each tensor that its shard covers (FSDP shards cut tensors
by rows), whatever the world size or strategy that wrote the checkpoint. A `TensorSource` answers those requests:
`FileSource` with plain reads from a full checkpoint file (tensor_file.py), `MemorySource` from tensors already in
memory (checkpoints written by earlier versions with torch.save).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol

import torch
from torch.distributed.checkpoint import Metadata, StorageReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from app.checkpoint.tensor_file import elements_per_row, read_header, read_into, read_region, whole_rows


class TensorSource(Protocol):
    def shapes(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every stored tensor's dtype and full shape."""

    def read_into(self, name: str, offsets: tuple[int, ...], lengths: tuple[int, ...], target: torch.Tensor) -> None:
        """Copy the region of tensor `name` starting at `offsets` with `lengths` into `target`."""


class FileSource:
    """A full checkpoint file, read with plain reads (no memory map): a rank's reads land in its own tensors."""

    def __init__(self, path: Path) -> None:
        self.entries, self.metadata = read_header(path)
        self.handle = open(path, "rb")

    def shapes(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {name: (entry.dtype, entry.shape) for name, entry in self.entries.items()}

    def read_into(self, name: str, offsets: tuple[int, ...], lengths: tuple[int, ...], target: torch.Tensor) -> None:
        entry = self.entries[name]
        direct = (target.device.type == "cpu" and target.dtype == entry.dtype and target.is_contiguous()
                  and bool(entry.shape) and whole_rows(entry, offsets, lengths))
        if direct:
            read_into(self.handle, entry, offsets[0] * elements_per_row(entry), target)
        else:
            target.copy_(read_region(self.handle, entry, offsets, lengths))

    def read_elements_into(self, name: str, first: int, target: torch.Tensor) -> None:
        """`target.numel()` elements of tensor `name`, flattened, from element `first` on."""
        entry = self.entries[name]
        if target.device.type == "cpu" and target.dtype == entry.dtype and target.is_contiguous():
            read_into(self.handle, entry, first, target)
        else:
            buffer = torch.empty(target.shape, dtype=entry.dtype)
            read_into(self.handle, entry, first, buffer)
            target.copy_(buffer)

    def close(self) -> None:
        self.handle.close()


class MemorySource:
    """Tensors already in memory (a memory-mapped torch.save file)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shapes(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in self.tensors.items()}

    def read_into(self, name: str, offsets: tuple[int, ...], lengths: tuple[int, ...], target: torch.Tensor) -> None:
        target.copy_(self.tensors[name][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))])

    def close(self) -> None:
        self.tensors.clear()


class SourceReader(StorageReader):
    """DCP's storage reader for a `TensorSource` that holds every tensor whole, as one chunk."""

    def __init__(self, source: TensorSource) -> None:
        super().__init__()
        self.source = source

    def reset(self, checkpoint_id: Optional[str] = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        entries = {}
        for name, (dtype, shape) in self.source.shapes().items():
            size = torch.Size(shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=size)
            entries[name] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=size, chunks=[chunk])
        return Metadata(state_dict_metadata=entries)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for request in plan.items:
            target = planner.resolve_tensor(request).detach()
            self.source.read_into(request.storage_index.fqn, tuple(request.storage_offsets), tuple(request.lengths),
                                  target)
            planner.commit_tensor(request, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True
