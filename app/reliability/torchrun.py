"""torchrun, exiting with the exit code of the first worker that failed instead of torchrun's own 1.

slurm/train-torchrun.sbatch requeues a run that stalled (exit 4) or timed out at the rendezvous (exit 5), and only
those: torchrun reports every failed worker as 1, so the script starts `python -m app.reliability.torchrun` with
torchrun's arguments instead. A worker killed by a signal gives 128 + its number, as a shell does.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main


def first_exit_code(failure: ChildFailedError) -> int:
    _, first = failure.get_first_failure()
    return first.exitcode if first.exitcode >= 0 else 128 - first.exitcode


if __name__ == "__main__":
    try:
        main()
    except ChildFailedError as failure:
        print(failure, file=sys.stderr)
        sys.exit(first_exit_code(failure))
