"""The prepared data folder, read as training steps and evaluation batches on this rank's device.

Worker processes (--num_workers) start as app/reliability/workers.py says: forked by a forkserver, never by the rank,
and deaf to the stop signals meant for the rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from datasets import Dataset, load_from_disk
from torch.utils.data import DataLoader

from app.data.formats import IGNORE_INDEX, Batch, DataFormat, Layout, with_trained_tokens
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


def train_steps(fabric: Fabric, data: TrainingData, plan: TrainingPlan, *, seed: int, epoch: int, position: int,
                num_workers: int) -> Iterator[Step]:
    """Steps from (epoch, position) onwards, epoch after epoch, without end."""
    while True:
        order = epoch_permutation(len(data.train), seed=seed, epoch=epoch)
        sampler = EpochBatches(order, plan, rank=fabric.global_rank, position=position)
        loader = DataLoader(data.train, batch_sampler=sampler, collate_fn=data.format.collate,
                            num_workers=num_workers, pin_memory=fabric.device.type == "cuda",
                            **worker_options(num_workers))
        micro_batches = iter(fabric.setup_dataloaders(loader, use_distributed_sampler=False, move_to_device=True))
        for rows in step_rows(order, plan, position):
            yield Step([next(micro_batches) for _ in range(plan.accumulation)],
                       int(data.train_trained_tokens[rows].sum()))
        epoch, position = epoch + 1, 0


def eval_batches(fabric: Fabric, data: TrainingData, *, batch_size: int, max_batches: int) -> Iterator[Batch]:
    """This rank's validation batches; padding rows (a rank past the end of the split) have no trained tokens."""
    for planned in eval_plan(len(data.validation), batch_size=batch_size, rank=fabric.global_rank,
                             world_size=fabric.world_size, max_batches=max_batches):
        rows = data.validation.__getitems__(planned.rows)
        for row in rows[planned.real_rows:]:
            row["labels"] = row.get("labels", row["input_ids"]).clone().fill_(IGNORE_INDEX)
            row["trained_tokens"] = 0
        batch = data.format.collate(rows)
        batch.inputs = fabric.to_device(batch.inputs)
        yield batch
