"""The suite's fork server (tests/forkserver.py) runs a train.py as `python train.py` would: its arguments, folder,
environment and streams, its exit status or the signal it died of, signals relayed, and the processes it starts with
sys.executable forked in turn, already past the imports."""

from __future__ import annotations

import os
import signal
import sys
import subprocess
from pathlib import Path

import pytest

from tests.conftest import FORK_SERVER, ROOT, run_environment
from tests.forkserver import PAUSE_VARIABLE

PROGRAM = '''
import os, signal, subprocess, sys, time
print("imported before the first line:", "torch" in sys.modules, "app.training.run" in sys.modules, flush=True)
print("argv", sys.argv[1:], "cwd", os.getcwd(), "variable", os.environ.get("FORKED_VARIABLE"), flush=True)
print("stdin", sys.stdin.readline().strip(), flush=True)
if sys.argv[1] == "child":
    sys.exit(subprocess.run([sys.executable, __file__, "exit", "5"], stdin=subprocess.DEVNULL).returncode + 1)
if sys.argv[1] == "wait":
    signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM received", flush=True), sys.exit(143)))
    print("waiting", flush=True)
    time.sleep(60)
if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "leave":  # what the interpreter's exit owes: threads, exit hooks, buffered output, the message
    import atexit, threading
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread done"))).start()
    atexit.register(lambda: print("exit hook ran"))
    print("buffered", end="")
    sys.exit("the message")
if sys.argv[1] == "state":  # what a fresh interpreter has of its own
    import random
    from lightning_fabric.utilities.rank_zero import rank_zero_only
    print("SIGINT", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          "SIGPIPE", signal.getsignal(signal.SIGPIPE) is signal.SIG_IGN, "rank", rank_zero_only.rank,
          "random", random.random())
    left_open = open(sys.argv[2], "w")  # closed, and its line written, by the objects' collection at exit
    left_open.write("written at exit")
    def keeps_the_globals_in_a_cycle():
        return left_open
    sys.exit(0)
if sys.argv[1] == "import":
    import fake_module
    sys.exit(fake_module.CODE)
sys.exit(int(sys.argv[2]))
'''


@pytest.fixture
def program(tmp_path):
    if not FORK_SERVER.available():
        pytest.skip("the fork server did not start")
    script = tmp_path / "train.py"  # forked by its name
    script.write_text(PROGRAM)
    return script


def start(program, *arguments: str, env_extra: dict[str, str] | None = None, **options) -> subprocess.Popen:
    env = run_environment(FORK_SERVER.variables() | {"FORKED_VARIABLE": "passed"} | (env_extra or {}))
    return subprocess.Popen([FORK_SERVER.shim, str(program), *arguments], cwd=program.parent, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, **{"stderr": subprocess.PIPE} | options)


def test_a_forked_program_gets_what_a_started_one_would_and_ends_the_same(program) -> None:
    out, err = start(program, "exit", "3").communicate("a line\n", timeout=60)
    assert "imported before the first line: True True" in out, out + err
    assert f"argv ['exit', '3'] cwd {program.parent} variable passed" in out
    assert "stdin a line" in out
    child = start(program, "child")
    out, err = child.communicate("\n", timeout=60)
    assert child.returncode == 6 and out.count("imported before the first line: True True") == 2, out + err
    died = start(program, "die")
    died.communicate("\n", timeout=60)
    assert died.returncode == -signal.SIGKILL


def test_a_forked_program_leaves_as_the_interpreter_would_without_tearing_down_the_servers_imports(program) -> None:
    """Its exit skips the interpreter's teardown of everything the server imported (1.8 s per process here, more than
    a refused train.py took in all), and keeps what that exit owes."""
    leaving = start(program, "leave")
    out, err = leaving.communicate("\n", timeout=60)
    assert leaving.returncode == 1 and err == "the message\n", out + err
    assert out.endswith("buffered" "thread done\n" "exit hook ran\n"), out
    both = start(program, "leave", stderr=subprocess.STDOUT)
    out, _ = both.communicate("\n", timeout=60)
    assert out.endswith("bufferedthe message\n" "thread done\n" "exit hook ran\n"), out  # the message first


def test_a_forked_program_has_what_a_fresh_interpreter_has_of_its_own(program, tmp_path) -> None:
    """Python's signal handlers at start, its own random state, Lightning's rank from LOCAL_RANK, and what it left
    for the interpreter's exit to close."""
    printed = []
    for rank in ("0", "1"):
        started = start(program, "state", str(tmp_path / f"left-open-{rank}"), env_extra={"LOCAL_RANK": rank})
        out, err = started.communicate("\n", timeout=60)
        assert started.returncode == 0, out + err
        printed.append(out.splitlines()[-1].split())
        assert (tmp_path / f"left-open-{rank}").read_text() == "written at exit"
    assert [line[:6] for line in printed] == [["SIGINT", "True", "SIGPIPE", "True", "rank", rank] for rank in "01"]
    assert printed[0][7] != printed[1][7], "each process its own random state"


def test_pythonpath_is_read_as_a_fresh_interpreter_would_unless_the_server_cannot_honour_it(program,
                                                                                           tmp_path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "fake_module.py").write_text("CODE = 7\n")
    imported = start(program, "import", env_extra={"PYTHONPATH": str(site)})
    imported.communicate("\n", timeout=60)
    assert imported.returncode == 7
    (site / "sitecustomize.py").write_text("")  # only an interpreter's start runs it
    refused = start(program, "import", env_extra={"PYTHONPATH": str(site)})
    _, err = refused.communicate("\n", timeout=60)
    assert refused.returncode == 1 and "run it from scratch (fresh=True)" in err, err


def test_signals_reach_the_program_through_its_client(program) -> None:
    waiting = waiting_for_a_signal(program)
    client = signal_masks(waiting.pid)
    waiting.send_signal(signal.SIGTERM)
    try:
        out, _ = waiting.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # seen once in a full suite, never alone: say in what state the client was
        waiting.kill()
        pytest.fail(f"SIGTERM to the client reached no handler of the program in 60 s; the client's {client}")
    assert "SIGTERM received" in out and waiting.returncode == 143


def test_a_signal_the_client_gets_before_it_relays_is_held_for_the_program(program) -> None:
    """The program may run, and catch signals, before its client has finished sending the request: a SIGTERM then
    ended the client by default and the program with it, where a process started from scratch would have run its
    handler. Here the client waits on a pipe between its request and its relaying, and the signal comes meanwhile."""
    pause_read, pause_write = os.pipe()
    waiting = waiting_for_a_signal(program, env_extra={PAUSE_VARIABLE: str(pause_read)}, pass_fds=(pause_read,))
    os.close(pause_read)
    waiting.send_signal(signal.SIGTERM)
    os.write(pause_write, b"go")
    os.close(pause_write)
    out, _ = waiting.communicate(timeout=60)
    assert "SIGTERM received" in out and waiting.returncode == 143, (out, waiting.returncode)


def waiting_for_a_signal(program: Path, **options) -> subprocess.Popen:
    """The program started with "wait", once it has said it waits (its SIGTERM handler is in place)."""
    waiting = start(program, "wait", **options)
    assert waiting.stdin and waiting.stdout
    waiting.stdin.write("\n")
    waiting.stdin.flush()
    while "waiting" not in waiting.stdout.readline():
        pass
    return waiting


def signal_masks(pid: int) -> str:
    """The signals a process blocks, ignores and catches, as its /proc status shows them (hexadecimal masks)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return " ".join(line.replace("\t", " ") for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def test_a_server_whose_test_process_was_killed_leaves_with_its_socket_folder(tmp_path) -> None:
    """A killed pytest (a timeout, a Ctrl-C on xdist workers) never runs the atexit that stops its server: the server
    must see it is orphaned and go, or it stays with 440 MB of imports and a folder in /tmp."""
    import os
    import time

    import psutil

    started = subprocess.run(
        [sys.executable, "-c", "import os; from tests.conftest import ForkServer; server = ForkServer(); "
                               "server.start(); print(server.process.pid, server.socket, flush=True); os._exit(0)"],
        cwd=ROOT, env=run_environment(None), capture_output=True, text=True, timeout=120)
    pid, socket = started.stdout.split()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(int(pid)) and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the orphaned fork server is still running"
        time.sleep(0.2)
    assert not os.path.exists(os.path.dirname(socket))
