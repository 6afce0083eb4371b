"""The batch arithmetic and the learning-rate schedule of a run, and of a resumed one from its checkpoint's position
(app/optimization/schedule.py holds the maths); what a resume changes is said once."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from app.checkpoint.files import read_best
from app.cli import counted
from app.data.mixture import parse_sources
from app.metrics.profiling import profile_window, steps_to_trace
from app.optimization.schedule import (TrainingPlan, accumulation_steps, interval_steps, learning_rate, make_plan,
                                       scale_for_batch, schedule_options, steps_for_tokens, steps_to_finish,
                                       tokens_read)
from app.training.preflight.data import DataFacts
from app.training.preflight.environment import world_size
from app.training.preflight.notes import note
from app.training.preflight.resume import ChosenCheckpoint

if TYPE_CHECKING:
    from arguments import Config


def check_plan(cfg: Config, data: DataFacts, resume: Optional[ChosenCheckpoint],
               problems: list[str]) -> Optional[TrainingPlan]:
    """The batch arithmetic. A resumed run keeps its checkpoint's global batch unless --global_batch_size is given:
    the accumulation follows the devices and micro batch it resumes with."""
    if cfg.eval_only:  # nothing trains: no step to fill, nor a schedule to check
        plan = TrainingPlan(world_size=world_size(cfg), micro_batch_size=cfg.micro_batch_size, accumulation=1,
                            train_rows=data.train_rows, max_step=0, block_size=data.block_size,
                            row_tokens=data.mean_row_tokens or data.block_size, target_tokens=data.mean_target_tokens)
        note_validation_share(cfg, data, plan)
        return plan
    kept = resume is not None and cfg.global_batch_size is None
    global_batch_size = resume.metadata["global_batch_size"] if kept else cfg.global_batch_size
    try:
        accumulation = accumulation_steps(world_size=world_size(cfg), micro_batch_size=cfg.micro_batch_size,
                                          gradient_accumulation_steps=None if kept else cfg.gradient_accumulation_steps,
                                          global_batch_size=global_batch_size)
    except ValueError as error:
        problems.append(f"--resume: the checkpoint's global batch of {global_batch_size} sequences does not split "
                        f"into --micro_batch_size {cfg.micro_batch_size} on {world_size(cfg)} ranks; choose a micro "
                        "batch and device count that divide it, or give --global_batch_size" if kept else str(error))
        return None
    try:
        plan = make_plan(train_rows=data.train_rows, block_size=data.block_size, row_tokens=data.mean_row_tokens,
                         target_tokens=data.mean_target_tokens, world_size=world_size(cfg),
                         micro_batch_size=cfg.micro_batch_size, accumulation=accumulation,
                         number_epochs=cfg.number_epochs, max_step=cfg.max_step)
    except ValueError as error:  # the data fills no step
        problems.append(shorter_than_a_step(data) if data.sources else str(error))
        return None
    if cfg.max_tokens is not None:
        plan = replace(plan, max_step=steps_for_tokens(cfg.max_tokens, plan))
    if resume is not None:
        if changed_epochs(cfg, data, resume.metadata, problems):
            return None
        if cfg.max_step is not None and cfg.max_step < resume.metadata["step"]:
            problems.append(f"--max_step {cfg.max_step}: the checkpoint is at step {resume.metadata['step']} "
                            "already; give a larger --max_step to train on, or convert the checkpoint as it is")
            return None
        if passed_the_token_budget(cfg, resume.metadata, plan, problems):
            return None
        epoch, position = resume.metadata["epoch"], resume.metadata["position"]
        if counts_epochs(cfg) and (epoch, position) > (cfg.number_epochs, 0):  # said "where this run ends", exit 0
            problems.append(f"--number_epochs {cfg.number_epochs}: the checkpoint is past it already (epoch "
                            f"{epoch + position / plan.train_rows:.2f}, step {resume.metadata['step']}); give more "
                            "epochs to train on, or convert the checkpoint as it is")
            return None
        plan = plan_from_checkpoint(cfg, resume.metadata, plan)
        note_what_changed(cfg, resume.metadata, plan)
        if cfg.eval_step_interval:
            note_validation_rows(cfg, data, resume.metadata, plan)
        elif best := read_best(cfg.out_dir):
            note(f"--eval_step_interval 0: the run's best checkpoint stays step {best['step']}'s (best.json, from "
                 "before validation was turned off), and --keep_last_n keeps it")
    # warmup counts schedule steps: a resume at another global batch finishes the checkpoint's schedule
    length = plan.schedule_length
    steps = (f"schedule of {length:g} steps (counted at this resume's global batch of {plan.global_batch_size})"
             if plan.resumed_schedule else f"{length:g} optimizer steps")
    if cfg.warmup_steps > length and not cfg.estimate_memory:  # a plan needs no schedule (nor real data)
        problems.append(f"--warmup_steps ({cfg.warmup_steps}) exceeds the run's {steps}"
                        + (f" (--number_epochs {cfg.number_epochs} at {plan.global_batch_size} sequences per step)"
                           if counts_epochs(cfg) and not plan.resumed_schedule else "")
                        + (f" (--max_tokens {cfg.max_tokens:,} at {plan.tokens_per_step:,} tokens per step)"
                           if cfg.max_tokens is not None and not plan.resumed_schedule else "")
                        + ": lower it" + (", or give --max_step" if counts_epochs(cfg) else
                                          ", or give a larger --max_tokens" if cfg.max_tokens is not None else ""))
    elif cfg.warmup_steps == length and cfg.lr_decay and not cfg.estimate_memory:
        note(f"--warmup_steps {cfg.warmup_steps} fills the run's {steps}: the rate rises to --lr and ends there, "
             "never decaying to --min_lr (fewer warmup steps leave some for the decay)")
    if not cfg.estimate_memory:
        check_profile_window(cfg, plan, resume.metadata["step"] if resume else 0, problems)
        if cfg.max_tokens is not None:
            note_token_budget(cfg, plan)
        note_rows_left_out(plan, mixture=data.sources is not None)
        if resume is None and cfg.eval_step_interval:  # a resume says what changed (note_validation_rows)
            note_validation_share(cfg, data, plan)
    return plan


def check_profile_window(cfg: Config, plan: TrainingPlan, start_step: int, problems: list[str]) -> None:
    """--profile_steps past the run's last step traces nothing: refused; one that ends past it traces the steps up
    to it, which is said. A resume after them (the same command relaunched) traces nothing either, which is said."""
    window = profile_window(cfg.profile_steps)
    if window is None:
        return
    if window[0] > plan.max_step:
        problems.append(f"--profile_steps {cfg.profile_steps}: the run ends at step {plan.max_step}; give steps up to "
                        "it")
    elif window[0] <= start_step:
        taken = steps_to_trace(window, start_step, plan.max_step)
        note(f"--profile_steps {cfg.profile_steps}: this run resumes at step {start_step}: "
             + (f"steps {taken[0]}-{taken[1]} are traced" if taken else "nothing is traced"))
    elif window[1] > plan.max_step:
        note(f"--profile_steps {cfg.profile_steps}: the run ends at step {plan.max_step}: steps {window[0]}-"
             f"{plan.max_step} are traced")


def counts_epochs(cfg: Config) -> bool:
    """The run ends after --number_epochs: neither --max_step nor --max_tokens says where."""
    return cfg.max_step is None and cfg.max_tokens is None


def passed_the_token_budget(cfg: Config, saved: dict, plan: TrainingPlan, problems: list[str]) -> bool:
    """A --max_tokens the checkpoint has read past already, unless it is the checkpoint's own: that run has ended
    (its last step read past the budget), which the run says, exit 0."""
    read = tokens_read(saved, plan)
    if cfg.max_tokens is None or read <= cfg.max_tokens or cfg.max_tokens == (saved.get("config") or {}).get(
            "max_tokens"):
        return False
    problems.append(f"--max_tokens {cfg.max_tokens:,}: the checkpoint has read {read:,} tokens already (step "
                    f"{saved['step']}); give a larger --max_tokens to train on, or convert the checkpoint as it is")
    return True


def note_token_budget(cfg: Config, plan: TrainingPlan) -> None:
    """What --max_tokens comes to in steps and epochs (a mixture's are passes over its first folder, counted in rows
    of the mixture), at this run's global batch. Rows of padded examples are said at their mean length, rounded as
    --print_config rounds it (cut down, it read 171 there and 172 here)."""
    row_tokens = round(plan.tokens_per_step / plan.global_batch_size)
    epochs = steps_for_tokens(cfg.max_tokens, plan) * plan.global_batch_size / plan.train_rows
    note(f"--max_tokens {cfg.max_tokens:,}: the run ends at step {plan.max_step}, each step reading "
         f"{plan.global_batch_size} sequences of {row_tokens:,} tokens ({plan.tokens_per_step:,}); {epochs:.2f} epochs "
         f"of {plan.train_rows:,} rows")


def shorter_than_a_step(data: DataFacts) -> str:
    """A mixture's epoch (one pass over its first folder) shorter than one step: "add data" was wrong for it."""
    first = data.sources[0]
    return (f"--train_data_dir: an epoch of a mixture is one pass over its first folder, and {first.name} "
            f"({data.source_rows[0]:,} rows at {float(first.weight):.0%} of every step) makes {data.train_rows:,} rows "
            "of the mixture, fewer than one optimizer step; list a larger folder first, or lower "
            "--micro_batch_size or --gradient_accumulation_steps")


def note_rows_left_out(plan: TrainingPlan, mixture: bool = False) -> None:
    """An epoch is its whole steps: the rows that fill no last step are left out of it (other rows each epoch, as
    the order is drawn anew). A mixture reads on into the next epoch instead, so a run that ends with its epochs is
    that many rows per epoch short of its passes over the first folder. Said when they are 5% of the rows or more: on
    a small fine-tuning set a third of the data went untrained in a one-epoch run, without a word."""
    trained = plan.steps_per_epoch * plan.global_batch_size
    left_out = plan.train_rows - trained
    if not plan.steps_per_epoch or left_out < plan.train_rows / 20:
        return
    share = f"{left_out:,} ({left_out / plan.train_rows:.0%})"
    if mixture:
        note(f"each epoch of the mixture counts {plan.steps_per_epoch} whole steps of {plan.global_batch_size} "
             f"sequences, {trained:,} of its {plan.train_rows:,} rows: the other {share} are read at the next epoch's "
             f"start, and a run that ends with its epochs ends {left_out:,} rows per epoch short of them; a global "
             f"batch that divides {plan.train_rows:,} trains them all")
        return
    note(f"each epoch trains {trained:,} of its {plan.train_rows:,} rows: the other {share} fill no whole step of "
         f"{plan.global_batch_size} sequences (other rows each epoch); a global batch that divides "
         f"{plan.train_rows:,} trains them all")


def note_validation_share(cfg: Config, data: DataFacts, plan: TrainingPlan) -> None:
    """--eval_iters counts batches per rank: a validation split larger than they hold is read in part, the same rows
    at every evaluation, and val_loss was taken for the whole split's, unsaid (the arguments.py this project started
    from read the whole split). --eval_data_dir's folders are read up to the same limit, each."""
    batch = cfg.eval_batch_size or cfg.micro_batch_size
    limit = cfg.eval_iters * batch * plan.world_size
    folders = [identity["validation_rows"] for identity in data.identities] if data.sources is not None else []
    read = []
    if max(folders, default=data.validation_rows) > limit:  # a mixture reads up to the limit of each folder
        read.append(f"up to {limit:,} rows of each folder of the mixture" if data.sources is not None
                    else f"{limit:,} of its {data.validation_rows:,} rows")
    read += [f"{limit:,} of --eval_data_dir {name}'s {rows:,}"
             for name, rows in data.evaluated_rows.items() if rows > limit]
    if read:
        note(f"validation reads {' and '.join(read)} at each evaluation (--eval_iters {cfg.eval_iters} batches of "
             f"{batch} on each of {plan.world_size} ranks), the same rows each time; raise --eval_iters to read more")


def plan_from_checkpoint(cfg: Config, saved: dict, plan: TrainingPlan) -> TrainingPlan:
    """A resumed run that ends after --number_epochs counts the steps left from the checkpoint's position at its
    own global batch: the checkpoint's step count, made at another global batch, would end it early or late. For the
    same epochs it finishes the checkpoint's learning-rate schedule over those steps (TrainingPlan.schedule_step).
    Given another end, it recounts the schedule to that end in this run's steps, where the data trained so far
    stands among them: the checkpoint's step count, made at another global batch, put a run at 8x the batch and
    one more epoch 62% through its cosine after 18% of its data (the rate fell 56% in one step).
    A mixture's epoch and position count its rows alike (the first folder's weight is the checkpoint's: see
    changed_epochs)."""
    if cfg.max_step is not None:
        return plan
    if cfg.max_tokens is not None:
        return plan_from_token_budget(cfg, saved, plan)
    left = steps_to_finish(plan, epoch=saved["epoch"], position=saved["position"], number_epochs=cfg.number_epochs)
    before = saved.get("config") or {}
    if before.get("max_step") is not None or before.get("number_epochs") != cfg.number_epochs:
        length = steps_to_finish(plan, epoch=0, position=0, number_epochs=cfg.number_epochs)
        return finishing(plan, saved["step"], left, length - left, length)
    schedule = saved.get("schedule") or {"step": saved["step"], "length": saved["step"] + steps_to_finish(
        replace(plan, micro_batch_size=saved["global_batch_size"], world_size=1, accumulation=1),
        epoch=saved["epoch"], position=saved["position"], number_epochs=cfg.number_epochs)}
    return finishing(plan, saved["step"], left, schedule["step"], schedule["length"])


def finishing(plan: TrainingPlan, step: int, left: int, position: float, length: float) -> TrainingPlan:
    """The plan of a run resumed at `step` with `left` steps to train, whose schedule stands at `position` of
    `length` steps: counted in this run's steps where they agree, else what is left of it spread over them."""
    resumed = replace(plan, max_step=step + left)
    if (position, length) == (step, resumed.max_step):
        return resumed
    return replace(resumed, resumed_schedule=(step, position, length))


def plan_from_token_budget(cfg: Config, saved: dict, plan: TrainingPlan) -> TrainingPlan:
    """A resumed run that ends after --max_tokens counts the steps left from the tokens its checkpoint read, at this
    run's global batch. For the same budget it finishes the checkpoint's schedule over those steps; for another, it
    recounts the schedule to that end in this run's steps, where the tokens read so far stand among them (as
    plan_from_checkpoint does for --number_epochs)."""
    left = steps_for_tokens(cfg.max_tokens - tokens_read(saved, plan), plan)
    schedule = saved.get("schedule")
    if schedule and (saved.get("config") or {}).get("max_tokens") == cfg.max_tokens:
        return finishing(plan, saved["step"], left, schedule["step"], schedule["length"])
    length = steps_for_tokens(cfg.max_tokens, plan)
    return finishing(plan, saved["step"], left, length - left, length)


def changed_epochs(cfg: Config, data: DataFacts, saved: dict, problems: list[str]) -> bool:
    """A mixture's epoch is a pass over its first folder, counted in rows of the mixture at that folder's weight
    (mixture.epoch_rows): resumed with another weight for it, the checkpoint's epoch and position count other rows,
    and the run would end after more or fewer passes than --number_epochs says, its schedule jumping at the resume.
    Refused unless --max_step or --max_tokens says where the run ends."""
    if not counts_epochs(cfg) or data.sources is None:
        return False
    try:
        before = parse_sources((saved.get("config") or {}).get("train_data_dir") or "")[0].weight
    except ValueError:
        return False
    now = data.sources[0].weight
    if before == now:
        return False
    problems.append(f"--train_data_dir: the first folder ({data.sources[0].name}) was {float(before):.1%} of every "
                    f"step and is {float(now):.1%} at this resume, and --number_epochs counts passes over it at the "
                    "checkpoint's share; give --max_step or --max_tokens to say where the resumed run ends")
    return True


def note_what_changed(cfg: Config, saved: dict, plan: TrainingPlan) -> None:
    """Say how the resumed run's layout differs from the checkpoint's (the samples it trains on do not)."""
    before = saved.get("config") or {}
    saved_world = len(saved.get("rng") or []) or None
    changes = [f"{name} {old} -> {new}" for name, old, new in (
        ("ranks", saved_world, plan.world_size), ("micro batch", before.get("micro_batch_size"), plan.micro_batch_size))
        if old is not None and old != new]
    if saved["global_batch_size"] != plan.global_batch_size:
        changes.append(f"global batch {saved['global_batch_size']} -> {plan.global_batch_size} sequences")
    if changes:
        note(f"--resume: {', '.join(changes)}; {plan.global_batch_size} sequences per step as {plan.accumulation} "
             f"accumulation x {plan.micro_batch_size} micro batch x {plan.world_size} ranks, continuing at sample "
             f"{saved['position']} of epoch {saved['epoch']}")
    if cfg.gradient_accumulation_steps not in (None, plan.accumulation) and cfg.global_batch_size is None:
        note(f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} is not used: the checkpoint's global "
             f"batch of {plan.global_batch_size} is kept (give --global_batch_size to change it)")


TRAINING_OPTIONS = ("precision", "reduce_dtype", "lr", "min_lr", "lr_decay", "lr_decay_type", "lr_decay_ratio",
                    "warmup_steps", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "max_step", "max_tokens",
                    "number_epochs", "spike_guard", "spike_z", "spike_min_rise", "spike_grad_norm_z", "spike_window",
                    "spike_warmup", "spike_incident", "spike_incident_steps", "fsdp_no_sync", "loss_kernel",
                    "chunked_loss", "tf32", "neftune_noise_alpha", "label_smoothing", "z_loss", "stochastic_rounding",
                    "muon_momentum")
"""The options whose change at a resume changes how the steps after it train (the batch is said apart)."""


def note_changed_options(cfg: Config, saved: dict, plan: Optional[TrainingPlan]) -> None:
    """Say which of TRAINING_OPTIONS the resume changes: a new --lr or --warmup_steps took effect at the resumed step
    (the rate went from 1.65e-3 to 8.33e-3 at once) and another --precision stored the weights and moments in bf16
    from then on, with only the usual resume lines. Where the learning rate moves, by how much."""
    before = saved.get("config") or {}
    changes = [f"{name} {before[name]} -> {getattr(cfg, name)}" for name in TRAINING_OPTIONS
               if name in before and before[name] != getattr(cfg, name)]
    if changes:
        note(f"--resume: changed since the checkpoint: {', '.join(changes)}; the steps after step {saved['step']} "
             f"train with the new values{rate_jump(cfg, saved, plan)}")


def rate_jump(cfg: Config, saved: dict, plan: Optional[TrainingPlan]) -> str:
    """`: step 3 trains at a learning rate of 8.33e-03, 1.65e-03 with the checkpoint's options`, where the two
    differ by more than 1% (a change of --max_step alone may move it little); else nothing. Both at the same step:
    during warm-up the rate moves from one step to the next by more than that anyway."""
    before, schedule, step = saved.get("config") or {}, saved.get("schedule"), saved["step"]
    if plan is None or not schedule or any(name not in before for name in ("lr", "min_lr", "warmup_steps", "lr_decay")):
        return ""
    then = learning_rate(schedule["step"] + 1, max_step=schedule["length"], **schedule_options(before))
    now = plan.learning_rate(step + 1, schedule_options(vars(cfg)))
    if math.isclose(then, now, rel_tol=0.01):
        return ""
    return f": step {step + 1} trains at a learning rate of {now:.2e}, {then:.2e} with the checkpoint's options"


def note_validation_rows(cfg: Config, data: DataFacts, saved: dict, plan: TrainingPlan) -> None:
    """--eval_iters counts batches per rank, so a resume on other ranks or another evaluation batch reads other
    validation rows: val_loss moves at the resume for that alone, and best.json compares losses of other rows. A
    mixture reads up to that many rows of each folder: said when a folder's count changes (a note claimed it of two
    folders of 13 and 12 rows, read whole before and after, from their sum)."""
    before, saved_world = saved.get("config") or {}, len(saved.get("rng") or [])
    if not (before.get("eval_iters") and saved_world and data.validation_rows):
        return
    batch_then = before.get("eval_batch_size") or before.get("micro_batch_size") or 0
    batch_now = cfg.eval_batch_size or cfg.micro_batch_size
    limit_then = before["eval_iters"] * batch_then * saved_world
    limit_now = cfg.eval_iters * batch_now * plan.world_size
    mixture = data.sources is not None
    counts = [folder["validation_rows"] for folder in data.identities] if mixture else [data.validation_rows]
    read_then, read_now = ([min(rows, limit) for rows in counts] for limit in (limit_then, limit_now))
    if read_then == read_now:
        return
    then, now = max(read_then), max(read_now)
    per_batch = batch_now * plan.world_size
    same = (-(-then // per_batch) if then == max(counts)  # all of them
            else then // per_batch if then % per_batch == 0 else None)
    rows = "rows of each folder" if mixture else "rows"
    note(f"--resume: validation reads {'up to ' if mixture else ''}{now:,} {rows} ({cfg.eval_iters} batches of "
         f"{batch_now} on each of {plan.world_size} ranks), the checkpoint's run read {then:,}: val_loss moves at "
         "this resume for that alone, and best.json and --early_stopping_patience start a new comparison (the "
         "losses of the other rows do not compare)"
         + (f"; --eval_iters {same} reads the same rows" if same else ""))


INTERVALS = ("eval_step_interval", "save_step_interval", "log_interval")
"""Options counted in optimizer steps that take a share of the run instead."""


def resolve_shares(cfg: Config, plan: Optional[TrainingPlan]) -> Config:
    """Intervals and the warmup given as a share of the run (below 1) in steps of this run's plan (the warmup in
    steps of its schedule, which a resume at another global batch counts otherwise), said once; the run, its
    config.yaml and its checkpoints hold the steps."""
    if plan is None or cfg.estimate_memory or cfg.eval_only:  # a plan's steps are a stand-in run's; none trains
        return cfg
    steps = {name: interval_steps(getattr(cfg, name), plan.max_step) for name in INTERVALS}
    for name, value in steps.items():
        if value != getattr(cfg, name):
            every = "every step" if value == 1 else f"every {value:,} steps"
            note(f"--{name} {getattr(cfg, name):g}: {every} of the run's {plan.max_step:,}")
    warmup = interval_steps(cfg.warmup_steps, plan.schedule_length)
    if warmup != cfg.warmup_steps:
        note(f"--warmup_steps {cfg.warmup_steps:g}: {counted(warmup, 'step')} of the run's {plan.schedule_length:,g}")
    return replace(cfg, **steps, warmup_steps=warmup)


def resolve_learning_rates(cfg: Config, plan: Optional[TrainingPlan]) -> Config:
    """--lr and --min_lr moved to the global batch by --lr_scaling, said once; the run uses the resolved values."""
    if cfg.lr_scaling == "none" or plan is None:
        return cfg
    lr, min_lr = (scale_for_batch(value, rule=cfg.lr_scaling, global_batch_size=plan.global_batch_size,
                                  reference_batch_size=cfg.reference_batch_size) for value in (cfg.lr, cfg.min_lr))
    note(f"--lr_scaling {cfg.lr_scaling}: lr {cfg.lr:.3g} -> {lr:.3g}, min_lr {cfg.min_lr:.3g} -> {min_lr:.3g} for "
         f"a global batch of {plan.global_batch_size} (--reference_batch_size {cfg.reference_batch_size})")
    return replace(cfg, lr=lr, min_lr=min_lr, lr_scaling="none", reference_batch_size=None)


def check_offloaded_accumulation(cfg: Config, plan: TrainingPlan, problems: list[str]) -> None:
    """FSDP1 with CPU offloading does not add a micro-batch's reduced gradient to the offloaded one: it copies it over
    (torch's FSDP documents gradient accumulation outside no_sync() with CPU offloading as unsupported;
    `FlatParamHandle.prepare_gradient_for_backward` leaves an offloaded gradient out of the sum), so every step would
    train on its last micro-batch alone. Inside no_sync (--fsdp_no_sync) the gradients add up unsharded."""
    if cfg.cpu_offload and cfg.strategy == "fsdp" and plan.accumulation > 1 and not cfg.fsdp_no_sync:
        problems.append(f"--cpu_offload true with {plan.accumulation} micro-batches per step: FSDP1 keeps only the "
                        "last one's offloaded gradient; add --fsdp_no_sync true (gradients add up unsharded until the "
                        "last micro-batch), or use --strategy fsdp2")
