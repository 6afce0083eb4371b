"""Which process of a run this is when a launcher starts train.py whole once per device (srun's tasks under
slurm/train.sbatch, torchrun's workers, Lightning's ranks), and how such a process ends before training: so that the
launcher's exit code names the task that failed, and so that no rank outlives its launcher.

srun --kill-on-bad-exit ends a step's other tasks with SIGTERM as soon as one exits non-zero, then exits with the
highest code of all its tasks, a signal's 128 + its number included. Every task checks the same inputs, so a refused
input (2) was reported by each task, and the tasks srun ended mid-check or while their interpreter shut down outranked
it with 143; a rendezvous timeout (5), which the script requeues, became 143 the same way. So an srun task that SIGTERM
ends before training exits with EXIT_ENDED_BY_SRUN, the lowest failure code, and only the run's first task reports a
refused input (a bad command line, a bad value, the preflight's problems): the others wait for srun to end them, and
report only what the first did not find (their own node's problem) when no end comes. Imports nothing heavy:
train.py installs this before it parses its arguments.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from functools import cache
from typing import Callable, NoReturn, Optional

from app.exit_codes import EXIT_BAD_INPUT, EXIT_ENDED_BY_SRUN

LAUNCHER_PID = "FSDP_TRAINER_LAUNCHER_PID"
"""Set by the launching process for the ranks it starts: their parent, to tell that it died before they asked the
kernel to end them with it."""
PR_SET_PDEATHSIG = 1
"""prctl's option: the signal this process gets when its parent dies (linux/prctl.h)."""
FIRST_REPORTS_S = 10.0
"""How long a task other than the first waits, once its inputs were refused, for srun to end it after the first task
reported the same problems; a problem the first task did not find is reported after it."""


def srun_task() -> bool:
    """One of several tasks of an srun step, each running train.py whole (not torchrun's workers, whose torchrun
    reports the first failed worker's own code: app/reliability/torchrun.py)."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or "1"
    return "SLURM_STEP_ID" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ and int(tasks) > 1


def srun_in_interactive_job() -> bool:
    """srun's tasks in a job named `bash` or `interactive` (salloc's default name): Lightning's SLURMEnvironment
    steps aside for such jobs, so that a train.py started by hand in an allocation launches its own ranks; each of
    srun's tasks then did, and two runs met over one --out_dir (one refused, srun ended the other)."""
    return srun_task() and os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive")


def started_whole_per_device() -> bool:
    """Each device's process runs train.py whole, preflight included (srun's tasks, torchrun's workers), rather than
    one process checking the inputs and starting the others (Lightning's launcher)."""
    return srun_task() or "TORCHELASTIC_RUN_ID" in os.environ


WHOLE_NUMBER_VARIABLES = ("LOCAL_RANK", "RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                          "MASTER_PORT", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
                          "MALLOC_TRIM_THRESHOLD_")
"""Variables of the environment that train.py, Lightning or torch read as whole numbers."""


def refuse_unreadable_variables() -> None:
    """Exit with one line where a variable of WHOLE_NUMBER_VARIABLES is set to what no whole number is
    (`LOCAL_RANK=abc`, a script's typo): each ended in a ValueError traceback, in this code or in Lightning's."""
    for name in WHOLE_NUMBER_VARIABLES:
        value = os.environ.get(name)
        if value and not value.strip().isdigit():  # (exit_refused reads them: said here, by each process)
            print(f"error: {name}={value!r} is set, and is not a whole number of 0 or more; unset it, or give it one",
                  file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)


def task_rank() -> int:
    """This process's rank in the run, as its launcher numbered it (0 where no launcher did)."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def end_with_the_launcher(end: bool = True) -> None:
    """In a rank that Lightning's launcher started (LOCAL_RANK >= 1, not torchrun's), until training begins: the
    kernel ends it (SIGKILL) when the launching process dies. Killed while the ranks started (an out-of-memory kill),
    the launcher left its ranks waiting in the rendezvous until --rendezvous_timeout_min, holding their devices, and
    for ever where their stderr was a pipe that had died with it. From the first step on, a rank says in one line that
    a process of the run ended first (`end=False` lets go: app/reliability/signals.py). Linux only (prctl)."""
    launcher = int(os.environ.get(LAUNCHER_PID) or 0)
    if not sys.platform.startswith("linux") or int(os.environ.get("LOCAL_RANK") or 0) < 1 or not launcher \
            or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    import ctypes

    if not end:  # whatever was asked at the start (a rank killed at the end of a run lost its exit handlers' work)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0)
        return
    if os.getppid() != launcher:  # started through another process (the tests' fork server), or the launcher is gone
        if not alive(launcher):
            os._exit(128 + signal.SIGKILL)  # as if the signal had come
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:  # it died before this rank asked
        os._exit(128 + signal.SIGKILL)


@cache
def prctl() -> Optional[Callable[..., int]]:
    """libc's prctl (Linux), None elsewhere; looked up once, in the process that forks."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def end_with_the_parent(parent: int) -> None:
    """In a worker that the main thread of process `parent` forked for a command (prepare_data.py's --num_proc
    pool): the kernel ends it when that thread, and so the process, ends. A SIGKILL of the command (the
    out-of-memory killer's) left its workers idle for ever, each holding its memory."""
    prctl()(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before this worker asked
        os._exit(128 + signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: the pid was taken again
        return False
    return True


def end_quietly_when_srun_ends_the_task() -> None:
    """In an srun task, until the run's own signal handling takes over (app/reliability/signals.py), SIGTERM ends this
    process with EXIT_ENDED_BY_SRUN and nothing printed: srun ending the step because another task failed, which
    reported why, or a scancel, which Slurm reports."""
    if srun_task():
        signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_ENDED_BY_SRUN))


def end_by_signals_as_a_containers_first_process() -> None:
    """As a container's first process (PID 1: `docker run` without --init, a Kubernetes pod without an init), the
    kernel drops every signal left to its default action: until the run's own handlers took over, `docker stop`'s
    SIGTERM and Ctrl-C did nothing (the run went on training, and `docker stop` waited for its SIGKILL). Handlers
    that end the process as the default action would (128 + the signal) stand in; Python runs them between
    bytecodes, so not while the main thread waits in C code."""
    if os.getpid() == 1:
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(signum, lambda number, _frame: os._exit(128 + number))


_time_limit_warned = False


def remember_a_time_limit_warning() -> None:
    """Until the run's own signal handling takes over (app/reliability/signals.py), SIGUSR1, Slurm's warning before a
    time limit (`--signal=USR1@120`), is remembered rather than ending the process by its default action: the job
    then failed with 138 (128 + SIGUSR1), which the Slurm scripts do not requeue, even with --requeue_on_signal true.
    The run acts on it as soon as it knows its options (`time_limit_warned`)."""
    signal.signal(signal.SIGUSR1, _remember_the_warning)


def _remember_the_warning(signum: int, frame: object) -> None:
    global _time_limit_warned
    _time_limit_warned = True


def time_limit_warned() -> bool:
    """Whether a SIGUSR1 came before the run's own signal handling took over."""
    return _time_limit_warned


def exit_refused(lines: list[str]) -> NoReturn:
    """Exit with EXIT_BAD_INPUT after the lines of a refused input, said once for the run: by its first process,
    where every device's process checks the same inputs; another says them only if the launcher has not ended it
    within FIRST_REPORTS_S (the first process found nothing wrong: the problem is this node's own)."""
    if started_whole_per_device() and task_rank() != 0:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_BAD_INPUT))
        time.sleep(FIRST_REPORTS_S)
    sys.stderr.write("".join(f"{line}\n" for line in lines))
    sys.stderr.flush()
    sys.exit(EXIT_BAD_INPUT)


def launching_process() -> bool:
    """True in the process the user started (or local rank 0 under torchrun/srun): the one that reports. In a Slurm
    job, whose log gathers every node's output, only the run's first process: each note came once per node."""
    if (os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0") != "0":
        return False
    launched_across_nodes = "RANK" in os.environ or "SLURM_STEP_ID" in os.environ  # torchrun, or an srun step
    if os.environ.get("SLURM_JOB_ID") and launched_across_nodes:
        return (os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0") == "0"
    return True
