"""prepare_data.py on small real text (the Python standard library's own sources): formats, packing, splits,
the trained tokenizer, and refusals of bad input."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

from app.prepare import PrepareArgs, UsageError, prepare, stdlib_corpus_paths
from app.prepare.cli import main
from app.prepare.corpus import Documents
from app.prepare.output import write_atomically
from app.prepare.pack import pack
from app.prepare.pipeline import summary
from app.prepare.split import split_by_document

REPO = Path(__file__).resolve().parents[1]
ROUND_TRIP_SAMPLES = [
    "def f(x):\n\tif x  ==  12345:\n        return 'héllo'\n\n",
    "    indented\n\n\n   three blank lines above, trailing spaces   ",
    " leading space and CRLF\r\nline 2\r\n",
    "never seen: 日本語, emoji 🤖🚀, math ∑∫, digits 0123456789 and 3.14159",
    "a literal </s> and <s> in the text stay text",
]


@pytest.fixture(scope="module", autouse=True)
def isolated_datasets_cache(tmp_path_factory):
    """Keep this module's `datasets` cache files out of the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets_cache")))
        yield


def cli_env(tmp_path: Path) -> dict:
    return {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "prepare_data.py"), *args],
        cwd=cwd,
        env=cli_env(cwd),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,  # the tests assert the exit status themselves
    )


@pytest.fixture(scope="module")
def code_documents() -> list[str]:
    """About 260 KB of real Python: the stdlib's json and http packages, one document per file."""
    files = sorted(f for folder in stdlib_corpus_paths(("json", "http")) for f in Path(folder).rglob("*.py"))
    return [f.read_text(encoding="utf-8") for f in files]


@pytest.fixture(scope="module")
def issue_run(tmp_path_factory, code_documents):
    """The exact command from the issue, run as a real subprocess."""
    work = tmp_path_factory.mktemp("issue")
    with open(work / "docs.jsonl", "w") as out:
        out.writelines(json.dumps({"content": text, "path": "ignored"}) + "\n" for text in code_documents)
    command = "--input docs.jsonl --text_field content --vocab_size 600 --block_size 64 --val_fraction 0.1"
    result = run_cli([*command.split(), "--output_dir", "out"], cwd=work)
    assert result.returncode == 0, result.stderr
    return work / "out"


def recover_documents(output_dir: Path, split: str) -> tuple[list[str], list[int], dict]:
    """Cut the concatenated blocks after each EOS: every piece must be exactly BOS + the encoded document + EOS.

    Returns the documents, the tokens after the last EOS (the start of the document the tail cut off), and stats.
    """
    tokenizer = AutoTokenizer.from_pretrained(output_dir / "tokenizer")
    blocks = datasets.load_from_disk(str(output_dir))[split]
    stream = [token for block in blocks["input_ids"] for token in block]
    documents, start = [], 0
    for position, token in enumerate(stream):
        if token == tokenizer.eos_token_id:
            piece = stream[start : position + 1]
            text = tokenizer.decode(piece, skip_special_tokens=True)
            assert piece == encode(tokenizer, text), "tokens in a block differ from the document's own encoding"
            documents.append(text)
            start = position + 1
    stats = json.loads((output_dir / "stats.json").read_text())
    return documents, stream[start:], stats


def encode(tokenizer, text: str) -> list[int]:
    """A document as it must appear in the stream: the tokenizer's BOS, the text, then EOS."""
    return tokenizer(text, split_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]


def test_issue_command_writes_blocks_of_64_and_a_tokenizer_that_round_trips_code(issue_run, code_documents):
    blocks = datasets.load_from_disk(str(issue_run))
    assert set(blocks) == {"train", "validation"}
    for split in blocks.values():
        assert split.column_names == ["input_ids"]
        assert split.features["input_ids"].feature.dtype == "int32"
        assert len(split) > 0 and {len(row) for row in split["input_ids"]} == {64}
    tokenizer = AutoTokenizer.from_pretrained(issue_run / "tokenizer")
    for text in code_documents[:3] + ROUND_TRIP_SAMPLES:
        assert tokenizer.decode(encode(tokenizer, text), skip_special_tokens=True) == text


def test_stats_say_the_rows_are_raw_text_blocks_and_which_libraries_prepared_them(issue_run):
    stats = json.loads((issue_run / "stats.json").read_text())
    assert stats["format"] == "text"
    assert list(stats)[-1] == "prepared_with" and stats["prepared_with"]["datasets"] == datasets.__version__


def test_trained_tokenizer_reloads_with_bos_eos_and_exact_round_trip(issue_run):
    tokenizer = AutoTokenizer.from_pretrained(issue_run / "tokenizer")
    stats = json.loads((issue_run / "stats.json").read_text())
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (stats["bos_token_id"], stats["eos_token_id"])
    assert len(tokenizer) == stats["vocab_size"] == 600
    for text in ROUND_TRIP_SAMPLES:
        ids = tokenizer(text, split_special_tokens=True)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in ids
        assert tokenizer.unk_token_id not in ids, "byte fallback must cover characters never seen in training"
        assert tokenizer.decode(ids[1:]) == text
    digits = tokenizer("98765", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(digits) == list("98765")


def test_blocks_are_the_exact_token_stream_with_eos_after_every_document(issue_run, code_documents):
    tokenizer = AutoTokenizer.from_pretrained(issue_run / "tokenizer")
    assert min(len(encode(tokenizer, text)) for text in code_documents) > 64, "so the tail cuts at most one document"
    splits = {}
    for split in ("train", "validation"):
        documents, tail, stats = recover_documents(issue_run, split)
        counts = stats["splits"][split]
        assert counts["blocks"] * 64 + counts["dropped_tokens"] == counts["tokens"] and counts["dropped_tokens"] < 64
        assert set(documents) <= set(code_documents), "a document was cut, padded or duplicated"
        if tail:  # the stream ends inside one document: its first tokens are in the blocks, the rest was dropped
            cut = [text for text in code_documents if encode(tokenizer, text)[: len(tail)] == tail]
            assert any(len(encode(tokenizer, text)) - len(tail) == counts["dropped_tokens"] for text in cut)
            documents.append(cut[0])
        assert len(documents) == counts["documents"]
        splits[split] = set(documents)
    assert not splits["train"] & splits["validation"], "a document is in both train and validation"
    assert splits["train"] | splits["validation"] == set(code_documents)
    assert len(splits["validation"]) == 1  # ceil(0.1 * 10 files)


def test_packing_is_exact_across_batches_and_processes():
    rng = np.random.default_rng(0)
    documents = [rng.integers(3, 500, size=rng.integers(1, 40)).tolist() for _ in range(3000)]
    tokenized = Dataset.from_dict({"input_ids": documents, "length": [len(d) for d in documents]})
    stream = np.concatenate([np.asarray(d) for d in documents])
    blocks = pack(tokenized, block_size=7, num_proc=2, desc="test")
    expected = stream[: len(stream) // 7 * 7].reshape(-1, 7)
    assert len(blocks) > 2000, "must span several map batches"
    np.testing.assert_array_equal(np.asarray(blocks["input_ids"]), expected)
    apart = pack(tokenized, block_size=7, num_proc=2, desc="test", documents_apart=True)  # --document_masking
    np.testing.assert_array_equal(np.asarray(apart["input_ids"]), expected)
    starts = np.zeros(len(stream), dtype=bool)
    starts[np.cumsum([0] + [len(d) for d in documents[:-1]])] = True  # each document's first token
    starts[::7] = True  # and each block's: a document that goes on there is a new piece
    positions = np.asarray(apart["position_ids"]).reshape(-1)
    np.testing.assert_array_equal(positions == 0, starts[: len(positions)])
    np.testing.assert_array_equal(np.diff(positions)[~starts[1: len(positions)]], 1)  # counting up within a piece
    labels, ids = np.asarray(apart["labels"]).reshape(-1), expected.reshape(-1)
    assert (labels[positions == 0] == -100).all() and (labels[positions > 0] == ids[positions > 0]).all()


def write_format(folder: Path, kind: str, documents: list[str]) -> Path:
    """The same documents as one of the accepted input kinds; returns the --input path."""
    folder.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame({"body": documents, "id": range(len(documents))})
    if kind == "txt":
        for i, text in enumerate(documents):
            (folder / f"doc{i}.txt").write_text(text)
        return folder
    if kind == "split_lines":
        (folder / "lines.txt").write_text("\n".join(text.replace("\n", " ") for text in documents) + "\n")
        return folder / "lines.txt"
    if kind == "jsonl":
        table.to_json(folder / "docs.jsonl", orient="records", lines=True)
        return folder / "docs.jsonl"
    if kind == "json":
        (folder / "docs.json").write_text(json.dumps(table.to_dict(orient="records")))
        return folder / "docs.json"
    if kind == "parquet":
        table.to_parquet(folder / "docs.parquet")
        return folder / "docs.parquet"
    if kind == "csv":
        table.to_csv(folder / "docs.csv", index=False)
        return folder / "docs.csv"
    if kind == "folder":
        half = len(documents) // 2
        nested = folder / "nested" / "deeper"
        nested.mkdir(parents=True)
        for i, text in enumerate(documents[:half]):
            (nested / f"module{i}.py" if i % 2 else folder / f"note{i}.md").write_text(text)
        table.iloc[half:].to_json(folder / "rest.jsonl", orient="records", lines=True)
        (folder / "__pycache__").mkdir()
        (folder / "__pycache__" / "skip.txt").write_text("not a document")
        return folder
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["txt", "split_lines", "jsonl", "json", "parquet", "csv", "folder"])
def test_every_input_format_yields_its_documents(kind, tmp_path, issue_run, code_documents):
    documents = [text[:400] for text in code_documents] + [f"short doc {i}\twith tab" for i in range(10)]
    if kind == "split_lines":
        documents = [text.replace("\n", " ") for text in documents]
    source = write_format(tmp_path / "in", kind, documents)
    stats = prepare(
        PrepareArgs(
            input=[str(source)],
            text_field=None if kind in ("txt", "split_lines") else "body",  # plain text has no fields
            split_lines=kind == "split_lines",
            tokenizer=str(issue_run / "tokenizer"),
            block_size=2,  # so that at most the final EOS is dropped and every document can be recovered
            val_fraction=0.2,
            output_dir=str(tmp_path / "out"),
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    recovered = []
    for split in ("train", "validation"):
        pieces, tail, _ = recover_documents(tmp_path / "out", split)
        recovered += pieces + ([tokenizer.decode(tail, skip_special_tokens=True)] if tail else [])
    assert sorted(recovered) == sorted(documents)
    assert sum(stats["splits"][s]["documents"] for s in ("train", "validation")) == len(documents)


def test_a_csv_file_beside_other_raw_text_inputs_is_read_with_them(tmp_path, issue_run):
    """pandas types a .csv's text as large_string, the JSON and text readers as string: the parts could not be
    joined, and a .csv beside any other raw-text input (in a folder, or as another --input) ended in a traceback."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "b.jsonl").write_text("".join(json.dumps({"text": f"json {i}"}) + "\n" for i in range(30)))
    pd.DataFrame({"text": [f"csv {i}" for i in range(20)]}).to_csv(tmp_path / "in" / "c.csv", index=False)
    (tmp_path / "in" / "d.txt").write_text("one text file")
    for inputs in ([tmp_path / "in"], [tmp_path / "in" / "c.csv", tmp_path / "in" / "b.jsonl"]):
        stats = prepare(PrepareArgs(input=[str(path) for path in inputs], tokenizer=str(issue_run / "tokenizer"),
                                    block_size=4, val_fraction=0, output_dir=str(tmp_path / "out"), overwrite=True))
        assert stats["splits"]["train"]["documents"] == (51 if len(inputs) == 1 else 50)


@pytest.mark.parametrize("name, content, advice", [
    ("b.txt", b"caf\xe9 au lait\n", "convert it from its encoding (iconv -f ENCODING -t UTF-8, ENCODING cp1252, "),
    ("c.jsonl", b'{"text": "caf\xe9"}\n', "convert it from its encoding"),
    ("d.txt", "\ufeff\u6211\u4eec\n".encode("utf-16-le"), "it looks UTF-16: convert it (iconv -f UTF-16 -t UTF-8)"),
    ("e.txt", "\u6211\u4eec abc".encode("utf-16-be"), "it looks UTF-16: convert it (iconv -f UTF-16 -t UTF-8)"),
    ("f.txt", "\ufeff\u6211".encode("utf-32-le"), "it looks UTF-32: convert it (iconv -f UTF-32 -t UTF-8)")])
def test_a_file_that_is_not_utf8_is_named_with_its_byte(name, content, advice, tmp_path, capsys, issue_run):
    """The text reader said "An error occurred while generating the dataset", naming no file among thousands; the
    JSON reader let the bytes through to a UnicodeDecodeError traceback at their first use. A UTF-16 file, converted
    as latin1 as the line advised for every file, became mojibake and NULs that prepared without a word."""
    (tmp_path / "in" / "deep").mkdir(parents=True)
    (tmp_path / "in" / "a.txt").write_text("fine text")
    (tmp_path / "in" / "deep" / name).write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", str(tmp_path / "in"), "--tokenizer", str(issue_run / "tokenizer"), "--block_size", "4",
              "--val_fraction", "0", "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"{tmp_path / 'in' / 'deep' / name} is not UTF-8 text (byte " in error[0], error
    assert advice in error[0], error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in"]


def test_saved_dataset_brings_its_own_validation_split(tmp_path, issue_run, code_documents):
    own = DatasetDict(
        train=Dataset.from_dict({"text": code_documents[:-2]}),
        validation=Dataset.from_dict({"text": code_documents[-2:]}),
    )
    own.save_to_disk(str(tmp_path / "saved"))
    saved = sorted(path.relative_to(tmp_path) for path in (tmp_path / "saved").rglob("*"))
    stats = prepare(
        PrepareArgs(
            input=[str(tmp_path / "saved")],
            tokenizer=str(issue_run / "tokenizer"),
            block_size=64,
            output_dir=str(tmp_path / "out"),
        )
    )
    assert sorted(path.relative_to(tmp_path) for path in (tmp_path / "saved").rglob("*")) == saved, (
        "datasets wrote its cache-*.arrow files into the input folder")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "saved"], "the workspace is gone"
    assert stats["splits"]["validation"]["documents"] == 2
    validation, _, _ = recover_documents(tmp_path / "out", "validation")
    assert set(validation) <= set(code_documents[-2:]) and validation


def test_split_of_a_saved_dataset_is_read_as_from_the_hub_and_refused_where_there_is_none(tmp_path, issue_run,
                                                                                           code_documents):
    """`--split train[:10%]`, the help's own example, was refused as "not in --input" for a saved DatasetDict, and
    --split was silently ignored for a saved Dataset: every row was prepared."""
    texts = [text for document in code_documents for text in document.split("\n\n") if text.strip()][:30]
    DatasetDict(train=Dataset.from_dict({"text": texts[:20]}),
                test=Dataset.from_dict({"text": texts[20:]})).save_to_disk(str(tmp_path / "saved"))
    Dataset.from_dict({"text": texts[:20]}).save_to_disk(str(tmp_path / "single"))
    args = {"input": [str(tmp_path / "saved")], "tokenizer": str(issue_run / "tokenizer"), "block_size": 8,
            "val_fraction": 0}
    for spec, documents in (("train[:10%]", 2), ("train[5:8]+test[:2]", 5), ("test", 10)):
        stats = prepare(PrepareArgs(**args, split=spec, output_dir=str(tmp_path / "out"), overwrite=True))
        assert stats["splits"]["train"]["documents"] == documents, spec
        assert stats["inputs"] == [f"{tmp_path / 'saved'} ({spec}: {documents} rows)"]
    with pytest.raises(UsageError, match=r"^--split validation: Unknown split \"validation\".* \(--input .* has "
                                         r"train, test\)$"):
        prepare(PrepareArgs(**args, split="validation", output_dir=str(tmp_path / "refused")))
    with pytest.raises(UsageError) as refusal:
        prepare(PrepareArgs(**args | {"input": [str(tmp_path / "single")]}, split="train[:10%]",
                            output_dir=str(tmp_path / "refused")))
    assert str(refusal.value) == (f"--split train[:10%]: --input {tmp_path / 'single'} is a saved dataset without "
                                  "splits (20 rows); drop --split")
    assert not (tmp_path / "refused").exists()


def test_a_local_file_rewritten_with_its_time_kept_is_read_anew_and_leaves_no_cache(tmp_path, issue_run):
    """datasets knows a local file by its path and modification time: rewritten with its time kept (rsync -a, tar
    --mtime, build tools that fix times), it was read as before, silently. It also left a converted copy and the
    tokenized rows (2.5 times the input) in the shared cache, kept for ever."""
    source = tmp_path / "docs.jsonl"
    arguments = dict(input=[str(source)], tokenizer=str(issue_run / "tokenizer"), block_size=16, val_fraction=0,
                     output_dir=str(tmp_path / "out"), overwrite=True)
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    before = sorted(cache.rglob("*")) if cache.exists() else []
    source.write_text("".join(json.dumps({"text": f"alpha document {i}"}) + "\n" for i in range(50)))
    kept = source.stat().st_mtime_ns
    assert prepare(PrepareArgs(**arguments))["splits"]["train"]["documents"] == 50
    source.write_text("".join(json.dumps({"text": f"beta document {i}"}) + "\n" for i in range(80)))
    os.utime(source, ns=(kept, kept))
    assert prepare(PrepareArgs(**arguments))["splits"]["train"]["documents"] == 80
    assert (sorted(cache.rglob("*")) if cache.exists() else []) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["docs.jsonl", "out"]


def test_same_seed_same_output_other_seed_other_split(tmp_path, code_documents):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code_documents))

    def run(seed: int, name: str) -> tuple[list, str]:
        args = PrepareArgs(
            input=[str(tmp_path / "docs.jsonl")],
            vocab_size=400,
            block_size=32,
            seed=seed,
            val_fraction=0.3,
            output_dir=str(tmp_path / name),
        )
        prepare(args)
        validation = datasets.load_from_disk(str(tmp_path / name))["validation"]["input_ids"]
        return list(validation), (tmp_path / name / "tokenizer" / "tokenizer.json").read_text()

    first, again, other = run(1, "a"), run(1, "b"), run(2, "c")
    assert first == again
    assert first[0] != other[0]


def test_identical_records_are_held_out_together_the_same_way_for_a_seed():
    """Half of the examples twice, as in scraped data: a duplicate must never be trained on and evaluated. Without
    duplicates the split is datasets' train_test_split's, so prepared folders keep their rows."""
    records = [{"source": f"def f{i}(): pass", "target": f"Function {i}."} for i in range(40)]
    pool = Dataset.from_list(records + records[:20])

    def split(pool: Dataset, seed: int) -> tuple[list[tuple], list[tuple]]:
        splits = split_by_document(Documents(pool, None, None, ["pairs.jsonl"]), 0.2, seed, 1, "example").records
        return [tuple(row.values()) for row in splits["train"]], [tuple(row.values()) for row in splits["validation"]]

    train, validation = split(pool, seed=3)
    assert not set(train) & set(validation) and len(train) + len(validation) == 60
    assert 12 <= len(validation) <= 24, "ceil(0.2 * 60) records, and the copies of those held out"
    assert split(pool, seed=3) == (train, validation)
    assert set(split(pool, seed=4)[1]) != set(validation)
    distinct = Dataset.from_list(records + [{"source": "def g(): pass", "target": "G."}])  # 41: 0.2 of it is 8.2
    expected = distinct.train_test_split(test_size=0.2, seed=3)
    assert split(distinct, seed=3) == tuple([tuple(row.values()) for row in expected[part]]
                                            for part in ("train", "test"))
    assert len(expected["test"]) == 9, "ceil(0.2 * 41)"


def test_too_few_documents_for_whole_ones_hold_out_the_end_of_each(code_documents):
    """Three files at --val_fraction 0.05: one whole file held out was a third of the corpus. Where whole documents
    would hold out more than twice val_fraction of them, validation is the last 5% of each instead: nothing in both
    splits, every document in both, about 5% of the text; with enough documents, whole ones are held out as
    before."""
    few = code_documents[:3]
    held = split_by_document(Documents(Dataset.from_dict({"text": few}), None, None, ["three.jsonl"]), 0.05, 0, 1)
    train, validation = held.records["train"]["text"], held.records["validation"]["text"]
    assert held.held_out == "document_ends"
    assert [head + tail for head, tail in zip(train, validation)] == few
    assert all(head and tail and head.endswith("\n") for head, tail in zip(train, validation)), "cut at a line break"
    assert 0.04 < sum(map(len, validation)) / sum(map(len, few)) < 0.06
    many = Documents(Dataset.from_dict({"text": code_documents}), None, None, ["all.jsonl"])
    assert split_by_document(many, 1 / len(code_documents), 0, 1).held_out == "documents"


@pytest.mark.parametrize("text, fraction, expected", [
    ("a" * 100, 0.1, 90),  # no separator: the point itself
    ("a" * 85 + "\n" + "b" * 14, 0.1, 90),  # a line break too far before the point (more than a quarter of 10)
    ("a" * 87 + "\n" + "b" * 12, 0.1, 88),  # just after the line break, before the point
    ("a" * 91 + "\n" + "b" * 8, 0.1, 92),  # or after it
    ("a" * 88 + " " + "a" * 5 + "\n" + "b" * 5, 0.1, 89),  # a space where no line break is near enough
    ("a" * 99 + "\n", 0.5, 50),  # never an empty end or an empty start
    ("\n" + "a" * 99, 0.99, 1),
])
def test_end_cut_starts_the_held_out_end_after_a_nearby_break(text, fraction, expected):
    from app.prepare.split import end_cut
    assert end_cut(text, fraction) == expected


def test_one_text_file_without_line_breaks_trains_a_tokenizer_and_holds_out_its_end(tmp_path):
    """One document (a book, a text file with one paragraph per line): it was refused ("1 distinct document"), and
    SentencePiece skipped every line longer than 4,192 bytes without a word, so a corpus of long lines trained its
    tokenizer on the short ones alone, or failed as "too small"."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma"]
    rng = np.random.default_rng(0)
    (tmp_path / "book.txt").write_text(" ".join(rng.choice(words, 40_000)))
    result = run_cli(["--input", "book.txt", "--vocab_size", "300", "--block_size", "64", "--output_dir", "out"],
                     tmp_path)
    assert result.returncode == 0, result.stderr
    assert "validation: " in result.stdout and "from the last 5% of 1 documents" in result.stdout
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["validation_held_out"] == "document_ends"
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "tokenizer"))
    assert len(tokenizer(" epsilon", add_special_tokens=False)["input_ids"]) == 1, "learnt from the long line"
    longer = run_cli(["--input", "book.txt", "--vocab_size", "300", "--block_size", "8192", "--output_dir", "o2"],
                     tmp_path)
    assert longer.returncode == 2 and "tokens: the last 5% of each of 1 documents, too few to hold out whole ones); " \
        "raise --val_fraction or lower --block_size" in longer.stderr, longer.stderr


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--input", "no/such/file.jsonl", "--vocab_size", "600"], "--input no/such/file.jsonl"),
        (["--input", "{docs}"], "--tokenizer"),
        (["--input", "{docs}", "--vocab_size", "600", "--tokenizer", "gpt2"], "--vocab_size"),
        (["--input", "{docs}", "--vocab_size", "600", "--text_field", "content"], "--text_field content"),
        (["--input", "{empty}", "--vocab_size", "600"], "no non-empty documents"),
        (["--input", "{docs}", "--vocab_size", "600", "--val_fraction", "1.5"], "--val_fraction"),
        (["--input", "{docs}", "--vocab_size", "600", "--block_size", "oops"], "block_size"),
        (["--input", "{docs}", "--vocab_size", "600", "--seed", "-1"], "--seed -1"),  # numpy's traceback
        (["--input", "{docs}", "--vocab_size", "600", "--seed", "99999999999"], "--seed 99999999999"),
        (["--input", "{docs}", "--vocab_size", "3000000000"], "--vocab_size 3000000000 is too large"),  # traceback
        # silently ignored:
        (["--input", "{docs}", "--vocab_size", "600", "--split_lines", "true"], "no --input holds a .txt file"),
        (["--input", "{docs}", "--vocab_size", "600", "--dataset_config", "en"], "--dataset_config en applies to a "
                                                                                   "Hugging Face dataset"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_leaves_output_alone(argv, flag, tmp_path, capsys, code_documents):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t, "id": 1}) + "\n" for t in code_documents))
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    argv = [a.format(docs=tmp_path / "docs.jsonl", empty=tmp_path / "empty.jsonl") for a in argv]
    output = make_earlier_output(tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--output_dir", str(output), "--overwrite"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and flag in error[0], error
    assert_untouched(output, tmp_path)


EARLIER_OUTPUT = {"dataset_dict.json": '{"splits": ["train", "validation"]}', "stats.json": '{"format": "text"}'}
"""The files by which --overwrite knows an earlier output of prepare_data.py (the only folder it may replace)."""


def make_earlier_output(output: Path) -> Path:
    output.mkdir()
    for name, text in EARLIER_OUTPUT.items():
        (output / name).write_text(text)
    return output


def assert_earlier_output(output: Path) -> None:
    assert {p.name: p.read_text() for p in output.iterdir()} == EARLIER_OUTPUT, "output touched"


def assert_untouched(output: Path, tmp_path: Path) -> None:
    assert_earlier_output(output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "empty.jsonl", "out"], "no leftovers"


def test_block_size_larger_than_the_text_is_refused_after_tokenizing_before_writing(tmp_path, capsys, issue_run):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "x = 1\n"}) + "\n" + json.dumps({"text": "y"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    output = make_earlier_output(tmp_path / "out")
    argv = ["--input", str(tmp_path / "docs.jsonl"), "--tokenizer", str(issue_run / "tokenizer"), "--block_size", "64"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--output_dir", str(output), "--overwrite"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("prepare_data.py: error: --block_size 64 is larger than the training text (")
    assert not any("Traceback" in line for line in error)
    assert_untouched(output, tmp_path)


def make_refusable_folder(tmp_path: Path) -> None:
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "x = 1\n", "id": 1}) + "\n")
    make_earlier_output(tmp_path / "out")


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--input", "missing.txt", "--vocab_size", "600"], "--input missing.txt"),
        (["--input", "docs.jsonl", "--vocab_size", "600"], "--output_dir"),
        (["--input", "docs.jsonl", "--vocab_size", "600", "--text_field", "nope", "--overwrite"], "text, id"),
    ],
)
def test_refusals_name_the_flag_in_one_line_and_leave_the_output_alone(argv, flag, tmp_path, capsys, monkeypatch):
    make_refusable_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--output_dir", "out"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and flag in lines[0], lines
    assert_earlier_output(tmp_path / "out")


def test_overwrite_refuses_an_earlier_output_holding_more_than_it_wrote(tmp_path, capsys, monkeypatch):
    """A train.py run given the data folder as --out_dir, or notes kept beside the data: --overwrite replaced the
    whole folder and deleted them with it."""
    make_refusable_folder(tmp_path)
    run = tmp_path / "out" / "checkpoints"
    run.mkdir()
    (run / "step-00000002.ckpt").write_text("a run's")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", "docs.jsonl", "--vocab_size", "600", "--overwrite", "--output_dir", "out"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert "--output_dir out: --overwrite would also delete checkpoints, which prepare_data.py did not" in lines[0]
    assert (run / "step-00000002.ckpt").read_text() == "a run's"


def test_workers_are_forked_also_where_python_starts_them_from_a_forkserver(monkeypatch):
    """Python 3.14 makes forkserver the default start method on Linux (as here): each datasets pool's workers then
    imported datasets and transformers again at every map (5 to 13 times slower on small inputs, in an audit that
    made it the default on 3.11), and a stop printed a traceback before its one line, as app/stopping.py's fork
    hooks never ran."""
    import multiprocess.context

    from app.prepare.pipeline import fork_the_workers

    default = multiprocess.context._default_context
    for start in (fork_the_workers, lambda: pytest.raises(UsageError, prepare, PrepareArgs(
            input=["/nonexistent/corpus"], output_dir="/nonexistent/out"))):  # prepare() forks them first
        monkeypatch.setattr(default, "_default_context", multiprocess.context._concrete_contexts["forkserver"])
        monkeypatch.setattr(default, "_actual_context", None)
        assert multiprocess.get_start_method() == "forkserver"
        start()
        assert multiprocess.get_start_method() == "fork"


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_a_signal_to_prepare_alone_ends_its_workers(tmp_path, issue_run, code_documents, stop):
    """`kill PID`, `timeout`, or an orchestrator signalling only the main process: its --num_proc workers were left
    running, orphaned, 1.25 GB each, for ever (the pool waited for them), and Ctrl-C ended in 63 lines of traceback
    and exit 1. Now: one line, exit 128 + the signal, no process and no folder left behind, not even
    multiprocessing's pymp-* folder in $TMPDIR. SIGKILL (the out-of-memory killer's) left the workers idle for ever,
    adopted by init (345 MB each in an audit's run): they end with the command now."""
    import signal

    import psutil

    corpus = tmp_path / "corpus.jsonl"  # about 15 MB: tokenizing it outlasts the moment the signal comes
    temporary = Path(tempfile.mkdtemp(prefix="t"))  # short: a socket's path under it has at most 107 bytes
    with open(corpus, "w") as handle:
        for copy in range(60):
            handle.writelines(json.dumps({"text": f"# {copy}\n{text}"}) + "\n" for text in code_documents)
    started = subprocess.Popen([sys.executable, str(REPO / "prepare_data.py"), "--input", str(corpus), "--tokenizer",
                                str(issue_run / "tokenizer"), "--block_size", "64", "--num_proc", "2",
                                "--output_dir", str(tmp_path / "new" / "out")],
                               cwd=tmp_path, env=cli_env(tmp_path) | {"TMPDIR": str(temporary)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert started.stdout is not None
    for line in started.stdout:
        if "tokenizing" in line:
            break
    deadline = time.monotonic() + 30
    while len(workers := psutil.Process(started.pid).children(recursive=True)) < 2:
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.1)
    started.send_signal(getattr(signal, stop))
    _, err = started.communicate(timeout=60)
    psutil.wait_procs(workers, timeout=10)
    assert not [worker.pid for worker in workers if worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE]
    time.sleep(0.5)  # nor a worker the pool forked in place of a killed one after the kill had looked (one was left
    assert not [process.pid for process in psutil.process_iter(["cmdline", "status"])  # orphaned, waiting for work)
                if str(tmp_path / "new" / "out") in (process.info["cmdline"] or [])
                and process.info["status"] != psutil.STATUS_ZOMBIE]
    if stop == "SIGKILL":  # no last word; what it began is removed by the next run into that folder
        shutil.rmtree(temporary)
        return
    assert (started.returncode, err.strip()) == (143, "prepare_data.py: stopped by SIGTERM; nothing was written "
                                                      "(the output appears whole, or not at all)")
    assert not (tmp_path / "new").exists(), "no output, workspace, or folder made for them"
    assert not list(temporary.glob("pymp-*")), "multiprocessing's folder, which os._exit left"
    temporary.rmdir()


SENTENCEPIECE_STOPPED = """
import random, sys
sys.path.insert(0, sys.argv[1])
from app.stopping import stopped_in_one_line
from app.prepare.tokenizer import train_tokenizer

random.seed(0)
words = ["".join(random.choices("abcdefghijklmnopqrstuvwxyz", k=random.randint(2, 9))) for _ in range(20000)]
lines = [" ".join(random.choices(words, k=30)) for _ in range(150000)]

def texts():
    yield from lines
    print("given", flush=True)

with stopped_in_one_line("prepare_data.py", "nothing was written", lambda: None):
    train_tokenizer(texts(), vocab_size=30000, seed=0)
print("trained", flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_while_sentencepiece_trains_stops_at_once(tmp_path):
    """Once SentencePiece has read its lines it trains in C++ (4 s here for this corpus, minutes for a large one),
    and Python's handler waited for it: Ctrl-C did nothing until the training ended."""
    import signal

    started = subprocess.Popen([sys.executable, "-c", SENTENCEPIECE_STOPPED, str(REPO)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert started.stdout is not None
    assert started.stdout.readline() == "given\n"
    sent = time.monotonic()
    started.send_signal(signal.SIGINT)
    out, err = started.communicate(timeout=120)
    seconds = time.monotonic() - sent
    assert (started.returncode, err, out) == (130, "prepare_data.py: stopped by SIGINT; nothing was written\n", "")
    assert seconds < 1.0, f"stopped {seconds:.1f} s after Ctrl-C"


POOL_TERMINATED = """
import multiprocessing, sys, time
sys.path.insert(0, sys.argv[1])
from app.stopping import stopped_in_one_line

with stopped_in_one_line("prepare_data.py", "nothing was written", lambda: None):
    with multiprocessing.get_context("fork").Pool(2) as pool:  # leaving it terminates the busy workers (SIGTERM)
        pool.map_async(time.sleep, [5, 5])
        time.sleep(0.5)
    time.sleep(1)
print("done", flush=True)
"""


def test_a_signal_to_a_worker_alone_is_not_the_commands(tmp_path):
    """The workers inherited the pipe through which the command's thread takes its signals: `Pool.terminate()`, which
    SIGTERMs the busy workers, stopped the whole command ("stopped by SIGTERM", exit 143)."""
    result = subprocess.run([sys.executable, "-c", POOL_TERMINATED, str(REPO)], capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")


def test_a_stop_while_the_output_is_written_leaves_no_staged_copy(tmp_path):
    """Ctrl-C while the dataset was saved left the whole staged copy beside --output_dir (50 MB in an audit's run,
    gigabytes on a real corpus), after "nothing was written"."""
    from app.prepare.output import write_atomically
    from app.prepare.workspace import abandon

    def write(staging: Path) -> None:
        (staging / "train").mkdir()
        abandon()  # what the stop calls before the process exits without unwinding
        raise SystemExit(130)

    with pytest.raises(SystemExit):
        write_atomically(tmp_path / "out", write, overwrite=False)
    assert list(tmp_path.iterdir()) == []


def test_real_cli_refuses_a_dataset_it_cannot_find_with_one_line(tmp_path):
    """`python prepare_data.py` itself, offline: the Hub is asked, and its error becomes one line."""
    make_refusable_folder(tmp_path)
    result = run_cli(["--input", "no-such-dataset-here", "--vocab_size", "600", "--overwrite", "--output_dir", "out"],
                     cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--input no-such-dataset-here" in lines[0] and "Traceback" not in result.stderr, lines
    assert_earlier_output(tmp_path / "out")


def test_overwrite_replaces_only_after_the_new_output_is_complete(tmp_path, issue_run, code_documents):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code_documents))
    output = make_earlier_output(tmp_path / "out")
    args = {"input": [str(tmp_path / "docs.jsonl")], "tokenizer": str(issue_run / "tokenizer"), "block_size": 64}
    with pytest.raises(UsageError, match="--output_dir .* already holds data"):
        prepare(PrepareArgs(**args, output_dir=str(output)))
    prepare(PrepareArgs(**args, output_dir=str(output), overwrite=True))
    assert sorted(p.name for p in output.iterdir()) == [
        "dataset_dict.json",
        "stats.json",
        "tokenizer",
        "train",
        "validation",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "out"], "staging folders left behind"
    with pytest.raises(UsageError, match="overlaps --input"):
        prepare(PrepareArgs(**{**args, "input": [str(tmp_path)]}, output_dir=str(output), overwrite=True))


def test_overwrite_of_a_linked_output_replaces_the_data_where_the_link_points_and_the_current_folder_works(
        tmp_path, issue_run, code_documents, monkeypatch):
    """A data folder linked to scratch storage: the link itself was renamed, the new data went beside it onto the
    other disk, the old data stayed, and the run ended in a traceback. `--output_dir .` failed after all the work."""
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code_documents[:3]))
    args = {"input": [str(tmp_path / "docs.jsonl")], "tokenizer": str(issue_run / "tokenizer"), "block_size": 64,
            "val_fraction": 0}
    scratch = tmp_path / "scratch" / "data"
    prepare(PrepareArgs(**args, output_dir=str(scratch)))
    (tmp_path / "data").symlink_to(scratch)
    prepare(PrepareArgs(**args | {"block_size": 32}, output_dir=str(tmp_path / "data"), overwrite=True))
    assert (tmp_path / "data").is_symlink() and (tmp_path / "data").resolve() == scratch
    assert json.loads((scratch / "stats.json").read_text())["block_size"] == 32
    assert sorted(p.name for p in scratch.parent.iterdir()) == ["data"], "staging folders left behind"
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    prepare(PrepareArgs(**args, output_dir="."))
    assert json.loads((tmp_path / "here" / "stats.json").read_text())["block_size"] == 64


def test_overwrite_refuses_a_folder_that_is_not_an_earlier_output_and_touches_nothing(tmp_path, issue_run,
                                                                                      code_documents):
    """--overwrite replaces --output_dir whole: a project folder named by mistake must survive, also when it changes
    into one while the data is prepared."""
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code_documents[:3]))
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "model.py").write_text("precious")
    (project / "stats.json").write_text("{}")  # one of the two files is not enough
    args = {"input": [str(tmp_path / "docs.jsonl")], "tokenizer": str(issue_run / "tokenizer"), "block_size": 64,
            "val_fraction": 0, "output_dir": str(project), "overwrite": True}
    with pytest.raises(UsageError) as refusal:
        prepare(PrepareArgs(**args))
    assert str(refusal.value) == (
        f"--output_dir {project}: --overwrite replaces only an empty folder or an earlier prepare_data.py output "
        "(with stats.json and dataset_dict.json), and this is neither; choose another folder")
    assert (project / "src" / "model.py").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "project"]
    empty = tmp_path / "empty"
    empty.mkdir()
    write = lambda folder: (empty / "notes.txt").write_text("written meanwhile")  # noqa: E731
    with pytest.raises(UsageError, match="--overwrite replaces only"):
        write_atomically(empty, write, overwrite=True)
    assert [p.name for p in empty.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "empty", "project"], "staging left behind"


def test_an_output_dir_on_read_only_storage_is_refused_before_reading_anything(tmp_path, issue_run, read_only_folder,
                                                                                 code_documents):
    """Found when the staging folder was made, after the corpus was read: a traceback."""
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code_documents[:3]))
    with pytest.raises(UsageError) as refusal:
        prepare(PrepareArgs(input=[str(tmp_path / "docs.jsonl")], tokenizer=str(issue_run / "tokenizer"),
                            block_size=64, output_dir=str(read_only_folder / "data")))
    assert str(refusal.value) == (f"--output_dir {read_only_folder / 'data'}: {read_only_folder} is not writable; "
                                  "choose a folder you can write to")
    from app.prepare.args import check_output_dir  # a link is written where it points, and checked there
    (tmp_path / "elsewhere").symlink_to(read_only_folder / "data")
    with pytest.raises(UsageError, match=f"--output_dir {tmp_path / 'elsewhere'}: {read_only_folder} is not writable"):
        check_output_dir(tmp_path / "elsewhere", overwrite=False, local_inputs=[])
    (tmp_path / "writable").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "writable" / "data")
    check_output_dir(tmp_path / "link", overwrite=False, local_inputs=[])


@pytest.mark.parametrize("before", ["absent", "empty"])
def test_an_output_another_command_wrote_meanwhile_is_never_replaced_without_overwrite(tmp_path, issue_run,
                                                                                       code_documents, before):
    """Two prepare_data.py into one --output_dir at once: the later replaced the earlier's data, and both said
    they had written theirs (one run then trained on the other's format)."""
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code_documents[:3]))
    args = {"input": [str(tmp_path / "docs.jsonl")], "tokenizer": str(issue_run / "tokenizer"), "block_size": 64,
            "val_fraction": 0}
    out = tmp_path / "out"
    if before == "empty":
        out.mkdir()

    def the_other_command_first(folder: Path) -> None:
        prepare(PrepareArgs(**args | {"block_size": 32}, output_dir=str(out)))

    with pytest.raises(UsageError) as refusal:
        write_atomically(out, the_other_command_first, overwrite=False)
    assert str(refusal.value) == (
        f"--output_dir {out}: written by another command while this one prepared its data (another prepare_data.py "
        "into the same folder?); nothing of it was replaced: choose another folder, or add --overwrite")
    assert json.loads((out / "stats.json").read_text())["block_size"] == 32
    assert sorted(path.name for path in tmp_path.iterdir()) == ["docs.jsonl", "out"], "staging left behind"


def test_val_fraction_0_writes_an_empty_validation_split_that_loads(tmp_path, issue_run, code_documents):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code_documents[:3]))
    args = {"input": [str(tmp_path / "docs.jsonl")], "tokenizer": str(issue_run / "tokenizer"), "block_size": 64}
    prepare(PrepareArgs(**args, val_fraction=0, output_dir=str(tmp_path / "out")))
    blocks = datasets.load_from_disk(str(tmp_path / "out"))
    assert len(blocks["validation"]) == 0 and blocks["validation"].column_names == ["input_ids"]
    assert len(blocks["train"]) > 0


def test_a_list_of_strings_field_becomes_one_document_joined_by_spaces(tmp_path, issue_run):
    games = [{"Moves": ["e2e4", "e7e5", f"g1f{i % 8 + 1}"], "Result": "1-0"} for i in range(20)]
    (tmp_path / "games.jsonl").write_text("".join(json.dumps(game) + "\n" for game in games))
    args = PrepareArgs(
        input=[str(tmp_path / "games.jsonl")],
        text_field="Moves",
        tokenizer=str(issue_run / "tokenizer"),
        block_size=2,
        val_fraction=0.2,
        output_dir=str(tmp_path / "out"),
    )
    prepare(args)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    recovered = []
    for split in ("train", "validation"):
        pieces, tail, _ = recover_documents(tmp_path / "out", split)
        recovered += pieces + ([tokenizer.decode(tail, skip_special_tokens=True)] if tail else [])
    assert sorted(recovered) == sorted(" ".join(game["Moves"]) for game in games)
    games[3]["Moves"][1] = None  # a TypeError traceback
    (tmp_path / "games.jsonl").write_text("".join(json.dumps(game) + "\n" for game in games))
    with pytest.raises(UsageError) as refusal:
        prepare(replace(args, output_dir=str(tmp_path / "refused")))
    assert str(refusal.value) == (f"--text_field Moves: row 4 of --input {tmp_path / 'games.jsonl'} holds a null item "
                                  "in its list; remove or fill it")


def test_a_hub_tokenizer_without_the_hub_is_refused_at_once_naming_prefetch(tmp_path):
    """No network and no HF_HUB_OFFLINE: huggingface_hub retried for over a minute, logging each retry, and the line
    gave no way forward; the Hub is asked once, briefly, and the line names the prefetch.py command."""
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "x = 1\n"}) + "\n")
    env = {**cli_env(tmp_path), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = subprocess.run([sys.executable, str(REPO / "prepare_data.py"), "--input", "docs.jsonl", "--tokenizer",
                             "nobody/missing-tokenizer", "--output_dir", "out"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("prepare_data.py: error: --tokenizer nobody/missing-tokenizer: no folder "), lines
    assert "run `python prefetch.py --model nobody/missing-tokenizer`" in lines[0]
    assert "Retry" not in result.stdout + result.stderr and not (tmp_path / "out").exists()


def test_a_vocabulary_too_small_for_the_characters_says_how_large_it_must_be(tmp_path, capsys):
    """SentencePiece needs a piece for every distinct character (and its byte and special pieces): the refusal said
    the text was too small, when it was too varied for --vocab_size; it says the size that is enough."""
    alphabet = "".join(chr(c) for c in range(0xC0, 0x180))
    texts = [f"def f{i}(x):\n    return '{alphabet[i:] + alphabet[:i]}'\n" for i in range(100)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    argv = ["--input", str(tmp_path / "docs.jsonl"), "--block_size", "8", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--vocab_size", "300"])
    error = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(error) == 1, error
    enough = re.search(r"--vocab_size 300: the vocabulary must hold every distinct character of the training text, "
                       r"and its byte and special pieces; raise --vocab_size to at least (\d+);", error[0])
    assert enough and int(enough.group(1)) > 300, error
    assert main([*argv, "--vocab_size", enough.group(1)])["vocab_size"] == int(enough.group(1))


def test_sentencepiece_is_given_a_long_line_in_bounded_pieces_and_other_lines_whole() -> None:
    """Pieces of at most 1,048 characters (4,192 bytes of UTF-8), which put together are the line, cut before a space
    where one lies in a piece's second half; a line SentencePiece takes is given whole, as before."""
    from app.prepare.tokenizer import LINE_PIECE_CHARS, SENTENCE_BYTES, _lines

    long = " ".join(["alpha", "béta", "日本語", "x" * 700][i % 4] for i in range(20_000))
    kept = "y" * 2000  # longer than a piece, but SentencePiece takes its 2,000 bytes
    pieces = list(_lines([f"{long}\n{kept}\n\nshort"]))
    assert "".join(pieces[:-2]) == long and pieces[-2:] == [kept, "short"]
    assert max(len(piece) for piece in pieces[:-2]) <= LINE_PIECE_CHARS
    assert max(len(piece.encode()) for piece in pieces) <= SENTENCE_BYTES
    assert sum(piece.startswith(" ") for piece in pieces[1:-2]) > len(pieces) // 2, "cut before spaces"


def text_lines(count: int, word: str = "text") -> str:
    return "".join(json.dumps({"text": f"{word} {i} " * 8}) + "\n" for i in range(count))


def prepared(tmp_path: Path, issue_run: Path, inputs: list[Path], **options) -> dict:
    return prepare(PrepareArgs(input=[str(path) for path in inputs], tokenizer=str(issue_run / "tokenizer"),
                               output_dir=str(tmp_path / "out"), overwrite=True,
                               **{"val_fraction": 0.0, "block_size": 4, **options}))


def refusal(tmp_path: Path, issue_run: Path, inputs: list[Path], **options) -> str:
    with pytest.raises(UsageError) as refused:
        prepared(tmp_path, issue_run, inputs, **options)
    return str(refused.value)


def test_a_folder_is_read_whole_and_what_it_cannot_read_is_refused_not_passed_over(tmp_path, issue_run):
    """Three `shard-N.jsonl.gz` beside a README.md made a corpus of the README alone; a linked folder and a broken
    link were passed over without a word."""
    folder, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "shard-1.jsonl").write_text(text_lines(10))
    (folder / "README.md").write_text("# A dataset card\n\nThese shards hold text.\n")
    (elsewhere / "shard-2.jsonl").write_text(text_lines(10, "linked"))
    (folder / "linked").symlink_to(elsewhere)
    (folder / "again").symlink_to(folder)  # a loop: each folder is read once
    stats = prepared(tmp_path, issue_run, [folder])
    assert stats["splits"]["train"]["documents"] == 20, "the linked folder's 10 are read, once"
    assert stats["inputs"] == [f"{folder} (2 files; not read: README.md, a dataset card)"]
    (folder / "shard-3.jsonl.gz").write_bytes(b"\x1f\x8b")
    assert refusal(tmp_path, issue_run, [folder]) == (
        f"--input {folder}: holds compressed or archived files, which prepare_data.py does not read "
        f"({folder / 'shard-3.jsonl.gz'}); decompress them (gunzip, zstd -d) or leave them out")
    (folder / "shard-3.jsonl.gz").unlink()
    (folder / "gone.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    assert refusal(tmp_path, issue_run, [folder]) == f"--input {folder}: {folder / 'gone.jsonl'}: a broken link; " \
                                                      "fix or remove it"
    (folder / "gone.jsonl").unlink()
    os.mkfifo(folder / "pipe.jsonl")  # reading it hung for ever, without a word
    assert refusal(tmp_path, issue_run, [folder]) == f"--input {folder}: {folder / 'pipe.jsonl'}: a pipe or a " \
                                                      "device, not a file; write it to a file or leave it out"
    assert refusal(tmp_path, issue_run, [folder / "pipe.jsonl"]) == (
        f"--input {folder / 'pipe.jsonl'}: is a pipe or a device, not a file or folder; write it to a file first")
    zipped = tmp_path / "zipped"  # its data zipped beside its card: the card was the whole corpus
    zipped.mkdir()
    (zipped / "README.md").write_text("# A dataset card\n\nThe data is in data.zip.\n")
    (zipped / "data.zip").write_bytes(b"PK")
    assert refusal(tmp_path, issue_run, [zipped]) == (
        f"--input {zipped}: holds a dataset card ({zipped / 'README.md'}) and no file prepare_data.py reads beside it "
        f"({zipped / 'data.zip'}); give the data as .txt/.py/.md/.jsonl/.json/.parquet/.csv files (decompress or "
        "unpack it)")


def test_a_large_json_array_is_read_with_a_note_that_json_lines_take_less_memory(tmp_path, issue_run, capsys,
                                                                              monkeypatch):
    """datasets reads a file of one JSON array whole: 284 MB took 1.94 GB of memory, as JSON Lines 0.73 GB; nothing
    said so (here the note's threshold is lowered to the test's file)."""
    from app.prepare import corpus

    monkeypatch.setattr(corpus, "WHOLE_ARRAY_NOTE_BYTES", 100)
    array = tmp_path / "docs.json"
    array.write_text(json.dumps([{"text": f"text {i} " * 8} for i in range(20)]))
    assert prepared(tmp_path, issue_run, [array])["splits"]["train"]["documents"] == 20
    assert f"note: {array} is one JSON array of 0 MB, read whole (about five times its size in memory); as JSON " \
        f"Lines it is read in pieces: jq -c '.[]' {array} > {tmp_path / 'docs.jsonl'}" in capsys.readouterr().out


def test_parquet_files_of_other_columns_are_refused_in_one_line_saying_why(tmp_path, issue_run, capfd):
    """The parquet reader logged "Failed to read file ..." (6 lines with its cast error) before ours said only "An
    error occurred while generating the dataset"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "shards"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["a few words of text"] * 10}), folder / "a.parquet")
    pq.write_table(pa.table({"text": ["more words of text"] * 10, "url": ["https://example.org"] * 10}),
                   folder / "b.parquet")
    capfd.readouterr()
    assert refusal(tmp_path, issue_run, [folder]) == (
        f"--input {folder}: could not read it as parquet: its files do not all hold the same columns (there are 1 "
        "new columns ({'url'}) in a file after the first); give files of one layout, or each layout as an --input of "
        "its own")
    assert "Failed to read file" not in capfd.readouterr().err


def test_a_field_whose_values_change_kind_after_the_first_rows_is_refused_wherever_the_row_is(tmp_path, issue_run):
    """datasets takes a JSON column's type from the first rows it reads: an object or a number in a text field of a
    later file (or past the first 10 MB of one) was trained as its JSON text, `{"title": "SECRET"}` and `987654321`,
    where the same rows in the first file were refused; also a chat's content, and a change between 10 and 16 MB of
    the first file (the check took its types from 16 MB). A chat's key null at first and text later is no change."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text(text_lines(20))
    (folder / "b.jsonl").write_text(text_lines(18) + json.dumps({"text": {"title": "SECRET"}}) + "\n"
                                    + json.dumps({"text": 987654321}) + "\n")
    assert refusal(tmp_path, issue_run, [folder]) == (
        f"--text_field text: row 19 of --input {folder / 'b.jsonl'} holds dict {{'title': 'SECRET'}}, not text")
    chats = tmp_path / "chats"
    chats.mkdir()
    chat = [{"role": "user", "content": "What is six times seven?"}, {"role": "assistant", "content": "Forty-two."}]
    (chats / "b.jsonl").write_text(json.dumps({"messages": [chat[0], {**chat[1], "name": "helper"}]}) + "\n")
    (chats / "a.jsonl").write_text(json.dumps({"messages": [chat[0], {**chat[1], "name": None}]}) + "\n")
    assert prepared(tmp_path, issue_run, [chats], messages_field="messages",
                    block_size=128)["splits"]["train"]["kept"] == 2
    big = tmp_path / "big.jsonl"
    line = json.dumps({"text": "some words " * 8}) + "\n"
    rows = 12 * 2**20 // len(line)  # 12 MB: past datasets' first 10 MB
    big.write_text(line * rows + json.dumps({"text": 987654321}) + "\n")
    assert refusal(tmp_path, issue_run, [big]) == (
        f"--text_field text: row {rows + 1} of --input {big} holds int 987654321, not text")
    moves = tmp_path / "moves"  # a list of text (the chess games' `Moves`): a number in a later file's list
    moves.mkdir()
    (moves / "a.jsonl").write_text("".join(json.dumps({"Moves": ["e4", "e5", "Nf3"]}) + "\n" for _ in range(8)))
    (moves / "b.jsonl").write_text(json.dumps({"Moves": [1, 2]}) + "\n")
    assert refusal(tmp_path, issue_run, [moves], text_field="Moves") == (
        f"--text_field Moves: row 1 of {moves / 'b.jsonl'} holds a number in its list where the rows before (of "
        f"--input {moves}) hold text: give every row the same kind there, or leave such rows out")
    big.write_text(json.dumps({"text": "word " * (11 * 2**20 // 5)}) + "\n" + line * 10  # a first line of 11 MB
                   + json.dumps({"text": 987654321}) + "\n")
    assert refusal(tmp_path, issue_run, [big]) == (
        f"--text_field text: row 12 of --input {big} holds int 987654321, not text")
    line = json.dumps({"messages": chat}) + "\n"
    rows = 12 * 2**20 // len(line)
    big.write_text(line * rows + json.dumps({"messages": [chat[0], {**chat[1], "content": 42}]}) + "\n")
    assert refusal(tmp_path, issue_run, [big], messages_field="messages") == (
        f"--messages_field messages: row {rows + 1} of {big} holds a number as a message's content where the rows "
        f"before (of --input {big}) hold text: give every row the same kind there, or leave such rows out")


def test_a_folder_laid_out_in_splits_trains_on_train_validates_on_validation_and_leaves_test(tmp_path, issue_run):
    """A copy of a Hub dataset repository (data/train-*, data/validation-*, data/test-*) was read as one pool: its
    test split trained on, its dataset card a document."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("# card\n")
    for split, count in (("train", 12), ("validation", 3), ("test", 5)):
        (repo / "data" / f"{split}-00000-of-00001.jsonl").write_text(text_lines(count, split))
    stats = prepared(tmp_path, issue_run, [repo], val_fraction=0.05)
    assert (stats["splits"]["train"]["documents"], stats["splits"]["validation"]["documents"]) == (12, 3)
    assert stats["inputs"] == [f"{repo} (train: 1 file, own validation: 1 file; not read: its test split)"]
    flat = tmp_path / "flat"  # split files at the top, and a file of no split (datasets tries several patterns per
    flat.mkdir()  # split, and resolving one that matched nothing failed the whole layout: a pool again)
    for split, count in (("train", 12), ("validation", 3), ("test", 5), ("notes", 2)):
        (flat / f"{split}.jsonl").write_text(text_lines(count, split))
    stats = prepared(tmp_path, issue_run, [flat], val_fraction=0.05)
    assert (stats["splits"]["train"]["documents"], stats["splits"]["validation"]["documents"]) == (12, 3)
    assert stats["inputs"] == [f"{flat} (train: 1 file, own validation: 1 file; not read: its test split, "
                               "notes.jsonl)"]
    text = tmp_path / "text"  # plain text split so: pooled, its test split trained on
    text.mkdir()
    for split, count in (("train", 12), ("validation", 3), ("test", 5)):
        (text / f"{split}.txt").write_text("\n".join(f"{split} line {k} of some words" for k in range(count)))
    stats = prepared(tmp_path, issue_run, [text], val_fraction=0.05, split_lines=True)
    assert (stats["splits"]["train"]["documents"], stats["splits"]["validation"]["documents"]) == (12, 3)
    assert stats["inputs"] == [f"{text} (train: 1 file, own validation: 1 file; not read: its test split)"]


def test_a_code_folder_with_a_test_folder_is_read_whole(tmp_path, issue_run):
    """datasets names a `test/` folder a split, and finds no files for some of its patterns: a folder of code is no
    dataset laid out in splits (the standard library's unittest, read by gpu_check.py, failed so)."""
    (tmp_path / "package" / "test").mkdir(parents=True)
    (tmp_path / "package" / "module.py").write_text("def f():\n    return 1\n" * 4)
    (tmp_path / "package" / "test" / "test_module.py").write_text("def test_f():\n    assert f() == 1\n" * 4)
    (tmp_path / "package" / "test" / "fixture.zip").write_bytes(b"PK")  # an archive of no data: passed over
    assert prepared(tmp_path, issue_run, [tmp_path / "package"])["splits"]["train"]["documents"] == 2


def test_the_same_file_given_twice_is_refused_not_trained_twice(tmp_path, issue_run):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "docs.jsonl").write_text(text_lines(10))
    for inputs in ([folder, folder / "docs.jsonl"], [folder / "docs.jsonl", folder / ".." / "in" / "docs.jsonl"]):
        assert refusal(tmp_path, issue_run, inputs) == (f"--input {inputs[0]} and --input {inputs[1]} both hold "
                                                        f"{inputs[1]}, which would be read twice; give each file once")
    (folder / "same.jsonl").symlink_to("docs.jsonl")
    assert refusal(tmp_path, issue_run, [folder]) == (f"--input {folder} holds {folder / 'docs.jsonl'} twice (through "
                                                      "a link); give each file once")


def test_csv_cells_are_read_as_the_text_they_hold(tmp_path, issue_run):
    """pandas typed a column of numbers as int (refused as "holds int 2, not text") and read "None", "null" and
    "N/A" as missing: raw text dropped those documents."""
    # with its index, as pandas writes by default: the header's first name is empty (pandas reads it "Unnamed: 0")
    pd.DataFrame({"text": ["None", "null", "N/A", "NaN", "", "42"]}).to_csv(tmp_path / "cells.csv")
    stats = prepared(tmp_path, issue_run, [tmp_path / "cells.csv"])
    assert (stats["splits"]["train"]["documents"], stats["empty_documents_skipped"]) == (5, 1)
    assert ("skipped 1 documents without text (empty files, or records whose --text_field text is missing, null or "
            "empty)") in summary(stats, "out")


def test_duplicates_do_not_take_validation_past_its_share(tmp_path, issue_run):
    """Every copy of a held-out record goes to validation (none is both trained on and evaluated): a record repeated
    in three of four rows held out 78% of them at --val_fraction 0.05."""
    rows = [{"text": "the same record " * 8} if i % 4 else {"text": f"record {i} " * 8} for i in range(40)]
    (tmp_path / "dup.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    stats = prepared(tmp_path, issue_run, [tmp_path / "dup.jsonl"], val_fraction=0.05)
    assert (stats["splits"]["train"]["documents"], stats["splits"]["validation"]["documents"]) == (38, 2)


def test_a_row_that_is_not_text_is_named(tmp_path, issue_run):
    rows = [{"text": f"record {i} " * 8} for i in range(12)]
    rows[10]["text"] = 12345
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert refusal(tmp_path, issue_run, [tmp_path / "mixed.jsonl"]) == \
        f"--text_field text: row 11 of --input {tmp_path / 'mixed.jsonl'} holds int 12345, not text"


def test_a_byte_order_mark_is_not_trained_on(tmp_path, issue_run):
    (tmp_path / "bom.txt").write_bytes("\ufeffthe text itself\n".encode() * 4)
    prepared(tmp_path, issue_run, [tmp_path / "bom.txt"])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    first = datasets.load_from_disk(str(tmp_path / "out"))["train"][0]["input_ids"]
    assert tokenizer.decode(first, skip_special_tokens=True).startswith("the")


def test_an_empty_file_is_named(tmp_path, issue_run):
    """The JSON reader's only word for it was "StopIteration"."""
    (tmp_path / "empty.jsonl").write_text("\n")
    empty = tmp_path / "empty.jsonl"
    assert refusal(tmp_path, issue_run, [empty]) == \
        f"--input {empty}: could not read it as json: {empty} is empty; leave it out"
    header = tmp_path / "header.csv"  # the CSV reader's: 'Instruction "train" corresponds to no data!'
    header.write_text("id,text\n")
    assert refusal(tmp_path, issue_run, [header]) == \
        f"--input {header}: could not read it as csv: {header} holds a header and no rows; leave it out"


def test_a_text_field_for_plain_text_files_is_refused_not_ignored(tmp_path, issue_run):
    """Plain-text files have no fields: --text_field content was ignored, and stats.json recorded it as used."""
    (tmp_path / "notes.txt").write_text("some notes " * 20)
    assert refusal(tmp_path, issue_run, [tmp_path / "notes.txt"], text_field="content") == (
        "--text_field content names a field of .jsonl/.json/.parquet/.csv files and datasets, and every --input is "
        "plain-text files, read whole; drop it")


def test_examples_longer_than_the_models_length_raise_no_warning(tmp_path, issue_run):
    """transformers warned "Token indices sequence length is longer than the specified maximum ... will result in
    indexing errors" for every input longer than the tokenizer's model_max_length: preparation cuts them itself."""
    short = AutoTokenizer.from_pretrained(issue_run / "tokenizer", model_max_length=16)
    short.save_pretrained(tmp_path / "short")
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"prompt": f"question {i} " * 8, "response": "answer " * 8})
                                                 + "\n" for i in range(10)))
    result = run_cli(["--input", "long.jsonl", "--tokenizer", "short", "--block_size", "128", "--prompt_field",
                      "prompt", "--response_field", "response", "--val_fraction", "0", "--output_dir", "out"], tmp_path)
    assert result.returncode == 0 and "Token indices sequence length" not in result.stderr, result.stderr


def pids_limited(name: str, limit: int) -> Path:
    """A pids cgroup of `limit` processes and threads, v1 or v2 (root only, as CI and the development machines run),
    for `echo $$ > cgroup.procs`; the test is skipped where none can be made."""
    root = Path("/sys/fs/cgroup")
    parent = root / "pids" if (root / "pids" / "pids.max").exists() or (root / "pids" / "cgroup.procs").exists() \
        else root if "pids" in (root / "cgroup.subtree_control").read_text(errors="ignore").split() else None
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("no writable pids cgroup here")
    group = parent / name
    group.mkdir(exist_ok=True)
    (group / "pids.max").write_text(str(limit))
    return group


def test_a_limit_on_threads_is_one_line_naming_num_proc_not_a_hang(tmp_path, issue_run):
    """Under a cgroup's pids.max (docker --pids-limit, `ulimit -u`), a thread of datasets' pool manager was refused
    ("can't start new thread" in another thread) and prepare_data.py waited for that manager for ever."""
    group = pids_limited(f"prepare-test-{os.getpid()}", 14)
    inputs = " ".join(stdlib_corpus_paths(("http", "json", "asyncio")))
    try:
        result = subprocess.run(
            ["sh", "-c", f"echo $$ > {group}/cgroup.procs && exec {sys.executable} {REPO / 'prepare_data.py'} "
                         f"--input {inputs} --tokenizer {issue_run / 'tokenizer'} --block_size 32 --num_proc 4 "
                         f"--output_dir {tmp_path / 'out'}"],
            cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=240)
    finally:
        for _ in range(50):  # what a hang left in the group (the workers of a timed-out run) goes first
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "prepare_data.py: the system refused a new thread: the limit on processes and threads is reached (a cgroup's "
        "pids.max, docker's --pids-limit, ulimit -u); lower --num_proc, or raise the limit; nothing was written (the "
        "output appears whole, or not at all)")
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_a_full_disk_is_one_line_naming_it_not_a_refusal_of_the_input(tmp_path, issue_run):
    """A full disk while reading was refused as bad input, exit 2, blaming an empty file of the input (`could not
    read it as text: .../email/mime/__init__.py is empty; leave it out`); while tokenizing, a 62-line traceback."""
    from tests.test_reliability import SmallStorage

    (tmp_path / "docs.jsonl").write_text(text_lines(4000))  # 0.5 MB: its Arrow copy fills the 256 KB disk
    disk = SmallStorage(tmp_path / "small", 256)
    try:
        result = run_cli(["--input", str(tmp_path / "docs.jsonl"), "--tokenizer", str(issue_run / "tokenizer"),
                          "--block_size", "32", "--output_dir", str(disk.folder / "out")], cwd=tmp_path)
        left = list(disk.folder.iterdir())
    finally:
        disk.unmount()
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "prepare_data.py: the storage refused a write: No space left on device (ENOSPC) writing the work folder "
        f"beside --output_dir {disk.folder / 'out'}: make room, then run it again; nothing was written (the output "
        "appears whole, or not at all)"), result.stderr
    assert left == []


RUNS_OUT_OF_MEMORY = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from app.stopping import stopped_in_one_line

with stopped_in_one_line("convert_to_hf.py", "nothing was written", lambda: None, fewer_workers="--num_proc"):
    if sys.argv[2] == "thread":  # a thread of the work, as a pool's are
        threading.Thread(target=lambda: bytearray(2**62)).start()
        threading.Event().wait(30)
    raise RuntimeError("unable to mmap 106518744 bytes from file <model.safetensors>: Cannot allocate memory (12)")
"""


@pytest.mark.parametrize("where", ["main", "thread"])
def test_running_out_of_memory_is_one_line_and_exit_1(where):
    """convert_to_hf.py verifying a model too large for the machine's memory: a 33-line traceback."""
    result = subprocess.run([sys.executable, "-c", RUNS_OUT_OF_MEMORY, str(REPO), where], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    cause = "unable to mmap 106518744 bytes from file <model.safetensors>: Cannot allocate memory (12)" \
        if where == "main" else "MemoryError"
    assert result.stderr.strip() == (f"convert_to_hf.py: out of memory ({cause}); lower --num_proc, or free memory, or "
                                     "run it where there is more; nothing was written"), result.stderr
