"""FSDP2's collectives on CPU processes: gloo's all-gather and reduce-scatter against
app/distributed/cpu_collectives.py's point-to-point ones, on one layer of the 170M model of configs/bench-170m (16.8M
fp32 elements, 67 MB), side by side.

Each of 2 processes runs every contender `--repeats` times in alternating order, each time on fresh tensors as FSDP2
allocates them at every layer; rank 0 reports the median time and page faults per call.

Run: python benchmarks/bench_collectives.py [--numel 16.8e6] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.distributed.cpu_collectives import PointToPointAllGather, PointToPointReduceScatter

Collective = Callable[[int, int], None]
"""(rank, numel of the gathered layer) -> one call on fresh tensors."""
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""torch's newer names (2.13 deprecates the older ones), else the older ones (the GPU image's torch 2.11 has no
other)."""


def gloo_all_gather(rank: int, numel: int) -> None:
    output = torch.empty(numel)
    ALL_GATHER(output, output.narrow(0, rank * numel // 2, numel // 2).fill_(rank))


def our_all_gather(rank: int, numel: int) -> None:
    output = torch.empty(numel)
    PointToPointAllGather()(output, output.narrow(0, rank * numel // 2, numel // 2).fill_(rank), dist.group.WORLD)


def gloo_reduce_scatter(rank: int, numel: int) -> None:
    REDUCE_SCATTER(torch.empty(numel // 2), torch.full((numel,), float(rank)), op=dist.ReduceOp.AVG)


def our_reduce_scatter(rank: int, numel: int) -> None:
    PointToPointReduceScatter()(torch.empty(numel // 2), torch.full((numel,), float(rank)), dist.group.WORLD,
                                op=dist.ReduceOp.AVG)


CONTENDERS: dict[str, tuple[Collective, Collective]] = {
    "all-gather": (our_all_gather, gloo_all_gather),
    "reduce-scatter": (our_reduce_scatter, gloo_reduce_scatter),
}


def measure(collective: Collective, rank: int, numel: int) -> tuple[float, int]:
    dist.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    collective(rank, numel)
    return time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def rank_main(rank: int, store: str, numel: int, repeats: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    for name, (ours, gloos) in CONTENDERS.items():
        samples: dict[Collective, list[tuple[float, int]]] = {ours: [], gloos: []}
        for repeat in range(repeats + 1):
            order = (ours, gloos) if repeat % 2 else (gloos, ours)
            for collective in order:
                result = measure(collective, rank, numel)
                if repeat:  # the first round warms up gloo's connections
                    samples[collective].append(result)
        if rank == 0:
            seconds = {c: statistics.median(s for s, _ in samples[c]) for c in samples}
            faults = {c: statistics.median(f for _, f in samples[c]) for c in samples}
            print(f"| {name}, {numel * 4 / 1e6:.0f} MB: point-to-point / gloo | {seconds[ours] * 1e3:.1f} ms, "
                  f"{faults[ours]:.0f} faults | {seconds[gloos] * 1e3:.1f} ms, {faults[gloos]:.0f} faults | "
                  f"{seconds[ours] / seconds[gloos]:.2f} |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=16.8e6, help="elements of the gathered layer")
    parser.add_argument("--repeats", type=int, default=20)
    options = parser.parse_args()
    if options.repeats < 1 or options.numel < 2:
        parser.error(f"--repeats must be 1 or more and --numel 2 or more, got {options.repeats} and {options.numel:g}")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    print("| collective (2 CPU processes, per call, median) | application | baseline | ratio |\n| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(str(Path(folder) / "store"), int(options.numel) // 2 * 2, options.repeats), nprocs=2)


if __name__ == "__main__":
    main()
