"""Which piece of each original parameter an FSDP1 rank holds, read from FSDP's flat parameters.

FSDP (use_orig_params=True, which Lightning sets) flattens each wrapped unit's parameters into one flat tensor and
keeps a contiguous range of it on every rank. Each original parameter's `.data` is then the 1-D piece of it this
rank holds, and FSDP names the piece: elements `intra_param_start_idx` to `intra_param_end_idx` of the flattened
whole parameter (`_ShardParamInfo`). Reading and writing those pieces in place needs no all-gather: checkpoints
(app/checkpoint/fsdp_shards.py) and pretrained weights (build.py's `load_pretrained_weights`) do.

This reads FSDP's private per-unit attributes (`_handle.flat_param._params`, `_shard_param_infos`, `_fqns`,
`_shared_param_infos`), which ties it to torch==2.13 (pinned); a model without them takes the general routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn import Module

from app.optimization.optimizer import canonical_name


def flat_parameters(module: Module) -> Iterator[tuple[str, Any]]:
    """(the unit's name prefix, its flat parameter) of every FSDP unit holding original parameters."""
    for unit_name, unit in module.named_modules():
        handle = getattr(unit, "_handle", None) if isinstance(unit, FSDP) else None
        flat = handle.flat_param if handle is not None else None
        if flat is not None and flat._params is not None:
            yield canonical_name(f"{unit_name}." if unit_name else ""), flat


def parameter_pieces(module: Module) -> dict[torch.nn.Parameter, tuple[str, tuple[int, ...], int]]:
    """Every original parameter -> (its name, its whole shape, where its local piece starts in it)."""
    found = {}
    for prefix, flat in flat_parameters(module):
        for parameter, info, fqn, shape in zip(flat._params, flat._shard_param_infos, flat._fqns, flat._shapes):
            start = info.intra_param_start_idx if info.in_shard else 0
            found[parameter] = (canonical_name(prefix + fqn), tuple(shape), start)
    return found


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
