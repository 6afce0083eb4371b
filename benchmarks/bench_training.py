"""The training application side by side with its baselines, on the same model, data, batch and steps.

1. step time: the application's FSDP against a bare torch FSDP loop (target: overhead <= 3%);
2. step time: the application with --strategy ddp against Hugging Face Trainer (target: >= 1.1x faster);
3. peak memory of the largest rank while training a ~170M-parameter model, FULL_SHARD against NO_SHARD
   (target: <= 0.70x);
4. checkpoint save and load of that model's training state against plain torch.save / torch.load of the same state.

Every contender runs in 2 processes on this machine's CPU with the same threads per process. A step time is the
difference of the training time of a long and a short run divided by the difference in steps, so that start-up,
the first steps' warm-up and the final evaluation and save cancel out. The two contenders of a comparison run back
to back, `--repeats` times in alternating order; a ratio is the median of the repeats' ratios, and its range is
printed next to it, because this machine's speed drifts by +-10% over tens of minutes. Prints a Markdown table
(the README's).

Run: python benchmarks/bench_training.py [--parts overhead trainer memory checkpoint] [--repeats 5]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
from transformers import LlamaConfig

from app.prepare import PrepareArgs, prepare, stdlib_corpus_paths
from app.prepare.corpus import quiet_progress
from benchmarks.baselines import Workload

CORPUS = ("asyncio", "email", "json", "logging", "http", "unittest")
STEP_MODEL = ROOT / "configs" / "demo-llama"
STATE_MODEL = LlamaConfig(vocab_size=2000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=10,
                          num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=128,
                          bos_token_id=1, eos_token_id=2)
"""~170M parameters whose training state (weights, gradients, AdamW moments) dominates memory."""


def child_environment() -> dict[str, str]:
    """Every process of every contender gets the same share of the cores."""
    threads = max(1, (os.cpu_count() or 2) // 2)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}


def run(command: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=ROOT, env=child_environment(), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed:\n{result.stderr[-4000:]}")
    return result


def train_app(work: Workload, **options: object) -> str:
    """train.py as a user runs it, on 2 CPU processes; evaluation and saving only where a run must (its last step)."""
    arguments = {
        "accelerator": "cpu", "devices": 2, "strategy": "fsdp", "precision": "32-true",
        "model_config": work.model_config, "train_data_dir": work.data, "out_dir": work.out_dir,
        "micro_batch_size": work.micro_batch_size, "gradient_accumulation_steps": 1, "max_step": work.steps,
        "lr": work.lr, "weight_decay": work.weight_decay, "warmup_steps": work.warmup_steps,
        "grad_clip": work.grad_clip, "log_interval": work.log_interval, "seed": work.seed,
        "eval_iters": 1, "eval_step_interval": 10**6, "save_step_interval": 10**6, "initial_validation": False,
        "wandb_mode": "disabled", "num_workers": 0,
    } | options
    command = [sys.executable, "train.py"]
    for name, value in arguments.items():
        command += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return run(command).stdout


def app_train_sec(work: Workload, **options: object) -> float:
    """A fresh run each time (a folder holding checkpoints would be refused)."""
    shutil.rmtree(work.out_dir, ignore_errors=True)
    train_app(work, **options)
    return json.loads((Path(work.out_dir) / "summary.json").read_text())["train_sec"]


def baseline_train_sec(name: str, work: Workload) -> float:
    """The baseline's own timing line. gloo sometimes aborts a process at exit ("terminate called without an active
    exception"), after the timing was printed: that does not affect the measurement."""
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  str(ROOT / "benchmarks" / "baselines.py"), name, json.dumps(asdict(work))], check=False)
    timing = [line for line in result.stdout.splitlines() if line.startswith('{"steps"')]
    if not timing:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-4000:]}")
    return json.loads(timing[-1])["train_sec"]


@dataclass
class PairedStepTimes:
    """Seconds per step of two contenders measured back to back, repeat after repeat."""

    ours: list[float]
    theirs: list[float]

    def ratios(self, speed_up: bool) -> list[float]:
        """One ratio per repeat, from two samples taken minutes apart at most: the machine's slow drift (this one's
        speed wanders by +-10% over tens of minutes) falls on both sides of each ratio."""
        return [t / o if speed_up else o / t for o, t in zip(self.ours, self.theirs)]


def paired_step_times(ours: Callable[[int], float], theirs: Callable[[int], float], short: int, long: int,
                      repeats: int) -> PairedStepTimes:
    """(long run - short run) / (long - short) for each contender, in the order AB, BA, AB, ... so that neither
    always runs first after the other."""
    def per_step(train_sec: Callable[[int], float]) -> float:
        return (train_sec(long) - train_sec(short)) / (long - short)

    times = PairedStepTimes(ours=[], theirs=[])
    for repeat in range(repeats):
        if repeat % 2:
            times.theirs.append(per_step(theirs))
            times.ours.append(per_step(ours))
        else:
            times.ours.append(per_step(ours))
            times.theirs.append(per_step(theirs))
        print(f"  repeat {repeat + 1}: {times.ours[-1]:.4f} / {times.theirs[-1]:.4f} s per step", flush=True)
    return times


STEP_BATCHES = {"compute-bound, 8 x 128 tokens per rank": (8, 40), "overhead-bound, 1 x 128 tokens per rank": (1, 160)}
"""(micro batch, steps of the long run) of the step-time comparisons: the same kernels dominate the first; each
framework's own per-step work shows in the second, whose short steps need a longer run to rise above the noise."""


def step_workload(data: Path, work_dir: Path, name: str, micro_batch_size: int, steps: int) -> Workload:
    return Workload(model_config=str(STEP_MODEL), data=str(data), out_dir=str(work_dir / name / str(steps)),
                    steps=steps, micro_batch_size=micro_batch_size)


def compare_step_times(options: argparse.Namespace, title: str, ours: Callable[[int, int], float],
                       theirs: Callable[[int, int], float], speed_up: bool, target: float) -> list[str]:
    """A row per micro batch; each contender maps (micro batch, steps) to seconds of training. The ratio is
    ours / theirs, or theirs / ours when `speed_up` (the target then being a minimum): the median of the repeats'
    paired ratios, with their range."""
    rows = []
    for label, (micro, long_steps) in STEP_BATCHES.items():
        times = paired_step_times(partial(ours, micro), partial(theirs, micro), options.short_steps, long_steps,
                                  options.repeats)
        ratios = times.ratios(speed_up)
        ratio = statistics.median(ratios)
        met = ratio >= target if speed_up else ratio <= target
        rows.append(row(f"{title} ({label})", f"{statistics.median(times.ours):.3f} s",
                        f"{statistics.median(times.theirs):.3f} s", ratio,
                        f"{'>=' if speed_up else '<='} {target:.2f}", met, spread=(min(ratios), max(ratios))))
    return rows


def bench_overhead(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    return compare_step_times(
        options, "step time: application FSDP / bare torch FSDP loop",
        lambda micro, steps: app_train_sec(step_workload(data, work_dir, "app", micro, steps)),
        lambda micro, steps: baseline_train_sec("bare_fsdp", step_workload(data, work_dir, "bare", micro, steps)),
        speed_up=False, target=1.03)


def bench_trainer(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    return compare_step_times(
        options, "speed-up: application DDP over Hugging Face Trainer",
        lambda micro, steps: app_train_sec(step_workload(data, work_dir, "app", micro, steps), strategy="ddp"),
        lambda micro, steps: baseline_train_sec("hf_trainer", step_workload(data, work_dir, "trainer", micro, steps)),
        speed_up=True, target=1.10)


def state_workload(data: Path, work_dir: Path, name: str, steps: int = 3) -> Workload:
    return Workload(model_config=str(work_dir / "state-model"), data=str(data), out_dir=str(work_dir / name),
                    steps=steps, micro_batch_size=2, warmup_steps=1, log_interval=1)


def peak_rss_while_training(out_dir: str) -> float:
    """The largest rank's peak RSS logged with the last training metrics, before that step's checkpoint is gathered."""
    with open(Path(out_dir) / "metrics.csv") as file:
        return max(float(r["peak_rss_gb"]) for r in csv.DictReader(file) if r["peak_rss_gb"])


def bench_memory(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    peaks = {}
    for sharding in ("FULL_SHARD", "NO_SHARD"):
        work = state_workload(data, work_dir, sharding)
        train_app(work, sharding_strategy=sharding)
        peaks[sharding] = peak_rss_while_training(work.out_dir)
        print(f"  {sharding}: peak RSS of the largest rank {peaks[sharding]:.2f} GB", flush=True)
    ratio = peaks["FULL_SHARD"] / peaks["NO_SHARD"]
    return [row("peak RSS, largest rank, 170M model: FULL_SHARD / NO_SHARD", f"{peaks['FULL_SHARD']:.2f} GB",
                f"{peaks['NO_SHARD']:.2f} GB", ratio, "<= 0.70", ratio <= 0.70)]


def median_seconds(action: Callable[[], object], repeats: int = 3) -> float:
    """Disk and page-cache timings vary a lot here: the median of a few."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def app_save_and_load_sec(data: Path, work_dir: Path, state_dict_type: str) -> tuple[float, float, Path]:
    """A 3-step run that saves once at its end, then a resume that loads that checkpoint (and trains one step)."""
    work = state_workload(data, work_dir, f"FULL_SHARD-{state_dict_type}")
    train_app(work, state_dict_type=state_dict_type)
    save_sec = json.loads((Path(work.out_dir) / "summary.json").read_text())["save_sec"]
    checkpoint = max((Path(work.out_dir) / "checkpoints").glob("step-*"))
    resumed = train_app(replace(work, steps=work.steps + 1), state_dict_type=state_dict_type, resume=True)
    load_sec = float(re.search(r"resumed from .* in ([0-9.]+) s", resumed).group(1))
    return save_sec, load_sec, checkpoint


def bench_checkpoint(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """The application's save (gather the shards or write one per rank, fsync, atomic rename) and resume (read,
    restore the shards and the optimizer) against torch.save / torch.load of the same state in one process."""
    rows = []
    for state_dict_type in ("full", "sharded"):
        save_sec, load_sec, checkpoint = app_save_and_load_sec(data, work_dir, state_dict_type)
        if state_dict_type == "full":
            state = torch.load(checkpoint, weights_only=True)
            plain_save = median_seconds(lambda: torch.save(state, work_dir / "plain.pt"))
            plain_load = median_seconds(lambda: torch.load(work_dir / "plain.pt", weights_only=True))
            size = checkpoint.stat().st_size / 1e9
            del state
        rows += [row(f"checkpoint save, {state_dict_type} ({size:.1f} GB): application / torch.save",
                     f"{save_sec:.1f} s", f"{plain_save:.1f} s", save_sec / plain_save),
                 row(f"checkpoint load, {state_dict_type}: application resume / torch.load", f"{load_sec:.1f} s",
                     f"{plain_load:.1f} s", load_sec / plain_load)]
        print(f"  {state_dict_type}: save {save_sec:.1f} s, load {load_sec:.1f} s", flush=True)
    return rows


def row(name: str, ours: str, baseline: str, ratio: float, target: str = "", met: bool | None = None,
        spread: tuple[float, float] | None = None) -> str:
    verdict = "" if met is None else (" met" if met else " **missed**")
    shown = f"{ratio:.2f}" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")
    return f"| {name} | {ours} | {baseline} | {shown} | {target}{verdict} |"


PARTS = {"overhead": bench_overhead, "trainer": bench_trainer, "memory": bench_memory, "checkpoint": bench_checkpoint}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--short_steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, quiet_progress():
        work_dir = Path(folder)
        data = work_dir / "data"
        prepare(PrepareArgs(input=stdlib_corpus_paths(CORPUS), output_dir=str(data), vocab_size=2000,
                            block_size=128, val_fraction=0.05, seed=0))
        STATE_MODEL.save_pretrained(work_dir / "state-model")
        rows = []
        for part in options.parts:
            print(f"{part} ...", flush=True)
            rows += PARTS[part](data, work_dir, options)
    print(f"\n{os.cpu_count()} CPU cores, 2 processes, torch {torch.__version__}; step times: medians of "
          f"{options.repeats} paired repeats of a {options.short_steps}-step run and a long one, ratio (range)\n")
    print("| measured | application | baseline | ratio | target |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
