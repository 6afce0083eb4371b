"""FSDP2's point-to-point collectives for CPU processes (app/distributed/cpu_collectives.py) give gloo's own results, and
fsdp2 on CPU processes uses them.

Three forked processes over gloo, so that a rank has more than one peer. Values are whole numbers, whose sums are
exact in any order, so the results must equal gloo's exactly. Training with them (fsdp2's steps equal fsdp's, resume,
HYBRID_SHARD's 2-D mesh) is in tests/test_resume_anywhere.py, tests/test_fsdp2.py and tests/test_hybrid_shard.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.nn import Linear, Sequential

from app.distributed.cpu_collectives import PointToPointAllGather, PointToPointReduceScatter
from app.distributed.fsdp2 import shard_model
from tests.conftest import run_forked_ranks

WORLD_SIZE = 3


def whole_numbers(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(-50, 50, (numel,), generator=torch.Generator().manual_seed(rank)).to(dtype)


def check_all_gather(rank: int, dtype: torch.dtype) -> None:
    """In place, as FSDP2 gathers (its input is this rank's slice of the output), and from a separate input."""
    numel = 1000
    expected = torch.cat([whole_numbers(peer, numel, dtype) for peer in range(WORLD_SIZE)])
    in_place = torch.full((numel * WORLD_SIZE,), float("nan"), dtype=dtype)
    own_slice = in_place.narrow(0, rank * numel, numel)
    own_slice.copy_(whole_numbers(rank, numel, dtype))
    PointToPointAllGather()(in_place, own_slice, dist.group.WORLD)
    assert torch.equal(in_place, expected)
    separate = torch.full_like(in_place, float("nan"))
    PointToPointAllGather()(separate, whole_numbers(rank, numel, dtype), dist.group.WORLD)
    assert torch.equal(separate, expected)


def check_reduce_scatter(rank: int, dtype: torch.dtype, op: dist.ReduceOp) -> None:
    numel = 600
    gradients = whole_numbers(rank, numel * WORLD_SIZE, dtype)
    ours, gloos = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
    given = gradients.clone()
    PointToPointReduceScatter()(ours, given, dist.group.WORLD, op=op)
    dist.reduce_scatter_tensor(gloos, gradients.clone(), op=op)
    assert torch.equal(ours, gloos), (op, dtype)
    assert given.untyped_storage().size() == 0, "the input's memory is released once reduced"


def check_fsdp2_installs_them(rank: int) -> None:
    """Through `shard_model` on a CPU mesh: every unit uses them, and the gradients FSDP2 reduces with them are the
    ones one process computes from every rank's batch."""
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("data_parallel",))
    torch.manual_seed(0)
    model = Sequential(Linear(6, 12), Linear(12, 6), Linear(6, 1, bias=False))
    reference = Sequential(*(Linear(m.in_features, m.out_features, bias=m.bias is not None) for m in model))
    reference.load_state_dict(model.state_dict())
    shard_model(model, mesh, wrap_classes={Linear}, sharding_strategy="FULL_SHARD", num_nodes=1,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(), param_init_fn=None)
    for module in model:
        group = module._get_fsdp_state()._fsdp_param_groups[0]
        assert isinstance(group._all_gather_comm, PointToPointAllGather)
        assert isinstance(group._reduce_scatter_comm, PointToPointReduceScatter)
    inputs = torch.randn(WORLD_SIZE, 4, 6, generator=torch.Generator().manual_seed(1))
    model(inputs[rank]).sum().backward()
    reference(inputs.flatten(0, 1)).sum().div(WORLD_SIZE).backward()
    for sharded, whole in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(sharded.grad.full_tensor(), whole.grad, rtol=1e-5, atol=1e-6)


def checks(rank: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        check_all_gather(rank, dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
            check_reduce_scatter(rank, dtype, op)
    check_fsdp2_installs_them(rank)


def test_point_to_point_collectives_equal_gloos_and_fsdp2_uses_them_on_cpu(tmp_path) -> None:
    run_forked_ranks(checks, WORLD_SIZE, tmp_path / "store")
