"""The prepared data folder, read as training steps and evaluation batches on this rank's device.

Worker processes (--num_workers) start as app/reliability/workers.py says: forked by a forkserver, never by the rank,
and deaf to the stop signals meant for the rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from datasets import Dataset, load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from app.data.formats import Batch, DataFormat, Layout, with_trained_tokens, without_training
from app.data.order import EpochBatches, epoch_permutation, eval_plan, step_rows
from app.optimization.schedule import TrainingPlan
from app.reliability.workers import worker_options

if TYPE_CHECKING:
    from lightning_fabric import Fabric


@dataclass
class TrainingData:
    format: DataFormat
    train: Dataset
    validation: Dataset
    train_trained_tokens: np.ndarray
    """Each train row's trained tokens: a step's total is known on every rank without a collective."""
    set_aside: set[int] = field(default_factory=set)
    """Train rows in quarantine (the spike guard's): read as every other row, trained on by no token."""

    def quarantine(self, rows: Iterable[int]) -> None:
        """From the next step on (and in the loaders made after this call) `rows` train nothing."""
        rows = set(rows)
        self.set_aside |= rows
        self.train_trained_tokens[sorted(rows)] = 0

    def row_batch(self, row: int) -> Batch:
        """One train row alone as a batch, on the host."""
        return self.format.collate(WithoutRows(self.train, self.set_aside).__getitems__([row]))


class WithoutRows(TorchDataset):
    """A split whose rows in `excluded` come without training (formats.without_training)."""

    def __init__(self, split: Dataset, excluded: set[int]) -> None:
        self.split, self.excluded = split, excluded

    def __len__(self) -> int:
        return len(self.split)

    def __getitems__(self, rows: list[int]) -> list[dict]:
        found = self.split.__getitems__(rows)
        return [without_training(item) if row in self.excluded else item for row, item in zip(rows, found)]


def load_data(data_dir: str | Path, layout: Layout = "position_ids") -> TrainingData:
    """The folder's splits; packed rows reach the model in `layout` (the one the preflight's probe chose)."""
    data_format = replace(DataFormat.of(data_dir), layout=layout)
    splits = load_from_disk(str(data_dir))
    train, counts = with_trained_tokens(splits["train"], data_format)
    validation, _ = with_trained_tokens(splits["validation"], data_format)
    return TrainingData(data_format, train, validation, counts)


@dataclass
class Step:
    """One optimizer step's micro-batches on this rank, and the trained tokens of the whole step on all ranks."""

    micro_batches: list[Batch]
    trained_tokens: int
    rows: list[int]
    """The rows of the whole step, all ranks' (order.step_rows)."""


def train_steps(fabric: Fabric, data: TrainingData, plan: TrainingPlan, *, seed: int, epoch: int, position: int,
                num_workers: int) -> Iterator[Step]:
    """Steps from (epoch, position) onwards, epoch after epoch, without end."""
    while True:
        order = epoch_permutation(len(data.train), seed=seed, epoch=epoch)
        sampler = EpochBatches(order, plan, rank=fabric.global_rank, position=position)
        split = WithoutRows(data.train, set(data.set_aside)) if data.set_aside else data.train
        loader = DataLoader(split, batch_sampler=sampler, collate_fn=data.format.collate,
                            num_workers=num_workers, pin_memory=fabric.device.type == "cuda",
                            **worker_options(num_workers))
        micro_batches = iter(fabric.setup_dataloaders(loader, use_distributed_sampler=False, move_to_device=True))
        for rows in step_rows(order, plan, position):
            yield Step([next(micro_batches) for _ in range(plan.accumulation)],
                       int(data.train_trained_tokens[rows].sum()), rows)
        epoch, position = epoch + 1, 0


def eval_batches(fabric: Fabric, data: TrainingData, *, batch_size: int, max_batches: int) -> Iterator[Batch]:
    """This rank's validation batches; padding rows (a rank past the end of the split) have no trained tokens."""
    for planned in eval_plan(len(data.validation), batch_size=batch_size, rank=fabric.global_rank,
                             world_size=fabric.world_size, max_batches=max_batches):
        rows = data.validation.__getitems__(planned.rows)
        for row in rows[planned.real_rows:]:
            without_training(row)
        batch = data.format.collate(rows)
        batch.inputs = fabric.to_device(batch.inputs)
        yield batch
