"""The training application side by side with its baselines, on the same model, data, batch and steps.

1. step time: the application's FSDP against a bare torch FSDP loop (target: overhead <= 3%), and the cost of
   starting the application with `python train.py` (Lightning's launcher) rather than torchrun;
2. speed-up: the application with --strategy ddp and --compile true against Hugging Face Trainer's defaults
   (target: >= 1.1x), and each against the other with the same kernels (both eager, both compiled);
3. --strategy fsdp2 against the default fsdp: every step's loss (target: within 1e-4) and step times (target: no
   slower);
4. peak memory of the largest rank while training a 172M-parameter model (configs/bench-170m) started by
   `python train.py`, FULL_SHARD against NO_SHARD (target: <= 0.70x) and fsdp2 against fsdp (target: <= 1.0x), and fsdp2 against
   fsdp with a 32K vocabulary (where both give the embeddings units of their own), FULL_SHARD against NO_SHARD
   with it under fsdp and fsdp2 (target: <= 0.70x), and 4 micro-batches per step against 1 (target: <= 1.05x);
5. checkpoint save and load of that model's training state against torch.save with fsync / torch.load of the same
   tensors (targets: full save and load <= 2.0x, sharded load <= 1.5x);
6. the training time one save costs with --async_save against a synchronous save (target: <= 0.20x);
7. the chunked loss against the model's own (`--chunked_loss false`) on a 128K-token vocabulary at 1 x 4096 tokens
   per rank: peak RSS of the largest rank (target: at least one fp32 copy of the logits, 2.1 GB, less) and step
   time (target: <= 1.05x);
8. the memory planner: what `--estimate_memory` plans against the largest rank's peak RSS in a run of the same
   options, for the Llama, GPT-2 and T5 demo shapes at two micro batches, Llama under bf16-mixed, and the 170M
   model without and with activation checkpointing (target: within 10%);
9. activation checkpointing of one layer in two (`--gradient_checkpointing_every 2`) against every layer's (target:
   a shorter step) and none: step times, and the 170M model's peak RSS, measured and planned (target: within 10%).

Every contender runs in 2 processes on this machine's CPU with the same threads per process, started by torchrun
unless a row says otherwise. A step time is the difference of the training time of a long and a short run divided
by the difference in steps, so that start-up, compilation, the first steps' warm-up and the final evaluation and
save cancel out. The contenders of a row run back to back, `--repeats` times in alternating order; a ratio is the
median of the repeats' ratios, and its range is printed next to it, because this machine's speed drifts by +-10%
over tens of minutes. Prints a Markdown table (the one in docs/performance.md). All parts take about an hour.

Run: python benchmarks/bench_training.py [--parts overhead trainer fsdp2 memory checkpoint async_save loss planner
checkpointing] [--repeats 5]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
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
from typing import Callable, Literal, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from app.checkpoint import read_tensors
from app.metrics.memory_plan import report_total_gb
from app.prepare import PrepareArgs, prepare, stdlib_corpus_paths
from app.prepare.corpus import quiet_progress
from app.prepare.stdlib_tasks import code_summary_pairs
from benchmarks.baselines import Workload

CORPUS = ("asyncio", "email", "json", "logging", "http", "unittest")
STEP_MODEL = ROOT / "configs" / "demo-llama"
STATE_MODEL = ROOT / "configs" / "bench-170m"
"""172M parameters (10 layers, 1024 wide, 2,000 tokens) whose training state (weights, gradients, AdamW moments)
dominates memory."""
VOCABULARY_MODEL = ROOT / "configs" / "bench-233m-32k"
"""The same layers with Llama-2's and Mistral's 32K vocabulary (233M parameters): each embedding holds 2.6 layers'
parameters (Llama-3-8B's 2.4), so fsdp and fsdp2 give them units of their own."""
VOCABULARY_128K_MODEL = ROOT / "configs" / "bench-128k"
"""Llama-3's 128,256-token vocabulary on 2 layers 512 wide (138M parameters, 95% of them embeddings): the logits
of 4096 tokens (2.1 GB in fp32) dominate a step's memory and time."""


GPT2_MODEL = ROOT / "configs" / "gpt2-demo"
"""GPT-2's architecture (LayerNorm, GELU, learned positions, dropout 0.1) at the demo's size."""
T5_MODEL = ROOT / "configs" / "t5-demo"


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


def torchrun(*script: str) -> list[str]:
    """2 processes as torchrun starts them: each in its own session, so each in its own scheduler group (the
    launcher matters on this machine's 2 cores: see the launcher row and docs/performance.md)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script]


def train_app(work: Workload, launcher: Literal["torchrun", "python"] = "torchrun", **options: object) -> str:
    """train.py on 2 CPU processes, started by torchrun (like every baseline) or by `python train.py` (Lightning's
    launcher); evaluation and saving only where a run must (its last step)."""
    arguments = {
        "accelerator": "cpu", "devices": 2, "strategy": "fsdp", "precision": "32-true",
        "model_config": work.model_config, "train_data_dir": work.data, "out_dir": work.out_dir,
        "micro_batch_size": work.micro_batch_size, "gradient_accumulation_steps": 1, "max_step": work.steps,
        "lr": work.lr, "weight_decay": work.weight_decay, "warmup_steps": work.warmup_steps,
        "grad_clip": work.grad_clip, "log_interval": work.log_interval, "seed": work.seed,
        "eval_iters": 1, "eval_step_interval": 10**6, "save_step_interval": 10**6, "initial_validation": False,
        "wandb_mode": "disabled", "num_workers": 0,
    } | options
    script = ["train.py"]
    for name, value in arguments.items():
        script += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return run(torchrun(*script) if launcher == "torchrun" else [sys.executable, *script]).stdout


def app_train_sec(work: Workload, **options: object) -> float:
    """A fresh run each time (a folder holding checkpoints would be refused)."""
    shutil.rmtree(work.out_dir, ignore_errors=True)
    train_app(work, **options)
    return json.loads((Path(work.out_dir) / "summary.json").read_text())["train_sec"]


def baseline_train_sec(name: str, work: Workload) -> float:
    """The baseline's own timing line. gloo sometimes aborts a process at exit ("terminate called without an active
    exception"), after the timing was printed: that does not affect the measurement."""
    result = run(torchrun(str(ROOT / "benchmarks" / "baselines.py"), name, json.dumps(asdict(work))), check=False)
    timing = [line for line in result.stdout.splitlines() if line.startswith('{"steps"')]
    if not timing:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-4000:]}")
    return json.loads(timing[-1])["train_sec"]


TrainSec = Callable[[int, int], float]
"""A contender: (micro batch, steps) -> seconds of training of a fresh run."""


@dataclass(frozen=True)
class Regime:
    label: str
    micro_batch_size: int
    long_steps: int


REGIMES = (Regime("compute-bound, 8 x 128 tokens per rank", 8, 40),
           Regime("overhead-bound, 1 x 128 tokens per rank", 1, 160))
"""The same kernels dominate the first; each framework's own per-step work shows in the second, whose short steps
need a longer run to rise above the noise."""


def step_times(contenders: dict[str, TrainSec], regime: Regime, options: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per step of every contender, (long run - short run) / (long - short steps), once per repeat.

    One short run of each contender first warms the caches (torch.compile's kernels, the page cache) out of the
    measurement. Within a repeat the contenders run back to back, in reversed order every other repeat, so that a
    ratio of two contenders of the same repeat compares samples taken minutes apart: this machine's speed drifts
    by +-10% over tens of minutes, and the drift falls on both sides of the ratio.
    """
    def per_step(train_sec: TrainSec) -> float:
        short = train_sec(regime.micro_batch_size, options.short_steps)
        long = train_sec(regime.micro_batch_size, regime.long_steps)
        return (long - short) / (regime.long_steps - options.short_steps)

    for train_sec in contenders.values():
        train_sec(regime.micro_batch_size, options.short_steps)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for repeat in range(options.repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            times[name].append(per_step(contenders[name]))
        print(f"  {regime.label}, repeat {repeat + 1}: "
              + ", ".join(f"{name} {times[name][-1]:.4f}" for name in names) + " s per step", flush=True)
    return times


@dataclass(frozen=True)
class Comparison:
    """A row: ours against theirs, as a time ratio (ours / theirs, at most `target`) or, when `speed_up`, as a
    speed-up (theirs / ours, at least `target`); without a target the row only informs."""

    title: str
    ours: str
    theirs: str
    speed_up: bool = False
    target: Optional[float] = None

    def row(self, times: dict[str, list[float]], regime: Regime) -> str:
        """The median of the repeats' ratios, with their range."""
        pairs = zip(times[self.ours], times[self.theirs])
        ratios = [theirs / ours if self.speed_up else ours / theirs for ours, theirs in pairs]
        ratio = statistics.median(ratios)
        met = None if self.target is None else (ratio >= self.target if self.speed_up else ratio <= self.target)
        target = "" if self.target is None else f"{'>=' if self.speed_up else '<='} {self.target:.2f}"
        return row(f"{self.title} ({regime.label})", f"{statistics.median(times[self.ours]):.3f} s",
                   f"{statistics.median(times[self.theirs]):.3f} s", ratio, target, met,
                   spread=(min(ratios), max(ratios)))


def compare_step_times(contenders: dict[str, TrainSec], comparisons: dict[Regime, list[Comparison]],
                       options: argparse.Namespace) -> list[str]:
    """Each regime's contenders are the ones its comparisons name."""
    rows = []
    for regime, regime_comparisons in comparisons.items():
        names = dict.fromkeys(name for c in regime_comparisons for name in (c.ours, c.theirs))
        times = step_times({name: contenders[name] for name in names}, regime, options)
        rows += [comparison.row(times, regime) for comparison in regime_comparisons]
    return rows


def app_contender(data: Path, work_dir: Path, name: str, **options: object) -> TrainSec:
    return lambda micro, steps: app_train_sec(step_workload(data, work_dir, name, micro, steps), **options)


def baseline_contender(data: Path, work_dir: Path, name: str) -> TrainSec:
    return lambda micro, steps: baseline_train_sec(name, step_workload(data, work_dir, name, micro, steps))


def step_workload(data: Path, work_dir: Path, name: str, micro_batch_size: int, steps: int) -> Workload:
    return Workload(model_config=str(STEP_MODEL), data=str(data), out_dir=str(work_dir / name / str(steps)),
                    steps=steps, micro_batch_size=micro_batch_size)


def bench_overhead(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """The application's FSDP against the bare loop, both started by torchrun; and what Lightning's launcher
    (`python train.py --devices 2`) costs against torchrun on this machine."""
    contenders = {"app": app_contender(data, work_dir, "app"),
                  "app-python": app_contender(data, work_dir, "app-python", launcher="python"),
                  "bare": baseline_contender(data, work_dir, "bare_fsdp")}
    comparisons = [Comparison("step time: application FSDP / bare torch FSDP loop", "app", "bare", target=1.03),
                   Comparison("step time: application started by `python train.py` / by torchrun", "app-python",
                              "app")]
    return compare_step_times(contenders, {regime: comparisons for regime in REGIMES}, options)


def bench_trainer(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """The application with --strategy ddp against Trainer as it is commonly run (its defaults); and, without a
    target, each against the other with the same kernels (both eager, both compiled), which isolates the per-step
    work of each framework."""
    contenders = {"app": app_contender(data, work_dir, "app-ddp", strategy="ddp"),
                  "app-compiled": app_contender(data, work_dir, "app-ddp-compiled", strategy="ddp", compile=True),
                  "trainer": baseline_contender(data, work_dir, "hf_trainer"),
                  "trainer-compiled": baseline_contender(data, work_dir, "hf_trainer_compiled")}
    fastest = Comparison("speed-up: application DDP `--compile true` over Hugging Face Trainer's defaults",
                         "app-compiled", "trainer", speed_up=True, target=1.10)
    eager = Comparison("speed-up: application DDP over Hugging Face Trainer, both eager", "app", "trainer",
                       speed_up=True)
    compiled = Comparison("speed-up: application DDP over Hugging Face Trainer, both compiled", "app-compiled",
                          "trainer-compiled", speed_up=True)
    compute_bound, overhead_bound = REGIMES
    return compare_step_times(contenders, {compute_bound: [fastest, eager, compiled],
                                           overhead_bound: [fastest, eager]}, options)


def state_workload(data: Path, work_dir: Path, name: str, steps: int = 3, model: Path = STATE_MODEL) -> Workload:
    return Workload(model_config=str(model), data=str(data), out_dir=str(work_dir / name),
                    steps=steps, micro_batch_size=2, warmup_steps=1, log_interval=1)


def peak_rss_while_training(out_dir: str) -> float:
    """The largest rank's peak RSS logged with the last training metrics, before that step's checkpoint is gathered."""
    with open(Path(out_dir) / "metrics.csv") as file:
        return max(float(r["peak_rss_gb"]) for r in csv.DictReader(file) if r["peak_rss_gb"])


def bench_memory(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """Peak RSS of the largest rank while training the 170M model, started as users start it (`python train.py
    --devices 2`): FULL_SHARD against NO_SHARD, and FSDP2 against FSDP, also with a 32K vocabulary."""
    peaks = {}
    for name, strategy, sharding, model, accumulation in (
            ("FULL_SHARD", "fsdp", "FULL_SHARD", STATE_MODEL, 1), ("NO_SHARD", "fsdp", "NO_SHARD", STATE_MODEL, 1),
            ("FSDP2", "fsdp2", "FULL_SHARD", STATE_MODEL, 1),
            ("FULL_SHARD x4", "fsdp", "FULL_SHARD", STATE_MODEL, 4),
            ("FSDP 32K", "fsdp", "FULL_SHARD", VOCABULARY_MODEL, 1),
            ("FSDP NO_SHARD 32K", "fsdp", "NO_SHARD", VOCABULARY_MODEL, 1),
            ("FSDP2 32K", "fsdp2", "FULL_SHARD", VOCABULARY_MODEL, 1),
            ("FSDP2 NO_SHARD 32K", "fsdp2", "NO_SHARD", VOCABULARY_MODEL, 1)):
        work = state_workload(data, work_dir, name.replace(" ", "-"), model=model)
        train_app(work, launcher="python", strategy=strategy, sharding_strategy=sharding,
                  gradient_accumulation_steps=accumulation)
        peaks[name] = peak_rss_while_training(work.out_dir)
        print(f"  {name}: peak RSS of the largest rank {peaks[name]:.2f} GB", flush=True)

    def ratio(title: str, ours: str, theirs: str, target: Optional[float]) -> str:
        value = peaks[ours] / peaks[theirs]
        return row(title, f"{peaks[ours]:.2f} GB", f"{peaks[theirs]:.2f} GB", value,
                   "" if target is None else f"<= {target:.2f}", None if target is None else value <= target)

    return [ratio("peak RSS, largest rank, 170M model, `python train.py`: FULL_SHARD / NO_SHARD", "FULL_SHARD",
                  "NO_SHARD", 0.70),
            ratio("peak RSS, largest rank, 170M model, `python train.py`, FULL_SHARD: fsdp2 / fsdp", "FSDP2",
                  "FULL_SHARD", 1.0),
            ratio("peak RSS, largest rank, 170M model, `python train.py`, FULL_SHARD: 4 micro-batches per step / 1",
                  "FULL_SHARD x4", "FULL_SHARD", 1.05),
            ratio("peak RSS, largest rank, 233M model (32K vocabulary), `python train.py`, FULL_SHARD: fsdp2 / fsdp",
                  "FSDP2 32K", "FSDP 32K", None),
            ratio("peak RSS, largest rank, 233M model (32K vocabulary), `python train.py`, fsdp: FULL_SHARD / "
                  "NO_SHARD", "FSDP 32K", "FSDP NO_SHARD 32K", 0.70),
            ratio("peak RSS, largest rank, 233M model (32K vocabulary), `python train.py`, fsdp2: FULL_SHARD / "
                  "NO_SHARD", "FSDP2 32K", "FSDP2 NO_SHARD 32K", 0.70)]


def bench_fsdp2(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """--strategy fsdp2 against the default fsdp: the losses of every step (target: within 1e-4 of each other) and
    step times in both regimes (target: no slower)."""
    fsdp2, fsdp = (every_step_loss(data, work_dir, strategy) for strategy in ("fsdp2", "fsdp"))
    largest = max(abs(fsdp2[step] - fsdp[step]) / fsdp[step] for step in fsdp)
    loss_row = (f"| training loss, each of {LOSS_STEPS} steps (fp32, 8 x 128 tokens per rank): fsdp2 against fsdp, "
                f"largest relative difference | {fsdp2[LOSS_STEPS]:.5f} at the last step | {fsdp[LOSS_STEPS]:.5f} | "
                f"{largest:.1e} | <= 1e-4{' met' if largest <= 1e-4 else ' **missed**'} |")
    contenders = {"fsdp2": app_contender(data, work_dir, "app-fsdp2", strategy="fsdp2"),
                  "fsdp": app_contender(data, work_dir, "app")}
    comparison = Comparison("step time: application --strategy fsdp2 / fsdp", "fsdp2", "fsdp", target=1.0)
    return [loss_row, *compare_step_times(contenders, {regime: [comparison] for regime in REGIMES}, options)]


LOSS_STEPS = 24


def every_step_loss(data: Path, work_dir: Path, strategy: str) -> dict[int, float]:
    """The training loss of each step of a run logging every step (the step-time runs log every 10th)."""
    work = replace(step_workload(data, work_dir, f"losses-{strategy}", micro_batch_size=8, steps=LOSS_STEPS),
                   log_interval=1)
    train_app(work, strategy=strategy)
    with open(Path(work.out_dir) / "metrics.csv") as file:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(file) if r["train_loss"]}


def median_seconds(action: Callable[[], object], repeats: int = 3) -> float:
    """Disk and page-cache timings vary a lot here: the median of a few."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def torch_save_with_fsync(state: dict[str, torch.Tensor], path: Path) -> None:
    """What a checkpoint must cost at least: torch.save of the same tensors, made durable as the application's are."""
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def evict_from_page_cache(path: Path) -> None:
    """Reads after this come from the disk, as a resume on a fresh node does. The application writes checkpoints
    past the page cache (O_DIRECT) and torch.save through it: without this, torch.load would read memory."""
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def torch_load_from_disk(path: Path) -> None:
    evict_from_page_cache(path)
    torch.load(path, weights_only=True)


def app_save_and_load_sec(data: Path, work_dir: Path, state_dict_type: str) -> tuple[float, float, Path]:
    """A 3-step run that saves once at its end, then a resume that loads that checkpoint (and trains one step)."""
    work = state_workload(data, work_dir, f"FULL_SHARD-{state_dict_type}")
    train_app(work, state_dict_type=state_dict_type)
    save_sec = json.loads((Path(work.out_dir) / "summary.json").read_text())["save_sec"]
    checkpoint = max((Path(work.out_dir) / "checkpoints").glob("step-*"))
    evict_from_page_cache(checkpoint)
    resumed = train_app(replace(work, steps=work.steps + 1), state_dict_type=state_dict_type, resume=True)
    load_sec = float(re.search(r"resumed from .* in ([0-9.]+) s", resumed).group(1))
    return save_sec, load_sec, checkpoint


def bench_checkpoint(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """The application's save (every rank writes its pieces into the file, or into its own file; fsync, rename) and
    resume (each rank reads its part and restores the shards and the optimizer) against torch.save with fsync and
    torch.load of the same tensors in one process, both loads from the disk."""
    rows = []
    timings = {kind: app_save_and_load_sec(data, work_dir, kind) for kind in ("full", "sharded")}
    full_file = timings["full"][2]
    state = read_tensors(full_file)
    plain = work_dir / "plain.pt"
    plain_save = median_seconds(partial(torch_save_with_fsync, state, plain))
    plain_load = median_seconds(partial(torch_load_from_disk, plain))
    size = full_file.stat().st_size / 1e9
    del state
    targets = {("full", "save"): 2.0, ("full", "load"): 2.0, ("sharded", "load"): 1.5}
    for kind, (save_sec, load_sec, _) in timings.items():
        print(f"  {kind}: save {save_sec:.1f} s, load {load_sec:.1f} s", flush=True)
        for action, ours, theirs, baseline in (("save", save_sec, plain_save, "torch.save + fsync"),
                                               ("load", load_sec, plain_load, "torch.load")):
            target = targets.get((kind, action))
            rows.append(row(f"checkpoint {action}, {kind} ({size:.1f} GB): application / {baseline}",
                            f"{ours:.1f} s", f"{theirs:.1f} s", ours / theirs,
                            f"<= {target:.1f}" if target else "", None if target is None else ours / theirs <= target))
    return rows


def step_ends(out_dir: str) -> dict[int, float]:
    """Seconds from the first step to the end of each step, logged before that step's own evaluation and save."""
    with open(Path(out_dir) / "metrics.csv") as file:
        return {int(r["step"]): float(r["elapsed_sec"]) for r in csv.DictReader(file) if r["elapsed_sec"]}


def time_lost_to_saves(ends: dict[int, float], interval: int) -> list[float]:
    """For every save a step follows: that step (which includes the save, or runs while a background one writes)
    less the median of the run's steps that follow no save. Steps of one run, as this machine drifts by tens of
    percent between runs minutes apart; against the median rather than the step before, as single steps of the 170M
    model vary by about 0.5 s. The same estimate for a synchronous save and a background one."""
    durations = {step: ends[step] - ends[step - 1] for step in ends if step - 1 in ends and step > 2}
    after_save = {step + 1 for step in range(interval, max(ends), interval)} & durations.keys()
    typical = statistics.median(seconds for step, seconds in durations.items() if step not in after_save)
    return [durations[step] - typical for step in sorted(after_save)]


def bench_async_save(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """Training time one save costs with --async_save against a synchronous one, for each format: 41 steps of one
    sequence per rank saving every 2 (a background write ends within the step after it), both modes in each repeat;
    the median over every save of the repeats. One sequence rather than two makes steps shorter (4.6 s here) and
    steadier: single steps of two sequences varied by about 0.5 s, as much as the cost measured."""
    steps, interval = 41, 2
    rows = []
    for kind in ("full", "sharded"):
        lost: dict[str, list[float]] = {"sync": [], "async": []}
        for repeat in range(options.repeats):
            for name in ("sync", "async")[::1 if repeat % 2 == 0 else -1]:
                work = replace(state_workload(data, work_dir, f"save-{kind}-{name}", steps=steps), micro_batch_size=1)
                shutil.rmtree(work.out_dir, ignore_errors=True)
                train_app(work, state_dict_type=kind, save_step_interval=interval, async_save=name == "async",
                          keep_last_n=1)
                run_lost = time_lost_to_saves(step_ends(work.out_dir), interval)
                print(f"    {kind} {name}, repeat {repeat + 1}: lost per save {statistics.median(run_lost):.2f} s "
                      f"(median; each: {' '.join(f'{seconds:.2f}' for seconds in run_lost)})", flush=True)
                lost[name] += run_lost
                shutil.rmtree(work.out_dir)
            print(f"  {kind}: training time lost per save: sync {statistics.median(lost['sync']):.2f} s, "
                  f"async {statistics.median(lost['async']):.2f} s (medians so far)", flush=True)
        ratio = statistics.median(lost["async"]) / statistics.median(lost["sync"])
        rows.append(row(f"training time lost per save, {kind}: `--async_save true` / synchronous",
                        f"{statistics.median(lost['async']):.2f} s", f"{statistics.median(lost['sync']):.2f} s",
                        ratio, "<= 0.20", ratio <= 0.20))
    return rows


LOSS_BLOCK = 4096
LOGITS_FP32_GB = LOSS_BLOCK * 128256 * 4 / 1e9


def bench_loss(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """The chunked loss against the model's own on the 128K-vocabulary model, 1 x 4096 tokens per rank, FULL_SHARD:
    the largest rank's peak RSS (one run each) and step times (paired repeats of a short and a long run)."""
    blocks = work_dir / "data-4096"
    if not blocks.exists():
        prepare(PrepareArgs(input=stdlib_corpus_paths(CORPUS), output_dir=str(blocks), vocab_size=2000,
                            block_size=LOSS_BLOCK, val_fraction=0.02, seed=0))

    def contender(name: str, chunked: bool) -> TrainSec:
        def train_sec(micro: int, steps: int) -> float:
            work = Workload(model_config=str(VOCABULARY_128K_MODEL), data=str(blocks),
                            out_dir=str(work_dir / name / str(steps)), steps=steps, micro_batch_size=micro,
                            warmup_steps=1, log_interval=1)
            return app_train_sec(work, chunked_loss=chunked)
        return train_sec

    contenders = {"chunked": contender("loss-chunked", True), "full": contender("loss-full", False)}
    few_steps = argparse.Namespace(**{**vars(options), "short_steps": 2})
    regime = Regime(f"1 x {LOSS_BLOCK} tokens per rank, 128K vocabulary", 1, 6)
    times = step_times(contenders, regime, few_steps)
    peaks = {name: peak_rss_while_training(str(work_dir / f"loss-{name}" / str(regime.long_steps)))
             for name in contenders}
    saved = peaks["full"] - peaks["chunked"]
    memory = row(f"peak RSS, largest rank, 138M model with a 128K vocabulary, 1 x {LOSS_BLOCK} tokens per rank: "
                 "chunked loss / the model's own", f"{peaks['chunked']:.2f} GB ({saved:.2f} GB less)",
                 f"{peaks['full']:.2f} GB", peaks["chunked"] / peaks["full"], f"{LOGITS_FP32_GB:.1f} GB less",
                 saved >= LOGITS_FP32_GB)
    step = Comparison("step time: chunked loss / the model's own", "chunked", "full", target=1.05)
    return [memory, step.row(times, regime)]


def bench_spike_guard(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """Step time with the spike guard judging every step (after a 3-step warm-up) against the guard switched off:
    its numbers ride on the all_reduce every step makes (target: within 1%). The limit is set out of reach
    (--spike_z 1e6) so that what is timed is the judgement of every step, not what a spike then costs (scoring the
    step's rows, a step not applied): with 2 rows a step, the default limit judged one spike in 160 steps."""
    contenders = {"guard": app_contender(data, work_dir, "guard", spike_guard="skip", spike_warmup=3, spike_z=1e6),
                  "off": app_contender(data, work_dir, "off", spike_guard="off")}
    comparisons = [Comparison("step time: --spike_guard skip / off", "guard", "off", target=1.01)]
    return compare_step_times(contenders, {regime: comparisons for regime in REGIMES}, options)


PLANNER_TOLERANCE = 0.10


def bench_planner(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """--estimate_memory against the largest rank's peak RSS while training with the same options (`python
    train.py --devices 2`, 6 steps, fsdp FULL_SHARD, 32-true unless a row says otherwise), for each architecture's
    demo shape: Llama and GPT-2 on the text blocks, T5 on the standard library's code -> summary pairs (sources of up
    to 256 tokens, targets of up to 48); then the 170M model."""
    pairs = work_dir / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(pair) + "\n" for pair in code_summary_pairs()))
    seq2seq = work_dir / "data-seq2seq"
    prepare(PrepareArgs(input=[str(pairs)], output_dir=str(seq2seq), source_field="code", target_field="summary",
                        max_source_length=256, max_target_length=48, vocab_size=2000, val_fraction=0.1, seed=0))
    rows = []
    for index, (name, model, folder, micro, options) in enumerate((
            ("Llama", STEP_MODEL, data, 4, {}), ("Llama", STEP_MODEL, data, 16, {}),
            ("Llama, bf16-mixed", STEP_MODEL, data, 16, {"precision": "bf16-mixed"}),
            ("Llama, 4 micro-batches per step", STEP_MODEL, data, 16, {"gradient_accumulation_steps": 4}),
            ("Llama, 4 micro-batches per step, `--fsdp_no_sync`", STEP_MODEL, data, 16,
             {"gradient_accumulation_steps": 4, "fsdp_no_sync": True}),
            ("GPT-2", GPT2_MODEL, data, 4, {}), ("GPT-2", GPT2_MODEL, data, 16, {}),
            ("T5", T5_MODEL, seq2seq, 4, {}), ("T5", T5_MODEL, seq2seq, 16, {}),
            ("170M Llama", STATE_MODEL, data, 2, {}),
            ("170M Llama, activation checkpointing", STATE_MODEL, data, 8, {"gradient_checkpointing": True}))):
        work = Workload(model_config=str(model), data=str(folder), out_dir=str(work_dir / f"plan-{index}"), steps=6,
                        micro_batch_size=micro, warmup_steps=1, log_interval=1)
        planned = report_total_gb(train_app(work, launcher="python", estimate_memory=True, **options))
        train_app(work, launcher="python", **options)
        measured = peak_rss_while_training(work.out_dir)
        print(f"  {name}, micro batch {micro}: planned {planned:.2f} GB, measured {measured:.2f} GB", flush=True)
        rows.append(row(f"peak RSS, largest rank: `--estimate_memory` / measured, {name} ({model.name}), micro "
                        f"batch {micro}", f"{planned:.2f} GB", f"{measured:.2f} GB", planned / measured,
                        f"within {PLANNER_TOLERANCE:.0%}", abs(planned / measured - 1) <= PLANNER_TOLERANCE))
    return rows


def row(name: str, ours: str, baseline: str, ratio: float, target: str = "", met: bool | None = None,
        spread: tuple[float, float] | None = None) -> str:
    verdict = "" if met is None else (" met" if met else " **missed**")
    shown = f"{ratio:.2f}" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")
    return f"| {name} | {ours} | {baseline} | {shown} | {target}{verdict} |"


CHECKPOINTING = {"none": {}, "every-2": {"gradient_checkpointing": True, "gradient_checkpointing_every": 2},
                 "every-1": {"gradient_checkpointing": True}}
"""--gradient_checkpointing_every's contenders: no activation checkpointing, one layer in two, every layer."""


def bench_checkpointing(data: Path, work_dir: Path, options: argparse.Namespace) -> list[str]:
    """Activation checkpointing of one layer in two (--gradient_checkpointing_every 2) between none and every
    layer's: step times of the 4-layer demo model in the compute-bound regime, then the 170M model's peak RSS of the
    largest rank at micro batch 8 (`python train.py`, as the planner's rows), measured and planned."""
    contenders = {name: app_contender(data, work_dir, f"checkpointing-{name}", **choice)
                  for name, choice in CHECKPOINTING.items()}
    rows = compare_step_times(contenders, {REGIMES[0]: [
        Comparison("step time: activation checkpointing of 1 layer in 2 / of every layer", "every-2", "every-1",
                   target=1.0),
        Comparison("step time: activation checkpointing of every layer / none", "every-1", "none")]}, options)
    peaks, planned = {}, {}
    for name, choice in CHECKPOINTING.items():
        work = Workload(model_config=str(STATE_MODEL), data=str(data), out_dir=str(work_dir / f"peak-{name}"),
                        steps=6, micro_batch_size=8, warmup_steps=1, log_interval=1)
        planned[name] = report_total_gb(train_app(work, launcher="python", estimate_memory=True, **choice))
        train_app(work, launcher="python", **choice)
        peaks[name] = peak_rss_while_training(work.out_dir)
        print(f"  {name}: planned {planned[name]:.2f} GB, measured {peaks[name]:.2f} GB", flush=True)
    rows += [row(f"peak RSS, largest rank, 170M model, micro batch 8: activation checkpointing of {said} / none",
                 f"{peaks[name]:.2f} GB", f"{peaks['none']:.2f} GB", peaks[name] / peaks["none"])
             for name, said in (("every-2", "1 layer in 2"), ("every-1", "every layer"))]
    return rows + [row("peak RSS, largest rank: `--estimate_memory` / measured, 170M model, micro batch 8, "
                       "activation checkpointing of 1 layer in 2", f"{planned['every-2']:.2f} GB",
                       f"{peaks['every-2']:.2f} GB", planned["every-2"] / peaks["every-2"],
                       f"within {PLANNER_TOLERANCE:.0%}", abs(planned["every-2"] / peaks["every-2"] - 1)
                       <= PLANNER_TOLERANCE)]


PARTS = {"overhead": bench_overhead, "trainer": bench_trainer, "fsdp2": bench_fsdp2, "memory": bench_memory,
         "checkpoint": bench_checkpoint, "async_save": bench_async_save, "loss": bench_loss,
         "spike_guard": bench_spike_guard, "planner": bench_planner, "checkpointing": bench_checkpointing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--short_steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    shortest_long_run = min(regime.long_steps for regime in REGIMES)
    if options.repeats < 1:
        parser.error(f"--repeats must be 1 or more, got {options.repeats}")
    if not Workload.warmup_steps <= options.short_steps < shortest_long_run:
        parser.error(f"--short_steps must be from {Workload.warmup_steps} (the warmup) to {shortest_long_run - 1} "
                     f"(below the shortest long run), got {options.short_steps}")
    if "trainer" in options.parts and importlib.util.find_spec("accelerate") is None:  # known now, not an hour on
        parser.error("--parts trainer runs the Hugging Face Trainer, which needs accelerate: "
                     "pip install -r benchmarks/requirements.txt")
    with tempfile.TemporaryDirectory() as folder, quiet_progress():
        work_dir = Path(folder)
        data = work_dir / "data"
        prepare(PrepareArgs(input=stdlib_corpus_paths(CORPUS), output_dir=str(data), vocab_size=2000,
                            block_size=128, val_fraction=0.05, seed=0))
        rows = []
        for part in options.parts:
            print(f"{part} ...", flush=True)
            part_rows = PARTS[part](data, work_dir, options)
            print("\n".join(part_rows), flush=True)  # kept in the log should a later part fail
            rows += part_rows
    print(f"\n{os.cpu_count()} CPU cores, 2 processes, torch {torch.__version__}; step times: medians of "
          f"{options.repeats} paired repeats of a {options.short_steps}-step run and a long one, ratio (range)\n")
    print("| measured | application | baseline | ratio | target |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
