"""The spike guard's decisions as pure functions: what a spike is, which rows explain it, when to roll back or stop."""

from __future__ import annotations

import json
import random

import pytest

from app.reliability.spikes import Spike, SpikeGuard, SpikeHistory, SpikeRules, culprits, outlier_limit, upper_limit


def loss_spike(limit: float) -> Spike:
    return Spike(step=41, loss=9.0, grad_norm=1.0, loss_limit=limit, grad_norm_limit=2.0)


def norm_spike(limit: float) -> Spike:
    return Spike(step=41, loss=3.0, grad_norm=9.0, loss_limit=limit, grad_norm_limit=2.0)


def noisy(count: int, centre: float, spread: float, seed: int = 0) -> list[float]:
    generator = random.Random(seed)
    return [generator.gauss(centre, spread) for _ in range(count)]


def warmed_guard(mode: str = "skip", **rules: object) -> SpikeGuard:
    guard = SpikeGuard(SpikeRules(mode=mode, warmup=20, window=50, **rules))
    for loss, norm in zip(noisy(40, 3.0, 0.05), noisy(40, 1.0, 0.1, seed=1)):
        guard.accept(loss, norm)
    return guard


def test_the_limit_follows_a_falling_loss_and_measures_its_noise_not_its_fall() -> None:
    falling = [6.0 - 0.1 * step + (0.02 if step % 2 else -0.02) for step in range(30)]
    limit = upper_limit(falling, z=6.0, floor=0.0)
    recent_median = sorted(falling[-10:])[4:6]
    assert sum(recent_median) / 2 < limit < sum(recent_median) / 2 + 6 * 0.14 * 1.05, (
        "the centre is the recent median; the noise comes from the step-to-step changes (0.06 and 0.14 here), "
        "not from the 3.0 the loss fell over the window")
    assert upper_limit([5.0] * 10, z=6.0, floor=0.01) == pytest.approx(5.0 + 6.0 * 0.05), "a plateau keeps a floor"


def test_an_outlier_is_the_median_plus_z_robust_deviations() -> None:
    assert outlier_limit([1.0, 2.0, 3.0, 4.0, 100.0], z=2.0, floor=0.0) == pytest.approx(3.0 + 2.0 * 1.4826 * 1.0)


def test_nothing_is_judged_while_warming_up_or_when_off() -> None:
    guard = SpikeGuard(SpikeRules(warmup=20, window=50))
    for loss in noisy(19, 3.0, 0.05):
        guard.accept(loss, 1.0)
    assert guard.judge(20, 50.0, 1.0) is None
    off = warmed_guard("off")
    assert off.judge(41, 50.0, 100.0) is None and off.history.losses == [] and off.metrics() == {}


def test_a_spike_is_a_loss_or_gradient_norm_far_above_recent_steps_and_only_above() -> None:
    guard = warmed_guard()
    assert guard.judge(41, 3.05, 1.1) is None, "ordinary noise"
    assert guard.judge(41, 1.0, 0.2) is None, "a loss falling fast is learning, not a spike"
    by_loss = guard.judge(41, 4.0, 1.0)
    assert by_loss is not None and by_loss.by_loss and "loss 4.0000 above" in by_loss.describe()
    assert guard.judge(41, 3.0, 5.0) is None, "the gradient norm is judged only when asked"
    by_norm = warmed_guard(grad_norm_z=6.0).judge(41, 3.0, 5.0)
    assert by_norm is not None and not by_norm.by_loss and "gradient norm 5 above" in by_norm.describe()


def test_spikes_that_rows_explain_are_skipped_however_many_and_unexplained_norm_spikes_escalate() -> None:
    """Spikes in the gradient norm alone were skipped however many: a norm that moved up for good left 37 steps in a
    row unapplied, and the run ended as finished without training."""
    guard = warmed_guard("rollback", grad_norm_z=6.0, incident_spikes=3, incident_steps=50, max_rollbacks=1)
    actions = [guard.respond(guard.judge(41 + i, 9.0, 1.0), explained=True) for i in range(10)]
    actions += [guard.respond(guard.judge(41 + i, 3.0, 9.0), explained=True) for i in range(10)]
    assert actions == ["skip"] * 20 and guard.history.skipped_steps == 20 and guard.history.recent_spikes == []
    assert [guard.respond(guard.judge(60 + i, 3.0, 9.0), explained=False) for i in range(3)] == [
        "skip", "skip", "rollback"]


def test_unexplained_spikes_that_repeat_roll_back_then_stop_when_no_rollback_is_left() -> None:
    guard = warmed_guard("rollback", incident_spikes=3, incident_steps=50, max_rollbacks=1)
    at_checkpoint = guard.history.to_dict()
    assert [guard.respond(guard.judge(step, 9.0, 1.0), explained=False) for step in (41, 60, 80)] == [
        "skip", "skip", "rollback"]
    assert guard.incident_began() == 41
    guard.rolled_back(32, at_checkpoint)
    assert guard.history.rollbacks == 1 and guard.history.recent_spikes == []
    assert [guard.respond(guard.judge(step, 9.0, 1.0), explained=False) for step in (41, 42, 43)] == [
        "skip", "skip", "stop"]


def test_spikes_further_apart_than_the_incident_window_do_not_add_up() -> None:
    guard = warmed_guard("skip", incident_spikes=2, incident_steps=10)
    assert [guard.respond(guard.judge(step, 9.0, 1.0), explained=False) for step in (41, 60, 80, 85)] == [
        "skip", "skip", "skip", "stop"], "under skip, an incident stops the run"


def test_detect_applies_every_step_and_counts() -> None:
    guard = warmed_guard("detect")
    assert guard.respond(guard.judge(41, 9.0, 1.0), explained=False) == "apply"
    assert guard.metrics() == {"spikes": 1, "skipped_steps": 0, "rollbacks": 0, "quarantined_rows": 0}
    assert not guard.sets_aside


def test_culprits_are_the_outlying_rows_without_which_the_step_is_no_spike() -> None:
    clean = [(row, 32 * loss, 32) for row, loss in enumerate(noisy(14, 3.0, 0.3))]
    poisoned = [(100, 32 * 6.5, 32), (101, 32 * 6.0, 32)]
    step_loss = sum(total for _, total, _ in clean + poisoned) / (32 * 16)
    assert step_loss > 3.3
    found = culprits(clean + poisoned, loss_spike(3.3), floor=0.01)
    assert [(row, round(mean, 2), tokens) for row, mean, tokens in found] == [(100, 6.5, 32), (101, 6.0, 32)]


def test_a_spike_in_the_gradient_norm_blames_the_rows_whose_loss_stands_out() -> None:
    clean = [(row, 32 * loss, 32) for row, loss in enumerate(noisy(14, 3.0, 0.3))]
    assert [row for row, *_ in culprits(clean + [(100, 32 * 6.0, 32)], norm_spike(4.0), floor=0.01)] == [100]
    assert culprits(clean, norm_spike(4.0), floor=0.01) == []


def test_a_whole_batch_gone_high_blames_no_row() -> None:
    high = [(row, 32 * loss, 32) for row, loss in enumerate(noisy(16, 6.0, 0.3))]
    assert culprits(high, loss_spike(3.3), floor=0.01) == [], "the model, not the data"
    assert culprits(high[:2], loss_spike(3.3), floor=0.01) == [], "too few rows to tell"


def test_rows_without_trained_tokens_are_never_blamed() -> None:
    clean = [(row, 32 * loss, 32) for row, loss in enumerate(noisy(14, 3.0, 0.3))]
    found = culprits(clean + [(100, 32 * 7.0, 32), (101, 0.0, 0)], loss_spike(3.2), floor=0.01)
    assert [row for row, *_ in found] == [100]


def test_the_history_survives_a_checkpoint_as_json_and_a_rollback_keeps_the_quarantine() -> None:
    guard = warmed_guard("rollback", rewarm_steps=10)
    guard.set_aside(41, [(7, 6.5, 32)])
    saved = json.loads(json.dumps(guard.history.to_dict()))
    assert SpikeHistory.from_dict(saved) == guard.history and SpikeHistory.from_dict(saved).quarantined_rows() == {7}
    before = SpikeHistory.from_dict({**saved, "quarantine": []})
    guard.rolled_back(32, before.to_dict())
    assert guard.history.quarantined_rows() == {7} and guard.history.losses == before.losses
    assert [guard.lr_factor(step) for step in (33, 37, 42, 50)] == [pytest.approx(0.1), pytest.approx(0.5), 1.0, 1.0]


def test_an_overflowed_gradient_is_left_to_the_gradient_scaler() -> None:
    guard = warmed_guard(grad_norm_z=6.0)
    assert guard.judge(41, 3.0, float("inf")) is None, "16-mixed skips such a step and lowers its scale itself"
    guard.accept(3.0, float("inf"))
    assert all(norm < 2.0 for norm in guard.history.grad_norms)


def test_the_guards_defaults_are_the_options_defaults() -> None:
    """SpikeRules (the guard's, which these tests build) and SpikeArgs (the command line's) each write the defaults:
    one changed without the other would test a guard no run uses."""
    from app.training.run import spike_rules
    from arguments import Config

    assert spike_rules(Config()) == SpikeRules()


def test_a_loss_near_zero_must_still_rise_by_the_minimum_to_spike() -> None:
    """A model memorising 16 rows sat at a loss of 0.008; a wobble to 0.16 was a spike (the floor, 1% of the median,
    was 0.0005 nats), and 9 of the 16 clean rows were set aside before the run stopped."""
    assert upper_limit([0.008] * 10, z=6.0, floor=0.01, min_rise=0.1) == pytest.approx(0.108)
    guard = SpikeGuard(SpikeRules(warmup=20, window=50))
    for loss in noisy(40, 0.0084, 0.0002):
        guard.accept(loss, 1.0)
    assert guard.judge(41, 0.09, 1.0) is None
    assert guard.judge(41, 0.2, 1.0) is not None, "a rise of 0.19 nats still is one"


def test_detect_takes_a_level_the_loss_keeps_as_its_new_normal() -> None:
    """A spike never joined the statistics, so after a lasting rise of the loss `detect` reported every later step."""
    guard, reported = warmed_guard("detect"), 0
    for step, loss in enumerate(noisy(200, 3.5, 0.05, seed=3), start=41):
        spike = guard.judge(step, loss, 1.0)
        if spike is None:
            guard.accept(loss, 1.0)
        else:
            reported += 1
            assert guard.respond(spike, explained=False) == "apply"
    assert 1 <= reported <= 10, reported


def test_a_rollback_sets_aside_the_rows_of_the_spikes_that_made_the_incident() -> None:
    """Under rollback, the incident's batches (no row of theirs stood out: the stretch is bad as a whole) trained again
    in the next epoch, unnoticed; they are set aside at the rollback, once each, with their mean loss."""
    guard = warmed_guard("rollback", incident_spikes=3, incident_steps=10)
    at_checkpoint = guard.history.to_dict()
    batches = {5: [(1, 80.0, 10), (2, 90.0, 10)], 41: [(3, 80.0, 10)], 42: [(4, 70.0, 10), (5, 0.0, 0)],
               43: [(3, 60.0, 10), (6, 50.0, 10)]}
    actions = [guard.respond(guard.judge(step, 9.0, 1.0), explained=False, rows=rows) for step, rows in batches.items()]
    assert actions == ["skip", "skip", "skip", "rollback"]
    assert guard.open_incident(43) == 41 and guard.open_incident(60) is None
    set_aside = guard.rolled_back(32, at_checkpoint)
    assert [(entry["row"], entry["loss"], entry["step"]) for entry in set_aside] == [(3, 6.0, 43), (4, 7.0, 42),
                                                                                    (6, 5.0, 43)]
    assert guard.history.quarantined_rows() == {3, 4, 6} and guard.history.incident_rows == []
    assert warmed_guard("skip").open_incident(43) is None, "only a rollback needs a checkpoint kept"


def test_statistics_of_another_mixture_start_again_and_the_quarantine_stays() -> None:
    """A folder added at a resume moved the loss by its own rows: judged against the old mixture's statistics, its
    clean rows were set aside as spikes."""
    guard = warmed_guard()
    guard.set_aside(41, [(7, 6.5, 32)])
    assert guard.judged_on([["a", "1/2"], ["b", "1/2"]]) is False, "a checkpoint from before this was recorded"
    assert guard.judged_on([["a", "1/2"], ["b", "1/2"]]) is False and guard.history.losses
    at_checkpoint = guard.history.to_dict()
    assert guard.judged_on([["a", "1/3"], ["b", "1/3"], ["c", "1/3"]]) is True
    assert guard.history.losses == [] and guard.history.quarantined_rows() == {7}
    guard.rolled_back(32, at_checkpoint)  # to a checkpoint from before the resume: its statistics are the old mixture's
    assert guard.history.losses == [] and guard.history.data == [["a", "1/3"], ["b", "1/3"], ["c", "1/3"]]
