"""Per-rank data order and evaluation batches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from app.data.order import StepBatches, epoch_permutation, eval_plan, step_rows
from app.optimization.schedule import make_plan
from tests.conftest import ROOT


def plan_for(world_size: int, micro_batch_size: int, accumulation: int, train_rows: int = 100):
    return make_plan(train_rows=train_rows, block_size=8, world_size=world_size, micro_batch_size=micro_batch_size,
                     accumulation=accumulation, number_epochs=1, max_step=None)


def rank_micro_batches(order: list[int], plan, *, rank: int, position: int) -> list[list[int]]:
    """The micro-batches the loader's sampler gives `rank` for every whole step from sample `position` on."""
    return list(StepBatches(step_rows(order, plan, position), plan, rank=rank))


def steps(plan, *, epoch: int = 0, position: int = 0, seed: int = 5) -> list[set[int]]:
    """The samples of each optimizer step, over all ranks and micro-batches."""
    order = epoch_permutation(plan.train_rows, seed=seed, epoch=epoch)
    per_rank = [rank_micro_batches(order, plan, rank=r, position=position) for r in range(plan.world_size)]
    return [{row for rank in per_rank for batch in rank[i:i + plan.accumulation] for row in batch}
            for i in range(0, len(per_rank[0]), plan.accumulation)]


def test_a_step_takes_the_next_global_batch_of_the_epoch_order_split_over_ranks_and_micro_batches() -> None:
    plan = plan_for(world_size=3, micro_batch_size=2, accumulation=2)
    order = epoch_permutation(100, seed=5, epoch=0)
    assert steps(plan) == [set(order[i:i + 12]) for i in range(0, 96, 12)], "8 whole steps, the tail of 4 left out"
    rank_batches = [rank_micro_batches(order, plan, rank=r, position=0)[0] for r in range(3)]
    assert all(len(batch) == 2 for batch in rank_batches) and len({*sum(rank_batches, [])}) == 6
    assert epoch_permutation(100, seed=5, epoch=1) != order, "a new order every epoch"


def test_every_layout_of_the_same_global_batch_trains_on_the_same_samples_step_by_step() -> None:
    """2 ranks x 4 x 2 accumulation, 4 ranks x 2 x 2, 1 rank x 4 x 4: 16 sequences per step, the same ones."""
    layouts = [plan_for(2, 4, 2), plan_for(4, 2, 2), plan_for(1, 4, 4), plan_for(2, 2, 4)]
    assert len({plan.global_batch_size for plan in layouts}) == 1
    reference = steps(layouts[0])
    assert all(steps(plan) == reference for plan in layouts)


def test_resume_at_a_sample_continues_the_same_order_whatever_the_layout() -> None:
    straight = steps(plan_for(2, 4, 2), epoch=3)
    for plan in (plan_for(2, 4, 2), plan_for(4, 2, 2), plan_for(1, 4, 4)):
        assert steps(plan, epoch=3, position=32) == straight[2:]


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
            return {"input_ids": torch.tensor([index, index]), "trained_tokens": torch.tensor(1)}
'''

FIRST_BATCH_OF_WORKERS = '''
import numpy as np
import torch
from app.data import DataFormat, TrainingData, train_steps
from app.optimization.schedule import make_plan


class OneRank:
    """What train_steps uses of Fabric."""
    global_rank = 0
    device = torch.device("cpu")

    def setup_dataloaders(self, loader, **options):
        return loader


def first_batch(rows):
    """The first micro-batch that 2 worker processes load from `rows` (64 of them)."""
    plan = make_plan(train_rows=64, block_size=1, world_size=1, micro_batch_size=4, accumulation=1, number_epochs=1,
                     max_step=None)
    data = TrainingData(DataFormat("text", 0), rows, None, np.ones(64, dtype=np.int64))
    steps = train_steps(OneRank(), data, plan, seed=0, epoch=0, position=0, num_workers=2)
    return next(iter(next(steps).micro_batches)).inputs["input_ids"]
'''

FIRST_BATCH_WHILE_ANOTHER_THREAD_HOLDS_THE_LOCK = FIRST_BATCH_OF_WORKERS + '''
import threading
from locked_rows import LOCK, LockedRows

held, release = threading.Event(), threading.Event()


def hold_the_lock():
    with LOCK:
        held.set()
        release.wait()


threading.Thread(target=hold_the_lock, daemon=True).start()
held.wait()
first = first_batch(LockedRows())  # the workers start now, while the other thread holds the lock
release.set()
print("first batch", first.flatten().tolist())
'''

MODULES_IN_THE_WORKER = '''
import sys

import torch


class ModulesInTheWorker:
    """Rows that tell which modules of the training stack the worker reading them has imported."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        imported = [name in sys.modules for name in ("lightning_fabric", "transformers", "torch._dynamo")]
        return {"input_ids": torch.tensor(imported, dtype=torch.long), "trained_tokens": torch.tensor(1)}
'''

FIRST_BATCH_OF_MODULES_IN_THE_WORKER = FIRST_BATCH_OF_WORKERS + '''
from modules_in_the_worker import ModulesInTheWorker

print("heavy modules imported", first_batch(ModulesInTheWorker()).sum().item())
'''


def run_probe(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`script` in a new session (its workers included), with tmp_path's modules importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # a hung worker included
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_workers_do_not_inherit_a_lock_another_thread_of_the_rank_held_when_they_started(tmp_path: Path) -> None:
    """The start-up hang, made deterministic: a worker forked while another thread of the rank (gloo's, OpenMP's,
    tqdm's) holds a lock inherits that lock held for ever, and hangs as soon as it needs it."""
    (tmp_path / "locked_rows.py").write_text(LOCKED_ROWS)
    result = run_probe(FIRST_BATCH_WHILE_ANOTHER_THREAD_HOLDS_THE_LOCK, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "first batch" in result.stdout


def test_workers_start_without_importing_the_training_stack(tmp_path: Path) -> None:
    """The forkserver imports all that a worker unpickles (app.data) once. When app.data pulled in Lightning and
    transformers, every worker imported them again: 5 s before a rank's first batch here, at every epoch."""
    (tmp_path / "modules_in_the_worker.py").write_text(MODULES_IN_THE_WORKER)
    result = run_probe(FIRST_BATCH_OF_MODULES_IN_THE_WORKER, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "heavy modules imported 0" in result.stdout, result.stdout


def eight_rows_on_one_rank():
    """Eight text rows of 5 tokens (row i holds token i) as train and validation, and what train_steps uses of
    Fabric on one CPU rank."""
    import torch
    from datasets import Dataset

    from app.data import DataFormat, TrainingData
    from app.data.formats import with_trained_tokens

    class OneRank:
        global_rank, device = 0, torch.device("cpu")

        def setup_dataloaders(self, loader, **options):
            return loader

    text = DataFormat("text", 0)
    split, counts = with_trained_tokens(Dataset.from_dict({"input_ids": [[row] * 5 for row in range(8)]}), text)
    return TrainingData(text, split, split, counts), OneRank()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_starting_the_steps_draws_nothing_from_torchs_generator_which_a_resume_restored(num_workers) -> None:
    """A DataLoader without a generator draws its workers' base seed from torch's global generator as it starts: a
    resumed run restored that generator just before, so every dropout mask after a resume differed from the
    straight run's (T5 and BART train with dropout)."""
    import torch

    from app.data import train_steps

    data, rank = eight_rows_on_one_rank()
    plan = make_plan(train_rows=8, block_size=5, world_size=1, micro_batch_size=4, accumulation=1, number_epochs=1,
                     max_step=None)
    before = torch.get_rng_state()
    next(train_steps(rank, data, plan, seed=0, epoch=0, position=0, num_workers=num_workers))
    assert torch.equal(torch.get_rng_state(), before)


def test_rows_set_aside_keep_their_place_in_the_order_but_train_no_token() -> None:
    from app.data import train_steps

    data, rank = eight_rows_on_one_rank()
    data.quarantine([3, 5])
    plan = make_plan(train_rows=8, block_size=5, world_size=1, micro_batch_size=8, accumulation=1, number_epochs=1,
                     max_step=None)
    step = next(train_steps(rank, data, plan, seed=0, epoch=0, position=0, num_workers=0))
    batch, = step.micro_batches
    inputs = batch.inputs
    assert inputs["input_ids"][:, 0].tolist() == step.rows, "every row in its place"
    assert [bool((labels == -100).all()) for labels in inputs["labels"]] == [row in (3, 5) for row in step.rows]
    assert step.trained_tokens == batch.trained_tokens == 6 * 4
    assert data.row_batch(3).trained_tokens == 0 and data.row_batch(4).trained_tokens == 4


def test_a_batch_is_pinned_whole_where_the_loader_pins_memory(monkeypatch) -> None:
    """The DataLoader's pin_memory=True (on GPUs) pins what it knows, or what has a pin_memory() method: a Batch had
    none and went to the GPU from pageable memory, its tensors never pinned (CPU torch cannot pin: recorded here)."""
    import torch
    from torch.utils.data._utils.pin_memory import pin_memory

    from app.data import Batch

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor, *_, **__: (pinned.append(tensor), tensor)[1])
    batch = Batch({"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}, 9)
    moved = pin_memory(batch)
    assert isinstance(moved, Batch) and moved.trained_tokens == 9 and moved.inputs.keys() == batch.inputs.keys()
    assert [id(tensor) for tensor in pinned] == [id(tensor) for tensor in batch.inputs.values()]


def test_a_steps_micro_batches_are_read_as_the_step_runs_them() -> None:
    """All of a step's micro-batches were read (collated, copied to the device) before its first forward: a GPU
    stood idle while the host read 32 of them. Each is now read when the step comes to it, its wait measured."""
    from contextlib import contextmanager

    from app.data.loader import MicroBatches

    read, measured = [], []

    def loader():
        for number in range(10):
            read.append(number)
            yield number

    @contextmanager
    def reading():
        measured.append(len(read))
        yield

    source = loader()
    first, second = MicroBatches(source, 3, reading), MicroBatches(source, 3, reading)
    assert len(first) == 3 and read == []
    batches = iter(first)
    assert next(batches) == 0 and read == [0]
    assert list(batches) == [1, 2] and list(second) == [3, 4, 5] and measured == [0, 1, 2, 3, 4, 5]
