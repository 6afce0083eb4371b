"""Bounds on waiting: a stall watchdog while training, a deadline for the start-up rendezvous, stacks on demand.

A stuck collective or data loader worker waits in C code for ever (or for the process group timeout, 30 min by
default), burning the allocation. Each rank therefore runs a daemon thread that ends the run when nothing finishes
in time. It prints first: the rank's Python stacks (faulthandler writes them from C, so it works while the main
thread is blocked and holds no Python lock), then it asks every process it started for theirs (SIGUSR2), kills them
(SIGKILL: the DataLoader workers, and in the launching process also the ranks Lightning's launcher started) and
leaves with os._exit and a documented code, skipping clean-up that would wait on the hung collective.

`kill -USR2 PID` prints any rank's or worker's stacks at any time, without stopping it.
"""

from __future__ import annotations

import faulthandler
import hashlib
import multiprocessing.process
import multiprocessing.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Optional

import psutil
import torch.distributed as dist

from app.exit_codes import EXIT_CRASHED, EXIT_PREEMPTED, EXIT_RENDEZVOUS_TIMEOUT, EXIT_STALLED

STACKS_SIGNAL = signal.SIGUSR2
STACKS_WAIT_SEC = 0.3
"""How long to wait for one process to print its stacks before asking the next one (or killing it)."""
LAUNCHER_HEAD_START_SEC = 10.0
"""Ranks other than a node's launching process expire this much later. Under Lightning's own launcher the other
ranks are the launching process's children, and when a child exits first, Lightning SIGKILLs the launching process
before it can print its stacks and exit with the code; being first, it collects the children's stacks instead."""


def print_stacks_on_signal() -> None:
    """`kill -USR2 PID` prints this process's Python stacks (every thread) to its stderr."""
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)


def say(text: str) -> None:
    """Text on stderr in as few writes as the OS allows, bypassing Python's stream lock (which a hung main thread may
    hold), so that other processes writing to the same log at the same time do not split it. A stderr that is gone
    (a pipe whose reader died with the launcher: BrokenPipeError) loses the text: raised, it ended the thread that was
    to end the process after saying why, and a rank orphaned at start-up waited for ever."""
    data = text.encode()
    with suppress(OSError):
        while data:
            data = data[os.write(sys.stderr.fileno(), data):]


def print_own_stacks() -> None:
    """This process's Python stacks (every thread), gathered first and written in one piece: faulthandler itself
    writes line fragments, which interleave with another process's in a shared log."""
    with tempfile.TemporaryFile() as gathered:
        faulthandler.dump_traceback(file=gathered, all_threads=True)
        gathered.seek(0)
        say(gathered.read().decode(errors="replace"))


def collect_stacks(processes: list[psutil.Process]) -> None:
    """Ask the processes for their stacks (STACKS_SIGNAL) one at a time, for the same reason, each under a header
    (the helper processes, which keep the signal blocked, print nothing under theirs)."""
    for process in processes:
        with suppress(psutil.NoSuchProcess):
            say(f"stacks of process {process.pid} ({process.name()}: {' '.join(process.cmdline())[:100]}):\n")
        send([process], STACKS_SIGNAL)
        time.sleep(STACKS_WAIT_SEC)


EXIT_HOOKS: list[Callable[[int], object]] = []
"""Called with the exit code before this process exits (exit_run, end_process_tree): W&B's run finishes there with
the run's code. Its own exit handler recorded 0 for every run (os._exit leaves no code to read), and a crash's or a
stall's end_process_tree killed its service before the last rows were written."""
_HOOKS_TAKEN = threading.Lock()
ENDING_HOOKS_SEC = 15.0
"""How long end_process_tree gives the exit hooks: a crash or a stall is not kept waiting on a network."""


def before_exit(hook: Callable[[int], object]) -> None:
    EXIT_HOOKS.append(hook)


def run_exit_hooks(code: int, timeout_sec: Optional[float]) -> None:
    """Each hook once, with `code`, for at most `timeout_sec` in all (None: until they return); an exception in one
    is left (the exit goes on)."""
    with _HOOKS_TAKEN:  # exit_run (main thread) and end_process_tree (another) may both come: the hooks run once
        hooks = list(EXIT_HOOKS)
        EXIT_HOOKS.clear()
    if not hooks:
        return
    done = threading.Event()

    def run() -> None:
        try:
            for hook in hooks:
                with suppress(BaseException):  # wandb.teardown may sys.exit with its service's code
                    hook(code)
        finally:
            done.set()

    threading.Thread(target=run, name="exit-hooks", daemon=True).start()
    done.wait(timeout_sec)


END_TREE_WAIT_S = 5.0
"""How long end_process_tree keeps looking for processes started while it kills."""
_ENDING = threading.Lock()
"""Held by the first thread that ends the process tree: it alone chooses the exit code."""


def process_ending() -> bool:
    """Whether a thread of this process is ending it (end_process_tree), with its own code and words."""
    return _ENDING.locked()


def end_process_tree(code: int, stacks: bool) -> NoReturn:
    """Kill every process this one started (after collecting their stacks), then exit at once with `code`. Looked
    for again until a look finds none alive: this runs in a thread while the main thread may be starting the ranks
    (Lightning's launcher forks them), and a rank forked just after a single look was left waiting in the rendezvous
    for --rendezvous_timeout_min (a Ctrl-C just as a run started; seen in CI). Only the first call ends the process:
    another thread calling it meanwhile (the main thread, whose collective failed because the first call killed its
    peer) waits for that exit, which keeps the first call's code (the stall watchdog's 4, which Slurm requeues)."""
    if not _ENDING.acquire(blocking=False):
        threading.Event().wait()  # never set: the first call exits the process
    stop_launcher_observer()
    if stacks:
        collect_stacks(psutil.Process().children(recursive=True))
    run_exit_hooks(code, ENDING_HOOKS_SEC)
    deadline, empty_looks, killed = time.monotonic() + END_TREE_WAIT_S, 0, {os.getpid()}
    while time.monotonic() < deadline and empty_looks < 2:  # two looks apart: a fork under way at the first
        alive = live_descendants()
        empty_looks = 0 if alive else empty_looks + 1
        send(alive, signal.SIGKILL)
        killed |= {process.pid for process in alive}
        time.sleep(0.1 if not alive else 0.05)
    remove_multiprocessing_folders(killed)
    os._exit(code)


def own_multiprocessing_folder() -> None:
    """multiprocessing's temporary folder of this process (the data loader's fork server's sockets), made now and
    named for the process (`multiprocessing_folder`): multiprocessing names it `pymp-` and 8 random characters and
    removes it in its exit handler, which neither os._exit nor a SIGKILL runs, so every stall exit (4, requeued)
    left one per rank in $TMPDIR. A folder of that name left by a process gone (the pid is this one's now) is
    replaced; where it cannot be, multiprocessing names its own."""
    config = multiprocessing.process.current_process()._config
    if config.get("tempdir") is not None:
        return
    folder = multiprocessing_folder(os.getpid())
    try:
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
        folder.mkdir(mode=0o700)
    except OSError:
        return
    config["tempdir"] = str(folder)
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(str(folder), True), exitpriority=-100)


def multiprocessing_folder(pid: int) -> Path:
    """`pymp-` and 8 characters drawn from the pid and this process's PID namespace, as long as multiprocessing's own
    name (a socket's path has at most 107 bytes): named by the pid alone, the rank 0 of two containers that share
    $TMPDIR, each pid 1 in a namespace of its own, took the same folder, and the second removed the first's fork
    server sockets (both runs ended with FileNotFoundError). The processes a run kills are in its namespace."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (not Linux): one namespace
        namespace = 0
    digest = int.from_bytes(hashlib.blake2b(f"{namespace}:{pid}".encode(), digest_size=8).digest(), "big")
    name = "".join("0123456789abcdefghijklmnopqrstuvwxyz"[digest // 36 ** place % 36] for place in range(8))
    return Path(tempfile.gettempdir()) / f"pymp-{name}"


def remove_multiprocessing_folders(pids: set[int]) -> None:
    """The multiprocessing folders of this process and of the processes it killed (`own_multiprocessing_folder`)."""
    own = multiprocessing.process.current_process()._config.get("tempdir")
    for folder in ([Path(own)] if own else []) + [multiprocessing_folder(pid) for pid in pids]:
        if not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)


def stop_launcher_observer() -> None:
    """Lightning's launcher watches the ranks it started from a thread (its child-process observer, every 5 s) and,
    seeing one killed, SIGKILLs this process too: a rank killed here then turned the exit code (the watchdog's 4,
    which Slurm requeues) into -9 whenever the observer's look fell between the kill and the exit (seen in CI).
    The run is ending: it looks no more. (Its private method; under a Lightning that renames it, the race returns.)"""
    for thread in threading.enumerate():
        if thread.name == "child-process-observer" and hasattr(thread, "_run"):
            thread._run = lambda: True  # "every rank is done": its loop ends without terminating anything


def take_over_launcher_observer() -> None:
    """Lightning's observer, seeing a rank it started end with an error, SIGKILLs this process (exit 137, and a
    line of its own that names no cause): where no collective of this process fails first (while the ranks start,
    load the model, run the first evaluation), an out-of-memory kill of a rank ended the run so, instead of exit 1 and
    the line saying which rank a signal killed. Its look is replaced by one that says so and ends the run as
    end_process_tree does: with the rank's own code where it exited with one (it said why: the stall watchdog's 4),
    else EXIT_CRASHED. Before the launch: the observer starts with the ranks. (Its private class and method; under a
    Lightning that renames them, its own look stays.)"""
    from lightning_fabric.strategies.launchers import subprocess_script

    observer = getattr(subprocess_script, "_ChildProcessObserver", None)
    if observer is not None and hasattr(observer, "_run"):
        observer._run = lambda self: look_at_ranks(getattr(self, "_child_processes", []))


TRAINING_BEGAN = threading.Event()
"""Set when this process's ranks have crossed into training together (signals.StopRequest.begin_training)."""
STOPPED_BEFORE_TRAINING = {128 + signal.SIGTERM: ("SIGTERM", "nothing to save yet"),
                           128 + signal.SIGINT: ("SIGINT", "nothing to save yet"),
                           EXIT_PREEMPTED: ("SIGUSR1", "nothing new to save; continue with --resume true")}
"""How a rank that a stop signal found before training ends (signals.quit_before_training), and what it means."""


def look_at_ranks(children: list[subprocess.Popen]) -> bool:
    """One look of the observer: True once every rank has ended well; a rank that did not ends the run."""
    for child in children:
        child.poll()
    if all(child.returncode == 0 for child in children):
        return True
    for rank, child in enumerate(children, start=1):  # a silent end first: the others' codes say only that it ended
        ending = silent_end(rank, child)
        if ending is not None:
            say(f"{ending[0]}; ending the run (exit {ending[1]})\n")
            end_process_tree(ending[1], stacks=False)
    for child in children:
        if child.returncode:
            end_process_tree(child.returncode, stacks=False)
    return False


def silent_end(rank: int, child: subprocess.Popen) -> Optional[tuple[str, int]]:
    """A rank that ended without a word, said, and the run's exit code for it: killed by a signal (the out-of-memory
    killer's SIGKILL), or stopped by a stop signal before training (a rank quits then without a line, so that a
    signal to every process is said once: sent to it alone, the run ended without any). None for any other end."""
    code = child.returncode
    if code is not None and code < 0:
        return (f"local rank {rank} (pid {child.pid}) was killed by {signal.Signals(-code).name}"
                + (" (out of memory?)" if code == -signal.SIGKILL else "")), EXIT_CRASHED
    if code in STOPPED_BEFORE_TRAINING and not TRAINING_BEGAN.is_set():
        name, meaning = STOPPED_BEFORE_TRAINING[code]
        return f"local rank {rank} (pid {child.pid}) was stopped by {name} before training began: {meaning}", code
    return None


def live_descendants() -> list[psutil.Process]:
    """This process's descendants but the dead ones not yet reaped (nothing reaps them once this process exits)."""
    alive = []
    for process in psutil.Process().children(recursive=True):
        with suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
    return alive


def send(processes: list[psutil.Process], signum: int) -> None:
    for process in processes:
        with suppress(psutil.NoSuchProcess):
            process.send_signal(signum)


def poll_interval(timeout_sec: float) -> float:
    return min(1.0, timeout_sec / 10)


@dataclass
class StallWatchdog:
    """Ends the run when no optimizer step, evaluation or save finishes within `timeout_sec` (0: never).

    Armed by the end of the first optimizer step, so that loading, compilation, the initial validation and the first
    step are not timed; `disarm()` once training is over (a final upload may take long and is not a stall).
    """

    timeout_sec: float
    rank: int = 0
    head_start_sec: float = 0.0
    last_beat: Optional[float] = field(default=None, init=False)

    def start(self) -> StallWatchdog:
        if self.timeout_sec > 0:
            threading.Thread(target=self._watch, name="stall-watchdog", daemon=True).start()
        return self

    def beat(self, arm: bool = False) -> None:
        """Something finished: restart the clock if it runs; `arm` (an optimizer step finished) starts it."""
        if arm or self.last_beat is not None:
            self.last_beat = time.monotonic()

    def disarm(self) -> None:
        self.last_beat = None

    def _watch(self) -> None:
        while True:
            time.sleep(poll_interval(self.timeout_sec))
            last_beat = self.last_beat
            if last_beat is not None and time.monotonic() - last_beat > self.timeout_sec + self.head_start_sec:
                self._expire(time.monotonic() - last_beat)

    def _expire(self, idle_sec: float) -> NoReturn:
        say(f"rank {self.rank}: stalled: no optimizer step, evaluation or save finished in {idle_sec / 60:.1f} min "
            f"(--stall_timeout_min {self.timeout_sec / 60:g}); the Python stacks of this rank and of the processes it "
            f"started follow, then the run ends with exit code {EXIT_STALLED}: resume with --resume true\n")
        print_own_stacks()
        end_process_tree(EXIT_STALLED, stacks=True)


@dataclass(frozen=True)
class RendezvousDeadline:
    """Ends this process (and the ranks it launched) when the process group is not up within `timeout_sec`.

    A multi-node run whose other nodes never start (or use another MASTER_ADDR/MASTER_PORT) waits in the
    rendezvous; Ctrl-C cannot end it there, as the main thread waits in C code.
    """

    timeout_sec: float
    nodes: int
    world_size: int
    node_rank: int
    local_rank: int

    def start(self) -> None:
        """Watch, and say on each node that its ranks wait for the others (the one start-up line of a multi-node run:
        until every node has started train.py, nothing else can happen)."""
        if self.nodes > 1 and self.local_rank == 0:
            print(f"node {self.node_rank}: waiting for the ranks of {self.nodes} nodes ({self.world_size} in all) to "
                  f"join, at most {self.timeout_sec / 60:g} min (--rendezvous_timeout_min)", flush=True)
        threading.Thread(target=self._watch, name="rendezvous-deadline", daemon=True).start()

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_sec
        while not dist.is_initialized():
            if time.monotonic() > deadline:
                say(self.message() + "\n")
                end_process_tree(EXIT_RENDEZVOUS_TIMEOUT, stacks=False)
            time.sleep(poll_interval(self.timeout_sec))

    def message(self) -> str:
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (f"error: node {self.node_rank}, local rank {self.local_rank}: the other ranks did not join within "
                f"{self.timeout_sec / 60:g} min (--rendezvous_timeout_min) at {address}, expecting {self.world_size} "
                f"ranks on {self.nodes} nodes; start train.py on every node (srun, torchrun --nnodes, or by hand "
                f"with the same MASTER_ADDR/MASTER_PORT and each node's NODE_RANK, and the same --devices and "
                f"--num_nodes on every node) and check that {address} is reachable from every node; a node that "
                f"refused its inputs or failed as it started says why in its own output; exit code "
                f"{EXIT_RENDEZVOUS_TIMEOUT}")
