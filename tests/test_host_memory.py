"""A CPU process returns the memory of freed large tensors to the system, and keeps the free space it reuses at every
step (app/distributed/host_memory.py); a GPU process asks CUDA's allocator for expandable segments
(app/distributed/device_memory.py)."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from app.distributed.device_memory import expandable_segments
from tests.conftest import ROOT, run_script, run_train, train_args

HELPER = ROOT / "tests" / "helpers" / "heap_behaviour.py"
GLIBC_TRIM_THRESHOLD = "131072"
"""glibc's own trim threshold, where it stays once the mmap threshold is fixed (what the application did before)."""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc/self/status")

REPORT_AT_EXIT = f"""
import atexit, sys

sys.path[:0] = [{str(ROOT)!r}, {str(HELPER.parent)!r}]
import app.distributed.host_memory
from heap_behaviour import report

applied = []
tune_cpu_heap = app.distributed.host_memory.tune_cpu_heap
app.distributed.host_memory.tune_cpu_heap = lambda: applied.extend(tune_cpu_heap()) or applied
atexit.register(lambda: print("heap behaviour:", report(applied), file=sys.stderr, flush=True))
"""
"""Each process of the run records what its call to tune_cpu_heap applied, and reports at exit."""


@pytest.fixture(autouse=True)
def glibcs_own_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The application keeps a threshold set in the environment: these tests start from glibc's."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)


def heap_behaviour(mode: str, **env: str) -> dict:
    result = run_script([sys.executable, str(HELPER), mode], timeout=120, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_cpu_process_returns_freed_large_tensors_to_the_system_once_the_threshold_is_fixed():
    assert heap_behaviour("default")["retained_mb"] > 250  # what training on CPU processes kept, step after step
    assert heap_behaviour("tuned")["retained_mb"] < 40


def test_a_cpu_process_keeps_the_free_space_it_allocates_again():
    """With only the mmap threshold fixed, a thread's heap gave its free top back and faulted the same 32 MB in
    again every time (about 5,000 faults); a trim threshold set in the environment is kept."""
    tuned = heap_behaviour("tuned")
    assert tuned["applied"] == ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"]
    assert tuned["faults_per_reallocation"] < 500
    users_trim = heap_behaviour("tuned", MALLOC_TRIM_THRESHOLD_=GLIBC_TRIM_THRESHOLD)
    assert users_trim["applied"] == ["MALLOC_MMAP_THRESHOLD_"]
    assert users_trim["faults_per_reallocation"] > 2000


def test_an_mmap_threshold_the_user_set_is_kept():
    assert heap_behaviour("tuned", MALLOC_MMAP_THRESHOLD_="1048576")["applied"] == ["MALLOC_TRIM_THRESHOLD_"]


def test_every_rank_of_a_cpu_run_tunes_its_heap(tiny, tmp_path: Path):
    """The launching process and the rank it starts, under fsdp2 whose per-parameter buffers needed it."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(REPORT_AT_EXIT)
    args = train_args(tiny, tmp_path / "out", strategy="fsdp2", max_step=2, warmup_steps=1, save_step_interval=100,
                      eval_step_interval=100)
    result = run_train(args, env={"PYTHONPATH": str(tmp_path / "site")}, fresh=True)  # read at start-up
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in re.findall(r"heap behaviour: (.*)", result.stderr)]
    assert len(reports) == 2, result.stderr[-3000:]
    assert all(r["applied"] == ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"] for r in reports), reports
    assert all(r["retained_mb"] < 40 and r["faults_per_reallocation"] < 500 for r in reports), reports


def test_gpu_runs_ask_for_expandable_segments_unless_the_user_configured_the_allocator() -> None:
    environ: dict[str, str] = {}
    assert expandable_segments(environ) and environ == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        chosen = {name: "max_split_size_mb:512"}
        assert not expandable_segments(chosen) and chosen == {name: "max_split_size_mb:512"}
