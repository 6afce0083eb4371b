"""AdamW with weight decay on matrices only: norms and biases (1-D parameters) are not decayed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import Module

if TYPE_CHECKING:
    from arguments import Config


WRAPPER_PREFIXES = ("_forward_module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter's name in the Hugging Face model, without the prefixes of Fabric, FSDP, checkpointing, compile."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix("module.")


def no_decay_names(model: Module) -> set[str]:
    """Norm weights and biases (the 1-D parameters), read before wrapping: FSDP flattens every shard to 1-D."""
    return {name for name, p in model.named_parameters() if p.ndim < 2}


def parameter_groups(model: Module, weight_decay: float, no_decay: set[str]) -> list[dict]:
    params = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in params if n not in no_decay], "weight_decay": weight_decay},
        {"params": [p for n, p in params if n in no_decay], "weight_decay": 0.0},
    ]


def build_optimizer(model: Module, cfg: Config, no_decay: set[str]) -> torch.optim.AdamW:
    """Built on the set-up (wrapped) model. The LR is set before every step by the schedule."""
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay, no_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=not cfg.tpu
    )


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
