"""Checkpoints: one `state` dict saved with fabric.save under a name carrying the step, made visible atomically.

A checkpoint is `<out_dir>/checkpoints/step-00000016.ckpt`: a file with --state_dict_type full (model weights under
their Hugging Face names, gathered on rank 0), a folder of shards with --state_dict_type sharded. It is written
under a hidden temporary name in the same folder and renamed once complete, so a crash at any moment leaves
either the previous checkpoints or the new one, never a partial file that resume would take.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from lightning import Fabric

CHECKPOINT_NAME = re.compile(r"^step-(\d+)\.ckpt$")


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(out_dir) / f"step-{step:08d}.ckpt"


def list_checkpoints(out_dir: str | Path) -> dict[int, Path]:
    """Complete checkpoints by step number (temporary files of an interrupted save never match the name)."""
    folder = checkpoint_dir(out_dir)
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = CHECKPOINT_NAME.match(path.name)
        if match:
            found[int(match.group(1))] = path
    return found


def latest_checkpoint(out_dir: str | Path) -> Optional[Path]:
    """The checkpoint with the highest step number (by number, not by string order)."""
    checkpoints = list_checkpoints(out_dir)
    return checkpoints[max(checkpoints)] if checkpoints else None


def capture_rng() -> dict[str, Any]:
    """This process's random generators as plain data and tensors (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_of_every_rank(fabric: Fabric) -> list[dict[str, Any]]:
    """Each rank's generators, indexed by rank, so that rank 0's file can restore all of them."""
    mine = capture_rng()
    if fabric.world_size == 1:
        return [mine]
    gathered: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(gathered, mine)
    return gathered


def _make_durable(path: Path) -> None:
    """fsync the written files and their folder, so the rename below publishes data that is on disk."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _publish(temporary: Path, final: Path) -> None:
    if final.is_dir():
        stale = final.with_name(f".{final.name}.replaced")
        os.rename(final, stale)
        os.rename(temporary, final)
        shutil.rmtree(stale)
    else:
        os.replace(temporary, final)


def save_checkpoint(fabric: Fabric, path: Path, state: dict[str, Any]) -> None:
    """fabric.save to a temporary name beside `path`, then an atomic rename on rank 0. Collective: all ranks call it."""
    temporary = path.with_name(f".{path.name}.partial")
    if fabric.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        if temporary.is_dir():
            shutil.rmtree(temporary)
        temporary.unlink(missing_ok=True)
    fabric.barrier()
    fabric.save(temporary, state)
    fabric.barrier()
    if fabric.is_global_zero:
        _make_durable(temporary)
        _publish(temporary, path)
    fabric.barrier()


def load_checkpoint(fabric: Fabric, path: Path, state: dict[str, Any]) -> None:
    """Restore `state` in place (model, optimizer, counters) and this rank's random generators."""
    fabric.load(path, state)
    restore_rng(state["rng"][fabric.global_rank])
