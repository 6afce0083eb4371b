"""The Weights & Biases options, from the flags or the WANDB_* variables, and what they need."""

from __future__ import annotations

import csv
import importlib.util
import os
import ssl
import threading
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from app.cli import first_line, without_credentials
from app.folders import unusable_folder
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
    if not cfg.wandb_mode and not os.environ.get("WANDB_MODE") and not cfg.estimate_memory:  # a plan logs nothing
        note(f"Weights & Biases: off{unread_wandb_names(cfg)} (--wandb_mode offline or online, or WANDB_MODE, to log "
             "there)")
    return replace(cfg, wandb_mode=mode, project=cfg.project or os.environ.get("WANDB_PROJECT") or "fsdp-trainer",
                   entity=cfg.entity or os.environ.get("WANDB_ENTITY"),
                   run_name=cfg.run_name or os.environ.get("WANDB_NAME"))


def unread_wandb_names(cfg: Config) -> str:
    """`--project team-runs` without a mode reads as "log to W&B", and the run logged nowhere, its note not naming
    the option (a mode chosen, `--wandb_mode disabled` over a config's project, is the user's: nothing to say)."""
    given = [f"--{name}" for name in ("project", "entity", "run_name") if getattr(cfg, name)]
    return f", so {', '.join(given)} {'is' if len(given) == 1 else 'are'} not read" if given else ""


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


def note_wandb_history(cfg: Config, resume_step: int, earlier: dict) -> None:
    """A resume from an older checkpoint logs its steps again. metrics.csv drops the abandoned rows; the W&B run it
    continues keeps them (W&B cannot cut a run's history: its rewind is a private preview), so say which. `earlier`:
    the options of the run that wrote the checkpoint."""
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
    if abandoned and earlier.get("log_model") and earlier.get("wandb_mode") == "offline":  # artifacts refer to files
        note(f"--resume: the offline W&B model artifacts of checkpoints after step {resume_step} refer to files this "
             "resume moves to checkpoints/rolled-back/, and a checkpoint saved again at their step takes their path: "
             "`wandb sync` the earlier starts' folders before this resume, or expect those artifacts not to upload")


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


WANDB_PROBE_TIMEOUT_S = 5.0


def wandb_server() -> tuple[str, bool]:
    """The W&B server wandb would log to (WANDB_BASE_URL, `wandb login --host`'s setting, else wandb's default: since
    wandb 0.31 not api.wandb.ai) and whether wandb finds credentials for it as wandb.init does: WANDB_API_KEY,
    WANDB_IDENTITY_TOKEN_FILE, its settings, or the netrc entry `wandb login` wrote for that server ($NETRC or
    ~/.netrc). A search for "api.wandb.ai" in ~/.netrc refused every user whom `wandb login` had logged in."""
    from wandb.errors import AuthenticationError
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import wbnetrc

    settings = wandb_setup.singleton().settings
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.api_key:
        return settings.base_url, True
    try:
        return settings.base_url, wbnetrc.read_netrc_auth(host=settings.base_url) is not None
    except AuthenticationError:  # a key there in a bad format: wandb.init names it
        return settings.base_url, True


def unreachable_reason(url: str, timeout_s: float = WANDB_PROBE_TIMEOUT_S) -> Optional[str]:
    """Why `url` does not answer within `timeout_s` (any HTTP answer counts), or None. In a thread with a deadline:
    a name lookup that hangs has no timeout of its own. Without it, wandb.init retried for 1 min 46 s and raised a
    traceback after the run's files were written."""
    reason = [f"no answer within {timeout_s:g} s"]

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s).close()
            reason[0] = ""
        except urllib.error.HTTPError:  # the server answered
            reason[0] = ""
        except (OSError, ValueError) as error:
            cause = getattr(error, "reason", error)
            # a certificate this check cannot verify answered all the same (a private CA, which wandb's requests
            # take from REQUESTS_CA_BUNDLE)
            reason[0] = "" if isinstance(cause, ssl.SSLError) else str(cause)

    thread = threading.Thread(target=probe, name="wandb-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1)
    return reason[0] or None


def check_wandb(cfg: Config, problems: list[str]) -> None:
    """What --wandb_mode offline or online needs, checked before anything is written: each was a traceback from
    wandb.init on rank 0, after the run's files, which then refused the rerun without --resume true."""
    if cfg.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
        problems.append(f"--wandb_mode {cfg.wandb_mode} needs the wandb package: pip install -r requirements.txt, or "
                        "use --wandb_mode disabled")
        return
    if cfg.wandb_mode != "disabled":
        refused = settings_problems(cfg)
        problems += refused
        if refused:
            return
    folder_problem = unusable_folder(Path(os.environ["WANDB_DIR"]).absolute()) if os.environ.get("WANDB_DIR") \
        and cfg.wandb_mode != "disabled" else None
    if folder_problem:
        problems.append(f"WANDB_DIR={os.environ['WANDB_DIR']}: {folder_problem}; unset it (W&B then writes to "
                        "--out_dir) or name a folder this run can write")
    id_problem = run_id_problem(Path(cfg.out_dir) / RUN_ID_FILE) if cfg.resume and cfg.wandb_mode != "disabled" \
        and not os.environ.get("WANDB_RUN_ID") else None
    if id_problem:
        problems.append(id_problem)
    if cfg.wandb_mode == "online":
        check_wandb_online(problems)
    if cfg.log_model == "all" and cfg.keep_last_n is not None and cfg.wandb_mode == "offline":
        problems.append(f"--log_model all with --keep_last_n {cfg.keep_last_n}: offline, W&B's model artifacts point "
                        "at the checkpoint files until `wandb sync` uploads them, and --keep_last_n deletes them "
                        "first; drop --keep_last_n, or log online")
    if cfg.log_model and cfg.wandb_mode == "disabled":
        problems.append(f"--log_model {str(cfg.log_model).lower()} uploads checkpoints to Weights & Biases, which this "
                        "run does not use; give --wandb_mode online (or offline, synced later), or drop --log_model")


def settings_problems(cfg: Config) -> list[str]:
    """A wandb that does not import (a protobuf too old for it), and the names wandb.init would refuse (a project with
    a slash, a WANDB_RUN_ID with a colon), asked of wandb's own settings: each ended rank 0 after the run's files
    were written, which then refused the rerun without --resume true."""
    try:
        import wandb
    except Exception as error:  # noqa: BLE001 (ImportError, or what a broken dependency raises while importing)
        return [f"--wandb_mode {cfg.wandb_mode}: the wandb package does not import ({type(error).__name__}: "
                f"{first_line(error)}); reinstall it (pip install -r requirements.txt), or use --wandb_mode disabled"]
    named = (("--project", "project", cfg.project), ("--entity", "entity", cfg.entity),
             ("WANDB_RUN_ID", "run_id", os.environ.get("WANDB_RUN_ID")))
    settings = getattr(wandb, "Settings", None)  # absent from another wandb's layout: wandb.init says it then
    problems = []
    for name, setting, value in named:
        if value is None or settings is None:
            continue
        try:
            settings(**{setting: value})
        except Exception as error:  # noqa: BLE001 (wandb's UsageError, or pydantic's ValidationError)
            problems.append(f"{name} {value!r}: W&B refuses it ({first_line(error)}); give another")
    if settings is not None and hasattr(settings, "update_from_env_vars") and not problems:  # (WANDB_RUN_ID: said)
        try:  # WANDB_FINISH_TIMEOUT=abc: "could not start the run (1 validation error for Settings)", after the files
            settings().update_from_env_vars(dict(os.environ))
        except Exception as error:  # noqa: BLE001 (pydantic's ValidationError, naming the setting)
            problems.append(f"a WANDB_* variable: W&B refuses {refused_setting(error)}; fix or unset it, or use "
                            "--wandb_mode disabled")
    return problems


def refused_setting(error: Exception) -> str:
    """`finish_timeout (WANDB_FINISH_TIMEOUT='abc': Input should be a valid number, ...)` from pydantic's
    ValidationError, whose first line names only the class; its first line otherwise."""
    details = getattr(error, "errors", lambda: [])()
    if not details:
        return first_line(error)
    field = str(details[0]["loc"][0]) if details[0].get("loc") else "a setting"
    given = os.environ.get(f"WANDB_{field.upper()}")
    shown = f"WANDB_{field.upper()}={given!r}: " if given is not None else ""
    return f"{field} ({shown}{details[0].get('msg', '')})"


RESERVED_IN_RUN_IDS = ":;,#?/'"
"""What wandb refuses in a run id (wandb_settings.py validate_run_id)."""


def run_id_problem(path: Path) -> Optional[str]:
    """What is wrong with the W&B run id a resume continues (out_dir/wandb_run_id): wandb.init refused it after the
    launch, once the resume had moved the newer checkpoints aside, with advice about the login."""
    try:
        run_id = path.read_text().strip() if path.is_file() else None
    except (OSError, UnicodeDecodeError) as error:
        return f"{path}: not readable ({first_line(error)}); delete it to start a new W&B run"
    if not run_id or not any(char in RESERVED_IN_RUN_IDS for char in run_id):  # empty: a new W&B run
        return None
    return (f"{path} holds {run_id[:40]!r}, not a W&B run id (none holds any of {RESERVED_IN_RUN_IDS}); write the id "
            "of the W&B run to continue, or delete the file to start a new one")


def check_wandb_online(problems: list[str]) -> None:
    """Credentials for the W&B server, a well-formed key, and the server within reach."""
    try:
        url, logged_in = wandb_server()
    except ImportError:  # another wandb's layout: wandb.init says what it lacks
        return
    except Exception as error:  # noqa: BLE001 (wandb's settings refused a variable or its settings file)
        problems.append(f"--wandb_mode online: wandb's settings do not load ({first_line(error)}); fix the WANDB_* "
                        "variable or the settings file it names, or use --wandb_mode offline")
        return
    server = without_credentials(url)  # never printed, nor taken for a host name by the probe
    if not logged_in:
        problems.append(f"--wandb_mode online needs WANDB_API_KEY or `wandb login` (for {server}); or use "
                        "--wandb_mode offline")
        return
    key_problem = wandb_key_problem(os.environ.get("WANDB_API_KEY"))
    if key_problem:
        problems.append(f"WANDB_API_KEY: {key_problem} Copy it again from https://wandb.ai/authorize, or use "
                        "--wandb_mode offline")
        return
    reason = unreachable_reason(server)
    if reason:
        problems.append(f"--wandb_mode online: {server} cannot be reached ({reason}); use --wandb_mode offline "
                        "(then `wandb sync` the run's wandb folder from a machine with internet access)")
