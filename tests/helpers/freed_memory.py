"""How much of 320 MB of freed 8 MB CPU tensors stays resident in this process (app/host_memory.py).

    python tests/helpers/freed_memory.py fixed|default    in a fresh process, with or without the fixed threshold

Imported at the end of a training run, it shows what the run's own processes do with freed memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

EIGHT_MB = 2 * 2**20


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


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from app.host_memory import map_large_cpu_tensors

    if sys.argv[1] == "fixed":
        assert map_large_cpu_tensors()
    print(mb_retained_after_freeing())
