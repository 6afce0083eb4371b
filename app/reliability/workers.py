"""DataLoader worker processes: never forked from a rank, and deaf to the stop signals meant for their rank.

Start: a rank already runs threads (gloo, OpenMP, tqdm's monitor) when its data loader starts workers. A child
forked from a threaded process inherits every lock another thread held at that instant, held for ever: the child can
deadlock before its first line (seen once in about 60 starts: a worker stuck in multiprocessing's popen_fork right
after fork()). Workers are therefore forked by multiprocessing's forkserver: a helper process started by fork+exec
(nothing of the rank runs in between), with the data modules imported once (PRELOADED), that does nothing but
fork. It never runs a Python thread, a collective or an OpenMP region; the only other threads its imports start are
idle pools (OpenBLAS's, pyarrow's jemalloc thread) whose libraries prepare for fork themselves (pthread_atfork).
Spawning each worker instead would pay those imports in every worker at every epoch, and an interpreter shutdown at
its end.

Signals: Slurm, `kill -TERM -- -PGID` and a terminal's Ctrl-C signal every process of the job, workers included.
torch's worker handler dies on a SIGTERM its parent did not send, and the rank then fails with "DataLoader worker
(pid N) is killed by signal: Terminated". The forkserver and multiprocessing's resource tracker start with SIGTERM,
SIGUSR1 and SIGINT blocked (a signal mask survives fork and exec), so they outlive those signals, and the workers
they fork start with them blocked too: there is no window before `worker_init_fn`, which ignores them. SIGUSR2
(print the stacks) is blocked in the helpers the same way, so `kill -USR2 -- -PGID` reaches only ranks and workers.
The rank alone decides when to stop. A worker still ends when its rank shuts the loader down, or within seconds of
its rank's death (the forkserver exits with the rank, and torch's worker watches its parent).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import forkserver, resource_tracker
from multiprocessing.context import BaseContext
from typing import Any

from app.reliability.watchdog import STACKS_SIGNAL, own_multiprocessing_folder, print_stacks_on_signal

RANK_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""The signals a rank handles itself (app/reliability/signals.py) and its workers must leave alone."""
BLOCKED_AT_START = (*RANK_SIGNALS, STACKS_SIGNAL)
"""Blocked in the forkserver and the resource tracker for good, and in the workers until worker_init_fn: so that a
signal to every process of the run (SIGUSR2 too: stacks, see app/reliability/watchdog.py) never kills them."""
PRELOADED = ["torch", "datasets", "app.data"]
"""Imported once by the forkserver, so that a worker starts in milliseconds instead of seconds: all that the objects
a worker receives (the dataset, its format's collate function, worker_init_fn) need, and nothing of the training
stack (Lightning, transformers), which cost every worker seconds of imports when app.data pulled it in."""


@contextmanager
def blocked_at_start() -> Iterator[None]:
    """Block BLOCKED_AT_START in the calling thread only: the rank's other threads still take those signals (and
    its handlers act on them), while every process started meanwhile inherits the mask."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED_AT_START)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_rank_signals_to_the_rank(worker_id: int) -> None:
    """worker_init_fn: ignore RANK_SIGNALS (replacing torch's SIGTERM handler, installed just before), print the
    worker's Python stacks on SIGUSR2 as the ranks do, unblock them all; let the forkserver end with the rank."""
    for rank_signal in RANK_SIGNALS:
        signal.signal(rank_signal, signal.SIG_IGN)
    print_stacks_on_signal()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED_AT_START)
    release_forkserver()


def release_forkserver() -> None:
    """Close this worker's copy of the forkserver's "alive" pipe. The forkserver exits once every holder has closed
    it; a worker holding it would keep the forkserver alive after its rank died, and with it the worker itself
    (torch's worker exits when its parent, the forkserver, does)."""
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def kill_workers_left_at_exit() -> None:
    """Kill the workers still running when the rank exits. torch shuts them down when their loader goes away, but
    after an error the loader can outlive the code that used it; multiprocessing's own exit hook, which runs after
    this one, would then SIGTERM them (which they ignore) and wait for them for ever."""
    for worker in multiprocessing.active_children():
        worker.kill()


def start_worker_server() -> BaseContext:
    """This rank's forkserver context, its process started now if not running (its imports take seconds: start it
    early, while the rank loads the model)."""
    own_multiprocessing_folder()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    for start in (resource_tracker.ensure_running, forkserver.ensure_running):
        with blocked_at_start():  # one at a time: starting the tracker unblocks SIGINT and SIGTERM on return
            start()
    atexit.unregister(kill_workers_left_at_exit)  # registered once
    atexit.register(kill_workers_left_at_exit)
    return context


def worker_options(num_workers: int) -> dict[str, Any]:
    """DataLoader arguments for `num_workers` worker processes."""
    if num_workers == 0:
        return {}
    return {"multiprocessing_context": start_worker_server(), "worker_init_fn": leave_rank_signals_to_the_rank}
