"""How a command ends when it is stopped, or runs out of what the machine gives it: one line on stderr and an exit
status, never a traceback or an orphaned worker (`stopped_in_one_line`, which prepare_data.py, convert_to_hf.py,
prefetch.py and generate.py run their work in), and which errors are such exhaustion (`exhausted`,
`out_of_memory`), which train.py's ranks say in one line too (app/reliability/signals.py).

The fork hooks at the end are registered when this module is imported (a registration cannot be undone); they act
only while a command runs in `stopped_in_one_line`.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Optional

from app.cli import first_line
from app.exit_codes import EXIT_CRASHED
from app.folders import NO_ROOM, storage_error
from app.tasks import end_with_the_parent, prctl

END_LOOKS_S = 5.0
"""How long a stop looks for child processes to kill, until two looks in a row find none."""


def alive(process: Any) -> bool:
    """A psutil process that is running: not gone, and not a zombie its killed pool has not reaped."""
    import psutil

    with suppress(psutil.Error):
        return process.status() != psutil.STATUS_ZOMBIE
    return False


@contextmanager
def stopped_in_one_line(prog: str, nothing_written: str | Callable[[], str], clean_up: Callable[[], None],
                        fewer_workers: str = "", writes_to: str = "its work folder") -> Iterator[None]:
    """Ctrl-C or SIGTERM as one line and exit 128 + the signal, at once: the work's child processes are killed,
    `clean_up` removes what the work had begun, and the process exits without unwinding. Unwound, a
    KeyboardInterrupt printed a traceback, or with a pool of workers a TimeoutError (exit 1); a SIGTERM that only
    this process got (`kill PID`, an orchestrator) left the workers running, orphaned, holding their memory for
    ever; and a pool's own cleanup waits for a lock that an idle worker holds while it waits for work, so that a
    stop could hang for ever (seen in CI). A forked worker that inherits the handler ends by the signal.

    Python runs a handler only between the main thread's bytecodes, which never come while it waits in C code:
    SentencePiece's training (minutes on a large corpus) kept a Ctrl-C waiting until it ended. So a thread also
    takes the signal, from the pipe that Python's C-level handler writes its number to (signal.set_wakeup_fd), and
    whichever of the two comes first stops the work.

    A thread that the system refuses (the limit on processes and threads: a cgroup's pids.max, `ulimit -u`), a full
    disk, too many open files or memory run out, in any thread or forked worker, ends the command the same way, exit
    1, in one line naming the cause (and the option that asks for fewer workers, `fewer_workers`, or where it writes,
    `writes_to`): datasets' pool waited for ever for a manager whose thread never started, and a full disk was a
    traceback of 62 lines."""
    import signal
    import threading

    import psutil

    owner, ending = os.getpid(), threading.Lock()

    def end(number: int, why: str = "", code: int = 0) -> None:
        if not ending.acquire(blocking=False):  # the other path is ending the process
            threading.Event().wait()
        _ENDING[0] = True  # no fork from now on (_before_fork)
        folders: set[str] = set()
        deadline, empty_looks = time.monotonic() + END_LOOKS_S, 0
        while time.monotonic() < deadline and empty_looks < 2:  # a pool's thread may fork a worker after one look
            children = [child for child in psutil.Process().children(recursive=True) if alive(child)]  # (one was
            empty_looks = 0 if children else empty_looks + 1  # left orphaned, waiting for work)
            folders |= multiprocessing_folders(children)
            for child in children:
                with suppress(psutil.Error):
                    child.kill()
            time.sleep(0.05)
        clean_up()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        said = nothing_written() if callable(nothing_written) else nothing_written  # what the work left, as it stands
        print(f"{prog}: {why or 'stopped by ' + signal.Signals(number).name}; {said}", file=sys.stderr, flush=True)
        os._exit(code or 128 + number)

    def stop(number: int, _frame: object) -> None:
        if os.getpid() != owner:  # a forked worker: end as the signal ends a process
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        end(number)

    def take_from_the_pipe(read_end: int) -> None:
        while received := os.read(read_end, 64):
            for number in set(received) & {signal.SIGINT, signal.SIGTERM}:
                end(number)
            if told := [byte for byte in received if byte in WORKER_CAUSES]:
                end(0, exhausted_reason(WORKER_CAUSES[told[0]], fewer_workers, writes_to), EXIT_CRASHED)
        os.close(read_end)

    def thread_refused(failed: threading.ExceptHookArgs) -> None:
        if failed.exc_value is not None and (cause := exhausted(failed.exc_value)) is not None:
            if os.getpid() != owner:  # a worker, or a pool's manager: the command's process says it and ends them all
                os.write(write_end, bytes([worker_byte(cause)]))
                threading.Event().wait()
            end(0, exhausted_reason(cause, fewer_workers, writes_to), EXIT_CRASHED)
        previous_hook(failed)

    previous_hook, threading.excepthook = threading.excepthook, thread_refused
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous_pipe = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    FORKING.append(write_end)
    previous = {number: signal.signal(number, stop) for number in (signal.SIGINT, signal.SIGTERM)}
    threading.Thread(target=take_from_the_pipe, args=(read_end,), name="stop-signals", daemon=True).start()
    create_the_multiprocessing_folders()
    try:
        yield
    except Exception as error:
        cause = exhausted(error)
        if cause is None and not (lost_a_worker(error) and ending_elsewhere(ending)):
            raise
        end(0, cause and exhausted_reason(cause, fewer_workers, writes_to), EXIT_CRASHED)  # or waits for that end
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        signal.set_wakeup_fd(previous_pipe)
        threading.excepthook = previous_hook
        FORKING.pop()  # forks from now on are not this command's workers
        os.close(write_end)  # the thread reads the end of the pipe and ends


THREAD_REFUSED = "can't start new thread"
WORKER_CAUSES = {251: RuntimeError(THREAD_REFUSED), 252: MemoryError("in a worker process"),
                 253: OSError(errno.EMFILE, "Too many open files"),
                 254: OSError(errno.ENOSPC, "No space left on device"),
                 255: OSError(errno.EDQUOT, "Disk quota exceeded")}
"""What a forked worker writes to its command's stop-signal pipe when a thread of its own met one of these (signal
numbers are below 65), and what its command's process then says."""
CONSEQUENCES_S = 2.0
"""How long an error of the work that lost a worker waits for another thread that met a refused thread first to end
the command: what that refusal broke (a pool's manager) reaches the main thread as errors of their own (connection
reset by peer); other errors are raised at once."""


def worker_byte(cause: BaseException) -> int:
    """The byte of WORKER_CAUSES that stands for `cause`."""
    if out_of_memory(cause):
        return 252
    if isinstance(cause, OSError):
        return {errno.EMFILE: 253, errno.EDQUOT: 255}.get(cause.errno, 254)
    return 251


def open_files_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def wrapped(error: BaseException) -> Iterator[BaseException]:
    """`error` and what it wraps: its cause, or the error it was raised while handling (not after `from None`)."""
    seen: Optional[BaseException] = error
    for _ in range(16):  # a chain, not a cycle
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)


def lost_a_worker(error: BaseException) -> bool:
    """Whether `error` is how the work meets a worker process or a pool's manager gone (EOF, a connection reset, a
    pool's timeout): perhaps the consequence of a refusal that the worker reports itself (WORKER_CAUSES)."""
    return any(isinstance(seen, (EOFError, ConnectionError)) or type(seen).__name__ == "TimeoutError"
               for seen in wrapped(error))


def ending_elsewhere(ending: Any) -> bool:
    """Whether another thread ends the command (it holds `ending`, a lock), or starts to within CONSEQUENCES_S."""
    deadline = time.monotonic() + CONSEQUENCES_S
    while not ending.locked() and time.monotonic() < deadline:
        time.sleep(0.05)
    return ending.locked()


def exhausted(error: BaseException) -> Optional[BaseException]:
    """The full disk, the quota, the open files, the memory or the thread refused in `error` or what it wraps
    (datasets wraps what its readers raise): what no input or option of the command is to blame for."""
    return next((seen for seen in wrapped(error) if isinstance(seen, OSError) and seen.errno in WRITES_REFUSED
                 or out_of_memory(seen) or isinstance(seen, RuntimeError) and THREAD_REFUSED in str(seen)), None)


WRITES_REFUSED = NO_ROOM | {errno.EMFILE}
"""The errors of a full disk, a quota reached and too many open files: EROFS and EIO (a disk remounted read-only or
failing) may come of reading an input, and keep their tracebacks."""


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the device or the host running out of memory: a CUDA OOM (torch.OutOfMemoryError, not
    imported here), the CPU allocator's, a memory map refused (safetensors' `unable to mmap ...: Cannot allocate
    memory`); not any error whose text quotes such words."""
    text = str(error)
    return (isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"
            or isinstance(error, OSError) and error.errno == errno.ENOMEM
            or isinstance(error, RuntimeError) and ("DefaultCPUAllocator: can't allocate memory" in text
                                                    or text.startswith("unable to mmap")
                                                    and "Cannot allocate memory" in text))


def exhausted_reason(cause: BaseException, fewer_workers: str = "", writes_to: str = "its work folder") -> str:
    fewer = f"lower {fewer_workers}, or " if fewer_workers else ""
    if out_of_memory(cause):
        return f"out of memory ({first_line(cause)[:200]}); {fewer}free memory, or run it where there is more"
    if isinstance(cause, OSError) and cause.errno == errno.EMFILE:
        return (f"too many open files (the limit, `ulimit -n`, is {open_files_limit()}); {fewer}raise it "
                "(`ulimit -n 65536`)")
    if isinstance(cause, OSError):
        return f"the storage refused a write: {storage_error(cause, writes_to)}: make room, then run it again"
    return ("the system refused a new thread: the limit on processes and threads is reached (a cgroup's pids.max, "
            f"docker's --pids-limit, ulimit -u); {fewer}raise the limit")


def create_the_multiprocessing_folders() -> None:
    """This process's `pymp-*` folder of multiprocessing and of datasets' multiprocess, made now, before any worker
    forks: a forked worker or manager inherits the folder instead of making one of its own, whose socket a stop
    could find only while that process still listened (CI saw one left when the manager died first)."""
    import importlib

    for name in ("multiprocessing", "multiprocess"):
        with suppress(ImportError):
            importlib.import_module(f"{name}.util").get_temp_dir()


def multiprocessing_folders(children: list) -> set[str]:
    """The `pymp-*` folders in $TMPDIR of this process and of `children` (psutil processes), which multiprocessing's
    exit handlers remove and neither os._exit nor a SIGKILL runs: every stopped prepare_data.py left one, holding
    the listener socket of datasets' Manager (a child process of its own)."""
    import psutil

    folders = {module.process.current_process()._config.get("tempdir") for name in ("multiprocessing", "multiprocess")
               if (module := sys.modules.get(name))}
    for child in children:
        with suppress(psutil.Error):
            folders |= {os.path.dirname(socket.laddr) for socket in child.net_connections(kind="unix")
                        if socket.laddr and os.path.basename(os.path.dirname(socket.laddr)).startswith("pymp-")}
    return {folder for folder in folders if folder}


FORKING: list[int] = []
"""The write ends of the stop-signal pipes of the commands running now (stopped_in_one_line), innermost last: what
the fork hooks below look at (registered once, at import: a registration cannot be undone)."""
_ENDING = [False]
"""Set once a stop ends the command: a fork then waits for the end instead (_before_fork)."""
_FORKED_BY: list[Optional[int]] = [None]
"""The process a fork comes from, when its main thread forks while a command runs: its workers end with it."""


def _before_fork() -> None:
    """In the forking process: a worker of the running command ends with this process, if the main thread forks it
    (PR_SET_PDEATHSIG fires when the forking thread ends: a worker a pool's helper thread started would end with that
    thread). prctl is looked up here, not in the child of a process with threads."""
    import threading

    if _ENDING[0]:  # a pool's thread replacing a worker the stop killed: that worker was left orphaned, for ever
        threading.Event().wait()  # the stop ends this process
    main = threading.current_thread() is threading.main_thread()
    _FORKED_BY[0] = os.getpid() if FORKING and main and prctl() else None


def _own_signals_only() -> None:
    """In a forked worker: its signals are not its parent's. A SIGTERM to a worker alone (`Pool.terminate()`) went
    through the inherited wakeup pipe to the parent's thread, which stopped the whole command. And it ends with the
    process that forked it (tasks.end_with_the_parent)."""
    import signal

    if not FORKING:
        return
    if _FORKED_BY[0] is not None:
        end_with_the_parent(_FORKED_BY[0])
    with suppress(ValueError, OSError):  # forked from another thread than the main one: set_wakeup_fd refuses
        previous = signal.set_wakeup_fd(-1)
        if previous != FORKING[-1]:  # another's: put back
            signal.set_wakeup_fd(previous)


os.register_at_fork(before=_before_fork, after_in_child=_own_signals_only)
