"""Where numbers go: `<out_dir>/metrics.csv`, `<out_dir>/summary.json`, and Weights & Biases when enabled."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.loggers import Logger
from lightning.fabric.utilities.rank_zero import rank_zero_only

from app.console import Console
from app.observe import summary_lines

if TYPE_CHECKING:
    from lightning import Fabric

    from arguments import Config

COLUMNS = ["step", "epoch", "train_loss", "val_loss", "val_ppl", "sample_exact_match", "sample_rouge1", "sample_rouge2",
           "sample_rougeL", "sample_length", "lr", "grad_norm", "tokens_per_sec",
           "samples_per_sec", "tokens_per_sec_per_device", "tflops_per_sec_per_device", "mfu", "data_wait_pct",
           "peak_rss_gb", "peak_allocated_gb", "peak_reserved_gb", "save_sec", "elapsed_sec"]


class CSVMetrics(Logger):
    """metrics.csv with a fixed header, appended to across resumes.

    Lightning's CSVLogger deletes an existing metrics.csv when it starts, which would lose a resumed run's history.
    Rows after the step a run resumes from belong to the abandoned attempt and are dropped, so the file reads as
    one continuous run.
    """

    def __init__(self, out_dir: str | Path, resume_step: Optional[int] = None) -> None:
        self.path = Path(out_dir) / "metrics.csv"
        self._resume_step = resume_step

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
        kept = []
        if self._resume_step is not None and self.path.exists():
            with open(self.path, newline="") as handle:
                kept = [row for row in csv.DictReader(handle) if int(row["step"]) <= self._resume_step]
        with open(self.path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(kept)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        unknown = set(metrics) - set(COLUMNS)
        if unknown:
            raise KeyError(f"metrics without a metrics.csv column: {sorted(unknown)}")
        with open(self.path, "a", newline="") as handle:
            csv.DictWriter(handle, fieldnames=COLUMNS).writerow({**metrics, "step": step})


def make_loggers(cfg: Config, resume_step: Optional[int]) -> list[Logger]:
    loggers: list[Logger] = [CSVMetrics(cfg.out_dir, resume_step)]
    if cfg.wandb_mode != "disabled":
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(
            project=cfg.project, entity=cfg.entity, name=cfg.run_name or Path(cfg.out_dir).resolve().name,
            save_dir=cfg.out_dir, offline=cfg.wandb_mode == "offline", resume="allow" if resume_step else None,
        ))
    return loggers


def should_upload_checkpoint(log_model: bool | str, last: bool) -> bool:
    """--log_model true uploads the final checkpoint, all uploads every one."""
    return log_model == "all" or (log_model is True and last)


@rank_zero_only
def upload_checkpoint(loggers: list[Logger], path: Path, step: int) -> None:
    """Log a published checkpoint as a W&B model artifact.

    The file is referenced, not copied (policy immutable): a published checkpoint never changes. In offline mode the
    upload happens at `wandb sync`, so keep the file until then.
    """
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger):
            artifact = wandb.Artifact(f"model-{logger.experiment.id}", type="model", metadata={"step": step})
            if path.is_dir():
                artifact.add_dir(str(path), policy="immutable")
            else:
                artifact.add_file(str(path), policy="immutable")
            logger.experiment.log_artifact(artifact, aliases=[f"step-{step}", "latest"])


def report_summary(fabric: Fabric, out_dir: str | Path, summary: dict[str, Any], console: Console) -> None:
    """The end-of-run summary: printed, written to <out_dir>/summary.json, and set as the W&B run summary."""
    if not fabric.is_global_zero:
        return
    path = Path(out_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    for line in summary_lines(summary):
        console.print(line)
    console.print(f"  written to {path}")
    from lightning.pytorch.loggers import WandbLogger

    for logger in fabric.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update({k: v for k, v in summary.items() if k != "ranks"})
