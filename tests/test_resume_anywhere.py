"""Resume anywhere: another strategy, checkpoint format, number of ranks or micro batch, and earlier versions'
checkpoints, each continuing exactly where a straight run would be.

One chain of runs changes all of them at every link, and its per-step losses and gradient norms must equal a
straight run's: the global batch of the checkpoint is kept (the accumulation follows), the data continues at the same
global sample, and every strategy loads what another wrote. So DDP over 2 ranks takes the steps of FSDP and of one
device, its norm summed over ranks and divided by the ranks holding each gradient. Links of 2 steps with a constant
learning rate, so that a link's --max_step does not change the schedule. Sharded checkpoints read by fsdp and
fsdp2, which the chain leaves out, are in tests/test_hybrid_shard.py (each reads the other's) and tests/test_fsdp2.py
(fsdp2 its own).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from app.checkpoint import list_checkpoints, read_metadata, read_tensors
from app.checkpoint.files import LOCK_FILE
from app.checkpoint.io import identity
from app.checkpoint.rng import decode_generator_state
from app.checkpoint.state import ADAMW_STATE
from app.exit_codes import EXIT_CORRUPT_CHECKPOINT
from app.model.build import meta_model
from app.optimization.optimizer import grouped_parameter_names, no_decay_names
from app.training.nodes import resume_disagreement
from app.training.preflight import preflight
from arguments import parse_config
from tests.conftest import ONE_PROCESS, ROOT, overwrite_in_place, run_entry, run_script, run_train, train_args
from tests.test_training import assert_succeeded, read_metrics

CONSTANT_LR = dict(lr_decay=False, min_lr=None, warmup_steps=0, eval_step_interval=2, save_step_interval=100,
                   eval_batch_size=16, eval_iters=100)  # the whole validation split, whatever the number of ranks
STRAIGHT = dict(strategy="fsdp", state_dict_type="full", devices=2, micro_batch_size=4, gradient_accumulation_steps=2)
CHAIN = [  # (strategy, format, ranks, micro batch): what each link resumes with, after the first link (two_steps)
    ("fsdp2", "full", 4, 2),  # loads fsdp/full: 2 -> 4 ranks, micro batch 4 -> 2
    ("ddp", "sharded", 2, 4),  # loads fsdp2/full: 4 -> 2 ranks
    ("single_device", "full", 1, 8),  # loads ddp/sharded: 2 -> 1 rank
    ("fsdp", "sharded", 2, 4),  # loads single/full: 1 -> 2 ranks
]
STEPS = 2 * (1 + len(CHAIN))


def link_args(tiny, out_dir: Path, strategy: str, state_dict_type: str, devices: int, micro_batch_size: int,
              max_step: int) -> list[str]:
    return train_args(tiny, out_dir, strategy=strategy, state_dict_type=state_dict_type, devices=devices,
                      micro_batch_size=micro_batch_size, gradient_accumulation_steps=None,
                      global_batch_size=16 if max_step == 2 else None, max_step=max_step,
                      resume=max_step > 2, **CONSTANT_LR)


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory) -> dict[int, dict[str, float]]:
    out_dir = tmp_path_factory.mktemp("straight")
    assert_succeeded(run_train(train_args(tiny, out_dir, max_step=STEPS, **STRAIGHT, **CONSTANT_LR)))
    return read_metrics(out_dir)


@pytest.fixture(scope="module")
def two_steps(tiny, tmp_path_factory) -> Path:
    """The first 2 steps of the straight run (FSDP, 2 ranks, full checkpoint at step 2), to resume from: the
    chain's first link."""
    out_dir = tmp_path_factory.mktemp("two-steps")
    assert_succeeded(run_train(link_args(tiny, out_dir, "fsdp", "full", 2, 4, max_step=2)))
    return out_dir


@pytest.mark.slow
def test_a_chain_of_resumes_across_strategies_formats_ranks_and_micro_batches_matches_a_straight_run(
        tiny, straight, two_steps, tmp_path) -> None:
    shutil.copytree(two_steps, tmp_path, dirs_exist_ok=True)
    outputs = []
    for link, (strategy, state_dict_type, devices, micro_batch_size) in enumerate(CHAIN, start=2):
        result = run_train(link_args(tiny, tmp_path, strategy, state_dict_type, devices, micro_batch_size,
                                     max_step=2 * link))
        assert_succeeded(result)
        outputs.append(result.stdout)
        saved = list_checkpoints(tmp_path)[2 * link]
        assert saved.is_dir() == (state_dict_type == "sharded")
        assert read_metadata(saved)["global_batch_size"] == 16
    assert "--resume: ranks 2 -> 4, micro batch 4 -> 2; 16 sequences per step as 2 accumulation" in outputs[0]
    assert "no random state saved for this rank; seeded from --seed and the step" in outputs[0]
    assert "ranks 2 -> 1" in outputs[2] and "as 2 accumulation x 8 micro batch x 1 ranks" in outputs[2]
    chained = read_metrics(tmp_path)
    assert sorted(step for step in chained if step) == sorted(step for step in straight if step)
    worst = {column: max(abs(chained[s][column] - straight[s][column]) / straight[s][column] for s in straight if s)
             for column in ("train_loss", "grad_norm")}
    print(f"\nchain of {len(CHAIN)} resumes vs straight run: max relative difference "
          + ", ".join(f"{column} {difference:.1e}" for column, difference in worst.items()))
    assert worst["train_loss"] < 1e-5
    assert worst["grad_norm"] < 1e-5, "summed over ranks, divided by the ranks holding each gradient"
    for step in range(2, STEPS + 1, 2):
        assert chained[step]["val_loss"] == pytest.approx(straight[step]["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_bytes_changed_in_place_are_found_when_the_resuming_layout_reads_no_piece_whole(tiny, two_steps,
                                                                                      tmp_path) -> None:
    """fsdp2's ranks read row halves of the pieces fsdp (or DDP, or one device) wrote: none was read whole, so none
    was checked, and a checkpoint whose bytes changed resumed without a word (a flipped bit trained on, or a
    non-finite loss blamed on --lr). The ranks now share out the pieces none of them read whole, and check them."""
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    name = "model.model.layers.0.mlp.down_proj.weight"
    changed = overwrite_in_place(run / "checkpoints" / "step-00000002.ckpt", name)
    result = run_train(link_args(tiny, run, "fsdp2", "full", 2, 4, max_step=4))
    assert result.returncode == EXIT_CORRUPT_CHECKPOINT, result.stderr[-3000:]  # --resume true chose it: set aside
    assert f"{changed}: elements 0 to " in result.stderr and (
        f"of {name} are not the bytes that were saved (their checksum differs): the checkpoint is corrupt"
        in result.stderr), result.stderr[-3000:]


@pytest.mark.slow
def test_fsdp2_trains_like_fsdp_and_converts_with_identical_logits(tiny, straight, tmp_path) -> None:
    """FSDP2 starts from the same weights (same init, same order) and takes the same steps as FSDP1, also when the
    gradients of the step's 2 micro-batches are reduced once, after the last (--fsdp_no_sync; the chain's fsdp2 link
    reduces them after each)."""
    result = run_train(train_args(tiny, tmp_path, max_step=STEPS, **(STRAIGHT | {"strategy": "fsdp2"}),
                                  fsdp_no_sync=True, **CONSTANT_LR))
    assert_succeeded(result)
    fsdp2 = read_metrics(tmp_path)
    worst = max(abs(fsdp2[s]["train_loss"] - straight[s]["train_loss"]) / straight[s]["train_loss"] for s in straight if s)
    print(f"\nfsdp2 vs fsdp over {STEPS} steps: max relative loss difference {worst:.1e}")
    assert worst < 1e-4
    converted = run_entry(["convert_to_hf.py", "--checkpoint", str(tmp_path), "--output_dir", str(tmp_path / "hf"),
                           "--dtype", "float32"])
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert "logits verified (max relative difference 0.0e+00)" in converted.stdout + converted.stderr


@pytest.mark.slow
def test_a_global_batch_that_the_new_layout_cannot_split_is_refused_before_any_work(tiny, two_steps, capsys) -> None:
    """train.py's preflight, in this process (the command line's one-line refusal is test_preflight's)."""
    before = {path: path.stat().st_mtime_ns for path in two_steps.rglob("*")}
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(link_args(tiny, two_steps, "ddp", "full", 2, 3, max_step=4)))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --resume: the checkpoint's global batch of 16 sequences does not split into --micro_batch_size 3 on "
        "2 ranks; choose a micro batch and device count that divide it, or give --global_batch_size")
    assert {path: path.stat().st_mtime_ns for path in two_steps.rglob("*")} == before


def write_legacy_checkpoint(source: Path, target: Path, *, numbered_optimizer: bool) -> None:
    """What earlier versions wrote with Lightning's fabric.save: torch.save of the state dict, the random states with
    tensors, the data position in micro-batches per rank and, under DDP or one device, the optimizer state numbered
    in the optimizer's parameter order."""
    metadata = read_metadata(source)
    tensors = read_tensors(source)
    model = meta_model(AutoConfig.for_model(**metadata["model_config"]))
    decayed, exempt = grouped_parameter_names(model, no_decay_names(model))
    optimizer = {index if numbered_optimizer else name: {key: tensors[f"optimizer.state.{name}.{key}"]
                                                         for key in ADAMW_STATE}
                 for index, name in enumerate(decayed + exempt)}
    rng = [state | {"python": tuple(state["python"]), "torch": decode_generator_state(state["torch"])}
           for state in metadata["rng"]]
    micro_batches = metadata["position"] // (metadata["config"]["micro_batch_size"] * len(rng))
    legacy = {key: metadata[key] for key in ("step", "epoch", "val_loss", "config", "model_config", "tokenizer")}
    legacy |= {"model": {name.removeprefix("model."): tensor for name, tensor in tensors.items()
                         if name.startswith("model.")},
               "optimizer": {"state": optimizer, "param_groups": []}, "rng": rng, "position": micro_batches}
    torch.save(legacy, target)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, numbered_optimizer", [("fsdp", False), ("ddp", True)])
def test_checkpoints_of_earlier_versions_resume_exactly(tiny, straight, two_steps, tmp_path, strategy,
                                                         numbered_optimizer) -> None:
    resumed = tmp_path / "resumed"
    legacy = tmp_path / "step-00000002.ckpt"
    write_legacy_checkpoint(list_checkpoints(two_steps)[2], legacy, numbered_optimizer=numbered_optimizer)
    result = run_train(link_args(tiny, resumed, strategy, "full", 2, 4, max_step=4) + ["--checkpoint", str(legacy)])
    assert_succeeded(result)
    assert f"resumed from {legacy} at step 2 (epoch 0, sample 32 of the epoch)" in result.stdout
    metrics = read_metrics(resumed)
    for step in (3, 4):
        assert metrics[step]["train_loss"] == pytest.approx(straight[step]["train_loss"], rel=1e-5)


@pytest.mark.slow
def test_resuming_a_full_checkpoint_under_fsdp_costs_about_the_optimizer_state(tiny, tmp_path) -> None:
    """Each rank reads only its own piece of every tensor into its shard; AdamW's moments, created on load, are 2/3
    of the file. Through torch's sharded state dicts the ranks' memory rose by 2.9x the file (170M model, 4 ranks);
    with zero gradients for every parameter at once to create the moments, by 0.85-1.04x (here 0.72-0.76x)."""
    config = tmp_path / "state-heavy"
    LlamaConfig(vocab_size=AutoConfig.from_pretrained(tiny.model_config).vocab_size, hidden_size=768,
                intermediate_size=3072, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=12,
                max_position_embeddings=64).save_pretrained(config)
    options = dict(model_config=config, max_step=1, warmup_steps=0, micro_batch_size=1, gradient_accumulation_steps=1,
                   initial_validation=False, eval_iters=1)
    assert_succeeded(run_train(train_args(tiny, tmp_path / "run", **options)))
    report = tmp_path / "resume-memory.json"
    result = run_script([sys.executable, str(ROOT / "benchmarks/resume_memory.py"), str(report),
                         str(list_checkpoints(tmp_path / "run")[1]), *train_args(tiny, tmp_path / "load", **options)],
                        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(report.read_text())
    print(f"\nresume memory: ranks rose by {measured['rises_gb']} GB for a {measured['checkpoint_gb']:.2f} GB "
          f"checkpoint: {measured['ratio']:.2f}x")
    assert measured["ratio"] < 0.9


def recorded_rows(out_dir: Path) -> dict[int, list[int]]:
    lines = (out_dir / "rows.jsonl").read_text().splitlines()
    return {record["step"]: sorted(row for rows in record["rows"].values() for row in rows)
            for record in map(json.loads, lines)}


def test_a_resume_at_a_larger_global_batch_trains_the_epochs_left_and_resumes_again_at_the_same_rows(
        tiny, tmp_path, capsys) -> None:
    """Saved at step 30 of 16 rows (sample 480 of 647), resumed at 256 rows a step for 2 epochs: no whole step is
    left in epoch 0, so 2 steps of epoch 1 (the run used to end at once: 647 // 256 x 2 = 4 steps < 30); resumed
    again from its first step's checkpoint, it reads the rows it read then (its position was a step behind them)."""
    one = dict(devices=1, strategy="single_device", gradient_accumulation_steps=None, warmup_steps=0,
               eval_step_interval=100, record_rows=True)
    first, larger, again = tmp_path / "first", tmp_path / "larger", tmp_path / "again"
    assert_succeeded(run_train(train_args(tiny, first, **one, micro_batch_size=16, global_batch_size=16, max_step=30,
                                          save_step_interval=30)))
    shutil.copytree(first / "checkpoints", larger / "checkpoints")
    resumed = run_train(train_args(tiny, larger, **one, micro_batch_size=64, global_batch_size=256, max_step=None,
                                   number_epochs=2, save_step_interval=1, resume=True))
    assert_succeeded(resumed)
    assert "training 32 steps of 256 sequences" in resumed.stdout, resumed.stdout
    # its schedule is 4 steps (2 epochs of 2) of which 2 are left: warmup counts those, not the 32 step numbers (10
    # warmup steps were accepted, and the rate climbed to the end, never reaching --lr)
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, larger, **(one | dict(warmup_steps=10)), micro_batch_size=64,
                                          global_batch_size=256, max_step=None, number_epochs=2, resume=True,
                                          checkpoint=larger / "checkpoints" / "step-00000030.ckpt")))
    assert ("--warmup_steps (10) exceeds the run's schedule of 4 steps (counted at this resume's global batch of "
            "256): lower it, or give --max_step") in capsys.readouterr().err
    with pytest.raises(SystemExit):  # fewer epochs than the checkpoint trained: "where this run ends", exit 0
        preflight(parse_config(train_args(tiny, larger, **one, micro_batch_size=64, global_batch_size=256,
                                          max_step=None, number_epochs=1, resume=True,
                                          checkpoint=larger / "checkpoints" / "step-00000031.ckpt")))
    assert ("--number_epochs 1: the checkpoint is past it already (epoch 1.40, step 31); give more epochs to train "
            "on, or convert the checkpoint as it is") in capsys.readouterr().err
    assert sorted(list_checkpoints(larger)) == [30, 31, 32]
    assert read_metadata(list_checkpoints(larger)[31])["epoch"] == 1
    shutil.copytree(larger / "checkpoints", again / "checkpoints")
    (again / "checkpoints" / "step-00000032.ckpt").unlink()
    assert_succeeded(run_train(train_args(tiny, again, **one, micro_batch_size=64, global_batch_size=256,
                                          max_step=None, number_epochs=2, save_step_interval=1, resume=True)))
    assert recorded_rows(again)[32] == recorded_rows(larger)[32]


def test_max_tokens_ends_at_the_step_that_reads_them_and_a_resume_at_another_batch_trains_what_is_left(
        tiny, tmp_path, capsys) -> None:
    """--max_tokens 700 at 4 sequences of 32 tokens a step: 6 steps, the last reading past it (768 tokens). Resumed
    from step 2 (256 read) at 8 sequences a step, 2 steps are left, not the 4 step numbers that would read twice the
    budget's rest; the schedule finishes over them, at --min_lr as the straight run's did. A smaller budget than the
    checkpoint read is refused."""
    one = dict(devices=1, strategy="single_device", gradient_accumulation_steps=None, warmup_steps=0,
               eval_step_interval=100, max_step=None, max_tokens=700, save_step_interval=2)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = run_train(train_args(tiny, straight, **one, micro_batch_size=4))
    assert_succeeded(result)
    assert ("--max_tokens 700: the run ends at step 6, each step reading 4 sequences of 32 tokens (128); 0.04 epochs "
            "of 647 rows") in result.stdout, result.stdout
    assert max(read_metrics(straight)) == 6 and read_metadata(list_checkpoints(straight)[6])["tokens_read"] == 768
    shutil.copytree(straight / "checkpoints", resumed / "checkpoints")
    for step in (4, 6):
        list_checkpoints(resumed)[step].unlink()
    assert_succeeded(run_train(train_args(tiny, resumed, **one, micro_batch_size=8, global_batch_size=8,
                                          resume=True)))
    metrics = read_metrics(resumed)
    assert max(metrics) == 4 and read_metadata(list_checkpoints(resumed)[4])["tokens_read"] == 256 + 2 * 256
    assert metrics[4]["lr"] == pytest.approx(read_metrics(straight)[6]["lr"]) == pytest.approx(3e-4)
    assert metrics[3]["lr"] == pytest.approx(read_metrics(straight)[4]["lr"]), "two of the straight run's steps each"
    with pytest.raises(SystemExit):
        preflight(parse_config(train_args(tiny, resumed, **(one | dict(max_tokens=200)), micro_batch_size=8,
                                          global_batch_size=8, resume=True, checkpoint=list_checkpoints(resumed)[2])))
    assert ("--max_tokens 200: the checkpoint has read 256 tokens already (step 2); give a larger --max_tokens to "
            "train on, or convert the checkpoint as it is") in capsys.readouterr().err


def test_a_run_resumes_where_its_data_and_out_dir_moved_to(tiny, moved_run, tmp_path) -> None:
    """Preempted, then resumed on another node where the mount differs: the data folder (renamed too) and the run
    folder lie elsewhere. The folder is known by what it holds (stats.json, rows), not by its path; it was refused:
    "the checkpoint was trained on .../node-a/data; a resumed run keeps those folders in that order"."""
    shutil.copytree(moved_run.data, tmp_path / "corpus")
    shutil.copytree(moved_run.out_dir, tmp_path / "run")
    resumed = run_train(train_args(tiny, tmp_path / "run", train_data_dir=tmp_path / "corpus", tokenizer=None,
                                   max_step=4, resume=True, devices=1, strategy="single_device",
                                   gradient_accumulation_steps=None, warmup_steps=0, eval_step_interval=2,
                                   save_step_interval=2))
    assert_succeeded(resumed)
    assert "at step 2" in resumed.stdout + resumed.stderr
    recorded = read_metadata(list_checkpoints(tmp_path / "run")[4])["data_folders"]
    assert [folder["path"] for folder in recorded] == [str(tmp_path / "corpus")], "the next resume compares these"


def test_a_checkpoint_deleted_while_the_preflight_reads_it_gives_way_to_the_newest(tiny, moved_run, tmp_path,
                                                                                    monkeypatch) -> None:
    """A run still writing --out_dir deletes its older checkpoints as it saves (--keep_last_n): the same job
    submitted twice ended in a FileNotFoundError from the middle of the second one's preflight (seen in CI) instead of
    the lock's line. A checkpoint that vanishes while it is read is passed over for the newest."""
    import app.training.preflight.resume as preflight_module
    from app.training.preflight.resume import VANISHED_READS, resolve_resume

    out = tmp_path / "run"
    shutil.copytree(moved_run.out_dir, out)
    checkpoints = out / "checkpoints"
    for step in (3, 4):
        shutil.copy(checkpoints / "step-00000002.ckpt", checkpoints / f"step-0000000{step}.ckpt")
    reads: list[str] = []

    def pruned_while_read(path: Path) -> dict:
        reads.append(path.name)
        if path.name != "step-00000002.ckpt":  # the other run saved again and deleted it
            path.unlink()
        return read_metadata(path)

    monkeypatch.setattr(preflight_module, "read_metadata", pruned_while_read)
    cfg = parse_config(train_args(tiny, out, train_data_dir=str(moved_run.data), resume=True))
    problems: list[str] = []
    resume = resolve_resume(cfg, AutoConfig.from_pretrained(tiny.model_config), problems)
    assert problems == [] and reads == ["step-00000004.ckpt", "step-00000003.ckpt", "step-00000002.ckpt"]
    assert resume.path == checkpoints / "step-00000002.ckpt" and resume.metadata["step"] == 2
    for step in range(3, 4 + VANISHED_READS):
        shutil.copy(checkpoints / "step-00000002.ckpt", checkpoints / f"step-{step:08d}.ckpt")
    monkeypatch.setattr(preflight_module, "read_metadata", lambda path: (path.unlink(), read_metadata(path)))
    assert resolve_resume(cfg, AutoConfig.from_pretrained(tiny.model_config), problems) is None
    assert problems == [f"--resume true: {VANISHED_READS} checkpoints in {checkpoints} were deleted while they were "
                        f"read; another run is writing --out_dir: wait for it to end, or choose another --out_dir"]


def test_nodes_that_would_resume_from_different_checkpoints_are_refused(tiny, moved_run, tmp_path) -> None:
    """Each node's preflight picks the checkpoint to resume from: a node given another --out_dir, or whose view of
    the shared folder lags, picked another one (here none), and the ranks trained one model from the shards of
    different steps until a collective failed. They now compare their choices first: one line, exit 2, nothing
    written."""
    shutil.copytree(moved_run.out_dir, tmp_path / "run")
    before = run_files(tmp_path / "run")
    result = run_train(train_args(tiny, tmp_path / "run", train_data_dir=moved_run.data, tokenizer=None, resume=True,
                                  devices=1, num_nodes=2, micro_batch_size=2, gradient_accumulation_steps=None),
                       nodes=2, node_args={1: ["--out_dir", str(tmp_path / "lagging")]})
    assert result.returncode != 0, result.stdout[-3000:] + result.stderr[-3000:]  # node 0's 2, or 1: another failed
    assert (f"error: --resume: the nodes would not continue from the same checkpoint: node 0 from {tmp_path / 'run'}"
            "/checkpoints/step-00000002.ckpt (step 2); node 1 at step 0, without a checkpoint; give every node"
            in result.stderr), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "lagging").exists()
    assert run_files(tmp_path / "run") == before


def test_a_checkpoint_one_node_does_not_see_says_every_node_reads_it(tiny, tmp_path) -> None:
    """A --checkpoint on node 0's own disk: node 1 refused it as missing, and node 0 waited for node 1 until the
    rendezvous timeout (exit 5, which the Slurm scripts requeue); node 1's line now says what every node needs."""
    from app.training.preflight.resume import resolve_resume

    problems: list[str] = []
    for nodes in (1, 2):
        cfg = parse_config(train_args(tiny, tmp_path / "out", resume=True, checkpoint=tmp_path / "local.ckpt",
                                      num_nodes=nodes, devices=1))
        resolve_resume(cfg, AutoConfig.from_pretrained(tiny.model_config), problems)
    assert problems[0] == f"--checkpoint {tmp_path / 'local.ckpt'}: no such file or folder"
    assert problems[1] == (f"--checkpoint {tmp_path / 'local.ckpt'}: no such file or folder; every node reads it: give "
                           "a path on storage all nodes share (a node that refuses its inputs leaves the others "
                           "waiting for it until --rendezvous_timeout_min)")


def test_nodes_given_other_checkpoints_of_the_same_step_are_refused(moved_run) -> None:
    """A node given a stale copy, or another run's checkpoint of the same step: the step agreed, every node loaded
    its own, and under HYBRID_SHARD each replica trained on from other weights (3% off the right losses by step 8,
    exit 0); the next save kept node 0's alone. Copies of one checkpoint agree."""
    checkpoint = moved_run.out_dir / "checkpoints" / "step-00000002.ckpt"
    metadata = read_metadata(checkpoint)
    other = {**metadata, "config": {**metadata["config"], "lr": 1e-3}}
    assert identity(metadata) == identity(json.loads(json.dumps(metadata))) != identity(other)
    assert resume_disagreement([(0, 2, str(checkpoint), identity(metadata)),
                                (1, 2, "/local/copy.ckpt", identity(metadata))]) is None
    line = resume_disagreement([(0, 2, str(checkpoint), identity(metadata)), (1, 2, "/local/b.ckpt", identity(other))])
    assert line.startswith(f"--resume: the nodes would not continue from the same checkpoint: node 0 from {checkpoint} "
                           f"(step 2, checkpoint {identity(metadata)}); node 1 from /local/b.ckpt (step 2, checkpoint "
                           f"{identity(other)}); give every node the same --out_dir"), line


def test_nodes_that_do_not_share_out_dir_are_refused_before_training(tiny, moved_run, tmp_path) -> None:
    """A fresh run whose node 1 writes to a folder of its own disk (here another --out_dir, holding the lock an
    earlier run on that node left): each rank would have written its part of every checkpoint where no other node
    reads it, and no node could have resumed. Node 1 does not see the lock rank 0 holds: one line, exit 2, no step
    trained, nothing written on node 1."""
    local = tmp_path / "node-1-disk"
    local.mkdir()
    (local / LOCK_FILE).write_text("pid 4242 on node-1\n")
    result = run_train(train_args(tiny, tmp_path / "run", train_data_dir=moved_run.data, tokenizer=None, devices=1,
                                  num_nodes=2, micro_batch_size=2, gradient_accumulation_steps=None),
                       nodes=2, node_args={1: ["--out_dir", str(local)]})
    assert result.returncode != 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (f"error: --out_dir: the lock node 0 holds in {tmp_path / 'run'} is not seen by every node (node 1 "
            f"looked in {local}); every node must write and read the same --out_dir" in result.stderr), \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "step 1/" not in result.stdout
    assert [path.name for path in local.iterdir()] == [LOCK_FILE] and not (tmp_path / "run" / "checkpoints").exists()


def test_nodes_started_with_other_options_are_refused_before_training(tiny, moved_run, tmp_path) -> None:
    """Node 1 applied --lr 0.3 while node 0 logged 3e-3; the loss went from 6.0 to 8.2 and a checkpoint mixing them
    was saved before a collective of another shape ended both nodes in a gloo error. The nodes compare what they
    were started with (options but their own paths, the data folders' contents, the model's config, the code)."""
    result = run_train(train_args(tiny, tmp_path / "run", train_data_dir=moved_run.data, tokenizer=None, devices=1,
                                  num_nodes=2, micro_batch_size=2, gradient_accumulation_steps=None),
                       nodes=2, node_args={1: ["--lr", "0.3", "--num_workers", "1"]})
    assert result.returncode != 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = ("error: the nodes were not started alike: node 0 / node 1: --lr 0.003 / 0.3; give every node the same "
            "command line, data, code and libraries")
    assert result.stderr.count(said) == 2, result.stderr[-3000:]  # each node's
    assert "Traceback" not in result.stderr and "step 1/" not in result.stdout


def test_what_nodes_differ_in_is_named_node_by_node(tiny, tmp_path, monkeypatch) -> None:
    """A node's own copy of the data (another folder name) or W&B variables set on the head node alone are no
    difference; a mixture's weights and the pretrained weights a node reads are (another revision, same config)."""
    from types import SimpleNamespace

    from app.training.nodes import code_version, node_fingerprint, nodes_disagreement, weights_identity

    node = {"options": {"lr": 0.003, "seed": 7}, "data": [{"train_rows": 647}], "mixture": [], "model": {"n": 1},
            "weights": [["model.safetensors", 8, "a"]], "code": code_version(),
            "libraries": {"torch": "2.13.0", "transformers": "5.23.0"}}
    assert nodes_disagreement({0: node, 1: dict(node)}) is None and code_version() == node["code"]
    assert nodes_disagreement({0: node, 1: node | {"weights": None}}) is None, "not in a node's cache yet: unknown"
    other = node | {"options": {"lr": 0.003, "seed": 8}, "data": [{"train_rows": 400}], "mixture": [["a", "1/2"]],
                    "weights": [["model.safetensors", 8, "x"]], "code": "0" * 64,
                    "libraries": {"torch": "2.12.1", "transformers": "5.23.0"}}
    assert nodes_disagreement({0: node, 1: node, 2: other}) == (
        "the nodes were not started alike: node 0 / node 2: --seed 7 / 8, the data folders' contents (stats.json or "
        "row counts), the mixture's folder names or weights, the pretrained weights, the code (app/, train.py, "
        "arguments.py), torch 2.13.0 / 2.12.1; give every node the same command line, data, code and libraries")
    earlier = {key: value for key, value in other.items() if key != "libraries"}  # a node of the code before
    assert nodes_disagreement({0: node, 1: earlier}).endswith("the code (app/, train.py, arguments.py); give every "
                                                              "node the same command line, data, code and libraries")

    copy = tmp_path / "copy-of-data"
    shutil.copytree(tiny.data, copy)
    identity = [{"name": "data", "path": str(tiny.data), "stats_sha256": "s", "train_rows": 647}]
    fingerprints = []
    for data, wandb_mode in ((tiny.data, "online"), (copy, "disabled")):
        cfg = parse_config(train_args(tiny, tmp_path / "run", train_data_dir=data, wandb_mode=wandb_mode))
        inputs = SimpleNamespace(model_config=None, data_folders=[identity[0] | {"name": data.name}], resume_from=None)
        fingerprints.append(node_fingerprint(cfg, inputs))
    assert nodes_disagreement(dict(enumerate(fingerprints))) is None
    assert fingerprints[0]["libraries"]["torch"] == torch.__version__ and "transformers" in fingerprints[0]["libraries"]
    for name, payload in (("a", b"\0" * 4096), ("b", b"\0" * 4095 + b"\1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(payload)
    assert weights_identity(str(tmp_path / "a")) != weights_identity(str(tmp_path / "b"))
    assert weights_identity(str(tmp_path / "a")) == weights_identity(str(tmp_path / "a"))
    assert weights_identity("owner/not-in-this-cache") is None and weights_identity(str(tmp_path / "none")) is None


def test_a_folder_prepared_again_after_an_upgrade_is_the_same_data_to_a_resume() -> None:
    """stats.json records the libraries that prepared it, which the folder's identity leaves out; a folder written
    before they were recorded keeps the hash its checkpoints hold."""
    import hashlib

    from app.data.identity import stats_digest

    stats = {"format": "text", "block_size": 32}
    before = (json.dumps(stats, indent=2) + "\n").encode()
    after = (json.dumps(stats | {"prepared_with": {"datasets": "9.0"}}, indent=2) + "\n").encode()
    assert stats_digest(after) == stats_digest(before) == hashlib.sha256(before).hexdigest()
    assert stats_digest((json.dumps(stats | {"block_size": 64}, indent=2) + "\n").encode()) != stats_digest(before)


def run_files(folder: Path) -> list[str]:
    """The files of a run folder, but for the lock its rank 0 takes as it starts (LOCK_FILE)."""
    return sorted(path.name for path in folder.rglob("*") if path.name != LOCK_FILE)


def resumed_data_problems(tiny, moved_run, spec: str, metadata: dict, **options) -> list[str]:
    """What the preflight's resume check says of --train_data_dir `spec` against a checkpoint's `metadata`."""
    from app.training.preflight.data import check_data
    from app.training.preflight.resume import ChosenCheckpoint, check_data_resume

    problems: list[str] = []
    cfg = parse_config(train_args(tiny, moved_run.out_dir, train_data_dir=spec, **options))
    check_data_resume(cfg, check_data(cfg, problems), ChosenCheckpoint(Path("step-00000002.ckpt"), metadata), problems)
    return problems


def test_a_resumed_run_logs_the_same_train_losses_as_a_run_that_was_not_stopped(tiny, tmp_path) -> None:
    """With --log_interval 3 and a checkpoint at step 4, a resume's first logged loss averaged steps 5-6 where the
    straight run's averaged 4-6, and step 4's loss was logged nowhere; made a log point, a checkpoint written at a
    stop (preemption, Ctrl-C) added a row a straight run does not have. The checkpoint now keeps the losses of the
    steps not logged yet, and the resume logs them where the straight run does. With attention dropout, the equality
    also needs the random state the checkpoint restores (no other resume test's model draws any)."""
    AutoConfig.from_pretrained(tiny.model_config, attention_dropout=0.1).save_pretrained(tmp_path / "dropout")
    options = ONE_PROCESS | dict(max_step=10, log_interval=3, save_step_interval=4, eval_step_interval=100,
                                 model_config=tmp_path / "dropout")
    run_train(train_args(tiny, tmp_path / "straight", **options)).check_returncode()
    resumed = run_train(train_args(tiny, tmp_path / "resumed", resume=True, **options,
                                   checkpoint=tmp_path / "straight" / "checkpoints" / "step-00000004.ckpt"))
    resumed.check_returncode()
    straight, continued = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    logged = sorted(step for step, row in straight.items() if "train_loss" in row)
    assert logged == [3, 6, 9, 10]
    assert sorted(step for step, row in continued.items() if "train_loss" in row) == [6, 9, 10]
    for step in (6, 9, 10):
        assert continued[step]["train_loss"] == pytest.approx(straight[step]["train_loss"], rel=1e-6), step


def test_a_resume_to_a_max_step_before_the_checkpoints_is_refused(tiny, moved_run, capsys) -> None:
    """It printed "training 1 steps", trained nothing, exited 0 and replaced summary.json with a summary of 0 steps."""
    from app.training.preflight import preflight

    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, moved_run.out_dir, train_data_dir=moved_run.data, tokenizer=None,
                                          resume=True, **ONE_PROCESS | {"max_step": 1})))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: --max_step 1: the checkpoint is at step 2 already; give a "
                                               "larger --max_step to train on, or convert the checkpoint as it is")


def test_relaunching_a_finished_run_trains_nothing_and_keeps_its_files(tiny, moved_run, tmp_path) -> None:
    """A relaunch of a run that had reached its --max_step (a re-run of its command, a requeue) printed "training 2
    steps", exited 0 and replaced its summary.json with a summary of 0 steps, and its config.yaml."""
    shutil.copytree(moved_run.out_dir, tmp_path / "run")
    before = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    result = run_train(train_args(tiny, tmp_path / "run", train_data_dir=moved_run.data, tokenizer=None,
                                  resume=True, **ONE_PROCESS | {"max_step": 2}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("--resume: the checkpoint at step 2 is where this run ends: nothing to train, nothing written"
            in result.stdout), result.stdout
    assert {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()} == before


def test_relaunching_a_rollback_continues_from_its_newest_checkpoint(tiny, tmp_path) -> None:
    """A run rolled back with --checkpoint step-2 and trained on to step 6; the same command again (a Slurm requeue,
    or --config out_dir/config.yaml, which records --checkpoint) went back to step 2 each time, set steps 4-6 aside
    and deleted the original stretch's step 4 that the first rollback had kept. Resumed from that copy, the run left
    the rollback's own step 4 in checkpoints/, where a crash would resume the other stretch."""
    run = tmp_path / "run"
    run_train(train_args(tiny, run, **ONE_PROCESS | {"max_step": 4})).check_returncode()
    original = (run / "checkpoints" / "step-00000004.ckpt").read_bytes()
    rollback = dict(resume=True, checkpoint=run / "checkpoints" / "step-00000002.ckpt")
    run_train(train_args(tiny, run, **ONE_PROCESS | rollback | {"max_step": 6})).check_returncode()
    relaunched = run_train(["--config", str(run / "config.yaml"), "--max_step", "8"])
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert (f"--checkpoint {rollback['checkpoint']}: this run started from it and has saved up to step 6 since; "
            "continuing from step 6" in relaunched.stdout), relaunched.stdout
    assert sorted(list_checkpoints(run)) == [2, 4, 6, 8]
    assert sorted(path.name for path in (run / "checkpoints" / "rolled-back").iterdir()) == ["best.json",
                                                                                          "step-00000004.ckpt"]
    assert (run / "checkpoints" / "rolled-back" / "step-00000004.ckpt").read_bytes() == original
    # Back to the original stretch's step 4, from rolled-back/: the rollback's own step 4 left checkpoints/ too
    branch = dict(resume=True, checkpoint=run / "checkpoints" / "rolled-back" / "step-00000004.ckpt")
    run_train(train_args(tiny, run, **ONE_PROCESS | branch | {"max_step": 6})).check_returncode()
    assert sorted(list_checkpoints(run)) == [2, 6], "the other stretch's step 4 stood among this one's"
    assert sorted(path.name for path in (run / "checkpoints" / "rolled-back").iterdir()) == [
        "best-2.json", "best.json", "step-00000004-2.ckpt", "step-00000004.ckpt", "step-00000006.ckpt",
        "step-00000008.ckpt"]


def test_a_resume_says_which_training_options_it_changes(tiny, moved_run, capsys) -> None:
    """A new --lr took effect at the resumed step (the rate went from 1.65e-3 to 8.33e-3 at once) with only the usual
    resume lines, and the rate's jump is said; the same options as the checkpoint's are not listed."""
    resumed = dict(train_data_dir=moved_run.data, tokenizer=None, resume=True)
    preflight(parse_config(train_args(tiny, moved_run.out_dir, **resumed, **ONE_PROCESS | {"max_step": 2})))
    assert "changed since the checkpoint" not in capsys.readouterr().out
    preflight(parse_config(train_args(tiny, moved_run.out_dir, **resumed, **ONE_PROCESS | {"max_step": 4},
                                      lr=1e-2, precision="bf16-true")))
    said = capsys.readouterr().out
    assert ("--resume: changed since the checkpoint: precision 32-true -> bf16-true, lr 0.003 -> 0.01, max_step 2 -> "
            "4; the steps after step 2 train with the new values: step 3 trains at a learning rate of 1.72e-03, 3.00e-04 "
            "with the checkpoint's options") in said, said
    preflight(parse_config(train_args(tiny, moved_run.out_dir, **resumed, **ONE_PROCESS | {"max_step": 2},
                                      grad_clip=0.5)))
    said = capsys.readouterr().out
    assert "grad_clip 1.0 -> 0.5; the steps after step 2 train with the new values\n" in said, "the rate is the same"


def test_a_resume_keeps_the_seed_its_data_order_was_drawn_from(tiny, moved_run) -> None:
    """Resumed with another --seed (a requeue whose config dropped it), the rest of the epoch was drawn from another
    permutation: 38 of 160 rows trained twice, as many never, without a word."""
    saved = read_metadata(list_checkpoints(moved_run.out_dir)[2])
    assert resumed_data_problems(tiny, moved_run, str(moved_run.data), saved, seed=saved["config"]["seed"]) == []
    assert resumed_data_problems(tiny, moved_run, str(moved_run.data), saved, seed=saved["config"]["seed"] + 1) == [
        f"--seed {saved['config']['seed'] + 1}: the checkpoint's run orders its data by --seed "
        f"{saved['config']['seed']}, which a resume continues (another seed repeats rows it trained and skips "
        f"others); give --seed {saved['config']['seed']}"]


def test_a_resumed_folder_must_hold_the_checkpoints_data_wherever_it_lies(tiny, moved_run, tmp_path) -> None:
    saved = read_metadata(list_checkpoints(moved_run.out_dir)[2])
    assert saved["data_folders"][0]["path"] == str(moved_run.trained_on)
    assert resumed_data_problems(tiny, moved_run, str(moved_run.data), saved) == []
    other = tmp_path / "data"
    shutil.copytree(moved_run.data, other)
    stats = json.loads((other / "stats.json").read_text())
    (other / "stats.json").write_text(json.dumps(stats | {"input": ["other.txt"]}))
    problems = resumed_data_problems(tiny, moved_run, str(other), saved)
    assert len(problems) == 1 and f"{other} is not folder 1 the checkpoint was trained on" in problems[0]
    assert "its stats.json differs" in problems[0], problems


def test_a_checkpoint_that_records_only_paths_resumes_on_a_folder_of_that_name_once_the_path_is_gone(
        tiny, moved_run, tmp_path) -> None:
    """Checkpoints written before data_folders: their --train_data_dir, relative to where they were trained."""
    saved = read_metadata(list_checkpoints(moved_run.out_dir)[2])
    earlier = {key: value for key, value in saved.items() if key != "data_folders"}
    earlier["config"] = earlier["config"] | {"train_data_dir": "node-a/data"}
    earlier["cwd"] = str(moved_run.trained_on.parent.parent)
    assert resumed_data_problems(tiny, moved_run, str(moved_run.data), earlier) == []
    shutil.copytree(moved_run.data, tmp_path / "corpus")
    problems = resumed_data_problems(tiny, moved_run, str(tmp_path / "corpus"), earlier)
    assert len(problems) == 1 and "records paths only" in problems[0], problems


def test_a_run_of_one_folder_is_not_resumed_as_a_mixture(tiny, moved_run, tmp_path) -> None:
    """A mixture draws each folder's rows in an order of its own: resumed with a folder added, a run of one folder
    read its folder again from the start (34 of 120 rows trained twice) and lost its token count, without a word."""
    shutil.copytree(moved_run.data, tmp_path / "small")
    saved = read_metadata(list_checkpoints(moved_run.out_dir)[2])
    (problem,) = resumed_data_problems(tiny, moved_run, f"{moved_run.data}:3,{tmp_path / 'small'}:1", saved)
    assert problem.startswith(f"--train_data_dir: the checkpoint was trained on {moved_run.trained_on} alone, in an "
                              "order a mixture does not continue"), problem
    assert resumed_data_problems(tiny, moved_run, str(moved_run.data), saved) == []


def test_a_moved_mixture_keeps_its_folders_names_and_order(tiny, moved_run, tmp_path) -> None:
    """A mixture's positions and seeds are kept per folder name: a moved folder of another name must be named as
    before; new weights and a folder added at the end are fine, another order is not."""
    shutil.copytree(moved_run.data, tmp_path / "small")
    saved = read_metadata(list_checkpoints(moved_run.out_dir)[2])
    mixture = saved | {"mixture": {}, "data_folders": [  # a mixture's positions: not read by this check
        saved["data_folders"][0] | {"name": "data"}, saved["data_folders"][0] | {"name": "small"}]}
    assert resumed_data_problems(tiny, moved_run, f"{moved_run.data}:1,{tmp_path / 'small'}:1", mixture) == []
    assert resumed_data_problems(tiny, moved_run, f"{moved_run.data}:3,{tmp_path / 'small'}:1,"
                                                  f"extra={moved_run.data}:1", mixture) == []
    renamed = tmp_path / "corpus"
    shutil.copytree(moved_run.data, renamed)
    problems = resumed_data_problems(tiny, moved_run, f"{renamed}:1,{tmp_path / 'small'}:1", mixture)
    assert len(problems) == 1 and "name it: data=FOLDER:WEIGHT" in problems[0], problems
    assert resumed_data_problems(tiny, moved_run, f"{tmp_path / 'small'}:1,{moved_run.data}:1", mixture)


def test_every_value_a_checkpoint_holds_is_resumed_restored_by_its_owner_or_describes_the_run() -> None:
    """A value added to the run's state must be taken back by a resume: resume and rollback copied the keys by hand,
    and elapsed_sec, added later, restarted at 0 after every resume. Each key is now in one of these groups, and a
    checkpoint that predates a key resumes it at its step-0 value."""
    from types import SimpleNamespace

    from app.training.progress import (GOES_ON_AT_A_ROLLBACK, PROGRESS, ROLLED_BACK, SAVED_FOR_THE_RANKS,
                                       progress_at_start, saved_progress)
    from app.training.run import initial_state

    inputs = SimpleNamespace(plan=SimpleNamespace(global_batch_size=8), model_config=SimpleNamespace(to_dict=dict),
                             tokenizer=None, data_folders=[], base_model=None, base_revision=None)
    state = initial_state(None, None, SimpleNamespace(to_dict=dict, model_name=None), inputs)
    describes_the_run = {"global_batch_size", "config", "cwd", "model_config", "tokenizer", "data_folders", "versions",
                         "base_model"}
    assert set(state) == {"model", "optimizer"} | set(PROGRESS) | set(SAVED_FOR_THE_RANKS) | describes_the_run
    resumed = saved_progress({"step": 7, "epoch": 1, "position": 24, "val_loss": 2.5, "source_tokens": None})
    assert resumed == progress_at_start() | {"step": 7, "epoch": 1, "position": 24, "val_loss": 2.5}
    resumed["log_window"].append(1.0)
    assert PROGRESS["log_window"] == [], "each resume starts from its own copy"
    assert sorted(ROLLED_BACK + GOES_ON_AT_A_ROLLBACK) == sorted(PROGRESS), "a rollback decides for each value"
    assert {"step", "tokens_seen"} <= set(ROLLED_BACK) and "position" in GOES_ON_AT_A_ROLLBACK
