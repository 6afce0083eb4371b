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
    parts = [f"step {step}/{max_step}", f"loss {metrics['train_loss']:.4f}", f"lr {metrics['lr']:.2e}"]
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
    """Rank 0's output. On a terminal a tqdm bar advances every step and messages print above it; in a log file
    (Slurm, docker logs, CI) a progress line is printed at each log interval instead, since a bar's carriage
    returns turn into one unreadable line there."""

    def __init__(self, *, enabled: bool, start_step: int, max_step: int, interactive: Optional[bool] = None) -> None:
        self.enabled = enabled
        interactive = sys.stdout.isatty() if interactive is None else interactive
        self.bar = (tqdm(total=max_step, initial=start_step, unit="step", file=sys.stdout, dynamic_ncols=True)
                    if enabled and interactive else None)

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
        """The log interval's numbers: the bar's postfix on a terminal, a line otherwise."""
        line = progress_line(step, max_step, metrics, eta)
        if self.bar is not None:
            self.bar.set_postfix_str(line.split(" | ", 1)[1], refresh=False)
        else:
            self.print(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
