"""The training loop: optimizer steps until max_step, with evaluation, logging and checkpoints at their intervals."""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional

import torch
from lightning_fabric import Fabric

from app.checkpoint import (CheckpointSaver, checkpoint_path, last_good_checkpoint, latest_checkpoint,
                            load_last_good_checkpoint, mark_if_best, prune_checkpoints, read_best,
                            rng_of_every_rank, set_aside_newer)
from app.checkpoint.io import validation_measured
from app.data import Batch, Step, TrainingData, train_steps
from app.distributed.precision import restore_grad_scaler
from app.evaluation.validation import EvaluationStopped, perplexity, row_losses, validation_losses
from app.metrics.console import Console
from app.model.loss import LossPath
from app.metrics.loggers import RowRecord, forget_after, should_upload_checkpoint, upload_checkpoint
from app.metrics.observe import (PEAK_MEMORY, ModelStateMemory, RankStats, StepClock, Stopwatch, gather_rows, largest,
                         run_summary)
from app.evaluation.samples import SampleEvaluator, set_aside_samples_after
from app.optimization.optimizer import GradientPolicy, clip_gradients, gradient_square_sum, set_learning_rate
from app.optimization.schedule import TrainingPlan, continuing_position, schedule_options, tokens_read
from app.reliability.signals import StepVerdict, StopRequest, how_to_continue, step_verdict, stop_agreed
from app.reliability.spikes import QUARANTINE_FILE, Action, SpikeGuard, culprits, write_quarantine
from app.reliability.watchdog import StallWatchdog
from app.training.progress import ROLLED_BACK, out_of_patience, patience_carried_over, saved_progress

if TYPE_CHECKING:
    from lightning_fabric.plugins import Precision

    from arguments import Config


Outcome = Literal["finished", "preempted", "interrupted", "non_finite", "spikes"]
RESUME_ADVICE = "Resume from the last checkpoint with a lower --lr"
SCALE_FLOOR = 1.0
"""A loss scale at which fp16 gradients still overflow leaves them overflowing unscaled: not finite at any scale."""


def micro_batch_loss(model, loss_path: LossPath, batch: Batch, step_tokens: int, world_size: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss: its summed token losses divided by the step's trained tokens
    over all ranks, times the world size that DDP's and FSDP's gradient averaging divides by again.

    Means of micro-batches with different numbers of trained tokens are never averaged (a mean of means gives every
    micro-batch the same weight whatever its tokens: wrong gradients with supervised data and accumulation).
    """
    return loss_path.summed_loss(model, batch) * (world_size / max(step_tokens, 1))


def train_step(fabric: Fabric, model, step: Step, stop: StopRequest, gradients: GradientPolicy,
               optimizer, loss_path: LossPath, save_failed: bool = False) -> tuple[torch.Tensor, StepVerdict]:
    """Forward and backward over one optimizer step's micro-batches; returns this rank's part of the loss x world
    size (their mean over ranks is the step's loss, on the device) and the ranks' verdict on it.

    Gradients are synchronised after every micro-batch, or only after the last one when `gradients.defer_sync`
    (DDP's no_sync costs no memory; FSDP's keeps the whole unsharded gradient on every rank). The gradient norm is
    measured even when clipping is off so that a non-finite gradient is caught.
    """
    accumulation = len(step.micro_batches)
    loss_sum = torch.zeros((), device=fabric.device)
    for index, batch in enumerate(step.micro_batches):
        skip_sync = gradients.defer_sync and index < accumulation - 1
        # Not no_backward_sync(enabled=False): under fsdp2 it still walks every module twice per micro-batch
        with fabric.no_backward_sync(model) if skip_sync else nullcontext():
            loss = micro_batch_loss(model, loss_path, batch, step.trained_tokens, fabric.world_size)
            fabric.backward(loss)
        loss_sum += loss.detach()
        # Backward frees the graph's saved tensors, not its nodes: a `loss` left alive into the next micro-batch keeps
        # every node of its forward, scattered over the heap where its activations were, and the next forward's
        # activations no longer fit there (demo-llama, micro batch 16, 4 micro-batches: peak RSS 36 MB higher)
        del loss
    if gradients.scaled:
        fabric.strategy.precision.unscale_gradients(optimizer.optimizer)
    verdict = step_verdict(fabric, loss_sum, gradient_square_sum(optimizer, fabric.device), stop,
                           replicas=gradients.replicas, scaled=gradients.scaled, save_failed=save_failed)
    return loss_sum, verdict


def update_weights(optimizer, verdict: StepVerdict, lr: float, gradients: GradientPolicy,
                   before_update: Callable[[], None]) -> None:
    """Clip and apply the step's gradients. `before_update` runs just before the weights change (a background save
    copies them until then)."""
    if gradients.max_norm > 0:
        clip_gradients(optimizer, verdict.grad_norm, gradients.max_norm)
    set_learning_rate(optimizer, lr)
    before_update()
    optimizer.step()


def skip_update(precision: Precision, gradients: GradientPolicy) -> None:
    """A step whose gradients are not applied (the spike guard's verdict): a gradient scaler that unscaled them
    still closes the step, as optimizer.step() would, or the next step's unscale fails."""
    if gradients.scaled:
        precision.scaler.update()


def count_improvement(state: dict[str, Any], val_loss: float, threshold: float) -> None:
    """Keep the lowest validation loss so far, and the evaluations since one fell below it by more than
    `threshold` (--early_stopping_patience counts them)."""
    best = state["best_val_loss"]
    if best is None or val_loss < best - threshold:
        state["best_val_loss"], state["evaluations_without_improvement"] = val_loss, 0
    else:
        state["evaluations_without_improvement"] += 1


def is_save_step(step: int, last: bool, interval: int) -> bool:
    """Every `interval` optimizer steps and at the last one; never with --save_step_interval 0."""
    return interval > 0 and (step % interval == 0 or last)


def advance_position(state: dict[str, Any], plan: TrainingPlan, step: Step, data: TrainingData,
                     applied: bool = True) -> bool:
    """Count one optimizer step (`step`, read from `data`), and its trained tokens when it was `applied` (a step the
    spike guard skipped trained nothing), in the state; returns True when it finished an epoch (no whole step left in
    it, as continuing_position decides; a mixture's epoch is the rows of its plan, mixture.epoch_rows)."""
    state["step"] += 1
    state["tokens_seen"] += step.trained_tokens if applied else 0
    state["tokens_read"] += plan.tokens_per_step
    if step.mixture is not None:
        state["mixture"] = step.mixture
        for part, tokens in zip(data.sources, data.tokens_by_source(step.rows)):
            state["source_tokens"][part.source.name] = state["source_tokens"].get(part.source.name, 0) + tokens
    epoch = state["epoch"]
    state["epoch"], state["position"] = continuing_position(epoch, state["position"] + plan.global_batch_size, plan)
    return state["epoch"] != epoch


@dataclass
class Loop:
    """One run's training: the objects it needs, the decisions of when to log, evaluate and save, and its timers."""

    fabric: Fabric
    cfg: Config
    plan: TrainingPlan
    data: TrainingData
    state: dict[str, Any]
    stop: StopRequest
    clock: StepClock
    console: Console
    gradients: GradientPolicy
    watchdog: StallWatchdog
    saver: CheckpointSaver
    loss_path: LossPath
    guard: SpikeGuard
    samples: Optional[SampleEvaluator] = None
    rows_record: Optional[RowRecord] = None
    resumed_from: Optional[Path] = None
    measured: Optional[str] = None
    """The validation rows this run's evaluations read (io.validation_measured), which best.json compares by."""
    data_wait: Stopwatch = field(default_factory=Stopwatch)
    evaluation: Stopwatch = field(default_factory=Stopwatch)
    saving: Stopwatch = field(default_factory=Stopwatch)
    state_memory: ModelStateMemory = field(default_factory=ModelStateMemory)
    trace_step: Optional[Callable[[int], None]] = None
    """Called with the last finished step before each step begins: --profile_steps's tracer (app/metrics/profiling.py),
    timed apart from training (its export) by `tracing`, which the summary reports as trace_sec."""
    tracing: Stopwatch = field(default_factory=Stopwatch)
    ranks_at_last_log: Optional[list[RankStats]] = None
    trained_at_last_log: float = 0.0
    schedule: dict[str, Any] = field(init=False)
    """The learning-rate schedule's options (schedule_options)."""

    def __post_init__(self) -> None:
        self.clock.between_steps = (self.evaluation, self.saving, self.tracing)
        self.schedule = schedule_options(vars(self.cfg))

    def fit(self) -> Outcome:
        """Train until max_step; returns early after saving when a stop signal arrived, or when numbers went bad."""
        state, plan, cfg = self.state, self.plan, self.cfg
        steps = self.steps()
        self.state_memory.watch(state["model"], state["optimizer"])
        if state["step"] == 0 and cfg.initial_validation and cfg.eval_step_interval and self.data.evaluable():
            self.fabric.log_dict(self.evaluate(), step=0)
        losses = self.unlogged_losses()
        self.before_next_step()
        self.stop.begin_training(self.fabric)
        while state["step"] < plan.max_step:
            lr = self.learning_rate(state["step"] + 1)
            with self.data_wait.measure():
                step_batches = next(steps)
            loss, verdict = train_step(self.fabric, state["model"], step_batches, self.stop, self.gradients,
                                       state["optimizer"], self.loss_path, save_failed=self.saver.failed())
            if verdict.save_failed:
                self.saver.wait()  # raises the failed write's SaveFailed, on every rank alike
            if verdict.non_finite:
                self.report_non_finite(verdict)
                return "non_finite"
            quarantined = len(self.data.set_aside)
            action = self.judge(step_batches, verdict)
            if self.update(action, verdict, lr):  # the scaler gave up
                return "non_finite"
            if action == "stop":
                return "spikes"
            if step_batches.trained_tokens:
                losses.append(verdict.loss)
            self.watchdog.beat(arm=True)
            epoch_ended = advance_position(state, plan, step_batches, self.data, applied=action == "apply")
            if self.rows_record:
                self.rows_record.write(state["step"], self.data.rows_by_source(step_batches.rows))
            if action == "rollback":
                if not self.roll_back():
                    return "spikes"
                steps, losses = self.steps(), self.unlogged_losses()
                self.before_next_step()
                continue
            if len(self.data.set_aside) != quarantined:  # read again from here: the loader's rows train nothing
                steps = self.steps()
            throughput = self.clock.tick(state["step"])
            self.console.advance()
            if self.log_evaluate_save(losses, verdict, lr, throughput, epoch_ended):
                if state["step"] < plan.max_step:
                    return self.stopped_by_signal()
                self.say_final_evaluation_cut()
            if self.out_of_patience() and state["step"] < plan.max_step:
                return self.stopped_early()
            self.before_next_step()
        return "finished"

    def before_next_step(self) -> None:
        """Tell --profile_steps's tracer which step ended last (before the first step: the one the run starts at)."""
        if self.trace_step is not None:
            with self.tracing.measure():
                self.trace_step(self.state["step"])

    def out_of_patience(self) -> bool:
        """Whether this step's evaluation was the --early_stopping_patience-th in a row without a new best (the
        validation loss is the same on every rank, and so is this answer)."""
        return out_of_patience(self.state, self.cfg.early_stopping_patience)

    def stopped_early(self) -> Outcome:
        """After the stop's save: wait until it is published, then say why the run ends before max_step."""
        self.saver.wait()
        state = self.state
        self.console.print(f"step {state['step']}: {state['evaluations_without_improvement']} evaluations without a "
                           f"validation loss below {state['best_val_loss']:.4f}: stopped early "
                           f"(--early_stopping_patience {self.cfg.early_stopping_patience}); checkpoints/best.json "
                           "names the best checkpoint saved" + self.best_not_saved())
        return "finished"

    def best_not_saved(self) -> str:
        """What best.json cannot say: that the lowest validation loss was measured on weights no checkpoint holds
        (the starting weights, whose loss a fine-tune at too high a rate never came back to, or a step between
        saves)."""
        best, saved = self.state["best_val_loss"], read_best(self.cfg.out_dir)
        if saved is None or saved["val_loss"] - best <= max(self.cfg.early_stopping_threshold, 1e-3 * abs(best)):
            return ""
        return (f"; but its {saved['checkpoint']} validated at {saved['val_loss']:.4f}, and the lowest loss, "
                f"{best:.4f}, was of weights no checkpoint holds (the starting weights, or a step between saves): a "
                "lower --lr, or --save_step_interval equal to --eval_step_interval, keeps them")

    def say_final_evaluation_cut(self) -> None:
        """A stop signal at the last step: the run ends as finished (exit 0), its last checkpoint saved, but an
        evaluation the signal cut short is said, since nothing measures it later (a resume there has nothing to
        train): the summary's val_loss and best.json are an earlier step's."""
        state = self.state
        if self.cfg.eval_step_interval and len(self.data.validation) and state["val_loss_step"] != state["step"]:
            earlier = f"step {state['val_loss_step']}'s" if state["val_loss_step"] is not None else "none"
            self.console.print(f"step {state['step']}: the last step is saved, but the signal cut its evaluation "
                               f"short: the run's validation loss is {earlier}")

    def learning_rate(self, number: int) -> float:
        """Step `number`'s learning rate: the schedule's, at the step's place in it, times the spike guard's factor."""
        return self.plan.learning_rate(number, self.schedule) * self.guard.lr_factor(number)

    def update(self, action: Action, verdict: StepVerdict, lr: float) -> bool:
        """Apply the step's gradients when the spike guard accepts them (the scaler may still skip them), and clear
        them either way; True when the scaler gave up (report_scaler_skip)."""
        optimizer = self.state["optimizer"]
        gave_up = False
        if action == "apply":
            update_weights(optimizer, verdict, lr, self.gradients, self.saver.before_update)
            if self.gradients.scaled and not math.isfinite(verdict.grad_norm_value):
                gave_up = self.report_scaler_skip(self.state["step"] + 1)
        else:
            skip_update(self.fabric.strategy.precision, self.gradients)
        optimizer.zero_grad(set_to_none=True)
        return gave_up

    def log_evaluate_save(self, losses: list[float], verdict: StepVerdict, lr: float, throughput: dict[str, float],
                          epoch_ended: bool) -> bool:
        """After a step: log, evaluate and save as their intervals (or a stop signal) say, in one metrics row; whether
        a stop signal came (with the step, during the evaluation or during the save), this step saved. `losses` are
        the steps' losses since the last log; they are cleared once logged."""
        cfg, step = self.cfg, self.state["step"]
        last = step == self.plan.max_step
        scheduled_save = is_save_step(step, last, cfg.save_step_interval)
        metrics: dict[str, float] = {}
        if step % cfg.log_interval == 0 or last:
            metrics |= self.training_metrics(losses, verdict.grad_norm_value, lr, throughput)
            losses.clear()
        evaluated = bool(cfg.eval_step_interval) and (step % cfg.eval_step_interval == 0 or epoch_ended or last)
        stop = verdict.stop_requested
        if evaluated:
            evaluation = self.evaluate()
            evaluated = "val_loss" in evaluation  # else no validation loss to mark the checkpoint best by
            metrics |= evaluation
            stop = stop or stop_agreed(self.fabric, self.stop)
        if scheduled_save or stop or self.out_of_patience():
            self.state["log_window"], self.state["step_row"] = list(losses), dict(metrics)
            save_time = self.save(evaluated, upload=should_upload_checkpoint(cfg.log_model, last))
            if scheduled_save or metrics:  # a stop's own save makes no row that a run not stopped lacks
                metrics |= save_time
            stop = stop or stop_agreed(self.fabric, self.stop)
        if metrics:
            self.fabric.log_dict(metrics, step=step)
        return stop

    def stopped_by_signal(self) -> Outcome:
        """After the stop's save: wait until it is published (or has failed), then say how to continue."""
        self.saver.wait()
        received = f" ({signal.Signals(self.stop.signal).name})" if self.stop.signal else ""  # else another rank's
        self.console.print(f"step {self.state['step']}: stopped by a signal after saving{received}; "
                           f"{how_to_continue(self.cfg.requeue_on_signal, self.stop.signal)}")
        return "interrupted" if self.stop.interrupted else "preempted"

    def unlogged_losses(self) -> list[float]:
        """The losses of the steps since the last log point that the checkpoint resumed from saved (its
        log_window): a resume, a stop or a rollback then logs the train_loss a straight run logs (the window was
        lost at a stop, and the first row after the resume averaged only the steps since it). Each is a step's loss
        over all ranks, as the step's verdict brought it to the host."""
        return list(self.state["log_window"])

    def steps(self) -> Iterator[Step]:
        """The training steps from the state's epoch and position on."""
        return train_steps(self.fabric, self.data, self.plan, seed=self.cfg.seed, epoch=self.state["epoch"],
                           position=self.state["position"], num_workers=self.cfg.num_workers,
                           mixture=self.state.get("mixture"), reading=self.data_wait.measure)

    def judge(self, step: Step, verdict: StepVerdict) -> Action:
        """The spike guard's decision on this step, the same on every rank (spikes.py); what it found is printed, and
        the rows it blames are set aside."""
        number, guard = self.state["step"] + 1, self.guard
        if not step.trained_tokens:  # AdamW would still move every weight (momentum, decay) for a loss of 0/0
            self.console.print(f"step {number}: no trained tokens, every row of it set aside in quarantine: not "
                               "applied")
            return "skip"
        spike = guard.judge(number, verdict.loss, verdict.grad_norm_value)
        if spike is None:
            guard.accept(verdict.loss, verdict.grad_norm_value)
            return "apply"
        scored = row_losses(self.fabric, self.state["model"], self.loss_path, self.data, step.rows)
        blamed = culprits(scored, spike, guard.rules.floor)
        action = guard.respond(spike, explained=bool(blamed), rows=scored)
        rows = ", ".join(f"{row} (loss {loss:.2f})" for row, loss, _ in blamed[:10]) + (" ..." if len(blamed) > 10
                                                                                        else "")
        if blamed and guard.sets_aside:
            guard.set_aside(number, blamed)
            self.data.quarantine(row for row, *_ in blamed)
            if self.fabric.is_global_zero:
                write_quarantine(Path(self.cfg.out_dir), guard.history.quarantine, self.data.locate)
        self.console.print(f"step {number}: loss spike, {spike.describe()}: " + {
            "apply": f"applied (--spike_guard detect){'; rows standing out: ' + rows if rows else ''}",
            "skip": "not applied; " + (f"train rows set aside in quarantine.jsonl: {rows}" if rows else
                                        "no row stands out"),
            "rollback": "not applied; loss spikes without rows to blame repeat: rolling back",
            "stop": "not applied; loss spikes without rows to blame repeat"
                    + (" and no rollback is left" if guard.rules.mode == "rollback" else " (--spike_guard skip)")
                    + f": stopped without saving. {RESUME_ADVICE}"
                    + ("" if guard.rules.mode == "rollback" else ", or under --spike_guard rollback (which sets aside "
                       "the rows of spikes that repeat, if the data is to blame)")
                    + f" (rows set aside so far are in {Path(self.cfg.out_dir) / QUARANTINE_FILE})"}[action])
        return action

    def roll_back(self) -> bool:
        """Reload, in place, the last good checkpoint from before the incident; the data goes on after the
        incident's stretch, which is skipped. False, with a message, when no checkpoint precedes the incident."""
        state, fabric = self.state, self.fabric
        self.saver.before_update()
        self.saver.wait()
        began = self.guard.incident_began()
        passed_over: list[str] = []

        def say(line: str) -> None:
            passed_over.append(line)
            self.console.print(f"step {state['step']}: {line}")

        loaded = load_last_good_checkpoint(self.cfg.out_dir, began, state["model"], state["optimizer"], say,
                                           also=self.resumed_from)
        if loaded is None:
            none_left = (f"every checkpoint from before step {began} was passed over (see above)" if passed_over
                         else f"no checkpoint from before step {began} to roll back to")
            self.console.print(f"step {state['step']}: {none_left}; stopped without saving. {RESUME_ADVICE}")
            return False
        path, saved = loaded
        if fabric.is_global_zero:
            for moved in set_aside_newer(self.cfg.out_dir, saved["step"]) + set_aside_samples_after(
                    Path(self.cfg.out_dir), saved["step"]):
                self.console.print(f"step {state['step']}: moved {moved.name}, of the stretch rolled back, to {moved}")
        back = state["step"] - saved["step"]
        forget_after(fabric.loggers, saved["step"])
        # the data goes on; tokens_seen is the checkpoint's weights', as a resume from it counts them
        state |= saved_progress(saved, ROLLED_BACK)
        if self.measured is not None:
            patience_carried_over(state, validation_measured(saved), self.measured)
        state["tokens_read"] = tokens_read(saved, self.plan)  # a checkpoint from before the count: estimated
        restore_grad_scaler(fabric.strategy.precision, saved)
        incident = self.guard.rolled_back(saved["step"], saved.get("spike_guard"))
        if incident:
            self.data.quarantine(entry["row"] for entry in incident)
            if fabric.is_global_zero:
                write_quarantine(Path(self.cfg.out_dir), self.guard.history.quarantine, self.data.locate)
            self.console.print(f"step {saved['step'] + back}: the {len(incident)} train rows of the spikes that made "
                               f"this incident are set aside ({Path(self.cfg.out_dir) / QUARANTINE_FILE})")
        self.clock.rewind(back)
        self.console.print(f"step {saved['step'] + back}: rolled back to {path} (step {saved['step']}, rollback "
                           f"{self.guard.history.rollbacks} of {self.guard.rules.max_rollbacks}); training goes on "
                           f"from sample {state['position']} of epoch {state['epoch']}, after the data that led here")
        return True

    def gather_rank_stats(self) -> list[RankStats]:
        """Every rank's RankStats (memory, data wait), in one all_gather."""
        stats = RankStats.of_this_rank(self.fabric.device, self.data_wait, self.state_memory)
        return [RankStats.from_tensor(row) for row in gather_rows(stats.to_tensor().to(self.fabric.device)).cpu()]

    def training_metrics(self, losses: list[float], grad_norm: float, lr: float,
                         throughput: dict[str, float]) -> dict[str, float]:
        """The metrics of a log interval: the steps' losses and the last gradient norm came to the host with each
        step's verdict (its one synchronisation); what only each rank knows comes in one all_gather here."""
        ranks = self.gather_rank_stats()
        previous = self.ranks_at_last_log or [RankStats() for _ in ranks]
        waited = max(now.data_wait_sec - before.data_wait_sec for now, before in zip(ranks, previous))
        trained = self.clock.training_time()
        interval = trained - self.trained_at_last_log
        self.ranks_at_last_log, self.trained_at_last_log = ranks, trained
        step = self.state["step"]
        loss = {"train_loss": sum(losses) / len(losses)} if losses else {}  # none when no step trained a token
        metrics = {"epoch": self.epochs_done(), "tokens_seen": self.state["tokens_seen"], **loss, "lr": lr,
                   "grad_norm": grad_norm, "elapsed_sec": self.clock.run_elapsed(),
                   "data_wait_pct": 100 * waited / interval,
                   **throughput, **self.guard.metrics(), **self.source_tokens()}
        metrics |= {name: largest(ranks, name) for name in PEAK_MEMORY if not math.isnan(largest(ranks, name))}
        self.console.report(step, self.plan.max_step, metrics, self.clock.eta(step))
        return metrics

    def epochs_done(self) -> float:
        """Epochs trained, with the share of the current one (as transformers' Trainer logs them): the epoch counter,
        which the step's end has already moved on, put the last step of an epoch in the next one."""
        return round(self.state["epoch"] + self.state["position"] / self.plan.train_rows, 4)

    def summarize(self) -> dict[str, Any]:
        """The run summary; every rank takes part (one all_gather of the ranks' numbers)."""
        ranks = self.gather_rank_stats()
        summary = run_summary(clock=self.clock, step=self.state["step"], evaluation=self.evaluation,
                              saving=self.saving, ranks=ranks, val_loss=self.state["val_loss"],
                              val_loss_step=self.state["val_loss_step"])
        return (summary | ({"spike_guard": self.guard.metrics()} if self.guard.active else {})
                | ({"scaler_skipped_steps": self.state["scaler_skipped_steps"]} if self.gradients.scaled
                   else {})
                | ({"tokens_by_source": self.source_tokens()} if self.data.mixture else {})
                | ({"trace_sec": self.tracing.total} if self.trace_step is not None else {}))

    def source_tokens(self) -> dict[str, int]:
        """A mixture's trained tokens read so far from each folder (`tokens/<name>`)."""
        if not self.data.mixture:
            return {}
        return {f"tokens/{name}": self.state["source_tokens"].get(name, 0)
                for name in (part.source.name for part in self.data.sources)}

    def evaluate(self) -> dict[str, float]:
        """Validation loss (and generation samples) on every rank; nothing when the data has no validation split and
        no --eval_data_dir, or when a stop signal cut the evaluation short (on every rank alike: the run then saves
        and stops). Without the training data's validation loss there is no val_loss, so no best checkpoint."""
        cfg, step = self.cfg, self.state["step"]
        if not self.data.evaluable():
            return {}
        with self.evaluation.measure():
            try:
                losses = validation_losses(self.fabric, self.state["model"], self.loss_path, self.data,
                                           batch_size=cfg.eval_batch_size or cfg.micro_batch_size,
                                           max_batches=cfg.eval_iters, stopping=partial(stop_agreed, self.fabric,
                                                                                        self.stop))
                loss = losses.pop("", None)
                metrics = ({"val_loss": loss, "val_ppl": perplexity(loss)} if loss is not None else {}) | {
                    f"val_loss/{name}": value for name, value in losses.items()}
                if self.samples:
                    metrics |= self.samples.evaluate(self.fabric, self.state["model"], step,
                                                     stopping=lambda: self.stop.requested)
            except EvaluationStopped:
                self.console.print(f"step {step}: evaluation stopped by a signal (not logged)")
                return {}
        if loss is not None:
            self.state["val_loss"], self.state["val_loss_step"] = loss, step
            count_improvement(self.state, loss, self.cfg.early_stopping_threshold)
        self.watchdog.beat()
        self.console.print(f"step {step}: " + " | ".join(f"{name} {value:.4f}" for name, value in metrics.items()))
        return metrics

    def report_scaler_skip(self, number: int) -> bool:
        """The gradient scaler (16-mixed) found overflowed gradients and did not apply this step: it still counts as a
        step (its data and learning rate are spent), so say so, and count it in the summary. True (give up) once the
        scale the gradients overflowed at was 1 or less (SCALE_FLOOR): they overflow unscaled, and a run whose every
        step the scaler skipped, halving its scale each time, finished with exit 0 and an untrained model."""
        self.state["scaler_skipped_steps"] += 1
        overflowed_at = 2 * self.fabric.strategy.precision.scaler.get_scale()  # the scaler has halved it since
        if overflowed_at <= SCALE_FLOOR:
            self.console.print(f"step {number}: fp16 gradients overflowed even at a loss scale of {overflowed_at:g} "
                               "(unscaled): stopped without applying this step or saving it. Resume from the last "
                               "checkpoint with --precision bf16-mixed (32-true on GPUs without bfloat16), a lower "
                               "--lr or a --grad_clip")
            return True
        self.console.print(f"step {number}: fp16 gradients overflowed: the gradient scaler did not apply this step "
                           f"(scale lowered to {overflowed_at / 2:g}; {self.state['scaler_skipped_steps']} steps not "
                           "applied by the scaler so far)")
        return False

    def report_non_finite(self, verdict: StepVerdict) -> None:
        """Which ranks, and what to change: the line showed rank 0's finite part of the loss when another rank's was
        NaN, advised a --grad_clip already set and a checkpoint none had saved, and a lower --lr for a first step,
        which no learning rate has touched yet."""
        cfg, number = self.cfg, self.state["step"] + 1
        ranks = (f" on {verdict.non_finite_ranks} of {self.fabric.world_size} ranks" if self.fabric.world_size > 1
                 and verdict.non_finite_ranks else "")
        line = (f"step {number}: non-finite values (loss {verdict.loss:.4g}{ranks}, gradient norm "
                f"{verdict.grad_norm_value:.4g}); stopped without applying this step or saving it. ")
        if self.state["step"] == 0:
            line += ("No update has been applied yet, so the learning rate is not the cause: look at the model's "
                     "weights (non-finite values in them?), its --precision, and the data")
        else:
            changes = ["a lower --lr"] + ([] if cfg.grad_clip > 0 else ["a --grad_clip"])
            if cfg.precision.startswith("16"):
                changes.append("--precision bf16-mixed (32-true on GPUs without bfloat16)")
            start = "Resume from the last checkpoint" if latest_checkpoint(cfg.out_dir) else "Start again (none saved)"
            line += f"{start} with {' or '.join([', '.join(changes[:-1]), changes[-1]] if changes[1:] else changes)}"
        self.console.print(line)

    def save(self, evaluated: bool, upload: bool) -> dict[str, float]:
        """Write the checkpoint (or, with --async_save, hand it to the background writer); once it is published,
        rank 0 marks it when it is the best so far and applies --keep_last_n. `save_sec` is the time this step paused
        training (a background copy that outlasts the next forward and backward would also hold its update)."""
        step = self.state["step"]
        path = checkpoint_path(self.cfg.out_dir, step)
        with self.saving.measure():
            self.saver.wait()  # the previous background write: it pauses training, but "saved in" is this write's
            published = partial(self.after_publishing, path, step, self.state["val_loss"] if evaluated else None,
                                started=time.monotonic(), incident_began=self.guard.open_incident(step))
            self.state["rng"] = rng_of_every_rank(self.fabric.world_size)
            self.state["grad_scaler"] = self.fabric.strategy.precision.state_dict()
            self.state["spike_guard"] = self.guard.history.to_dict()
            self.state["elapsed_sec"] = self.clock.run_elapsed()
            self.state["schedule"] = {"step": self.plan.schedule_step(step), "length": self.plan.schedule_length}
            self.saver.save(path, self.state, published)
        paused = self.saving.last
        self.watchdog.beat()
        if self.saver.background:
            self.console.print(f"step {step}: writing {path} in the background (training paused {paused:.1f} s)")
        if upload:  # the write waited for, and the artifact logged: checkpoint time too, not the next step's
            with self.saving.measure(counted=False):
                self.saver.wait()
                upload_checkpoint(self.fabric.loggers, path, step)
            paused += self.saving.last
        return {"save_sec": paused}

    def after_publishing(self, path: Path, step: int, val_loss: Optional[float], started: float,
                         incident_began: Optional[int] = None) -> None:
        """On rank 0, when the checkpoint is visible (in the background writer's thread with --async_save). While
        spikes may still make an incident (`incident_began`), --keep_last_n keeps the checkpoint its rollback would
        return to: it was deleted between the first spikes and the last, and the run stopped with nothing to roll back
        to, as did every resume."""
        self.console.print(f"step {step}: saved {path} in {time.monotonic() - started:.1f} s")
        if val_loss is not None:
            mark_if_best(path, val_loss, self.measured)
        protected = {path, self.resumed_from} if self.resumed_from else {path}
        if incident_began is not None and self.cfg.keep_last_n is not None:
            needed = last_good_checkpoint(self.cfg.out_dir, incident_began, also=self.resumed_from)
            protected |= {needed} if needed else set()
        for deleted in prune_checkpoints(self.cfg.out_dir, self.cfg.keep_last_n, protected):
            self.console.print(f"step {step}: deleted {deleted.name} (--keep_last_n {self.cfg.keep_last_n})")
