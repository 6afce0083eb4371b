"""Weighted mixtures of prepared folders: the shares of every step, each folder's own epochs, the position a resume
continues from (pure), the joined data, the preflight's refusals, and real runs that resume on 1 and 4 processes
with the rows of a straight run; and folders evaluated without training (--eval_data_dir), named as a mixture's."""

from __future__ import annotations

import csv
import json
import random
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, load_from_disk
from transformers import AutoTokenizer

from app.checkpoint import list_checkpoints, read_metadata
from app.data.mixture import (Position, Source, epoch_rows, interleave, mixture_steps, parse_eval_folders,
                              parse_sources, step_counts)
from app.data.order import epoch_permutation, epochs_of_steps, step_rows
from app.optimization.schedule import make_plan
from conftest import BLOCK_SIZE, TinySetup, run_train, train_args


def weights_of(*raw: int) -> list[Fraction]:
    return [Fraction(value, sum(raw)) for value in raw]


def test_the_command_line_names_folders_weights_and_refuses_what_it_cannot_read_in_one_line() -> None:
    sources = parse_sources("/data/wiki-es:0.7,/data/wiki-en:0.2,code=/data/the-stack/:0.1")
    assert sources == [Source("wiki-es", "/data/wiki-es", Fraction(7, 10)),
                       Source("wiki-en", "/data/wiki-en", Fraction(2, 10)),
                       Source("code", "/data/the-stack/", Fraction(1, 10))]
    assert [s.weight for s in parse_sources("a:3,b:1")] == weights_of(3, 1), "weights are normalised"
    assert parse_sources("/runs/x:y") == [Source("x:y", "/runs/x:y", Fraction(1))], "a colon inside a folder's name"
    assert len(parse_sources("/data/one:0.5")) == 1
    for spec, message in (("a:3,b", "b has no weight"), ("a:1,/x/a:1", "two folders are named a"),
                          ("a:0,b:1", "must be positive"), ("a:1,,b:1", "an empty entry"),
                          # these three were a ZeroDivisionError, an OverflowError and a plan of 4e31 steps
                          ("a:3,b:1/0", "the weight of b divides by zero"),
                          ("a:3,b:1e400", "the weights leave a less than a millionth of every step"),
                          ("a:1e-30,b:1", "leave a less than a millionth of every step; give weights within"),
                          # read as part of a folder's name, then as a folder without a weight
                          ("a:inf,b:1", "the weight of a must be a finite positive number, got inf"),
                          ("a:1,b:NaN", "the weight of b must be a finite positive number, got NaN")):
        with pytest.raises(ValueError, match=message):
            parse_sources(spec)


def test_evaluation_folders_are_named_as_a_mixtures_folders_and_refused_in_one_line() -> None:
    assert parse_eval_folders("/data/wiki-en,code=/data/code-eval/", "/data/es") == {
        "wiki-en": "/data/wiki-en", "code": "/data/code-eval/"}
    assert parse_eval_folders("es=/data/es-2", "/data/es") == {"es": "/data/es-2"}, \
        "a single training folder is val_loss"
    assert parse_eval_folders("runs/lr=3e-4/wiki,a=b=c", "t") == {"wiki": "runs/lr=3e-4/wiki", "a": "b=c"}, \
        "a '=' in a folder's path is no name"
    assert parse_sources("runs/lr=3e-4/data:2")[0].path == "runs/lr=3e-4/data"
    for spec, train, message in (("a,,b", "t", "--eval_data_dir 'a,,b': an empty entry"),
                                 ("x=", "t", "an empty entry"),
                                 ("/x/a,/y/a", "t", "two folders are named a; name them"),
                                 ("/x/a b", "t", "/x/a b needs a name of letters"),
                                 ("/y/es", "/x/es:3,/x/en:1", "es names a folder of the training mixture too"),
                                 ("/x/es/", "/x/es", r"/x/es/ is a --train_data_dir folder, whose validation rows "
                                  r"val_loss scores already; give a folder the run does not train on"),
                                 ("held=/x/./en", "/x/es:3,/x/en:1", "rows val_loss/en scores already"),
                                 ("a=/x/es,b=/x/../x/es", "t",
                                  "/x/es and /x/../x/es are the same folder; give it once")):
        with pytest.raises(ValueError, match=message):
            parse_eval_folders(spec, train)


def test_every_step_holds_each_share_as_exactly_as_integers_allow() -> None:
    credits = [Fraction(0)] * 2
    for _ in range(100):
        counts, credits = step_counts(weights_of(3, 1), 16, credits)
        assert counts == [12, 4]
    rng = random.Random(0)
    for _ in range(100):
        weights = weights_of(*(rng.randint(1, 100) for _ in range(rng.randint(2, 6))))
        batch = rng.choice([1, 3, 16, 64])
        credits, taken = [Fraction(0)] * len(weights), [0] * len(weights)
        for step in range(1, 200):
            counts, credits = step_counts(weights, batch, credits)
            assert sum(counts) == batch
            for i, (count, weight) in enumerate(zip(counts, weights)):
                assert count in (int(batch * weight), -int(-batch * weight // 1)), "the floor or the ceiling"
                taken[i] += count
                assert abs(taken[i] - step * batch * weight) < 1, "within one row of the exact share"


def steps_of(weights: list[Fraction], rows: list[int], position: Position, count: int, batch: int = 16,
             seed: int = 7):
    sources = [Source(f"s{i}", f"/s{i}", weight) for i, weight in enumerate(weights)]
    offsets = [sum(rows[:i]) for i in range(len(rows))]
    steps = mixture_steps(sources, rows, offsets, batch, position, epoch_permutation, seed=seed)
    return [next(steps) for _ in range(count)], sources


def test_every_seed_a_run_takes_orders_a_mixture_and_the_seeds_that_did_keep_their_order() -> None:
    """A source's seed is the run's times 65,537 plus its name's checksum, and the permutation multiplies it again:
    from --seed 281,469,838 on it passed the 64 bits torch's generator takes, and a mixture seeded with the time
    (--seed $(date +%s)) ended in an OverflowError at its first step."""
    for seed in (281_469_838, 1_764_400_000, 2**32 - 1):
        steps, _ = steps_of(weights_of(3, 1), [500, 30], Position.start(2), 3, seed=seed)
        assert all(len(step) == 16 for step, _ in steps)
    assert epoch_permutation(10, seed=7, epoch=2) == [4, 7, 5, 8, 6, 1, 3, 2, 9, 0], "the order that seed always had"


def test_a_small_source_repeats_only_after_all_its_rows_and_a_resume_continues_the_same_rows() -> None:
    rows = [500, 30]
    straight, sources = steps_of(weights_of(3, 1), rows, Position.start(2), 100)
    small = [row - 500 for step, _ in straight for row in step if row >= 500]
    assert len(small) == 400
    for epoch in range(len(small) // 30):
        assert sorted(small[epoch * 30:(epoch + 1) * 30]) == list(range(30)), f"epoch {epoch} of the small source"
    assert small[:30] != small[30:60], "each epoch in its own order"
    assert all(sum(row < 500 for row in step) == 12 for step, _ in straight)
    for k in (1, 37, 99):
        saved = json.loads(json.dumps(straight[k - 1][1].to_dict(sources)))  # through the checkpoint's JSON
        resumed, _ = steps_of(weights_of(3, 1), rows, Position.from_dict(saved, sources), 100 - k)
        assert [step for step, _ in resumed] == [step for step, _ in straight[k:]], f"resumed after step {k}"


def test_changed_weights_at_a_resume_start_the_credits_again_and_keep_the_rows_taken() -> None:
    sources = [Source("a", "/a", Fraction(3, 4)), Source("b", "/b", Fraction(1, 4))]
    saved = Position((120, 40), (Fraction(1, 3), Fraction(-1, 3))).to_dict(sources)
    assert Position.from_dict(saved, sources) == Position((120, 40), (Fraction(1, 3), Fraction(-1, 3)))
    annealed = [Source("a", "/a", Fraction(1, 2)), Source("b", "/b", Fraction(1, 2)), Source("c", "/c", Fraction(0))]
    assert Position.from_dict(saved, annealed) == Position((120, 40, 0), (Fraction(0),) * 3)


def test_a_step_spreads_each_source_over_its_micro_batches_and_an_epoch_is_a_pass_over_the_first_folder() -> None:
    assert interleave([[0, 1, 2], [10]]) == [0, 1, 10, 2]
    mixed = interleave([list(range(12)), list(range(100, 104))])
    assert [sum(row >= 100 for row in mixed[i:i + 4]) for i in range(0, 16, 4)] == [1, 1, 1, 1]
    assert epoch_rows(weights_of(3, 1), [500, 30]) == 666, "500 rows at 3/4 of every step"
    assert epoch_rows(weights_of(1, 3), [10, 3000]) == 40, "however large the folder replayed beside it"


def test_a_small_folder_that_wraps_often_leaves_the_large_folders_order_computed_once() -> None:
    """Every few wraps of a small folder the cache of orders was cleared, the large folder's with it: its permutation
    (1.3 s for 10M rows) was computed again at every step or two, on every rank, twice."""
    computed = []

    def permutation(rows: int, seed: int, epoch: int) -> list[int]:
        computed.append((rows, epoch))
        return epoch_permutation(rows, seed=seed, epoch=epoch)

    steps = mixture_steps([Source("big", "b", Fraction(4, 5)), Source("small", "s", Fraction(1, 5))], [100_000, 5],
                          [0, 100_000], 64, Position.start(2), permutation, 7)
    for _ in range(50):
        next(steps)
    small = [epoch for rows, epoch in computed if rows == 5]
    assert [rows for rows, _ in computed].count(100_000) == 1 and small == list(range(len(small))) and len(small) > 100


def test_the_order_of_one_folder_crosses_epochs_as_epoch_by_epoch() -> None:
    plan = make_plan(train_rows=100, block_size=8, world_size=2, micro_batch_size=3, accumulation=2,
                     number_epochs=1, max_step=None)
    by_epoch = [rows for epoch in (3, 4, 5) for rows in step_rows(epoch_permutation(100, seed=5, epoch=epoch), plan,
                                                                     24 if epoch == 3 else 0)]
    crossing = epochs_of_steps(100, plan, seed=5, epoch=3, position=24)
    assert [next(crossing) for _ in by_epoch] == by_epoch


# --- the joined data, the preflight, and real runs ---------------------------------------------------------------

SMALL_TRAIN, SMALL_VALIDATION = 40, 24


@pytest.fixture(scope="module")
def small(tiny: TinySetup, tmp_path_factory) -> Path:
    """A second folder of the tiny setup's format and tokenizer: 40 train and 24 validation rows of its own."""
    splits = load_from_disk(str(tiny.data))
    target = tmp_path_factory.mktemp("mixture") / "small"
    DatasetDict(train=splits["train"].select(range(SMALL_TRAIN)),
                validation=splits["validation"].select(range(SMALL_VALIDATION))).save_to_disk(str(target))
    shutil.copy(tiny.data / "stats.json", target / "stats.json")
    shutil.copytree(tiny.data / "tokenizer", target / "tokenizer")
    return target


def test_a_mixtures_generation_samples_take_turns_among_its_folders() -> None:
    """--eval_samples took the first rows of the joined validation split: all of them the first folder's, while the
    others made most of every step."""
    import numpy as np

    from app.data.formats import DataFormat
    from app.data.loader import SourceRows, TrainingData

    rows = [{"input_ids": [folder, row], "labels": [row]} for folder, count in ((1, 3), (2, 2)) for row in range(count)]
    validation = Dataset.from_list(rows)
    sources = [SourceRows(Source("a", "a", Fraction(1, 4)), range(0), range(0, 3)),
               SourceRows(Source("b", "b", Fraction(3, 4)), range(0), range(3, 5))]
    data = TrainingData(DataFormat("seq2seq", 0), Dataset.from_list(rows[:1]), validation, np.zeros(1), sources=sources)
    assert [sample.prompt for sample in data.validation_samples()] == [[1, 0], [2, 0], [1, 1], [2, 1], [1, 2]]
    alone = TrainingData(DataFormat("seq2seq", 0), Dataset.from_list(rows[:1]), validation, np.zeros(1))
    assert [sample.prompt for sample in alone.validation_samples()] == [row["input_ids"] for row in rows]


def test_the_folders_are_read_as_one_split_numbered_folder_after_folder(tiny, small, tmp_path) -> None:
    from app.data import load_data
    from app.reliability.spikes import write_quarantine

    alone, mixed = load_data(tiny.data), load_data(f"big={tiny.data}:3,{small}:1")
    big_rows = len(alone.train)
    assert len(mixed.train) == big_rows + SMALL_TRAIN and mixed.mixture and not alone.mixture
    assert mixed.train[big_rows + 5]["input_ids"].tolist() == load_from_disk(str(small))["train"][5]["input_ids"]
    assert mixed.locate(big_rows + 5) == (str(small), 5) and mixed.locate(3) == (str(tiny.data), 3)
    assert mixed.rows_by_source([3, big_rows + 5, 9]) == {"big": [3, 9], "small": [5]}
    assert mixed.tokens_by_source([3, big_rows + 5, 9]) == [2 * (BLOCK_SIZE - 1), BLOCK_SIZE - 1]
    assert {name: len(split) for name, split in mixed.validation_splits().items()} == {
        "big": len(alone.validation), "small": SMALL_VALIDATION}
    write_quarantine(tmp_path, [{"row": big_rows + 5, "loss": 9.5, "tokens": 31, "step": 12}], mixed.locate)
    assert json.loads((tmp_path / "quarantine.jsonl").read_text()) == {
        "data_dir": str(small), "split": "train", "row": 5, "loss": 9.5, "tokens": 31, "step": 12}, "its own folder"
    one = load_data(f"{tiny.data}:1")
    assert not one.mixture and one.train.data.equals(alone.train.data), "a mixture of one is the folder"


def test_folders_that_cannot_be_mixed_are_refused_before_any_work(tiny, small, long_blocks, tmp_path, capsys) -> None:
    from app.training.preflight import preflight
    from arguments import parse_config

    by_hand = tmp_path / "by-hand"  # its input_ids stored as a list of any length, the prepared ones of 32
    rows = load_from_disk(str(small))
    DatasetDict({name: Dataset.from_dict({"input_ids": [[int(t) for t in row] for row in rows[name]["input_ids"]]})
                 for name in ("train", "validation")}).save_to_disk(str(by_hand))
    shutil.copy(tiny.data / "stats.json", by_hand / "stats.json")
    shutil.copytree(tiny.data / "tokenizer", by_hand / "tokenizer")
    tiny_first = tmp_path / "few"
    DatasetDict(train=rows["train"].select(range(3)), validation=rows["validation"]).save_to_disk(str(tiny_first))
    shutil.copy(tiny.data / "stats.json", tiny_first / "stats.json")
    shutil.copytree(tiny.data / "tokenizer", tiny_first / "tokenizer")
    templated = tmp_path / "templated"  # the same tokenizer, another --chat_template: "prepared with another tokenizer"
    shutil.copytree(small, templated)
    tokenizer = AutoTokenizer.from_pretrained(templated / "tokenizer")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}"
    tokenizer.save_pretrained(templated / "tokenizer")
    for spec, message in ((f"{tiny.data}:3,{templated}:1", f"{templated} was prepared with another chat template than "
                           f"{tiny.data}: the model would learn two renderings and be converted with one; prepare "
                           "every folder of a mixture with one --chat_template"),
                          (f"{tiny.data}:3,long={long_blocks}:1", "must hold one block length (data: 32, long: 1024)"),
                          (f"{tiny.data}:3,{by_hand}:1",  # datasets could not join them: a traceback on every rank
                           "must hold one storage of column input_ids (data: List(Value('int32'), length=32), "
                           "by-hand: List(Value('int32')))"),
                          (f"{tiny_first}:3,{tiny.data}:1",  # it said "add data"
                           "an epoch of a mixture is one pass over its first folder, and few (3 rows at 75% of every "
                           "step) makes 4 rows of the mixture, fewer than one optimizer step; list a larger folder"),
                          (f"{tiny.data}:3,{small}", f"{small} has no weight"),
                          (f"{tiny.data}:3,{tmp_path / 'absent'}:1", "absent: no such folder")):
        with pytest.raises(SystemExit) as exit_info:
            preflight(parse_config(train_args(tiny, tmp_path / "out", train_data_dir=spec)))
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, spec
    with pytest.raises(SystemExit):  # the batch arithmetic's own refusal, not the short epoch's
        preflight(parse_config(train_args(tiny, tmp_path / "out", train_data_dir=f"{tiny.data}:1,{small}:1",
                                          global_batch_size=10, gradient_accumulation_steps=None)))
    assert "--global_batch_size 10" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_print_config_and_the_memory_plan_show_the_mixture(tiny, small, tmp_path, capfd) -> None:
    from app.training.run import run
    from arguments import parse_config

    mixture = f"{tiny.data}:3,{small}:1"
    run(parse_config(train_args(tiny, tmp_path / "out", train_data_dir=mixture, print_config=True, max_step=None)))
    printed = capfd.readouterr().out
    train_rows = len(load_from_disk(str(tiny.data))["train"])
    assert f"#     data: 75.0% of every step, {train_rows:,} train rows ({tiny.data})" in printed
    assert f"#     small: 25.0% of every step, {SMALL_TRAIN} train rows ({small})" in printed
    epoch_steps = int(train_rows / Fraction(3, 4)) // 16
    assert f"optimizer steps: {epoch_steps} (--number_epochs 1; {epoch_steps} steps per epoch" in printed
    run(parse_config(train_args(tiny, tmp_path / "out", train_data_dir=mixture, estimate_memory=True)))
    assert "data: a mixture of\ndata: 75.0% of every step" in capfd.readouterr().out


def metrics_of(out_dir: Path) -> dict[int, dict[str, str]]:
    with open(out_dir / "metrics.csv", newline="") as handle:
        rows: dict[int, dict[str, str]] = {}
        for row in csv.DictReader(handle):
            rows.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v != ""})
        return rows


def rows_of(out_dir: Path) -> dict[int, dict[str, list[int]]]:
    lines = [json.loads(line) for line in (out_dir / "rows.jsonl").read_text().splitlines()]
    return {line["step"]: line["rows"] for line in lines}


MIXTURE_RUN = dict(max_step=100, eval_step_interval=25, eval_iters=2, save_step_interval=30, record_rows=True,
                   warmup_steps=10, log_interval=10)


@pytest.fixture(scope="module")
def straight(tiny, small, tmp_path_factory) -> Path:
    """3:1 of the tiny setup's rows and the small folder's, a global batch of 16 on 2 processes with loader workers,
    100 steps: the small folder's 40 rows go round 10 times."""
    out_dir = tmp_path_factory.mktemp("mixture-runs") / "straight"
    result = run_train(train_args(tiny, out_dir, train_data_dir=f"{tiny.data}:3,{small}:1", num_workers=2,
                                  **MIXTURE_RUN))
    assert result.returncode == 0, result.stdout + result.stderr
    return out_dir


def test_every_step_holds_12_and_4_rows_and_the_small_folder_repeats_only_after_all_its_rows(straight) -> None:
    steps = rows_of(straight)
    assert sorted(steps) == list(range(1, 101))
    assert all(len(rows["data"]) == 12 and len(rows["small"]) == 4 for rows in steps.values())
    small = [row for step in range(1, 101) for row in steps[step]["small"]]
    assert [sorted(small[i:i + SMALL_TRAIN]) for i in range(0, 400, SMALL_TRAIN)] == [list(range(SMALL_TRAIN))] * 10
    big = [row for step in range(1, 101) for row in steps[step]["data"]]
    assert len(set(big[:600])) == 600, "no row of the large folder comes twice within its epoch"
    metrics = metrics_of(straight)
    assert int(metrics[100]["tokens/data"]) == 100 * 12 * (BLOCK_SIZE - 1)
    assert int(metrics[100]["tokens/small"]) == 100 * 4 * (BLOCK_SIZE - 1)


def test_each_folder_is_validated_and_the_loss_is_their_token_weighted_mean(straight) -> None:
    metrics = metrics_of(straight)
    evaluated = [step for step, row in metrics.items() if "val_loss" in row]
    assert evaluated == [0, 25, 50, 53, 75, 100], "and at the end of the epoch: 862 rows / 16"
    for step in evaluated:  # 2 batches of 4 rows on each of 2 ranks from each folder: 16 rows of 31 targets each
        row = {name: float(metrics[step][name]) for name in ("val_loss", "val_loss/data", "val_loss/small")}
        assert row["val_loss"] == pytest.approx((row["val_loss/data"] + row["val_loss/small"]) / 2, rel=1e-6)
    assert float(metrics[100]["val_loss/small"]) < float(metrics[0]["val_loss/small"])
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["tokens_by_source"] == {"tokens/data": 37200, "tokens/small": 12400}


def test_a_mixtures_validation_loss_weighs_each_folder_by_the_tokens_it_read(tiny, small) -> None:
    """32 validation rows of one folder against the small folder's 24: the run above reads as many of each, where a
    plain mean of the folders' losses is the weighted one too."""
    import torch
    from lightning_fabric import Fabric
    from transformers import AutoConfig, AutoModelForCausalLM

    from app.data import load_data
    from app.evaluation.validation import validation_losses
    from app.model.loss import LossPath

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    losses = validation_losses(Fabric(accelerator="cpu", devices=1), model, LossPath(),
                               load_data(f"{tiny.data}:3,{small}:1"), batch_size=8, max_batches=4)
    rows = {"data": 32, "small": SMALL_VALIDATION}
    weighted = sum(losses[name] * read for name, read in rows.items()) / sum(rows.values())
    assert losses[""] == pytest.approx(weighted, rel=1e-9)
    assert losses[""] != pytest.approx((losses["data"] + losses["small"]) / 2, rel=1e-5)


def test_an_evaluation_folder_is_validated_apart_and_left_out_of_the_validation_loss(tiny, small, tmp_path) -> None:
    """Copies of the training folders, evaluated (the folders themselves are refused: their rows are val_loss's)."""
    import torch
    from lightning_fabric import Fabric
    from transformers import AutoConfig, AutoModelForCausalLM

    from app.data import load_data
    from app.evaluation.validation import validation_losses
    from app.model.loss import LossPath

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))

    def losses(train_data_dir: str, eval_data_dir: str | None = None) -> dict[str, float]:
        return validation_losses(Fabric(accelerator="cpu", devices=1), model, LossPath(),
                                 load_data(train_data_dir, eval_data_dir=eval_data_dir), batch_size=8, max_batches=4)

    copies = {name: shutil.copytree(folder, tmp_path / name)
              for name, folder in (("held", small), ("again", tiny.data))}
    alone, held = losses(str(tiny.data)), losses(str(small))[""]
    assert losses(str(tiny.data), f"held={copies['held']}") == {"": alone[""], "held": held}
    mixture = losses(f"{tiny.data}:3,{small}:1")
    assert losses(f"{tiny.data}:3,{small}:1", f"held={copies['held']},again={copies['again']}") == mixture | {
        "held": held, "again": alone[""]}


def test_evaluation_folders_unlike_the_training_data_are_refused_before_any_work(tiny, small, long_blocks, tmp_path,
                                                                                 capsys) -> None:
    """Another format or tokenizer (a loss that compares with nothing), longer rows than the run plans for, a folder
    with nothing to evaluate, an interval that never evaluates; another chat template is evaluated."""
    from app.training.preflight import preflight
    from arguments import parse_config

    rows = load_from_disk(str(small))
    documents = tmp_path / "documents"  # text_documents: each document apart
    DatasetDict({name: split.map(lambda row: {"labels": row["input_ids"], "position_ids": list(range(BLOCK_SIZE))})
                 for name, split in rows.items()}).save_to_disk(str(documents))
    shutil.copytree(small / "tokenizer", documents / "tokenizer")
    stats = json.loads((small / "stats.json").read_text())
    (documents / "stats.json").write_text(json.dumps(stats | {"format": "text_documents"}))
    empty = tmp_path / "empty"
    DatasetDict(train=rows["train"], validation=rows["validation"].select([])).save_to_disk(
        str(empty), num_shards={"validation": 1})
    other_tokenizer, templated = shutil.copytree(small, tmp_path / "other"), shutil.copytree(small, tmp_path / "chat")
    for folder in (empty,):
        shutil.copy(small / "stats.json", folder / "stats.json")
        shutil.copytree(small / "tokenizer", folder / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(other_tokenizer / "tokenizer")
    tokenizer.add_tokens(["<an-added-token>"])
    tokenizer.save_pretrained(other_tokenizer / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(templated / "tokenizer")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}"
    tokenizer.save_pretrained(templated / "tokenizer")
    for spec, options, message in (
            (str(documents), {}, f"--eval_data_dir {documents} holds text_documents data, and --train_data_dir text "
                                 "data; prepare it as the training data was"),
            (str(other_tokenizer), {}, f"--eval_data_dir {other_tokenizer} was prepared with another tokenizer than "
                                       "--train_data_dir ("),
            (str(long_blocks), {}, f"--eval_data_dir {long_blocks} holds rows of up to 1024 tokens, longer than "
                                   f"--train_data_dir's, which the run's memory and the model's positions are planned "
                                   f"for; prepare it with --block_size {BLOCK_SIZE}"),
            (str(empty), {}, f"--eval_data_dir {empty}: no validation rows to evaluate"),
            (str(tmp_path / "absent"), {}, f"--eval_data_dir {tmp_path / 'absent'}: no such folder"),
            (str(small), dict(eval_step_interval=0), "--eval_data_dir: not read with --eval_step_interval 0")):
        with pytest.raises(SystemExit) as exit_info:
            preflight(parse_config(train_args(tiny, tmp_path / "out", eval_data_dir=spec, **options)))
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, spec
    assert not (tmp_path / "out").exists()
    inputs = preflight(parse_config(train_args(tiny, tmp_path / "out", eval_data_dir=f"{templated},{small}")))
    assert inputs.config.eval_data_dir == f"{templated},{small}"
    for single in (f"name={tiny.data}", f"{tiny.data}:1"):  # one training folder, named or weighted: a traceback once
        preflight(parse_config(train_args(tiny, tmp_path / "out", train_data_dir=single, eval_data_dir=str(small))))


@pytest.mark.parametrize("devices, micro_batch_size, from_step", [(1, 8, 60), (4, 2, 90)])
def test_a_resume_on_another_number_of_processes_continues_the_same_rows(tiny, small, straight, tmp_path, devices,
                                                                         micro_batch_size, from_step) -> None:
    """Also evaluating a copy of the small folder as a folder of --eval_data_dir: the same loss, left out of
    val_loss."""
    out_dir, held = tmp_path / "resumed", tmp_path / "held"
    shutil.copytree(small, held)
    checkpoint = straight / "checkpoints" / f"step-{from_step:08d}.ckpt"
    result = run_train(train_args(tiny, out_dir, train_data_dir=f"{tiny.data}:3,{small}:1", devices=devices,
                                  micro_batch_size=micro_batch_size, resume=True, checkpoint=checkpoint,
                                  eval_data_dir=f"held={held}", **MIXTURE_RUN))
    assert result.returncode == 0, result.stdout + result.stderr
    resumed, expected = rows_of(out_dir), rows_of(straight)
    assert sorted(resumed) == list(range(from_step + 1, 101))
    assert all(resumed[step] == expected[step] for step in resumed), "the same rows, step by step"
    metrics, reference = metrics_of(out_dir), metrics_of(straight)
    for step in range(from_step + 10, 101, 10):
        assert float(metrics[step]["train_loss"]) == pytest.approx(float(reference[step]["train_loss"]), rel=1e-4)
    assert float(metrics[100]["val_loss/small"]) == pytest.approx(float(reference[100]["val_loss/small"]), rel=1e-4)
    assert int(metrics[100]["tokens/small"]) == int(reference[100]["tokens/small"]), "counted on from the checkpoint"
    assert float(metrics[100]["val_loss/held"]) == pytest.approx(float(metrics[100]["val_loss/small"]), rel=1e-6)
    assert float(metrics[100]["val_loss"]) == pytest.approx(float(reference[100]["val_loss"]), rel=1e-4)
    assert "step 100: val_loss " in result.stdout and " | val_loss/held " in result.stdout


def test_a_resume_at_a_larger_global_batch_counts_the_epochs_as_its_plan_did(tiny, small, straight, tmp_path) -> None:
    """At step 30 the mixture stands at sample 480 of its 862-row epoch, and no step of 512 rows fits there: the
    plan counts one step of epoch 1 to finish 2 epochs. The counters were left behind at the resume (for a mixture
    only), so its one step finished epoch 0 instead: the run ended at epoch 1 of 2, where a later resume with more
    epochs would have planned one step too many."""
    result = run_train(train_args(tiny, tmp_path / "resumed", train_data_dir=f"{tiny.data}:3,{small}:1", devices=1,
                                  strategy="single_device", micro_batch_size=16, gradient_accumulation_steps=None,
                                  global_batch_size=512, resume=True,
                                  checkpoint=straight / "checkpoints" / "step-00000030.ckpt",
                                  **(MIXTURE_RUN | dict(max_step=None, number_epochs=2, save_step_interval=1,
                                                        warmup_steps=0))))  # 10 steps of 512: past the schedule
    assert result.returncode == 0, result.stdout + result.stderr
    assert "training 31 steps of 512 sequences" in result.stdout, result.stdout
    saved = read_metadata(list_checkpoints(tmp_path / "resumed")[31])
    assert (saved["epoch"], saved["position"]) == (2, 0)


def test_a_resume_that_changes_the_first_folders_weight_counts_its_epoch_at_the_new_weight(tiny, small, straight,
                                                                                           tmp_path) -> None:
    """An epoch is a pass over the first folder: at step 60 of the 3:1 run it stands at sample 112 of 862, 84 of the
    first folder's rows. Annealed to 1:1 at the resume, the same 84 rows are sample 168 of 1,292; the saved position
    was read at the new weight (112 of 1,292), and the epoch went backwards (0.47 to 0.27 in an audit's run)."""
    before = read_metadata(straight / "checkpoints" / "step-00000060.ckpt")
    out_dir = tmp_path / "annealed"
    result = run_train(train_args(tiny, out_dir, train_data_dir=f"{tiny.data}:1,{small}:1", resume=True,
                                  checkpoint=straight / "checkpoints" / "step-00000060.ckpt",
                                  **(MIXTURE_RUN | dict(max_step=62, save_step_interval=2))))
    assert result.returncode == 0, result.stdout + result.stderr
    after = read_metadata(list_checkpoints(out_dir)[62])
    assert (before["epoch"], before["position"]) == (1, 112)
    assert (after["epoch"], after["position"]) == (1, 112 * 3 // 2 + 2 * 16)


def test_a_resume_may_change_the_weights_but_not_drop_or_reorder_the_folders(tiny, small, straight, tmp_path,
                                                                              capfd) -> None:
    from app.training.preflight import preflight
    from arguments import parse_config

    checkpoint = straight / "checkpoints" / "step-00000060.ckpt"

    def resumed(spec: str) -> list[str]:
        return train_args(tiny, tmp_path / "out", train_data_dir=spec, resume=True, checkpoint=checkpoint,
                          max_step=80)

    annealed = preflight(parse_config(resumed(f"{tiny.data}/:1,{small}:1")))  # the same folders, new weights
    assert annealed.mixture and "50.0% of every step" in annealed.mixture
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(resumed(f"{small}:1,{tiny.data}:3")))
    assert exit_info.value.code == 2
    assert "a resumed run keeps those folders in that order" in capfd.readouterr().err
