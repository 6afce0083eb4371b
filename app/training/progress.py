"""Where training stands: the plain values of a run's `state` that change as it trains, which a checkpoint keeps and a
resume takes back. One table gives each its value at step 0, which is also the value for a checkpoint written before
the key existed; copying the keys by hand in each place that restores them was a place to forget one (elapsed_sec
restarted at 0 after every resume)."""

from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

PROGRESS: dict[str, Any] = {
    "step": 0,
    "epoch": 0,
    "position": 0,  # rows of the epoch trained
    "val_loss": None,
    "val_loss_step": None,  # the step val_loss was measured at (a stopped run's last one may be long ago)
    "best_val_loss": None,  # the lowest val_loss so far, and the evaluations since it (--early_stopping_patience)
    "evaluations_without_improvement": 0,
    "scaler_skipped_steps": 0,  # steps whose overflowed fp16 gradients the scaler did not apply (16-mixed)
    "spike_guard": None,  # the spike guard's history (app/reliability/spikes.py), set when saving
    "mixture": None,  # a mixture's positions and seeds per folder (app/data/mixture.py)
    "source_tokens": {},  # tokens trained per mixture folder
    "tokens_seen": 0,  # trained tokens (labels not -100) of the steps the weights took, over every attempt
    "tokens_read": 0,  # positions of every step, skipped ones too (TrainingPlan.tokens_per_step each): --max_tokens
    "log_window": [],  # the losses of the steps since the last log point, set when saving (Loop.unlogged_losses)
    "step_row": {},  # the metrics row of the saved step but its save_sec, set when saving (loggers.log_lost_row)
    "elapsed_sec": 0.0,  # the run's seconds at the save, over every attempt (StepClock.run_elapsed)
    "base_revision": None,  # the commit of the Hub model the run started from, set at its start (run.initial_state)
}

ROLLED_BACK = ("step", "val_loss", "val_loss_step", "best_val_loss", "evaluations_without_improvement", "log_window",
               "step_row", "tokens_seen", "tokens_read")
"""What a rollback (app/training/loop.py) takes back from the checkpoint it returns to: the counters of the weights
it reloads (tokens_seen went on, counting twice the tokens of the steps rolled back)."""
GOES_ON_AT_A_ROLLBACK = ("epoch", "position", "mixture", "source_tokens", "scaler_skipped_steps", "spike_guard",
                         "elapsed_sec", "base_revision")
"""What a rollback keeps: the data goes on after the incident's rows, the spike guard keeps its history (and
rolls back its own part), the run's clock and counts of what happened run on."""

SAVED_FOR_THE_RANKS = ("rng", "grad_scaler", "schedule")
"""Kept by a checkpoint and restored by their owners: each rank's random state (app/checkpoint/rng.py), the
gradient scaler's (the precision plugin), where the learning-rate schedule stands (the preflight's plan)."""


def out_of_patience(state: dict[str, Any], patience: Optional[int]) -> bool:
    """Whether the evaluation at the state's step was the --early_stopping_patience-th in a row without a new best:
    the run ends there (and a relaunch of it has nothing to train)."""
    return bool(patience) and state["val_loss_step"] == state["step"] and \
        state["evaluations_without_improvement"] >= patience


def patience_carried_over(state: dict[str, Any], saved_rows: str, rows_now: str) -> None:
    """What a resume or a rollback takes back for early stopping, the lowest validation loss and the evaluations since
    it, is kept only where those losses were measured on the rows this run's evaluations read
    (`io.validation_measured`): the losses of other rows do not compare (a resume on one rank of two read half the
    rows and stopped early a run whose loss on them was still falling), and the count starts anew, as best.json's."""
    if saved_rows != rows_now:
        state["best_val_loss"], state["evaluations_without_improvement"] = None, 0


def progress_at_start() -> dict[str, Any]:
    return copy.deepcopy(PROGRESS)


def saved_progress(saved: dict[str, Any], keys: Iterable[str] = PROGRESS) -> dict[str, Any]:
    """The values of `keys` a checkpoint holds, each at its step-0 value where the checkpoint predates it."""
    return {key: saved[key] if saved.get(key) is not None else copy.deepcopy(PROGRESS[key]) for key in keys}
