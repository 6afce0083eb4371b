"""Per-rank data order and evaluation batches."""

from __future__ import annotations

from app.data import EpochBatches, epoch_order, eval_plan
from app.schedule import make_plan


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
