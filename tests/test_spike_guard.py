"""The spike guard in real runs: poisoned rows are skipped and set aside, a poisoned stretch is rolled back, and the
quarantine holds across a kill and a resume on another device count.

The data is the tiny setup's, with train rows made one repeated token (a corrupt document) where the run meets them:
4 of the 16 rows of steps 23, 25 and 28 (steps whose clean rows hold none of the corpus's own outliers), and every row
of steps 33 to 35 (the whole batch high: no row stands out, as when the model itself breaks). 647 rows / 16 a step:
40 steps an epoch, so the second epoch meets the rows set aside again.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from datasets import DatasetDict, load_from_disk

from app.data.order import epoch_permutation
from app.exit_codes import EXIT_FINISHED
from conftest import TinySetup, read_checkpoint, run_train, tensorboard_scalars, train_args

SEED, GLOBAL_BATCH, REPEATED_TOKEN = 7, 16, 399
SPIKY_STEPS, BROKEN_STEPS = (23, 25, 28), (33, 34, 35)
GUARD = dict(micro_batch_size=4, gradient_accumulation_steps=2, max_step=60, eval_step_interval=20,
             save_step_interval=8, spike_warmup=15, spike_window=30)


def rows_of_step(step: int, train_rows: int) -> list[int]:
    order = epoch_permutation(train_rows, seed=SEED, epoch=0)
    return order[(step - 1) * GLOBAL_BATCH:step * GLOBAL_BATCH]


def poisoned_copy(tiny: TinySetup, target: Path, rows: set[int]) -> Path:
    """The tiny data with `rows` of its train split made one repeated token."""
    splits = load_from_disk(str(tiny.data))

    def poison(example: dict, index: int) -> dict:
        if index in rows:
            example["input_ids"] = [REPEATED_TOKEN] * len(example["input_ids"])
        return example

    DatasetDict(train=splits["train"].map(poison, with_indices=True, keep_in_memory=True),  # no cache file in tiny
                validation=splits["validation"]).save_to_disk(str(target))
    shutil.copy(tiny.data / "stats.json", target / "stats.json")
    return target


def quarantined(out_dir: Path) -> list[int]:
    return sorted(json.loads(line)["row"] for line in (out_dir / "quarantine.jsonl").read_text().splitlines())


def final_val_loss(output: str) -> float:
    return float(re.findall(r"val_loss (\d+\.\d+)", output)[-1])


def logged_losses(out_dir: Path) -> dict[int, float]:
    """The last train_loss logged for each step (a rollback logs its steps again)."""
    with open(out_dir / "metrics.csv", newline="") as handle:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(handle) if row["train_loss"]}


@pytest.mark.slow
def test_bad_rows_are_set_aside_a_broken_stretch_is_rolled_back_and_a_resume_elsewhere_skips_the_same_rows(
        tiny: TinySetup, tmp_path: Path) -> None:
    train_rows = len(load_from_disk(str(tiny.data))["train"])
    spiky = sorted(row for step in SPIKY_STEPS for row in rows_of_step(step, train_rows)[:4])
    broken = {row for step in BROKEN_STEPS for row in rows_of_step(step, train_rows)}
    data = poisoned_copy(tiny, tmp_path / "data", set(spiky) | broken)

    clean = run_train(train_args(tiny, tmp_path / "clean", **GUARD))
    assert clean.returncode == EXIT_FINISHED, clean.stderr[-3000:]
    assert "spike guard: 0 spikes" in clean.stdout, "no false positive on clean data"

    guarded = run_train(train_args(tiny, tmp_path / "guarded", train_data_dir=data, spike_guard="rollback",
                                   tensorboard=True, **GUARD))
    assert guarded.returncode == EXIT_FINISHED, guarded.stderr[-3000:]
    spikes = [int(step) for step in re.findall(r"^step (\d+): loss spike", guarded.stdout, re.MULTILINE)]
    assert spikes == [*SPIKY_STEPS, *BROKEN_STEPS], guarded.stdout
    assert "step 35: rolled back to" in guarded.stdout and "checkpoints/step-00000032.ckpt (step 32" in guarded.stdout
    assert "step 35: the 48 train rows of the spikes that made this incident are set aside" in guarded.stdout
    set_aside = sorted(set(spiky) | broken)
    assert quarantined(tmp_path / "guarded") == set_aside, "exactly the bad rows the spikes met, no clean row"
    assert final_val_loss(guarded.stdout) == pytest.approx(final_val_loss(clean.stdout), rel=0.02)
    with open(tmp_path / "guarded" / "metrics.csv", newline="") as handle:  # in the order logged: 33-35 twice
        seen = [(int(row["step"]), int(row["tokens_seen"])) for row in csv.DictReader(handle) if row["tokens_seen"]]
    first = dict(reversed(seen))
    assert all(first[step] == first[step - 1] for step in SPIKY_STEPS), "a step not applied trains no token"
    replayed = [tokens for step, tokens in seen if step == 33][-1]
    assert first[32] < replayed <= first[32] + first[1], "the rollback takes the checkpoint's count back"
    _, shown = tensorboard_scalars(tmp_path / "guarded" / "tensorboard")
    assert dict(shown["train_loss"]) == pytest.approx(logged_losses(tmp_path / "guarded"), rel=1e-6)
    assert len(shown["train_loss"]) == len(dict(shown["train_loss"])), "TensorBoard shows a rolled-back step once"

    # Resumed into a new --out_dir from the checkpoint before the broken stretch (docs/reliability.md's way back to
    # a stretch), the run rolls back to that checkpoint: it had none of its own to roll back to, and stopped.
    elsewhere = run_train(train_args(tiny, tmp_path / "elsewhere", train_data_dir=data, spike_guard="rollback",
                                     resume=True, checkpoint=tmp_path / "guarded" / "checkpoints" /
                                     "step-00000032.ckpt", **(GUARD | dict(max_step=37))))
    assert elsewhere.returncode == EXIT_FINISHED, elsewhere.stdout[-3000:] + elsewhere.stderr[-3000:]
    assert f"step 35: rolled back to {tmp_path / 'guarded' / 'checkpoints' / 'step-00000032.ckpt'}" in elsewhere.stdout

    # The checkpoint after the rollback, as a crash would leave it, resumed on 1 process with another micro batch
    # and under `detect`: the second epoch (from step 38: the rollback took 3 steps back) meets rows set aside, which
    # train nothing (under detect they once trained again, while the summary counted them set aside).
    after = tmp_path / "guarded" / "checkpoints" / "step-00000040.ckpt"
    second_epoch = epoch_permutation(train_rows, seed=SEED, epoch=1)
    met = {38 + index // GLOBAL_BATCH for index, row in enumerate(second_epoch) if row in spiky}
    assert met & set(range(41, 61)), "the resumed steps meet rows set aside"
    resumed = run_train(train_args(tiny, tmp_path / "resumed", train_data_dir=data, spike_guard="detect",
                                   resume=True, checkpoint=after, devices=1, **(GUARD | dict(micro_batch_size=8))))
    assert resumed.returncode == EXIT_FINISHED, resumed.stderr[-3000:]
    assert "60 train rows set aside by the spike guard train nothing" in resumed.stdout
    assert "spike guard: 6 spikes, 6 steps not applied, 1 rollbacks, 60 train rows set aside" in resumed.stdout
    straight, continued = logged_losses(tmp_path / "guarded"), logged_losses(tmp_path / "resumed")
    for step in range(41, 61):
        assert continued[step] == pytest.approx(straight[step], rel=1e-4), step
    assert quarantined(tmp_path / "resumed") == set_aside

    # Resumed one row a step, the step of a row set aside has no trained token: it once logged loss 0 and fed it to
    # the guard, and AdamW moved every weight for it (momentum, weight decay) as for a step that trained.
    done = 3 * GLOBAL_BATCH  # the rows of the second epoch before the checkpoint: its steps 38 to 40
    empty = 41 + next(index for index, row in enumerate(second_epoch[done:]) if row in set_aside)
    alone = run_train(train_args(tiny, tmp_path / "alone", train_data_dir=data, spike_guard="detect", resume=True,
                                 checkpoint=after, devices=1, micro_batch_size=1, global_batch_size=1,
                                 gradient_accumulation_steps=None, max_step=empty, save_step_interval=1,
                                 eval_step_interval=100, log_interval=1))
    assert alone.returncode == EXIT_FINISHED, alone.stderr[-3000:]
    assert f"step {empty}: no trained tokens, every row of it set aside in quarantine: not applied" in alone.stdout
    assert f"step {empty}/{empty} | no trained tokens | lr " in alone.stdout, alone.stdout[-2000:]
    assert empty not in logged_losses(tmp_path / "alone") and empty - 1 in logged_losses(tmp_path / "alone")
    weights = [read_checkpoint(tmp_path / "alone" / "checkpoints" / f"step-{step:08d}.ckpt")["model"]
               for step in (empty - 1, empty)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


@pytest.mark.parametrize("mode", ["skip", "off"])
def test_quarantine_jsonl_says_what_the_run_skips_also_when_it_skips_nothing(tiny: TinySetup, tmp_path: Path,
                                                                              mode: str) -> None:
    """Resumed from a checkpoint saved before rows were set aside (or under --spike_guard off), the run trained on
    rows that quarantine.jsonl still listed: the file was rewritten only when the state held rows to skip."""
    from types import SimpleNamespace

    from app.reliability.spikes import QUARANTINE_FILE
    from app.training.run import spike_guard
    from arguments import parse_config

    cfg = parse_config(train_args(tiny, tmp_path, spike_guard=mode))
    stale = tmp_path / QUARANTINE_FILE
    stale.write_text(json.dumps({"data_dir": str(tiny.data), "split": "train", "row": 323}) + "\n")
    held = {"quarantine": [{"row": 7, "step": 3}]} if mode == "off" else None  # off: they train again
    fabric = SimpleNamespace(is_global_zero=True, print=lambda line: None)
    data = SimpleNamespace(quarantine=lambda rows: None, locate=lambda row: (str(tiny.data), row), mixture=False)
    spike_guard(fabric, cfg, {"spike_guard": held}, data)
    assert not stale.exists()
