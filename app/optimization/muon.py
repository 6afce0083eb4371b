"""--optimizer muon: Muon for the weight matrices of the model's layers and AdamW for every other parameter, as one
optimizer.

Muon (torch.optim.Muon) orthogonalises each matrix's momentum by Newton-Schulz iterations; it is defined for 2-D
weights only, and its authors and the models trained with it (Moonlight, Kimi K2, GLM-4.5) step the embeddings, the
output layer, norms and biases with AdamW. torch has both optimizers but nothing that runs two as one, which the run
needs: the schedule sets one learning rate on every parameter group, clipping and the gradient norm read every
group, and a checkpoint holds one optimizer's state (under each parameter's name, whatever the strategy). So the two
torch optimizers here share one state and one list of parameter groups, those of this optimizer; each steps its own.

Under FSDP2 the matrices are DTensors sharded by rows. torch's Muon runs its iterations on them op by op, each matrix
product gathering a whole operand again: about 15 collectives per matrix and step (1,020 for the 70 matrices of
configs/bench-170m, benchmarks/bench_muon.py). `ShardedMuon` orthogonalises each matrix whole on one rank of its
shard group instead, the matrices dealt round-robin, and sends each rank its rows back: per round of as many
matrices as ranks, one all_to_all brings each matrix's rows to its rank and one sends the results back, in bf16, the
dtype the iterations run in. torch's Muon has no such path (2.11 and 2.13, whose `_muon.py` is the same code), so
it is written here around torch's own iteration and learning-rate rule (private functions of that module), so that
each rank's rows are those torch's Muon computes on the whole matrix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over `matrix_groups`, AdamW over `other_groups`, one state and one list of groups (Muon's first)."""

    def __init__(self, matrix_groups: list[dict], other_groups: list[dict], *, lr: float, momentum: float,
                 adamw_options: dict[str, Any]) -> None:
        # match_rms_adamw scales each matrix's orthogonal update to the RMS of an AdamW step, so one lr serves both
        self.muon = ShardedMuon(matrix_groups, lr=lr, momentum=momentum, nesterov=True, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(other_groups, lr=lr, **adamw_options)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point both optimizers at this one's groups and state (again after load_state_dict replaces them)."""
        split = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:split], self.param_groups[split:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.muon.step()
        self.adamw.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()


class ShardedMuon(torch.optim.Muon):
    """torch's Muon; on DTensor matrices (fsdp2) each matrix's update is orthogonalised whole on one rank."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not any(isinstance(p, DTensor) for group in self.param_groups for p in group["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            if params:
                step_sharded(params, grads, buffers, group)
        return loss


def step_sharded(params: list[DTensor], grads: list[DTensor], buffers: list[DTensor], group: dict) -> None:
    """Steps this rank's rows of `params` as torch's Muon steps the whole matrices, a round of as many matrices as
    ranks at a time, the rounds overlapped: a round's rows travel to their owners while the round before iterates,
    and its results travel back while the next one does. At most two rounds are in flight, never the whole model's
    updates. The matrices are dealt in order of their shapes (a matrix and its transpose alike), so that a round's
    ranks iterate on matrices of one cost and none waits."""
    process_group, dim = shard_layout(params[0])
    if any(shard_layout(p) != (process_group, dim) for p in params):
        raise ValueError("Muon's matrices are sharded over different process groups or dimensions")
    ranks = dist.get_world_size(process_group)
    device = torch.device(params[0].device_mesh.device_type)  # where the collectives run (the GPU under cpu_offload)
    dealt = sorted(range(len(params)), key=lambda i: sorted(params[i].shape))  # the same order on every rank
    rounds = [dealt[start:start + ranks] for start in range(0, len(dealt), ranks)]

    def send(matrices: list[int]) -> Round:
        updates = [nesterov_update(grads[i].to_local(), buffers[i].to_local(), group) for i in matrices]
        return Round([params[i].shape for i in matrices], updates, dim, process_group, device)

    def apply(matrices: list[int], returned: Round) -> None:
        for i, direction in zip(matrices, returned.rows()):
            rows = params[i].to_local()
            rows.mul_(1 - group["lr"] * group["weight_decay"])
            rows.add_(direction.to(rows.device), alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], params[i].shape))

    current, previous = send(rounds[0]), None
    for index, matrices in enumerate(rounds):
        following = send(rounds[index + 1]) if index + 1 < len(rounds) else None
        current.orthogonalise(group)
        if previous is not None:
            apply(rounds[index - 1], previous)
        previous, current = current, following
    apply(rounds[-1], previous)


def nesterov_update(grad: torch.Tensor, buffer: torch.Tensor, group: dict) -> torch.Tensor:
    """torch's Muon's momentum (the buffer updated in place) and the update it orthogonalises, row by row."""
    buffer.lerp_(grad, 1 - group["momentum"])
    return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer


def shard_layout(param: DTensor) -> tuple[dist.ProcessGroup, int]:
    """The process group a matrix is sharded over and the dimension it is sharded along: FSDP2's one Shard placement
    (replicated over the other mesh dimension under HYBRID_SHARD)."""
    shards = [(mesh_dim, p.dim) for mesh_dim, p in enumerate(param.placements) if isinstance(p, Shard)]
    if len(shards) != 1 or not all(p.is_replicate() or p.is_shard() for p in param.placements):
        raise ValueError(f"Muon steps matrices sharded along one dimension, not placed as {param.placements}")
    mesh_dim, dim = shards[0]
    return param.device_mesh.get_group(mesh_dim), dim


def shard_sizes(length: int, ranks: int) -> list[int]:
    """Each rank's share of `length` rows as DTensor's Shard splits them (torch.chunk's: the last ranks may get fewer,
    or none)."""
    size = -(-length // ranks)
    return [max(0, min(size, length - rank * size)) for rank in range(ranks)]


class Round:
    """A round's matrices in flight, the k-th orthogonalised whole on rank k: made, it starts the all_to_all that
    brings that matrix's rows from every rank to rank k; `orthogonalise` iterates on it and starts the one that sends
    each rank its rows of the results; `rows` waits for those. Each waits only when it needs what it waits for."""

    def __init__(self, shapes: list[torch.Size], updates: list[torch.Tensor], dim: int,
                 process_group: dist.ProcessGroup, device: torch.device) -> None:
        ranks, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        mine = [update.to(device, torch.bfloat16).flatten() for update in updates]  # the iteration's dtype
        self.shapes = [update.shape for update in updates]
        self.sent_sizes = [part.numel() for part in mine] + [0] * (ranks - len(mine))
        self.owned = shapes[rank] if rank < len(shapes) else None
        self.dim, self.process_group = dim, process_group
        self.row_counts = shard_sizes(self.owned[dim], ranks) if self.owned is not None else [0] * ranks
        row_numel = self.owned.numel() // self.owned[dim] if self.owned is not None else 0
        self.owned_sizes = [count * row_numel for count in self.row_counts]
        self.received, self.work = exchange(torch.cat(mine), self.sent_sizes, self.owned_sizes, process_group)

    def orthogonalise(self, group: dict) -> None:
        """Once its rows have arrived, the owned matrix through torch's Newton-Schulz iteration, and each rank's
        rows of the result on their way back."""
        self.work.wait()
        results = self.received.new_empty(0)
        if self.owned is not None:
            dim = self.dim
            shard_shapes = [(*self.owned[:dim], count, *self.owned[dim + 1:]) for count in self.row_counts]
            matrix = torch.cat([part.view(shape) for part, shape
                                in zip(self.received.split(self.owned_sizes), shard_shapes)], dim)
            direction = _zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
            results = torch.cat([part.flatten() for part in direction.split(self.row_counts, dim)])
        self.received, self.work = exchange(results, self.owned_sizes, self.sent_sizes, self.process_group)

    def rows(self) -> list[torch.Tensor]:
        """This rank's rows of each of the round's orthogonalised matrices (bf16), once they are back."""
        self.work.wait()
        parts = self.received.split(self.sent_sizes[:len(self.shapes)])
        return [part.view(shape) for part, shape in zip(parts, self.shapes)]


def exchange(sent: torch.Tensor, sent_sizes: list[int], received_sizes: list[int],
             process_group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Starts an all_to_all of one flat tensor, `sent_sizes[r]` elements to rank r and `received_sizes[r]` from it:
    the tensor it fills, and the work to wait on before reading it."""
    received = sent.new_empty(sum(received_sizes))
    work = dist.all_to_all_single(received, sent, received_sizes, sent_sizes, group=process_group, async_op=True)
    return received, work
