"""AdamW (or Muon with AdamW, app/optimization/muon.py) with weight decay on matrices only (norms and biases are not
decayed), and the gradient norm in fp32.

The gradient norm is computed here rather than by Lightning or FSDP, whose norms come back in the gradients' dtype (bf16
under bf16-true) and cost one collective of their own: each rank sums its gradients' squares in fp32, the sum travels in
the step's single all_reduce (app/reliability/signals.py), and dividing by the number of ranks that hold the same
gradient values (`app.distributed.strategy.gradient_replicas`) gives the squared norm of the whole gradient, under FSDP,
DDP or one device alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor
from torch.nn import Embedding, Module

from app.distributed.precision import uses_grad_scaler
from app.optimization.muon import MuonWithAdamW
from app.optimization.stochastic_rounding import StochasticRoundingAdamW

if TYPE_CHECKING:
    from arguments import Config


WRAPPER_PREFIXES = ("_forward_module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter's name in the Hugging Face model, without the prefixes of Fabric, FSDP, checkpointing, compile."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix("module.")


def no_decay_names(model: Module) -> set[str]:
    """Norm weights and biases, read before wrapping (FSDP flattens every shard to 1-D): the 1-D parameters, and those
    named as biases whatever their shape (T5's `relative_attention_bias`, a table of attention biases), as the
    Hugging Face Trainer exempts them."""
    return {name for name, p in model.named_parameters() if p.ndim < 2 or "bias" in name}


def matrix_names(model: Module) -> set[str]:
    """The weight matrices of the model's layers, which --optimizer muon steps with Muon: the 2-D parameters but
    norms and biases (`no_decay_names`), embeddings (T5's relative attention bias and GPT-2's positions among them)
    and the output layer, which AdamW steps, as Muon's authors do. Read before wrapping, as `no_decay_names`."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, Embedding) or m is output}
    exempt = no_decay_names(model)
    return {canonical_name(name) for name, p in model.named_parameters()
            if p.ndim == 2 and id(p) not in embeddings and name not in exempt}


@dataclass(frozen=True)
class ParameterRoles:
    """How the optimizer treats each parameter, by name, read before wrapping."""

    no_decay: frozenset[str]
    matrices: frozenset[str]
    """What Muon steps under --optimizer muon (`matrix_names`)."""

    @classmethod
    def of(cls, model: Module) -> "ParameterRoles":
        return cls(frozenset(no_decay_names(model)), frozenset(matrix_names(model)))

    def muon(self, optimizer: str) -> frozenset[str]:
        """The parameters --optimizer steps with Muon; none under AdamW."""
        return self.matrices if optimizer == "muon" else frozenset()


def grouped_parameter_names(model: Module, no_decay: set[str] | frozenset[str],
                            leave_out: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """The trainable parameters with and without weight decay, in the order the optimizer lists them; those of
    `leave_out` left out."""
    names = [canonical_name(n) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n in names if n not in leave_out]
    return [n for n in names if n not in no_decay], [n for n in names if n in no_decay]


def parameter_groups(model: Module, weight_decay: float, no_decay: set[str] | frozenset[str],
                     leave_out: frozenset[str] = frozenset()) -> list[dict]:
    params = {canonical_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    decayed, exempt = grouped_parameter_names(model, no_decay, leave_out)
    return [{"params": [params[n] for n in decayed], "weight_decay": weight_decay},
            {"params": [params[n] for n in exempt], "weight_decay": 0.0}]


def matrix_groups(model: Module, weight_decay: float, names: frozenset[str]) -> list[dict]:
    """Muon's group: the trainable matrices among `names`, decayed."""
    matrices = [p for n, p in model.named_parameters() if p.requires_grad and canonical_name(n) in names]
    return [{"params": matrices, "weight_decay": weight_decay}] if matrices else []


def build_optimizer(model: Module, cfg: Config, roles: ParameterRoles) -> torch.optim.Optimizer:
    """Built on the set-up (wrapped) model. The LR is set before every step by the schedule.

    Fused AdamW (one kernel over all parameters) unscales fp16 gradients inside its step, so Lightning cannot clip
    them first: with a gradient scaler (16-mixed) the multi-tensor (foreach) implementation is used instead.
    --stochastic_rounding takes this project's AdamW (app/optimization/stochastic_rounding.py); --optimizer muon
    Muon with AdamW (app/optimization/muon.py), or AdamW alone where nothing Muon would step trains (--freeze).
    """
    matrices = matrix_groups(model, cfg.weight_decay, roles.muon(cfg.optimizer))
    groups = parameter_groups(model, cfg.weight_decay, roles.no_decay, roles.muon(cfg.optimizer))
    options = dict(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.stochastic_rounding:
        return StochasticRoundingAdamW(groups, seed=cfg.seed, lr=cfg.lr, **options)
    fused = not cfg.tpu and not uses_grad_scaler(cfg.precision)
    options |= dict(fused=fused, foreach=None if fused else True)
    if matrices:
        return MuonWithAdamW(matrices, groups, lr=cfg.lr, momentum=cfg.muon_momentum, adamw_options=options)
    return torch.optim.AdamW(groups, lr=cfg.lr, **options)


@dataclass(frozen=True)
class GradientPolicy:
    """How a step's gradients are accumulated, measured and bounded."""

    max_norm: float
    """0 measures the norm without clipping."""
    replicas: int
    """Ranks holding the same gradient values (app.distributed.strategy.gradient_replicas)."""
    scaled: bool
    """A gradient scaler unscales first and skips steps whose gradients are not finite."""
    defer_sync: bool
    """Synchronise gradients only after the last micro-batch (DDP; FSDP with --fsdp_no_sync), else after each."""


def local_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradient entries this rank holds: FSDP2's gradients are DTensors, whose local part is this rank's rows."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]


def gradient_square_sum(optimizer: torch.optim.Optimizer, device: torch.device) -> torch.Tensor:
    """The sum of the squares of the gradient entries this rank holds, in fp32 whatever the gradients' dtype."""
    grads = local_gradients(optimizer)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.stack([norm.to(device) for norm in norms]).square().sum()


def clip_gradients(optimizer: torch.optim.Optimizer, total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients down to `max_norm` when the whole gradient's norm exceeds it (no host synchronisation;
    torch's clip_grads_with_norm_ with its epsilon, on the local parts so that DTensor gradients are scaled too)."""
    scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in local_gradients(optimizer):
        by_device.setdefault(grad.device, []).append(grad)
    for device, grads in by_device.items():  # with --cpu_offload the gradients live on the CPU
        torch._foreach_mul_(grads, scale.to(device))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
