"""Where numbers go: `<out_dir>/metrics.csv`, `<out_dir>/summary.json`, and Weights & Biases and TensorBoard when
enabled."""

from __future__ import annotations

import csv
import io
import json
import os
import re
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

from lightning_fabric.loggers import Logger, TensorBoardLogger
from lightning_fabric.loggers.logger import rank_zero_experiment
from lightning_fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE
from lightning_fabric.utilities.logger import _convert_params, _flatten_dict
from lightning_fabric.utilities.rank_zero import rank_zero_only

from app.cli import first_line
from app.data.mixture import parse_eval_folders, parse_sources
from app.exit_codes import EXIT_PREEMPTED
from app.folders import append_whole, replace_file, written_or_warned
from app.metrics.console import Console
from app.metrics.observe import summary_lines
from app.reliability.watchdog import before_exit

if TYPE_CHECKING:
    from lightning_fabric import Fabric

    from arguments import Config

COLUMNS = ["step", "epoch", "tokens_seen", "train_loss", "val_loss", "val_ppl", "sample_exact_match", "sample_rouge1",
           "sample_rouge2", "sample_rougeL", "sample_rougeLsum", "sample_length", "lr", "grad_norm", "tokens_per_sec",
           "samples_per_sec", "tokens_per_sec_per_device", "tflops_per_sec_per_device", "mfu", "data_wait_pct",
           "peak_rss_gb", "peak_allocated_gb", "peak_reserved_gb", "save_sec", "elapsed_sec", "spikes",
           "skipped_steps", "rollbacks", "quarantined_rows"]
RUN_ID_FILE = "wandb_run_id"
METRICS_FILE = "metrics.csv"
SUMMARY_FILE = "summary.json"
ROWS_FILE = "rows.jsonl"
TENSORBOARD_DIR = "tensorboard"


class CSVMetrics(Logger):
    """metrics.csv with a fixed header, appended to across resumes.

    Lightning's CSVLogger deletes an existing metrics.csv when it starts, which would lose a resumed run's history.
    Rows after the step a run resumes from belong to the abandoned attempt and are dropped, so the file reads as
    one continuous run.
    """

    def __init__(self, out_dir: str | Path, resume_step: Optional[int] = None, sources: tuple[str, ...] = (),
                 evaluated: tuple[str, ...] = ()) -> None:
        self.path = Path(out_dir) / METRICS_FILE
        self._resume_step = resume_step
        self.last_step_kept: Optional[int] = None
        """The step of the last row that the resumed run's file kept, once log_hyperparams has rewritten it."""
        self.columns = (COLUMNS + [f"{metric}/{name}" for metric in ("val_loss", "tokens") for name in sources]
                        + [f"val_loss/{name}" for name in evaluated])
        """With a mixture's folders (`sources`), their validation losses and trained tokens; with --eval_data_dir's
        (`evaluated`), their validation losses."""

    @property
    def name(self) -> str:
        return "csv"

    @property
    def version(self) -> str:
        return "0"

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Prepare the file once: the hyperparameters themselves live in config.yaml."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns += [column for column in self.earlier_columns() if column not in self.columns]
        replace_file(self.path, self.lines_kept())

    def earlier_columns(self) -> list[str]:
        """The columns of the metrics.csv a resumed run continues, kept after this run's own: the history of a folder
        no longer evaluated (--eval_data_dir, a mixture's) was dropped with its column."""
        if self._resume_step is None or not self.path.exists():
            return []
        with open(self.path, newline="") as handle:
            return next(csv.reader(handle), [])

    def lines_kept(self) -> Iterator[str]:
        """The header, then the rows up to the step the run resumes from (`kept_rows`), one at a time: a week's
        metrics.csv at --log_interval 1 (600k rows, 157 MB) held in memory took 10 s and 1.45 GB at every resume, and
        rank 0's peak RSS, which every later row reports, measured that rather than training."""
        line = io.StringIO(newline="")
        writer = csv.DictWriter(line, fieldnames=self.columns, extrasaction="ignore")
        writer.writeheader()
        header = taken(line)
        yield header
        if self._resume_step is None or not self.path.exists():
            return
        with open(self.path, newline="") as handle:
            same_columns = handle.readline() == header
        if same_columns:  # rows copied as written: through csv's dicts, 45 us a row (600k rows: 28 s, every resume)
            for kept in kept_rows(partial(whole_lines, self.path, skip=1), lambda row: int(row.split(",", 1)[0]),
                                  self._resume_step):
                self.last_step_kept = int(kept.split(",", 1)[0])
                yield kept
            return

        def rows() -> Iterator[dict]:
            with open(self.path, newline="") as handle:  # a row cut short (killed while appending it) is dropped
                yield from csv.DictReader(line for line in handle if line.endswith("\n"))

        for row in kept_rows(rows, lambda row: int(row["step"]), self._resume_step):
            self.last_step_kept = int(row["step"])
            writer.writerow(row)
            yield taken(line)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        unknown = set(metrics) - set(self.columns)
        if unknown:
            raise KeyError(f"metrics without a metrics.csv column: {sorted(unknown)}")
        row = io.StringIO(newline="")
        csv.DictWriter(row, fieldnames=self.columns).writerow({**metrics, "step": step})
        written_or_warned(self.path, partial(append_whole, self.path, row.getvalue()))


T = TypeVar("T")


def kept_rows(rows: Callable[[], Iterator[T]], step_of: Callable[[T], int], resume_step: int) -> Iterator[T]:
    """What a resume from `resume_step` keeps of a file of rows by step (`rows` reads it afresh, for two passes: a
    long run's file does not fit in memory): every row up to the last one of a step no later than the resume's.
    A rollback wrote the abandoned steps' rows and then the same steps again (`…32, 33, 34, 33, 34…`); keeping
    each row of a step up to the resume's, a resume from the second 33 kept the abandoned 33 but not 34, where
    the run itself had both."""
    last = -1
    for index, row in enumerate(rows()):
        if step_of(row) <= resume_step:
            last = index
    for index, row in enumerate(rows()):
        if index > last:
            return
        yield row


def whole_lines(path: Path, skip: int = 0) -> Iterator[str]:
    """The lines of `path` as written (line ends kept), after the first `skip`, but for a last one cut short (killed
    while appending it)."""
    with open(path, newline="") as handle:
        for _ in range(skip):
            handle.readline()
        yield from (line for line in handle if line.endswith("\n"))


def lines_up_to(path: Path, step: int) -> Iterator[str]:
    """rows.jsonl's whole lines up to `step` (`kept_rows`), one at a time (a long run's file is gigabytes at real
    batch sizes); each line's step read from its start, `{"step": N, ...` as RowRecord writes it (json.loads of
    every line took 2.2 s for 46 MB at every resume)."""
    yield from kept_rows(partial(whole_lines, path), line_step, step)


def line_step(line: str) -> int:
    written = ROW_STEP.match(line)
    return int(written.group(1)) if written else json.loads(line)["step"]


ROW_STEP = re.compile(r'\{"step": (\d+),')


def taken(buffer: io.StringIO) -> str:
    """What `buffer` holds, which it then forgets."""
    text = buffer.getvalue()
    buffer.seek(0)
    buffer.truncate()
    return text


class RowRecord:
    """`out_dir/rows.jsonl` (--record_rows): one line per step with its train rows by folder, written by rank 0 as
    the step ends. A resumed run keeps the lines up to its checkpoint's step, as metrics.csv does, so the file reads
    as the rows of one continuous run."""

    def __init__(self, out_dir: str | Path, resume_step: int) -> None:
        path = Path(out_dir) / ROWS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, lines_up_to(path, resume_step) if resume_step and path.exists() else "")
        self.path = path

    def write(self, step: int, rows: dict[str, list[int]]) -> None:
        """A line, on disk before the next step."""
        line = json.dumps({"step": step, "rows": rows}) + "\n"
        written_or_warned(self.path, partial(append_whole, self.path, line))


class WandbFailed(Exception):
    """wandb.init failed on rank 0 (the server refused the login or the project, its service did not start): one
    line, not wandb's traceback."""


class WandbMetrics(Logger):
    """The run in Weights & Biases: started on rank 0 at its first use, finished with the run's exit code as the
    process leaves (`finish`).

    The Fabric package has no W&B logger (Lightning's comes with its Trainer, whose import, torchmetrics included, adds
    about 2 s to the start of every rank, and wandb's Fabric integration imports that), and a run needs four of wandb's
    calls. Metrics are plotted against `trainer/global_step`, as Lightning's logger does, so that resumed runs line up.

    Offline, wandb says nothing (its lines told to `wandb online` or set WANDB_MODE, which the run's own mode
    overrides, and to sync only this start's folder), and one line says where the run is and how to upload it all;
    online, its non-essential output is off. The uploads left at the end are waited for --stall_timeout_min at most
    (wandb's finish_timeout, unless WANDB_FINISH_TIMEOUT sets it): wandb waits for ever by default, and a finished run
    whose network had gone held its nodes, what the stall watchdog prevents during the run; what was not sent stays in
    the run's folder for `wandb sync`.

    A resumed run continues the W&B run it resumes (its history, its model artifacts): the run's id is kept in
    `out_dir/wandb_run_id` (not a secret), unless WANDB_RUN_ID names one. Without an id wandb starts a new run.
    """

    def __init__(self, cfg: Config, resuming: bool) -> None:
        self._id_file = Path(cfg.out_dir) / RUN_ID_FILE
        run_id = None
        if resuming and not os.environ.get("WANDB_RUN_ID") and self._id_file.is_file():
            run_id = self._id_file.read_text().strip() or None
        self._init = dict(project=cfg.project, entity=cfg.entity, name=cfg.run_name or Path(cfg.out_dir).resolve().name,
                          dir=os.environ.get("WANDB_DIR") or cfg.out_dir, mode=cfg.wandb_mode, id=run_id,
                          resume="allow" if resuming else None)
        self._uploaded_before_pruned = cfg.keep_last_n is not None and cfg.wandb_mode == "online"
        self._finish_timeout_sec = None if "WANDB_FINISH_TIMEOUT" in os.environ else cfg.stall_timeout_min * 60
        self._run: Any = None

    @property
    def name(self) -> str:
        return "wandb"

    @property
    def version(self) -> Optional[str]:
        return self._run.id if self._run else None

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._run is None:
            import wandb

            Path(self._init["dir"]).mkdir(parents=True, exist_ok=True)
            settings = {} if self._finish_timeout_sec is None else dict(finish_timeout=self._finish_timeout_sec)
            offline = self._init["mode"] == "offline"
            settings |= {"silent": True} if offline else {"quiet": True}  # its advice, wrong here, and ~30 lines
            try:
                self._run = wandb.init(**self._init, settings=settings)
            except Exception as error:  # wandb's CommError, AuthenticationError, UsageError, ServiceStartTimeoutError
                other = "offline" if self._init["mode"] == "online" else "disabled"
                advice = ("set HOME or WANDB_CONFIG_DIR to a folder this user can write (a container's user without "
                          "an account has no home, where wandb keeps its settings)" if "home directory" in str(error)
                          else "check the login, --project and --entity")
                raise WandbFailed(f"Weights & Biases could not start the run ({first_line(error)}); {advice}, or use "
                                  f"--wandb_mode {other}") from error
            replace_file(self._id_file, self._run.id + "\n")
            if offline:
                folder = Path(self._init["dir"]) / "wandb"
                print(f"Weights & Biases: offline, in {folder}; upload every start of this run with `wandb sync "
                      f"{folder}/offline-run-*`", flush=True)
            before_exit(self.finish)
            self._run.define_metric("trainer/global_step")
            self._run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        return self._run

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.experiment.config.update(params, allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.experiment.log({**metrics, "trainer/global_step": step} if step is not None else metrics)

    @rank_zero_only
    def log_checkpoint(self, path: Path, step: int) -> None:
        """A published checkpoint as a model artifact, referenced rather than copied (policy immutable): it never
        changes. Uploaded in the background, or in offline mode at `wandb sync` (--log_model all is refused there with
        --keep_last_n): online under --keep_last_n, which may delete the file at the next save, the upload is waited
        for (offline, wandb has no upload to wait for: Artifact.wait raises)."""
        import wandb

        artifact = wandb.Artifact(f"model-{self.experiment.id}", type="model", metadata={"step": step})
        if path.is_dir():
            artifact.add_dir(str(path), policy="immutable")
        else:
            artifact.add_file(str(path), policy="immutable")
        logged = self.experiment.log_artifact(artifact, aliases=[f"step-{step}", "latest"])
        if self._uploaded_before_pruned:
            logged.wait()

    @rank_zero_only
    def set_summary(self, summary: dict[str, Any]) -> None:
        self.experiment.summary.update(summary)

    def finish(self, code: int) -> None:
        """Finish the W&B run with the run's exit code (a preempted run marked so), and wait for wandb's service to
        have written and sent it, as the process exits: wandb's own exit handler said 0 whatever the run's end, and
        a crash's end killed the service with the run's rows unwritten (app/reliability/watchdog.py EXIT_HOOKS)."""
        import wandb

        if code == EXIT_PREEMPTED:
            self._run.mark_preempting()
        self._run.finish(exit_code=code)
        wandb.teardown()


class TensorBoardMetrics(TensorBoardLogger):
    """`out_dir/tensorboard/` (--tensorboard): metrics.csv's rows as TensorBoard scalars at the same steps, and the
    run's options as its hyperparameters, written by rank 0 with Fabric's logger.

    Every start of the run writes its own event file into the one folder, which TensorBoard reads as one run. A
    resume from step N starts its file with TensorBoard's purge marker at N + 1 (`purge_step`): TensorBoard then
    hides what the abandoned stretch logged after step N, as metrics.csv drops those rows. A rollback to step N
    writes the same marker into the open file (`forget_after`), and a start with --tensorboard off writes a file
    of it alone (`forget_in_folder`): a later start with it on would otherwise show the stretch that start
    abandoned, beside the steps it trained again unseen. The writer queues events
    for a thread of its own and flushes every two minutes, so it is closed as the process exits (`before_exit`),
    whichever way the run ends: finished, stopped or crashed.
    """

    def __init__(self, out_dir: str | Path, resume_step: Optional[int] = None) -> None:
        super().__init__(Path(out_dir) / TENSORBOARD_DIR, name="", version="", purge_step=purge_step(resume_step))
        self._start_step = resume_step or 0

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The writer, made at its first use on rank 0."""
        if self._experiment is None:
            before_exit(self.close)
        return super().experiment

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The options once per start, at the step it starts from. They are config.yaml's, which W&B receives too:
        no option holds a credential (tokens and keys come from the environment). Fabric's own method writes them
        only beside a metric, a placeholder `hp_metric` that metrics.csv has not."""
        if _TENSORBOARD_AVAILABLE:
            from torch.utils.tensorboard.summary import hparams
        else:
            from tensorboardX.summary import hparams
        writer = self.experiment._get_file_writer()
        for summary in hparams(self._sanitize_params(_flatten_dict(_convert_params(params))), {}):
            writer.add_summary(summary, self._start_step)

    @rank_zero_only
    def forget_after(self, step: int) -> None:
        """TensorBoard's purge marker at `step` + 1: it forgets what the file showed after `step` (a rollback's)."""
        if _TENSORBOARD_AVAILABLE:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        else:
            from tensorboardX.proto.event_pb2 import Event, SessionLog
        marker = Event(step=step + 1, session_log=SessionLog(status=SessionLog.START))
        self.experiment._get_file_writer().add_event(marker)

    def close(self, code: int) -> None:
        """Write what is queued and close the file (an exit hook: the run's exit code does not matter here)."""
        self.finalize("success" if code == 0 else "failed")


@rank_zero_only
def log_lost_row(loggers: list[Logger], step: int, row: dict[str, float]) -> None:
    """A save step's metrics row is logged once its checkpoint is published, as it holds the save's time: an attempt
    that ended in between (a stall's exit while the ranks agreed that the save went well, a kill) left the
    checkpoint of step `step` without its row, and the run resumed from it goes on at the next step. The checkpoint
    keeps that row but its save_sec (state["step_row"]): logged here, after metrics.csv was rewritten for the resume
    (log_hyperparams), where the file lacks it; its columns that this run's file has not (a folder no longer
    evaluated, in a metrics.csv written anew) are left out."""
    metrics_csv = next(logger for logger in loggers if isinstance(logger, CSVMetrics))
    row = {name: value for name, value in row.items() if name in metrics_csv.columns}
    if row and (metrics_csv.last_step_kept is None or metrics_csv.last_step_kept < step):
        for logger in loggers:
            logger.log_metrics(row, step)


def forget_after(loggers: list[Logger], step: int) -> None:
    """A rollback to `step`: TensorBoard forgets the steps after it, which the run logs again. metrics.csv keeps
    both, in the order logged (a resume keeps them: kept_rows); W&B cannot take a point back."""
    for logger in loggers:
        if isinstance(logger, TensorBoardMetrics):
            logger.forget_after(step)


@rank_zero_only
def forget_in_folder(out_dir: str | Path, resume_step: Optional[int]) -> None:
    """A start with --tensorboard off, of a run whose TensorBoard folder is there: a file holding only the purge
    marker (`purge_step`), for what that folder shows after `resume_step` is abandoned."""
    folder = Path(out_dir) / TENSORBOARD_DIR
    if folder.is_dir():
        TensorBoardLogger(folder, name="", version="", purge_step=purge_step(resume_step)).experiment.close()


def purge_step(resume_step: Optional[int]) -> int:
    """The step from which TensorBoard hides what earlier starts wrote: everything for a run starting at step 0 (a
    relaunch without a checkpoint replaces the earlier start's metrics.csv too), the steps after the checkpoint's for
    a resume."""
    return 0 if resume_step is None else resume_step + 1


def make_loggers(cfg: Config, resume_step: Optional[int]) -> list[Logger]:
    sources = parse_sources(cfg.train_data_dir) if cfg.train_data_dir else []
    evaluated = parse_eval_folders(cfg.eval_data_dir, cfg.train_data_dir) if cfg.eval_data_dir else {}
    loggers: list[Logger] = [CSVMetrics(cfg.out_dir, resume_step,
                                        tuple(source.name for source in sources) if len(sources) > 1 else (),
                                        tuple(evaluated))]
    if cfg.tensorboard:  # before W&B: its exit hook, quick, runs first (W&B's may wait out a crash's 15 s)
        loggers.append(TensorBoardMetrics(cfg.out_dir, resume_step))
    else:
        forget_in_folder(cfg.out_dir, resume_step)
    if cfg.wandb_mode != "disabled":
        loggers.append(WandbMetrics(cfg, resuming=bool(resume_step)))
    return loggers


def should_upload_checkpoint(log_model: bool | str, last: bool) -> bool:
    """--log_model true uploads the final checkpoint, all uploads every one."""
    return log_model == "all" or (log_model is True and last)


def upload_checkpoint(loggers: list[Logger], path: Path, step: int) -> None:
    for logger in loggers:
        if isinstance(logger, WandbMetrics):
            logger.log_checkpoint(path, step)


def report_summary(fabric: Fabric, out_dir: str | Path, summary: dict[str, Any], console: Console) -> None:
    """The end-of-run summary: printed, written to <out_dir>/summary.json, and set as the W&B run summary under
    `attempt/` (this attempt's figures: under the history's own names, elapsed_sec and tokens_per_sec replaced the
    run's last values in W&B's runs table with this attempt's)."""
    if not fabric.is_global_zero:
        return
    path = Path(out_dir) / SUMMARY_FILE
    written = written_or_warned(path, partial(replace_file, path, json.dumps(summary, indent=2) + "\n"))
    for line in summary_lines(summary):
        console.print(line)
    if written:
        console.print(f"  written to {path}")
    for logger in fabric.loggers:
        if isinstance(logger, WandbMetrics):
            logger.set_summary({f"attempt/{k}": v for k, v in summary.items() if k != "ranks"})
