"""How CUDA's caching allocator lays out a GPU run's memory.

By default it carves fixed-size segments and cannot merge the free space of two of them: the blocks that FSDP's
all-gathers and reduce-scatters allocate and free at every layer, of many sizes, leave the reserved memory well above
the allocated (fragmentation), and a run can fail with out-of-memory while gigabytes are free in pieces. With
`expandable_segments:True` a segment grows in place by mapping more pages, so freed space joins its neighbours
(PyTorch's memory notes; torchtitan and Megatron set it). Read once, when CUDA first allocates: set by each process
before its model exists, and inherited by the ranks it starts.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""torch's name for the setting, and its older CUDA-only name: a user's choice under either is kept."""
EXPANDABLE = "expandable_segments:True"


def expandable_segments(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Ask for expandable segments unless the user configured the allocator; True when set here."""
    if any(environ.get(name) for name in ALLOCATOR_VARIABLES):
        return False
    environ["PYTORCH_ALLOC_CONF"] = EXPANDABLE
    return True
