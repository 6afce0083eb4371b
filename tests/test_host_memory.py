"""A CPU process returns the memory of freed large tensors to the system (app/host_memory.py)."""

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_script, run_train, train_args

HELPER = ROOT / "tests" / "helpers" / "freed_memory.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc/self/status")

REPORT_AT_EXIT = f"""
import atexit, sys

def report():
    sys.path.insert(0, {str(HELPER.parent)!r})
    from freed_memory import mb_retained_after_freeing
    print(f"retained after freeing: {{mb_retained_after_freeing():.0f}} MB", file=sys.stderr, flush=True)

atexit.register(report)
"""


@pytest.fixture(autouse=True)
def glibcs_own_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The application keeps a threshold set in the environment: these tests start from glibc's."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)


def mb_retained(threshold: str) -> float:
    result = run_script([sys.executable, str(HELPER), threshold], timeout=120)
    assert result.returncode == 0, result.stderr
    return float(result.stdout)


def test_a_cpu_process_returns_freed_large_tensors_to_the_system_once_the_threshold_is_fixed():
    assert mb_retained("default") > 250  # what training on CPU processes kept, step after step, before
    assert mb_retained("fixed") < 40


def test_every_rank_of_a_cpu_run_returns_freed_large_tensors(tiny, tmp_path: Path):
    """The launching process and the rank it starts, under fsdp2 whose per-parameter buffers needed it."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(REPORT_AT_EXIT)
    args = train_args(tiny, tmp_path / "out", strategy="fsdp2", max_step=2, warmup_steps=1, save_step_interval=100,
                      eval_step_interval=100)
    result = run_train(args, env={"PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 0, result.stderr[-3000:]
    retained = [float(mb) for mb in re.findall(r"retained after freeing: (\d+) MB", result.stderr)]
    assert len(retained) == 2 and max(retained) < 40, result.stderr[-3000:]


def test_a_threshold_the_user_set_is_kept(monkeypatch):
    from app.host_memory import map_large_cpu_tensors

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert not map_large_cpu_tensors()
