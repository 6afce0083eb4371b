"""Whole tensors on rank 0, one at a time, from the pieces the ranks hold, over a process group of the writer's own.

torch's own gathers are slow or heavy for writing one file: a ShardedTensor's `gather` pads and gathers every
shard through the default group, and a DTensor's `full_tensor` all-gathers the whole tensor onto every rank. Here
each rank sends only the pieces rank 0 lacks, straight into their place in the tensor rank 0 writes (point to
point, in the same order on both sides). Under FSDP a piece is a rank's rows of a tensor (dim-0 slabs, contiguous
in the whole tensor); under DDP and on one device rank 0 holds every tensor whole and nothing travels; where ranks
replicate a piece (HYBRID_SHARD, NO_SHARD) the lowest of them sends it.

The group is a gloo group made for checkpoints (CPU tensors, on GPU machines too, so that the same code runs
everywhere), which also lets a background writer gather while training uses the default group.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + data.numel()) of the flattened whole tensor (1-D)."""

    start: int
    data: torch.Tensor


def flat_start(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """Where a block of rows starts in the flattened tensor; other blocks are not contiguous there."""
    if any(offsets[1:]) or tuple(sizes[1:]) != tuple(shape[1:]):
        raise ValueError(f"a shard at {offsets} of size {sizes} is not a block of rows of a tensor of shape {shape}")
    return offsets[0] * prod(shape[1:]) if shape else 0


def pieces_of(value: Any, copy: bool) -> Optional[list[Piece]]:
    """This rank's pieces of a sharded value on the CPU, `copy`ed away from the tensors training changes (else views
    where they already live on the CPU); None for a plain tensor that every rank holds whole."""
    if isinstance(value, ShardedTensor):
        blocks = [(tuple(shard.metadata.shard_offsets), shard.tensor) for shard in value.local_shards()]
    elif isinstance(value, DTensor):
        _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        blocks = [(tuple(offsets), value.to_local())]
    else:
        return None
    shape = tuple(value.size())
    return [Piece(flat_start(shape, offsets, tuple(local.shape)), local.detach().reshape(-1).to("cpu", copy=copy))
            for offsets, local in blocks if local.numel()]


class RankZeroGather:
    """Which rank sends which piece of every tensor, agreed once per checkpoint; then whole tensors on rank 0."""

    def __init__(self, pieces: dict[str, Optional[list[Piece]]], group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        layout = {name: [(p.start, p.data.numel()) for p in found] for name, found in pieces.items() if found}
        layouts: list[Any] = [None] * self.world_size
        if self.world_size > 1:
            dist.gather_object(layout, layouts if self.rank == 0 else None, group_dst=0, group=group)
        else:
            layouts = [layout]
        plan: list[Any] = [self.senders(layouts) if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(plan, group_src=0, group=group)
        self.plan: dict[str, list[tuple[int, int, int]]] = plan[0]

    @staticmethod
    def senders(layouts: list[dict[str, list[tuple[int, int]]]]) -> dict[str, list[tuple[int, int, int]]]:
        """(rank, start, numel) of every distinct piece, from the lowest rank holding it."""
        plan: dict[str, dict[tuple[int, int], int]] = {}
        for rank, layout in enumerate(layouts):
            for name, regions in layout.items():
                for region in regions:
                    plan.setdefault(name, {}).setdefault(region, rank)
        return {name: sorted((rank, start, numel) for (start, numel), rank in regions.items())
                for name, regions in plan.items()}

    def whole(self, name: str, value: Any, pieces: Optional[list[Piece]]) -> Optional[torch.Tensor]:
        """The whole tensor `name` on rank 0's CPU (None elsewhere), of `value`'s shape and dtype (a plain tensor is
        returned as it is). Collective over the group, in the same tensor order on every rank."""
        if pieces is None and name not in self.plan:
            return value.detach().cpu() if self.rank == 0 else None
        own = {piece.start: piece.data for piece in pieces or []}
        if self.rank != 0:
            for rank, start, _ in self.plan[name]:
                if rank == self.rank:
                    dist.send(own[start], group_dst=0, group=self.group)
            return None
        whole = torch.empty(tuple(value.size()), dtype=value.dtype)
        flat = whole.view(-1)
        covered = 0
        for rank, start, numel in self.plan[name]:
            region = flat[start:start + numel]
            if rank == 0:
                region.copy_(own[start])
            else:
                dist.recv(region, group_src=rank, group=self.group)
            covered += numel
        if covered != whole.numel():
            raise RuntimeError(f"the ranks' pieces of {name} cover {covered} of its {whole.numel()} elements")
        return whole
