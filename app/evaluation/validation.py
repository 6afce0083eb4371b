"""Validation loss: the mean over every trained token of the evaluated batches, on all ranks together."""

from __future__ import annotations

import math

import torch
from lightning_fabric import Fabric
from torch.nn import Module

from app.data import TrainingData, eval_batches
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


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
