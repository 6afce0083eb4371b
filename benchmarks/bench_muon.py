"""One Muon step of a model's layer matrices sharded by rows over 2 processes (FSDP2's DTensors): torch's Muon,
whose Newton-Schulz iterations run op by op on the DTensors, against this project's ShardedMuon
(app/optimization/muon.py), which orthogonalises each matrix whole on one rank; alternating in one invocation, so
that the ratio is of samples taken in the same seconds of a noisy machine.

    python benchmarks/bench_muon.py --model_config configs/bench-170m --repeats 5 [--backend nccl]

prints each contender's median step time and collectives per step (DTensor's CommDebugMode; ShardedMuon's
all_to_alls are counted there too), and the median of the repeats' ratios with their range."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.optimization.muon import ShardedMuon  # noqa: E402
from app.optimization.optimizer import matrix_names  # noqa: E402

CONTENDERS = {"torch Muon on DTensors": torch.optim.Muon, "ShardedMuon": ShardedMuon}
WORLD_SIZE = 2


def layer_matrix_shapes(model_config: str) -> list[torch.Size]:
    """The shapes of the matrices --optimizer muon steps with Muon, in the model's order (built on the meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_config))
    names = matrix_names(model)
    return [p.shape for name, p in model.named_parameters() if name in names]


def sharded_optimizer(make: type, shapes: list[torch.Size], mesh, device: torch.device) -> torch.optim.Optimizer:
    """An optimizer over DTensor matrices sharded by rows, with gradients, stepped once (its momentum created)."""
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(distribute_tensor(torch.randn(shape, device=device), mesh, [Shard(0)]))
        param.grad = distribute_tensor(torch.randn(shape, device=device), mesh, [Shard(0)])
        params.append(param)
    optimizer = make(params, lr=2e-4, adjust_lr_fn="match_rms_adamw")
    optimizer.step()
    return optimizer


def step_seconds(optimizer: torch.optim.Optimizer, device: torch.device) -> tuple[float, int]:
    """One step's seconds, the same on every rank (the slowest's), and its collectives."""
    dist.barrier()
    with CommDebugMode() as comms:
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = torch.tensor(time.perf_counter() - start, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item(), comms.get_total_counts()


def rank_main(rank: int, options: argparse.Namespace) -> None:
    os.environ |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(options.port))
    dist.init_process_group(options.backend, rank=rank, world_size=WORLD_SIZE)
    device = torch.device("cuda", rank) if options.backend == "nccl" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (WORLD_SIZE,))
    shapes = layer_matrix_shapes(options.model_config)
    optimizers = {name: sharded_optimizer(make, shapes, mesh, device) for name, make in CONTENDERS.items()}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    collectives: dict[str, int] = {}
    for repeat in range(options.repeats):
        for name in list(optimizers) if repeat % 2 == 0 else list(reversed(optimizers)):
            seconds, collectives[name] = step_seconds(optimizers[name], device)
            times[name].append(seconds)
    if rank == 0:
        baseline, ours = times.values()
        ratios = [mine / theirs for mine, theirs in zip(ours, baseline)]
        for name, seconds in times.items():
            print(f"{name}: {statistics.median(seconds):.3f} s a step, {collectives[name]} collectives "
                  f"({len(shapes)} matrices of {options.model_config}, {WORLD_SIZE} ranks, {device.type})")
        print(f"ShardedMuon / torch Muon: {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
              f"over {options.repeats} repeats")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_config", default="configs/bench-170m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="nccl: one GPU per rank")
    options = parser.parse_args()
    if options.repeats < 1:
        parser.error(f"--repeats must be 1 or more, got {options.repeats}")
    with socket.socket() as probe:  # a free port for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        options.port = probe.getsockname()[1]
    mp.start_processes(rank_main, args=(options,), nprocs=WORLD_SIZE, start_method="fork")  # nothing touched CUDA


if __name__ == "__main__":
    main()
