"""--stochastic_rounding (app/optimization/stochastic_rounding.py): the rounding is unbiased, fp32 weights step as
torch's AdamW, bf16 weights keep the small steps that rounding to nearest loses, replicas round alike, checkpoints
move between the two optimizers, and a run under fsdp2 and fsdp trains and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from app.distributed.precision import bf16_rounding_note, offloaded_rounding_note
from app.optimization.stochastic_rounding import StochasticRoundingAdamW, round_stochastically
from tests.conftest import run_train, train_args
from tests.test_training import assert_succeeded, read_metrics

OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_rounding_lands_on_the_two_neighbours_as_often_as_the_value_is_near_each(sign: float) -> None:
    """1 + 2^-10 lies an eighth of the way from bf16's 1 to 1 + 2^-7: it rounds up one time in eight, and the mean
    is the value (the noise of 200,000 draws is 2e-5 there); a bf16 value itself never moves."""
    values = torch.full((200_000,), sign * (1 + 2**-10))
    rounded = round_stochastically(values, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {sign * 1.0, sign * (1 + 2**-7)}
    assert rounded.mean().item() == pytest.approx(sign * (1 + 2**-10), abs=6e-5)
    assert rounded.mean().item() != pytest.approx(sign, abs=6e-4), "not rounded to nearest"
    exact = torch.tensor([0.0, 1.0, -3.5, 2.0**-20, 65280.0])
    assert torch.equal(round_stochastically(exact, torch.Generator().manual_seed(1)).float(), exact)


def test_fp32_weights_step_as_torchs_adamw_with_and_without_decay() -> None:
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(300, 7)), torch.nn.Parameter(torch.randn(7))]
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]

    def groups(params):
        return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]

    torchs = torch.optim.AdamW(groups(weights), fused=True, **OPTIONS)
    ours = StochasticRoundingAdamW(groups(copies), seed=3, **OPTIONS)
    for _ in range(5):
        for weight, copy in zip(weights, copies):
            weight.grad = torch.randn_like(weight)
            copy.grad = weight.grad.clone()
        torchs.step()
        ours.step()
    for weight, copy in zip(weights, copies):
        torch.testing.assert_close(copy, weight, rtol=1e-6, atol=1e-6)


def test_small_steps_move_bf16_weights_by_their_size_on_average_where_rounding_to_nearest_loses_them() -> None:
    """Weights near 0.02 at a fine-tune's lr of 2e-5: 100 steps of AdamW (about lr each, the gradient constant) leave
    torch's fused AdamW's bf16 weights where they were; here they move by the fp32 run's 2e-3 on average."""
    start = 0.02 + 0.002 * torch.rand(4096, generator=torch.Generator().manual_seed(0))
    reference, nearest, stochastic = (torch.nn.Parameter(start.to(dtype).clone())
                                      for dtype in (torch.float32, torch.bfloat16, torch.bfloat16))
    options = dict(lr=2e-5, betas=(0.9, 0.95), weight_decay=0.0)
    optimizers = [torch.optim.AdamW([reference], fused=True, **options),
                  torch.optim.AdamW([nearest], fused=True, **options),
                  StochasticRoundingAdamW([stochastic], seed=0, **options)]
    for _ in range(100):
        for weight, optimizer in zip((reference, nearest, stochastic), optimizers):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
    moved = (start - reference.detach()).mean().item()
    assert moved == pytest.approx(2e-3, rel=0.01)
    assert torch.equal(nearest.detach(), start.bfloat16()), "rounded to nearest, every step was lost"
    assert (start.bfloat16().float() - stochastic.detach().float()).mean().item() == pytest.approx(moved, rel=0.03)


def test_the_second_moment_decreases_at_torchs_beta2_where_rounding_to_nearest_keeps_it() -> None:
    """--beta2 0.999 (torch's default): after 20 steps of gradient 1, 200 of 0.01. v should fall by about 0.999^200
    (to 82%); in bf16 to nearest 0.999 x v rounds back to v, and it stays where it was (so the steps stay 14x too small
    after such a burst, refused under bf16-true without this option). Here it falls as the fp32 run's, on average."""
    options = dict(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    weights = [torch.nn.Parameter(torch.zeros(4096, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16,
                                                                                torch.bfloat16)]
    optimizers = [torch.optim.AdamW(weights[:1], fused=True, **options),
                  torch.optim.AdamW(weights[1:2], fused=True, **options),
                  StochasticRoundingAdamW(weights[2:], seed=0, **options)]
    for step in range(220):
        for weight, optimizer in zip(weights, optimizers):
            weight.grad = torch.full_like(weight, 1.0 if step < 20 else 0.01)
            optimizer.step()
    reference, nearest, stochastic = (optimizer.state[weight]["exp_avg_sq"].float()
                                      for weight, optimizer in zip(weights, optimizers))
    peak = 1 - 0.999**20
    assert reference.mean().item() == pytest.approx(peak * 0.999**200 + 1e-4 * (1 - 0.999**200), rel=1e-3)
    assert nearest.mean().item() == pytest.approx(peak, rel=2**-7), "never decreased"
    assert stochastic.mean().item() == pytest.approx(reference.mean().item(), rel=0.01)


def test_replicas_round_alike_other_seeds_apart_and_checkpoints_move_between_the_optimizers() -> None:
    """Ranks holding the same weights (ddp, NO_SHARD) draw the same noise at the same step: they stay equal. The
    state of torch's AdamW, read in place as a resume reads a checkpoint, continues here, and this one's in torch's."""
    from app.checkpoint.state import initialise_optimizer_state

    torch.manual_seed(0)
    start, grads = torch.randn(1000).bfloat16(), [torch.randn(1000).bfloat16() for _ in range(4)]

    def train(seed: int, optimizer_class=StochasticRoundingAdamW, steps=grads, weight=None, state=None):
        weight = torch.nn.Parameter(start.clone() if weight is None else weight)
        optimizer = (optimizer_class([weight], seed=seed, **OPTIONS) if optimizer_class is StochasticRoundingAdamW
                     else optimizer_class([weight], fused=True, **OPTIONS))
        if state is not None:
            initialise_optimizer_state(optimizer)
            for name, value in state.items():
                optimizer.state[weight][name].copy_(value)
        for grad in steps:
            weight.grad = grad.clone()
            optimizer.step()
        return weight.detach(), optimizer.state[weight]

    replica, straight = train(7)
    assert torch.equal(replica, train(7)[0]) and not torch.equal(replica, train(8)[0])
    _, torchs = train(7, torch.optim.AdamW)
    for first, then in ((torch.optim.AdamW, StochasticRoundingAdamW), (StochasticRoundingAdamW, torch.optim.AdamW)):
        halfway, state = train(7, first, grads[:2])
        _, state = train(7, then, grads[2:], weight=halfway, state=state)
        assert state["step"].item() == 4, "the step count, hence the bias correction, continues"
        for expected in (straight, torchs):  # the moments are the gradients' alone: the first rounded to nearest by
            assert torch.equal(state["exp_avg"], expected["exp_avg"])  # both, the second stochastically here
            torch.testing.assert_close(state["exp_avg_sq"], expected["exp_avg_sq"], rtol=2**-6, atol=0)


def test_no_rounding_note_under_stochastic_rounding_and_only_under_bf16_true(tiny, tmp_path, capsys) -> None:
    from arguments import parse_config

    assert bf16_rounding_note("bf16-true", 2e-5) and bf16_rounding_note("bf16-true", 2e-5, 0.01, True) is None
    assert offloaded_rounding_note(True, True).startswith("note: --stochastic_rounding with --cpu_offload: the "
                                                         "optimizer steps on the CPU, where its AdamW took 27x")
    assert offloaded_rounding_note(True, False) is None and offloaded_rounding_note(False, True) is None
    with pytest.raises(SystemExit):
        parse_config(train_args(tiny, tmp_path / "out", precision="bf16-mixed", stochastic_rounding=True))
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: --stochastic_rounding rounds bf16 weights, which only --precision bf16-true trains (under "
        "bf16-mixed they are fp32): drop it")


@pytest.mark.slow
def test_a_run_under_fsdp2_and_fsdp_trains_and_resumes_with_the_same_rounding(tiny, tmp_path) -> None:
    """2 ranks, bf16-true at lr 2e-4: each step's noise comes from (--seed, step), so a resume from step 2 rounds
    steps 3 and 4 as the straight run did (fsdp2's weights are DTensors, fsdp's flat shards); rounded to nearest,
    the steps' losses differ."""
    options = dict(precision="bf16-true", stochastic_rounding=True, lr=2e-4, min_lr=2e-5, warmup_steps=0, max_step=4,
                   save_step_interval=2, eval_step_interval=4, state_dict_type="sharded")
    for strategy in ("fsdp2", "fsdp"):
        straight, resumed = tmp_path / f"{strategy}-straight", tmp_path / f"{strategy}-resumed"
        result = run_train(train_args(tiny, straight, strategy=strategy, **options))
        assert_succeeded(result)
        assert "rounded away" not in result.stdout + result.stderr, "no note that steps are lost"
        metrics = read_metrics(straight)
        assert metrics[4]["val_loss"] < metrics[0]["val_loss"], strategy
        if strategy == "fsdp":
            nearest = tmp_path / "nearest"
            assert_succeeded(run_train(train_args(tiny, nearest, strategy=strategy,
                                                  **(options | dict(stochastic_rounding=False)))))
            assert all(read_metrics(nearest)[step]["train_loss"] != metrics[step]["train_loss"] for step in (2, 3, 4))
            break
        assert_succeeded(run_train(train_args(tiny, resumed, strategy=strategy, resume=True,
                                              checkpoint=straight / "checkpoints" / "step-00000002.ckpt", **options)))
        again = read_metrics(resumed)
        assert [again[step]["train_loss"] for step in (3, 4)] == [metrics[step]["train_loss"] for step in (3, 4)]
