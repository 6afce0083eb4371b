"""AdamW whose updates of bf16 weights are rounded stochastically (--stochastic_rounding, under bf16-true).

bf16 keeps 8 significant bits, so an AdamW step smaller than half the spacing of bf16 numbers at a weight (a weight
of 0.02 at a fine-tune's lr of 2e-5) rounds back to the weight: to nearest, it never moves. Rounded stochastically
(up with the probability of the fraction that rounding drops), the same step moves it by the step on average, so
bf16-true trains without fp32 master weights' 4 bytes per parameter (Zamirai et al., "Revisiting BFloat16
Training", 2020). The update is computed in fp32 from bf16 weights, gradients and moments, as torch's fused AdamW
computes it. The second moment is rounded stochastically too: beta2 x v differs from v by (1 - beta2) of it, which
to nearest rounds away at torch's 0.999, so that v could never decrease after a large gradient (the preflight
refuses that --beta2 under bf16-true without this option). The first moment, which moves by a tenth of itself at
beta1 0.9, is stored to nearest, as torch stores it.

Written here rather than taken from torchao (`torchao.optim._AdamW(bf16_stochastic_round=True)`): that one compiles
every parameter's step with torch.compile (minutes on CPU, a warm-up on GPUs), takes its learning rate as a tensor,
which the schedule's per-step assignment breaks, and draws its noise from the global generator, which the ranks seed
apart: ranks holding the same weights (ddp, NO_SHARD, HYBRID_SHARD's replicas) would round them apart and drift.
Here the noise of step s comes from a generator seeded with (--seed, s) on every rank: replicas round alike, and a
resume draws the same noise with nothing to store. The state (step, exp_avg, exp_avg_sq), the parameter groups and
the state dict are torch.optim.AdamW's, so a checkpoint of either resumes with the other.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

CHUNK = 2**24
"""Elements updated at a time (fp32 temporaries of 64 MiB each): a weight of Llama-3's 128K x 4096 embedding
unsharded would otherwise take several fp32 copies of 2 GiB."""
SEED_STRIDE = 1_000_003
"""Seeds of steps s and s + 1 of seeds k and k + 1 stay apart: seed k x SEED_STRIDE + s."""


def round_stochastically(values: Tensor, generator: torch.Generator) -> Tensor:
    """`values` (fp32) in bf16, each rounded away from zero with the probability of the fraction of a bf16 spacing
    that rounding towards zero drops, so that the expected result is the value. A random 16-bit number is added to
    the low half of the fp32 bits, then the low half is cleared: it carries into the high half exactly that often
    (the sign is a bit apart, so this works on magnitudes)."""
    noise = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, device=values.device, generator=generator)
    bits = (values.view(torch.int32) + noise).bitwise_and_(-(1 << 16))
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low half is zero


class StochasticRoundingAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with each step's weights rounded stochastically where they are bf16 (as computed by torch's
    AdamW, in fp32, elsewhere)."""

    def __init__(self, params: Iterable[Any], *, seed: int, **options: Any) -> None:
        super().__init__(params, foreach=False, fused=False, **options)
        self.seed = seed

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        generators: dict[torch.device, torch.Generator] = {}
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                state = self.state[parameter]
                if not state:  # as torch's AdamW (not fused, not capturable): the step count on the CPU
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                weight = local(parameter)
                if weight.device not in generators:
                    generators[weight.device] = torch.Generator(weight.device).manual_seed(
                        self.seed * SEED_STRIDE + step)
                adamw_update(weight, local(parameter.grad), local(state["exp_avg"]), local(state["exp_avg_sq"]),
                             step, group, generators[weight.device])
        return loss


def local(tensor: Tensor) -> Tensor:
    """This rank's part: FSDP2's weights, gradients and moments are DTensors of the same placement."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def adamw_update(weight: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, group: dict,
                 generator: torch.Generator) -> None:
    """One AdamW step of one tensor, in fp32, CHUNK elements at a time, in torch's AdamW's order of operations:
    decay, moments, bias-corrected step."""
    lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    step_size = lr / (1 - beta1**step)
    root_correction = math.sqrt(1 - beta2**step)
    pieces = [tensor.view(-1).split(CHUNK) for tensor in (weight, grad, exp_avg, exp_avg_sq)]
    for w, g, m, v in zip(*pieces):
        g32 = g.float()
        m32 = m.float().lerp_(g32, 1 - beta1)
        v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        m.copy_(m32)
        v.copy_(round_stochastically(v32, generator) if v.dtype == torch.bfloat16 else v32)
        denominator = v32.sqrt().div_(root_correction).add_(eps)
        w32 = w.float().mul_(1 - lr * weight_decay).addcdiv_(m32, denominator, value=-step_size)
        w.copy_(round_stochastically(w32, generator) if w.dtype == torch.bfloat16 else w32)
