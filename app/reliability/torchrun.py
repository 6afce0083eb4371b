"""torchrun, exiting with the exit code of the first worker that failed instead of torchrun's own 1.

slurm/train-torchrun.sbatch requeues a run that stalled (exit 4) or timed out at the rendezvous (exit 5), and only
those: torchrun reports every failed worker as 1, so the script starts `python -m app.reliability.torchrun` with
torchrun's arguments instead. A worker killed by a signal gives 128 + its number, as a shell does. Under torchrun's c10d
rendezvous the workers start only once every node's torchrun has joined, so a node that never joins is torchrun's
own timeout (`--rdzv_conf join_timeout`, which the script sets), not --rendezvous_timeout_min: torchrun's
RendezvousTimeoutError (a 30-line traceback, exit 1, not requeued) is one line and exit 5 here.

A stop signal to torchrun itself (Slurm's preemption or scancel, SIGTERM to every task; `--signal=USR1`, with
`--signals_to_handle`) is handed to the workers, which save and exit (app/reliability/signals.py); torchrun then
raises with a traceback and exits 1. Here it exits with the code the workers exited with, after one line, as
train.sbatch's srun does: 75 after SIGTERM or SIGUSR1 when every worker saved, 130 after SIGINT; a worker that
stopped otherwise (killed while it started, before it could save; killed after --shutdown_timeout; failed) gives its
own code, so 75 never says "saved" for a run that saved nothing. torchrun keeps the workers' codes in its agent's
process context, which it closes without returning them: LocalElasticAgent._shutdown is wrapped to read them (where a
torch release lacks it, the code expected for the signal is used, and the line says so).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from typing import Any, Optional

# c10d's C++ warnings, 30 frames each, in this agent and its workers when the node that hosts the rendezvous ends
# first (its output says why); TORCH_CPP_LOG_LEVEL=WARNING set by the user brings them back
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError  # noqa: E402
from torch.distributed.run import main  # noqa: E402

from app.exit_codes import EXIT_CRASHED, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_RENDEZVOUS_TIMEOUT  # noqa: E402

CODE_AFTER_SIGNAL = {signal.SIGTERM: EXIT_PREEMPTED, signal.SIGUSR1: EXIT_PREEMPTED, signal.SIGINT: EXIT_INTERRUPTED}


def first_failure(failure: ChildFailedError) -> tuple[int, str]:
    """The first failed worker's code, and one line saying which it was (its own output said why, the refusal of
    an input included: torchrun's 25-line report said nothing more)."""
    rank, first = failure.get_first_failure()
    code = shell_code(first.exitcode)
    how = f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0 else f"exited with {code}"
    why = ("(out of memory? the kernel's out-of-memory killer sends SIGKILL, and the killed worker says nothing: "
           "see `dmesg`, or sacct's MaxRSS)" if first.exitcode == -signal.SIGKILL else "(its output above says why)")
    return code, f"torchrun: the worker of rank {rank} {how} {why}: exit {code}"


def code_after_signal(signum: int) -> int:
    return CODE_AFTER_SIGNAL.get(signum, 128 + signum)


def shell_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def exit_after_signal(signum: int, worker_codes: Optional[list[int]]) -> tuple[int, str]:
    """The wrapper's exit code after stop signal `signum` and what the line says. train.py's ranks that do not
    report exit 0 and the node's reporting one the run's code (app/reliability/signals.py exit_run): the first code
    that is neither 0 nor the one expected is a worker that did not stop as asked; else the expected one where a
    worker gave it, else 0 (the run had finished)."""
    name, expected = signal.Signals(signum).name, code_after_signal(signum)
    if worker_codes is None:
        return expected, f"{name} handed to the workers; their exit codes are unknown, exit {expected}"
    other = next((code for code in worker_codes if code not in (0, expected)), None)
    if other is not None:
        return other, f"{name} handed to the workers; one exited with {other}, not {expected}: exit {other}"
    code = expected if expected in worker_codes else 0
    return code, f"{name} handed to the workers, which stopped; exit {code}"


def join_timeout(argv: list[str]) -> str:
    """The rendezvous's join_timeout as the command line gave it (torch's default, 600 s, otherwise)."""
    found = re.search(r"join_timeout=(\d+)", " ".join(argv))
    return f"join_timeout of {found.group(1) if found else 600} s"


WORKER_CODES: list[Optional[list[int]]] = [None]
"""The workers' exit codes once the agent has closed them (read by the wrapped _shutdown)."""


def keep_worker_codes() -> None:
    shutdown = getattr(LocalElasticAgent, "_shutdown", None)
    if shutdown is None:
        return

    def shutdown_keeping_codes(agent: LocalElasticAgent, *args: Any, **kwargs: Any) -> None:
        shutdown(agent, *args, **kwargs)
        handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None) or {}
        codes = [handler.proc.poll() for _, handler in sorted(handlers.items())]
        if codes and None not in codes:
            WORKER_CODES[0] = [shell_code(code) for code in codes]

    LocalElasticAgent._shutdown = shutdown_keeping_codes


if __name__ == "__main__":
    # its lines on each worker that failed or that it ended ("failed (exitcode: 2)", "Sending process N closing signal
    # SIGTERM"): the line below says what they said
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").setLevel(logging.ERROR)
    keep_worker_codes()
    try:
        main()
    except ChildFailedError as failure:
        code, line = first_failure(failure)
        print(line, file=sys.stderr)
        sys.exit(code)
    except SignalException as stopped:
        code, line = exit_after_signal(stopped.sigval, WORKER_CODES[0])
        print(f"torchrun: {line}", file=sys.stderr)
        sys.exit(code)
    except RendezvousTimeoutError:
        print(f"torchrun: the nodes did not all join the rendezvous within its {join_timeout(sys.argv)} (--rdzv_conf "
              "join_timeout; RDZV_JOIN_TIMEOUT_SEC in slurm/train-torchrun.sbatch): a node that never started, or "
              f"another --rdzv_endpoint (exit {EXIT_RENDEZVOUS_TIMEOUT})", file=sys.stderr)
        sys.exit(EXIT_RENDEZVOUS_TIMEOUT)
    except RendezvousConnectionError:  # the node that hosts it ended (its own output says why), with a traceback
        print(f"torchrun: the rendezvous at --rdzv_endpoint stopped answering: the node that hosts it ended first (its "
              f"output says why) (exit {EXIT_CRASHED})", file=sys.stderr)
        sys.exit(EXIT_CRASHED)
