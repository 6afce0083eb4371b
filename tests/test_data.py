"""Per-rank data order, evaluation batches, and how data loader workers start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from app.data import EpochBatches, epoch_order, eval_plan
from app.schedule import make_plan
from tests.conftest import ROOT


def test_ranks_read_disjoint_rows_and_the_order_changes_every_epoch() -> None:
    orders = [epoch_order(103, seed=1, epoch=0, rank=r, world_size=3) for r in range(3)]
    assert not set(orders[0]) & set(orders[1]) and not set(orders[1]) & set(orders[2])
    assert sorted(sum(orders, [])) == list(range(103))
    assert epoch_order(103, seed=1, epoch=1, rank=0, world_size=3) != orders[0]
    assert epoch_order(103, seed=1, epoch=0, rank=0, world_size=3) == orders[0]


def test_resume_skips_batches_by_index_and_continues_identically() -> None:
    plan = make_plan(train_rows=100, block_size=8, world_size=2, micro_batch_size=3, accumulation=2,
                     number_epochs=1, max_step=None)
    full = list(EpochBatches(100, plan, seed=5, epoch=2, rank=1))
    assert len(full) == plan.micro_batches_per_epoch == 16
    assert list(EpochBatches(100, plan, seed=5, epoch=2, rank=1, skip=6)) == full[6:]


def test_evaluation_gives_every_rank_the_same_number_of_batches_and_covers_each_row_once() -> None:
    plans = [eval_plan(9, batch_size=2, rank=r, world_size=3, max_batches=100) for r in range(3)]
    assert {len(p) for p in plans} == {2}
    real = [row for plan in plans for batch in plan for row in batch.rows[:batch.real_rows]]
    assert sorted(real) == list(range(9))
    assert all(len(batch.rows) == 2 for plan in plans for batch in plan)
    assert plans[2][1].real_rows == 0  # the third rank runs a padding batch instead of waiting


def test_eval_iters_caps_the_batches() -> None:
    assert len(eval_plan(1000, batch_size=4, rank=0, world_size=2, max_batches=3)) == 3


LOCKED_ROWS = '''
import threading

import torch

LOCK = threading.Lock()


class LockedRows:
    """Rows that need LOCK, as reading rows may need a lock that the rank's other threads also take."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        with LOCK:
            return {"input_ids": torch.tensor([index])}
'''

FIRST_BATCH_WHILE_ANOTHER_THREAD_HOLDS_THE_LOCK = '''
import sys, threading
import torch
from locked_rows import LOCK, LockedRows
from app.data import train_batches
from app.schedule import make_plan


class OneRank:
    """What train_batches uses of Fabric."""
    global_rank = 0
    device = torch.device("cpu")

    def setup_dataloaders(self, loader, **options):
        return loader


held, release = threading.Event(), threading.Event()


def hold_the_lock():
    with LOCK:
        held.set()
        release.wait()


threading.Thread(target=hold_the_lock, daemon=True).start()
held.wait()
plan = make_plan(train_rows=64, block_size=1, world_size=1, micro_batch_size=4, accumulation=1, number_epochs=1,
                 max_step=None)
batches = train_batches(OneRank(), LockedRows(), plan, seed=0, epoch=0, position=0, num_workers=2)
first = next(batches)  # the workers start now, while the other thread holds the lock
release.set()
print("first batch", first.flatten().tolist())
'''


@pytest.mark.slow
def test_workers_do_not_inherit_a_lock_another_thread_of_the_rank_held_when_they_started(tmp_path: Path) -> None:
    """The start-up hang, made deterministic: a worker forked while another thread of the rank (gloo's, OpenMP's,
    tqdm's) holds a lock inherits that lock held for ever, and hangs as soon as it needs it."""
    (tmp_path / "locked_rows.py").write_text(LOCKED_ROWS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    process = subprocess.Popen([sys.executable, "-c", FIRST_BATCH_WHILE_ANOTHER_THREAD_HOLDS_THE_LOCK], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # a hung worker included
    assert process.returncode == 0, stderr
    assert "first batch" in stdout
