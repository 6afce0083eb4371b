"""--profile_steps: torch.profiler's trace of a stretch of optimizer steps, one per rank, and the table of the
operators that took the most time.

torch's own profiler does the recording (CPU and, on a GPU, CUDA kernels, with their memory); this module only
places its window on the run's step numbers, which a resume continues, and writes what it recorded where the run's
other files are: out_dir/profile/steps-A-B-rank-R.json.gz (open it in https://ui.perfetto.dev) and the matching .txt.
torch is imported where it is used: arguments.py checks the option's value with profile_window, before the command
line has imported torch.
"""

from __future__ import annotations

import re
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

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


def steps_to_trace(window: tuple[int, int], start_step: int) -> Optional[tuple[int, int]]:
    """The steps of `window` a run resumed at `start_step` still takes; None when it is past them."""
    first, last = window
    return (max(first, start_step + 1), last) if last > start_step else None


@contextmanager
def profiled_steps(window: Optional[tuple[int, int]], start_step: int, out_dir: Path, rank: int,
                   say: Callable[[str], None]) -> Iterator[Callable[[], None]]:
    """Yields what the loop calls after each optimizer step. The profiler records the steps of `window` (one step
    before them warms it up, when the run has one: its first recorded step pays for starting the profiler),
    exports them as soon as the last one ends, and `say`s where."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    steps = steps_to_trace(window, start_step) if window else None
    if steps is None:
        yield lambda: None
        return
    first, last = steps
    warmup = 1 if first > start_step + 1 else 0
    folder, name = out_dir / "profile", f"steps-{first}-{last}-rank-{rank}"

    def export(recorded: profile) -> None:
        """Written by each rank; a disk that refuses them is said, and training goes on."""
        sort_by = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            recorded.export_chrome_trace(str(folder / f"{name}.json.gz"))
            (folder / f"{name}.txt").write_text(recorded.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS))
        except OSError as error:
            print(f"warning: rank {rank}: --profile_steps: the trace of steps {first}-{last} could not be written "
                  f"({error.strerror or error}); training goes on", file=sys.stderr, flush=True)
            return
        say(f"step {last}: steps {first}-{last} traced in {folder}: a trace per rank for https://ui.perfetto.dev, "
            "and the slowest operators")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with warnings.catch_warnings():  # "won't be using warmup": a window from the run's first step has no step before
        warnings.simplefilter("ignore", UserWarning)
        window_schedule = schedule(wait=first - start_step - 1 - warmup, warmup=warmup, active=last - first + 1,
                                   repeat=1)
    with profile(activities=activities, schedule=window_schedule, on_trace_ready=export, record_shapes=True,
                 profile_memory=True) as recorder:
        yield recorder.step
