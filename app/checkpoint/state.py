"""The model's and optimizer's state in one form for every strategy: flat names, this rank's part of each tensor.

torch.distributed.checkpoint's state-dict API names every tensor after the Hugging Face model, whether the model
is wrapped by FSDP, DDP, torch.compile or nothing, and AdamW's moments after the parameter they belong to:

    model.<parameter>                     e.g. model.model.layers.0.mlp.up_proj.weight
    optimizer.state.<parameter>.<state>   state: step, exp_avg, exp_avg_sq

(the keys DCP gives the nested `{"model": ..., "optimizer": ...}` dict, as Lightning saved it). Under FSDP each value
holds this rank's rows of the tensor (ShardedTensor, or DTensor under FSDP2); under DDP and on one device the whole
tensor. A checkpoint written by any strategy therefore loads into any other, at any world size: the load asks for
the regions each rank holds. Shapes are checked against the model before any tensor is read, so optimizer state of
another model never reaches a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn import Module

from app.model import strategy_module

SHARDED = StateDictOptions(full_state_dict=False)
MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer.state."


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold this model's state: named tensor, shapes, what to do."""


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Fabric's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


@dataclass
class TrainingState:
    """The nested state dicts torch's API reads and writes, and the flat view of their tensors checkpoints store."""

    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]

    @classmethod
    def of(cls, model: Module, optimizer: Any) -> "TrainingState":
        """This rank's state; an optimizer that has not stepped yet gets zero moments (step 0) to load into."""
        model_state, optimizer_state = get_state_dict(strategy_module(model), raw_optimizer(optimizer), options=SHARDED)
        return cls(model_state, optimizer_state)

    def tensors(self) -> dict[str, Any]:
        flat = {MODEL_PREFIX + name: value for name, value in self.model_state.items()}
        for parameter, values in self.optimizer_state["state"].items():
            flat |= {f"{OPTIMIZER_PREFIX}{parameter}.{key}": value for key, value in values.items()}
        return flat

    def parameter_order(self) -> list[str]:
        """Parameter names in the optimizer's order (how torch's own optimizer state dicts number them)."""
        return [name for group in self.optimizer_state["param_groups"] for name in group["params"]]

    def apply(self, model: Module, optimizer: Any) -> None:
        """Give the (loaded) tensors back to the model and optimizer."""
        set_state_dict(strategy_module(model), raw_optimizer(optimizer), model_state_dict=self.model_state,
                       optim_state_dict=self.optimizer_state, options=SHARDED)


ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")


def expected_shapes(model: Module, parameter_order: list[str]) -> dict[str, tuple[int, ...]]:
    """What a checkpoint of `model` (possibly on the meta device) trained with AdamW holds, by name."""
    shapes = {MODEL_PREFIX + name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    parameters = dict(model.named_parameters())
    for name in parameter_order:
        shape = tuple(parameters[name].shape)
        shapes |= {f"{OPTIMIZER_PREFIX}{name}.{key}": () if key == "step" else shape for key in ADAMW_STATE}
    return shapes


def global_shape(value: Any) -> tuple[int, ...]:
    """The whole tensor's shape, also for a rank's shard (ShardedTensor and DTensor report the whole size)."""
    return tuple(value.size())


def check_fits(stored: dict[str, tuple[torch.dtype, tuple[int, ...]]], expected: dict[str, tuple[int, ...]],
               source: str) -> None:
    """Every expected tensor is stored with its shape, and nothing else is: else CheckpointMismatch, one line."""
    for name, shape in expected.items():
        if name not in stored:
            raise CheckpointMismatch(f"{source} has no {name}: it was written for another model or optimizer")
        if tuple(stored[name][1]) != tuple(shape):
            raise CheckpointMismatch(f"{source} holds {name} of shape {tuple(stored[name][1])}, the model needs "
                                     f"{tuple(shape)}: it was written for another model")
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise CheckpointMismatch(f"{source} holds {extra[0]}, which this model does not have (and {len(extra) - 1} "
                                 "more): it was written for another model")
