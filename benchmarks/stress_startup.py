"""Start-up stress: N short 2-process runs of train.py with the default data loader workers, counting hangs.

The start-up hang this guards against (a data loader worker forked from a rank that already ran threads, deadlocked
before its first line) came about once in 60 starts. Each run here is train.py as users start it: `python train.py
--devices 2` (Lightning's launcher) with the default `--num_workers` (2), on the tests' tiny model and data, 24
steps over 3 epochs, so that every run starts 12 workers (2 per rank and epoch). A run that does not end within
`--timeout` seconds is a hang: its processes print their Python stacks into its log one after the other (SIGUSR2, see
app/reliability/watchdog.py), then they are killed. The logs of runs that hung or failed are kept in `--log_dir`.

Run: python benchmarks/stress_startup.py [--runs 100] [--timeout 180] [--log_dir stress-logs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import suppress
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from app.reliability.watchdog import collect_stacks
from conftest import TinySetup, build_tiny_setup, train_args

RUN = dict(micro_batch_size=16, gradient_accumulation_steps=2, max_step=24, eval_step_interval=100,
           save_step_interval=100, log_interval=8, num_workers=None)
"""647 train blocks / (16 x 2 ranks x 2 accumulation) = 10 steps per epoch, so 3 epochs; num_workers None: train.py's
default."""


def one_run(tiny: TinySetup, out_dir: Path, log: Path, timeout: float) -> str:
    """'finished', 'hung' or 'failed (exit N)'; no process of the run is left afterwards."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *train_args(tiny, out_dir, **RUN)],
                                   cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = process.wait(timeout=timeout)
        return "finished" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        launcher = psutil.Process(process.pid)
        collect_stacks([launcher, *launcher.children(recursive=True)])
        return "hung"
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="Runs to start (default 100).")
    parser.add_argument("--timeout", type=float, default=180, help="Seconds after which a run counts as hung.")
    parser.add_argument("--log_dir", type=Path, default=Path("stress-logs"), help="Where logs of bad runs go.")
    args = parser.parse_args()
    if args.runs < 1 or args.timeout <= 0:
        parser.exit(2, "error: --runs must be at least 1 and --timeout positive\n")
    return args


def main() -> None:
    args = parse_args()
    outcomes: Counter[str] = Counter()
    seconds: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        tiny = build_tiny_setup(Path(scratch))
        for index in range(1, args.runs + 1):
            log = Path(scratch) / f"run-{index:03d}.log"
            started = time.monotonic()
            outcome = one_run(tiny, Path(scratch) / f"run-{index:03d}", log, args.timeout)
            seconds.append(time.monotonic() - started)
            outcomes[outcome.split(" ")[0]] += 1
            if outcome != "finished":
                args.log_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy(log, args.log_dir / log.name)
            print(f"run {index}/{args.runs}: {outcome} in {seconds[-1]:.1f} s", flush=True)
    print(f"{outcomes['finished']} finished, {outcomes['hung']} hung, {outcomes['failed']} failed of {args.runs} "
          f"runs (median {statistics.median(seconds):.1f} s per run; logs of the others in {args.log_dir})")


if __name__ == "__main__":
    main()
