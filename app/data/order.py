"""Which rows each rank reads, as a pure function of the state: the same answer on every rank, nothing read to know it.

Training: each epoch is one seeded permutation of the train split, the same on every rank; it depends on
(seed, epoch) only (a mixture of folders orders its rows as mixture.py says, and is split among ranks alike). Optimizer step after step takes the next `global_batch_size` samples of it, and splits them
into the micro-batches of every rank. `position` counts the samples of the epoch already trained on, so a run
resumed on another number of ranks or with another micro batch continues at the same sample of the same order;
the batches before it are skipped by index, not read. A tail too short for a whole step is left out.
Evaluation: the validation split in order, every rank taking the same number of batches (a rank past the end of
the data gets padding rows of weight zero), so that FSDP's collectives never wait on a rank that has run out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

from app.optimization.schedule import TrainingPlan


def epoch_permutation(num_rows: int, *, seed: int, epoch: int) -> list[int]:
    """The order of the train split's rows in one epoch. The seed is taken modulo 2**64, the most torch's generator
    takes: a mixture's seeds (mixture.source_seed) pass it from --seed 281,469,838 on, which ended a run in an
    overflow at its first step; every smaller seed keeps the order it had."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
    return torch.randperm(num_rows, generator=generator).tolist()


def step_rows(order: list[int], plan: TrainingPlan, position: int) -> Iterator[list[int]]:
    """The rows of every whole step from sample `position` of `order` on, over all ranks."""
    for start in range(position, len(order) - plan.global_batch_size + 1, plan.global_batch_size):
        yield order[start:start + plan.global_batch_size]


def epochs_of_steps(num_rows: int, plan: TrainingPlan, *, seed: int, epoch: int,
                    position: int) -> Iterator[list[int]]:
    """The rows of every step from sample `position` of epoch `epoch` on, epoch after epoch, without end."""
    while True:
        yield from step_rows(epoch_permutation(num_rows, seed=seed, epoch=epoch), plan, position)
        epoch, position = epoch + 1, 0


def rank_share(rows: list[int], plan: TrainingPlan, rank: int) -> list[list[int]]:
    """This rank's micro-batches of one step's rows (all ranks').

    Micro-batch m of a step holds the step's samples [m x world x micro, (m + 1) x world x micro), rank r its
    r-th slice of `micro` samples: every layout of the same global batch trains on the same samples.
    """
    size, world = plan.micro_batch_size, plan.world_size
    return [rows[(micro * world + rank) * size:(micro * world + rank + 1) * size] for micro in range(plan.accumulation)]


class StepBatches(Sampler[list[int]]):
    """Micro-batches of row indices for one rank, from an iterator of steps' rows (all ranks'), as they come."""

    def __init__(self, steps: Iterator[list[int]], plan: TrainingPlan, *, rank: int) -> None:
        self.steps, self.plan, self.rank = steps, plan, rank

    def __iter__(self) -> Iterator[list[int]]:
        for rows in self.steps:
            yield from rank_share(rows, self.plan, self.rank)


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
