"""Throughput of the whole prepare pipeline (read, split, tokenize, pack, save) against the tokenizer's own batch
encoding of the same documents. Run: `python benchmarks/bench_prepare.py [--num_proc 2] [--copies 4]`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets
from transformers import AutoTokenizer

from app.prepare import PrepareArgs, prepare, stdlib_corpus_paths
from app.prepare.corpus import quiet_progress


def write_corpus(folder: Path, copies: int) -> tuple[Path, list[str]]:
    """The stdlib corpus, `copies` times over, as one .jsonl file (a document per source file)."""
    files = [f for folder in stdlib_corpus_paths() for f in sorted(Path(folder).rglob("*.py"))]
    texts = [
        text for text in (f.read_text(encoding="utf-8") for f in files) if text
    ] * copies  # as prepare drops empties
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num_proc", type=int, default=2)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=4000)
    options = parser.parse_args()
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
