"""Where numbers go: a progress line on rank 0, `<out_dir>/metrics.csv`, and Weights & Biases when enabled."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.loggers import Logger
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.throughput import Throughput

if TYPE_CHECKING:
    from arguments import Config

COLUMNS = ["step", "epoch", "train_loss", "val_loss", "val_ppl", "lr", "grad_norm", "tokens_per_sec",
           "samples_per_sec", "tokens_per_sec_per_device", "elapsed_sec"]


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


def format_duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


class StepClock:
    """Elapsed time, throughput (Lightning's Throughput over the last log interval) and ETA of the training steps."""

    def __init__(self, *, start_step: int, max_step: int, window: int, world_size: int,
                 samples_per_step: int, tokens_per_step: int) -> None:
        self.start_step, self.max_step = start_step, max_step
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self.world_size = world_size
        self.throughput = Throughput(world_size=world_size, window_size=window + 1)
        self.started = time.perf_counter()
        self._update(start_step)

    def _update(self, step: int) -> None:
        done = step - self.start_step
        per_device = self.samples_per_step // self.world_size
        self.throughput.update(time=self.elapsed(), batches=done, samples=done * per_device,
                               lengths=done * per_device * (self.tokens_per_step // self.samples_per_step))

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def tick(self, step: int) -> dict[str, float]:
        """Record a finished step; returns throughput once a full window of steps has been timed."""
        self._update(step)
        measured = self.throughput.compute()
        if "device/samples_per_sec" not in measured:
            return {}
        per_device = measured["device/items_per_sec"]
        return {
            "tokens_per_sec": per_device * self.world_size,
            "samples_per_sec": measured["device/samples_per_sec"] * self.world_size,
            "tokens_per_sec_per_device": per_device,
        }

    def eta(self, step: int) -> float:
        done = step - self.start_step
        return self.elapsed() / done * (self.max_step - step) if done else math.nan


def progress_line(step: int, max_step: int, metrics: dict[str, float], eta: float) -> str:
    parts = [f"step {step}/{max_step}", f"loss {metrics['train_loss']:.4f}", f"lr {metrics['lr']:.2e}"]
    if "tokens_per_sec" in metrics:
        parts.append(f"{metrics['tokens_per_sec']:,.0f} tok/s")
    if not math.isnan(eta):
        parts.append(f"eta {format_duration(eta)}")
    return " | ".join(parts)
