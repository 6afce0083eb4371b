"""How a CPU process's heap returns freed tensors to the system.

glibc serves a block of at least its mmap threshold with its own mapping, unmapped when freed; smaller blocks come
from the heap, whose freed space stays resident. The threshold starts at 128 KB and rises to the size of each mapped
block freed, up to 32 MB. Training frees and reallocates tensors of a few MB at every step (FSDP2 gathers, and
reduces gradients, parameter by parameter), so after a few steps they all come from the heap, and a rank's peak RSS
holds freed space (a fixed threshold took the 170M model's peak from 2.8 to 2.2 GB under fsdp2, 2.4 to 2.3 under
fsdp: docs/performance.md). On GPUs tensors live in CUDA's allocator, so GPU runs keep glibc's default.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number in glibc's malloc.h."""

CPU_TENSOR_MMAP_THRESHOLD = 4 * 2**20
"""Blocks of 4 MB and more are mapped: the 170M model's parameters and their gradients (4-16 MB), while smaller
activations keep coming from the heap, fast (a 1 MB threshold made steps 22% slower: every block mapped is faulted
in afresh)."""


def map_large_cpu_tensors(threshold: int = CPU_TENSOR_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold unless the user set MALLOC_MMAP_THRESHOLD_; False where the C library is not glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, threshold))
