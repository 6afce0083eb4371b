"""Exact resume, crash-safe checkpoints, preemption signals, the non-finite guard and secrets, with real processes.

Every run is train.py in 2 real FSDP processes on CPU; signals are real signals sent to the real processes.
"""

from __future__ import annotations

import csv
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from app.checkpoint import list_checkpoints, mark_if_best, prune_checkpoints, read_best
from app.exit_codes import EXIT_NON_FINITE, EXIT_PREEMPTED
from conftest import ROOT, TinySetup, read_checkpoint, run_train, train_args

FAKE_SECRETS = {"HF_TOKEN": "hf_FAKEsecretTOKEN0123456789", "WANDB_API_KEY": "fakewandbkey0123456789abcdef0123456789ab"}
# 647 train blocks / (16 micro-batch x 2 ranks x 2 accumulation) = 10 steps per epoch: step 10 ends epoch 0.
EXACT = dict(micro_batch_size=16, gradient_accumulation_steps=2, max_step=14, save_step_interval=6,
             eval_step_interval=100)
STEP_LINE = re.compile(r"^step (\d+)/\d+ \|", re.MULTILINE)


@dataclass
class Launched:
    """A train.py run in its own process group, its console output going to a file we can watch."""

    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text()

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not any(int(s) >= step for s in STEP_LINE.findall(self.output())):
            assert self.process.poll() is None, f"run ended before step {step}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no step {step} within {timeout} s:\n{self.output()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 180) -> int:
        return self.process.wait(timeout=timeout)


def launch(args: list[str], log: Path, env: dict[str, str] | None = None) -> Launched:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                                   stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return Launched(process, log)


def logged_losses(out_dir: Path) -> dict[int, float]:
    with open(out_dir / "metrics.csv", newline="") as handle:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(handle) if row["train_loss"]}


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(path)["model"]


def first_logged_step(output: str) -> int:
    return int(STEP_LINE.search(output).group(1))


def files_under(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()]


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_resume_matches_a_straight_run_exactly(tiny: TinySetup, tmp_path: Path):
    """Straight 14 steps vs SIGTERM at step k < 10 then --resume true to 14: epoch boundary and accumulation inside."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    straight_run = launch(train_args(tiny, straight, **EXACT, wandb_mode="offline"), tmp_path / "straight.log",
                          env=FAKE_SECRETS)
    stopped_run = launch(train_args(tiny, stopped, **EXACT), tmp_path / "stopped.log")
    stopped_run.wait_for_step(2)
    sent = time.monotonic()
    stopped_run.process.send_signal(signal.SIGTERM)  # the launcher only (rank 0); rank 1 learns it by all_reduce
    assert stopped_run.finish() == EXIT_PREEMPTED, stopped_run.output()
    seconds_to_exit = time.monotonic() - sent
    stop_step = int(re.search(r"step (\d+): stopped by a signal", stopped_run.output()).group(1))
    assert 2 <= stop_step < 10 and stop_step in list_checkpoints(stopped), stopped_run.output()
    assert straight_run.finish() == 0, straight_run.output()

    resumed = run_train(train_args(tiny, stopped, **EXACT, resume=True))
    assert resumed.returncode == 0, resumed.stderr
    assert first_logged_step(resumed.stdout) == stop_step + 1

    expected, got = logged_losses(straight), logged_losses(stopped)
    assert sorted(got) == list(range(1, 15))
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
def test_three_sigkills_resume_at_the_next_step_then_sigusr1_to_all_saves(tiny: TinySetup, tmp_path: Path):
    """SIGKILL to the whole process group at seeded random moments (mid-step, mid-save, mid-eval), three times."""
    out = tmp_path / "run"
    args = train_args(tiny, out, micro_batch_size=4, max_step=200, save_step_interval=2, eval_step_interval=4,
                      keep_last_n=2, num_workers=1)
    moments = random.Random(20261105)
    latest = 0
    for attempt in range(4):
        run = launch(args + (["--resume", "true"] if attempt else []), tmp_path / f"attempt{attempt}.log")
        run.wait_for_step(latest + moments.randint(2, 6))
        assert first_logged_step(run.output()) == latest + 1, run.output()
        if attempt:
            assert f"resumed from {out / 'checkpoints' / f'step-{latest:08d}.ckpt'}" in run.output()
        time.sleep(moments.uniform(0, 0.5))
        if attempt == 3:
            break
        os.killpg(run.process.pid, signal.SIGKILL)
        run.finish()
        checkpoints = list_checkpoints(out)
        latest = max(checkpoints)
        read_checkpoint(checkpoints[latest])  # the one resume takes is complete

    os.killpg(run.process.pid, signal.SIGUSR1)  # every rank and data loader worker gets it, as under srun
    assert run.finish() == EXIT_PREEMPTED, run.output()
    stop_step = int(re.search(r"step (\d+): stopped by a signal", run.output()).group(1))
    checkpoints = list_checkpoints(out)
    assert max(checkpoints) == stop_step
    best = read_best(out)
    kept = {step for step in checkpoints}
    assert kept <= set(sorted(checkpoints)[-2:]) | {best["step"], latest}
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.endswith((".partial", ".replaced"))]


@pytest.mark.slow
def test_non_finite_loss_stops_without_saving_corrupted_weights(tiny: TinySetup, tmp_path: Path):
    out = tmp_path / "run"
    result = run_train(train_args(tiny, out, lr=1e30, min_lr=0, warmup_steps=0, grad_clip=0, max_step=8,
                                  save_step_interval=1))
    assert result.returncode == EXIT_NON_FINITE, result.stdout + result.stderr
    bad_step = int(re.search(r"step (\d+): non-finite values", result.stdout).group(1))
    assert "Traceback" not in result.stderr
    checkpoints = list_checkpoints(out)
    assert max(checkpoints) == bad_step - 1
    for path in checkpoints.values():
        assert all(torch.isfinite(t).all() for t in model_tensors(path).values())


def test_keep_last_n_keeps_the_best_and_the_resumed_checkpoint(tmp_path: Path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step, val_loss in [(2, 3.0), (4, 2.5), (6, 2.9), (8, 2.7), (10, 2.8)]:
        path = folder / f"step-{step:08d}.ckpt"
        path.write_bytes(b"x")
        mark_if_best(path, step, val_loss)
    assert read_best(tmp_path) == {"checkpoint": "step-00000004.ckpt", "step": 4, "val_loss": 2.5}
    deleted = prune_checkpoints(tmp_path, 2, protected={folder / "step-00000002.ckpt"})
    assert [p.name for p in deleted] == ["step-00000006.ckpt"]
    assert sorted(list_checkpoints(tmp_path)) == [2, 4, 8, 10]
    assert prune_checkpoints(tmp_path, None, set()) == []
