"""Tokenized data from prepare_data.py, cut into per-rank batches whose order is a pure function of the state.

Training: each epoch is one seeded permutation of the train split, the same on every rank; it depends on
(seed, epoch) only. Optimizer step after step takes the next `global_batch_size` samples of it, and splits them
into the micro-batches of every rank. `position` counts the samples of the epoch already trained on, so a run
resumed on another number of ranks or with another micro batch continues at the same sample of the same order;
the batches before it are skipped by index, not read. A tail too short for a whole step is left out.
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


def load_splits(train_data_dir: str | Path) -> DatasetDict:
    """The train and validation splits, yielding int64 token tensors."""
    splits = load_from_disk(str(train_data_dir))
    return DatasetDict({name: splits[name].with_format("torch", columns=["input_ids"], dtype=torch.long)
                        for name in ("train", "validation")})


def block_size(split: Dataset) -> int:
    return len(split[0]["input_ids"])


def epoch_permutation(num_rows: int, *, seed: int, epoch: int) -> list[int]:
    """The order of the train split's rows in one epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_rows, generator=generator).tolist()


def rank_micro_batches(order: list[int], plan: TrainingPlan, *, rank: int, position: int) -> list[list[int]]:
    """This rank's micro-batches for every whole step from sample `position` of `order` on.

    Micro-batch m of a step holds the step's samples [m x world x micro, (m + 1) x world x micro), rank r its
    r-th slice of `micro` samples: every layout of the same global batch trains on the same samples.
    """
    size, world = plan.micro_batch_size, plan.world_size
    batches = []
    for start in range(position, len(order) - plan.global_batch_size + 1, plan.global_batch_size):
        for micro in range(plan.accumulation):
            first = start + (micro * world + rank) * size
            batches.append(order[first:first + size])
    return batches


class EpochBatches(Sampler[list[int]]):
    """Micro-batches of row indices for one rank and one epoch, from sample `position` of the epoch on."""

    def __init__(self, num_rows: int, plan: TrainingPlan, *, seed: int, epoch: int, rank: int,
                 position: int = 0) -> None:
        order = epoch_permutation(num_rows, seed=seed, epoch=epoch)
        self.batches = rank_micro_batches(order, plan, rank=rank, position=position)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def train_batches(fabric, split: Dataset, plan: TrainingPlan, *, seed: int, epoch: int, position: int,
                  num_workers: int) -> Iterator[torch.Tensor]:
    """Token batches on this rank's device from (epoch, position) onwards, epoch after epoch, without end."""
    while True:
        sampler = EpochBatches(len(split), plan, seed=seed, epoch=epoch, rank=fabric.global_rank, position=position)
        loader = DataLoader(split, batch_sampler=sampler, num_workers=num_workers,
                            pin_memory=fabric.device.type == "cuda", persistent_workers=False)
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
