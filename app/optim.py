"""AdamW with weight decay on matrices only: norms and biases (1-D parameters) are not decayed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import Module

if TYPE_CHECKING:
    from arguments import Config


def parameter_groups(model: Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: Module, cfg: Config) -> torch.optim.AdamW:
    """Built on the unwrapped model; Fabric keeps the references valid through FSDP (use_orig_params=True).

    The LR is set before every step by the schedule, so the value given here is never used.
    """
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=not cfg.tpu
    )


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
