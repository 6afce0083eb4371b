"""A fork server for the suite's `train.py` runs: each rank process is forked from one that has already imported
torch, Lightning Fabric, transformers, datasets and the application, instead of importing them again.

Why: the suite starts about 250 train.py processes, and each spent ~6 CPU-s importing those libraries before its
first line of work (torch 1.8 s, lightning_fabric with torch._dynamo 1.9 s, transformers' scan of its model files,
datasets): on the CI machine's 2 cores that was about half of `make test`'s 19 minutes. A forked process is a real
process (its own memory, its own gloo sockets, its own exit status); what it skips is the imports.

How: `python tests/forkserver.py serve SOCKET` imports everything once and waits. `tests/forkserver-python
script.py ARGS...` (the client, with FORKSERVER_SOCKET and FORKSERVER_PYTHON in its environment) sends its
arguments, environment, working folder, signal mask and standard streams over the socket; the server forks a worker,
which forks the program (in a session of its own, with the client's streams, environment and folder;
`sys.executable` is the client again, so that the ranks Lightning's launcher starts are forked too) and waits for
it. The client relays the signals it gets to the program and exits with its status (or
dies of the same signal); when the client goes away, the program's session is killed. Anything else than a train.py
is exec'd with the real interpreter.

Not for runs that measure what a fresh process would: peak RSS starts at the server's (a forked child inherits the
high-water mark), the environment at import time is the server's (a variable a library reads on import, such as
HF_HUB_OFFLINE, must not differ; PYTHONPATH's folders are put on sys.path, but a module there that the server
imported from elsewhere is refused), and signals reach the program through the client. A program leaves with
os._exit once its threads and exit hooks are done: the interpreter's teardown of everything the server imported
took 1.8 s per process, longer than a refused train.py run took in all. tests/conftest.py's run_train
uses it for single-node runs without an environment of their own, unless a test asks for a fresh process.
"""

from __future__ import annotations

import array
import inspect
import json
import os
import select
import signal
import shutil
import socket
import struct
import sys

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
SOCKET_VARIABLE, PYTHON_VARIABLE = "FORKSERVER_SOCKET", "FORKSERVER_PYTHON"
PAUSE_VARIABLE = "FORKSERVER_PAUSE_FD"
"""A file descriptor the client reads one byte from between sending its request and relaying signals (tests only)."""
FORKED = ("train.py", "gpu_check.py", "convert_to_hf.py", "prepare_data.py", "generate.py", "bench_loss.py",
          "probe_setup.py", "probe_group_timeouts.py")
"""Scripts whose processes are forked (by file name): what the suite starts most, and the tests' helpers that set
ranks up as train.py does (tests/helpers/), each importing what the server has imported. Not write_pieces.py:
its ranks exchange a checkpoint's pieces, and forked ones would share the string hash seed that orders sets of
names differently on each rank of a real run."""
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver-python")
"""The executable a forked program sees as sys.executable: `forkserver.py client` under the real interpreter."""


def preload(root: str) -> None:
    """What a train.py rank imports, so that the forked ones do not."""
    sys.path.insert(0, root)
    import torch.distributed.checkpoint  # noqa: F401
    import transformers
    from transformers import LlamaForCausalLM, T5ForConditionalGeneration  # noqa: F401

    import app.training.run  # noqa: F401
    import arguments

    transformers.AutoModelForCausalLM  # noqa: B018  transformers' lazy module reads its model files on first use
    arguments.build_parser()  # cached: the forked ranks parse their command lines without building it again
    sys.path.remove(root)


def serve(path: str) -> None:
    """Accept requests until killed or until the test process that started it is gone; one worker process per
    request."""
    preload(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import threading

    # A Python thread would be missing in every forked child, holding whatever lock it held. The native threads the
    # imports start (one of torch's, pyarrow's jemalloc background thread) are those every DataLoader worker forked
    # from a training process also leaves behind; no parallel region has run yet.
    if threading.active_count() != 1:
        raise SystemExit(f"forkserver: {threading.active_count()} Python threads after the imports; cannot fork")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        if not select.select([listener], [], [], 1.0)[0]:
            if os.getppid() != parent:  # the test process was killed before its atexit could stop this server,
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # which stayed behind with 440 MB of
                os._exit(0)  # imports (a timeout, a Ctrl-C on xdist workers), and so did its socket's folder
            continue
        connection, _ = listener.accept()
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            listener.close()
            work(connection)
        connection.close()


def receive(connection: socket.socket) -> tuple[dict, list[int]]:
    size = struct.unpack("!I", connection.recv(4, socket.MSG_WAITALL))[0]
    fds = array.array("i")
    message, ancillary, _, _ = connection.recvmsg(size, socket.CMSG_LEN(3 * fds.itemsize), socket.MSG_WAITALL)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return json.loads(message), list(fds)


def work(connection: socket.socket) -> None:
    """The worker: fork the program, relay the client's signals to it, report how it ended."""
    request, fds = receive(connection)
    program = os.fork()
    if program == 0:
        connection.close()
        run_program(request, fds)
    for fd in fds:
        os.close(fd)
    while True:
        done, status = os.waitpid(program, os.WNOHANG)
        if done:
            break
        ready, _, _ = select.select([connection], [], [], 0.2)
        if ready:
            data = connection.recv(16)
            if not data:  # the client is gone: so is the program
                with_suppressed(os.killpg, program, signal.SIGKILL)
                os.waitpid(program, 0)
                os._exit(0)
            for number in data:
                with_suppressed(os.kill, program, number)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
    with_suppressed(connection.sendall, struct.pack("!i", code))
    with_suppressed(os.killpg, program, signal.SIGKILL)  # what the program left behind in its session
    os._exit(0)


def with_suppressed(function, *arguments) -> None:
    try:
        function(*arguments)
    except OSError:
        pass


def run_program(request: dict, fds: list[int]) -> None:
    """In the forked program: become the client's process, then run the script as `python script args` would."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for number in range(1, signal.NSIG):
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            with_suppressed_signal(number)
    for number in (signal.SIGPIPE, signal.SIGXFSZ):  # as a Python interpreter starts: BrokenPipeError, not death
        signal.signal(number, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script, *request["argv"][1:]]
    sys.path[0] = os.path.dirname(script)
    sys.path[1:1] = python_path(request["env"].get("PYTHONPATH", ""))
    sys.executable = SHIM
    set_apart_from_the_server()
    import atexit
    import gc
    import threading
    import types

    main = types.ModuleType("__main__")  # as `python script` (and runpy.run_path) run it
    main.__dict__.update(__file__=script, __cached__=None, __loader__=None, __package__="", __spec__=None)
    sys.modules["__main__"] = main
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec")
    try:
        exec(code, main.__dict__)
        left: object = 0
    except SystemExit as leaving:
        left = leaving.code
    status = exit_status(left)  # its message first, as the interpreter prints it
    threading._shutdown()  # then what the interpreter's own exit waits for, in its order
    atexit._run_exitfuncs()
    clear_module(main.__dict__)  # the teardown's first work: the script's objects freed (its open files written)
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        if not flushed(stream):
            status = 120  # as the interpreter's exit
    os._exit(status)


def clear_module(namespace: dict) -> None:
    """A module's names set to None as the interpreter's teardown does (underscored ones first). A garbage
    collection alone loses what a text file left open had buffered: it may close the file under its text layer."""
    for names in ([name for name in namespace if name.startswith("_")], list(namespace)):
        for name in names:
            if name != "__builtins__":
                namespace[name] = None


def set_apart_from_the_server() -> None:
    """What a fresh process would not share with the server and its other forks: the random generators seeded at
    import (Python's, numpy's), and Lightning's rank for rank_zero_only, read from LOCAL_RANK and the like at import.
    The string hash seed cannot be changed after start: every forked process has the server's."""
    import random

    import numpy
    from lightning_fabric.utilities.rank_zero import _get_rank, rank_zero_only

    random.seed()
    numpy.random.seed()
    rank_zero_only.rank = _get_rank() or 0


def python_path(variable: str) -> list[str]:
    """PYTHONPATH's folders, as a fresh interpreter puts them after the script's. A module they hold that the
    server imported from elsewhere, or that only a fresh interpreter runs (sitecustomize), would not be the one the
    test meant: such a run must start from scratch."""
    folders = [os.path.abspath(folder) for folder in variable.split(os.pathsep) if folder]
    for folder in folders:
        for entry in os.listdir(folder) if os.path.isdir(folder) and folder not in sys.path else []:
            name = inspect.getmodulename(entry) or entry  # a module (.py, .pyc, .so) or a package's folder
            imported = getattr(sys.modules.get(name), "__file__", None) or ""
            if (name in sys.modules and not imported.startswith(folder + os.sep)) or name in ("sitecustomize",
                                                                                              "usercustomize"):
                raise SystemExit(f"forkserver: PYTHONPATH's {os.path.join(folder, entry)} would not be imported "
                                 "in a forked process; run it from scratch (fresh=True)")
    return folders


def flushed(stream) -> bool:
    """Whether `stream`'s buffered output is written; the interpreter's exit says so too when it is not."""
    try:
        stream.flush()
    except (OSError, ValueError) as error:
        print(f"Exception ignored on flushing {getattr(stream, 'name', stream)}: {error!r}", file=sys.__stderr__)
        return False
    return True


def exit_status(code: object) -> int:
    """The status `raise SystemExit(code)` ends a Python process with (a message is printed and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def with_suppressed_signal(number: int) -> None:
    try:
        signal.signal(number, signal.SIG_DFL)
    except (OSError, ValueError):
        pass


def run(path: str, argv: list[str]) -> None:
    """The client: the program's stand-in for whoever started it."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    # Held from here until they can be relayed: the program may run (and catch them) before this process has sent
    # its whole request, and a signal then would end this process by default and the program with it.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    message = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                          "blocked": sorted(int(s) for s in blocked)}).encode()
    connection.sendall(struct.pack("!I", len(message)))
    connection.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    if os.environ.get(PAUSE_VARIABLE):  # tests/test_forkserver.py's window between the request and the relay
        os.read(int(os.environ[PAUSE_VARIABLE]), 1)
    for number in RELAYED:
        signal.signal(number, lambda received, _: connection.send(bytes([received])))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    answer = connection.recv(4, socket.MSG_WAITALL)
    if len(answer) < 4:
        raise SystemExit("forkserver: the server went away")
    code = struct.unpack("!i", answer)[0]
    if code < 0:  # die of the same signal
        with_suppressed_signal(-code)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    raise SystemExit(code)


def main() -> None:
    command, *rest = sys.argv[1:]
    if command == "serve":
        serve(rest[0])
    elif rest and os.path.basename(rest[0]) in FORKED and os.environ.get(SOCKET_VARIABLE):
        run(os.environ[SOCKET_VARIABLE], rest)
    else:  # not ours to fork: the real interpreter, as asked
        python = os.environ.get(PYTHON_VARIABLE, sys.executable)
        os.execv(python, [python, *rest])


if __name__ == "__main__":
    main()
