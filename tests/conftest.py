"""Shared fixtures: a tiny Llama built from a config, a tokenizer trained here, and real text packed into blocks.

Nothing is downloaded: the text is the Python standard library's own source, prepared by prepare_data's pipeline.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest

# One OpenMP thread per process, set before anything imports torch (the fork server and every process the suite
# starts inherit it): on 2 cores, 3 workers and their runs are already more processes than cores, and a
# single-process run's second thread (Lightning gives each rank cores // ranks) mostly spun. On 2026-11-28, fresh
# clones: 1,647 busy CPU-s and 834 s before; 1,504 CPU-s and 759 s with this line and tests/test_slurm.py's jobs
# halved. The files of single-process runs fell most: test_resume_anywhere.py 117 to 78 CPU-s, test_mixture.py 84
# to 45 (tests under a sampler of every process's CPU).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Where transformers copies the Python code of a model or tokenizer loaded with --trust_remote_code: a folder of the
# suite's own instead of ~/.cache/huggingface/modules. Set here, as transformers reads it on import: the fork
# server's runs and the ones started from scratch then share it, and such a run is forked like any other.
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="hf-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)

ROOT = Path(__file__).resolve().parent.parent

# One module under both names the tests import it by: `conftest`, as pytest loads it, and `tests.conftest`. As two
# modules, each started a fork server of its own in a worker that ran files of both kinds (6 CPU-s of imports).
sys.modules.setdefault("tests.conftest" if __name__ == "conftest" else "conftest", sys.modules[__name__])
BLOCK_SIZE = 32

# `make test` hands whole files to its workers (xdist's --dist loadfile) in this order (--no-loadscope-reorder):
# the files holding the longest multi-process runs first, so that none of them starts near the end and keeps one
# worker busy while the others sit idle (longest-first scheduling). Seconds per file in the suite of 2026-12-01
# (915 s in all); the files not listed follow in their usual order.
LONGEST_FILES_FIRST = (
    "test_slurm.py",  # 506 s, most of it waiting on Slurm: started first, its waits overlap the other files' work
    "test_reliability.py",  # 627 s
    "test_fsdp2.py",  # 177 s (one test compiles: 144 s)
    "test_async_save.py",  # 126 s
    "test_resume_anywhere.py",  # 112 s
    "test_precision.py",  # 108 s
    "test_prepare_data.py",  # 108 s
    "test_prefetch.py",  # 93 s
    "test_memory_plan.py",  # 73 s
    "test_convert.py",  # 70 s
    "test_training.py",  # 65 s
    "test_supervised.py",  # 60 s
    "test_seq2seq.py",  # 55 s
    "test_gpu_check.py",  # 53 s (one test: about 10 processes)
    "test_mixture.py",  # 44 s: a 100-step run, resumed on 1 and on 4 processes
    "test_spike_guard.py",  # 41 s (one test: three runs)
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    renamed = [name for name in LONGEST_FILES_FIRST if not (ROOT / "tests" / name).exists()]
    if renamed:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FILES_FIRST names missing files {renamed}")

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)

    items.sort(key=rank)


@dataclass(frozen=True)
class TinySetup:
    model_config: Path
    tokenizer: Path
    data: Path


def build_tiny_setup(root: Path) -> TinySetup:
    """prepare_data's own pipeline on the stdlib's json package (a tokenizer of 400 pieces, blocks of 32 tokens),
    and a 2-layer, 64-wide Llama config whose vocabulary fits that tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig

    from app.prepare import PrepareArgs, prepare, stdlib_corpus_paths

    data = root / "data"
    prepare(PrepareArgs(input=stdlib_corpus_paths(("json",)), output_dir=str(data), vocab_size=400,
                        block_size=BLOCK_SIZE, val_fraction=0.15, seed=0))
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(root / "model")
    return TinySetup(model_config=root / "model", tokenizer=data / "tokenizer", data=data)


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder on a read-only filesystem (a tmpfs mounted read-only: root only, as CI and the development machines
    run; permissions do not stop root), as datasets and models on shared storage are."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"a read-only filesystem needs mount (root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinySetup:
    return build_tiny_setup(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Code -> docstring summary pairs of three standard-library packages (JSON lines: code, summary)."""
    from app.prepare.stdlib_tasks import code_summary_pairs

    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in code_summary_pairs(("json", "email", "http"))))
    return path


LONG_BLOCK_SIZE = 1024


@pytest.fixture(scope="session")
def long_blocks(tiny: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same text in blocks of 1024 tokens (20 train, 9 validation), where rotary precision shows."""
    from app.prepare import PrepareArgs, prepare, stdlib_corpus_paths

    data = tmp_path_factory.mktemp("long") / "data"
    prepare(PrepareArgs(input=stdlib_corpus_paths(("json",)), output_dir=str(data), tokenizer=str(tiny.tokenizer),
                        block_size=LONG_BLOCK_SIZE, val_fraction=0.15, seed=0))
    return data


@dataclass(frozen=True)
class MovedRun:
    data: Path
    out_dir: Path
    trained_on: Path
    """Where the data folder was when the run trained on it (gone now)."""


ONE_PROCESS = dict(devices=1, strategy="single_device", gradient_accumulation_steps=None, warmup_steps=0,
                   eval_step_interval=2, save_step_interval=2)


@pytest.fixture(scope="session")
def moved_run(tiny: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> MovedRun:
    """A 2-step run on a copy of the data with the tokenizer it was prepared with (no --tokenizer), then its folder
    and its data moved together, as to another node, mount or working directory: the data's old path is gone."""
    root = tmp_path_factory.mktemp("moved")
    shutil.copytree(tiny.data, root / "node-a" / "data")
    result = run_train(train_args(tiny, root / "node-a" / "run", train_data_dir=root / "node-a" / "data",
                                  tokenizer=None, max_step=2, **ONE_PROCESS))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (root / "node-a").rename(root / "node-b")
    return MovedRun(data=root / "node-b" / "data", out_dir=root / "node-b" / "run", trained_on=root / "node-a" / "data")


TRAINING_ONLY = ("gradient_accumulation_steps", "max_step", "lr", "min_lr", "warmup_steps", "save_step_interval")
"""Options of `train_args`' command line that --eval_only true does not read."""


def train_args(tiny: TinySetup, out_dir: Path, **overrides: object) -> list[str]:
    """The issue's reference command line, with overrides (`devices=1`, `resume=True`, ...)."""
    options = {
        "accelerator": "cpu", "devices": 2, "strategy": "fsdp", "precision": "32-true",
        "model_config": tiny.model_config, "tokenizer": tiny.tokenizer, "train_data_dir": tiny.data,
        "out_dir": out_dir, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "max_step": 24, "lr": 3e-3,
        "min_lr": 3e-4, "warmup_steps": 4, "eval_step_interval": 8, "eval_iters": 4, "save_step_interval": 8,
        "log_interval": 1, "wandb_mode": "disabled", "seed": 7, "num_workers": 0,
    }
    if overrides.get("eval_only"):  # without what only training reads, which --eval_only true refuses as flags
        options = {name: value for name, value in options.items() if name not in TRAINING_ONLY}
    options |= overrides
    args = []
    for name, value in options.items():
        if value is not None:
            args += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def one_process_llama(micro_batches: int):
    """A 1-layer Llama set up by Fabric on one CPU process with its AdamW, and one optimizer step of `micro_batches`
    identical micro-batches of 2 x 16 tokens: train_step and update_weights without any launcher."""
    import torch
    from lightning_fabric import Fabric
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.data import Batch, Step

    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    tokens = torch.randint(0, 64, (2, 16))
    step = Step([Batch({"input_ids": tokens, "labels": tokens}, trained_tokens=30)] * micro_batches,
                trained_tokens=30 * micro_batches, rows=[0, 1])
    return fabric, model, optimizer, step


def run_train(args: list[str], timeout: float = 300, env: dict[str, str] | None = None,
              nodes: int = 1, fresh: bool = False,
              node_args: dict[int, list[str]] | None = None) -> subprocess.CompletedProcess:
    """train.py in real processes, as a user runs it (with extra environment variables `env`); with `nodes` > 1,
    once per node, all on this machine, as users start each node by hand (with `--num_nodes` among `args`).

    Its processes are forked by tests/forkserver.py, past the imports (about 6 CPU-s per process); `fresh` asks for
    processes started from scratch: for runs whose peak RSS is measured, and for variables in `env` that a library
    reads when it is imported (HF_HUB_OFFLINE, a sitecustomize on PYTHONPATH) rather than when it is used.
    `node_args` adds options to some nodes' command lines (a node given another folder)."""
    python, variables = interpreter(fresh)
    command = [python, str(ROOT / "train.py"), *args]
    return run_script(command if nodes == 1 else on_nodes(command, nodes, node_args), timeout,
                      run_environment(variables | (env or {})))


def interpreter(fresh: bool = False) -> tuple[str, dict[str, str]]:
    """The Python to run train.py (or benchmarks/gpu_check.py) with, and the variables it needs: the fork server's
    client unless `fresh` or the server is unavailable."""
    if not fresh and FORK_SERVER.available():
        return FORK_SERVER.shim, FORK_SERVER.variables()
    return sys.executable, {}


def run_entry(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """One of the repository's scripts (`convert_to_hf.py ...`) run from the repository as a user runs it, forked by
    the fork server where it can be (tests/forkserver.py's FORKED): the same process, without its imports."""
    python, variables = interpreter()
    return run_script([python, *argv], timeout, run_environment(variables))


class ForkServer:
    """This test process's tests/forkserver.py server, started at the first run that uses it, stopped at exit.
    FORKSERVER=0 in the environment starts every run from scratch."""

    shim = str(ROOT / "tests" / "forkserver-python")

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.socket = ""
        self.failed = os.environ.get("FORKSERVER") == "0"

    def available(self) -> bool:
        if self.process is None and not self.failed:
            self.start()
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.socket = os.path.join(tempfile.mkdtemp(prefix="fs"), "socket")
        self.process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forkserver.py"), "serve", self.socket],
                                        env=run_environment(None), stdout=subprocess.PIPE, text=True,
                                        start_new_session=True)
        atexit.register(self.stop)
        if self.process.stdout.readline().strip() != "ready":  # it said why on stderr
            self.stop()
            self.failed = True

    def stop(self) -> None:
        if self.process is not None:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None
            shutil.rmtree(os.path.dirname(self.socket), ignore_errors=True)

    def variables(self) -> dict[str, str]:
        return {"FORKSERVER_SOCKET": self.socket, "FORKSERVER_PYTHON": sys.executable}


FORK_SERVER = ForkServer()


def run_environment(env: dict[str, str] | None) -> dict[str, str]:
    """This environment, unbuffered, with the extra variables `env`."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}


def on_nodes(command: list[str], nodes: int, node_args: dict[int, list[str]] | None = None) -> list[str]:
    """A shell that starts `command` (plus `node_args` of the node) as every node of a job (Lightning's MASTER_ADDR,
    MASTER_PORT and NODE_RANK), node 0 in the foreground, and fails if any node failed."""
    port = free_port()
    starts = [f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} NODE_RANK={node} "
              f"{shlex.join(command + (node_args or {}).get(node, []))}" for node in range(nodes)]
    others = "".join(f"{start} & pids+=($!); " for start in starts[1:])
    return ["bash", "-c", f'pids=(); {others}{starts[0]}; status=$?; '
                          f'for pid in "${{pids[@]}}"; do wait $pid || status=1; done; exit $status']


def run_script(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`command` run from the repository with its output captured. When it has not finished after `timeout`
    seconds the test fails with what it printed and where each of its processes is (py-spy), and none of them is
    left running: a rare hang in CI is then diagnosed from the log alone. The command runs in a session of its own,
    which finds its processes even where the launching one has exited and left a rank behind."""
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        stacks = None
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = kill_session(process.pid)
            stdout, stderr = process.communicate()
    if stacks is not None:
        pytest.fail(f"{' '.join(command[:2])} did not finish in {timeout:.0f} s\n--- stdout\n{stdout[-4000:]}\n"
                    f"--- stderr\n{stderr[-4000:]}\n--- where its processes were\n{stacks}", pytrace=False)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


STEP_LINE = re.compile(r"^step (\d+)/\d+ \|", re.MULTILINE)


@dataclass
class Launched:
    """A train.py run in its own process group, its console output going to a file we can watch."""

    process: subprocess.Popen
    log: Path
    forked: bool = False
    """Whether the fork server runs it: `process` is then the client, which relays its signals to the launcher
    alone, and the run's processes are in sessions of their own (`processes()` finds them by their output). Once
    the launcher has ended, the server kills what is left in its session: `assert_nothing_left` cannot see a
    process a forked run leaves behind."""

    def output(self) -> str:
        return self.log.read_text()

    def wait_until(self, condition: Callable[[str], bool], what: str, timeout: float = 180) -> float:
        """Wait until `condition(output)`; returns the time it held."""
        deadline = time.monotonic() + timeout
        while not condition(self.output()):
            assert self.process.poll() is None, f"run ended before {what}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{self.output()}"
            time.sleep(0.01)
        return time.monotonic()

    def wait_for(self, pattern: str, timeout: float = 180) -> float:
        return self.wait_until(lambda output: re.search(pattern, output, re.MULTILINE) is not None, repr(pattern),
                               timeout)

    def wait_for_step(self, step: int, timeout: float = 180) -> float:
        return self.wait_until(lambda output: any(int(s) >= step for s in STEP_LINE.findall(output)), f"step {step}",
                               timeout)

    def wait_until_quiet(self, seconds: float, timeout: float = 60) -> None:
        """Wait until the output has not changed for `seconds`: the run makes no more progress."""
        deadline = time.monotonic() + timeout
        last, since = self.output(), time.monotonic()
        while time.monotonic() - since < seconds:
            assert time.monotonic() < deadline, f"still progressing after {timeout} s:\n{self.output()}"
            time.sleep(0.2)
            if self.output() != last:
                last, since = self.output(), time.monotonic()

    def finish(self, timeout: float = 180) -> int:
        return self.process.wait(timeout=timeout)

    def processes(self) -> list[psutil.Process]:
        """Every live process of the run: ranks, data loader workers, forkservers (zombies are dead). A forked
        run's are those whose output is the run's log."""
        found, log = [], os.stat(self.log)
        for process in psutil.process_iter(["status"]):
            with suppress(OSError, psutil.Error):
                if self.forked:
                    output = os.stat(f"/proc/{process.pid}/fd/1")
                    ours = (output.st_dev, output.st_ino) == (log.st_dev, log.st_ino)
                else:
                    ours = os.getpgid(process.pid) == self.process.pid
                if ours and process.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(process)
        return found

    def workers_of(self, process: psutil.Process) -> list[psutil.Process]:
        return [child for child in process.children(recursive=True) if child.name() == "pt_data_worker"]

    def other_rank(self) -> psutil.Process:
        """Rank 1, which Lightning's launcher (rank 0, the launched process) started."""
        assert not self.forked, "a forked run's rank 1 is not a child of the launched process"
        return next(child for child in psutil.Process(self.process.pid).children()
                    if "train.py" in " ".join(child.cmdline()))

    def assert_nothing_left(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while self.processes():
            assert time.monotonic() < deadline, f"left running: {[p.cmdline()[:3] for p in self.processes()]}"
            time.sleep(0.2)

    def kill(self) -> None:
        """Whatever happened, leave no process behind: at one moment, as a SIGKILL to a process group. A forked
        run's processes are stopped first, then killed: none goes on while another is already dead."""
        found = self.processes() if self.forked else []
        for process in found:
            with suppress(psutil.Error):
                process.suspend()
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for process in found:
            with suppress(psutil.Error):
                process.kill()


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (the kernel's SigCgt mask); False once it is gone."""
    with suppress(FileNotFoundError):
        status = Path(f"/proc/{pid}/status").read_text()
        return bool(int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16) >> (signum - 1) & 1)
    return False


def launch(args: list[str], log: Path, env: dict[str, str] | None = None, forked: bool = False) -> Launched:
    """train.py started from scratch in a process group of its own, as a terminal or Slurm starts it: a signal to
    the group reaches every rank and data loader worker. `forked` runs it from the fork server (6 CPU-s of imports
    less per rank), for runs that take signals only through the launcher or SIGKILL (see Launched.forked)."""
    python, variables = interpreter(fresh=not forked)
    with open(log, "w") as handle:
        process = subprocess.Popen([python, str(ROOT / "train.py"), *args], cwd=ROOT,
                                   env=run_environment(variables | (env or {})), stdout=handle,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return Launched(process, log, forked=python != sys.executable)


@contextmanager
def launched(args: list[str], log: Path, env: dict[str, str] | None = None,
             forked: bool = False) -> Iterator[Launched]:
    """`launch`, and whatever happens, no process of the run left afterwards."""
    run = launch(args, log, env, forked)
    try:
        yield run
    finally:
        run.kill()


def kill_session(session: int) -> str:
    """The Python stacks of every process of `session` (all threads), then SIGKILL for all of them."""
    members = [process for process in psutil.process_iter(["status"]) if session_of(process.pid) == session]
    stacks = [f"process {process.pid}: exited" if process.info["status"] == psutil.STATUS_ZOMBIE
              else python_stacks(process.pid) for process in members]
    for process in members:
        with suppress(psutil.NoSuchProcess):
            process.kill()
    return "\n".join(stacks)


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def python_stacks(pid: int) -> str:
    dump = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(pid)],
                          capture_output=True, text=True, timeout=60)
    return f"process {pid}:\n{dump.stdout}{dump.stderr}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's metadata (step, config, grad_scaler, ...) and its model weights under "model"."""
    from app.checkpoint import read_metadata, read_model_weights

    return read_metadata(path) | {"model": read_model_weights(path)}


def overwrite_in_place(checkpoint: Path, name: str) -> Path:
    """Zero 64 bytes of tensor `name`'s data where the checkpoint stores them, its files' sizes unchanged (a failing
    disk, or a copy tool that sizes its file first and was cut short); returns the file changed."""
    from app.checkpoint.sources import open_source

    with open_source(checkpoint) as source:
        source.shapes()
        extent = source.extents_of(name)[0]
    with open(extent.path, "r+b") as handle:
        handle.seek(extent.offset)
        handle.write(bytes(64))
    return extent.path


def stop_where_lengths_differ(generated: list[list[int]]) -> tuple[int, list[list[int]]]:
    """A stop token that ends some greedy outputs early and others later, and the outputs cut after it: the case
    where ranks finish generating at different steps and must not wait on each other for ever."""
    for token in dict.fromkeys(t for tokens in generated for t in tokens):
        cut = [tokens[:tokens.index(token) + 1] if token in tokens else tokens for tokens in generated]
        if len({len(tokens) for tokens in cut}) > 1:
            return token, cut
    raise AssertionError(f"every output has the same length whatever stops it: {generated}")


def generate_through_the_application(tiny, data: Path, model: Path, stop_id: int, count: int, max_new_tokens: int,
                                     work: Path) -> list[list[int]]:
    """tests/helpers/probe_generation.py: evaluation's samples generated by 2 FSDP processes, each rank's prompts
    padded into one batch (the test fails when the preflight has them go one at a time)."""
    from app.data import load_data

    folder = load_data(data)
    longest = max(len(sample.prompt) for sample in folder.format.samples(folder.validation, count))
    report, together = work / "generated.json", count * (longest + max_new_tokens)
    args = train_args(tiny, work / "out", model_config=None, model_name=model, train_data_dir=data, tokenizer=None,
                      eval_samples=count, eval_max_new_tokens=max_new_tokens)
    result = run_script([sys.executable, str(ROOT / "tests/helpers/probe_generation.py"), str(report), str(stop_id),
                         str(count), str(max_new_tokens), str(together), *args], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads(report.read_text())
    assert written["token_budget"] == together, "one prompt at a time"
    return written["generated"]


@dataclass(frozen=True)
class WandbRecord:
    """What an offline W&B run recorded: the exit codes its finish wrote, and the steps of its history rows."""

    exit_codes: list[int]
    steps: list[int]


def wandb_records(out_dir: Path) -> list[WandbRecord]:
    """What each start of the run recorded offline in W&B (out_dir/wandb/offline-run-*/run-*.wandb), in start order."""
    return [wandb_record(path) for path in sorted((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))]


def wandb_record(path: Path) -> WandbRecord:
    """An offline W&B file decoded: wandb 0.31 reads its files in Go only. A LevelDB-style log: a 7-byte header,
    then 32 KiB blocks of chunks (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last) holding protobuf
    `Record`s."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, position, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or length == kind == 0:  # a block's padding
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    kinds = [record.WhichOneof("record_type") for record in records]
    return WandbRecord(
        exit_codes=[record.exit.exit_code for record, kind in zip(records, kinds) if kind == "exit"],
        steps=[int(item.value_json) for record, kind in zip(records, kinds) if kind == "history"
               for item in record.history.item if list(item.nested_key) == ["trainer/global_step"]])


Points = dict[str, list[tuple[int, float]]]
"""TensorBoard's scalars: each tag's (step, value) points, in the order they were written."""


def tensorboard_events(folder: Path) -> Iterator[Any]:
    """The events of `folder`'s files in the order TensorBoard reads them: the files by name (a start's file is named
    by its time), each record as tensorboardX writes it: a length (8 bytes), its checksum (4), the event, the event's
    checksum (4)."""
    from tensorboardX.proto.event_pb2 import Event

    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            yield Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4


def tensorboard_scalars(folder: Path) -> tuple[Points, Points]:
    """The scalars as written, and as TensorBoard shows them: at a session's start marker (a resume's purge_step) it
    forgets every point at that step or later (event_accumulator's _CheckForRestartAndMaybePurge)."""
    from tensorboardX.proto.event_pb2 import SessionLog

    written: Points = {}
    shown: Points = {}
    for event in tensorboard_events(folder):
        if event.HasField("session_log") and event.session_log.status == SessionLog.START:
            shown = {tag: [point for point in points if point[0] < event.step] for tag, points in shown.items()}
        for value in event.summary.value:
            if value.HasField("simple_value"):
                for points in (written, shown):
                    points.setdefault(value.tag, []).append((event.step, value.simple_value))
    return written, shown


def run_forked_ranks(check: Callable[[int], None], world_size: int, store: Path, timeout: float = 120) -> None:
    """`check(rank)` in `world_size` forked processes joined in one gloo process group (through the file `store`);
    fails with the first rank's traceback, and leaves no process behind if a rank is stuck in a collective."""
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    ranks = [context.Process(target=_forked_rank, args=(check, rank, world_size, store, errors))
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=timeout)
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    assert errors.empty(), errors.get()
    assert [process.exitcode for process in ranks] == [0] * world_size


def _forked_rank(check: Callable[[int], None], rank: int, world_size: int, store: Path,
                 errors: multiprocessing.Queue) -> None:
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        check(rank)
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
