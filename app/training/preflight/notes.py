"""The preflight's notes: said once, by the process the user started, not by every rank."""

from __future__ import annotations

import os


def launching_process() -> bool:
    """True in the process the user started (or local rank 0 under torchrun/srun): the one that reports."""
    return (os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0") == "0"


def note(message: str) -> None:
    if launching_process():
        print(message, flush=True)
