"""A full checkpoint read straight into FSDP's flat-parameter shards: resuming costs no memory but AdamW's state.

FSDP (use_orig_params=True, which Lightning sets) flattens each wrapped unit's parameters into one flat tensor and
keeps a contiguous range of it on every rank. Each original parameter's `.data` is then the 1-D piece of it this
rank holds, AdamW's moments for it have the same shape, and FSDP names the piece: elements `intra_param_start_idx`
to `intra_param_end_idx` of the flattened whole parameter (`_ShardParamInfo`). Reading exactly those elements from
the file into the parameter and its moments needs no other memory. torch's sharded state dict, the general route
(state.py), copies the rank's shard twice more on the way in: measured on a 170M model over 4 ranks, each rank's
memory rose by 1.47 GB while loading a 2.0 GB checkpoint, 2.9 times the file over all ranks.

This reads FSDP's private per-unit attributes (`_handle.flat_param._params`, `_shard_param_infos`, `_fqns`), which
ties it to torch==2.13 (pinned); a model without them takes the general route.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn import Module

from app.checkpoint.reader import FileSource
from app.checkpoint.state import ADAMW_STATE, MODEL_PREFIX, OPTIMIZER_PREFIX, check_fits, raw_optimizer
from app.optim import canonical_name


@dataclass(frozen=True)
class Piece:
    """The part of one parameter this rank holds: elements [start, start + numel) of it, flattened."""

    name: str
    parameter: torch.nn.Parameter
    shape: tuple[int, ...]
    start: int


def flat_parameters(module: Module) -> Iterator[tuple[str, Any]]:
    """(the unit's name prefix, its flat parameter) of every FSDP unit holding original parameters."""
    for unit_name, unit in module.named_modules():
        handle = getattr(unit, "_handle", None) if isinstance(unit, FSDP) else None
        flat = handle.flat_param if handle is not None else None
        if flat is not None and flat._params is not None:
            yield canonical_name(f"{unit_name}." if unit_name else ""), flat


def local_pieces(module: Module) -> list[Piece]:
    """Every parameter's local piece under FSDP; empty when `module` is not FSDP with original parameters."""
    pieces = []
    for prefix, flat in flat_parameters(module):
        for parameter, info, fqn, shape in zip(flat._params, flat._shard_param_infos, flat._fqns, flat._shapes):
            start = info.intra_param_start_idx if info.in_shard else 0
            pieces.append(Piece(canonical_name(prefix + fqn), parameter, tuple(shape), start))
    return pieces


def tied_aliases(module: Module) -> dict[str, str]:
    """Other names of tied parameters (T5's encoder and decoder embeddings and head are its shared embedding):
    state dicts hold every name, FSDP one parameter. Maps each alias to the name of the parameter it is."""
    aliases = {}
    for prefix, flat in flat_parameters(module):
        for info in flat._shared_param_infos:
            alias = qualified(prefix, info.module_name, info.param_name)
            aliases[alias] = qualified(prefix, info.prim_module_name, info.prim_param_name)
    return aliases


def qualified(prefix: str, module_name: str, parameter: str) -> str:
    return canonical_name(prefix + (f"{module_name}." if module_name else "") + parameter)


def persistent_buffers(module: Module) -> dict[str, torch.Tensor]:
    """Buffers a state dict holds (FSDP keeps them whole on every rank)."""
    buffers = {}
    for owner_name, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if name not in owner._non_persistent_buffers_set:
                buffers[canonical_name(f"{owner_name}.{name}" if owner_name else name)] = buffer
    return buffers


def initialise_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Let AdamW create its state as its first step would (an lr-0 step on zero gradients), to be overwritten."""
    if optimizer.state:
        return
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, learning_rates):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def expected_shapes(pieces: list[Piece], buffers: dict[str, torch.Tensor],
                    aliases: dict[str, str]) -> dict[str, tuple[int, ...]]:
    shapes = {MODEL_PREFIX + name: tuple(buffer.shape) for name, buffer in buffers.items()}
    for piece in pieces:
        shapes[MODEL_PREFIX + piece.name] = piece.shape
        shapes |= {f"{OPTIMIZER_PREFIX}{piece.name}.{key}": () if key == "step" else piece.shape
                   for key in ADAMW_STATE}
    return shapes | {MODEL_PREFIX + alias: shapes[MODEL_PREFIX + name] for alias, name in aliases.items()}


@torch.no_grad()
def load_into_shards(source: FileSource, module: Module, optimizer: Any, pieces: list[Piece], where: str) -> None:
    """Read every piece of the weights and AdamW's moments, and the step count, from a full checkpoint file."""
    buffers = persistent_buffers(module)
    check_fits(source.shapes(), expected_shapes(pieces, buffers, tied_aliases(module)), where)
    optimizer = raw_optimizer(optimizer)
    initialise_adamw_state(optimizer)
    for name, buffer in buffers.items():
        source.read_elements_into(MODEL_PREFIX + name, 0, buffer)
    for piece in pieces:
        state = optimizer.state[piece.parameter]
        source.read_elements_into(f"{OPTIMIZER_PREFIX}{piece.name}.step", 0, state["step"])
        if not piece.parameter.numel() or prod(piece.shape) == 0:
            continue
        source.read_elements_into(MODEL_PREFIX + piece.name, piece.start, piece.parameter.data)
        for key in ("exp_avg", "exp_avg_sq"):
            source.read_elements_into(f"{OPTIMIZER_PREFIX}{piece.name}.{key}", piece.start, state[key])
