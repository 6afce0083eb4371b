"""Every rank's random generators (Python, NumPy, torch CPU and CUDA), as plain JSON data in the checkpoint.

Dropout and sampling draw from them, so a resumed run restores each rank's own. A rank the checkpoint has no
state for (the run resumes on more ranks than it was saved from) gets generators seeded from --seed, the step and
its rank: reproducible, and different on every rank.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def encode_generator_state(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def decode_generator_state(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """This process's generators as JSON-compatible data."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
             "torch": encode_generator_state(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = encode_generator_state(torch.cuda.get_rng_state())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(decode_generator_state(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(decode_generator_state(state["cuda"]))


def rng_of_every_rank(world_size: int) -> list[dict[str, Any]]:
    """Each rank's generators, indexed by rank (a collective when there are several ranks)."""
    mine = capture_rng()
    if world_size == 1:
        return [mine]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return gathered


def derived_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + rank) % 2**32


def resume_rng(saved: list[dict[str, Any]], rank: int, seed: int, step: int) -> bool:
    """Restore this rank's saved generators; seed them from (seed, step, rank) when none were saved for this rank.
    Returns whether a saved state was used."""
    if rank < len(saved):
        restore_rng(saved[rank])
        return True
    value = derived_seed(seed, step, rank)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    return False
