"""FSDP2's all-gather and reduce-scatter for CPU processes, as point-to-point messages over gloo.

FSDP2 gathers each unit in place (its input is this rank's slice of the output), but gloo's all-gather gathers into
a flat temporary of its own and copies that into the output, so on a CPU rank every unit's gather also allocated
(a fresh mapping, faulted in page by page) and copied the whole unit once more, and held it twice at fsdp2's peak;
its reduce-scatter likewise works through temporaries of the whole gradient. Here each rank sends its slice to
every peer and receives theirs straight into the output, and a reduce-scatter adds its peers' chunks into its own
one at a time. On 2 processes, per call on one layer of the README's 170M model (67 MB), the all-gather took 0.59
of gloo's time with half its page faults and the reduce-scatter 0.79 (`python benchmarks/bench_collectives.py`);
fsdp2's steps went from 0.95-0.99 of fsdp's to 0.76-0.91 (docs/performance.md).

FSDP2 takes these through `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`, so everything else it
does (copy-in, copy-out, mixed precision, resharding, prefetching) is the code GPU runs take; GPUs keep NCCL's
collectives, which write into FSDP2's buffers directly. Both finish before they return (`async_op` is ignored): a CPU
process has nothing to overlap them with, and FSDP2 takes a collective that returns no work handle as done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule


def uses_point_to_point(device: torch.device) -> bool:
    """CPU processes talk over gloo; GPUs keep NCCL's collectives, which write into the output directly."""
    return device.type == "cpu"


class FreshBuffers:
    """FSDP2's `Comm.allocate`, as its default: a new buffer for every call."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class PointToPointAllGather(FreshBuffers):
    """FSDP2's `AllGather` interface: every rank sends its slice to each peer and receives theirs in place."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        rank, slices = group.rank(), output_tensor.chunk(group.size())
        if slices[rank].data_ptr() != input_tensor.data_ptr():  # FSDP2 gathers in place
            slices[rank].copy_(input_tensor)
        works = []
        for peer in range(group.size()):
            if peer != rank:
                works.append(dist.isend(input_tensor, group_dst=peer, group=group))
                works.append(dist.irecv(slices[peer], group_src=peer, group=group))
        for work in works:
            work.wait()


class PointToPointReduceScatter(FreshBuffers):
    """FSDP2's `ReduceScatter` interface. Sums and averages go point to point: every rank posts its peers' chunks,
    then receives theirs one at a time into one shard-sized buffer and adds each to its own chunk; any other
    operation goes to gloo. Either way the input's memory is released on return: FSDP2 reads it no more, and holds
    it until the next unit's reduction only so that a GPU's compute stream cannot reuse memory its reduce-scatter
    stream may still read, which a CPU process need not wait for (a layer's whole gradient at fsdp2's peak)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> None:
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            reduce_scatter_point_to_point(output_tensor, input_tensor, group, average=op == dist.ReduceOp.AVG)
        else:
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
        input_tensor.untyped_storage().resize_(0)


def reduce_scatter_point_to_point(output: torch.Tensor, gradients: torch.Tensor, group: dist.ProcessGroup,
                                  average: bool) -> None:
    rank, world_size = group.rank(), group.size()
    chunks = gradients.chunk(world_size)
    output.copy_(chunks[rank])
    received = torch.empty_like(output)
    sends = [dist.isend(chunks[peer], group_dst=peer, group=group) for peer in range(world_size) if peer != rank]
    for peer in range(world_size):
        if peer != rank:
            dist.irecv(received, group_src=peer, group=group).wait()
            output.add_(received)
    for send in sends:
        send.wait()
    if average:
        output.div_(world_size)


def use_point_to_point_collectives(module: FSDPModule) -> None:
    module.set_custom_all_gather(PointToPointAllGather())
    module.set_custom_reduce_scatter(PointToPointReduceScatter())
