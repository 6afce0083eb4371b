"""What `train.py --print_config` prints: the run as it will train, after the preflight has checked every input.

Every option with its value and where that came from (a flag, a config file, the environment, the default, or
derived by the preflight: `--lr` after `--lr_scaling`), as YAML that `--config` reads back, then, as comments, what
the run derives from them: world size, gradient accumulation, global batch, tokens per step, optimizer steps. A raw
dump of the parsed values (jsonargparse's own --print_config) would show none of that and validate nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.optimization.schedule import TrainingPlan
    from app.training.preflight import RunInputs
    from arguments import Config

ENVIRONMENT = {"wandb_mode": "WANDB_MODE", "project": "WANDB_PROJECT", "entity": "WANDB_ENTITY",
               "run_name": "WANDB_NAME"}
"""Options whose default the environment gives (app/training/preflight/wandb_options.py resolve_wandb)."""
COMMENT_COLUMN = 56


def source_of(name: str, given: Config, resolved: Config, sources: dict[str, str]) -> str:
    """Where the resolved value of option `name` comes from."""
    before, after = getattr(given, name), getattr(resolved, name)
    if name in sources and before == after:
        return sources[name]
    if before is None and name in ENVIRONMENT:
        return f"environment {ENVIRONMENT[name]}" if os.environ.get(ENVIRONMENT[name]) else "default"
    if before != after and name in given.unread():
        return f"default: {before!r} ({sources.get(name, 'default')}) is not read"
    if before != after:
        return f"derived from {before!r} ({sources.get(name, 'default')}) by the preflight"
    return "default"


def learning_rate_line(resolved: Config, plan: TrainingPlan) -> str:
    """`0.003 after 30 warmup steps, then constant until step 800, then sqrt decay to 0.0003 at step 1000`."""
    line = f"{resolved.lr:.3g} after {resolved.warmup_steps} warmup steps, "
    if not resolved.lr_decay or resolved.warmup_steps >= plan.schedule_length:
        return line + "then constant"
    stable_until = plan.schedule_length * (1 - resolved.lr_decay_ratio)  # in the schedule's steps
    resumed_at = plan.resumed_schedule[1] if plan.resumed_schedule else 0.0
    if stable_until <= resolved.warmup_steps:
        stable = ""
    elif stable_until <= resumed_at:  # the decay began before the checkpoint this run resumes from
        stable = f"then (decaying since before step {plan.resumed_schedule[0]}) "
    else:
        stable = f"then constant until step {plan.run_step(stable_until):.0f}, then "
    return line + f"{stable}{resolved.lr_decay_type} decay to {resolved.min_lr:.3g} at step {plan.max_step}"


def resolved_run(given: Config, inputs: RunInputs, sources: dict[str, str]) -> str:
    """The YAML text --print_config prints (see the module docstring)."""
    resolved, plan = inputs.config.readable_back(), inputs.plan
    lines = ["# train.py --print_config: the run as resolved after checking every input; --config reads it back."]
    for option in fields(resolved):
        if option.name == "print_config":
            continue
        entry = f"{option.name}: {json.dumps(getattr(resolved, option.name))}"  # JSON values are YAML
        lines.append(f"{entry:<{COMMENT_COLUMN}} # {source_of(option.name, given, resolved, sources)}")
    epochs = ("--max_step" if given.max_step else f"--max_tokens {given.max_tokens:,}" if given.max_tokens else
              f"--number_epochs {given.number_epochs}")
    lines += [
        "# derived:",
        f"#   world size: {plan.world_size} ranks (--devices x --num_nodes)",
        f"#   gradient accumulation: {plan.accumulation} (micro-batches per optimizer step)",
        f"#   global batch: {plan.global_batch_size} sequences per step ({plan.micro_batch_size} micro batch x "
        f"{plan.accumulation} accumulation x {plan.world_size} ranks)",
        f"#   tokens per step: {plan.tokens_per_step:,} (rows of {plan.row_tokens:.0f} tokens on average"
        + (f", and targets of {plan.target_tokens:.0f})" if plan.target_tokens else ")"),
        f"#   optimizer steps: {plan.max_step} ({epochs}; {plan.steps_per_epoch} steps per epoch of "
        f"{plan.train_rows:,} rows)",
        f"#   learning rate: {learning_rate_line(resolved, plan)}",
    ]
    if inputs.mixture:
        lines += ["#   mixture (rows of every step by weight; an epoch is one pass over the first folder):"] + [f"#     {line}" for line in inputs.mixture.splitlines()]
    if inputs.resume_from:
        lines.append(f"#   resumes from: {inputs.resume_from}")
    if inputs.packed_layout != "position_ids":
        lines.append(f"#   packed examples kept apart as: {inputs.packed_layout}")
    return "\n".join(lines)
