"""Validation loss: the mean over every trained token of the evaluated batches, on all ranks together."""

from __future__ import annotations

import math
from typing import Callable

import torch
from lightning_fabric import Fabric
from torch.nn import Module

from app.data import TrainingData
from app.data.loader import eval_batches
from app.metrics.observe import gather_rows
from app.model.build import evaluation_mode
from app.model.loss import LossPath
from app.reliability.signals import all_reduce_sum


class EvaluationStopped(Exception):
    """A stop signal came during an evaluation: every rank leaves it at the same batch (or generated token), so that
    the run saves and stops within its grace period rather than after minutes of validation and generation."""


STOP_CHECK_BATCHES = 16
"""Every how many batches of a validation the ranks agree whether a stop signal came (one small all_reduce): between
two checks nothing synchronises."""


@torch.no_grad()
def validation_losses(fabric: Fabric, model: Module, loss_path: LossPath, data: TrainingData, *, batch_size: int,
                      max_batches: int, stopping: Callable[[], bool] = lambda: False) -> dict[str, float]:
    """Token-weighted mean loss over up to max_batches batches per rank, reduced over all ranks: {"": the loss}, and
    for a mixture also each folder's by name (up to max_batches batches of each), "" being their token-weighted mean;
    and each folder of --eval_data_dir's by name, left out of "" (the training data's; absent when it has none).

    Every rank runs the same number of forward passes (FSDP gathers parameters collectively). Batches' summed
    token losses are added up and divided by their trained tokens (counted on the host), so batches and ranks with
    more trained tokens weigh more, and nothing synchronises until the one final reduction, but `stopping()` every
    STOP_CHECK_BATCHES batches: whether any rank has seen a stop signal (then EvaluationStopped). The loss is asked
    for as training asks (`loss_path`): chunked, it never holds a batch's full logits.
    """
    trained = {name: split for name, split in data.validation_splits().items() if len(split)}
    splits = trained | data.evaluated  # other names: parse_eval_folders
    totals = torch.zeros(len(splits), 2, device=fabric.device, dtype=torch.float64)
    with evaluation_mode(model):
        for index, split in enumerate(splits.values()):
            token_count = 0
            batches = eval_batches(fabric, data.format, split, batch_size=batch_size, max_batches=max_batches)
            for number, batch in enumerate(batches, start=1):
                loss = loss_path.summed_loss(model, batch, auxiliary=False)  # on every rank, trained tokens or not
                if batch.trained_tokens:
                    totals[index, 0] += loss.double()
                    token_count += batch.trained_tokens
                if number % STOP_CHECK_BATCHES == 0 and stopping():
                    raise EvaluationStopped
            totals[index, 1] = token_count
    totals = all_reduce_sum(fabric, totals).tolist()  # without Lightning's barrier before it
    losses = {name: loss_sum / tokens for name, (loss_sum, tokens) in zip(splits, totals) if tokens}
    trained_totals = totals[:len(trained)]  # the training data's folders come first
    trained_tokens = sum(tokens for _, tokens in trained_totals)
    return losses | ({"": sum(loss_sum for loss_sum, _ in trained_totals) / trained_tokens} if trained_tokens else {})


@torch.no_grad()
def row_losses(fabric: Fabric, model: Module, loss_path: LossPath, data: TrainingData,
               rows: list[int]) -> list[tuple[int, float, int]]:
    """(row, summed token loss, trained tokens) of each train row of `rows` (one step's, all ranks'), each row through
    the model alone, without dropout: every rank scores an equal share, then one all_gather gives all of them to
    every rank. For the spike guard, to name the rows that made a spike (spikes.culprits)."""
    share = len(rows) // fabric.world_size
    mine = rows[fabric.global_rank * share:(fabric.global_rank + 1) * share]
    scored = []
    with evaluation_mode(model):
        for row in mine:
            batch = data.row_batch(row)
            batch.inputs = fabric.to_device(batch.inputs)
            scored.append(torch.stack([torch.tensor(float(row), dtype=torch.float64, device=fabric.device),
                                       loss_path.summed_loss(model, batch, auxiliary=False).double(),
                                       torch.tensor(float(batch.trained_tokens), dtype=torch.float64,
                                                    device=fabric.device)]))
    every_rank = gather_rows(torch.stack(scored).reshape(-1)).reshape(-1, 3).tolist()
    return [(int(row), loss, int(tokens)) for row, loss, tokens in every_rank]


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
