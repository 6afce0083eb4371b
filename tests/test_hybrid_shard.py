"""HYBRID_SHARD on two nodes as users start them by hand (`python train.py --num_nodes 2` on each, with MASTER_ADDR,
MASTER_PORT and NODE_RANK), both on this machine with 2 processes each: parameters sharded within a node and
replicated across it, under fsdp and fsdp2. Its steps are FULL_SHARD's, and its sharded checkpoints, written by 4
ranks on 2 nodes, resume under the other strategy: on 2 nodes again, and on the 2 ranks of one node."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, interpreter, run_environment, run_train, train_args
from tests.test_training import assert_succeeded, read_metrics

CONSTANT_LR = dict(lr_decay=False, min_lr=None, warmup_steps=0, eval_step_interval=100, micro_batch_size=2,
                   gradient_accumulation_steps=1, state_dict_type="sharded")


@pytest.fixture(scope="module")
def full_shard(tiny, tmp_path_factory) -> Path:
    """6 steps of FULL_SHARD on 2 ranks: the same global batch of 8 sequences (2 accumulation), and each rank
    holds what a rank of a 2-rank node holds under HYBRID_SHARD."""
    out_dir = tmp_path_factory.mktemp("full-shard")
    options = CONSTANT_LR | {"gradient_accumulation_steps": 2}
    assert_succeeded(run_train(train_args(tiny, out_dir, devices=2, max_step=6, **options)))
    return out_dir


def parameters_per_rank(out_dir: Path) -> list[float]:
    return [rank["parameters_gb"] for rank in json.loads((out_dir / "summary.json").read_text())["ranks"]]


@pytest.mark.slow
def test_hybrid_shard_on_two_nodes_takes_full_shards_steps_and_resumes_under_the_other_strategy_and_on_one_node(
        tiny, full_shard, tmp_path) -> None:
    """fsdp on two nodes takes steps 1-2, fsdp2 on two nodes resumes its checkpoint for steps 3-4, and fsdp on the
    2 ranks of one node resumes fsdp2's for steps 5-6."""
    sharded_in_two = parameters_per_rank(full_shard)
    on_each_node = sharded_in_two + sharded_in_two  # node 0's two ranks, then node 1's
    for strategy, max_step in (("fsdp", 2), ("fsdp2", 4)):
        hybrid = run_train(train_args(tiny, tmp_path, strategy=strategy, sharding_strategy="HYBRID_SHARD", devices=2,
                                      num_nodes=2, max_step=max_step, save_step_interval=2, resume=max_step > 2,
                                      **CONSTANT_LR), nodes=2)
        assert_succeeded(hybrid)
        # once: said on each node's first process, a Slurm log (every node's output) held it once per node
        assert hybrid.stdout.count("8 sequences x 32 tokens (1 accumulation x 2 micro-batch x 4 ranks)") == 1, \
            hybrid.stdout
        assert hybrid.stdout.count("resumed from") == (max_step > 2), hybrid.stdout
        assert parameters_per_rank(tmp_path) == pytest.approx(on_each_node, rel=0.02), "a node's half, not a quarter"
    resumed = run_train(train_args(tiny, tmp_path, strategy="fsdp", devices=2, max_step=6, resume=True,
                                   **CONSTANT_LR))
    assert_succeeded(resumed)
    assert "ranks 4 -> 2" in resumed.stdout, resumed.stdout
    steps, reference = read_metrics(tmp_path), read_metrics(full_shard)
    for step in range(1, 7):
        assert steps[step]["train_loss"] == pytest.approx(reference[step]["train_loss"], rel=1e-5), step


@pytest.mark.slow
def test_hybrid_shard_with_one_device_per_node_synchronises_across_the_nodes(tiny, full_shard, tmp_path) -> None:
    """Shard groups of one rank: FSDP1 switched to NO_SHARD within each and never all-reduced across the nodes,
    each node training its own replica on its own rows (grad_norm 0.52 where FULL_SHARD's is 1.12)."""
    options = CONSTANT_LR | {"gradient_accumulation_steps": 2}
    hybrid = run_train(train_args(tiny, tmp_path, sharding_strategy="HYBRID_SHARD", devices=1, num_nodes=2,
                                  max_step=2, **options), nodes=2)
    assert_succeeded(hybrid)
    steps, reference = read_metrics(tmp_path), read_metrics(full_shard)
    for step in (1, 2):
        for name in ("train_loss", "grad_norm"):
            assert steps[step][name] == pytest.approx(reference[step][name], rel=1e-5), (step, name)


def test_every_process_group_a_run_creates_times_out_after_process_group_timeout_min() -> None:
    """Lightning's default group, the device meshes of HYBRID_SHARD under fsdp and fsdp2 and the checkpoint writer's
    gloo group: all 7 min as asked (the mesh and writer groups were 30 min, torch's default; NCCL's is 10)."""
    ports = [str(free_port()), str(free_port())]
    python, variables = interpreter()
    ranks = [subprocess.Popen([python, str(ROOT / "tests" / "helpers" / "probe_group_timeouts.py"), str(rank), *ports],
                              cwd=ROOT, env=run_environment(variables | {"PYTHONPATH": str(ROOT)}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    lines = [line for line in outputs[0][0].splitlines() if " group " in line]
    for strategy in ("fsdp", "fsdp2"):
        assert len([line for line in lines if line.startswith(strategy) and "(1 ranks)" in line]) >= 1, lines
    assert lines and all(line.endswith(": 7 min") for line in lines), lines
