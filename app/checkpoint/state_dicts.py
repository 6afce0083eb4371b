"""This rank's part of a checkpoint for every strategy: FSDP's flat shards where it has them, else torch's state dicts.

torch.distributed.checkpoint's state-dict API gives the model's and AdamW's tensors under the Hugging Face names
(state.py) for any wrapping: under FSDP2 as DTensors whose local shards are the parameters' own rows, under DDP and on
one device as the tensors themselves. Their values share memory with what training uses, so their pieces are read
into in place too. FSDP1's sharded state dict is not a view (it gathers and re-cuts every unit): FSDP1 takes its flat
shards instead (fsdp_shards.py).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.nn import Module

from app.checkpoint.fsdp_shards import flat_shard_state
from app.checkpoint.state import (MODEL_PREFIX, OPTIMIZER_PREFIX, LocalState, initialise_optimizer_state, part_of,
                                  raw_optimizer)
from app.model.build import strategy_module

SHARDED = StateDictOptions(full_state_dict=False)


def local_state(model: Module, optimizer: Any) -> LocalState:
    """This rank's part of everything a checkpoint of `model` and `optimizer` holds, as views of their tensors."""
    module, optimizer = strategy_module(model), raw_optimizer(optimizer)
    flat = flat_shard_state(module, optimizer)
    if flat is not None:
        return flat
    initialise_optimizer_state(optimizer)
    model_state, optimizer_state = get_state_dict(module, optimizer, options=SHARDED)
    parts = {MODEL_PREFIX + name: part_of(value) for name, value in model_state.items()}
    for parameter, values in optimizer_state["state"].items():
        parts |= {f"{OPTIMIZER_PREFIX}{parameter}.{key}": part_of(value) for key, value in values.items()}
    order = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    return LocalState(parts, order)
