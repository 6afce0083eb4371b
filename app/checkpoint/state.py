"""What a checkpoint holds, and this rank's part of it: flat names, and pieces of flattened tensors.

Every strategy's checkpoint stores the same tensors under the names of torch.distributed.checkpoint's state-dict API,
named after the Hugging Face model whether it is wrapped by FSDP, DDP, torch.compile or nothing:

    model.<parameter or persistent buffer>    e.g. model.model.layers.0.mlp.up_proj.weight
    optimizer.state.<parameter>.<state>       state: step, exp_avg, exp_avg_sq (AdamW); momentum_buffer (Muon)

A rank holds a `Part` of each: the whole tensor's shape and dtype and the `Piece`s of it the rank has, each a range of
elements of the tensor flattened in C order. Under FSDP a piece is the rank's range of a parameter inside FSDP's flat
shard (fsdp_shards.py) or, under FSDP2, its rows (a DTensor's local shard); under DDP and on one device every rank
holds every tensor as one piece. Pieces are views of the tensors training uses, so a checkpoint is written from them
and read into them with no copy of the state on the way. Element ranges make every layout readable by every other:
a checkpoint written by any strategy loads into any other, at any world size. Shapes are checked against the model
before any tensor is read, so another model's optimizer state never reaches a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn import Module

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer.state."
ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")
MUON_STATE = ("momentum_buffer",)


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold this model's state: named tensor, shapes, what to do."""


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + data.numel()) of a tensor flattened in C order; `data` is 1-D."""

    start: int
    data: torch.Tensor


@dataclass(frozen=True)
class Part:
    """This rank's part of one stored tensor: the whole tensor's shape and dtype, and the pieces the rank holds."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass
class LocalState:
    """This rank's part of every tensor a checkpoint holds, by name (in the order a full checkpoint stores them),
    and the parameters' names in the optimizer's order (how earlier versions numbered their optimizer state)."""

    parts: dict[str, Part]
    parameter_order: list[str]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: part.shape for name, part in self.parts.items()}


def whole_part(tensor: torch.Tensor) -> Part:
    """A tensor this rank holds whole, as one piece."""
    pieces = (Piece(0, tensor.detach().view(-1)),) if tensor.numel() else ()
    return Part(tuple(tensor.shape), tensor.dtype, pieces)


def part_of(value: Any) -> Part:
    """This rank's part of a value of torch's distributed state dicts: a DTensor's or ShardedTensor's local blocks
    of rows, or a plain tensor held whole."""
    if isinstance(value, ShardedTensor):
        blocks = [(tuple(shard.metadata.shard_offsets), shard.tensor) for shard in value.local_shards()]
    elif isinstance(value, DTensor):
        _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        blocks = [(tuple(offsets), value.to_local())]
    else:
        return whole_part(value)
    shape = tuple(value.size())
    pieces = tuple(Piece(row_block_start(shape, offsets, tuple(local.shape)), local.detach().view(-1))
                   for offsets, local in blocks if local.numel())
    return Part(shape, value.dtype, pieces)


def row_block_start(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """Where a block of whole rows starts in the flattened tensor (other blocks are not one range of elements)."""
    if any(offsets[1:]) or tuple(sizes[1:]) != tuple(shape[1:]):
        raise ValueError(f"a shard at {offsets} of size {sizes} is not a block of rows of a tensor of shape {shape}")
    return offsets[0] * prod(shape[1:]) if shape else 0


def blocks(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The rectangular blocks (offsets, sizes) that elements [start, stop) of a C-ordered tensor of `shape` make up,
    in order: a partial first row, whole rows, a partial last row (recursively for more dimensions). A sharded
    checkpoint stores a piece as these blocks, the form torch.distributed.checkpoint describes chunks in."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    row = prod(shape[1:])
    first_row, first_column = divmod(start, row)
    last_row, last_column = divmod(stop, row)

    def within(row_index: int, begin: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row_index, *offsets), (1, *sizes)) for offsets, sizes in blocks(shape[1:], begin, end)]

    if first_row == last_row:
        return within(first_row, first_column, last_column)
    found = within(first_row, first_column, row) if first_column else []
    whole_from = first_row + (1 if first_column else 0)
    if last_row > whole_from:
        found.append(((whole_from, *[0] * (len(shape) - 1)), (last_row - whole_from, *shape[1:])))
    return found + (within(last_row, 0, last_column) if last_column else [])


def flat_range(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int]:
    """(start, numel) of a block that is one range of the flattened tensor; ValueError for any other block."""
    split = next((dim for dim, size in enumerate(sizes) if size != 1), len(sizes))
    if any(offsets[dim] != 0 or sizes[dim] != shape[dim] for dim in range(split + 1, len(shape))):
        raise ValueError(f"a block at {tuple(offsets)} of size {tuple(sizes)} is not one range of a tensor of shape "
                         f"{tuple(shape)}")
    strides = [prod(shape[dim + 1:]) for dim in range(len(shape))]
    return sum(o * s for o, s in zip(offsets, strides)), prod(sizes)


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Fabric's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


@torch.no_grad()
def initialise_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without optimizer state (none before the first step; under FSDP, those a rank holds no
    element of) the state its optimizer starts from (AdamW's zero moments and step 0, Muon's zero momentum), so that
    a checkpoint can be written from it or read into it. The optimizer creates it in a step: here one with lr 0 on
    a zero gradient, for one parameter at a time so that no more than the largest parameter's zeros exist at once
    (all of them at once held a second copy of the parameters while resuming), after which AdamW's step count is
    set back to 0, so that their next step is exactly the first one."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    missing = [parameter for parameter in parameters if parameter not in optimizer.state]
    if not missing:
        return
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    gradients = [parameter.grad for parameter in parameters]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for parameter in parameters:
        parameter.grad = None
    for parameter in missing:
        parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
        parameter.grad = None
    for group, lr in zip(optimizer.param_groups, learning_rates):
        group["lr"] = lr
    for parameter, gradient in zip(parameters, gradients):
        parameter.grad = gradient
    for parameter in missing:
        if "step" in optimizer.state[parameter]:
            optimizer.state[parameter]["step"].zero_()


def expected_shapes(model: Module, parameter_order: list[str],
                    muon: frozenset[str] = frozenset()) -> dict[str, tuple[int, ...]]:
    """What a checkpoint of `model` (possibly on the meta device) holds, by name, trained with AdamW, and with Muon
    for the parameters `muon` names."""
    shapes = {MODEL_PREFIX + name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    parameters = dict(model.named_parameters())
    for name in parameter_order:
        shape = tuple(parameters[name].shape)
        keys = MUON_STATE if name in muon else ADAMW_STATE
        shapes |= {f"{OPTIMIZER_PREFIX}{name}.{key}": () if key == "step" else shape for key in keys}
    return shapes


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
