"""--async_save: a background save holds exactly its step's state while later steps train, and a crash during its
write leaves the previous checkpoint as the one resume takes.

The hand-over between the writing thread and the next weight update is shown in one process with a write or copy
held back on purpose; whole runs are train.py in 2 real FSDP processes on CPU, and the crash is a real SIGKILL.
"""

from __future__ import annotations

import csv
import json
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

from app.checkpoint import list_checkpoints
from conftest import TinySetup, launched, one_process_llama, read_checkpoint, run_train, train_args


def linear_state() -> dict:
    model = torch.nn.Linear(256, 128)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": 1}


def update_and_check(saver, path: Path, state: dict) -> None:
    """The optimizer step that follows (after `before_update`), then the end of the run: the checkpoint holds the
    weights of the step that saved."""
    from app.checkpoint import read_model_weights

    model = state["model"]
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    saver.close()
    stored = read_model_weights(path)
    for name, value in saved.items():
        assert torch.equal(stored[name], value), name


@pytest.mark.parametrize("sharded", [False, True])
def test_a_background_save_holds_its_steps_state_even_when_its_write_outlasts_the_next_forward_and_backward(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool):
    """A background save writes the training state itself while the next step computes; `before_update`, which the
    next weight update waits for, waits for the piece being written and copies those not yet written: the
    checkpoint never holds weights of a later step. (A full file's pieces are written from where they lie only if
    they lie there as in the file; here all are.)"""
    from lightning_fabric import Fabric

    from app.checkpoint import CheckpointSaver, writers
    from app.checkpoint.handover import Handover

    monkeypatch.setattr(writers, "lies_as_in_the_file", lambda data, phase: True)
    state = linear_state()
    saver = CheckpointSaver(Fabric(accelerator="cpu", devices=1), state, sharded=sharded, background=True)
    reading, writing, release = Handover.reading, threading.Event(), threading.Event()

    @contextmanager
    def slow_reading(handover: Handover, key: object) -> Iterator[torch.Tensor]:
        with reading(handover, key) as data:
            if not writing.is_set():  # the first piece: still being written when the update comes
                writing.set()
                release.wait(timeout=60)
            yield data

    monkeypatch.setattr(Handover, "reading", slow_reading)
    path, published = tmp_path / "step-00000001.ckpt", []
    saver.save(path, state, lambda: published.append(path))
    handover = saver.handover
    assert writing.wait(timeout=60), "the write began"
    threading.Timer(0.3, release.set).start()  # the next forward and backward end before the piece is written
    saver.before_update()
    assert release.is_set() and len(handover.done) >= 1, "before_update() waited for the piece being written"
    assert set(handover.copies) == set(handover.live) - {next(iter(handover.live))}, "and copied the others"
    update_and_check(saver, path, state)
    assert published == [path]


def test_a_background_save_of_pieces_on_a_gpu_holds_its_steps_state_even_when_their_copy_outlasts_the_next_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Pieces a disk cannot write from (a GPU's memory, or a full file's pieces lying otherwise than in the file)
    are copied to host memory while the next step computes; `before_update` returns only once the copy is made.
    Shown with host pieces taken for a GPU's."""
    from lightning_fabric import Fabric

    from app.checkpoint import CheckpointSaver
    from app.checkpoint import writers
    from app.checkpoint.writers import StagingArea

    monkeypatch.setattr(writers, "lies_as_in_the_file", lambda data, phase: False)
    state = linear_state()
    saver = CheckpointSaver(Fabric(accelerator="cpu", devices=1), state, sharded=False, background=True)
    copy, release, copied = StagingArea.copy, threading.Event(), threading.Event()

    def slow_copy(area: StagingArea, *args: object) -> dict:
        release.wait(timeout=60)
        staged = copy(area, *args)
        copied.set()
        return staged

    monkeypatch.setattr(StagingArea, "copy", slow_copy)
    path = tmp_path / "step-00000001.ckpt"
    saver.save(path, state, lambda: None)
    assert not copied.is_set(), "save() returned before the copy"
    assert not saver.handover.live, "no piece is written from where it lies"
    threading.Timer(0.3, release.set).start()  # the copy is made while the next step would compute
    saver.before_update()
    assert copied.is_set(), "before_update() returned once the copy was made"
    update_and_check(saver, path, state)


def test_a_background_write_that_failed_ends_the_run_at_the_next_step(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk during a background write used to show only at the next save (or the end of the run): every step
    in between was trained for nothing. The step's verdict carries `failed()` to every rank; `wait` raises it."""
    import errno

    from lightning_fabric import Fabric

    from app.checkpoint import CheckpointSaver, SaveFailed, saver as saver_module

    def full_disk(path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saver_module, "make_durable", full_disk)
    state = linear_state()
    saver = CheckpointSaver(Fabric(accelerator="cpu", devices=1), state, sharded=False, background=True)
    saver.save(tmp_path / "step-00000001.ckpt", state, lambda: None)
    while not saver.pending.done():
        threading.Event().wait(0.01)
    assert saver.failed()
    with pytest.raises(SaveFailed, match=r"step-00000001.ckpt was not saved: rank 0 on .*: No space left on device "
                                         r"\(ENOSPC\) writing .*\.step-00000001\.ckpt\.partial$"):
        saver.wait()
    assert not saver.failed()
    assert list(tmp_path.iterdir()) == [], "nothing published, the partial file removed"


def test_a_failure_after_the_checkpoint_is_published_says_that_it_was_saved(tmp_path: Path) -> None:
    """best.json or --keep_last_n failing on a disk the checkpoint just filled was reported as "was not saved", and
    "the steps since the last one are lost", with the checkpoint whole on disk (found by review)."""
    import errno

    from lightning_fabric import Fabric

    from app.checkpoint import CheckpointSaver, SaveFailed

    def best_json_on_a_full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "best.json"))

    state = linear_state()
    saver = CheckpointSaver(Fabric(accelerator="cpu", devices=1), state, sharded=False, background=False)
    with pytest.raises(SaveFailed) as failed:
        saver.save(tmp_path / "step-00000001.ckpt", state, best_json_on_a_full_disk)
    assert failed.value.published and str(failed.value).startswith(
        f"the checkpoint {tmp_path / 'step-00000001.ckpt'} was saved, but not what follows it (best.json, "
        "--keep_last_n): rank 0 on ")
    assert "lost" not in failed.value.advice() and [path.name for path in tmp_path.iterdir()] == ["step-00000001.ckpt"]


def test_a_step_calls_before_update_after_its_backward_and_before_its_weights_change() -> None:
    from app.model.loss import LossPath
    from app.training.loop import train_step, update_weights
    from app.optimization.optimizer import GradientPolicy
    from app.reliability.signals import StopRequest

    fabric, model, optimizer, step = one_process_llama(micro_batches=1)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    seen = []

    def before_update() -> None:
        seen.append((all(torch.equal(p, b) for p, b in zip(model.parameters(), before)),
                     all(p.grad is not None for p in model.parameters())))

    gradients = GradientPolicy(max_norm=1.0, replicas=1, scaled=False, defer_sync=False)
    _, verdict = train_step(fabric, model, step, StopRequest(), gradients, optimizer, LossPath())
    assert seen == [], "the forward and backward change nothing"
    update_weights(optimizer, verdict, 1e-2, gradients, before_update)
    assert seen == [(True, True)], "once, with the gradients computed and the weights not yet changed"
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "then the step changed them"


@pytest.mark.slow
@pytest.mark.parametrize("strategy, state_dict_type", [("fsdp", "full"), ("fsdp2", "sharded")])
def test_background_saves_hold_exactly_what_synchronous_saves_of_the_same_steps_hold(
        tiny: TinySetup, tmp_path: Path, strategy: str, state_dict_type: str):
    from app.checkpoint import read_tensors

    checkpoints = {}
    for async_save in (False, True):
        out = tmp_path / f"async-{async_save}"
        result = run_train(train_args(tiny, out, strategy=strategy, state_dict_type=state_dict_type,
                                      async_save=async_save, max_step=4, save_step_interval=1,
                                      eval_step_interval=1000, initial_validation=False))
        assert result.returncode == 0, result.stderr[-3000:]
        checkpoints[async_save] = list_checkpoints(out)
    assert sorted(checkpoints[True]) == sorted(checkpoints[False]) == [1, 2, 3, 4]
    for step, path in checkpoints[True].items():
        written, expected = read_tensors(path), read_tensors(checkpoints[False][step])
        assert written.keys() == expected.keys()
        assert all(torch.equal(written[name], expected[name]) for name in expected), f"step {step}"


@pytest.fixture(scope="module")
def wider_model(tiny: TinySetup, tmp_path_factory) -> Path:
    """27M parameters: a 0.3 GB training state, whose write and fsync outlast a few training steps here."""
    from transformers import AutoConfig, LlamaConfig

    folder = tmp_path_factory.mktemp("wider")
    LlamaConfig(vocab_size=AutoConfig.from_pretrained(tiny.model_config).vocab_size, hidden_size=512,
                intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                max_position_embeddings=128).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_async_save_returns_before_the_write_and_a_sigkill_mid_write_leaves_the_previous_checkpoint(
        tiny: TinySetup, wider_model: Path, tmp_path: Path, state_dict_type: str):
    out = tmp_path / "run"
    args = train_args(tiny, out, model_config=wider_model, async_save=True, state_dict_type=state_dict_type,
                      micro_batch_size=1, gradient_accumulation_steps=1, save_step_interval=2, eval_step_interval=1000,
                      initial_validation=False, max_step=100)
    writing = out / "checkpoints" / ".step-00000004.ckpt.partial"
    with launched(args, tmp_path / "async.log", forked=True) as run:
        run.wait_until(lambda _: writing.exists(), "step 4's write")  # step 2's was published before it began
        run.kill()  # every process of the run
        run.finish()
        run.assert_nothing_left()
        output = run.output()
    assert output.index("step 2: writing") < output.index("step 2: saved"), "the step returned before the write"
    assert sorted(list_checkpoints(out)) == [2], "step 4 was killed mid-write: only step 2 is a checkpoint"

    resumed = run_train(args[:-2] + ["--max_step", "5", "--resume", "true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step-00000002.ckpt'} at step 2" in resumed.stdout
    assert sorted(list_checkpoints(out)) == [2, 4, 5]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.endswith(".partial")]
    read_checkpoint(list_checkpoints(out)[5])


SLOW_FSYNC = """import os, time
_fsync = os.fsync


def slow_fsync(fd):  # a slow disk for the checkpoints being written: 4 s per file made durable
    if ".partial" in os.readlink(f"/proc/self/fd/{fd}"):
        time.sleep(4)
    return _fsync(fd)


os.fsync = slow_fsync
"""


@pytest.mark.slow
@pytest.mark.parametrize("log_model", [False, "all"])
def test_the_summary_counts_the_last_background_write_as_checkpoint_time_not_training(tiny: TinySetup, tmp_path: Path,
                                                                                     log_model) -> None:
    """The wait for the last background write came after the loop, outside its save timer: the summary gave it to
    training (3.4 s of training for 0.4 s, 606 tokens/s for 5,415 in an audit); and a step's "saved in" counted the
    wait for the previous write too. --log_model waits for each write to upload it: that wait was training's too."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_FSYNC)
    out = tmp_path / "run"
    logged = dict(log_model=log_model, wandb_mode="offline") if log_model else {}
    result = run_train(train_args(tiny, out, async_save=True, max_step=4, save_step_interval=2,
                                  eval_step_interval=1000, initial_validation=False, devices=1, **logged),
                       env={"PYTHONPATH": str(tmp_path / "site")}, fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpoints_saved"] == 2 and summary["save_sec"] > 4 > summary["train_sec"], summary
    saved_in = [float(seconds) for seconds in re.findall(r"step \d+: saved .* in ([\d.]+) s", result.stdout)]
    assert len(saved_in) == 2 and max(saved_in) < 6.5, result.stdout  # its write (4 s), not the one before too
    if log_model:  # each row's save_sec holds the upload's wait for its write, as the summary does
        rows = [row for row in csv.DictReader((out / "metrics.csv").open()) if row.get("save_sec")]
        assert [(row["step"], float(row["save_sec"]) > 4) for row in rows] == [("2", True), ("4", True)], rows
