"""Tokenized data from prepare_data.py, cut into per-rank batches whose order is a pure function of the state.

Training: each epoch is a seeded permutation of the train split, dealt round-robin to the ranks, so each rank
reads a disjoint part; the order depends on (seed, epoch) only. Resuming at `position` micro-batches into an epoch
skips those batches by index, without reading them. Worker processes (--num_workers) start as app/workers.py says:
forked by a forkserver, never by the rank, and deaf to the stop signals meant for the rank.
Evaluation: the validation split in order, every rank taking the same number of batches (a rank past the end of
the data gets padding rows of weight zero), so that FSDP's collectives never wait on a rank that has run out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict, load_from_disk
from torch.utils.data import DataLoader, Sampler

from app.schedule import TrainingPlan
from app.workers import worker_options


def load_splits(train_data_dir: str | Path) -> DatasetDict:
    """The train and validation splits, yielding int64 token tensors."""
    splits = load_from_disk(str(train_data_dir))
    return DatasetDict({name: splits[name].with_format("torch", columns=["input_ids"], dtype=torch.long)
                        for name in ("train", "validation")})


def block_size(split: Dataset) -> int:
    return len(split[0]["input_ids"])


def epoch_order(num_rows: int, *, seed: int, epoch: int, rank: int, world_size: int) -> list[int]:
    """This rank's rows for one epoch: a permutation seeded by (seed, epoch), dealt round-robin to the ranks."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_rows, generator=generator)[rank::world_size].tolist()


class EpochBatches(Sampler[list[int]]):
    """Micro-batches of row indices for one rank and one epoch, starting `skip` micro-batches in."""

    def __init__(self, num_rows: int, plan: TrainingPlan, *, seed: int, epoch: int, rank: int, skip: int = 0) -> None:
        order = epoch_order(num_rows, seed=seed, epoch=epoch, rank=rank, world_size=plan.world_size)
        size = plan.micro_batch_size
        self.batches = [order[i * size:(i + 1) * size] for i in range(skip, plan.micro_batches_per_epoch)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def train_batches(fabric, split: Dataset, plan: TrainingPlan, *, seed: int, epoch: int, position: int,
                  num_workers: int) -> Iterator[torch.Tensor]:
    """Token batches on this rank's device from (epoch, position) onwards, epoch after epoch, without end."""
    while True:
        sampler = EpochBatches(len(split), plan, seed=seed, epoch=epoch, rank=fabric.global_rank, skip=position)
        loader = DataLoader(split, batch_sampler=sampler, num_workers=num_workers,
                            pin_memory=fabric.device.type == "cuda", persistent_workers=False,
                            **worker_options(num_workers))
        for batch in fabric.setup_dataloaders(loader, use_distributed_sampler=False, move_to_device=True):
            yield batch["input_ids"]
        epoch, position = epoch + 1, 0


@dataclass(frozen=True)
class EvalBatch:
    rows: list[int]
    real_rows: int


def eval_plan(num_rows: int, *, batch_size: int, rank: int, world_size: int, max_batches: int) -> list[EvalBatch]:
    """The same number of batches on every rank; rows past the end are padding (row 0) with real_rows excluding them."""
    per_round = batch_size * world_size
    rounds = min(max_batches, -(-num_rows // per_round))
    plan = []
    for r in range(rounds):
        start = r * per_round + rank * batch_size
        rows = list(range(start, min(start + batch_size, num_rows)))
        plan.append(EvalBatch(rows=rows + [0] * (batch_size - len(rows)), real_rows=len(rows)))
    return plan
