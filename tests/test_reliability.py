"""Exact resume, crash-safe checkpoints, stop signals, Ctrl-C, hangs, the non-finite guard and secrets, for real.

Every run is train.py in 2 real FSDP processes on CPU; signals are real signals sent to the real processes.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from app.checkpoint import (checkpoint_dir, latest_checkpoint, list_checkpoints, mark_if_best, prune_checkpoints,
                            read_best, set_aside_newer)
from app.checkpoint.files import publish
from app.folders import staging_folder
from app.exit_codes import (EXIT_BAD_INPUT, EXIT_CRASHED, EXIT_INTERRUPTED, EXIT_NON_FINITE, EXIT_PREEMPTED,
                            EXIT_RENDEZVOUS_TIMEOUT, EXIT_SAVE_FAILED, EXIT_STALLED)
from app.evaluation.samples import set_aside_samples_after, write_samples
from app.evaluation.show import latest_samples
from app.reliability import signals
from app.reliability.signals import INTERRUPT_MESSAGE
from app.reliability.watchdog import collect_stacks, silent_end
from conftest import (ROOT, STEP_LINE, Launched, TinySetup, catches, free_port, kill_session, launch, launched,
                      read_checkpoint, run_environment, run_script, run_train, train_args, wandb_records)

FAKE_SECRETS = {"HF_TOKEN": "hf_FAKEsecretTOKEN0123456789", "WANDB_API_KEY": "fakewandbkey0123456789abcdef0123456789ab"}
# 647 train blocks / (16 micro-batch x 2 ranks x 2 accumulation) = 10 steps per epoch: step 10 ends epoch 0.
EXACT = dict(micro_batch_size=16, gradient_accumulation_steps=2, max_step=14, save_step_interval=6,
             eval_step_interval=100, log_interval=2)


def logged_losses(out_dir: Path) -> dict[int, float]:
    with open(out_dir / "metrics.csv", newline="") as handle:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(handle) if row["train_loss"]}


def metrics_rows(out_dir: Path) -> list[int]:
    with open(out_dir / "metrics.csv", newline="") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle)]


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(path)["model"]


def first_logged_step(output: str) -> int:
    return int(STEP_LINE.search(output).group(1))


def files_under(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()]


def test_each_way_a_run_ends_exits_with_the_code_the_docs_promise() -> None:
    """Wrapper scripts and the sbatch scripts act on these (they requeue 4, 5 and 8, never 6): docs/reliability.md."""
    from app.training.run import EXIT_CODES

    assert EXIT_CODES == {"finished": 0, "preempted": 75, "interrupted": 130, "non_finite": 3, "spikes": 6}
    documented = " ".join((ROOT / "docs" / "reliability.md").read_text().split())
    for phrase in ("`0` finished", "`3` a non-finite loss", "`6` loss spikes kept coming", "`75` a SIGTERM or SIGUSR1",
                   "`130` Ctrl-C"):
        assert phrase in documented, phrase


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_resume_matches_a_straight_run_exactly(tiny: TinySetup, tmp_path: Path):
    """Straight 14 steps vs SIGTERM at step k < 10 then --resume true to 14: epoch boundary and accumulation inside.
    The stopped run writes no checkpoint of its own (--save_step_interval 0) but the one the signal asks for, and its
    resumed part logs into the same W&B run. Logged every 2 steps, its metrics.csv has the straight run's rows: the
    signal's save at an odd step (usually 3) added a row of its own, holding only save_sec."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    straight_run = launch(train_args(tiny, straight, **EXACT, wandb_mode="offline"), tmp_path / "straight.log",
                          env=FAKE_SECRETS, forked=True)  # the libraries read the tokens when they use them
    stopped_run = launch(train_args(tiny, stopped, **EXACT | {"save_step_interval": 0, "wandb_mode": "offline"}),
                         tmp_path / "stopped.log", forked=True)
    stopped_run.wait_for_step(2)
    sent = time.monotonic()
    stopped_run.process.send_signal(signal.SIGTERM)  # the launcher only (rank 0); rank 1 learns it by all_reduce
    assert stopped_run.finish() == EXIT_PREEMPTED, stopped_run.output()
    seconds_to_exit = time.monotonic() - sent
    stop_step = int(re.search(r"step (\d+): stopped by a signal", stopped_run.output()).group(1))
    assert 2 <= stop_step < 10 and list(list_checkpoints(stopped)) == [stop_step], stopped_run.output()
    assert straight_run.finish() == 0, straight_run.output()

    resumed = run_train(train_args(tiny, stopped, **EXACT, resume=True, wandb_mode="offline"))
    assert resumed.returncode == 0, resumed.stderr
    assert first_logged_step(resumed.stdout) == stop_step + 2 - stop_step % 2
    wandb_runs = sorted(path.name for path in (stopped / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and len({name.rsplit("-", 1)[1] for name in wandb_runs}) == 1, \
        f"the resumed run continues the W&B run: {wandb_runs}"
    assert [logged.exit_codes for logged in wandb_records(stopped)] == [[EXIT_PREEMPTED], [0]]
    assert (f"Weights & Biases: offline, in {stopped / 'wandb'}; upload every start of this run with `wandb sync "
            f"{stopped / 'wandb'}/offline-run-*`") in resumed.stdout
    assert "wandb:" not in resumed.stdout + resumed.stderr, "its advice (`wandb online`, one start's folder to sync)"

    expected, got = logged_losses(straight), logged_losses(stopped)
    assert sorted(got) == list(range(2, 15, 2))
    assert metrics_rows(stopped) == metrics_rows(straight), f"stopped at step {stop_step}"
    worst = max(abs(got[s] - expected[s]) / abs(expected[s]) for s in expected)
    assert worst <= 1e-6
    final_straight, final_resumed = model_tensors(straight / "checkpoints/step-00000014.ckpt"), \
        model_tensors(stopped / "checkpoints/step-00000014.ckpt")
    assert final_straight.keys() == final_resumed.keys()
    assert all(torch.equal(final_straight[k], final_resumed[k]) for k in final_straight)
    print(f"\nstraight vs resumed: max relative loss difference {worst:.1e} over 14 steps; "
          f"SIGTERM saved at step {stop_step} and exited in {seconds_to_exit:.1f} s")

    written = "\n".join(path.read_bytes().decode("latin-1") for path in files_under(straight))
    for name, secret in FAKE_SECRETS.items():
        assert secret not in written and secret not in straight_run.output(), f"{name} leaked"
    assert any("wandb" in path.parts for path in files_under(straight)), "wandb offline files were not checked"


@pytest.mark.slow
def test_two_sigkills_resume_at_the_next_step_then_sigusr1_to_all_saves(tiny: TinySetup, tmp_path: Path):
    """SIGKILL to every process of the run at seeded random moments (mid-step, mid-save, mid-eval), twice, each
    followed by a resume (a third kill and resume cost the suite about 40 s for the same path once more). The
    runs killed are forked (12 CPU-s of imports less); the last, which the signal to its process group ends,
    is not."""
    out = tmp_path / "run"
    args = train_args(tiny, out, micro_batch_size=4, max_step=200, save_step_interval=2, eval_step_interval=4,
                      keep_last_n=2, num_workers=2)
    moments = random.Random(20261105)
    latest = 0
    for attempt in range(3):
        run = launch(args + (["--resume", "true"] if attempt else []), tmp_path / f"attempt{attempt}.log",
                     forked=attempt < 2)
        run.wait_for_step(latest + moments.randint(2, 6))
        assert first_logged_step(run.output()) == latest + 1, run.output()
        if attempt:
            assert f"resumed from {out / 'checkpoints' / f'step-{latest:08d}.ckpt'}" in run.output()
        time.sleep(moments.uniform(0, 0.5))
        if attempt == 2:
            break
        run.kill()
        run.finish()
        run.assert_nothing_left()
        checkpoints = list_checkpoints(out)
        latest = max(checkpoints)
        read_checkpoint(checkpoints[latest])  # the one resume takes is complete

    os.killpg(run.process.pid, signal.SIGUSR1)  # every rank and data loader worker gets it, as under srun
    assert run.finish() == EXIT_PREEMPTED, run.output()
    assert "Traceback" not in run.output() and "resource_tracker" not in run.output(), run.output()
    run.assert_nothing_left()
    stop_step = int(re.search(r"step (\d+): stopped by a signal", run.output()).group(1))
    checkpoints = list_checkpoints(out)
    assert max(checkpoints) == stop_step
    best = read_best(out)
    kept = {step for step in checkpoints}
    assert kept <= set(sorted(checkpoints)[-2:]) | {best["step"], latest}
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.endswith((".partial", ".replaced"))]


def stop_gracefully(run: Launched, signum: int, code: int, out_dir: Path) -> tuple[int, float]:
    """Send `signum` to every process of the run: it must save the current step and exit with `code`, without a
    traceback and leaving no process behind. Returns the step and the seconds until the save was announced."""
    sent = time.monotonic()
    os.killpg(run.process.pid, signum)
    seconds = run.wait_for(rf"stopped by a signal after saving \({signal.Signals(signum).name}\)") - sent
    assert run.finish() == code, run.output()
    step = int(re.search(r"step (\d+): stopped by a signal", run.output()).group(1))
    assert step in list_checkpoints(out_dir) and "Traceback" not in run.output(), run.output()
    saved = run.output().find(f"step {step}: saved ")  # a background write is published before the line says so
    assert -1 < saved < run.output().find(f"step {step}: stopped by a signal"), run.output()
    assert "resource_tracker" not in run.output(), run.output()  # multiprocessing's helper outlived the signal
    run.assert_nothing_left()
    return step, seconds


@pytest.mark.slow
def test_sigterm_then_ctrl_c_to_every_process_with_default_workers(tiny: TinySetup, tmp_path: Path):
    """SIGUSR2 (stacks) to each process, then SIGTERM to the whole process group, data loader workers included
    (Slurm's scancel and time limit, `kill -TERM -- -PGID`); then Ctrl-C (SIGINT to the group, as a terminal sends
    it) once on the resumed run, which saves in the background; then twice on the next one while rank 1 waits for
    ever on its workers and rank 0 on the collective."""
    out = tmp_path / "run"
    args = train_args(tiny, out, num_workers=2, max_step=300, save_step_interval=100, eval_step_interval=100)
    with launched(args, tmp_path / "sigterm.log") as run:
        run.wait_for_step(2)
        workers = [w for w in run.processes() if w.name() == "pt_data_worker"]
        assert len(workers) == 4 and all("forkserver" in " ".join(w.parent().cmdline()) for w in workers)
        collect_stacks(run.processes())  # every rank and worker prints its stacks; the run goes on
        run.wait_for(r"in _worker_loop")
        run.wait_for_step(3)
        first_stop, seconds_to_checkpoint = stop_gracefully(run, signal.SIGTERM, EXIT_PREEMPTED, out)

    with launched(args + ["--resume", "true", "--async_save", "true"], tmp_path / "ctrl-c.log") as run:
        run.wait_for_step(first_stop + 2)
        second_stop, _ = stop_gracefully(run, signal.SIGINT, EXIT_INTERRUPTED, out)
        assert second_stop > first_stop and run.output().count(INTERRUPT_MESSAGE) == 1, run.output()
        assert json.loads((out / "summary.json").read_text())["last_step"] == second_stop

    with launched(args + ["--resume", "true"], tmp_path / "ctrl-c-twice.log") as run:
        run.wait_for_step(second_stop + 2)
        for worker in run.workers_of(run.other_rank()):
            worker.suspend()
        run.wait_until_quiet(seconds=5)
        os.killpg(run.process.pid, signal.SIGINT)
        run.wait_for(re.escape(INTERRUPT_MESSAGE), timeout=10)
        sent = time.monotonic()
        os.killpg(run.process.pid, signal.SIGINT)
        assert run.finish(timeout=30) == EXIT_INTERRUPTED, run.output()
        seconds_to_quit = time.monotonic() - sent
        assert "Traceback" not in run.output() and "KeyboardInterrupt" not in run.output(), run.output()
        assert max(list_checkpoints(out)) == second_stop
        assert not (out / "summary.json").exists(), "the summary of the start before, as if it were this one's"
        run.assert_nothing_left()
    print(f"\nSIGTERM to every process: checkpoint of step {first_stop} written and announced "
          f"{seconds_to_checkpoint:.1f} s after the signal; a second Ctrl-C quit in {seconds_to_quit:.1f} s")


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_is_named_by_the_process_that_started_it(tiny: TinySetup, tmp_path: Path):
    """The out-of-memory killer's SIGKILL leaves the killed rank no last word: the launching process said only
    "another process of the run ended first (... Connection reset by peer)"."""
    args = train_args(tiny, tmp_path / "run", max_step=300, save_step_interval=0, eval_step_interval=1000,
                      wandb_mode="offline")
    with launched(args, tmp_path / "sigkill.log") as run:
        run.wait_for_step(2)
        victim = run.other_rank()
        victim.kill()
        assert run.finish(timeout=60) == EXIT_CRASHED, run.output()
        assert f"local rank 1 (pid {victim.pid}) was killed by SIGKILL (out of memory?)" in run.output(), run.output()
        run.assert_nothing_left()
    (logged,) = wandb_records(tmp_path / "run")  # the run's end killed wandb's service first: no exit, rows lost
    assert logged.exit_codes == [EXIT_CRASHED] and max(logged.steps) >= 2, logged


def wait_for_ranks(launcher: subprocess.Popen, timeout: float = 60) -> list[psutil.Process]:
    """The ranks the launching process started, as soon as there is one."""
    deadline = time.monotonic() + timeout
    while not (ranks := [child for child in psutil.Process(launcher.pid).children()
                         if "train.py" in " ".join(child.cmdline())]):
        assert time.monotonic() < deadline and launcher.poll() is None, "no rank started"
        time.sleep(0.01)
    return ranks


@pytest.mark.slow
def test_a_stop_signal_to_one_rank_before_training_is_said(tiny: TinySetup, tmp_path: Path) -> None:
    """A rank that a stop signal finds before training quits without a word (a signal to every process is said once,
    by the first); sent to that rank alone, the run ended after the observer's look with no line at all. SIGTERM
    here; what the launcher says of the other stop signals' codes, below (a rank quitting with 75 on SIGUSR1 before
    training: tests/test_slurm.py)."""
    signum, code, meaning = signal.SIGTERM, 128 + signal.SIGTERM, "nothing to save yet"
    args = train_args(tiny, tmp_path / "run", eval_iters=1000, eval_batch_size=1)  # a long initial validation
    with launched(args, tmp_path / "run.log") as run:
        run.wait_for("training 24 steps")
        victim = run.other_rank()
        time.sleep(0.5)
        victim.send_signal(signum)
        assert run.finish(timeout=60) == code, run.output()
        assert (f"local rank 1 (pid {victim.pid}) was stopped by {signal.Signals(signum).name} before training began: "
                f"{meaning}") in run.output(), run.output()
        assert "Traceback" not in run.output()
        run.assert_nothing_left()


@pytest.mark.parametrize("code, said", [
    (128 + signal.SIGTERM, "stopped by SIGTERM before training began: nothing to save yet"),
    (128 + signal.SIGINT, "stopped by SIGINT before training began: nothing to save yet"),
    (EXIT_PREEMPTED, "stopped by SIGUSR1 before training began: nothing new to save; continue with --resume true")])
def test_the_launcher_says_what_the_code_of_a_rank_stopped_before_training_means(code: int, said: str) -> None:
    child = SimpleNamespace(pid=4321, returncode=code)
    assert silent_end(1, child) == (f"local rank 1 (pid 4321) was {said}", code)


@pytest.mark.slow
def test_a_stop_signal_during_the_last_evaluation_ends_as_finished_and_says_what_it_cut(tiny: TinySetup,
                                                                                       tmp_path: Path) -> None:
    """At the last step a stop signal finds nothing left to train: the run saves and ends as finished (exit 0); the
    evaluation the signal cut short was said only as "not logged", and the summary's loss was step 2's."""
    args = train_args(tiny, tmp_path / "run", max_step=4, eval_step_interval=2, eval_iters=1000, eval_batch_size=1,
                      initial_validation=False)
    with launched(args, tmp_path / "run.log", forked=True) as run:  # rank 1 learns of the signal from rank 0
        run.wait_for(r"step 4/4")
        time.sleep(0.3)
        run.process.send_signal(signal.SIGTERM)
        assert run.finish(timeout=120) == 0, run.output()
        assert "step 4: the last step is saved, but the signal cut its evaluation short: the run's validation loss " \
               "is step 2's" in run.output(), run.output()
        assert 4 in list_checkpoints(tmp_path / "run"), run.output()
        run.assert_nothing_left()


@pytest.mark.slow
def test_a_launcher_killed_during_training_is_said_by_its_rank(tiny: TinySetup, tmp_path: Path) -> None:
    """From the first step on, a rank whose launcher dies says so in one line and exits: the kernel's SIGKILL that
    ends it with its launcher while the ranks start (app/tasks.py) is let go of when training begins. It once was
    not (the rank read its own pid as its launcher's), and the rank died without a word, or at a run's end before
    its exit handlers ran."""
    with launched(train_args(tiny, tmp_path / "run", max_step=300, save_step_interval=0, eval_step_interval=1000),
                  tmp_path / "run.log") as run:
        run.wait_for_step(2)
        rank = run.other_rank()
        run.process.kill()
        psutil.wait_procs([rank], timeout=30)
        assert "rank 1: another process of the run ended first" in run.output(), run.output()


@pytest.mark.slow
def test_a_rank_killed_while_the_ranks_start_is_named_and_ends_the_run_with_1(tiny: TinySetup, tmp_path: Path):
    """Before the first collective (the ranks starting, loading the model, evaluating) Lightning's observer of the
    ranks saw the killed one and SIGKILLed the launching process: exit 137 and a line of its own naming no cause."""
    with launched(train_args(tiny, tmp_path / "run"), tmp_path / "run.log") as run:
        [victim] = wait_for_ranks(run.process)
        time.sleep(0.5)
        victim.kill()
        assert run.finish(timeout=60) == EXIT_CRASHED, run.output()
        assert (f"local rank 1 (pid {victim.pid}) was killed by SIGKILL (out of memory?); ending the run "
                f"(exit {EXIT_CRASHED})") in run.output(), run.output()
        assert "zombies" not in run.output() and "Traceback" not in run.output(), run.output()
        run.assert_nothing_left()


@pytest.mark.slow
def test_a_hung_worker_on_one_rank_ends_the_run_with_every_ranks_stacks(tiny: TinySetup, tmp_path: Path):
    """Rank 1's data loader worker stops (SIGSTOP): rank 1 waits on it, rank 0 on the next collective. Nothing is
    left in $TMPDIR (each stall exit left a `pymp-*` folder per rank, and a requeued run stalls again and again)."""
    temporary = Path(tempfile.mkdtemp(prefix="t"))  # short: a socket's path under it has at most 107 bytes
    with launched(train_args(tiny, tmp_path / "run", num_workers=1, max_step=300, save_step_interval=100,
                             eval_step_interval=100, stall_timeout_min=0.1), tmp_path / "stall.log",
                  env={"TMPDIR": str(temporary)}) as run:
        run.wait_for_step(3)
        for worker in run.workers_of(run.other_rank()):
            worker.suspend()
        hung = time.monotonic()
        assert run.finish(timeout=120) == EXIT_STALLED, run.output()
        seconds = time.monotonic() - hung
        output = run.output()
        assert "rank 0: stalled: no optimizer step, evaluation or save finished in 0.1 min" in output, output
        assert "in all_gather" in output and "in _try_get_data" in output, output  # rank 0's stack, rank 1's
        assert "Traceback" not in output
        run.assert_nothing_left()
    assert list(temporary.iterdir()) == []
    temporary.rmdir()
    print(f"\nstall watchdog (--stall_timeout_min 0.1): exit {EXIT_STALLED} {seconds:.1f} s after the worker hung")


def test_loader_workers_a_containers_small_shared_memory_cannot_hold_leave_the_reading_to_the_ranks(
        tiny: TinySetup, tmp_path: Path) -> None:
    """A container's /dev/shm (64 MB unless --ipc=host or --shm-size; 16 KB here): a worker that could not put its
    batch there lost it with a traceback, and the rank waited for it until the stall watchdog (or, fuller still,
    the loader's first queue ended the run with a traceback). The ranks now read their batches themselves, and say
    why; with room enough, the workers stay."""
    from app.data import load_data
    from app.data.loader import batch_bytes, workers_that_fit

    args = shlex.join([sys.executable, str(ROOT / "train.py"), *train_args(tiny, tmp_path / "run", max_step=4,
                                                                           num_workers=2, stall_timeout_min=0.5)])
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             f"mount -t tmpfs -o size=16k tmpfs /dev/shm && exec {args}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    if "unshare failed" in result.stderr or "mount: " in result.stderr:
        pytest.skip(f"no mount namespace here: {result.stderr.strip()[:200]}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: --num_workers 2: the batches the loader workers of this node's 2 ranks keep in /dev/shm need " \
        "about" in result.stdout and "each rank reads its batches itself (--num_workers 0)" in result.stdout
    assert "Traceback" not in result.stderr and sorted(logged_losses(tmp_path / "run")) == [1, 2, 3, 4]
    assert workers_that_fit(2, load_data(tiny.data), 4, 2) == (2, None), "this machine's /dev/shm holds them"
    assert batch_bytes(load_data(tiny.data), 4) == 4 * 32 * 8 * 2, "4 rows of 32 tokens: input_ids and labels"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_containers_first_process_ends_on_a_signal_while_it_starts(tiny: TinySetup, tmp_path: Path,
                                                                    signum: int) -> None:
    """train.py as PID 1 (`docker run` without --init, a Kubernetes pod): the kernel dropped Ctrl-C and `docker
    stop`'s SIGTERM while it started (their action was the default), and the run went on to train all its steps."""
    command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(ROOT / "train.py"),
               *train_args(tiny, tmp_path / "run", devices=1, strategy="single_device", max_step=40, warmup_steps=0)]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as unshare:
        deadline, first = time.monotonic() + 60, None
        while first is None or not catches(first.pid, signal.SIGUSR1):  # its first handler (app/tasks.py) is in place
            assert time.monotonic() < deadline and unshare.poll() is None, unshare.communicate()
            with contextlib.suppress(psutil.NoSuchProcess, IndexError):
                first = psutil.Process(unshare.pid).children()[0]
            time.sleep(0.02)
        first.send_signal(signum)
        output, errors = unshare.communicate(timeout=60)
    if "unshare failed" in errors:
        pytest.skip(f"no PID namespace here: {errors.strip()[:200]}")
    assert unshare.returncode == 128 + signum, output[-2000:] + errors[-2000:]
    assert "step 1/" not in output and "Traceback" not in errors


def test_processes_of_the_same_pid_in_two_pid_namespaces_take_multiprocessing_folders_of_their_own() -> None:
    """Two containers sharing $TMPDIR, each with its own PID namespace: rank 0 is pid 1 in both, and named by the pid
    alone their folders were one, whose fork server sockets the second run removed (both ended, FileNotFoundError)."""
    from app.reliability.watchdog import multiprocessing_folder

    name = "from app.reliability.watchdog import multiprocessing_folder; print(multiprocessing_folder(1))"
    inside = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", name], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    if inside.returncode != 0:
        pytest.skip(f"no PID namespace here: {inside.stderr.strip()[:200]}")
    again = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", name], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    folders = {Path(inside.stdout.strip()), Path(again.stdout.strip()), multiprocessing_folder(1)}
    assert len(folders) == 3 and all(len(folder.name) == len("pymp-") + 8 for folder in folders), folders


@pytest.mark.slow
def test_a_node_that_never_starts_ends_the_rendezvous_and_ctrl_c_ends_it_at_once(tiny: TinySetup, tmp_path: Path):
    """Two nodes by hand (Lightning's MASTER_ADDR, MASTER_PORT, NODE_RANK) on one machine, the second never
    started: the rendezvous ends after --rendezvous_timeout_min with one line; Ctrl-C ends it sooner."""
    port = free_port()
    by_hand = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0"}
    started = time.monotonic()
    with launched(train_args(tiny, tmp_path / "run", num_nodes=2, rendezvous_timeout_min=0.1),
                  tmp_path / "rendezvous.log", env=by_hand) as run:
        assert run.finish(timeout=120) == EXIT_RENDEZVOUS_TIMEOUT, run.output()
        seconds = time.monotonic() - started
        errors = [line for line in run.output().splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "the other ranks did not join within 0.1 min" in errors[0], run.output()
        assert f"127.0.0.1:{port}" in errors[0] and "expecting 4 ranks on 2 nodes" in errors[0]
        assert "Traceback" not in run.output()
        run.assert_nothing_left()

    with launched(train_args(tiny, tmp_path / "run", num_nodes=2), tmp_path / "ctrl-c.log", env=by_hand) as run:
        sent = run.wait_for(r"node 0: waiting for the ranks of 2 nodes \(4 in all\) to join")
        os.killpg(run.process.pid, signal.SIGINT)
        code = run.finish(timeout=30)
        assert code in (EXIT_INTERRUPTED, -signal.SIGINT), run.output()
        assert time.monotonic() - sent < 10 and "Traceback" not in run.output(), run.output()
        if code == EXIT_INTERRUPTED:  # else SIGINT itself ended it, before its handler was in place
            assert "SIGINT before training began: nothing to save yet, quitting (exit 130)" in run.output()
        run.assert_nothing_left()
    print(f"\nrendezvous without the second node: exit {EXIT_RENDEZVOUS_TIMEOUT} after {seconds:.1f} s in all "
          "(--rendezvous_timeout_min 0.1, start-up included)")


def test_a_port_another_job_holds_ends_the_start_with_5_naming_it(tiny: TinySetup, tmp_path: Path) -> None:
    """Two jobs on one node met at one port (Lightning's 15000 + the job id's last four digits): the second ended
    with 1 and "a node that ended first says why", on one node; now 5, which the Slurm scripts requeue, and the
    port. The scripts pick a port nothing holds (app/distributed/ports.py), from a start the job id moves."""
    from app.distributed.ports import HIGHEST, LOWEST, free_port as port_of_the_job

    with socket.socket() as other_job:
        other_job.bind(("", 0))
        other_job.listen()
        port = other_job.getsockname()[1]
        result = run_train(train_args(tiny, tmp_path / "run", max_step=2, warmup_steps=0),
                           env={"MASTER_PORT": str(port)})
        assert result.returncode == EXIT_RENDEZVOUS_TIMEOUT, result.stderr[-3000:]
        assert f"rank 0: the ranks could not meet: port {port} on this node is another process's (another job's on " \
            "a shared node?); set MASTER_PORT to a free port, as the Slurm scripts do (exit 5)" in result.stderr
        assert "Traceback" not in result.stderr and not list_checkpoints(tmp_path / "run")
    first = port_of_the_job(4242)
    assert LOWEST <= first <= HIGHEST
    with socket.socket() as other_job:
        other_job.bind(("", first))
        other_job.listen()
        assert first < port_of_the_job(4242) <= HIGHEST


A_RANK_STARTS_DURING_THE_KILL = """
import subprocess, sys
import app.reliability.watchdog as watchdog

MARKER, real_send, started = sys.argv[1], watchdog.send, []


def rank(n):
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", MARKER, str(n)])


def send_while_a_rank_starts(processes, signum):
    real_send(processes, signum)
    if not started:  # the main thread's fork of the next rank completes just after the look
        started.append(rank(2))


watchdog.send = send_while_a_rank_starts
rank(1)
watchdog.end_process_tree(3, stacks=False)
"""


def test_ending_the_tree_also_kills_a_rank_started_while_it_kills(tmp_path: Path) -> None:
    """end_process_tree runs in a thread while the launcher's main thread may be forking the ranks: one forked just
    after its single look was left behind, waiting in the rendezvous for 10 minutes (CI: a Ctrl-C to the process
    group just as the launcher printed that it waits for the other nodes)."""
    marker = f"rank-of-{tmp_path.name}"
    result = subprocess.run([sys.executable, "-c", A_RANK_STARTS_DURING_THE_KILL, marker], cwd=ROOT, timeout=60)
    assert result.returncode == 3

    def left() -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline", "status"]):
            if marker in (process.info["cmdline"] or []) and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process)
        return found

    deadline = time.monotonic() + 5
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = left()
    for process in survivors:
        process.kill()
    assert survivors == []


LIGHTNINGS_OBSERVER_LOOKS_DURING_THE_KILL = """
import subprocess, sys, time
from lightning_fabric.strategies.launchers.subprocess_script import _launch_process_observer
import app.reliability.watchdog as watchdog

rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
_launch_process_observer([rank])  # as Lightning's launcher starts it, looking every 5 s
real_send = watchdog.send


def send_then_wait_for_the_observers_look(processes, signum):
    real_send(processes, signum)
    if processes:
        time.sleep(6)  # its next look sees the killed rank (it would SIGKILL this process, exit -9)


watchdog.send = send_then_wait_for_the_observers_look
watchdog.end_process_tree(4, stacks=False)
"""


def test_lightnings_observer_of_the_ranks_does_not_turn_the_watchdogs_exit_into_a_kill() -> None:
    """CI: a stalled run ended with -9, not 4 (which Slurm requeues): the launcher's observer of its ranks looked
    between end_process_tree's kill of rank 1 and its exit, and SIGKILLed the launcher itself."""
    result = subprocess.run([sys.executable, "-c", LIGHTNINGS_OBSERVER_LOOKS_DURING_THE_KILL], cwd=ROOT, timeout=60)
    assert result.returncode == 4


THE_MAIN_THREAD_FAILS_DURING_THE_KILL = """
import subprocess, sys, threading, time
import app.reliability.watchdog as watchdog

real_send, killing = watchdog.send, threading.Event()


def slow_send(processes, signum):
    real_send(processes, signum)
    killing.set()
    time.sleep(0.5)  # the main thread's collective fails meanwhile: its peer is gone


watchdog.send = slow_send
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
threading.Thread(target=watchdog.end_process_tree, args=(4, False)).start()  # the stall watchdog
killing.wait()
watchdog.end_process_tree(1, stacks=False)  # run_and_exit, after the failed collective
"""


def test_the_first_thread_to_end_the_tree_chooses_the_exit_code() -> None:
    """The stall watchdog kills the ranks it started; the main thread's collective then fails and ends the tree too.
    Its exit 1 (CI) replaced the watchdog's 4, which the Slurm script requeues."""
    result = subprocess.run([sys.executable, "-c", THE_MAIN_THREAD_FAILS_DURING_THE_KILL], cwd=ROOT, timeout=60)
    assert result.returncode == 4


def fake_scontrol(folder: Path, body: str) -> Path:
    folder.mkdir()
    (folder / "scontrol").write_text(f"#!/bin/sh\n{body}\n")
    (folder / "scontrol").chmod(0o755)
    return folder


def test_the_job_requeueing_itself_is_not_undone_by_the_sigterm_its_requeue_sends(tmp_path: Path, monkeypatch,
                                                                                  capsys) -> None:
    """The requeue makes Slurm signal every process of the job's step, scontrol included. Where that SIGTERM came
    before the controller's answer (CI, a loaded node), the run said "requeue failed" for a job that was requeued."""
    bin_dir = fake_scontrol(tmp_path / "bin", 'kill -TERM $$; echo "$@" > "$(dirname "$0")/asked"')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    signals.requeue_slurm_job()
    assert capsys.readouterr().out == "Slurm job 7 requeued\n"
    assert (bin_dir / "asked").read_text() == "requeue 7\n"


def test_a_failed_requeue_says_what_scontrol_said_or_what_ended_it(tmp_path: Path, monkeypatch, capsys) -> None:
    refused = fake_scontrol(tmp_path / "refused",
                            'echo "Requested operation is presently disabled for job $2" >&2; exit 1')
    killed = fake_scontrol(tmp_path / "killed", "kill -KILL $$")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    for bin_dir in (refused, killed):
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        signals.requeue_slurm_job()
    assert capsys.readouterr().out.splitlines() == [
        "Slurm job 7 requeue failed (scontrol exit 1): Requested operation is presently disabled for job 7",
        "Slurm job 7 requeue failed (scontrol killed by SIGKILL)"]


@pytest.mark.slow
def test_a_stop_signal_to_the_launcher_alone_while_the_ranks_start_ends_them_too(tiny: TinySetup, tmp_path: Path):
    """`kill PID`, GNU timeout or a supervisor signal the launching process only. While it waits in the rendezvous,
    the rank it started used to be left waiting for it until --rendezvous_timeout_min (10 minutes by default)."""
    with launched(train_args(tiny, tmp_path / "run"), tmp_path / "run.log") as run:
        wait_for_ranks(run.process)
        run.process.send_signal(signal.SIGTERM)
        assert run.finish(timeout=30) == 128 + signal.SIGTERM, run.output()
        assert "Traceback" not in run.output(), run.output()
        assert "SIGTERM before training began: nothing to save yet, quitting (exit 143)" in run.output()
        run.assert_nothing_left(timeout=10)


INITIAL_VALIDATION = {"initial_validation": True, "eval_iters": 1000, "eval_batch_size": 1}
"""A validation before the first step that reads 131 rows one by one (1.5 s here)."""


@pytest.mark.slow
@pytest.mark.parametrize("when, devices", [("interpreter_starts", 2), ("ranks_start", 2), ("initial_validation", 1)])
def test_a_time_limit_warning_before_training_requeues_the_job_with_75(tiny: TinySetup, tmp_path: Path, when,
                                                                       devices):
    """SIGUSR1 (Slurm's `--signal=USR1@120`) before the first step ended the job by its default action, 138, which
    the Slurm scripts do not requeue, even with --requeue_on_signal true; or, from the model's loading on, it trained
    a step and saved, which a large model may not finish before the time limit. It now ends at once as a stop after a
    save (75), nothing trained since the latest checkpoint, and requeues the job; also when the warning came while
    the interpreter imported, before the options were known."""
    requeues = tmp_path / "requeues"
    bin_dir = fake_scontrol(tmp_path / "bin", f'echo "$@" >> {requeues}')
    slurm_job = {"SLURM_JOB_ID": "7", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    with launched(train_args(tiny, tmp_path / "run", requeue_on_signal=True, devices=devices, **INITIAL_VALIDATION),
                  tmp_path / "run.log", env=slurm_job, forked=devices == 1) as run:  # one process: the launcher
        if when == "ranks_start":
            wait_for_ranks(run.process)
        elif when == "initial_validation":
            run.wait_for(r"training \d+ steps of")
        else:
            while not catches(run.process.pid, signal.SIGUSR1):
                assert run.process.poll() is None, run.output()
                time.sleep(0.005)
            assert not [child for child in psutil.Process(run.process.pid).children()
                        if "train.py" in " ".join(child.cmdline())], "the ranks started already"
        run.process.send_signal(signal.SIGUSR1)
        assert run.finish(timeout=60) == EXIT_PREEMPTED, run.output()
        assert f"SIGUSR1 before training began: nothing new to save (exit {EXIT_PREEMPTED}); requeueing the Slurm " \
               "job, which resumes from its latest checkpoint" in run.output(), run.output()
        assert "Slurm job 7 requeued" in run.output() and "Traceback" not in run.output(), run.output()
        assert requeues.read_text() == "requeue 7\n" and not list_checkpoints(tmp_path / "run")
        run.assert_nothing_left(timeout=10)


@pytest.mark.slow
def test_a_preemption_before_the_first_step_quits_at_once(tiny: TinySetup, tmp_path: Path):
    """SIGTERM during the initial validation (or the model's loading) trained a step and saved before it stopped:
    with a large model, past the 30 s Slurm waits before its SIGKILL. Nothing is trained since the latest
    checkpoint, so the run quits at once."""
    with launched(train_args(tiny, tmp_path / "run", devices=1, **INITIAL_VALIDATION), tmp_path / "run.log",
                  forked=True) as run:  # one process, which takes the signal through the fork server's client
        run.wait_for(r"training \d+ steps of")
        run.process.send_signal(signal.SIGTERM)
        assert run.finish(timeout=30) == 128 + signal.SIGTERM, run.output()
        assert "SIGTERM before training began: nothing to save yet, quitting (exit 143)" in run.output(), run.output()
        assert "step 1" not in run.output() and not list_checkpoints(tmp_path / "run"), run.output()
        run.assert_nothing_left(timeout=10)


@pytest.mark.slow
def test_a_stop_signal_during_an_evaluation_stops_at_that_step_with_its_checkpoint(tiny: TinySetup, tmp_path: Path):
    """The ranks learnt of a signal only from the next step's verdict: one arriving during an evaluation (minutes
    with generation samples) or a save trained one more step and saved again (96 s after a SIGTERM, past Docker's
    10 s and Kubernetes' 30 s of grace). Then the evaluation itself was not cut short; it is now, within
    STOP_CHECK_BATCHES batches, and its partial loss is neither logged nor taken for the checkpoint's."""
    with launched(train_args(tiny, tmp_path / "run", eval_step_interval=2, eval_iters=1000, eval_batch_size=1,
                             save_step_interval=0), tmp_path / "run.log", forked=True) as run:
        run.wait_for_step(2)  # its line comes before the evaluation, which reads 131 rows one by one
        run.process.send_signal(signal.SIGTERM)
        assert run.finish() == EXIT_PREEMPTED, run.output()
        assert "step 2: stopped by a signal after saving" in run.output(), run.output()
        steps = [int(step) for step in STEP_LINE.findall(run.output())]
        assert list(list_checkpoints(tmp_path / "run")) == [2] and max(steps) == 2, run.output()
        assert "step 2: evaluation stopped by a signal (not logged)" in run.output(), run.output()
        assert "step 2: val_loss" not in run.output() and read_best(tmp_path / "run") is None, run.output()


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 1.0])
def test_a_launcher_killed_while_the_ranks_start_takes_them_with_it(tiny: TinySetup, tmp_path: Path, delay) -> None:
    """The launching process SIGKILLed (an out-of-memory kill) as its rank started: the rank waited for it until
    --rendezvous_timeout_min (10 minutes, holding its device), then blamed the other nodes; and for ever where its
    stderr was a pipe that died with the launcher (the line saying why raised BrokenPipeError in the thread that was
    to end it). A rank now ends with its launcher (app/tasks.py end_with_the_launcher): at once, or at its start
    where the launcher died first."""
    process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *train_args(tiny, tmp_path / "run")],
                               cwd=ROOT, env=run_environment(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        ranks = wait_for_ranks(process)
        time.sleep(delay)
        process.kill()
        process.wait()
        process.stdout.close()
        process.stderr.close()  # the rank's stderr: a pipe without its reader
        gone, alive = psutil.wait_procs(ranks, timeout=20)
        assert not [rank for rank in alive if rank.status() != psutil.STATUS_ZOMBIE], "the rank outlived its launcher"
    finally:
        kill_session(process.pid)


def test_a_run_that_outlives_its_timeout_fails_with_where_its_processes_were_and_leaves_none_running() -> None:
    """The tests' harness (conftest.run_script) as CI met it: the launching process had exited and a rank it
    started hung, holding the output pipes open."""
    rank = "import time; time.sleep(300)  # the rank left behind"
    launcher = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {rank!r}]); print('launched')"
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_script([sys.executable, "-c", launcher], timeout=3)
    assert "did not finish in 3 s" in str(failure.value) and "launched" in str(failure.value)
    assert "exited" in str(failure.value) and "Thread" in str(failure.value), str(failure.value)
    assert not [p for p in psutil.process_iter(["cmdline"]) if rank in " ".join(p.info["cmdline"] or [])]
    assert time.monotonic() - started < 60


def test_ctrl_c_before_the_first_step_says_that_it_quits(monkeypatch) -> None:
    """During the initial validation (or the model's loading) Ctrl-C quits at once, as documented, but the user saw
    exit 130 and no line at all; during training it stops after the step, with its own line."""
    said = []
    monkeypatch.setattr(signals, "say", said.append)

    def end_process_tree(code: int, stacks: bool) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(signals, "end_process_tree", end_process_tree)
    stop = signals.StopRequest()
    stop.announce = True
    with pytest.raises(SystemExit) as ended:
        stop._interrupt()
    assert ended.value.code == EXIT_INTERRUPTED
    assert said == [f"\nCtrl-C before the first step: nothing to save yet, quitting (exit {EXIT_INTERRUPTED})\n"]
    training = signals.StopRequest()
    training.announce, training.training = True, True
    training._interrupt()
    assert said[-1] == f"\n{INTERRUPT_MESSAGE}\n" and training.interrupted


def test_what_a_run_made_is_released_before_its_teardown_begins(monkeypatch) -> None:
    """The model holds the process groups (DDP's reducer, FSDP's units): if it outlived the teardown, destroying
    the groups would happen as the launcher's frames unwind, unbounded, where a join of gloo's threads once hung a
    finished run for good. Here the model is held by a reference cycle, as wrapped models often are."""
    seen = {}

    class Model:
        pass

    def train(fabric: object, name: str) -> int:
        model = Model()
        model.itself = model
        seen["model"] = weakref.ref(model)
        return EXIT_PREEMPTED

    monkeypatch.setattr(signals, "exit_run", lambda fabric, code: seen.update(alive=seen["model"]() is not None,
                                                                              code=code))
    gc.disable()  # only run_and_exit may collect it
    try:
        signals.run_and_exit(object(), train, "run")
    finally:
        gc.enable()
    assert seen == {"model": seen["model"], "alive": False, "code": EXIT_PREEMPTED}


def test_an_exception_in_the_launching_rank_ends_the_ranks_it_started_with_exit_1() -> None:
    """Lightning's launcher starts ranks 1..N as children of rank 0; if rank 0 raised and exited alone, they would
    wait in their next collective until the process group timeout (NCCL does not notice a dead peer)."""
    rank = "import time; time.sleep(300)  # a rank the launcher started"
    launcher = ("import subprocess, sys\nfrom app.reliability.signals import run_and_exit\n"
                f"child = subprocess.Popen([sys.executable, '-c', {rank!r}])\n"
                "print(child.pid, flush=True)\n"
                "def work(fabric):\n    raise RuntimeError('CUDA out of memory, say')\n"
                "run_and_exit(None, work)\n")
    result = subprocess.run([sys.executable, "-c", launcher], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_CRASHED, result.stderr
    assert "RuntimeError: CUDA out of memory, say" in result.stderr
    time.sleep(0.2)
    assert not psutil.pid_exists(int(result.stdout)) or psutil.Process(int(result.stdout)).status() == "zombie"


@pytest.mark.parametrize("raised", [
    "torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 9.06 MiB is free. If reserved but unallocated memory is large try setting ...')",
    "RuntimeError('[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can\\'t allocate memory: you tried "
    "to allocate 106518744 bytes. Error code 12 (Cannot allocate memory)')"], ids=["cuda", "cpu"])
def test_running_out_of_memory_is_one_line_saying_what_to_change(raised: str) -> None:
    """A CUDA or host OOM was a 45-line traceback on every rank, without a word on what to change."""
    launcher = ("import types, torch\nfrom app.reliability.signals import run_and_exit\n"
                f"def work(fabric):\n    raise {raised}\n"
                "run_and_exit(types.SimpleNamespace(global_rank=1), work)\n")
    result = subprocess.run([sys.executable, "-c", launcher], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_CRASHED, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith("rank 1: out of memory (") and line.endswith(
        "): lower --micro_batch_size (the global batch stays, through more accumulation) or --eval_batch_size, or add "
        "--gradient_checkpointing true; --estimate_memory true plans what a run needs"), line
    assert "If reserved" not in line and ("Tried to allocate 2.00 GiB" in line or "106518744 bytes" in line)


@pytest.mark.parametrize("raised, said", [
    ("RuntimeError('DataLoader worker (pid(s) 4242) exited unexpectedly')",  # 55 lines, SIGKILL never said
     "rank 1: a data loader worker (pid 4242) exited unexpectedly, as the out-of-memory killer ends one (see `dmesg`): "
     "lower --num_workers or --micro_batch_size"),
    ("RuntimeError(\"can't start new thread\")",  # up to 108 lines from the ranks and their workers
     "rank 1: the system refused a new thread: the limit on processes and threads is reached (a cgroup's pids.max, "
     "docker's --pids-limit, ulimit -u); lower --num_workers, or raise the limit"),
    ("OSError(24, 'Too many open files')", "rank 1: too many open files (the limit, `ulimit -n`, is ")],
    ids=["loader worker", "threads", "files"])
def test_what_ends_a_rank_from_outside_is_one_line_naming_it(raised: str, said: str) -> None:
    launcher = ("import types\nfrom app.reliability.signals import run_and_exit\n"
                f"def work(fabric):\n    raise {raised}\n"
                "run_and_exit(types.SimpleNamespace(global_rank=1), work)\n")
    result = subprocess.run([sys.executable, "-c", launcher], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_CRASHED, result.stderr
    assert result.stderr.strip().splitlines()[0].startswith(said) and "Traceback" not in result.stderr, result.stderr


def test_a_teardown_that_hangs_is_left_after_its_timeout_with_the_runs_exit_code() -> None:
    """The ranks' last meeting and destroy_process_group can hang at exit (rarely): the rank must still leave, with
    the run's exit code, and say where it was stuck."""
    teardown = ("import time\nfrom app.reliability.signals import run_or_leave\n"
                "run_or_leave(lambda: None, 5, 9)\nprint('returned', flush=True)\n"
                "run_or_leave(lambda: time.sleep(120), 0.5, {code})\nprint('not reached')\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", teardown.format(code=EXIT_PREEMPTED)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_PREEMPTED, result.stderr
    assert result.stdout == "returned\n"
    assert f"did not return within 0.5 s; exiting without it (exit {EXIT_PREEMPTED})" in result.stderr
    assert 'File "<string>", line 5 in <lambda>' in result.stderr, result.stderr
    assert time.monotonic() - started < 30


def test_leaving_skips_the_interpreters_teardown_but_not_what_it_owes() -> None:
    """A rank leaves with os._exit after its run: a thread still working, an idle thread pool (torch.compile leaves
    one), an exit handler (W&B's finish is one) and output still in the buffer of a pipe must all have had their turn,
    and the exit code must be the run's."""
    leaving = ("import atexit, threading, time\nfrom concurrent.futures import ThreadPoolExecutor\n"
               "from app.reliability.signals import leave\n"
               "atexit.register(print, 'exit handler ran')\n"
               "ThreadPoolExecutor(2).submit(print, 'pool idle').result()\n"
               "threading.Thread(target=lambda: (time.sleep(0.5), print('thread finished'))).start()\n"
               "print('buffered', end=' ')\nleave(9)\nprint('not reached')\n")
    result = subprocess.run([sys.executable, "-c", leaving], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 9, result.stderr
    assert result.stdout == "pool idle\nbuffered thread finished\nexit handler ran\n"


@pytest.mark.parametrize("holder_host", ["here", "elsewhere"])
def test_a_folder_locked_here_is_refused_at_once_and_one_locked_from_another_machine_after_a_wait(holder_host,
                                                                                                  tmp_path):
    """A run on this machine holds its lock as long as it lives; one from another machine may have crashed, its lock
    held by a network filesystem until the lease ends while Slurm requeues the run elsewhere: waited for, then
    refused. A lock released during the wait is taken."""
    import fcntl
    import socket
    import threading

    from app.checkpoint.files import HELD_LOCKS, LOCK_FILE, claim_run_folder

    tmp_path.joinpath(LOCK_FILE).write_text("")
    holder = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    host = socket.gethostname() if holder_host == "here" else "node-that-crashed"
    os.write(holder, f"pid 4242 on {host}\n".encode())
    said: list[str] = []
    start = time.monotonic()
    refusal = claim_run_folder(tmp_path, said.append, wait_s=0.6, poll_s=0.1)
    assert refusal == f"--out_dir {tmp_path} is in use by another run (pid 4242 on {host}); wait for it to end, " \
                      "or choose another --out_dir"
    assert (time.monotonic() - start < 0.5) == (holder_host == "here") and len(said) == (holder_host != "here")
    if holder_host == "here":
        os.close(holder)
        return
    threading.Timer(0.3, os.close, [holder]).start()
    assert claim_run_folder(tmp_path, said.append, wait_s=30, poll_s=0.1) is None
    os.close(HELD_LOCKS.pop())


def test_a_node_sees_the_lock_only_in_the_folder_rank_0_holds(tmp_path):
    """What each node's first rank looks for in its --out_dir: rank 0's own line. Another process's line answers at
    once; a missing lock only after the wait (an NFS client may still hold the folder's older listing), and it is
    taken when it appears meanwhile."""
    import threading

    from app.checkpoint.files import HELD_LOCKS, LOCK_FILE, claim_run_folder, holder_line, sees_lock

    shared, other, missing = tmp_path / "shared", tmp_path / "other", tmp_path / "missing"
    assert claim_run_folder(shared) is None
    other.mkdir()
    (other / LOCK_FILE).write_text("pid 4242 on another-node\n")
    start = time.monotonic()
    assert sees_lock(shared, holder_line(), wait_s=5) and not sees_lock(other, holder_line(), wait_s=5)
    assert time.monotonic() - start < 1
    assert not sees_lock(missing, holder_line(), wait_s=0.3, poll_s=0.1) and not missing.exists()
    threading.Timer(0.3, lambda: (missing.mkdir(), (missing / LOCK_FILE).write_text(holder_line()))).start()
    assert sees_lock(missing, holder_line(), wait_s=10, poll_s=0.1)
    os.close(HELD_LOCKS.pop())


@pytest.mark.slow
def test_a_second_run_in_the_same_out_dir_is_refused_while_the_first_runs(tiny: TinySetup, tmp_path: Path):
    """The same job submitted twice, both with --resume true as the Slurm scripts pass it: the second resumed from a
    checkpoint the first was deleting (--keep_last_n) and ended with a traceback (CheckpointError: ...
    FileNotFoundError), or wrote the same checkpoint names. Refused in one line now; the first goes on."""
    out = tmp_path / "run"
    args = train_args(tiny, out, devices=1, strategy="single_device", gradient_accumulation_steps=None, max_step=300,
                      save_step_interval=1, keep_last_n=1, eval_step_interval=100, resume=True)
    with launched(args, tmp_path / "first.log") as first:
        first.wait_for_step(2)
        second = run_train(args)
        assert second.returncode == EXIT_BAD_INPUT, second.stdout[-3000:] + second.stderr[-3000:]
        assert f"error: --out_dir {out} is in use by another run (pid {first.process.pid} on " in second.stderr
        assert "Traceback" not in second.stderr and first.process.poll() is None, first.output()


@pytest.mark.slow
def test_non_finite_loss_stops_without_saving_corrupted_weights(tiny: TinySetup, tmp_path: Path):
    out = tmp_path / "run"
    result = run_train(train_args(tiny, out, lr=1e30, min_lr=0, warmup_steps=0, grad_clip=0, max_step=8,
                                  save_step_interval=1, wandb_mode="offline"))
    assert result.returncode == EXIT_NON_FINITE, result.stdout + result.stderr
    bad_step = int(re.search(r"step (\d+): non-finite values", result.stdout).group(1))
    assert re.search(r"non-finite values \(loss \S+( on [12] of 2 ranks)?, gradient norm \S+\); stopped without "
                     r"applying this step or saving it\. Resume from the last checkpoint with a lower --lr or a "
                     r"--grad_clip$", result.stdout, re.MULTILINE), result.stdout[-2000:]
    (logged,) = wandb_records(out)
    assert logged.exit_codes == [EXIT_NON_FINITE], "W&B recorded exit 0 for every run, stopped or not"
    assert max(logged.steps) == bad_step - 1
    assert "Traceback" not in result.stderr
    checkpoints = list_checkpoints(out)
    assert max(checkpoints) == bad_step - 1
    for path in checkpoints.values():
        assert all(torch.isfinite(t).all() for t in model_tensors(path).values())


def test_a_non_finite_first_step_blames_the_weights_not_the_learning_rate(tiny: TinySetup, tmp_path: Path):
    """Rank 1's NaN was shown as rank 0's finite part of the loss, and the advice was a lower --lr and a --grad_clip
    (already set) from a checkpoint none had saved, for a step that no learning rate had touched."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    with torch.no_grad():
        model.model.embed_tokens.weight[5:].fill_(float("nan"))
    model.save_pretrained(tmp_path / "model")
    result = run_train(train_args(tiny, tmp_path / "run", model_config=None, model_name=tmp_path / "model",
                                  grad_clip=1.0))
    assert result.returncode == EXIT_NON_FINITE, result.stdout[-2000:] + result.stderr[-2000:]
    assert ("step 1: non-finite values (loss nan on 2 of 2 ranks, gradient norm nan); stopped without applying this "
            "step or saving it. No update has been applied yet, so the learning rate is not the cause: look at the "
            "model's weights (non-finite values in them?), its --precision, and the data\n") in result.stdout


WAITED_FOR = """
import sys
from dataclasses import replace
from arguments import Config
from app.metrics.loggers import WandbMetrics
logger = WandbMetrics(replace(Config(), out_dir=sys.argv[1], wandb_mode="offline", stall_timeout_min=2.5), False)
print("finish_timeout", logger.experiment.settings.finish_timeout)
logger.finish(0)
"""


@pytest.mark.parametrize("variable, waited", [(None, 150.0), ("7", 7.0)])
def test_the_wandb_uploads_left_at_the_end_are_waited_for_the_stall_timeout_unless_wandb_is_told(
        tmp_path: Path, variable: str | None, waited: float) -> None:
    """wandb's finish waits for its uploads for ever by default: a finished run whose network had gone held its
    nodes (wandb/wandb#5601, #6625), where a run that stalls in training is ended after --stall_timeout_min."""
    env = {name: value for name, value in run_environment({"WANDB_MODE": "offline"}).items()
           if name != "WANDB_FINISH_TIMEOUT"} | ({"WANDB_FINISH_TIMEOUT": variable} if variable else {})
    result = run_script([sys.executable, "-c", WAITED_FOR, str(tmp_path / "run")], timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"finish_timeout {waited}" in result.stdout, result.stdout


def test_keep_last_n_keeps_the_best_and_the_resumed_checkpoint(tmp_path: Path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step, val_loss in [(2, 3.0), (4, 2.5), (6, 2.9), (8, 2.7), (10, 2.8)]:
        path = folder / f"step-{step:08d}.ckpt"
        path.write_bytes(b"x")
        mark_if_best(path, val_loss)
    assert read_best(tmp_path) == {"checkpoint": "step-00000004.ckpt", "step": 4, "val_loss": 2.5, "evaluated": {
        "step-00000002.ckpt": 3.0, "step-00000004.ckpt": 2.5, "step-00000006.ckpt": 2.9, "step-00000008.ckpt": 2.7,
        "step-00000010.ckpt": 2.8}}
    deleted = prune_checkpoints(tmp_path, 2, protected={folder / "step-00000002.ckpt"})
    assert [p.name for p in deleted] == ["step-00000006.ckpt"]
    assert sorted(list_checkpoints(tmp_path)) == [2, 4, 8, 10]
    assert read_best(tmp_path)["evaluated"] == {"step-00000002.ckpt": 3.0, "step-00000004.ckpt": 2.5,
                                                "step-00000008.ckpt": 2.7, "step-00000010.ckpt": 2.8}, "still there"
    assert prune_checkpoints(tmp_path, None, set()) == []


def test_a_resume_from_an_older_checkpoint_keeps_the_best_of_the_checkpoints_left(tmp_path: Path):
    """best.json named a checkpoint the resume set aside: the next evaluation was marked best whatever its loss, and
    --keep_last_n then deleted the better checkpoints left (a resumed run's val_loss 36.7 replaced 5.58's)."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step, val_loss in [(2, 3.0), (4, 2.5), (6, 2.9), (8, 2.0)]:
        (folder / f"step-{step:08d}.ckpt").write_bytes(b"x")
        mark_if_best(folder / f"step-{step:08d}.ckpt", val_loss)
    set_aside_newer(tmp_path, 6)
    assert read_best(tmp_path)["checkpoint"] == "step-00000004.ckpt"
    assert json.loads((folder / "rolled-back" / "best.json").read_text())["checkpoint"] == "step-00000008.ckpt"
    (folder / "step-00000008.ckpt").write_bytes(b"again")
    mark_if_best(folder / "step-00000008.ckpt", 36.7)
    assert read_best(tmp_path)["checkpoint"] == "step-00000004.ckpt"
    assert [p.name for p in prune_checkpoints(tmp_path, 1, protected=set())] == ["step-00000002.ckpt",
                                                                                 "step-00000006.ckpt"]
    (folder / "best.json").write_text(json.dumps({"checkpoint": "step-00000004.ckpt", "step": 4, "val_loss": 2.5}))
    mark_if_best(folder / "step-00000008.ckpt", 2.4)  # a best.json of an earlier version, without `evaluated`
    assert read_best(tmp_path)["evaluated"] == {"step-00000004.ckpt": 2.5, "step-00000008.ckpt": 2.4}


def test_best_json_compares_losses_measured_on_the_same_rows_only(tmp_path: Path):
    """Resumed with --eval_iters 1 where the run had evaluated with 5, best.json kept step 40 (3.7594 over 20 rows)
    over step 44 (3.8020 over 4), though 44 was the better on either set of rows, and --keep_last_n kept 40: losses
    measured on other rows start a new comparison. The same rows still compare: a data folder moved and renamed, or
    another layout reading as many (--eval_iters 10 on 1 rank for 5 on 2)."""
    from app.checkpoint.io import validation_measured

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    metadata = {"config": {"eval_iters": 5, "micro_batch_size": 2}, "rng": [0, 1],
                "data_folders": [{"name": "data", "path": "/old/data", "stats_sha256": "s", "train_rows": 9,
                                  "validation_rows": 20}]}
    moved = metadata | {"data_folders": [metadata["data_folders"][0] | {"path": "/new/copy", "name": "copy"}],
                        "config": {"eval_iters": 10, "micro_batch_size": 2}, "rng": [0]}
    fewer = moved | {"config": {"eval_iters": 1, "micro_batch_size": 2}}
    assert validation_measured(moved) == validation_measured(metadata) != validation_measured(fewer)
    for step, val_loss, measured in [(20, 3.9, metadata), (40, 3.7594, moved), (44, 3.8020, fewer)]:
        (folder / f"step-{step:08d}.ckpt").write_bytes(b"x")
        mark_if_best(folder / f"step-{step:08d}.ckpt", val_loss, validation_measured(measured))
        if step == 40:
            assert read_best(tmp_path)["checkpoint"] == "step-00000040.ckpt"
    best = read_best(tmp_path)
    assert (best["checkpoint"], best["evaluated"]) == ("step-00000044.ckpt", {"step-00000044.ckpt": 3.8020})
    assert [p.name for p in prune_checkpoints(tmp_path, 1, protected=set())] == ["step-00000020.ckpt",
                                                                                 "step-00000040.ckpt"]


class SmallStorage:
    """A tmpfs of `kilobytes` mounted at `folder` (root only: CI and the development machines run as root), grown
    in place."""

    def __init__(self, folder: Path, kilobytes: int) -> None:
        self.folder = folder
        folder.mkdir(parents=True)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kilobytes}k", "tmpfs", str(folder)],
                                 capture_output=True, text=True)
        if mounted.returncode:
            pytest.skip(f"a small filesystem needs mount (root): {mounted.stderr.strip()}")

    def grow(self, kilobytes: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={kilobytes}k", str(self.folder)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "--lazy", str(self.folder)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, state_dict_type, async_save, max_step",
                         [("fsdp", "full", False, 6), ("fsdp2", "sharded", True, 4)])
def test_a_full_disk_stops_every_rank_at_the_save_in_one_line_and_the_run_resumes_once_there_is_room(
        tiny: TinySetup, tmp_path: Path, strategy: str, state_dict_type: str, async_save: bool, max_step: int):
    """ENOSPC during a save ended the run with the writing rank's traceback and the others' "connection closed by
    peer" (exit 1), and its partial checkpoint stayed on the full disk. The background save of the last step fails
    once the loop is over (it was a traceback after the fix, found by review)."""
    out = tmp_path / "run"
    storage = SmallStorage(checkpoint_dir(out), kilobytes=2500)  # one checkpoint of the tiny model (1.5 MB), not two
    try:
        args = train_args(tiny, out, strategy=strategy, state_dict_type=state_dict_type, async_save=async_save,
                          max_step=max_step, save_step_interval=2, eval_step_interval=100)
        result = run_train(args)
        assert result.returncode == EXIT_SAVE_FAILED, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and "ended first" not in result.stderr, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.stderr[-3000:]
        assert "step-00000004.ckpt was not saved: rank " in errors[0]
        assert "No space left on device (ENOSPC) writing" in errors[0] and "--resume true" in errors[0]
        assert sorted(path.name for path in checkpoint_dir(out).iterdir()) == ["step-00000002.ckpt"]
        storage.grow(kilobytes=20_000)
        resumed = run_train(args + ["--resume", "true"])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [int(step) for step in STEP_LINE.findall(resumed.stdout)] == list(range(3, max_step + 1))
        assert sorted(list_checkpoints(out)) == list(range(2, max_step + 1, 2))
    finally:
        storage.unmount()


def test_a_side_file_the_disk_refuses_is_one_warning_until_it_is_written_again_and_never_half_a_line(
        tmp_path: Path, capsys):
    """metrics.csv's row, rows.jsonl, the samples, quarantine.jsonl and summary.json met a full disk (another job
    filled it between saves) with rank 0's traceback, the other ranks' "connection closed by peer". Now a row is left
    out with one warning until the file is written again (the next save meets the full disk and stops the run in one
    line), and what was cut off part way is cut off whole."""
    from app.folders import append_whole, written_or_warned

    storage = SmallStorage(tmp_path / "storage", kilobytes=64)
    try:
        metrics = storage.folder / "metrics.csv"
        append_whole(metrics, "step,train_loss\n")
        filler = storage.folder / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as handle:
            while True:
                handle.write(bytes(1 << 12))
                handle.flush()
        row = "7," + "1" * 20_000 + "\n"  # more than the page the file has: written in part, then refused
        for _ in range(3):
            assert not written_or_warned(metrics, lambda: append_whole(metrics, row))
        assert metrics.read_text() == "step,train_loss\n", "nothing of the rows"
        filler.unlink()
        assert written_or_warned(metrics, lambda: append_whole(metrics, row))
        assert metrics.read_text() == "step,train_loss\n" + row
    finally:
        storage.unmount()
    assert capsys.readouterr().err.splitlines() == [
        f"warning: No space left on device (ENOSPC) writing {metrics}; the run goes on without it until it can be "
        "written again", f"{metrics} is written again"]
    with pytest.raises(IsADirectoryError):  # not the storage's state: a run set up wrong still ends
        written_or_warned(tmp_path, lambda: append_whole(tmp_path, "row\n"))


GLOO_WAITER = """
import sys, time, datetime, torch.distributed as dist
from app.reliability.signals import collective_timed_out, peer_ended
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=2))
if rank == 1:
    time.sleep(8)  # a rank frozen before the first step (a hung filesystem while loading the model)
else:
    try:
        dist.all_gather_object([None, None], "ready")
    except RuntimeError as error:
        print(collective_timed_out(error), peer_ended(error))
"""


def test_a_collective_that_waited_out_the_process_group_timeout_is_told_from_a_peer_that_ended() -> None:
    """Torch's own gloo error for a rank that never came (before the stall watchdog is armed): it was a traceback
    and exit 1, not requeued; it is a stall now, exit 4."""
    port = str(free_port())
    frozen = subprocess.Popen([sys.executable, "-c", GLOO_WAITER, "1", port], cwd=ROOT)
    try:
        waiting = subprocess.run([sys.executable, "-c", GLOO_WAITER, "0", port], cwd=ROOT, capture_output=True,
                                 text=True, timeout=120)
    finally:
        frozen.kill()
    assert waiting.stdout.split() == ["True", "False"], waiting.stdout + waiting.stderr[-2000:]


def test_a_pruned_checkpoint_folder_is_never_seen_half_deleted(tmp_path: Path, monkeypatch):
    """A sharded checkpoint is a folder, deleted file by file: it leaves its name first (renamed to the hidden name
    remove_leftovers knows), so that a reader in that moment finds it whole or gone."""
    import shutil

    import app.checkpoint.files as files

    folder = tmp_path / "checkpoints"
    for step in (2, 4):
        (folder / f"step-{step:08d}.ckpt").mkdir(parents=True)
        (folder / f"step-{step:08d}.ckpt" / "__0_0.distcp").write_bytes(b"x")
    seen_while_deleting = []
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        seen_while_deleting.append((Path(path).name, sorted(list_checkpoints(tmp_path))))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(files.shutil, "rmtree", rmtree)
    assert [path.name for path in prune_checkpoints(tmp_path, 1, protected=set())] == ["step-00000002.ckpt"]
    assert seen_while_deleting == [(".step-00000002.ckpt.replaced", [4])]
    assert sorted(path.name for path in folder.iterdir()) == ["step-00000004.ckpt"]


def test_a_killed_writers_half_written_folder_is_removed_by_the_next_writer_on_its_machine(tmp_path: Path):
    """prepare_data.py and convert_to_hf.py write their folder under a hidden name beside it: one killed (SIGKILL,
    an out-of-memory kill, a node's end) left that half-written dataset or model there for good."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = socket.gethostname()
    names = {"killed": f".data.partial-{host}-{ended.pid}-0a1b2c3d", "retired": f".data.replaced-{host}-{ended.pid}-0",
             "live": f".data.partial-{host}-{os.getppid()}-0a1b2c3d", "elsewhere": f".data.partial-other-{ended.pid}-0",
             "another output": f".data2.partial-{host}-{ended.pid}-0"}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard").write_bytes(b"x")
    staging = staging_folder(tmp_path / "data")
    assert staging.name.startswith(f".data.partial-{host}-{os.getpid()}-") and not staging.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        names[kept] for kept in ("live", "elsewhere", "another output"))


def test_a_folder_replaced_again_after_a_crash_mid_swap_is_published(tmp_path: Path):
    """A crash between the swap and the removal leaves the old folder as `.model.replaced`: the next conversion to
    the same folder failed to rename the current one onto it (Directory not empty)."""
    (tmp_path / "model").mkdir()
    (tmp_path / ".model.replaced").mkdir()
    (tmp_path / ".model.replaced" / "model.safetensors").write_bytes(b"old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "model.safetensors").write_bytes(b"new")
    publish(tmp_path / "new", tmp_path / "model")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == b"new"


def test_keep_last_n_removes_a_linked_checkpoint_but_not_what_it_links_to(tmp_path: Path):
    """A checkpoint of another run linked into checkpoints/ to resume from it: pruning it used to end the run with
    'OSError: Cannot call rmtree on a symbolic link' (a sharded folder), and must not delete the other run's."""
    other = tmp_path / "other" / "step-00000002.ckpt"
    other.mkdir(parents=True)
    (other / "__0_0.distcp").write_bytes(b"x")
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / other.name).symlink_to(other)
    for step in (4, 6):
        (folder / f"step-{step:08d}.ckpt").write_bytes(b"x")
    deleted = prune_checkpoints(tmp_path / "run", 1, protected=set())
    assert [path.name for path in deleted] == ["step-00000002.ckpt", "step-00000004.ckpt"]
    assert sorted(list_checkpoints(tmp_path / "run")) == [6] and (other / "__0_0.distcp").is_file()


def test_a_rollback_moves_the_checkpoints_of_the_abandoned_stretch_where_resume_does_not_look(tmp_path: Path):
    """A rollback may pass over checkpoints whose validation loss had begun to rise; left in place, the newest of them
    was what --resume true continued from after a crash, undoing the rollback."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (2, 4, 8):
        (folder / f"step-{step:08d}.ckpt").write_bytes(b"x")
    (folder / "step-00000006.ckpt").mkdir()  # a sharded one
    (folder / "step-00000006.ckpt" / "__0_0.distcp").write_bytes(b"x")
    moved = set_aside_newer(tmp_path, 4)
    assert [path.name for path in moved] == ["step-00000006.ckpt", "step-00000008.ckpt"]
    assert sorted(list_checkpoints(tmp_path)) == [2, 4] and latest_checkpoint(tmp_path).name == "step-00000004.ckpt"
    assert (folder / "rolled-back" / "step-00000006.ckpt" / "__0_0.distcp").is_file()
    (folder / "step-00000008.ckpt").write_bytes(b"again")  # the same step saved again, and rolled back again
    mark_if_best(folder / "step-00000008.ckpt", 2.0)
    samples = tmp_path / "samples"
    for step in (4, 6, 8):
        write_samples(samples / f"step-{step:08d}.jsonl", ["prompt"], ["reference"], [f"at step {step}"])
    (samples / "step-00000008 (copy).jsonl").write_text("a user's copy\n")  # not the run's: left where it is
    set_aside_newer(tmp_path, 4)
    assert (folder / "rolled-back" / "step-00000008.ckpt").read_bytes() == b"x", "the first copy is kept"
    assert (folder / "rolled-back" / "step-00000008-2.ckpt").read_bytes() == b"again"
    assert read_best(tmp_path) is None, "best.json named a checkpoint set aside"
    moved = set_aside_samples_after(tmp_path, 4)
    assert [path.name for path in moved] == ["step-00000006.jsonl", "step-00000008.jsonl"]
    assert latest_samples(tmp_path).name == "step-00000004.jsonl", "show_samples.py shows the run it continues"


SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}


def start_task(code: str, rank: int, srun: bool = True) -> subprocess.Popen:
    """A Python process that runs `code` as srun's task `rank` of 2 (or outside srun)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("SLURM_", "TORCHELASTIC"))}
    env |= (SRUN_TASK | {"SLURM_PROCID": str(rank)}) if srun else {}
    return subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); {code}"],
                            env=env, stderr=subprocess.PIPE, text=True)


REFUSE = "import app.tasks as tasks; tasks.FIRST_REPORTS_S = 4; tasks.exit_refused(['error: --x 1: wrong'])"


@pytest.mark.parametrize("rank, ended_by_srun, reports", [(0, False, True), (1, True, False), (1, False, True)])
def test_a_refused_input_is_reported_once_by_the_first_srun_task_and_exits_2(rank, ended_by_srun, reports) -> None:
    """Each of srun's tasks checks the same inputs: the log held the line once per task, and srun, which ends the
    other tasks when one fails and exits with the highest code, reported 143 for the tasks it ended as often as 2.
    The first task reports at once; another waits for srun to end it, then exits 2 in silence, or, not ended (the
    first task found nothing wrong: this node's own problem), reports after FIRST_REPORTS_S."""
    started = time.monotonic()
    task = start_task(REFUSE, rank)
    if ended_by_srun:
        time.sleep(2)
        task.send_signal(signal.SIGTERM)
    _, stderr = task.communicate(timeout=60)
    seconds = time.monotonic() - started
    assert task.returncode == EXIT_BAD_INPUT
    assert stderr == ("error: --x 1: wrong\n" if reports else ""), stderr
    assert (seconds >= 4) is (rank != 0 and not ended_by_srun), seconds


@pytest.mark.parametrize("srun, code", [(True, 1), (False, -signal.SIGTERM)])
def test_an_srun_task_that_sigterm_ends_before_training_exits_1_so_the_failed_tasks_code_is_the_jobs(srun, code):
    """srun reports the highest code of its tasks: a rendezvous timeout's 5 (requeued by slurm/train.sbatch) became
    143 from the tasks srun ended. Outside srun, SIGTERM keeps its default action."""
    task = start_task("from app.tasks import end_quietly_when_srun_ends_the_task as e; e(); "
                      "print('ready', file=sys.stderr, flush=True); import time; time.sleep(60)", rank=1, srun=srun)
    assert task.stderr.readline() == "ready\n"
    task.send_signal(signal.SIGTERM)
    assert task.wait(timeout=30) == code
    assert task.stderr.read() == ""


@pytest.mark.parametrize("env, first", [({"TORCHELASTIC_RUN_ID": "7", "RANK": "2", "LOCAL_RANK": "0"}, False),
                                        ({"TORCHELASTIC_RUN_ID": "7", "RANK": "0", "LOCAL_RANK": "0"}, True),
                                        ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False), ({}, True),
                                        ({**SRUN_TASK, "SLURM_PROCID": "1"}, False)])
def test_only_the_runs_first_process_requeues_the_job(env, first, monkeypatch) -> None:
    """A time-limit warning before training: under torchrun every node's first worker requeued the job."""
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert signals.first_of_the_run() is first


@pytest.mark.parametrize("text", ["{bad", "", "{}", '{"checkpoint": 3}'])
def test_a_best_json_cut_short_or_edited_is_read_as_none_and_written_again(tmp_path, text) -> None:
    """Every resume read it (set_aside_newer) and ended in a JSONDecodeError or KeyError traceback after the launch."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "step-00000004.ckpt").write_text("a checkpoint")
    (folder / "best.json").write_text(text)
    assert read_best(tmp_path) is None and set_aside_newer(tmp_path, 4) == []
    mark_if_best(folder / "step-00000004.ckpt", 2.5)
    assert read_best(tmp_path)["checkpoint"] == "step-00000004.ckpt"


def test_a_wandb_run_id_wandb_would_refuse_is_named_before_the_resume_moves_anything(tmp_path) -> None:
    from app.training.preflight.wandb_options import run_id_problem

    (tmp_path / "wandb_run_id").write_text("bad id/x\n")
    assert run_id_problem(tmp_path / "wandb_run_id") == (
        f"{tmp_path / 'wandb_run_id'} holds 'bad id/x', not a W&B run id (none holds any of :;,#?/'); write the id of "
        "the W&B run to continue, or delete the file to start a new one")
    for fine in ("3xk9v2ab\n", "\n"):
        (tmp_path / "wandb_run_id").write_text(fine)
        assert run_id_problem(tmp_path / "wandb_run_id") is None


def test_exit_hooks_run_once_and_one_that_exits_stops_neither_the_others_nor_the_exit() -> None:
    """wandb.teardown may sys.exit with its service's code inside the hook: the thread died without saying it was
    done, and exit_run, which waits for the hooks without a limit (a run's last uploads), would have waited for ever."""
    from app.reliability import watchdog

    seen: list[int] = []

    def exits(code: int) -> None:
        raise SystemExit(3)

    watchdog.before_exit(exits)
    watchdog.before_exit(seen.append)
    watchdog.run_exit_hooks(7, None)
    watchdog.run_exit_hooks(8, None)
    assert seen == [7], "each hook once, with the first exit's code"


def test_an_srun_task_warned_before_training_waits_for_srun_to_end_it(monkeypatch) -> None:
    """Task 1 of an srun step warned (SIGUSR1) before training waits for task 0 to say it and requeue, then for
    srun's SIGTERM: a SIGTERM read with the warning or after it ends the wait, another SIGUSR1 (`scancel --full`)
    does not, nothing ends it after FIRST_REPORTS_S; task 0 and a task of no srun step quit at once. Training that
    begins meanwhile stops at a step boundary instead (it quit mid-training)."""
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(signals, "FIRST_REPORTS_S", 0.5)
    usr1, term = signal.SIGUSR1, signal.SIGTERM

    def waited(pending: bytes = b"", later: bytes = b"") -> tuple[int, float]:
        read_end, write_end = os.pipe()
        writer = threading.Timer(0.1, os.write, (write_end, later)) if later else None
        if writer:
            writer.start()
        started = time.monotonic()
        signum = signals.after_the_first_task(usr1, read_end, pending)
        os.close(read_end), os.close(write_end)
        return signum, time.monotonic() - started

    assert waited(pending=bytes([term]))[0] == term
    signum, seconds = waited(later=bytes([usr1, term]))
    assert signum == term and seconds < 0.4
    signum, seconds = waited()
    assert signum == usr1 and seconds >= 0.5
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert waited()[1] < 0.1

    monkeypatch.setenv("SLURM_PROCID", "1")
    quits = []
    monkeypatch.setattr(signals, "quit_before_training", lambda *args, **_: quits.append(args))
    stop = signals.StopRequest()
    read_end, write_end = os.pipe()
    os.write(write_end, bytes([usr1]))
    threading.Timer(0.2, setattr, (stop, "training", True)).start()
    threading.Timer(0.7, os.close, (write_end,)).start()
    stop._receive(read_end)
    os.close(read_end)
    assert quits == [] and stop.signal == usr1


def test_only_what_ends_a_rank_from_outside_loses_its_traceback() -> None:
    """A failing or read-only disk met while reading an input, an error that quotes "Cannot allocate memory", a bug
    raised `from None` while handling a full disk and a worker that crashed (a bus error, an exit code) are no full
    disk, no OOM kill: they keep their tracebacks (the review of the change that added the one-line ends)."""
    import errno

    from app.stopping import exhausted
    from app.reliability.signals import one_line_for

    def bug_after_a_full_disk() -> Exception:
        try:
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise KeyError("bug") from None
        except KeyError as error:
            return error

    def bus_error_behind_an_unexpected_exit() -> Exception:  # torch's error when /dev/shm is too small
        try:
            try:
                raise RuntimeError("DataLoader worker (pid 42) is killed by signal: Bus error. It is possible that "
                                   "dataloader's workers are out of shared memory.")
            except RuntimeError as cause:
                raise RuntimeError("DataLoader worker (pid(s) 42) exited unexpectedly") from cause
        except RuntimeError as error:
            return error

    for error in (OSError(errno.EIO, "Input/output error", "/data/a.jsonl"), OSError(errno.EROFS, "Read-only"),
                  ValueError("row 3: 'fork: Cannot allocate memory' is not a label"), bug_after_a_full_disk(),
                  RuntimeError("DataLoader worker (pid 42) is killed by signal: Bus error. It is possible that "
                               "dataloader's workers are out of shared memory."),
                  RuntimeError("DataLoader worker (pid(s) 42) exited unexpectedly with exit code 1"),
                  bus_error_behind_an_unexpected_exit()):
        assert one_line_for(error, 0) is None and exhausted(error) is None, error
