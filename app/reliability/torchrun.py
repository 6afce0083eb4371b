"""torchrun, exiting with the exit code of the first worker that failed instead of torchrun's own 1.

slurm/train-torchrun.sbatch requeues a run that stalled (exit 4) or timed out at the rendezvous (exit 5), and only
those: torchrun reports every failed worker as 1, so the script starts `python -m app.reliability.torchrun` with
torchrun's arguments instead. A worker killed by a signal gives 128 + its number, as a shell does.

A stop signal to torchrun itself (Slurm's preemption or scancel, SIGTERM to every task; `--signal=USR1`, with
`--signals_to_handle`) is handed to the workers, which save and exit (app/reliability/signals.py); torchrun then
raises with a traceback and exits 1. Here it exits with the code train.py's workers exit with for that signal (75
after SIGTERM or SIGUSR1, 130 after SIGINT, 128 + the number otherwise), after one line, as train.sbatch's srun does.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

from app.exit_codes import EXIT_INTERRUPTED, EXIT_PREEMPTED

CODE_AFTER_SIGNAL = {signal.SIGTERM: EXIT_PREEMPTED, signal.SIGUSR1: EXIT_PREEMPTED, signal.SIGINT: EXIT_INTERRUPTED}


def first_exit_code(failure: ChildFailedError) -> int:
    _, first = failure.get_first_failure()
    return first.exitcode if first.exitcode >= 0 else 128 - first.exitcode


def code_after_signal(signum: int) -> int:
    return CODE_AFTER_SIGNAL.get(signum, 128 + signum)


if __name__ == "__main__":
    try:
        main()
    except ChildFailedError as failure:
        print(failure, file=sys.stderr)
        sys.exit(first_exit_code(failure))
    except SignalException as stopped:
        code = code_after_signal(stopped.sigval)
        print(f"torchrun: {signal.Signals(stopped.sigval).name} handed to the workers, which stopped; exit {code}",
              file=sys.stderr)
        sys.exit(code)
