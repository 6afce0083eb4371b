"""Validation loss: the mean over every trained token of the evaluated batches, on all ranks together."""

from __future__ import annotations

import math

import torch
from lightning_fabric import Fabric
from torch.nn import Module

from app.data import TrainingData, eval_batches
from app.metrics.observe import gather_rows
from app.model.loss import LossPath


@torch.no_grad()
def validation_loss(fabric: Fabric, model: Module, loss_path: LossPath, data: TrainingData, *, batch_size: int,
                    max_batches: int) -> float:
    """Token-weighted mean loss over up to max_batches batches per rank, reduced over all ranks.

    Every rank runs the same number of forward passes (FSDP gathers parameters collectively). Batches' summed
    token losses are added up and divided by their trained tokens (counted on the host), so batches and ranks with
    more trained tokens weigh more, and nothing synchronises until the final reduction. The loss is asked for as
    training asks (`loss_path`): chunked, it never holds a batch's full logits.
    """
    model.eval()
    loss_sum = torch.zeros((), device=fabric.device, dtype=torch.float64)
    token_count = 0
    for batch in eval_batches(fabric, data, batch_size=batch_size, max_batches=max_batches):
        loss = loss_path.summed_loss(model, batch)  # on every rank, trained tokens or not
        if batch.trained_tokens:
            loss_sum += loss.double()
            token_count += batch.trained_tokens
    model.train()
    totals = torch.stack([loss_sum, torch.tensor(float(token_count), device=fabric.device, dtype=torch.float64)])
    totals = fabric.all_reduce(totals, reduce_op="sum")
    return (totals[0] / totals[1]).item()


@torch.no_grad()
def row_losses(fabric: Fabric, model: Module, loss_path: LossPath, data: TrainingData,
               rows: list[int]) -> list[tuple[int, float, int]]:
    """(row, summed token loss, trained tokens) of each train row of `rows` (one step's, all ranks'), each row through
    the model alone, without dropout: every rank scores an equal share, then one all_gather gives all of them to
    every rank. For the spike guard, to name the rows that made a spike (spikes.culprits)."""
    share = len(rows) // fabric.world_size
    mine = rows[fabric.global_rank * share:(fabric.global_rank + 1) * share]
    model.eval()
    scored = []
    for row in mine:
        batch = data.row_batch(row)
        batch.inputs = fabric.to_device(batch.inputs)
        scored.append(torch.stack([torch.tensor(float(row), dtype=torch.float64, device=fabric.device),
                                   loss_path.summed_loss(model, batch).double(),
                                   torch.tensor(float(batch.trained_tokens), dtype=torch.float64,
                                                device=fabric.device)]))
    model.train()
    every_rank = gather_rows(torch.stack(scored).reshape(-1)).reshape(-1, 3).tolist()
    return [(int(row), loss, int(tokens)) for row, loss, tokens in every_rank]


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
