"""The arithmetic of a run: batch sizes, steps per epoch and the learning rate at each step. Pure functions."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional


DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1.0 - progress,
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
}
"""The share of (lr - min_lr) left at a point of the decay (0: its start, 1: its end). `sqrt` is the cooldown that
warmup-stable-decay runs end with (Hägele et al. 2024; torchtitan's decay_type sqrt)."""

SCHEDULE_OPTIONS = {"lr": None, "min_lr": None, "warmup_steps": None, "lr_decay": None, "lr_decay_type": "cosine",
                    "lr_decay_ratio": 1.0}
"""The options learning_rate reads, with the value of those that a checkpoint of an earlier version lacks."""


def learning_rate(step: float, *, lr: float, min_lr: float, warmup_steps: float, max_step: float,
                  lr_decay: bool = True, lr_decay_type: str = "cosine", lr_decay_ratio: float = 1.0) -> float:
    """LR for optimizer step `step` (1-based): linear warmup from 0 to lr, then lr until the decay begins, then the
    decay's shape down to min_lr at max_step. The decay takes the last `lr_decay_ratio` of the steps, and never
    begins before the warmup ends: 1 (the default) decays from the end of warmup on; 0.2 holds lr until the last
    fifth of the run (warmup-stable-decay, which a resume can end or extend: --max_step moves the decay with it).

    Past max_step the LR stays at min_lr; with decay off it stays at lr after warmup.
    """
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    if not lr_decay:
        return lr
    if step >= max_step:
        return min_lr
    begins = max(warmup_steps, max_step * (1.0 - lr_decay_ratio))
    if step <= begins:
        return lr
    progress = (step - begins) / (max_step - begins)
    return min_lr + DECAY_SHAPES[lr_decay_type](progress) * (lr - min_lr)


def schedule_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """learning_rate's options as a run's config (a Config's fields, or a checkpoint's `config`) gives them."""
    return {name: config.get(name, default) for name, default in SCHEDULE_OPTIONS.items()}


def scale_for_batch(value: float, *, rule: str, global_batch_size: int, reference_batch_size: Optional[int]) -> float:
    """A learning rate tuned at `reference_batch_size`, moved to `global_batch_size` (seed 003): linear scales it
    with the batch, sqrt with its square root (sqrt(28 / 10) x 1e-5 = 1.7e-5 for 28 sequences tuned at 10)."""
    if rule == "none":
        return value
    ratio = global_batch_size / reference_batch_size
    return value * (ratio if rule == "linear" else math.sqrt(ratio))


def accumulation_steps(
    *, world_size: int, micro_batch_size: int, gradient_accumulation_steps: Optional[int], global_batch_size: Optional[int]
) -> int:
    """Micro-batches per optimizer step. Raises ValueError (naming the flags) when the batch sizes do not divide."""
    if global_batch_size is None:
        return gradient_accumulation_steps or 1
    per_pass = micro_batch_size * world_size
    if global_batch_size % per_pass:
        raise ValueError(
            f"--global_batch_size {global_batch_size} is not a multiple of --micro_batch_size x world size "
            f"({micro_batch_size} x {world_size} = {per_pass}): change one of them"
        )
    derived = global_batch_size // per_pass
    if gradient_accumulation_steps not in (None, derived):
        raise ValueError(
            f"--gradient_accumulation_steps {gradient_accumulation_steps} contradicts --global_batch_size "
            f"{global_batch_size}, which needs {derived} at world size {world_size}: give only one of them (a flag "
            "--gradient_accumulation_steps null or --global_batch_size null drops a config file's)"
        )
    return derived


@dataclass(frozen=True)
class TrainingPlan:
    """What the loop needs to know about batches and steps, derived once from the config and the data."""

    world_size: int
    micro_batch_size: int
    accumulation: int
    train_rows: int
    max_step: int
    block_size: int
    """The longest row: every row's length for block formats, an upper bound for padded ones."""
    row_tokens: float
    """Tokens in an average train row: `block_size` for block formats; the source for seq2seq."""
    target_tokens: float = 0.0
    """Tokens in an average target (seq2seq data), which the decoder reads."""
    resumed_schedule: Optional[tuple[int, float, float]] = None
    """(step, schedule step, schedule length) of a checkpoint whose learning-rate schedule this run finishes over
    its own remaining steps: a run resumed at another global batch takes another number of steps for the same
    epochs (see `schedule_step`). None: the schedule is this plan's steps."""

    def schedule_step(self, step: int) -> float:
        """Where optimizer step `step` stands in the learning-rate schedule (of `schedule_length` steps).

        Counted in this plan's steps, except after a resume at another global batch for the same epochs: the
        cosine was counted in the checkpoint's steps, and recounting it in this run's would move the rate at once
        (45% down at a doubled batch half-way); what is left of it is spread over this run's steps left instead."""
        if self.resumed_schedule is None:
            return step
        start, position, length = self.resumed_schedule
        if self.max_step <= start:
            return length
        return position + (step - start) * (length - position) / (self.max_step - start)

    def run_step(self, schedule_step: float) -> float:
        """The optimizer step at which the schedule stands at `schedule_step` (schedule_step's inverse), for saying
        where a stretch of it begins in this run's steps."""
        if self.resumed_schedule is None:
            return schedule_step
        start, position, length = self.resumed_schedule
        if length <= position:
            return self.max_step
        return start + (schedule_step - position) * (self.max_step - start) / (length - position)

    def learning_rate(self, step: int, options: dict[str, Any]) -> float:
        """Optimizer step `step`'s learning rate: the schedule's (its `options`: schedule_options) at the step's
        place in it."""
        return learning_rate(self.schedule_step(step), max_step=self.schedule_length, **options)

    @property
    def schedule_length(self) -> float:
        return self.resumed_schedule[2] if self.resumed_schedule is not None else self.max_step

    @property
    def steps_per_epoch(self) -> int:
        """Whole optimizer steps in one pass over the train split; a tail that does not fill one is skipped."""
        return self.train_rows // self.global_batch_size

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.world_size * self.accumulation

    @property
    def tokens_per_step(self) -> int:
        return round(self.global_batch_size * (self.row_tokens + self.target_tokens))


def interval_steps(interval: float, max_step: int) -> int:
    """An interval option in optimizer steps: a whole number as given, a share of the run below 1 as that many of
    its `max_step` steps, rounded up as the Hugging Face Trainer rounds them (0.1 of 25 steps: 3); 0 stays 0
    (off)."""
    if interval == 0 or interval >= 1:
        return int(interval)
    return max(1, math.ceil(interval * max_step))


def continuing_position(epoch: int, position: int, plan: TrainingPlan) -> tuple[int, int]:
    """Where a resumed run reads on: a checkpoint's position with no whole step of this run's global batch left in
    its epoch (the global batch grew) is the next epoch's start, as the data order has it (order.step_rows)."""
    if position + plan.global_batch_size > plan.train_rows:
        return epoch + 1, 0
    return epoch, position


def steps_for_tokens(tokens: int, plan: TrainingPlan) -> int:
    """Optimizer steps of this plan that read `tokens` positions (--max_tokens): the last one may read past them."""
    return max(0, math.ceil(tokens / plan.tokens_per_step))


def tokens_read(saved: dict[str, Any], plan: TrainingPlan) -> int:
    """The positions a checkpoint's steps read, which --max_tokens counts: its own count, or for a checkpoint written
    before it kept one, its steps at its global batch."""
    if saved.get("tokens_read") is not None:
        return saved["tokens_read"]
    return round(saved["step"] * saved["global_batch_size"] * plan.tokens_per_step / plan.global_batch_size)


def steps_to_finish(plan: TrainingPlan, *, epoch: int, position: int, number_epochs: int) -> int:
    """Optimizer steps from a resumed position to the end of --number_epochs, at this run's global batch (a
    checkpoint's step count was made at its own)."""
    epoch, position = continuing_position(epoch, position, plan)
    if epoch >= number_epochs:
        return 0
    return (plan.train_rows - position) // plan.global_batch_size + (number_epochs - 1 - epoch) * plan.steps_per_epoch


def make_plan(
    *,
    train_rows: int,
    block_size: int,
    row_tokens: Optional[float] = None,
    target_tokens: float = 0.0,
    world_size: int,
    micro_batch_size: int,
    accumulation: int,
    number_epochs: int,
    max_step: Optional[int],
) -> TrainingPlan:
    """Raises ValueError when the training split cannot fill a single optimizer step."""
    steps_per_epoch = train_rows // (world_size * micro_batch_size * accumulation)
    if steps_per_epoch == 0:
        raise ValueError(
            f"the training split has {train_rows} sequences, fewer than one optimizer step needs "
            f"({micro_batch_size} x {world_size} devices x {accumulation} accumulation): "
            "lower --micro_batch_size or --gradient_accumulation_steps, or add data"
        )
    return TrainingPlan(
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        accumulation=accumulation,
        train_rows=train_rows,
        max_step=max_step or steps_per_epoch * number_epochs,
        block_size=block_size,
        row_tokens=row_tokens or block_size,
        target_tokens=target_tokens,
    )
