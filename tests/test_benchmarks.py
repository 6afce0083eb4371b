"""benchmarks/bench_training.py's arithmetic, without its hour of runs: how a step time, a ratio and the time a save
costs are derived from the runs, and how the planner's report is read. These numbers go into docs/performance.md,
so a change that skews them (or a planner report the benchmark can no longer read) fails here, not in an hour-long
benchmark run."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch

from app.metrics.memory_plan import report_total_gb
from benchmarks.bench_training import Comparison, Regime, step_times, time_lost_to_saves
from tests.conftest import run_entry

REGIME = Regime("test", micro_batch_size=4, long_steps=30)


def test_the_optimizer_benchmark_times_both_contenders_at_each_repeat() -> None:
    from benchmarks.bench_optimizer import CONTENDERS, measure

    times = measure(10_000, 3, torch.device("cpu"))
    assert list(times) == list(CONTENDERS) and all(len(seconds) == 3 and min(seconds) > 0
                                                   for seconds in times.values())


def test_the_muon_benchmark_steps_both_contenders_on_two_ranks_and_counts_their_collectives(tiny) -> None:
    """The tiny model's 14 matrices: torch's Muon on DTensors gathers operands op by op, ShardedMuon sends 2
    all_to_alls per round of 2 matrices; a statistics traceback after minutes of set-up is refused first."""
    result = run_entry(["benchmarks/bench_muon.py", "--model_config", str(tiny.model_config), "--repeats", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[1].startswith("ShardedMuon: ") and " s a step, 14 collectives (14 matrices" in lines[1], lines
    assert int(lines[0].split(" s a step, ")[1].split()[0]) > 5 * 14, lines[0]
    assert lines[2].startswith("ShardedMuon / torch Muon: ") and "over 1 repeats" in lines[2], lines
    refused = run_entry(["benchmarks/bench_muon.py", "--repeats", "0"])
    assert refused.returncode == 2 and "error: --repeats must be 1 or more" in refused.stderr, refused.stderr


def test_a_step_time_is_the_long_run_less_the_short_one_per_extra_step_and_contenders_alternate() -> None:
    """Start-up and the last evaluation cancel out: a contender of 5 s fixed cost and 0.1 s a step measures 0.1 s.
    Each contender first warms up once; then, within a repeat, they run back to back in alternating order."""
    calls: list[tuple[str, int]] = []

    def contender(name: str, fixed: float, per_step: float):
        def train_sec(micro: int, steps: int) -> float:
            assert micro == REGIME.micro_batch_size
            calls.append((name, steps))
            return fixed + per_step * steps
        return train_sec

    times = step_times({"ours": contender("ours", 5.0, 0.1), "theirs": contender("theirs", 2.0, 0.2)}, REGIME,
                       Namespace(short_steps=10, repeats=3))
    assert times == {"ours": pytest.approx([0.1] * 3), "theirs": pytest.approx([0.2] * 3)}
    assert [name for name, steps in calls[2::2]] == ["ours", "theirs", "theirs", "ours", "ours", "theirs"]
    assert calls[:2] == [("ours", 10), ("theirs", 10)] and [steps for _, steps in calls[2:]] == [10, 30] * 6


def test_a_ratio_is_the_median_of_the_repeats_ratios_with_their_range_and_its_verdict() -> None:
    """Repeats whose median of ratios (1.0), ratio of medians (2.0) and mean of ratios (1.5) all differ: the ratio of
    samples taken side by side, in the same minutes of this drifting machine, is what a row reports."""
    times = {"ours": [1.0, 3.0, 2.0], "theirs": [1.0, 1.0, 4.0]}
    assert Comparison("step time", "ours", "theirs", target=1.03).row(times, REGIME) == (
        "| step time (test) | 2.000 s | 1.000 s | 1.00 (0.50-3.00) | <= 1.03 met |")
    assert Comparison("speed-up", "ours", "theirs", speed_up=True, target=1.1).row(times, REGIME) == (
        "| speed-up (test) | 2.000 s | 1.000 s | 1.00 (0.33-2.00) | >= 1.10 **missed** |")
    assert Comparison("informs", "ours", "theirs").row(times, REGIME).endswith("| 1.00 (0.50-3.00) |  |")


def test_the_time_a_save_costs_is_the_step_after_it_less_the_runs_typical_step() -> None:
    """Steps of 1 s, saves every 4 steps: the steps after them (5 and 9) took 1.5 s and 1.25 s."""
    durations = {step: 1.0 for step in range(1, 12)} | {5: 1.5, 9: 1.25}
    ends, elapsed = {}, 0.0
    for step, seconds in durations.items():
        elapsed += seconds
        ends[step] = elapsed
    assert time_lost_to_saves(ends, interval=4) == pytest.approx([0.5, 0.25])


def test_the_planners_total_is_read_from_what_estimate_memory_prints(tiny, tmp_path, capfd) -> None:
    from app.training.run import run
    from arguments import parse_config
    from tests.conftest import train_args

    run(parse_config(train_args(tiny, tmp_path / "run", estimate_memory=True, device_memory_gb=80)))
    printed = capfd.readouterr().out
    total = report_total_gb(printed)
    assert 0.05 < total < 2.0, printed
    assert report_total_gb("  total          1.25 GB\n") == 1.25 and report_total_gb("  total  51.2 MB\n") == 0.05
