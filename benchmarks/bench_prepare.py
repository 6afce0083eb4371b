"""Throughput of the whole prepare pipeline (read, split, tokenize, pack, save) against the tokenizer's own batch
encoding of the same documents. Run: `python benchmarks/bench_prepare.py [--num_proc 2] [--copies 4]`.

`--memory`: the peak RSS of `prepare_data.py --num_proc 1` on one long document and on many documents of 30-60 KB,
against the same run with the tokenizer given each batch or document whole (app/prepare/windows.py unbounded)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets
from transformers import AutoTokenizer

from app.prepare import PrepareArgs, prepare, stdlib_corpus_paths
from app.prepare.corpus import quiet_progress
from app.prepare.tokenizer import train_tokenizer


def write_corpus(folder: Path, copies: int) -> tuple[Path, list[str]]:
    """The stdlib corpus, `copies` times over, as one .jsonl file (a document per source file)."""
    files = [f for folder in stdlib_corpus_paths() for f in sorted(Path(folder).rglob("*.py"))]
    texts = [
        text for text in (f.read_text(encoding="utf-8") for f in files) if text
    ] * copies  # as prepare drops empties
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path, texts


REPO = Path(__file__).resolve().parents[1]
UNBOUNDED = "import app.prepare.windows as w; w.WINDOW_CHARS = 1 << 62"
"""The baseline: every batch of documents, and every document, handed to the tokenizer whole."""


def stdlib_text() -> str:
    files = [f for folder in stdlib_corpus_paths() for f in sorted(Path(folder).rglob("*.py"))]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def write_memory_corpora(folder: Path, megabytes: int) -> dict[str, Path]:
    """One document of `megabytes` MB (a .txt, the stdlib's code over and over), and five times as many megabytes of
    documents of 30-60 KB cut from it (JSON Lines)."""
    text = stdlib_text()
    size = megabytes * 1_000_000
    single = folder / "one-document.txt"
    single.write_text((text * (size // len(text) + 1))[:size])
    many, written, index = folder / "documents.jsonl", 0, 0
    with many.open("w") as out:
        while written < 5 * size:
            length = 30_000 + index * 7919 % 30_000
            start = index * 104_729 % (len(text) - length)
            out.write(json.dumps({"text": text[start:start + length]}) + "\n")
            written, index = written + length, index + 1
    return {f"one document of {megabytes} MB": single, f"{5 * megabytes} MB of 30-60 KB documents": many}


def peak_rss(command: list[str]) -> tuple[float, float]:
    """The command's largest process's peak RSS in GB (sampled every 0.1 s) and its seconds."""
    started, peak = time.perf_counter(), 0
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watched = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            peak = max([peak, watched.memory_info().rss] + [c.memory_info().rss for c in watched.children(True)])
        except psutil.Error:
            pass
        time.sleep(0.1)
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed: {process.stderr.read().strip().splitlines()[-1]}")
    return peak / 1e9, time.perf_counter() - started


def measure_memory(megabytes: int) -> None:
    with tempfile.TemporaryDirectory() as work, quiet_progress():
        work = Path(work)
        corpora = write_memory_corpora(work, megabytes)
        train_tokenizer([stdlib_text()], 4000, seed=0).save_pretrained(work / "tokenizer")
        for name, corpus in corpora.items():
            options = ["--input", str(corpus), "--tokenizer", str(work / "tokenizer"), "--block_size",
                       "1024", "--num_proc", "1", "--val_fraction", "0"]
            runs = {}
            for label, prefix in (("bounded", ""), ("whole", UNBOUNDED + "; ")):
                code = prefix + "from app.prepare.cli import main; main()"
                runs[label] = peak_rss([sys.executable, "-c", code, *options, "--output_dir", str(work / label)])
            blocks = [datasets.load_from_disk(str(work / label / "train")).with_format("numpy")[:]["input_ids"]
                      for label in runs]
            same = "identical blocks" if (blocks[0] == blocks[1]).all() else "BLOCKS DIFFER"
            (bounded, bounded_s), (whole, whole_s) = runs["bounded"], runs["whole"]
            print(f"{name}: peak RSS {bounded:.2f} GB in {bounded_s:.1f} s against {whole:.2f} GB in {whole_s:.1f} s "
                  f"given whole ({bounded / whole:.2f}), {same}")
            for label in runs:
                shutil.rmtree(work / label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num_proc", type=int, default=2)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=4000)
    parser.add_argument("--memory", type=int, metavar="MB", help="measure memory on a document of MB megabytes")
    options = parser.parse_args()
    if options.memory:
        return measure_memory(options.memory)
    with tempfile.TemporaryDirectory() as work, quiet_progress():
        work = Path(work)
        datasets.config.HF_DATASETS_CACHE = str(work / "cache")  # cold: no map result may come from a cache
        corpus, texts = write_corpus(work, options.copies)
        common = {"input": [str(corpus)], "block_size": 2048, "val_fraction": 0.05}
        prepare(PrepareArgs(**common, vocab_size=options.vocab_size, output_dir=str(work / "trained")))
        tokenizer_dir = str(work / "trained" / "tokenizer")

        started = time.perf_counter()
        stats = prepare(
            PrepareArgs(**common, tokenizer=tokenizer_dir, num_proc=options.num_proc, output_dir=str(work / "out"))
        )
        pipeline_seconds = time.perf_counter() - started
        pipeline_tokens = sum(split["tokens"] for split in stats["splits"].values())

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        started = time.perf_counter()
        encoded = tokenizer(texts, split_special_tokens=True, verbose=False)["input_ids"]
        encode_seconds = time.perf_counter() - started
        encode_tokens = sum(len(ids) + 1 for ids in encoded)  # + EOS, as in the pipeline

    megabytes = sum(len(text.encode()) for text in texts) / 1e6
    print(f"corpus: {len(texts)} documents, {megabytes:.1f} MB, tokenizer vocab {len(tokenizer)}, block 2048")
    print(
        f"prepare pipeline (--num_proc {options.num_proc}): {pipeline_tokens / pipeline_seconds:,.0f} tokens/s "
        f"({pipeline_tokens:,} tokens in {pipeline_seconds:.2f} s, including read, split, pack and save)"
    )
    print(
        f"tokenizer batch encode (1 call)  : {encode_tokens / encode_seconds:,.0f} tokens/s "
        f"({encode_tokens:,} tokens in {encode_seconds:.2f} s)"
    )
    print(
        f"ratio pipeline / batch encode    : {(pipeline_tokens / pipeline_seconds) / (encode_tokens / encode_seconds):.2f}"
    )


if __name__ == "__main__":
    main()
