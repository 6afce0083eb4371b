"""Validation loss: the mean over every predicted token of the evaluated batches, on all ranks together."""

from __future__ import annotations

import math

import torch
from datasets import Dataset
from lightning import Fabric
from torch.nn import Module

from app.data import eval_plan

IGNORE_INDEX = -100


@torch.no_grad()
def validation_loss(fabric: Fabric, model: Module, split: Dataset, *, batch_size: int, max_batches: int) -> float:
    """Token-weighted mean loss over up to max_batches batches per rank, reduced over all ranks.

    Every rank runs the same number of forward passes (FSDP gathers parameters collectively); padding rows are
    excluded from the loss through the ignore index.
    """
    model.eval()
    loss_sum = torch.zeros((), device=fabric.device, dtype=torch.float64)
    token_count = torch.zeros((), device=fabric.device, dtype=torch.float64)
    for batch in eval_plan(len(split), batch_size=batch_size, rank=fabric.global_rank,
                           world_size=fabric.world_size, max_batches=max_batches):
        input_ids = fabric.to_device(split[batch.rows]["input_ids"])
        labels = input_ids.clone()
        labels[batch.real_rows:] = IGNORE_INDEX
        loss = model(input_ids=input_ids, labels=labels).loss
        if batch.real_rows:
            tokens = batch.real_rows * (input_ids.shape[1] - 1)
            loss_sum += loss.double() * tokens
            token_count += tokens
    model.train()
    totals = fabric.all_reduce(torch.stack([loss_sum, token_count]), reduce_op="sum")
    return (totals[0] / totals[1]).item()


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
