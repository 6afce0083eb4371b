"""--profile_steps: torch.profiler's trace of a stretch of optimizer steps, one per rank, and the table of the
operators that took the most time.

torch's own profiler does the recording (CPU and, on a GPU, CUDA kernels, with their memory); this module only
places its window on the run's step numbers (which a resume continues and a rollback takes back), and writes what
it recorded where the run's other files are: out_dir/profile/steps-A-B-rank-R.json.gz (open it in
https://ui.perfetto.dev) and the matching .txt. torch is imported where it is used: arguments.py checks the option's
value with profile_window, before the command line has imported torch.
"""

from __future__ import annotations

import re
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

WINDOW = re.compile(r"(\d+)(?::(\d+))?")
TABLE_ROWS = 30


def profile_window(text: Optional[str]) -> Optional[tuple[int, int]]:
    """`10:12` as (10, 12), `10` as (10, 10); None for none. Raises ValueError for anything else, or a window
    that does not start at step 1 or later and end where it starts or after."""
    if text is None:
        return None
    match = WINDOW.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--profile_steps {text}: give the optimizer steps to trace as FIRST:LAST (10:12) or one step")
    first = int(match.group(1))
    last = int(match.group(2) or first)
    if not 1 <= first <= last:
        raise ValueError(f"--profile_steps {text}: the first step must be 1 or more, and the last at least the first")
    return first, last


def steps_to_trace(window: tuple[int, int], start_step: int, max_step: int) -> Optional[tuple[int, int]]:
    """The steps of `window` a run from `start_step` (a resume's) to `max_step` takes; None when it takes none."""
    first, last = max(window[0], start_step + 1), min(window[1], max_step)
    return (first, last) if first <= last else None


@dataclass
class StepTracer:
    """Called with the number of the last finished step before every step begins (and before the first): starts
    torch's profiler one step before `first` where the run has that step (its warm-up: the first recorded step would
    pay for starting the profiler), records `first` to `last`, and exports what it recorded when `last` ends or the
    run does. A rollback's steps are traced as they ran, and the files are named after the steps recorded."""

    first: int
    last: int
    folder: Path
    rank: int
    say: Callable[[str], None]
    recorder: Any = None
    recorded: list[int] = field(default_factory=list)

    def __call__(self, done: int) -> None:
        if self.recorder is None:
            if done in (self.first - 2, self.first - 1):
                self.start(warmup=int(done == self.first - 2))
            return
        if self.recording():
            self.recorded.append(done)
        self.recorder.step()

    def recording(self) -> bool:
        return self.recorder is not None and self.recorder.current_action.name.startswith("RECORD")

    def start(self, warmup: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with warnings.catch_warnings():  # "won't be using warmup": a window from a run's first step has no step before
            warnings.simplefilter("ignore", UserWarning)
            window = schedule(wait=0, warmup=warmup, active=self.last - self.first + 1, repeat=1)
        self.recorder = profile(activities=activities, schedule=window, on_trace_ready=self.export, record_shapes=True,
                                profile_memory=True)
        self.recorder.start()

    def stop(self) -> None:
        """At the run's end: what a window cut short recorded is exported too, with the step it ended in."""
        if self.recording():
            self.recorded.append(self.recorded[-1] + 1 if self.recorded else self.first)
        if self.recorder is not None:
            self.recorder.stop()

    def export(self, recorder: Any) -> None:
        """Written by each rank; a disk that refuses them is said, and training goes on."""
        import torch

        if not self.recorded:
            return
        steps = f"{self.recorded[0]}-{self.recorded[-1]}"
        name = f"steps-{steps}-rank-{self.rank}"
        sort_by = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            recorder.export_chrome_trace(str(self.folder / f"{name}.json.gz"))
            (self.folder / f"{name}.txt").write_text(recorder.key_averages().table(sort_by=sort_by,
                                                                                   row_limit=TABLE_ROWS))
        except OSError as error:
            print(f"warning: rank {self.rank}: --profile_steps: the trace of steps {steps} could not be written "
                  f"({error.strerror or error}); training goes on", file=sys.stderr, flush=True)
            return
        self.say(f"step {self.recorded[-1]}: steps {steps} traced in {self.folder}: a trace per rank for "
                 "https://ui.perfetto.dev, and the slowest operators")


@contextmanager
def profiled_steps(window: Optional[tuple[int, int]], start_step: int, max_step: int, out_dir: Path, rank: int,
                   say: Callable[[str], None]) -> Iterator[Optional[Callable[[int], None]]]:
    """Yields what the loop calls with the last finished step before each step: a StepTracer for the steps of
    `window` this run takes, else None."""
    steps = steps_to_trace(window, start_step, max_step) if window else None
    if steps is None:
        yield None
        return
    tracer = StepTracer(*steps, folder=out_dir / "profile", rank=rank, say=say)
    try:
        yield tracer
    finally:
        tracer.stop()
