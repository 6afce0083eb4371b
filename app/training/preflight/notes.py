"""The preflight's notes: said once, by the process the user started, not by every rank."""

from __future__ import annotations

import os


def launching_process() -> bool:
    """True in the process the user started (or local rank 0 under torchrun/srun): the one that reports. In a Slurm
    job, whose log gathers every node's output, only the run's first process: each note came once per node."""
    if (os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0") != "0":
        return False
    launched_across_nodes = "RANK" in os.environ or "SLURM_STEP_ID" in os.environ  # torchrun, or an srun step
    if os.environ.get("SLURM_JOB_ID") and launched_across_nodes:
        return (os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0") == "0"
    return True


def note(message: str) -> None:
    if launching_process():
        print(message, flush=True)
