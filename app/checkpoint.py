"""Checkpoints: one `state` dict saved with fabric.save under a name carrying the step, made visible atomically.

A checkpoint is `<out_dir>/checkpoints/step-00000016.ckpt`: a file with --state_dict_type full (model weights under
their Hugging Face names, gathered on rank 0), a folder of shards with --state_dict_type sharded. It is written
under a hidden temporary name in the same folder and renamed once complete, so a crash at any moment leaves
either the previous checkpoints or the new one, never a partial file that resume would take; the next save removes
what an interrupted one left behind.

After publishing, rank 0 records the checkpoint with the lowest validation loss in `checkpoints/best.json` (only
checkpoints evaluated at their own step compete) and, with --keep_last_n, deletes older checkpoints except that
best one and the one the run resumed from.
"""

from __future__ import annotations

import json
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
LEFTOVER_NAME = re.compile(r"^\.step-\d+\.ckpt\.(partial|replaced)$")
BEST_FILE = "best.json"


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


def remove_leftovers(folder: Path) -> None:
    """Delete what interrupted saves left behind (hidden `.partial` / `.replaced` names, never a checkpoint)."""
    for path in folder.iterdir() if folder.is_dir() else ():
        if LEFTOVER_NAME.match(path.name):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def read_best(out_dir: str | Path) -> Optional[dict[str, Any]]:
    """`{"checkpoint": "step-00000016.ckpt", "step": 16, "val_loss": 2.31}`, or None when nothing was marked yet."""
    path = checkpoint_dir(out_dir) / BEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def mark_if_best(path: Path, step: int, val_loss: float) -> None:
    """Point best.json at `path` when its validation loss beats the marked one (written atomically)."""
    best = read_best(path.parent.parent)
    if best is not None and (path.parent / best["checkpoint"]).exists() and best["val_loss"] <= val_loss:
        return
    temporary = path.parent / f".{BEST_FILE}.partial"
    temporary.write_text(json.dumps({"checkpoint": path.name, "step": step, "val_loss": val_loss}) + "\n")
    os.replace(temporary, path.parent / BEST_FILE)


def prune_checkpoints(out_dir: str | Path, keep_last_n: Optional[int], protected: set[Path]) -> list[Path]:
    """Delete all but the newest `keep_last_n` checkpoints, never the best one nor those in `protected`."""
    if keep_last_n is None:
        return []
    checkpoints = list_checkpoints(out_dir)
    best = read_best(out_dir)
    keep = {path.resolve() for path in protected} | {checkpoints[step].resolve() for step in sorted(checkpoints)[-keep_last_n:]}
    if best is not None:
        keep.add((checkpoint_dir(out_dir) / best["checkpoint"]).resolve())
    deleted = [path for step, path in sorted(checkpoints.items()) if path.resolve() not in keep]
    for path in deleted:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return deleted


def save_checkpoint(fabric: Fabric, path: Path, state: dict[str, Any]) -> None:
    """fabric.save to a temporary name beside `path`, then an atomic rename on rank 0. Collective: all ranks call it."""
    temporary = path.with_name(f".{path.name}.partial")
    if fabric.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(path.parent)
    fabric.barrier()
    fabric.save(temporary, state)
    fabric.barrier()
    if fabric.is_global_zero:
        _make_durable(temporary)
        _publish(temporary, path)
    fabric.barrier()


def read_checkpoint_metadata(path: Path) -> dict[str, Any]:
    """The checkpoint's contents, read safely (weights_only: tensors and plain data only, no code runs) and lazily
    (mmap: no weights are read); of a sharded folder, its `meta.pt`. Raises on unreadable or unsafe files."""
    if path.is_dir():
        return torch.load(path / "meta.pt", weights_only=True)
    return torch.load(path, weights_only=True, mmap=True, map_location="cpu")


def load_checkpoint(fabric: Fabric, path: Path, state: dict[str, Any]) -> None:
    """Restore `state` in place (model, optimizer, counters), this rank's random generators and the gradient scaler.

    Lightning reads full checkpoint files with an unrestricted unpickler, so every rank first reads the file with
    weights_only=True, which refuses anything but tensors and plain data before Lightning's loader sees it.
    """
    read_checkpoint_metadata(path)
    fabric.load(path, state)
    restore_rng(state["rng"][fabric.global_rank])
    if state.get("grad_scaler"):
        fabric.strategy.precision.load_state_dict(state["grad_scaler"])
