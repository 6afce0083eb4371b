"""--optimizer muon: Muon for the layers' weight matrices and AdamW for the rest, stepped as torch's two optimizers
step them apart, under fsdp2 and ddp alike, resumed exactly, converted; refused where it cannot train."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn import Linear, Sequential
from transformers import AutoConfig, AutoModelForCausalLM

from app.distributed.fsdp2 import shard_model
from app.optimization.muon import MuonWithAdamW, ShardedMuon
from app.optimization.optimizer import ParameterRoles, build_optimizer
from app.training.preflight import preflight
from arguments import Config, parse_config
from tests.conftest import run_entry, run_forked_ranks, run_train, train_args
from tests.test_training import assert_succeeded, read_metrics


def test_muon_with_adamw_steps_each_parameter_as_torchs_muon_or_adamw_alone(tiny) -> None:
    """The layers' matrices take torch's Muon step, everything else torch's AdamW step, with the lr the schedule
    sets on the shared groups; the state survives a state_dict round trip, after which both still step."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    reference = copy.deepcopy(model)
    cfg = Config(optimizer="muon", lr=1e-2, weight_decay=0.1, muon_momentum=0.9)
    roles = ParameterRoles.of(model)
    optimizer = build_optimizer(model, cfg, roles)
    assert isinstance(optimizer, MuonWithAdamW)
    matrices = [p for name, p in reference.named_parameters() if name in roles.matrices]
    others = [p for name, p in reference.named_parameters() if name not in roles.matrices]
    assert {name.split(".")[-2] for name in roles.matrices} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"}
    muon = torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in others if p.ndim == 2], "weight_decay": 0.1},
                               {"params": [p for p in others if p.ndim < 2], "weight_decay": 0.0}],
                              lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)  # as built on CPU
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for step in range(4):
        lr = 1e-2 / (step + 1)
        for group in [*optimizer.param_groups, *muon.param_groups, *adamw.param_groups]:
            group["lr"] = lr
        for one, steppers in ((model, [optimizer]), (reference, [muon, adamw])):
            one(input_ids=ids, labels=ids).loss.backward()
            for stepper in steppers:
                stepper.step()
                stepper.zero_grad()
        if step == 1:  # as a checkpoint is read back
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(ours, theirs), name
    assert set(optimizer.state[model.lm_head.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(optimizer.state[model.model.layers[0].mlp.up_proj.weight]) == {"momentum_buffer"}


def step_sharded_muon_as_torchs_muon_on_whole_matrices(world_size: int, sharding: str, nodes: int) -> None:
    """Matrices sharded by FSDP2 in shards of 3 ranks, uneven (7 rows: 3, 3, 1; 2 rows: 1, 1, none), wider and taller
    than long (torch transposes the latter), 7 of them (rounds of 3, 3 and 1), or in shards of 2 ranks replicated
    over 2 nodes (HYBRID_SHARD): after 3 steps with Nesterov and without, every rank's rows are those torch's Muon
    computes on the whole matrices in one process, to the bit."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
    shapes = [(7, 5), (2, 7), (9, 2), (5, 9), (4, 4), (1, 6), (12, 3)]
    torch.manual_seed(0)
    model = Sequential(*(Linear(cols, rows, bias=False) for rows, cols in shapes))
    reference = copy.deepcopy(model)
    shard_model(model, mesh, wrap_classes={Linear}, sharding_strategy=sharding, num_nodes=nodes,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(), param_init_fn=None)
    for nesterov in (True, False):
        options = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
        ours, theirs = ShardedMuon(model.parameters(), **options), torch.optim.Muon(reference.parameters(), **options)
        for step in range(3):
            for module, optimizer in ((model, ours), (reference, theirs)):
                for param, (rows, cols) in zip(module.parameters(), shapes):
                    whole = torch.randn(rows, cols, generator=torch.Generator().manual_seed(step * 10 + rows))
                    param.grad = (distribute_tensor(whole, param.device_mesh, param.placements)
                                  if module is model else whole)
                assert optimizer.step(lambda: step) == step  # the closure's loss, as torch's optimizers return it
        for sharded, whole in zip(model.parameters(), reference.parameters()):
            assert isinstance(sharded, DTensor) and Shard(0) in sharded.placements
            assert torch.equal(sharded.full_tensor(), whole), sharded.shape


@pytest.mark.parametrize("world_size, sharding, nodes", [(3, "FULL_SHARD", 1), (4, "HYBRID_SHARD", 2)])
def test_sharded_muon_computes_torchs_muon_of_whole_matrices_from_shards(world_size, sharding, nodes, tmp_path) -> None:
    run_forked_ranks(lambda rank: step_sharded_muon_as_torchs_muon_on_whole_matrices(world_size, sharding, nodes),
                     world_size, tmp_path / "store")


def test_muon_trains_under_fsdp2_and_ddp_alike_resumes_exactly_across_them_and_converts(tiny, tmp_path) -> None:
    """fsdp2 (matrices sharded by rows, Muon's update computed on DTensors) against ddp (whole matrices): the same
    losses; a sharded checkpoint resumes fsdp2 exactly and ddp from the same step; the weights convert."""
    constant = dict(optimizer="muon", lr=1e-3, lr_decay=False, min_lr=None, warmup_steps=0, max_step=6,
                    eval_step_interval=3, save_step_interval=3, gradient_accumulation_steps=1, micro_batch_size=2)
    runs = {name: tmp_path / name for name in ("fsdp2", "ddp", "resumed", "resumed-ddp")}
    assert_succeeded(run_train(train_args(tiny, runs["fsdp2"], strategy="fsdp2", **constant)))
    assert_succeeded(run_train(train_args(tiny, runs["ddp"], strategy="ddp", **constant)))
    halfway = constant | dict(max_step=3, state_dict_type="sharded")
    assert_succeeded(run_train(train_args(tiny, runs["resumed"], strategy="fsdp2", **halfway)))
    shutil.copytree(runs["resumed"], runs["resumed-ddp"])
    assert_succeeded(run_train(train_args(tiny, runs["resumed"], strategy="fsdp2", resume=True, **constant)))
    assert_succeeded(run_train(train_args(tiny, runs["resumed-ddp"], strategy="ddp", resume=True, **constant)))
    losses = {name: read_metrics(out_dir) for name, out_dir in runs.items()}
    straight = losses["fsdp2"]
    assert straight[6]["val_loss"] < straight[3]["val_loss"] < straight[0]["val_loss"]
    for step in range(1, 7):
        assert losses["resumed"][step]["train_loss"] == straight[step]["train_loss"], step
        assert losses["ddp"][step]["train_loss"] == pytest.approx(straight[step]["train_loss"], rel=1e-4), step
        assert losses["resumed-ddp"][step]["train_loss"] == pytest.approx(straight[step]["train_loss"], rel=1e-4)
    adamw = train_args(tiny, tmp_path / "adamw", strategy="fsdp2", **constant | dict(optimizer="adamw"))
    assert_succeeded(run_train(adamw))
    assert read_metrics(tmp_path / "adamw")[4]["train_loss"] != straight[4]["train_loss"], "Muon stepped"
    converted = run_entry(["convert_to_hf.py", "--checkpoint", str(runs["resumed"]), "--output_dir",
                           str(tmp_path / "hf"), "--dtype", "float32"])
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert "logits verified (max relative difference 0.0e+00)" in converted.stdout + converted.stderr


def test_muon_is_refused_where_it_cannot_train_and_a_resume_keeps_the_optimizer(tiny, tmp_path, capsys) -> None:
    """FSDP1 flattens the matrices Muon orthogonalises; --stochastic_rounding is AdamW's own; --muon_momentum
    without Muon would be ignored; a checkpoint's optimizer state is its optimizer's."""

    def refusal(out_dir: Path = tmp_path / "out", **options) -> str:
        with pytest.raises(SystemExit) as exit_info:
            preflight(parse_config(train_args(tiny, out_dir, **options)))
        assert exit_info.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        return line

    assert refusal(optimizer="muon") == (
        "error: --optimizer muon orthogonalises each weight matrix whole, and --strategy fsdp (FSDP1) flattens the "
        "matrices into shards: use --strategy fsdp2 (or ddp)")
    assert refusal(optimizer="muon", strategy="fsdp2", precision="bf16-true", stochastic_rounding=True) == (
        "error: --stochastic_rounding rounds AdamW's steps of every weight, and --optimizer muon steps the weight "
        "matrices with Muon: drop one of them")
    assert refusal(muon_momentum=0.9).startswith("error: --muon_momentum is only read with --optimizer muon")
    assert refusal(optimizer="muon", strategy="ddp", muon_momentum=1.0).startswith(
        "error: --muon_momentum must be in [0, 1), got 1.0")
    adamw = tmp_path / "adamw"
    assert_succeeded(run_train(train_args(tiny, adamw, strategy="fsdp2", max_step=2, save_step_interval=2,
                                          eval_step_interval=2, warmup_steps=0)))
    line = refusal(adamw, strategy="fsdp2", optimizer="muon", resume=True, max_step=4, warmup_steps=0)
    assert f"--checkpoint {adamw / 'checkpoints' / 'step-00000002.ckpt'} was trained with --optimizer adamw, not " \
           "muon: its optimizer state is that optimizer's; resume with the same --optimizer, or start a new phase " \
           "from its weights with --init_from" in line
