"""What a CPU process's heap does with freed tensors (app/distributed/host_memory.py).

    python tests/helpers/heap_behaviour.py default|tuned    in a fresh process, with or without tune_cpu_heap()

prints, as JSON, the settings applied, how much of 320 MB of freed 8 MB tensors stays resident, and how many page
faults a thread takes each time it allocates 32 MB of 2 MB tensors again. Imported at the end of a training run, it
shows what the run's own processes do.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import threading
from pathlib import Path

import torch

EIGHT_MB = 2 * 2**20
TWO_MB = 2**19


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def mb_retained_after_freeing() -> float:
    torch.ones(EIGHT_MB)  # freed at once: glibc raises its own threshold to the size of a mapped block freed
    before = resident_mb()
    large, small = [], []
    for _ in range(40):
        large.append(torch.ones(EIGHT_MB))
        small.append(torch.ones(1024))  # in use above each large block, so the heap cannot shrink from its top
    del large
    return resident_mb() - before


def faults_per_reallocation(repeats: int = 10) -> float:
    """A step's pattern: blocks below the mmap threshold, allocated and freed together, over and over. In a thread,
    whose heap is not the main one: there the faults show in every round, as they did in training.

    The median round: at the end of a run the thread may share an arena that other threads have filled, where an
    odd round spills into a heap of its own, which glibc unmaps once empty whatever the thresholds (a run's rank
    once measured a mean of 563 where its other rank measured 77)."""
    def allocate_and_free() -> None:
        blocks = [torch.ones(TWO_MB) for _ in range(16)]
        del blocks

    def faults_so_far() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    def measure() -> None:
        allocate_and_free()
        allocate_and_free()  # a new heap takes two rounds to reach the size it keeps
        for _ in range(repeats):
            before = faults_so_far()
            allocate_and_free()
            faults.append(faults_so_far() - before)

    faults: list[int] = []
    thread = threading.Thread(target=measure)
    thread.start()
    thread.join()
    return statistics.median(faults)


def report(applied: list[str]) -> str:
    return json.dumps({"applied": applied, "retained_mb": mb_retained_after_freeing(),
                       "faults_per_reallocation": faults_per_reallocation()})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from app.distributed.host_memory import tune_cpu_heap

    print(report(tune_cpu_heap() if sys.argv[1] == "tuned" else []))
