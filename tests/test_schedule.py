"""LR schedule, accumulation arithmetic and steps per epoch: pure functions, tested at their edges."""

from __future__ import annotations

import math

import pytest

from app.optimization.schedule import (accumulation_steps, continuing_position, interval_steps, learning_rate,
                                      make_plan, steps_for_tokens, steps_to_finish, tokens_read)


def lr_at(step: int, **overrides: object) -> float:
    options = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_step=110, lr_decay=True) | overrides
    return learning_rate(step, **options)


def test_an_interval_below_one_is_that_share_of_the_runs_steps() -> None:
    assert [interval_steps(0.05, 1000), interval_steps(0.05, 1010), interval_steps(0.1, 25)] == [50, 51, 3], (
        "rounded up, as the Hugging Face Trainer rounds them")
    assert interval_steps(0.001, 100) == 1
    assert interval_steps(1, 100) == interval_steps(1.0, 100) == 1, "a whole step, not the whole run"
    assert [interval_steps(0, 100), interval_steps(500, 100), interval_steps(2000.0, 10)] == [0, 500, 2000]
    assert isinstance(interval_steps(2000.0, 10), int)


def test_warmup_is_linear_from_zero_to_lr() -> None:
    assert lr_at(0) == 0.0
    assert lr_at(5) == pytest.approx(0.5)
    assert lr_at(10) == 1.0


def test_cosine_decay_reaches_min_lr_at_max_step_and_stays_there() -> None:
    assert lr_at(60) == pytest.approx(0.1 + 0.5 * 0.9)  # half way through the decay
    assert lr_at(110) == pytest.approx(0.1)
    assert lr_at(500) == pytest.approx(0.1)
    values = [lr_at(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_no_warmup_starts_at_lr() -> None:
    assert lr_at(1, warmup_steps=0) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 110)))
    assert lr_at(0, warmup_steps=0) == 1.0


def test_warmup_equal_to_max_step_ends_at_lr_then_min_lr() -> None:
    assert lr_at(110, warmup_steps=110) == 1.0
    assert lr_at(111, warmup_steps=110) == pytest.approx(0.1)


def test_constant_after_warmup_without_decay() -> None:
    assert [lr_at(s, lr_decay=False) for s in (10, 50, 110, 1000)] == [1.0] * 4


def test_the_decay_takes_its_share_of_the_steps_at_the_end_in_its_shape() -> None:
    """Warmup-stable-decay: --lr_decay_ratio 0.2 holds lr until the last fifth of the run (step 88 of 110), then
    decays to min_lr at max_step; 1 is the decay from the end of warmup on, as before the option."""
    assert [lr_at(s, lr_decay_ratio=0.2) for s in (10, 50, 88)] == [1.0] * 3
    assert lr_at(99, lr_decay_ratio=0.2) == pytest.approx(0.1 + 0.5 * 0.9)  # half way through its cosine
    assert lr_at(110, lr_decay_ratio=0.2) == pytest.approx(0.1)
    assert lr_at(99, lr_decay_ratio=0.2, lr_decay_type="linear") == pytest.approx(0.55)
    assert lr_at(99, lr_decay_ratio=0.2, lr_decay_type="sqrt") == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)))
    assert [lr_at(s, lr_decay_ratio=1.0) for s in (5, 60, 100)] == [lr_at(s) for s in (5, 60, 100)]
    assert lr_at(60, lr_decay_type="linear") == pytest.approx(0.55), "after a warmup of 10, half way at step 60"
    assert lr_at(20, lr_decay_ratio=0.99) == lr_at(20), "the decay never begins before the warmup ends"
    for shape in ("cosine", "linear", "sqrt"):
        values = [lr_at(s, lr_decay_ratio=0.3, lr_decay_type=shape) for s in range(10, 111)]
        assert all(a >= b for a, b in zip(values, values[1:])) and values[-1] == pytest.approx(0.1), shape


def test_a_resume_that_lengthens_a_stable_run_decays_from_where_it_stands() -> None:
    """A run trained at a constant rate to step 12 (--lr_decay false), resumed with --max_step 16 and
    --lr_decay_ratio 0.25, anneals over its last 4 steps: from lr at step 12 down to min_lr, without a jump."""
    constant = [lr_at(s, warmup_steps=0, lr_decay=False, max_step=12) for s in range(1, 13)]
    annealed = [lr_at(s, warmup_steps=0, lr_decay_ratio=0.25, max_step=16) for s in range(13, 17)]
    assert constant == [1.0] * 12 and lr_at(12, warmup_steps=0, lr_decay_ratio=0.25, max_step=16) == 1.0
    assert annealed[0] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4))) and annealed[-1] == 0.1


def test_print_config_says_where_the_decay_begins_in_this_runs_steps() -> None:
    """After a resume at another global batch the schedule's steps are the checkpoint's: the start of the decay was
    said in them (step 40 of 80 for this run's step 60), or, begun before the resume, as a negative step."""
    from types import SimpleNamespace

    from app.optimization.schedule import TrainingPlan
    from app.training.print_config import learning_rate_line

    plan = TrainingPlan(world_size=1, micro_batch_size=4, accumulation=1, train_rows=100, max_step=120, block_size=32,
                        row_tokens=32, resumed_schedule=(40, 40, 80))  # 40 schedule steps left over 80 of this run
    cfg = SimpleNamespace(lr=2e-5, warmup_steps=2, lr_decay=True, lr_decay_ratio=0.25, lr_decay_type="linear",
                          min_lr=2e-6)
    assert learning_rate_line(cfg, plan) == ("2e-05 after 2 warmup steps, then constant until step 80, then linear "
                                             "decay to 2e-06 at step 120")
    assert learning_rate_line(SimpleNamespace(**vars(cfg) | {"lr_decay_ratio": 0.9}), plan) == (
        "2e-05 after 2 warmup steps, then (decaying since before step 40) linear decay to 2e-06 at step 120")


def test_accumulation_from_global_batch_size() -> None:
    assert accumulation_steps(world_size=4, micro_batch_size=2, gradient_accumulation_steps=None,
                              global_batch_size=64) == 8
    assert accumulation_steps(world_size=4, micro_batch_size=2, gradient_accumulation_steps=None,
                              global_batch_size=None) == 1
    assert accumulation_steps(world_size=4, micro_batch_size=2, gradient_accumulation_steps=3,
                              global_batch_size=None) == 3


def test_accumulation_that_does_not_divide_names_the_flags() -> None:
    with pytest.raises(ValueError, match="--global_batch_size 60 is not a multiple"):
        accumulation_steps(world_size=4, micro_batch_size=2, gradient_accumulation_steps=None, global_batch_size=60)
    with pytest.raises(ValueError, match="contradicts --global_batch_size"):
        accumulation_steps(world_size=4, micro_batch_size=2, gradient_accumulation_steps=4, global_batch_size=64)


def test_plan_derives_max_step_from_epochs_and_drops_the_partial_step() -> None:
    plan = make_plan(train_rows=1000, block_size=128, world_size=2, micro_batch_size=4, accumulation=3,
                     number_epochs=2, max_step=None)
    assert plan.steps_per_epoch == 1000 // 2 // 4 // 3 == 41
    assert plan.global_batch_size == 24 and plan.train_rows - 41 * 24 == 16, "the partial step left out"
    assert plan.max_step == 82
    assert plan.global_batch_size == 24 and plan.tokens_per_step == 24 * 128
    assert make_plan(train_rows=1000, block_size=128, world_size=2, micro_batch_size=4, accumulation=3,
                     number_epochs=2, max_step=7).max_step == 7


def test_the_rows_an_epoch_leaves_out_are_said_when_they_are_5_percent_or_more(capsys) -> None:
    """49 chats at 32 a step: one step an epoch, 17 rows (35%) never trained in a one-epoch run, without a word."""
    from app.training.preflight.plan import note_rows_left_out

    def said(train_rows: int, global_batch: int, mixture: bool = False) -> str:
        note_rows_left_out(make_plan(train_rows=train_rows, block_size=8, world_size=1, micro_batch_size=global_batch,
                                     accumulation=1, number_epochs=1, max_step=None), mixture)
        return capsys.readouterr().out.strip()

    assert said(49, 32) == ("each epoch trains 32 of its 49 rows: the other 17 (35%) fill no whole step of 32 "
                            "sequences (other rows each epoch); a global batch that divides 49 trains them all")
    assert said(647, 16) == "", "7 rows (1%) are not worth a line"
    assert said(64, 16) == ""
    assert said(4074, 256, mixture=True) == (  # a mixture's epoch is not cut: the next one reads on
        "each epoch of the mixture counts 15 whole steps of 256 sequences, 3,840 of its 4,074 rows: the other 234 (6%) "
        "are read at the next epoch's start, and a run that ends with its epochs ends 234 rows per epoch short of "
        "them; a global batch that divides 4,074 trains them all")


def test_a_resume_at_another_global_batch_counts_the_steps_left_from_its_samples() -> None:
    """A 1-epoch run of 64 rows at 8 a step, saved at step 4 (sample 32): at 16 a step, 2 steps are left (it ended at
    once, at step 8 = 64 // 16 x 1 epoch, with half the epoch untrained); at 4 a step, 8 (it trained past the epoch)."""
    def plan(global_batch: int):
        return make_plan(train_rows=64, block_size=8, world_size=1, micro_batch_size=global_batch, accumulation=1,
                         number_epochs=1, max_step=None)

    assert steps_to_finish(plan(8), epoch=0, position=32, number_epochs=1) == 4, "the same batch: as planned"
    assert steps_to_finish(plan(16), epoch=0, position=32, number_epochs=1) == 2
    assert steps_to_finish(plan(4), epoch=0, position=32, number_epochs=1) == 8
    assert steps_to_finish(plan(16), epoch=0, position=32, number_epochs=3) == 2 + 2 * 4
    assert steps_to_finish(plan(8), epoch=1, position=0, number_epochs=1) == 0


def test_a_resume_whose_epoch_has_no_whole_step_left_reads_on_from_the_next_epoch() -> None:
    """The data order skips an epoch's tail that does not fill a step; the saved position must too, or every later
    position (and resume) stays a step behind the rows read, which are then read again."""
    plan = make_plan(train_rows=64, block_size=8, world_size=1, micro_batch_size=32, accumulation=1,
                     number_epochs=3, max_step=None)
    assert continuing_position(0, 48, plan) == (1, 0), "16 rows left, fewer than the new step's 32"
    assert continuing_position(0, 32, plan) == (0, 32)
    assert steps_to_finish(plan, epoch=0, position=48, number_epochs=3) == 2 * 2


def test_plan_refuses_data_smaller_than_one_step() -> None:
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        make_plan(train_rows=10, block_size=8, world_size=2, micro_batch_size=4, accumulation=2,
                  number_epochs=1, max_step=None)


def test_learning_rate_scales_with_the_global_batch_as_seed_003_computes_it() -> None:
    from app.optimization.schedule import scale_for_batch

    assert scale_for_batch(1e-5, rule="sqrt", global_batch_size=28, reference_batch_size=10) == pytest.approx(1.673e-5,
                                                                                                           rel=1e-3)
    assert scale_for_batch(1e-5, rule="sqrt", global_batch_size=40, reference_batch_size=10) == pytest.approx(2e-5)
    assert scale_for_batch(1e-5, rule="linear", global_batch_size=40, reference_batch_size=10) == pytest.approx(4e-5)
    assert scale_for_batch(1e-5, rule="none", global_batch_size=40, reference_batch_size=None) == 1e-5


def test_a_resume_at_another_global_batch_finishes_the_checkpoints_schedule_without_a_jump() -> None:
    """647 rows, 2 epochs at 16 a step (80 steps), saved at step 40 and resumed at 32 a step (20 steps left): the
    rate was recounted over 60 steps and fell 45% at once; now each resumed step moves the schedule by two of the
    checkpoint's steps, as it trains two steps' data, and reaches --min_lr at the run's last step. A later resume
    of that run continues the same way; one at the checkpoint's own batch counts in steps as before. Given one more
    epoch as well, the schedule was recounted to the new end from the checkpoint's step count: half-way after a
    third of the data."""
    from types import SimpleNamespace

    from app.training.preflight.plan import plan_from_checkpoint

    def plan(global_batch_size: int):
        return make_plan(train_rows=647, block_size=32, world_size=1, micro_batch_size=global_batch_size,
                         accumulation=1, number_epochs=2, max_step=None)

    cfg = SimpleNamespace(max_step=None, max_tokens=None, number_epochs=2)
    saved = {"step": 40, "epoch": 1, "position": 0, "global_batch_size": 16,
             "config": {"max_step": None, "number_epochs": 2}}
    straight = dict(lr=3e-3, min_lr=3e-4, warmup_steps=0, max_step=80)
    resumed = plan_from_checkpoint(cfg, saved, plan(32))
    assert resumed.max_step == 60
    lr = [learning_rate(resumed.schedule_step(step), lr=3e-3, min_lr=3e-4, warmup_steps=0,
                        max_step=resumed.schedule_length) for step in range(41, 61)]
    assert learning_rate(40, **straight) == pytest.approx(1.65e-3)
    assert learning_rate(41, **straight | {"max_step": 60}) == pytest.approx(0.92e-3, abs=1e-5), "recounted: 45% down"
    assert lr[0] == pytest.approx(learning_rate(42, **straight)) and lr[-1] == pytest.approx(3e-4)
    assert all(a > b for a, b in zip(lr, lr[1:]))
    again = plan_from_checkpoint(cfg, saved | {"step": 50, "epoch": 1, "position": 320, "global_batch_size": 32,
                                                     "schedule": {"step": 60, "length": 80}}, plan(32))
    assert again.schedule_step(51) == pytest.approx(62) and again.schedule_step(60) == pytest.approx(80)
    assert [again.run_step(again.schedule_step(step)) for step in (51, 55, 60)] == pytest.approx([51, 55, 60]), (
        "where a stretch of the schedule begins, in this run's steps (--print_config's decay)")
    same = plan_from_checkpoint(cfg, saved, plan(16))
    assert same.resumed_schedule is None and same.schedule_step(41) == 41 and same.schedule_length == 80
    three_epochs = SimpleNamespace(max_step=None, max_tokens=None, number_epochs=3)
    longer = plan_from_checkpoint(three_epochs, saved, plan(16))
    assert longer.resumed_schedule is None and longer.max_step == 120, "more epochs: the schedule's new end"
    longer_and_larger = plan_from_checkpoint(three_epochs, saved, plan(32))
    assert longer_and_larger.max_step == 80
    assert longer_and_larger.schedule_step(40) == 20 and longer_and_larger.schedule_length == 60, \
        "one epoch of three trained: a third of the way, not at step 40 of 80"
    assert longer_and_larger.schedule_step(80) == 60


def test_a_mixture_resumed_at_another_global_batch_counts_the_steps_left_from_its_position() -> None:
    """A mixture's epoch of 1,600 rows at 16 a step, saved at step 50: resumed at 32 a step it ended at once at step 50
    (its step count recounted from the start), at 8 a step it trained 1.25 epochs; like a single folder's now."""
    from types import SimpleNamespace

    from app.training.preflight.plan import plan_from_checkpoint

    def plan(global_batch_size: int):
        return make_plan(train_rows=1600, block_size=32, world_size=1, micro_batch_size=global_batch_size,
                         accumulation=1, number_epochs=1, max_step=None)

    saved = {"step": 50, "epoch": 0, "position": 800, "global_batch_size": 16,
             "config": {"max_step": None, "number_epochs": 1, "train_data_dir": "a:3,b:1"}}
    cfg = SimpleNamespace(max_step=None, max_tokens=None, number_epochs=1)
    assert plan_from_checkpoint(cfg, saved, plan(32)).max_step == 75
    assert plan_from_checkpoint(cfg, saved, plan(8)).max_step == 150


def test_a_mixture_resumed_with_another_weight_for_its_first_folder_needs_max_step() -> None:
    """Its epochs are passes over the first folder in rows of the mixture at that folder's weight: 75% -> 50% made
    the resumed run read that folder 1.3 times for one epoch, its learning rate jumping from 0.09 to 0.49."""
    from types import SimpleNamespace

    from app.data.mixture import parse_sources
    from app.training.preflight.plan import changed_epochs

    saved = {"config": {"train_data_dir": "a:3,b:1"}}
    problems: list[str] = []
    for spec, max_step, max_tokens in (("a:3,b:1", None, None), ("a:0.75,b:0.1,c:0.15", None, None),
                                       ("a:1,b:1", 200, None), ("a:1,b:1", None, 10**6)):
        assert not changed_epochs(SimpleNamespace(max_step=max_step, max_tokens=max_tokens),
                                  SimpleNamespace(sources=parse_sources(spec)), saved, problems)
    assert changed_epochs(SimpleNamespace(max_step=None, max_tokens=None),
                          SimpleNamespace(sources=parse_sources("a:1,b:1")), saved, problems)
    assert problems == ["--train_data_dir: the first folder (a) was 75.0% of every step and is 50.0% at this resume, "
                        "and --number_epochs counts passes over it at the checkpoint's share; give --max_step or "
                        "--max_tokens to say where the resumed run ends"]


def test_a_resume_that_reads_other_validation_rows_says_so_and_how_to_read_the_same(capsys) -> None:
    """--eval_iters counts batches per rank: 100 batches of 4 on 8 ranks read 3,200 rows, on 4 ranks 1,600; the
    val_loss curve moved at the resume, and best.json compared losses of other rows, without a word (it now starts a
    new comparison: tests/test_reliability.py -k measured_on_other_rows)."""
    from types import SimpleNamespace

    from app.training.preflight.plan import note_validation_rows

    saved = {"config": {"eval_iters": 100, "eval_batch_size": None, "micro_batch_size": 4}, "rng": [None] * 8}
    cfg, plan = SimpleNamespace(eval_iters=100, eval_batch_size=None, micro_batch_size=4), SimpleNamespace(world_size=4)
    for validation_rows in (10_000, 2_000, 1_000):
        note_validation_rows(cfg, SimpleNamespace(validation_rows=validation_rows, sources=None), saved, plan)
    folders = SimpleNamespace(validation_rows=10_000, sources=["a", "b"],
                              identities=[{"validation_rows": 6_000}, {"validation_rows": 4_000}])
    note_validation_rows(cfg, folders, saved, plan)
    small = SimpleNamespace(validation_rows=2_500, sources=["a", "b"],
                            identities=[{"validation_rows": 1_300}, {"validation_rows": 1_200}])
    note_validation_rows(cfg, small, saved, plan)  # each read whole, before and now: their sum passes 1,600
    assert capsys.readouterr().out.splitlines() == [
        "--resume: validation reads 1,600 rows (100 batches of 4 on each of 4 ranks), the checkpoint's run read "
        "3,200: val_loss moves at this resume for that alone, and best.json and --early_stopping_patience start a new "
        "comparison (the losses of the other rows do not compare); --eval_iters 200 reads the same rows",
        "--resume: validation reads 1,600 rows (100 batches of 4 on each of 4 ranks), the checkpoint's run read "
        "2,000: val_loss moves at this resume for that alone, and best.json and --early_stopping_patience start a new "
        "comparison (the losses of the other rows do not compare); --eval_iters 125 reads the same rows",
        "--resume: validation reads up to 1,600 rows of each folder (100 batches of 4 on each of 4 ranks), the "
        "checkpoint's run read 3,200: val_loss moves at this resume for that alone, and best.json and "
        "--early_stopping_patience start a new comparison (the losses of the other rows do not compare); "
        "--eval_iters 200 reads the same rows"], (
        "1,000 rows, and two folders of 1,300 and 1,200: all of them, before and now")


def test_a_validation_split_read_in_part_is_said_with_its_count(capsys) -> None:
    """--eval_iters counts batches per rank (100 by default): 200 of 299 validation rows were read, and val_loss was
    taken for the split's, unsaid."""
    from types import SimpleNamespace

    from app.training.preflight.plan import note_validation_share

    plan = make_plan(train_rows=64, block_size=8, world_size=2, micro_batch_size=1, accumulation=1, number_epochs=1,
                     max_step=None)
    cfg = SimpleNamespace(eval_iters=100, eval_batch_size=None, micro_batch_size=1)

    def said(validation_rows: int, folders: list[int] = (), evaluated: dict[str, int] = {}) -> str:
        note_validation_share(cfg, SimpleNamespace(validation_rows=validation_rows, sources=folders or None,
                                                   identities=[{"validation_rows": rows} for rows in folders],
                                                   evaluated_rows=evaluated), plan)
        return capsys.readouterr().out.strip()

    assert said(299) == ("validation reads 200 of its 299 rows at each evaluation (--eval_iters 100 batches of 1 on "
                         "each of 2 ranks), the same rows each time; raise --eval_iters to read more")
    assert said(200) == ""
    assert said(900, [600, 300]).startswith("validation reads up to 200 rows of each folder of the mixture")
    assert said(450, [150, 150, 150]) == "", "each folder is read whole"
    assert said(200, evaluated={"code": 200, "chat": 5000}) == (
        "validation reads 200 of --eval_data_dir chat's 5,000 at each evaluation (--eval_iters 100 batches of 1 on "
        "each of 2 ranks), the same rows each time; raise --eval_iters to read more"), "an evaluated folder is too"
    assert said(299, evaluated={"code": 300}).startswith(
        "validation reads 200 of its 299 rows and 200 of --eval_data_dir code's 300 at each evaluation")


def test_a_token_budget_counts_its_steps_at_each_global_batch_and_another_budget_recounts_the_schedule() -> None:
    """--max_tokens 10,240 at 8 rows of 32 tokens a step (256) is 40 steps. Saved at step 10 (2,560 read) and resumed
    at 16 rows a step, 15 are left: for the same budget the checkpoint's schedule is finished over them (two of its
    steps each); for twice the budget it is recounted to the new end, where the tokens read stand (step 5 of 40 at
    this batch). A checkpoint written before the count is read as its steps at its own global batch."""
    from types import SimpleNamespace

    from app.training.preflight.plan import plan_from_token_budget

    def plan(global_batch_size: int):
        return make_plan(train_rows=647, block_size=32, world_size=1, micro_batch_size=global_batch_size,
                         accumulation=1, number_epochs=1, max_step=None)

    assert [steps_for_tokens(tokens, plan(8)) for tokens in (1, 256, 257, 10_240)] == [1, 1, 2, 40]
    saved = {"step": 10, "global_batch_size": 8, "tokens_read": 2_560, "schedule": {"step": 10, "length": 40},
             "config": {"max_tokens": 10_240}}
    budget = SimpleNamespace(max_tokens=10_240)
    same = plan_from_token_budget(budget, saved, plan(16))
    assert same.max_step == 25 and same.schedule_step(11) == 12 and same.schedule_step(25) == 40
    assert plan_from_token_budget(budget, saved, plan(8)).resumed_schedule is None, "the same batch: as planned"
    doubled = plan_from_token_budget(SimpleNamespace(max_tokens=20_480), saved, plan(16))
    assert doubled.max_step == 10 + 35 and doubled.resumed_schedule == (10, 5, 40)
    older = {key: value for key, value in saved.items() if key != "tokens_read"}
    assert tokens_read(older, plan(16)) == 2_560 and plan_from_token_budget(budget, older, plan(16)).max_step == 25
