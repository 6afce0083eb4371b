"""What rank 0 prints while training: a progress bar with ETA on a terminal, plain lines when output is a log file."""

from __future__ import annotations

import math
import sys
from typing import Optional

from tqdm import tqdm


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def format_gb(gb: float) -> str:
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1024:.2f} MB"


def progress_line(step: int, max_step: int, metrics: dict[str, float], eta: float) -> str:
    loss = f"loss {metrics['train_loss']:.4f}" if "train_loss" in metrics else "no trained tokens"
    parts = [f"step {step}/{max_step}", loss, f"lr {metrics['lr']:.2e}"]
    if "tokens_per_sec" in metrics:
        parts.append(f"{metrics['tokens_per_sec']:,.0f} tok/s")
    if "mfu" in metrics:
        parts.append(f"MFU {metrics['mfu']:.1%}")
    if "peak_allocated_gb" in metrics:
        parts.append(f"mem {metrics['peak_allocated_gb']:.1f} GB")
    if not math.isnan(eta):
        parts.append(f"eta {format_duration(eta)}")
    return " | ".join(parts)


class Console:
    """Rank 0's output. Each log interval's numbers are one line that stays (in a terminal's scrollback, or a log
    file); on a terminal a tqdm bar below them also advances every step, with the run's own ETA (tqdm's, from its
    average step rate, would disagree with the line's after every evaluation or save). In a log file (Slurm, docker
    logs, CI) there is no bar: its carriage returns would turn into one unreadable line there."""

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"

    def __init__(self, *, enabled: bool, start_step: int, max_step: int, interactive: Optional[bool] = None) -> None:
        self.enabled = enabled
        interactive = sys.stdout.isatty() if interactive is None else interactive
        self.bar = (tqdm(total=max_step, initial=start_step, unit="step", file=sys.stdout, dynamic_ncols=True,
                         bar_format=self.BAR_FORMAT) if enabled and interactive else None)

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, max_step: int, metrics: dict[str, float], eta: float) -> None:
        """The log interval's numbers: a line (above the bar on a terminal), and the bar's ETA."""
        self.print(progress_line(step, max_step, metrics, eta))
        if self.bar is not None and not math.isnan(eta):
            self.bar.set_postfix_str(f"eta {format_duration(eta)}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
