"""One optimizer step of bf16 weights: torch's fused AdamW (rounding to nearest) against --stochastic_rounding's
AdamW (app/optimization/stochastic_rounding.py), side by side in one process, alternating, so that the ratio is of
samples taken in the same seconds of a noisy machine.

    python benchmarks/bench_optimizer.py --elements 50000000 --repeats 5 [--device cuda]

prints each contender's median step time and the median of the repeats' ratios with their range."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.optimization.stochastic_rounding import StochasticRoundingAdamW  # noqa: E402

CONTENDERS: dict[str, Callable[[torch.nn.Parameter], torch.optim.Optimizer]] = {
    "torch fused AdamW": lambda weight: torch.optim.AdamW([weight], lr=2e-5, fused=True),
    "stochastic rounding": lambda weight: StochasticRoundingAdamW([weight], seed=0, lr=2e-5),
}


def step_seconds(optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(elements: int, repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Each contender's step times, one per repeat, after a first step that creates its state."""
    optimizers = {}
    for name, make in CONTENDERS.items():
        weight = torch.nn.Parameter(torch.randn(elements, device=device).bfloat16())
        weight.grad = torch.randn(elements, device=device).bfloat16()
        optimizers[name] = make(weight)
        optimizers[name].step()
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for repeat in range(repeats):
        order = list(optimizers) if repeat % 2 == 0 else list(reversed(optimizers))
        for name in order:
            times[name].append(step_seconds(optimizers[name], device))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=50_000_000, help="bf16 weights in the one tensor stepped")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    times = measure(args.elements, args.repeats, torch.device(args.device))
    baseline, ours = (times[name] for name in CONTENDERS)
    ratios = [mine / theirs for mine, theirs in zip(ours, baseline)]
    for name, seconds in times.items():
        print(f"{name}: {statistics.median(seconds):.4f} s a step of {args.elements:,} weights ({args.device})")
    print(f"stochastic rounding / torch fused AdamW: {statistics.median(ratios):.1f} "
          f"({min(ratios):.1f}-{max(ratios):.1f}) over {args.repeats} repeats")


if __name__ == "__main__":
    main()
