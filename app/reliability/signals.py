"""Stopping a run cleanly: preemption signals, non-finite numbers, and the exit codes schedulers see.

SIGTERM (what Kubernetes, Docker and Slurm send before killing a job) and SIGUSR1 (what Slurm sends ahead of a time
limit with `#SBATCH --signal=USR1@120`) only set a flag here. The signal may reach one process (Lightning's launcher
parent, which is rank 0) or all of them (srun, torchrun, `kill -TERM -PGID`); either way the ranks learn of it at the
next optimizer-step boundary through ONE small all_reduce (sum) that also carries the non-finite check of the step's
loss and the gradient norm (app/optimization/optimizer.py). That is one host synchronisation per optimizer step, never
per micro-batch. Every rank then finishes the step, saves a checkpoint together with the others, and exits.

Ctrl-C (SIGINT, which a terminal sends to every process of the run): the first one during training stops the same
way, and rank 0 says so; a second one, or one before the first step (nothing to save yet), quits at once.

Exit codes: app/exit_codes.py (75 after a preemption save, 130 after Ctrl-C, 3 after non-finite numbers).
"""

from __future__ import annotations

import atexit
import gc
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from contextlib import suppress
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Callable, NoReturn, Optional

import torch
import torch.distributed as dist

from app.cli import first_line
from app.stopping import exhausted, exhausted_reason, out_of_memory, wrapped
from app.exit_codes import (EXIT_CRASHED, EXIT_ENDED_BY_SRUN, EXIT_FINISHED, EXIT_INTERRUPTED, EXIT_PREEMPTED,
                            EXIT_STALLED)
from app.tasks import FIRST_REPORTS_S, end_with_the_launcher, srun_task, task_rank, time_limit_warned
from app.reliability.watchdog import (TRAINING_BEGAN, end_process_tree, print_own_stacks, process_ending,
                                      run_exit_hooks, say, silent_end)

if TYPE_CHECKING:
    from lightning_fabric import Fabric

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
INTERRUPT_MESSAGE = "Ctrl-C: stopping after this step and saving a checkpoint; press Ctrl-C again to quit at once"


def _leave_to_the_thread(signum: int, frame: Optional[FrameType]) -> None:
    """A Python-level handler that does nothing: it keeps Python's C-level handler, which feeds the wakeup pipe."""


_OUR_WRITE_ENDS: set[int] = set()


def signals_to_a_pipe() -> int:
    """Route SIGTERM, SIGUSR1 and SIGINT to a new pipe and return its read end, for a thread to act on them (see
    StopRequest). A pipe of ours that this replaces is closed, so that the thread reading it ends."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    replaced = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for handled in (*STOP_SIGNALS, signal.SIGINT):
        signal.signal(handled, _leave_to_the_thread)
    if replaced in _OUR_WRITE_ENDS:
        _OUR_WRITE_ENDS.discard(replaced)
        os.close(replaced)
    _OUR_WRITE_ENDS.add(write_end)
    return read_end


def end_ranks_on_signal_until_training(requeue_on_signal: bool) -> None:
    """Until StopRequest takes over on the ranks, a stop signal or Ctrl-C ends this process and every process it
    started (exit 128 + the signal's number; an srun task that SIGTERM ends exits EXIT_ENDED_BY_SRUN: tasks.py).
    SIGUSR1, Slurm's warning before a time limit, ends it with EXIT_PREEMPTED as after a save, since nothing was
    trained since the latest checkpoint, and requeues the job under --requeue_on_signal true; also when the warning
    came earlier, while the interpreter started (app/tasks.py remember_a_time_limit_warning).

    The launching process waits in the rendezvous while the ranks it started import and check their inputs. A
    signal sent to it alone (`kill PID`, GNU timeout, a supervisor) would end it by default and leave those ranks
    waiting for it until --rendezvous_timeout_min, holding their devices; and Python's own handlers never run while
    the main thread waits there."""
    read_end = signals_to_a_pipe()

    def end_on_first_signal() -> None:
        received = os.read(read_end, 1)
        if received:
            reports = (task_rank() if srun_task() else int(os.environ.get("LOCAL_RANK") or 0)) == 0  # on each node
            signum = after_the_first_task(received[0], read_end)
            if not TRAINING_BEGAN.is_set():
                quit_before_training(signum, requeue_on_signal, reports=reports)
            signal.raise_signal(signum)  # training began meanwhile: to StopRequest, which stops at a step boundary
        os.close(read_end)  # StopRequest took over

    threading.Thread(target=end_on_first_signal, name="start-up-signals", daemon=True).start()
    if time_limit_warned():
        signal.raise_signal(signal.SIGUSR1)  # to that thread, through the pipe


def first_of_the_run() -> bool:
    """Whether this is the run's first process, the one that requeues its job: its first rank where a launcher started
    each rank (srun's tasks, torchrun's workers, numbered in SLURM_PROCID or RANK), else the launching process of the
    first node (Lightning's launcher: LOCAL_RANK and NODE_RANK 0). Under torchrun each node's first worker requeued
    the job."""
    if srun_task() or "RANK" in os.environ:
        return task_rank() == 0
    return int(os.environ.get("LOCAL_RANK") or 0) == 0 and int(os.environ.get("NODE_RANK") or 0) == 0


def after_the_first_task(signum: int, read_end: int, pending: bytes = b"") -> int:
    """The signal to quit on before training. An srun task other than the first, warned of the time limit, waits
    for the first task to say so and requeue the job, and for srun to end it then (its SIGTERM, or a Ctrl-C, read
    from the pipe after the signals already read, `pending`): quitting at once, it let srun end the first task before
    it had said anything or requeued, and the job FAILED with 75, unsaid. Another SIGUSR1 (`scancel --full`) does not
    end the wait; after FIRST_REPORTS_S without an end, it quits as warned."""
    if signum != signal.SIGUSR1 or not srun_task() or task_rank() == 0:
        return signum
    ending = (signal.SIGTERM, signal.SIGINT)
    deadline = time.monotonic() + FIRST_REPORTS_S
    while not any(byte in ending for byte in pending) and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([read_end], [], [], left)
        pending = os.read(read_end, 64) if ready else b""
        if not pending:  # waited long enough, or the pipe was closed (StopRequest took over)
            break
    return next((byte for byte in pending if byte in ending), signum)


def quit_before_training(signum: int, requeue_on_signal: bool, reports: bool) -> NoReturn:
    """End this process and those it started at once: a signal before the first optimizer step finds nothing to save
    since the latest checkpoint. Loading a large model, then a step and a save, could outlast the grace before Slurm's
    SIGKILL (30 s of KillWait after a preemption's SIGTERM, 120 s after `--signal=USR1@120`), and a job killed at
    its time limit is not requeued. SIGUSR1 ends as a stop after a save would (EXIT_PREEMPTED), requeueing the
    job under --requeue_on_signal true; `reports` in the process that tells the user (on each node), the run's first
    process also requeues."""
    if signum == signal.SIGUSR1:
        code = EXIT_PREEMPTED
        outcome = f"nothing new to save (exit {code}); {how_to_continue(requeue_on_signal, signum)}"
    else:
        code = EXIT_ENDED_BY_SRUN if signum == signal.SIGTERM and srun_task() else 128 + signum
        outcome = f"nothing to save yet, quitting (exit {code})"
    if reports:
        say(f"{signal.Signals(signum).name} before training began: {outcome}\n")
        if requeues_itself(requeue_on_signal, signum) and first_of_the_run():
            requeue_slurm_job()
    end_process_tree(code, stacks=False)


class StopRequest:
    """Remembers the first stop signal this process received, and quits at once on Ctrl-C when that is due.

    Python runs signal handlers in the main thread only, between bytecodes, which never comes while that thread
    waits in a collective or the rendezvous. So Python's C-level handler only writes the signal's number to a pipe
    (signal.set_wakeup_fd) and a daemon thread reads it and acts at once. Quitting kills the processes this one started
    (its data loader workers; in the launching process also the other ranks) and leaves with os._exit(130): no rank
    prints a KeyboardInterrupt or gloo traceback.
    """

    def __init__(self, requeue_on_signal: bool = False) -> None:
        self.signal: Optional[int] = None
        self.interrupted = False
        self.training = False
        self.announce = False
        self.requeue_on_signal = requeue_on_signal

    def install(self, announce: bool = False) -> None:
        """Take over SIGTERM, SIGUSR1 and SIGINT; `announce` in the one process that tells the user about Ctrl-C."""
        self.announce = announce
        read_end = signals_to_a_pipe()
        if time_limit_warned():  # while this process started, on one device (end_ranks_on_signal_until_training)
            signal.raise_signal(signal.SIGUSR1)  # to the thread below, through the pipe
        # blocked while the ranks started (app/training/run.py)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        threading.Thread(target=self._receive, args=(read_end,), name="stop-signals", daemon=True).start()

    def begin_training(self, fabric: Fabric) -> None:
        """From the first optimizer step on, a stop signal stops at a step boundary with a checkpoint (before it, it
        quits at once), and a rank whose launcher dies says so (app/tasks.py end_with_the_launcher). The ranks cross
        that line together (one all_reduce): a signal to every rank found some on either side of it after a skew
        (loading, the initial validation), and those that had quit left the others waiting for them in the first
        step, without a checkpoint or the job's requeue."""
        stop_agreed(fabric, self)
        self.training = True
        TRAINING_BEGAN.set()
        end_with_the_launcher(end=False)

    def _receive(self, read_end: int) -> None:
        while received := os.read(read_end, 64):
            for k, signum in enumerate(received):
                if signum in STOP_SIGNALS and not self.training:
                    signum = after_the_first_task(signum, read_end, received[k + 1:])
                    if not self.training:  # else training began meanwhile: it stops at a step boundary
                        quit_before_training(signum, self.requeue_on_signal, reports=self.announce)
                if signum in STOP_SIGNALS:
                    self.signal = self.signal or signum
                elif signum == signal.SIGINT:
                    self._interrupt()

    def _interrupt(self) -> None:
        if not self.interrupted and not self.training and self.announce:  # else the Ctrl-C went without a word
            say(f"\nCtrl-C before the first step: nothing to save yet, quitting (exit {EXIT_INTERRUPTED})\n")
        if self.interrupted or not self.training:
            end_process_tree(EXIT_INTERRUPTED, stacks=False)
        self.interrupted = True
        self.signal = self.signal or signal.SIGINT
        if self.announce:
            say(f"\n{INTERRUPT_MESSAGE}\n")

    @property
    def requested(self) -> bool:
        return self.signal is not None


@dataclass(frozen=True)
class StepVerdict:
    """What all ranks agreed on at one optimizer-step boundary."""

    stop_requested: bool
    save_failed: bool
    """A rank's background checkpoint write has failed (app/checkpoint/failures.py)."""
    non_finite: bool
    grad_norm: torch.Tensor
    """The norm of the whole gradient in fp32, on the device (for clipping)."""
    loss: float
    """The step's loss over all ranks (the mean of the ranks' parts), the same number on every rank."""
    grad_norm_value: float
    """`grad_norm` on the host: these two are what the spike guard judges (spikes.py), on every rank alike."""
    non_finite_ranks: int = 0
    """How many ranks' parts of the loss were not finite."""


def all_reduce_sum(fabric: Fabric, tensor: torch.Tensor) -> torch.Tensor:
    """torch.distributed's all_reduce alone on CPU and CUDA: Lightning's `fabric.all_reduce` puts a barrier before
    it, a second collective on every step. XLA devices keep Lightning's."""
    if fabric.world_size == 1:
        return tensor
    if fabric.device.type not in ("cpu", "cuda"):
        return fabric.all_reduce(tensor, reduce_op="sum")
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def step_verdict(fabric: Fabric, loss: torch.Tensor, grad_square_sum: torch.Tensor, stop: StopRequest, *,
                 replicas: int, scaled: bool, save_failed: bool = False) -> StepVerdict:
    """ONE all_reduce (sum) of [this rank's squared gradient norm, it saw a stop signal, its loss is not finite,
    its part of the loss, its background save failed].

    The loss is the sum over the step's micro-batches, so a NaN in any of them shows here without a sync per
    micro-batch; the `.tolist()` is the step's single device-to-host synchronisation, and brings the step's loss
    and gradient norm to every rank's host with the flags. Non-finite gradients stop the run, except under a
    gradient scaler (16-mixed), which skips such steps and lowers its scale by design.
    """
    device = grad_square_sum.device
    local = torch.stack([grad_square_sum.float(), torch.tensor(float(stop.requested), device=device),
                         (~torch.isfinite(loss)).float().to(device), loss.float().to(device),
                         torch.tensor(float(save_failed), device=device)])
    totals = all_reduce_sum(fabric, local)
    grad_norm = (totals[0] / replicas).sqrt()
    on_host = torch.stack([totals[1], totals[2], (~torch.isfinite(grad_norm)).float(), totals[3] / fabric.world_size,
                           grad_norm, totals[4]])
    stop_requested, bad_loss, bad_gradient, step_loss, norm, failed_saves = on_host.tolist()
    return StepVerdict(stop_requested=stop_requested > 0, save_failed=failed_saves > 0,
                       non_finite=bad_loss > 0 or (bad_gradient > 0 and not scaled),
                       grad_norm=grad_norm, loss=step_loss, grad_norm_value=norm, non_finite_ranks=round(bad_loss))


def stop_agreed(fabric: Fabric, stop: StopRequest) -> bool:
    """Whether a rank has seen a stop signal since the step's verdict: one all_reduce, after an evaluation or a save
    (minutes, with generation samples or a large model), so that a signal during them stops there, with this step's
    checkpoint, rather than after one more step and one more save (96 s after a SIGTERM: past Docker's 10 s and
    Kubernetes' 30 s of grace)."""
    flag = torch.tensor([float(stop.requested)], device=fabric.device)
    return all_reduce_sum(fabric, flag).item() > 0


def requeues_itself(requeue_on_signal: bool, signum: Optional[int]) -> bool:
    """Whether the stopped run puts its Slurm job back in the queue: only after SIGUSR1, Slurm's warning before a time
    limit (`#SBATCH --signal=USR1@120`). SIGTERM comes from `scancel` (the user wants the job gone) or from a
    preemption that Slurm requeues itself (`--requeue`): requeueing then would undo a cancel or fail."""
    return requeue_on_signal and signum == signal.SIGUSR1 and "SLURM_JOB_ID" in os.environ


def how_to_continue(requeue_on_signal: bool, signum: Optional[int]) -> str:
    """What the user reads after a stop with a checkpoint."""
    if requeues_itself(requeue_on_signal, signum):
        return "requeueing the Slurm job, which resumes from its latest checkpoint"
    if signum == signal.SIGUSR1 and "SLURM_JOB_ID" in os.environ:
        return ("continue with --resume true (submit the same sbatch command again), or pass --requeue_on_signal true "
                "so that the job requeues itself")
    return "continue with --resume true"


REQUEUE_IGNORING_SIGTERM = 'trap "" TERM; exec scontrol requeue "$1"'
"""scontrol with SIGTERM ignored (kept across exec): it runs inside the job's step, and the requeue it asks for makes
Slurm send SIGTERM to every process of the step, itself included. On a loaded node that signal could reach it
before the controller's answer did: once in CI the run reported a requeue that failed, with no word from scontrol, for
a job that Slurm had requeued."""


def requeue_slurm_job() -> None:
    """`scontrol requeue $SLURM_JOB_ID`: Slurm puts the job back in the queue; its next start resumes
    (--resume true)."""
    job_id = os.environ["SLURM_JOB_ID"]
    result = subprocess.run(["sh", "-c", REQUEUE_IGNORING_SIGTERM, "sh", job_id], capture_output=True, text=True)
    print(f"Slurm job {job_id} {requeue_outcome(result)}", flush=True)


def requeue_outcome(result: subprocess.CompletedProcess[str]) -> str:
    if result.returncode == 0:
        return "requeued"
    said = (result.stderr.strip() or result.stdout.strip()).replace("\n", "; ")
    how = (f"killed by {signal.Signals(-result.returncode).name}" if result.returncode < 0
           else f"exit {result.returncode}")
    return f"requeue failed (scontrol {how}){': ' + said if said else ''}"


def run_and_exit(fabric: Fabric, work: Callable[..., int], *args: object) -> NoReturn:
    """`work(fabric, *args)`, then `exit_run` with the exit code it returns, once what it made is released. Its
    models hold the process groups (DDP's reducer, FSDP's units): released here, while the groups are still
    registered, they leave the groups' destruction, which joins gloo's threads, to exit_run's bounded teardown. A
    finished run whose model outlived the teardown hung for good in that join as the launcher's frames unwound
    (once in about 150 runs here).

    An exception ends this rank's processes at once, after its traceback: from the launching process the ranks that
    Lightning's launcher started would otherwise stay in their next collective until the process group timeout
    (NCCL notices no dead peer), and its observer of those ranks is a daemon thread that dies with the interpreter."""
    try:
        code = work(fabric, *args)
    except Exception as error:
        if process_ending():  # this process's watchdog or signal thread is ending the run: its line says why
            end_process_tree(EXIT_CRASHED, stacks=False)  # waits for that exit, with that thread's code
        if said := one_line_for(error, getattr(fabric, "global_rank", 0)):  # (the tests pass no fabric)
            say(f"{said}\n")
            end_process_tree(EXIT_CRASHED, stacks=False)
        if peer_ended(error):  # the process that ended first printed why; a traceback here would only hide it
            ended = silent_children(fabric)
            say(f"rank {fabric.global_rank}: another process of the run ended first ({first_line(error)})"
                + "".join(f"; {line}" for line, _ in ended) + "\n")
            if ended:
                end_process_tree(ended[0][1], stacks=False)
        elif collective_timed_out(error):  # a rank stopped answering where the stall watchdog does not watch yet
            say(f"rank {fabric.global_rank}: another rank did not answer within --process_group_timeout_min "
                f"({first_line(error)}); ending the run as stalled (exit {EXIT_STALLED}): resume with --resume true\n")
            end_process_tree(EXIT_STALLED, stacks=False)
        else:
            traceback.print_exc()
            sys.stderr.flush()
        end_process_tree(EXIT_CRASHED, stacks=False)
    gc.collect()  # the model, if reference cycles hold it
    exit_run(fabric, code)


def silent_children(fabric: Fabric, wait_sec: float = 1.0) -> list[tuple[str, int]]:
    """The ranks that Lightning's launcher started from this process and that ended without a word (watchdog.
    silent_end), said, with the run's exit code for each: the others' only line was a connection reset by peer."""
    children = getattr(getattr(fabric.strategy, "launcher", None), "procs", None) or []
    deadline = time.monotonic() + wait_sec
    while children and all(child.poll() is None for child in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [ending for rank, child in enumerate(children, start=1) if (ending := silent_end(rank, child))]


PEER_ENDED = ("Connection closed by peer", "Connection reset by peer",  # gloo
              "remote process exited or there was a network error")  # NCCL's ncclRemoteError


COLLECTIVE_TIMEOUTS = ("Timed out waiting",  # gloo: "Timed out waiting 1800000ms for recv operation to complete"
                       "Application timeout caused pair closure")  # gloo, at the collectives after that one


def collective_timed_out(error: Exception) -> bool:
    """Whether `error` is a collective that waited --process_group_timeout_min for a rank that never came: a rank
    frozen between the rendezvous and the first step (a hung filesystem while loading, a stopped process), before the
    stall watchdog is armed. It was a traceback and exit 1, which the Slurm scripts do not requeue; as a stall it is
    exit 4, requeued. (NCCL's own watchdog ends such a process itself, with SIGABRT.)"""
    return any(text in str(error) for text in COLLECTIVE_TIMEOUTS)


LOADER_WORKER_KILLED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (exited unexpectedly|is killed by "
                                  r"signal: Killed\.?)")
"""torch's error when a data loader worker was killed, as the out-of-memory killer's usual victim is (a 55-line
traceback that never said SIGKILL); a worker that crashed otherwise (a bus error, an exit code) keeps its traceback."""


def crashed_otherwise(error: BaseException) -> bool:
    """Whether what `error` wraps says a worker died of another signal than SIGKILL ("exited unexpectedly" may wrap
    "killed by signal: Bus error", a /dev/shm too small, whose advice the traceback keeps)."""
    return any("killed by signal:" in str(seen) and "killed by signal: Killed" not in str(seen)
               for seen in wrapped(error))


def one_line_for(error: Exception, rank: int) -> Optional[str]:
    """What a rank says, in one line, of an exception whose traceback helps no one: running out of memory (CUDA's or
    the host's: 45 lines on every rank, no advice), a data loader worker killed, a limit on threads or open files."""
    if out_of_memory(error):  # where it happened matters less than what to change
        return (f"rank {rank}: out of memory ({first_line(error).split(' If reserved')[0]}): lower --micro_batch_size "
                "(the global batch stays, through more accumulation) or --eval_batch_size, or add "
                "--gradient_checkpointing true; --estimate_memory true plans what a run needs")
    if (worker := LOADER_WORKER_KILLED.fullmatch(str(error).strip())) and not crashed_otherwise(error):
        how = "was killed by SIGKILL" if "Killed" in worker.group(2) else "exited unexpectedly"
        return (f"rank {rank}: a data loader worker (pid {worker.group(1).strip()}) {how}, as the out-of-memory "
                "killer ends one (see `dmesg`): lower --num_workers or --micro_batch_size")
    if (cause := exhausted(error)) is not None:
        return f"rank {rank}: {exhausted_reason(cause, '--num_workers', writes_to='a folder of the run')}"
    return None


def peer_ended(error: Exception) -> bool:
    """Whether `error` is a collective failing because another rank's process went away."""
    return any(text in str(error) for text in PEER_ENDED)


def exit_run(fabric: Fabric, code: int) -> NoReturn:
    """Leave with `code` from the launching process of each node and with 0 from the other ranks.
    The ranks meet, then destroy the process groups before the interpreter exits: gloo's threads still holding work
    at interpreter shutdown can abort the process (SIGABRT, "terminate called without an active exception"), seen
    once in about 40 runs here. Destroying them can itself hang, rarely (pytorch/pytorch#75097; once in about 150 CI
    runs here): after a minute the rank prints where it is and leaves. The meeting is bounded the same way."""

    def meet_and_disconnect() -> None:
        fabric.barrier()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    own_code = code if fabric.local_rank == 0 else EXIT_FINISHED
    run_or_leave(meet_and_disconnect, TEARDOWN_SEC, own_code)
    run_exit_hooks(own_code, None)  # rank 0's W&B run: its last uploads are waited for, as its exit handler did
    leave(own_code)


def leave(code: int) -> NoReturn:
    """Exit as the interpreter would, without its final teardown of every module and object, which took 1.3-1.8 s
    per process here once torch, Lightning and transformers are imported (every rank pays it at the end of a run).
    What that teardown would still do for us is done first, by the interpreter's own functions: thread pools are
    told to finish and other threads are waited for, exit handlers run (W&B's finish, logging, multiprocessing's
    children) and the standard streams are flushed. Nothing else holds buffered output: metrics.csv and every
    checkpoint are closed when written, and --tensorboard's writer by its exit hook, before this."""
    threading._shutdown()  # the interpreter's first step: thread pools told to finish, other threads waited for
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a reader that went away, as at the interpreter's own exit
            stream.flush()
    os._exit(code)


TEARDOWN_SEC = 60.0


def run_or_leave(action: Callable[[], object], timeout_sec: float, code: int) -> None:
    """`action()`, or, when it has not returned after `timeout_sec`, exit at once with `code` (the run's work is
    done and saved by then; only the teardown is stuck)."""
    finished = threading.Event()

    def run() -> None:
        try:
            action()
        finally:
            finished.set()

    threading.Thread(target=run, name="teardown", daemon=True).start()
    if not finished.wait(timeout_sec):
        sys.stdout.flush()
        say(f"{getattr(action, '__name__', 'teardown')} did not return within {timeout_sec:g} s; "
            f"exiting without it (exit {code}) from where this process was:\n")
        print_own_stacks()
        os._exit(code)
