"""How a CPU process's heap returns freed tensors to the system, and how much of its free space it keeps for reuse.

glibc serves a block of at least its mmap threshold with its own mapping, unmapped when freed; smaller blocks come
from the heap, whose freed space stays resident except at its top: free space there beyond the trim threshold is
given back, and faulted in again page by page when the heap grows.

By default both thresholds move: the mmap threshold starts at 128 KB and rises to the size of each mapped block
freed, up to 32 MB, and the trim threshold follows at twice it. Training frees and reallocates tensors of a few MB
at every step (FSDP2 gathers, and reduces gradients, parameter by parameter), so after a few steps they all came from
the heap and a rank's peak RSS held freed space. On CPU processes both are therefore fixed (docs/performance.md):
- the mmap threshold at 4 MB: the 170M model's peak went from 2.8 to 2.2 GB under fsdp2, 2.4 to 2.3 under fsdp;
- the trim threshold at 64 MB: fixing one turns off the other's rise, and at its 128 KB start every heap gave back
  its top after each step and faulted it in at the next (4,400-7,300 page faults per step on `configs/demo-llama`).

A setting in the environment (which glibc reads itself) is kept. On GPUs tensors live in CUDA's allocator, so GPU
runs keep glibc's default.
"""

from __future__ import annotations

import ctypes
import os

CPU_HEAP_SETTINGS = {
    # environment variable: (mallopt's parameter number in glibc's malloc.h, value)
    "MALLOC_MMAP_THRESHOLD_": (-3, 4 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": (-1, 64 * 2**20),
}
"""Blocks of 4 MB and more are mapped: the 170M model's parameters and their gradients (4-16 MB), while smaller
activations keep coming from the heap, fast (a 1 MB threshold made steps 22% slower: every block mapped is faulted
in afresh). Up to 64 MB free at a heap's top stays for the next step: at 8 MB a third of the faults remained."""


def tune_cpu_heap() -> list[str]:
    """Apply every setting the user did not make in the environment; the names of those applied ([] where the C
    library is not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return []
    return [name for name, (parameter, value) in CPU_HEAP_SETTINGS.items()
            if name not in os.environ and mallopt(parameter, value)]
