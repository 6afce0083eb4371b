"""The Weights & Biases options, from the flags or the WANDB_* variables, and what they need."""

from __future__ import annotations

import csv
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from app.metrics.loggers import METRICS_FILE, RUN_ID_FILE
from app.training.preflight.notes import note

if TYPE_CHECKING:
    from arguments import Config


WANDB_MODES = ("online", "offline", "disabled")


def resolve_wandb(cfg: Config, problems: list[str]) -> Config:
    """--wandb_mode, --project, --entity and --run_name when given, else WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY and
    WANDB_NAME (what docker/run.sh forwards and wandb's users set), else disabled: a run without a choice writes
    nothing to out_dir/wandb, and says so in one line."""
    note_unused_wandb_variables(cfg)
    mode = cfg.wandb_mode or os.environ.get("WANDB_MODE") or "disabled"
    mode = wandb_mode_name(mode)
    if mode not in WANDB_MODES:
        problems.append(f"WANDB_MODE={mode} is not one of {', '.join(WANDB_MODES)}; set one, or give --wandb_mode")
        mode = "disabled"
    if not cfg.wandb_mode and not os.environ.get("WANDB_MODE"):
        note("Weights & Biases: off (--wandb_mode offline or online, or WANDB_MODE, to log there)")
    return replace(cfg, wandb_mode=mode, project=cfg.project or os.environ.get("WANDB_PROJECT") or "fsdp-trainer",
                   entity=cfg.entity or os.environ.get("WANDB_ENTITY"),
                   run_name=cfg.run_name or os.environ.get("WANDB_NAME"))


def wandb_mode_name(mode: str) -> str:
    return {"dryrun": "offline", "run": "online"}.get(mode, mode)  # wandb's older names


WANDB_VARIABLES = {"wandb_mode": "WANDB_MODE", "project": "WANDB_PROJECT", "entity": "WANDB_ENTITY",
                   "run_name": "WANDB_NAME"}


def note_unused_wandb_variables(cfg: Config) -> None:
    """An option (a flag or a config file: every demo config said `wandb_mode: disabled`) wins over the variable of
    the environment; say so where they differ, or `WANDB_MODE=offline` on a node without network goes unheard."""
    for option, variable in WANDB_VARIABLES.items():
        given, environment = getattr(cfg, option), os.environ.get(variable)
        if given and environment and wandb_mode_name(str(given)) != wandb_mode_name(environment):
            note(f"{variable}={environment} is not used: --{option} {given} (a flag or a config file) decides")


def note_wandb_history(cfg: Config, resume_step: int) -> None:
    """A resume from an older checkpoint logs its steps again. metrics.csv drops the abandoned rows; the W&B run it
    continues keeps them (W&B cannot cut a run's history: its rewind is a private preview), so say which."""
    out_dir, continued = Path(cfg.out_dir), os.environ.get("WANDB_RUN_ID")
    if cfg.wandb_mode == "disabled" or not (continued or (out_dir / RUN_ID_FILE).is_file()):
        return
    try:
        with open(out_dir / METRICS_FILE, newline="") as handle:
            logged = [int(row["step"]) for row in csv.DictReader(handle) if (row.get("step") or "").isdigit()]
    except (OSError, KeyError, csv.Error):
        return
    abandoned = sorted(step for step in logged if step > resume_step)
    if abandoned:
        note(f"--resume: the Weights & Biases run keeps steps {abandoned[0]}-{abandoned[-1]}, logged after step "
             f"{resume_step} by the stretch this resume abandons, beside the ones logged again (W&B cannot cut a "
             "run's history); metrics.csv drops them")


def wandb_key_problem(key: Optional[str]) -> Optional[str]:
    """What W&B's own format check finds wrong with the key, never the key itself: wandb.init raised it in a
    traceback, after the run's files were written (and the rerun was refused for them). wandb is imported only for
    a key to check: its import makes staging folders in $TMPDIR."""
    if key is None:
        return None
    try:
        from wandb.sdk.lib.wbauth.validation import check_api_key
    except ImportError:  # another wandb's layout: wandb.init checks it then
        return None
    return check_api_key(key)


def check_wandb(cfg: Config, problems: list[str]) -> None:
    netrc = Path.home() / ".netrc"
    logged_in = "WANDB_API_KEY" in os.environ or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())
    if cfg.wandb_mode == "online" and not logged_in:
        problems.append("--wandb_mode online needs WANDB_API_KEY or `wandb login`; or use --wandb_mode offline")
    key_problem = wandb_key_problem(os.environ.get("WANDB_API_KEY")) if cfg.wandb_mode == "online" else None
    if key_problem:
        problems.append(f"WANDB_API_KEY: {key_problem} Copy it again from https://wandb.ai/authorize, or use "
                        "--wandb_mode offline")
    if cfg.log_model and cfg.wandb_mode == "disabled":
        problems.append(f"--log_model {str(cfg.log_model).lower()} uploads checkpoints to Weights & Biases, which this "
                        "run does not use; give --wandb_mode online (or offline, synced later), or drop --log_model")
