"""Checkpoints written by earlier versions (Lightning's `fabric.save`), read into today's form so that runs resume.

Full checkpoints were torch.save files (a zip archive): `model`, `optimizer` (FSDP's state dict keyed by parameter
name; DDP's and one device's numbered in the optimizer's parameter order), counters, and the random state of every
rank with torch tensors. Sharded ones were DCP folders with the same tensor names as today and `meta.pt`. Their
`position` counted micro-batches per rank; today it counts samples of the epoch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from app.checkpoint.rng import encode_generator_state
from app.checkpoint.state import MODEL_PREFIX, OPTIMIZER_PREFIX

SHARDED_METADATA = "meta.pt"


def is_torch_save_file(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(2) == b"PK"


def load_torch_save(path: Path) -> dict[str, Any]:
    """The whole file, memory-mapped and read safely (weights_only: tensors and plain data, no code runs)."""
    return torch.load(path, weights_only=True, mmap=True, map_location="cpu")


def load_sharded_metadata(folder: Path) -> dict[str, Any]:
    return torch.load(folder / SHARDED_METADATA, weights_only=True)


def _encoded_rng(state: dict[str, Any]) -> dict[str, Any]:
    converted = dict(state)
    for device in ("torch", "cuda"):
        if device in converted:
            converted[device] = encode_generator_state(converted[device])
    return converted


def metadata(saved: dict[str, Any]) -> dict[str, Any]:
    """Today's metadata from an earlier checkpoint's: random states as JSON data, the position in samples."""
    config = saved.get("config") or {}
    world_size = len(saved.get("rng") or []) or 1
    micro_batch_size = config.get("micro_batch_size", 1)
    global_batch_size = config.get("global_batch_size") or (
        micro_batch_size * world_size * (config.get("gradient_accumulation_steps") or 1))
    tensors = ("model", "optimizer")
    return {key: value for key, value in saved.items() if key not in tensors} | {
        "rng": [_encoded_rng(state) for state in saved.get("rng") or []],
        "position": saved.get("position", 0) * micro_batch_size * world_size,
        "global_batch_size": global_batch_size,
        "grad_scaler": saved.get("grad_scaler") or {},
    }


def tensors(saved: dict[str, Any], parameter_order: Optional[list[str]]) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors under today's names; numbered optimizer entries (DDP, one device) are named
    by `parameter_order`, the order in which the optimizer lists its parameters (without it, they are left out)."""
    flat = {MODEL_PREFIX + name: tensor for name, tensor in saved["model"].items()}
    for key, values in (saved.get("optimizer") or {}).get("state", {}).items():
        if isinstance(key, int) and parameter_order is None:
            continue
        parameter = parameter_order[key] if isinstance(key, int) else key
        flat |= {f"{OPTIMIZER_PREFIX}{parameter}.{name}": value for name, value in values.items()
                 if isinstance(value, torch.Tensor)}
    return flat
