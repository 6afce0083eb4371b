"""End-to-end runs of train.py in real processes: 2-process FSDP over gloo, resume, DDP, one process."""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
import shutil
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from app.metrics import observe
from app.metrics.console import Console
from app.metrics.observe import StepClock, Stopwatch
from app.prepare import PrepareArgs, prepare, stdlib_corpus_paths
from arguments import Config
from tests.conftest import (BLOCK_SIZE, one_process_llama, read_checkpoint, run_train, tensorboard_events,
                            tensorboard_scalars, train_args)


def read_metrics(out_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.csv as {step: {column: value}} with the empty cells left out."""
    with open(out_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    merged: dict[int, dict[str, float]] = {}
    for row in rows:
        merged.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    return merged


def tensorboard_options(folder: Path) -> dict[str, Any]:
    """The options the last start wrote as hyperparameters (TensorBoard's HPARAMS tab)."""
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    options: dict[str, Any] = {}
    for event in tensorboard_events(folder):
        for value in event.summary.value:
            if value.tag == "_hparams_/session_start_info":
                hparams = HParamsPluginData.FromString(value.metadata.plugin_data.content).session_start_info.hparams
                options = {name: getattr(given, given.WhichOneof("kind")) for name, given in hparams.items()}
    return options


def assert_succeeded(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def fsdp_run(tiny, tmp_path_factory) -> Path:
    """The issue's reference run: FSDP over 2 CPU processes, 24 steps, evaluation and checkpoints every 8."""
    out_dir = tmp_path_factory.mktemp("fsdp")
    result = run_train(train_args(tiny, out_dir, tensorboard=True))
    assert_succeeded(result)
    stderr_of(out_dir).write_text(result.stderr)
    shutil.copy(out_dir / "metrics.csv", out_dir / "straight_metrics.csv")
    return out_dir


def stderr_of(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".stderr")


def test_fsdp_run_trains_evaluates_and_logs_every_step(fsdp_run) -> None:
    metrics = read_metrics(fsdp_run)
    assert sorted(metrics) == list(range(0, 25))
    assert all("train_loss" in metrics[s] and "lr" in metrics[s] for s in range(1, 25))
    assert [s for s in metrics if "val_loss" in metrics[s]] == [0, 8, 16, 24]
    assert metrics[0]["val_loss"] > metrics[8]["val_loss"], "the initial validation is the untrained baseline"
    first, last = metrics[1]["train_loss"], sum(metrics[s]["train_loss"] for s in range(21, 25)) / 4
    assert last < first - 0.5, (first, last)
    assert metrics[24]["val_loss"] < metrics[8]["val_loss"]
    assert metrics[4]["lr"] == pytest.approx(3e-3) and metrics[24]["lr"] == pytest.approx(3e-4)
    assert (fsdp_run / "config.yaml").read_text().count("micro_batch_size: 4") == 1


def test_a_run_prints_no_library_warning(fsdp_run) -> None:
    """Every rank printed torch 2.13's deprecation of the gather that Fabric's all_gather uses, on every run. A
    warning reads `<file>.py:<line>: <message>` (Lightning drops the category)."""
    stderr = stderr_of(fsdp_run).read_text()
    assert not re.search(r"\.py:\d+: ", stderr), stderr


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_flops_of_encoder_decoders_are_counted_with_their_decoders_share(model_type) -> None:
    """Counted on the meta device: BART's SDPA mask read tensor values there ("Tensor.item() cannot be called on
    meta tensors"), and its runs reported no MFU. A longer target adds the decoder's matrix products."""
    from transformers import AutoConfig

    from app.metrics.observe import flops_per_micro_batch

    small = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=64, decoder_ffn_dim=64) if model_type == "bart" else \
        dict(d_model=32, d_ff=64, d_kv=16, num_layers=1, num_heads=2, decoder_start_token_id=0)
    config = AutoConfig.for_model(model_type, vocab_size=400, **small)
    short, long = (flops_per_micro_batch(config, 1, 64, targets) for targets in (8, 16))
    assert 0 < short < long


def test_flops_of_a_mixture_of_experts_count_the_experts_each_token_meets() -> None:
    """Mixtral's experts run through torch's grouped_mm, which FlopCounter neither counted nor ran on the meta
    device in fp32: its runs reported no MFU. Top-2 of 4 experts of width 128 is a dense MLP of width 256, plus the
    router (2 x 3 matrix products of 256 tokens x 64 x 4 experts, in each of 2 layers)."""
    from transformers import LlamaConfig, MixtralConfig

    from app.metrics.observe import flops_per_micro_batch

    shape = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256)
    moe = flops_per_micro_batch(MixtralConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                                              **shape), 2, 128)
    dense = flops_per_micro_batch(LlamaConfig(intermediate_size=256, **shape), 2, 128)
    assert moe == dense + 2 * 3 * (2 * 256 * 64 * 4)


def test_run_reports_throughput_flops_memory_and_time_lost(fsdp_run, tiny) -> None:
    """metrics.csv at every log interval, and summary.json with every rank's memory (before the resume test)."""
    metrics = read_metrics(fsdp_run)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    matmul_weights = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    for step in range(2, 25):
        row = metrics[step]
        assert row["tokens_per_sec_per_device"] == pytest.approx(row["tokens_per_sec"] / 2)
        assert row["samples_per_sec"] == pytest.approx(row["tokens_per_sec"] / 32)
        flops_per_token = row["tflops_per_sec_per_device"] * 1e12 / row["tokens_per_sec_per_device"]
        assert 6 * matmul_weights < flops_per_token < 8 * matmul_weights, "6 per weight (forward, backward) + attention"
        assert 0 <= row["data_wait_pct"] < 50 and 0.2 < row["peak_rss_gb"] < 4
        assert "mfu" not in row and "peak_allocated_gb" not in row, "a CPU has no FLOP peak and no CUDA allocator"
    assert [s for s in metrics if "save_sec" in metrics[s]] == [8, 16, 24]
    summary = json.loads((fsdp_run / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["checkpoints_saved"] == 3
    assert summary["tokens_per_sec"] == pytest.approx(16 * 32 * 24 / summary["train_sec"])
    assert summary["train_sec"] + summary["eval_sec"] + summary["save_sec"] == pytest.approx(summary["elapsed_sec"])
    assert summary["val_loss"] == pytest.approx(metrics[24]["val_loss"]) and summary["val_loss_step"] == 24
    assert [sorted(rank) for rank in summary["ranks"]] == [
        ["gradients_gb", "optimizer_gb", "parameters_gb", "peak_rss_gb"]] * 2


def test_the_summary_names_the_step_its_validation_loss_is_from() -> None:
    """A run stopped by SIGTERM at step 25 said "final val_loss 6.0345": step 0's, before any training."""
    from app.metrics.observe import summary_lines

    summary = {"steps": 0, "elapsed_sec": 1.0, "train_sec": 1.0, "eval_sec": 0.0, "save_sec": 0.0,
               "checkpoints_saved": 1, "val_loss": 6.0345, "val_loss_step": 0, "ranks": []}
    assert summary_lines(summary)[0].endswith("for 1 saved), val_loss 6.0345 at step 0")


def test_logged_throughput_leaves_out_evaluation_and_saving_as_the_summary_does(monkeypatch) -> None:
    """Steps of 0.1 s with 1,024 tokens, an evaluation of 1 s after step 5: every interval logs 10,240 tokens/s (it
    logged 3,413 for the interval holding the evaluation, while summary.json said 10,240)."""
    now = [0.0]
    monkeypatch.setattr(observe.time, "perf_counter", lambda: now[0])
    evaluation = Stopwatch()
    clock = StepClock(start_step=0, max_step=10, window=5, world_size=1, samples_per_step=8, tokens_per_step=1024,
                      started=0.0, between_steps=(evaluation, Stopwatch()))
    logged = {}
    for step in range(1, 11):
        now[0] += 0.1
        logged[step] = clock.tick(step).get("tokens_per_sec")
        if step == 5:
            with evaluation.measure():
                now[0] += 1.0
    assert logged[5] == pytest.approx(10240) and logged[10] == pytest.approx(10240)
    assert clock.training_time() == pytest.approx(1.0) and clock.elapsed() == pytest.approx(2.0)


def test_the_epoch_column_counts_the_epochs_trained(fsdp_run) -> None:
    """The epoch counter, which a step's end moves on, put the last step of an epoch in the next one; the column is
    the epochs trained, with the share of the current one: 16 rows a step of the 647."""
    metrics = read_metrics(fsdp_run)
    for step in range(1, 25):
        assert metrics[step]["epoch"] == pytest.approx(16 * step / 647, abs=1e-4), step


def test_tokens_per_second_keep_the_fraction_of_a_token_per_row(monkeypatch) -> None:
    """Padded rows of 171.86 tokens on average: every interval logged 171 tokens per sample (0.5% low; a 10.9-token
    mean logged 9% low), while summary.json said 171.86."""
    now = [0.0]
    monkeypatch.setattr(observe.time, "perf_counter", lambda: now[0])
    clock = StepClock(start_step=0, max_step=10, window=2, world_size=2, samples_per_step=8, tokens_per_step=1375,
                      started=0.0)
    for step in range(1, 4):
        now[0] += 0.1
        logged = clock.tick(step)
    assert logged["tokens_per_sec"] / logged["samples_per_sec"] == pytest.approx(1375 / 8, rel=1e-3)


def test_a_row_logged_before_a_whole_interval_has_the_throughput_since_the_start(monkeypatch) -> None:
    """--log_interval 10 and --max_step 3, or a resume at step 16 logging at 20 with --log_interval 5: the row had no
    tokens/s, TFLOP/s or MFU (Lightning's window was not full), while summary.json had them."""
    now = [0.0]
    monkeypatch.setattr(observe.time, "perf_counter", lambda: now[0])
    for start, last, window in ((0, 3, 10), (16, 20, 5)):
        clock = StepClock(start_step=start, max_step=last, window=window, world_size=2, samples_per_step=8,
                          tokens_per_step=1024, flops_per_step=10**12, available_flops=10**13, started=now[0])
        for step in range(start + 1, last + 1):
            now[0] += 0.25
            logged = clock.tick(step)
        assert logged == pytest.approx({"tokens_per_sec": 4096, "tokens_per_sec_per_device": 2048,
                                        "samples_per_sec": 32, "tflops_per_sec_per_device": 4, "mfu": 0.4})


def test_the_eta_leaves_out_what_only_the_start_pays(monkeypatch) -> None:
    """A first step of 60 s (--compile), then steps of 0.5 s: at step 11 of 100 the ETA said 526 s for 44.5."""
    now = [0.0]
    monkeypatch.setattr(observe.time, "perf_counter", lambda: now[0])
    clock = StepClock(start_step=0, max_step=100, window=5, world_size=1, samples_per_step=8, tokens_per_step=1024,
                      started=0.0)
    now[0] += 60.0
    clock.tick(1)
    assert clock.eta(1) == pytest.approx(60.0 * 99), "one step: all there is to go by"
    for step in range(2, 12):
        now[0] += 0.5
        clock.tick(step)
    assert clock.eta(11) == pytest.approx(0.5 * 89)
    clock.rewind(5)  # a rollback of 5 steps: the 10 steps since the first still took 0.5 s each
    assert clock.eta(6) == pytest.approx(0.5 * 94)


def test_checkpoints_hold_the_hugging_face_state_dict(fsdp_run, tiny) -> None:
    names = sorted(p.name for p in (fsdp_run / "checkpoints").iterdir())
    assert names == ["best.json", "step-00000008.ckpt", "step-00000016.ckpt", "step-00000024.ckpt"]
    checkpoint = read_checkpoint(fsdp_run / "checkpoints" / "step-00000016.ckpt")
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config)).state_dict()
    assert {k: v.shape for k, v in checkpoint["model"].items()} == {k: v.shape for k, v in reference.items()}
    assert checkpoint["step"] == 16 and isinstance(checkpoint["step"], int)
    assert checkpoint["schedule"] == {"step": 16, "length": 24}, "where a resume at another batch takes the lr from"
    assert checkpoint["config"]["lr"] == 3e-3 and checkpoint["tokenizer"] == str(tiny.tokenizer)
    assert Path(checkpoint["cwd"]).is_dir(), "where the config's relative paths lead, for convert_to_hf.py"
    assert checkpoint["model_config"]["hidden_size"] == 64


def test_resume_continues_at_the_next_step_with_the_same_lr_and_losses(fsdp_run, tiny, tmp_path) -> None:
    """From a checkpoint copied under a name of the user's (the step is read from it), older than the run's newest:
    that one is set aside, else the next --resume true would continue from it and undo this run. The resumed run
    also traces steps 18 and 19 with --profile_steps, which changes none of its numbers."""
    straight = read_metrics(fsdp_run)
    checkpoint = tmp_path / "chosen.ckpt"
    shutil.copy(fsdp_run / "checkpoints" / "step-00000016.ckpt", checkpoint)
    result = run_train(train_args(tiny, fsdp_run, resume=True, checkpoint=checkpoint, tensorboard=True,
                                  profile_steps="18:19"))
    assert_succeeded(result)
    assert_profiled(fsdp_run / "profile", result.stdout, first=18, last=19, ranks=2)
    summary = json.loads((fsdp_run / "summary.json").read_text())
    assert summary["train_sec"] + summary["eval_sec"] + summary["save_sec"] + summary["trace_sec"] == pytest.approx(
        summary["elapsed_sec"]) and summary["trace_sec"] > 0, "writing the trace is not training time"
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert progress[0].startswith("step 17/24"), progress[:2]
    set_aside = fsdp_run / "checkpoints" / "rolled-back" / "step-00000024.ckpt"
    assert f"set aside, of the stretch this resume abandons: {set_aside}" in result.stdout
    assert set_aside.is_file() and (fsdp_run / "checkpoints" / "step-00000024.ckpt").is_file()
    resumed = read_metrics(fsdp_run)
    assert sorted(resumed) == list(range(0, 25))
    for step in range(17, 25):
        assert resumed[step]["lr"] == straight[step]["lr"]
        assert resumed[step]["train_loss"] == pytest.approx(straight[step]["train_loss"], rel=1e-5)
    elapsed = [resumed[step]["elapsed_sec"] for step in range(1, 25)]
    assert elapsed == sorted(elapsed), "the run's time continues from the checkpoint's (it began again at 0)"
    assert resumed[17]["elapsed_sec"] > straight[16]["elapsed_sec"] == resumed[16]["elapsed_sec"]
    per_step = straight[1]["tokens_seen"]
    assert per_step > 0 and [resumed[step]["tokens_seen"] for step in range(1, 25)] == [
        step * per_step for step in range(1, 25)], "the trained tokens so far, continued from the checkpoint's"
    assert_tensorboard_shows_metrics_csv(fsdp_run, resumed, abandoned=range(17, 25))


def assert_profiled(folder: Path, stdout: str, first: int, last: int, ranks: int) -> None:
    """Each rank's trace of the steps first..last, with the model's matrix products and FSDP's collectives, and its
    table of operators; said once."""
    name = f"steps-{first}-{last}-rank"
    assert sorted(path.name for path in folder.iterdir()) == sorted(
        f"{name}-{rank}.{kind}" for rank in range(ranks) for kind in ("json.gz", "txt"))
    for rank in range(ranks):
        events = {event.get("name", "") for event in json.loads(
            gzip.decompress((folder / f"{name}-{rank}.json.gz").read_bytes()))["traceEvents"]}
        assert len({event for event in events if event.startswith("ProfilerStep#")}) == last - first + 1, rank
        assert "aten::mm" in events and any(event.startswith("c10d::") for event in events), rank
        assert "aten::mm" in (folder / f"{name}-{rank}.txt").read_text()
    assert stdout.count(f"step {last}: steps {first}-{last} traced in {folder}: a trace per rank for") == 1


def test_a_resumed_run_traces_what_is_left_of_its_profile_window() -> None:
    from app.metrics.profiling import profile_window, steps_to_trace

    assert profile_window("10:12") == (10, 12) and profile_window(" 10 ") == (10, 10) and profile_window(None) is None
    assert steps_to_trace((10, 12), start_step=0, max_step=20) == (10, 12)
    assert steps_to_trace((10, 12), start_step=10, max_step=20) == (11, 12), "resumed inside the window: its rest"
    assert steps_to_trace((10, 12), start_step=12, max_step=20) is None, "resumed after it: nothing"
    assert steps_to_trace((10, 12), start_step=0, max_step=11) == (10, 11), "up to the run's last step"


def test_the_start_says_which_steps_of_the_window_the_run_traces(capsys) -> None:
    from types import SimpleNamespace

    from app.optimization.schedule import make_plan
    from app.training.preflight.plan import check_profile_window

    plan = make_plan(train_rows=647, block_size=32, world_size=1, micro_batch_size=4, accumulation=1, number_epochs=1,
                     max_step=20)

    def said(window: str, start_step: int) -> tuple[list[str], str]:
        problems: list[str] = []
        check_profile_window(SimpleNamespace(profile_steps=window), plan, start_step, problems)
        return problems, capsys.readouterr().out.strip()

    assert said("18:25", 0) == ([], "--profile_steps 18:25: the run ends at step 20: steps 18-20 are traced")
    assert said("5:8", 6) == ([], "--profile_steps 5:8: this run resumes at step 6: steps 7-8 are traced")
    assert said("5:8", 9) == ([], "--profile_steps 5:8: this run resumes at step 9: nothing is traced")
    assert said("5:8", 0) == ([], "")
    assert said("21:22", 0) == (["--profile_steps 21:22: the run ends at step 20; give steps up to it"], "")


def test_a_trace_holds_its_steps_after_a_warm_up_step_and_a_window_cut_short_is_named_by_the_steps_it_holds(
        tmp_path) -> None:
    """--profile_steps 2:4 in a run that a signal ends after step 3: steps 2 and 3 are traced (step 1 warmed the
    profiler up and is not), under their own numbers."""
    from torch.profiler import record_function

    from app.metrics.profiling import profiled_steps

    said: list[str] = []
    with profiled_steps((2, 4), 0, 10, tmp_path, 0, said.append) as trace_step:
        for step in (1, 2, 3):
            trace_step(step - 1)
            with record_function(f"work of step {step}"):
                torch.ones(8, 8) @ torch.ones(8, 8)
    folder = tmp_path / "profile"
    assert said == [f"step 3: steps 2-3 traced in {folder}: a trace per rank for https://ui.perfetto.dev, and the "
                    "slowest operators"]
    events = {event.get("name") for event in json.loads(
        gzip.decompress((folder / "steps-2-3-rank-0.json.gz").read_bytes()))["traceEvents"]}
    assert {"work of step 2", "work of step 3"} <= events and "work of step 1" not in events


def test_a_trace_the_disk_refuses_is_one_warning_and_training_goes_on(read_only_folder, capsys) -> None:
    from app.metrics.profiling import profiled_steps

    said: list[str] = []
    with profiled_steps((1, 1), 0, 10, read_only_folder, 3, said.append) as trace_step:
        trace_step(0)
        torch.ones(8, 8) @ torch.ones(8, 8)
        trace_step(1)
    assert said == [] and capsys.readouterr().err.count(
        "warning: rank 3: --profile_steps: the trace of steps 1-1 could not be written (Read-only file system); "
        "training goes on") == 1


def assert_tensorboard_shows_metrics_csv(out_dir: Path, metrics: dict[int, dict[str, float]],
                                         abandoned: range) -> None:
    """out_dir/tensorboard as TensorBoard shows it: every metrics.csv cell at its step, each step once, though the
    steps a resume abandoned were written twice; and the run's options as hyperparameters."""
    written, shown = tensorboard_scalars(out_dir / "tensorboard")
    assert len(list((out_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2, "one file a start, rank 0's"
    assert [step for step, _ in written["train_loss"]].count(abandoned[0]) == 2, "the abandoned stretch was logged"
    assert {tag: sorted({step for step, _ in points}) for tag, points in shown.items()} == {
        tag: [step for step, _ in points] for tag, points in shown.items()}, "a step shown twice"
    assert {(tag, step) for tag, points in shown.items() for step, _ in points} == {
        (column, step) for step, row in metrics.items() for column in row}
    for tag in ("train_loss", "val_loss", "lr"):
        assert {step: value for step, value in shown[tag]} == pytest.approx(
            {step: row[tag] for step, row in metrics.items() if tag in row}, rel=1e-6), tag
    options = tensorboard_options(out_dir / "tensorboard")
    assert options["micro_batch_size"] == 4 and options["resume"] is True and options["tensorboard"] is True
    assert {name.split("/")[0] for name in options} <= {option.name for option in fields(Config)}, "options only"


def test_a_new_run_starts_from_a_checkpoints_weights_in_another_layout(fsdp_run, tiny, tmp_path, capsys) -> None:
    """--init_from: the weights of the FSDP run's step 16, read into DDP's layout, with a fresh optimizer and
    schedule (here warmup-stable-decay: --lr_decay_ratio 0.4, linear); the new run's baseline is the validation loss
    the checkpoint's run measured at that step. A relaunch with --resume true continues the new run, and the
    checkpoint it started from stays the one recorded, whatever the path given names by then."""
    from app.checkpoint import read_tensors
    from app.training.preflight import preflight
    from arguments import parse_config

    start = fsdp_run / "checkpoints" / "step-00000016.ckpt"
    run = tmp_path / "phase-2"
    result = run_train(train_args(tiny, run, model_config=None, init_from=start, strategy="ddp", max_step=5,
                                  warmup_steps=2, lr_decay_ratio=0.4, lr_decay_type="linear", save_step_interval=100))
    assert_succeeded(result)
    assert f"started from the weights of {start} (step 16 of its run)" in result.stdout
    metrics, straight = read_metrics(run), read_metrics(fsdp_run)
    assert metrics[0]["val_loss"] == pytest.approx(straight[16]["val_loss"], rel=1e-6), "the checkpoint's weights"
    assert [metrics[step]["lr"] for step in range(1, 6)] == pytest.approx([1.5e-3, 3e-3, 3e-3, 1.65e-3, 3e-4]), (
        "warmup over 2 steps from the first, lr until the last 40% of 5 steps, then a linear fall to --min_lr")
    assert metrics[1]["tokens_seen"] == straight[1]["tokens_seen"]
    moments = read_tensors(run / "checkpoints" / "step-00000005.ckpt", "optimizer.state.model.norm.weight.step")
    assert [float(value) for value in moments.values()] == [5.0], "AdamW's own 5 steps, not 21 with the checkpoint's 16"
    evaluated = tmp_path / "evaluated"  # the checkpoint alone, evaluated: --eval_only
    shutil.copytree(tiny.data, tmp_path / "copy")  # the same rows in a folder the run does not train on
    result = run_train(train_args(tiny, evaluated, model_config=None, init_from=start, eval_only=True,
                                  eval_data_dir=f"again={tmp_path / 'copy'}"))
    assert_succeeded(result)
    assert "summary: evaluated in " in result.stdout and "spike guard" not in result.stdout
    assert read_metrics(evaluated) == {0: {"val_loss": metrics[0]["val_loss"], "val_ppl": metrics[0]["val_ppl"],
                                           "val_loss/again": metrics[0]["val_loss"]}}, "--eval_data_dir's too"
    summary = json.loads((evaluated / "summary.json").read_text())
    assert summary["val_loss"] == metrics[0]["val_loss"] and not (evaluated / "checkpoints").exists()
    assert summary["val_loss/again"] == metrics[0]["val_loss"], "each evaluated folder's loss in the summary too"
    capsys.readouterr()
    inputs = preflight(parse_config(train_args(tiny, run, model_config=None, init_from=fsdp_run, resume=True,
                                               max_step=6, warmup_steps=2)))
    assert f"--init_from {fsdp_run}: not read: --resume true continues this run from its checkpoint at step 5 (it " \
           f"started from {start})" in capsys.readouterr().out and inputs.config.init_from == str(start)


@pytest.mark.parametrize("layout", [dict(strategy="fsdp"), dict(strategy="ddp", gradient_checkpointing=True)],
                         ids=["fsdp-flat-parameters", "ddp-activation-checkpointing"])
def test_frozen_parameters_stay_as_they_were_and_the_others_train(fsdp_run, tiny, tmp_path, layout) -> None:
    """--freeze: FSDP1 flattens frozen and trained weights of a layer into one parameter, and activation
    checkpointing recomputes layers whose inputs (from a frozen embedding) need no gradient; either could have left
    a frozen weight moving, or a trained one still."""
    start = fsdp_run / "checkpoints" / "step-00000016.ckpt"
    result = run_train(train_args(tiny, tmp_path, model_config=None, init_from=start, max_step=2, warmup_steps=0,
                                  save_step_interval=100, freeze=r"[embed_tokens, layers\.0\.self_attn]", **layout))
    assert_succeeded(result)
    saved = tmp_path / "checkpoints" / "step-00000002.ckpt"
    before, after = (read_checkpoint(path)["model"] for path in (start, saved))
    frozen = {name for name in before if "embed_tokens" in name or "layers.0.self_attn" in name}
    assert frozen and all(torch.equal(before[name], after[name]) for name in frozen)
    assert all(not torch.equal(before[name], after[name]) for name in before if name not in frozen and "weight" in name
               and "norm" not in name), "every other weight trained"
    assert not any(name.startswith("optimizer.state.model.embed_tokens") for name in stored_names(saved)), (
        "no optimizer state for what does not train")


def stored_names(path: Path) -> set[str]:
    from app.checkpoint import stored_tensor_shapes

    return set(stored_tensor_shapes(path))


def test_a_run_whose_validation_loss_stops_improving_stops_early_and_saves(tiny, tmp_path) -> None:
    """--early_stopping_patience 2: a rate too small to move the loss by --early_stopping_threshold, so the
    evaluations after step 0's make no progress; the run saves at the second and ends as finished (exit 0). The same
    command with --resume true (a relaunch) trains nothing: it trained on past the stop. A resume whose validation
    reads other rows counts anew: it compared their losses with the best of the others, and stopped a run whose loss
    was still falling on them."""
    from app.training.loop import count_improvement

    state = {"best_val_loss": None, "evaluations_without_improvement": 0}
    for loss in (3.0, 2.9, 2.895, 2.95):
        count_improvement(state, loss, threshold=0.01)
    assert state == {"best_val_loss": 2.9, "evaluations_without_improvement": 2}, "2.895 is no fall of 0.01"
    command = dict(devices=1, strategy="single_device", lr=1e-9, min_lr=None, lr_decay=False, warmup_steps=0,
                   max_step=10, eval_step_interval=1, save_step_interval=100, early_stopping_patience=2,
                   early_stopping_threshold=0.01)
    result = run_train(train_args(tiny, tmp_path, **command))
    assert_succeeded(result)
    assert "step 2: 2 evaluations without a validation loss below " in result.stdout, result.stdout
    assert sorted(read_metrics(tmp_path)) == [0, 1, 2] and (tmp_path / "checkpoints" / "step-00000002.ckpt").is_file()
    summary = (tmp_path / "summary.json").read_text()
    relaunched = run_train(train_args(tiny, tmp_path, resume=True, **command))
    assert_succeeded(relaunched)
    assert "--resume: the checkpoint at step 2 is where early stopping ends this run (2 evaluations without a " \
           "validation loss below " in relaunched.stdout + relaunched.stderr
    assert sorted(read_metrics(tmp_path)) == [0, 1, 2] and (tmp_path / "summary.json").read_text() == summary
    other_rows = run_train(train_args(tiny, tmp_path, resume=True, **command | dict(eval_iters=1)))
    assert_succeeded(other_rows)
    assert "step 5: 2 evaluations without a validation loss below " in other_rows.stdout, other_rows.stdout
    assert sorted(read_metrics(tmp_path)) == [0, 1, 2, 3, 4, 5]
    assert "no checkpoint holds" not in result.stdout + other_rows.stdout, "the saved loss is the lowest, or near it"
    diverged = run_train(train_args(tiny, tmp_path / "diverged", **command | dict(lr=1.0)))
    assert_succeeded(diverged)
    metrics = read_metrics(tmp_path / "diverged")
    assert sorted(metrics) == [0, 1, 2] and metrics[2]["val_loss"] > metrics[0]["val_loss"] + 0.1
    assert (f"but its step-00000002.ckpt validated at {metrics[2]['val_loss']:.4f}, and the lowest loss, "
            f"{metrics[0]['val_loss']:.4f}, was of weights no checkpoint holds") in diverged.stdout, diverged.stdout


def test_memory_and_scheduling_knobs_leave_the_losses_unchanged(fsdp_run, tiny, tmp_path) -> None:
    """Replication instead of sharding, activation checkpointing (of one layer in two), prefetching and all-gather
    throttling trade memory for time, never the maths: the same losses, and the same gradient norm whether each rank
    holds half of the gradient (FULL_SHARD) or all of it (NO_SHARD)."""
    result = run_train(train_args(tiny, tmp_path, max_step=4, gradient_checkpointing=True, save_step_interval=100,
                                  gradient_checkpointing_every=2, sharding_strategy="NO_SHARD",
                                  backward_prefetch="BACKWARD_POST", forward_prefetch=True, limit_all_gathers=False))
    assert_succeeded(result)
    output = result.stdout + result.stderr  # torch's deprecation of FSDP1's NO_SHARD, twice on every rank, was
    assert "deprecated" not in output and output.count("torch deprecates --sharding_strategy NO_SHARD") == 1
    straight = read_metrics(fsdp_run)
    with_knobs = read_metrics(tmp_path)
    for step in (1, 2, 3, 4):
        assert with_knobs[step]["train_loss"] == pytest.approx(straight[step]["train_loss"], rel=1e-5)
        assert with_knobs[step]["grad_norm"] == pytest.approx(straight[step]["grad_norm"], rel=1e-5)


def short_run(tiny, out_dir: Path, env: dict[str, str] | None = None,
              **overrides: object) -> dict[int, dict[str, float]]:
    """Six steps, evaluated and saved at the end; returns the metrics after checking the checkpoint."""
    options = dict(max_step=6, eval_step_interval=6, save_step_interval=6, warmup_steps=1) | overrides
    assert_succeeded(run_train(train_args(tiny, out_dir, **options), env=env))
    checkpoint = read_checkpoint(out_dir / "checkpoints" / "step-00000006.ckpt")
    assert "model.embed_tokens.weight" in checkpoint["model"] and checkpoint["step"] == 6
    metrics = read_metrics(out_dir)
    assert metrics[6]["train_loss"] < metrics[1]["train_loss"] and "val_loss" in metrics[6]
    return metrics


def test_single_process_run_logs_to_wandb_offline_with_checkpoint_artifacts(tiny, tmp_path) -> None:
    """WANDB_MODE chooses, as wandb's users set it (docker/run.sh forwards it): no --wandb_mode here."""
    short_run(tiny, tmp_path, env={"WANDB_MODE": "offline"}, strategy="single_device", devices=1,
              save_step_interval=3, wandb_mode=None, log_model="all")
    [run_log] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    recorded = run_log.read_bytes()
    assert b"val_loss" in recorded and b"train_loss" in recorded and b"trainer/global_step" in recorded
    assert b"step-00000003.ckpt" in recorded and b"step-00000006.ckpt" in recorded
    assert b"attempt/train_sec" in recorded, "the run summary, written when W&B finishes the run as the process leaves"
    assert b"attempt/elapsed_sec" in recorded, "its own names: the history's elapsed_sec is the run's, not this start's"
    again = run_train(train_args(tiny, tmp_path, max_step=6, eval_step_interval=6, save_step_interval=3,
                                 warmup_steps=1, strategy="single_device", devices=1, wandb_mode=None, resume=True,
                                 checkpoint=tmp_path / "checkpoints" / "step-00000003.ckpt"),
                      env={"WANDB_MODE": "offline"})
    assert_succeeded(again)
    assert ("--resume: the Weights & Biases run keeps steps 4-6, logged after step 3 by the stretch this resume "
            "abandons") in again.stdout, "W&B cannot cut a run's history: the resume says what it keeps twice"
    assert ("the offline W&B model artifacts of checkpoints after step 3 refer to files this resume moves to "
            "checkpoints/rolled-back/") in again.stdout, "step 6's artifact would sync the file saved again there"
    assert len({log.name.split("-")[-1] for log in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")}) == 1


def test_an_offline_run_logs_its_last_checkpoint_with_older_ones_pruned(tiny, tmp_path) -> None:
    """--log_model true with --keep_last_n, offline: waiting for the upload (online, before --keep_last_n may delete
    the file) raised ArtifactNotLoggedError at the last save, as offline there is nothing to wait for."""
    short_run(tiny, tmp_path, strategy="single_device", devices=1, save_step_interval=3, wandb_mode="offline",
              log_model=True, keep_last_n=1)
    [run_log] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"step-00000006.ckpt" in run_log.read_bytes()


@pytest.mark.parametrize("failure, advice", [
    ("the W&B service did not start", "check the login, --project and --entity"),
    # a container's user without an account (`docker run --user 1234`) and no HOME: it said to check the login
    ("Could not determine home directory.", "set HOME or WANDB_CONFIG_DIR to a folder this user can write (a "
                                            "container's user without an account has no home, where wandb keeps its "
                                            "settings)")])
def test_a_wandb_run_that_cannot_start_ends_every_rank_with_one_line(tiny, tmp_path, failure, advice) -> None:
    """wandb.init failing on rank 0 (a login or project the server refuses, a service that does not start) was
    wandb's traceback; here a wandb whose init fails as the real one does, in a 2-process run."""
    fake = tmp_path / "site" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"def init(**options):\n    raise RuntimeError({failure!r})\n")
    result = run_train(train_args(tiny, tmp_path / "out", wandb_mode="offline"),
                       env={"PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"error: Weights & Biases could not start the run ({failure}); {advice}, or use --wandb_mode disabled" \
        in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not list((tmp_path / "out").glob("checkpoints/*"))


def test_a_one_process_run_without_validation_prints_only_what_a_user_can_act_on(tiny, tmp_path) -> None:
    """Data prepared with --val_fraction 0 (which train.py used to refuse) trains without evaluating; FSDP on one
    process with sharded saves, on a machine where Slurm's srun exists, and no W&B choice: none of FSDP's NO_SHARD,
    DCP's single-process or Lightning's srun warnings, no start-up banner, one line about W&B and nothing written
    for it."""
    data = tmp_path / "data"
    prepare(PrepareArgs(input=stdlib_corpus_paths(("json",)), output_dir=str(data), tokenizer=str(tiny.tokenizer),
                        block_size=BLOCK_SIZE, val_fraction=0.0))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    result = run_train(train_args(tiny, tmp_path / "out", train_data_dir=data, devices=1, max_step=4, warmup_steps=0,
                                  save_step_interval=2, state_dict_type="sharded", wandb_mode=None),
                       env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert_succeeded(result)
    output = result.stdout + result.stderr
    assert "has no validation rows (prepared with --val_fraction 0): the run trains without evaluating" in output
    metrics = read_metrics(tmp_path / "out")
    assert sorted(metrics) == [1, 2, 3, 4] and not any("val_loss" in row for row in metrics.values())
    assert (tmp_path / "out" / "checkpoints" / "step-00000004.ckpt").is_dir()
    evaluated = tmp_path / "evaluated"  # the same data with a folder of --eval_data_dir: measured from step 0 on
    assert_succeeded(run_train(train_args(tiny, evaluated, train_data_dir=data, devices=1, max_step=2, warmup_steps=0,
                                          eval_step_interval=2, eval_data_dir=f"held={tiny.data}")))
    metrics = read_metrics(evaluated)
    assert [step for step, row in sorted(metrics.items()) if "val_loss/held" in row] == [0, 2]
    assert not any("val_loss" in row for row in metrics.values()), "val_loss is the training data's alone"
    for noise in ("NO_SHARD", "torch.distributed is disabled", "srun", "Initializing distributed", "distributed_backend",
                  "Seed set", "Warning"):
        assert noise not in output, noise
    assert output.count("Weights & Biases") == 1 and "wandb" not in output.replace("--wandb_mode", "")
    assert not (tmp_path / "out" / "wandb").exists()


def test_validation_turned_off_reads_no_validation_row(tiny, tmp_path) -> None:
    """Seed 002's --run_validation false: validation could not be turned off (`--eval_step_interval 0` was refused,
    "must be at least 1") but by preparing the data again without a validation split."""
    result = run_train(train_args(tiny, tmp_path / "out", devices=1, max_step=4, warmup_steps=0, save_step_interval=2,
                                  eval_step_interval=0, eval_iters=None))
    assert_succeeded(result)
    metrics = read_metrics(tmp_path / "out")
    assert sorted(metrics) == [1, 2, 3, 4] and not any("val_loss" in row for row in metrics.values())
    assert not (tmp_path / "out" / "checkpoints" / "best.json").exists()
    assert "validation reads" not in result.stdout + result.stderr
    evaluated = tmp_path / "evaluated"  # a run with a best checkpoint, resumed with validation turned off
    assert_succeeded(run_train(train_args(tiny, evaluated, devices=1, max_step=4, warmup_steps=0, save_step_interval=4,
                                          eval_step_interval=4)))
    resumed = run_train(train_args(tiny, evaluated, devices=1, max_step=6, warmup_steps=0, save_step_interval=2,
                                   eval_step_interval=0, eval_iters=None, resume=True))
    assert_succeeded(resumed)
    assert "--eval_step_interval 0: the run's best checkpoint stays step 4's (best.json, from before validation was " \
           "turned off), and --keep_last_n keeps it" in resumed.stdout + resumed.stderr


def test_on_a_terminal_every_log_interval_stays_in_the_scrollback_and_the_bar_has_one_eta(capsys) -> None:
    console = Console(enabled=True, start_step=0, max_step=4, interactive=True)
    for step in (1, 2, 3, 4):
        console.advance()
        if step % 2 == 0:
            console.report(step, 4, {"train_loss": 5.0 / step, "lr": 1e-3}, eta=30.0 - step)
    console.close()
    output = capsys.readouterr().out
    lines = [line for line in output.replace("\r", "\n").splitlines() if line.startswith("step ")]
    assert lines == ["step 2/4 | loss 2.5000 | lr 1.00e-03 | eta 28.0s",
                     "step 4/4 | loss 1.2500 | lr 1.00e-03 | eta 26.0s"]
    bar = output.replace("\r", "\n").splitlines()[-1]
    assert bar.count("eta") == 1 and "eta 26.0s" in bar and "<" not in bar, bar


def test_a_micro_batch_graph_is_gone_before_the_next_micro_batch_forward() -> None:
    """Backward frees a graph's saved tensors but not its nodes, which the loss keeps: the previous micro-batch's
    nodes, spread over the heap among its activations, left the next forward's activations less room (peak RSS of the
    largest rank 0.83 against 0.79 GB on configs/demo-llama, 4 micro-batches of 16 under fsdp). What a node holds
    besides saved tensors lives exactly as long as the node."""
    import weakref

    import torch

    from app.model.loss import LossPath
    from app.optimization.optimizer import GradientPolicy
    from app.reliability.signals import StopRequest
    from app.training.loop import train_step

    class Marker:
        """Held by the loss's last node, as a node holds its attributes."""

    class HeldByTheNode(torch.autograd.Function):
        @staticmethod
        def forward(ctx, loss, marker):
            ctx.marker = marker
            return loss.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class WatchedLoss(LossPath):
        def __init__(self) -> None:
            super().__init__()
            self.previous = None
            self.previous_alive = []

        def summed_loss(self, model, batch):
            self.previous_alive.append(self.previous is not None and self.previous() is not None)
            marker = Marker()
            self.previous = weakref.ref(marker)
            return HeldByTheNode.apply(super().summed_loss(model, batch), marker)

    fabric, model, optimizer, step = one_process_llama(micro_batches=3)
    for defer_sync in (False, True):
        loss_path = WatchedLoss()
        train_step(fabric, model, step, StopRequest(), GradientPolicy(max_norm=1.0, replicas=1, scaled=False,
                                                                      defer_sync=defer_sync), optimizer, loss_path)
        assert loss_path.previous_alive == [False, False, False]
        assert loss_path.previous() is None, "nor after the step"
        optimizer.zero_grad(set_to_none=True)


def test_a_resumed_checkpoint_that_records_no_val_loss_step_names_none_in_the_summary() -> None:
    """A checkpoint written before val_loss_step holds a val_loss but no step: the summary of a resumed run stopped
    before its first evaluation said "val_loss 5.9791 at step None"."""
    from app.metrics.observe import summary_lines

    summary = {"steps": 0, "elapsed_sec": 1.0, "train_sec": 1.0, "eval_sec": 0.0, "save_sec": 0.0,
               "checkpoints_saved": 1, "val_loss": 5.9791, "val_loss_step": None, "ranks": []}
    assert "None" not in summary_lines(summary)[0]


def test_the_run_keeps_only_the_tokenizer_of_a_model_folder_given_as_tokenizer(tiny, tmp_path) -> None:
    """--tokenizer (or --model_name without a data folder tokenizer) naming a model folder: out_dir/tokenizer got a
    copy of the whole folder, weights included (16 GB for Llama-3-8B, copied by rank 0 before the first step)."""
    from transformers import AutoTokenizer

    from app.training.run import keep_tokenizer_with_run

    model = tmp_path / "model"
    AutoTokenizer.from_pretrained(tiny.tokenizer).save_pretrained(model)
    (model / "model.safetensors").write_bytes(b"\0" * 1_000_000)
    keep_tokenizer_with_run(tmp_path / "run", str(model), trust_remote_code=False)
    kept = tmp_path / "run" / "tokenizer"
    assert not (kept / "model.safetensors").exists()
    assert AutoTokenizer.from_pretrained(kept).get_vocab() == AutoTokenizer.from_pretrained(tiny.tokenizer).get_vocab()


def test_the_kept_tokenizer_is_made_durable_before_its_name_appears(tiny, tmp_path, monkeypatch) -> None:
    """A crash after the rename could leave out_dir/tokenizer/ with files the page cache never wrote: a run that
    converts without its data folder had an empty tokenizer.json. What a killed start left is replaced."""
    from app.training.run import keep_tokenizer_with_run

    synced: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd)))
    leftover = tmp_path / "run" / ".tokenizer.partial"
    leftover.mkdir(parents=True)
    (leftover / "tokenizer.json").write_text("{ half")
    keep_tokenizer_with_run(tmp_path / "run", tiny.tokenizer, trust_remote_code=False)
    kept = tmp_path / "run" / "tokenizer"
    assert not leftover.exists() and (kept / "tokenizer.json").stat().st_size > 100
    staged = {Path(path).name for path in synced if "/.tokenizer.partial/" in path}
    assert staged == {path.name for path in kept.iterdir()}, "every file fsynced under its temporary name"
    assert str(kept.parent) in synced, "and the folder that holds the new name"


def test_a_tokenizer_the_run_cannot_copy_is_a_note_not_the_end_of_rank_0(tmp_path, capsys) -> None:
    """Rank 0 copies the tokenizer alone, before the first step: an exception there would leave the other ranks
    waiting in their first collective until a timeout."""
    from app.training.run import keep_tokenizer_with_run

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer_config.json").write_text("{ not json")
    keep_tokenizer_with_run(tmp_path / "run", str(tmp_path / "broken"), trust_remote_code=False)
    assert "note: the run's tokenizer was not copied to" in capsys.readouterr().out
    assert not list(tmp_path.glob("run/*")) and not list(tmp_path.glob("run/.*")), "no copy, nothing half-written"


def test_a_resume_that_cannot_rewrite_metrics_csv_leaves_its_history(tmp_path, monkeypatch) -> None:
    """A resumed run rewrites metrics.csv with the rows up to its step. A full disk (ENOSPC) while writing used to
    leave it truncated, the run's whole history lost; it is written beside and renamed into place."""
    import builtins
    import errno

    from app.metrics.loggers import CSVMetrics

    CSVMetrics(tmp_path).log_hyperparams({})
    for step in (1, 2, 3):
        CSVMetrics(tmp_path).log_metrics({"train_loss": 5.0 - step}, step=step)
    before = (tmp_path / "metrics.csv").read_text()
    real_open = builtins.open

    def no_space(text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def full_disk(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if "w" in mode:
            handle.write = no_space
        return handle

    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(OSError):
        CSVMetrics(tmp_path, resume_step=2).log_hyperparams({})
    monkeypatch.undo()
    assert (tmp_path / "metrics.csv").read_text() == before and os.listdir(tmp_path) == ["metrics.csv"]
    CSVMetrics(tmp_path, resume_step=2).log_hyperparams({})
    assert list(read_metrics(tmp_path)) == [1, 2]


def test_a_resume_keeps_the_columns_of_folders_no_longer_evaluated(tmp_path) -> None:
    """A resume with another --eval_data_dir (or mixture) rewrote metrics.csv under its own header: the history of a
    folder it no longer evaluates was dropped with its column."""
    from app.metrics.loggers import CSVMetrics

    CSVMetrics(tmp_path, evaluated=("forgetting",)).log_hyperparams({})
    for step in (1, 2, 3):
        CSVMetrics(tmp_path, evaluated=("forgetting",)).log_metrics({"val_loss/forgetting": 5.0 - step}, step=step)
    resumed = CSVMetrics(tmp_path, resume_step=2, evaluated=("code",))
    resumed.log_hyperparams({})
    resumed.log_metrics({"val_loss/code": 1.5}, step=3)
    assert read_metrics(tmp_path) == {1: {"val_loss/forgetting": 4.0}, 2: {"val_loss/forgetting": 3.0},
                                      3: {"val_loss/code": 1.5}}


def test_a_resume_keeps_the_history_of_metrics_csv_and_rows_jsonl_in_constant_memory(tmp_path) -> None:
    """The rows up to the resumed step were read whole into memory: a week's metrics.csv at --log_interval 1 took
    10 s and 1.45 GB of rank 0 at every resume, and its peak RSS, which every later row reports, measured that."""
    import tracemalloc

    from app.metrics.loggers import METRICS_FILE, ROWS_FILE, CSVMetrics, RowRecord

    steps = 40_000
    header = "step,train_loss\n"
    (tmp_path / METRICS_FILE).write_text(header + "".join(f"{step},{1 / step:.12f}\n" for step in range(1, steps + 1)))
    (tmp_path / ROWS_FILE).write_text("".join(json.dumps({"step": step, "rows": {"data": list(range(64))}}) + "\n"
                                              for step in range(1, steps + 1)))
    tracemalloc.start()
    CSVMetrics(tmp_path, resume_step=steps - 10).log_hyperparams({})
    RowRecord(tmp_path, resume_step=steps - 10)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 << 20, f"{peak / 2**20:.1f} MB for files of {(tmp_path / ROWS_FILE).stat().st_size / 2**20:.0f} MB"
    assert list(read_metrics(tmp_path))[-1] == steps - 10 and len(list(read_metrics(tmp_path))) == steps - 10
    last = (tmp_path / ROWS_FILE).read_text().splitlines()[-1]
    assert json.loads(last)["step"] == steps - 10


def test_a_save_steps_row_lost_by_an_attempt_that_ended_before_logging_it_is_logged_by_the_resume(tiny,
                                                                                                     tmp_path) -> None:
    """A save step's row is logged once its checkpoint is published (the row holds save_sec). A job whose other task
    froze during step 10's save published step 10, stalled before the row, and resumed at step 11: metrics.csv never
    had step 10 (the fresh-clone CI of 2026-12-03). Here the attempt ends there: step 4's row and everything after
    it are taken away, as is the checkpoint of step 6. The resume logs step 4's row from its checkpoint, as it was
    but for save_sec, and goes on as the run did."""
    from tests.conftest import ONE_PROCESS

    out_dir = tmp_path / "run"
    args = train_args(tiny, out_dir, **(ONE_PROCESS | {"max_step": 6}))
    assert_succeeded(run_train(args))
    straight = read_metrics(out_dir)
    lines = (out_dir / "metrics.csv").read_text().splitlines(keepends=True)
    (out_dir / "metrics.csv").write_text("".join(line for line in lines if not line.startswith(("4,", "5,", "6,"))))
    (out_dir / "checkpoints" / "step-00000006.ckpt").unlink()  # a single file on one process
    assert_succeeded(run_train(args + ["--resume", "true"]))
    resumed = read_metrics(out_dir)
    assert sorted(resumed) == list(range(7)), resumed
    assert "save_sec" in straight[4] and "save_sec" not in resumed[4]
    restored = ("train_loss", "val_loss", "lr", "grad_norm", "tokens_seen")
    assert {name: resumed[4][name] for name in restored} == {name: straight[4][name] for name in restored}
    assert resumed[6]["train_loss"] == pytest.approx(straight[6]["train_loss"], rel=1e-5)


def test_a_lost_row_is_logged_without_the_columns_of_a_folder_this_run_does_not_evaluate(tmp_path) -> None:
    """A resume that evaluates another --eval_data_dir, of a run whose metrics.csv was deleted, writes a file without
    the lost row's `val_loss/<folder>` column (a file kept keeps its columns): that value is left out, where
    metrics.csv refused the row (a KeyError)."""
    from app.metrics.loggers import CSVMetrics, log_lost_row

    metrics_csv = CSVMetrics(tmp_path, resume_step=4)
    metrics_csv.log_hyperparams({})
    log_lost_row([metrics_csv], 4, {"train_loss": 1.5, "val_loss/gone": 2.0})
    assert read_metrics(tmp_path) == {4: {"train_loss": 1.5}}


def test_links_placed_at_the_runs_fixed_names_are_never_written_through(tiny, tmp_path) -> None:
    """A link at `.config.yaml.partial`, `.metrics.csv.partial`, `checkpoints/.best.json.partial` or
    `.tokenizer.partial` had the run overwrite the file it pointed to (and the folder's tokenizer.json); the renames
    then made config.yaml and the others links to them. A link at `.lock` would be truncated: the run is refused."""
    from tests.conftest import ONE_PROCESS

    out_dir, victims = tmp_path / "run", tmp_path / "victims"
    (victims / "folder").mkdir(parents=True)
    (out_dir / "checkpoints").mkdir(parents=True)
    links = {".config.yaml.partial": victims / "config", ".metrics.csv.partial": victims / "metrics",
             "checkpoints/.best.json.partial": victims / "best", ".tokenizer.partial": victims / "folder"}
    (victims / "folder" / "tokenizer.json").write_text("mine")
    for name, target in links.items():
        if not target.is_dir():
            target.write_text("mine")
        (out_dir / name).symlink_to(target)
    result = run_train(train_args(tiny, out_dir, **(ONE_PROCESS | {"max_step": 2})))
    assert_succeeded(result)
    assert [p.read_text() for p in sorted(victims.rglob("*")) if p.is_file()] == ["mine"] * 4
    assert not any(p.is_symlink() for p in out_dir.rglob("*")), "a fixed name became a link"
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / ".lock").symlink_to(victims / "config")
    refused = run_train(train_args(tiny, tmp_path / "again", **(ONE_PROCESS | {"max_step": 2})))
    assert refused.returncode != 0 and ".lock is a symbolic link; remove it" in refused.stdout + refused.stderr
    assert (victims / "config").read_text() == "mine"


def test_a_step_clips_its_gradients_to_grad_clip_before_the_update() -> None:
    """clip_gradients is tested alone; its wiring was not: a step that never clipped passed every test (the losses of
    two runs of the same code agree either way). The weights a step writes equal AdamW's after torch's own
    clip_grad_norm_, and differ from an unclipped step's."""
    import torch

    from app.model.loss import LossPath
    from app.optimization.optimizer import GradientPolicy
    from app.reliability.signals import StopRequest
    from app.training.loop import train_step, update_weights

    def weights_after_one_step(max_norm: float, torch_clips: bool = False) -> list[torch.Tensor]:
        fabric, model, optimizer, step = one_process_llama(micro_batches=2)
        policy = GradientPolicy(max_norm=0.0 if torch_clips else max_norm, replicas=1, scaled=False, defer_sync=False)
        _, verdict = train_step(fabric, model, step, StopRequest(), policy, optimizer, LossPath())
        if torch_clips:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        update_weights(optimizer, verdict, 1e-2, policy, lambda: None)
        return [p.detach().clone() for p in model.parameters()]

    clipped, by_torch, unclipped = weights_after_one_step(1e-3), weights_after_one_step(1e-3, True), \
        weights_after_one_step(0.0)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(clipped, by_torch))
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(clipped, unclipped))


def test_a_metrics_row_cut_short_by_a_kill_is_dropped_at_the_resume(tmp_path) -> None:
    """A kill while a row was appended left part of it; the resume kept it, padded with empty fields and holding a
    truncated number (lr 0.00293392629699)."""
    from app.metrics.loggers import CSVMetrics

    CSVMetrics(tmp_path).log_hyperparams({})
    for step in (1, 2):
        CSVMetrics(tmp_path).log_metrics({"train_loss": 5.0 - step, "lr": 0.0029339262969923}, step=step)
    whole = (tmp_path / "metrics.csv").read_text()
    (tmp_path / "metrics.csv").write_text(whole + "3,2.5,0.00293392629699")
    CSVMetrics(tmp_path, resume_step=3).log_hyperparams({})
    assert (tmp_path / "metrics.csv").read_text() == whole


def test_a_resume_after_a_rollback_keeps_metrics_csv_and_rows_jsonl_as_the_run_wrote_them(tmp_path) -> None:
    """A rollback at 35 to 32 logs 33 and 34 again: `…32, 33, 34, 33, 34, 35`. Resumed from the second 33, the files
    kept the abandoned 33 but not the abandoned 34 (rows up to step 33 wherever they stood); they now keep what
    the run had written up to the resumed step."""
    from app.metrics.loggers import ROWS_FILE, CSVMetrics, RowRecord

    steps = [32, 33, 34, 33, 34, 35]
    CSVMetrics(tmp_path).log_hyperparams({})
    for index, step in enumerate(steps):
        CSVMetrics(tmp_path).log_metrics({"train_loss": float(index)}, step=step)
    (tmp_path / ROWS_FILE).write_text("".join(json.dumps({"step": step, "rows": {"data": [index]}}) + "\n"
                                              for index, step in enumerate(steps)))
    CSVMetrics(tmp_path, resume_step=33).log_hyperparams({})
    RowRecord(tmp_path, resume_step=33)
    with open(tmp_path / "metrics.csv", newline="") as handle:
        assert [(int(row["step"]), float(row["train_loss"])) for row in csv.DictReader(handle)] == [
            (32, 0.0), (33, 1.0), (34, 2.0), (33, 3.0)]
    assert [json.loads(line)["rows"]["data"] for line in (tmp_path / ROWS_FILE).read_text().splitlines()] == [
        [0], [1], [2], [3]]
    CSVMetrics(tmp_path, resume_step=32).log_hyperparams({})
    assert list(read_metrics(tmp_path)) == [32], "a resume from before the rollback drops all of its stretch"


def test_tensorboard_shows_a_resumed_run_once_and_its_writer_is_closed_as_the_process_exits(tmp_path,
                                                                                          monkeypatch) -> None:
    """A start logs steps 1-4; a resume from step 2 logs 3-5 again: TensorBoard shows 1-2 of the first and 3-5 of the
    second (the purge marker at 3), per-folder keys included. A resume from 3 with --tensorboard off trains 4-6
    unseen, and one from 6 with it on again shows 7: 4 and 5 of the second start are gone, which that resume
    abandoned. A rollback from 8 to 7 logs 8 again: shown once, its second value. The writer flushes every two
    minutes: its rows reach the file through the exit hook that every end of a run calls."""
    from app.metrics.loggers import TensorBoardMetrics, forget_after, forget_in_folder, purge_step
    from app.reliability import watchdog

    assert (purge_step(None), purge_step(0), purge_step(2)) == (0, 1, 3)
    monkeypatch.setattr(watchdog, "EXIT_HOOKS", [])
    for start, steps in ((None, range(1, 5)), (2, range(3, 6)), (3, None), (6, (7, 8, "rollback to 7", 8))):
        if steps is None:  # --tensorboard off
            forget_in_folder(tmp_path, start)
        else:
            logger = TensorBoardMetrics(tmp_path, resume_step=start)
            logger.log_hyperparams({"lr": 0.1, "freeze": ["embed"], "model_overrides": None})
            for step in steps:
                if step == "rollback to 7":
                    forget_after([logger], 7)
                    start = 9
                else:
                    logger.log_metrics({"train_loss": 10.0 * (start or 1) + step, "val_loss/code": 0.5}, step=step)
            watchdog.run_exit_hooks(0, timeout_sec=None)
        time.sleep(1.01 - time.time() % 1)  # a file is named by its start's second: a run's starts are seconds apart
    _, shown = tensorboard_scalars(tmp_path / "tensorboard")
    assert shown["train_loss"] == [(1, 11.0), (2, 12.0), (3, 23.0), (7, 67.0), (8, 98.0)]
    assert shown["val_loss/code"] == [(step, 0.5) for step in (1, 2, 3, 7, 8)]
    assert tensorboard_options(tmp_path / "tensorboard") == {"lr": 0.1, "freeze": "['embed']",
                                                             "model_overrides": "None"}
