"""Tokenize documents and cut their concatenation into blocks of exactly `block_size` tokens.

Packing is exact over the whole split, also with several processes: block `i` is tokens
`[i * block_size, (i + 1) * block_size)` of the split's token stream (every document followed by EOS), so the
blocks, concatenated, are the stream without its last `stream % block_size` tokens, which is all that is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from datasets import Dataset, Features, List, Value
from transformers import PreTrainedTokenizerBase

from app.choices import IGNORE_INDEX
from app.prepare.args import useful_processes
from app.prepare.tokenizer import encode_texts
from app.prepare.workspace import arrow_file


@dataclass(frozen=True)
class SplitCounts:
    """What packing did to one split: the numbers stats.json reports."""

    documents: int
    tokens: int
    blocks: int
    dropped_tokens: int


def tokenize(
    documents: Dataset, tokenizer: PreTrainedTokenizerBase, suffix: list[int], num_proc: int, desc: str
) -> Dataset:
    """Each document's ids (with the tokenizer's own BOS, then EOS) and their count, in document order."""

    def encode(batch: dict) -> dict:
        ids = encode_texts(tokenizer, batch["text"], suffix, documents=True)
        return {"input_ids": ids, "length": [len(document) for document in ids]}

    return documents.map(
        encode,
        batched=True,
        num_proc=useful_processes(len(documents), num_proc),
        remove_columns=documents.column_names,
        features=Features({"input_ids": List(Value("int32")), "length": Value("int64")}),
        desc=desc,
        **arrow_file("tokens"),
    )


def _lengths(tokenized: Dataset) -> np.ndarray:
    if not len(tokenized):
        return np.zeros(0, dtype=np.int64)
    return tokenized.select_columns(["length"]).with_format("numpy")[:]["length"]


def count(tokenized: Dataset, block_size: int) -> SplitCounts:
    """Documents, tokens, full blocks and the dropped tail of one tokenized split, before any block is cut."""
    total = int(_lengths(tokenized).sum())
    blocks = total // block_size
    return SplitCounts(len(tokenized), total, blocks, total - blocks * block_size)


def pack(tokenized: Dataset, block_size: int, num_proc: int, desc: str, documents_apart: bool = False) -> Dataset:
    """Blocks of the split's token stream; each worker cuts its own range of blocks from the documents it spans.
    `documents_apart` (--document_masking): each block also gets the positions of its documents' pieces, restarting
    at each, and labels without their first tokens, in the columns of packed examples (app/data/formats.py), which
    training keeps apart as it keeps packed examples apart."""
    lengths = _lengths(tokenized)
    ends = np.cumsum(lengths)
    blocks = int(lengths.sum()) // block_size
    row = List(Value("int32"), length=block_size)
    features = Features({"input_ids": row} | ({"labels": row, "position_ids": row} if documents_apart else {}))
    if not blocks:
        return empty_rows(features)

    def cut(batch: dict) -> dict:
        start, stop = batch["block"][0] * block_size, (batch["block"][-1] + 1) * block_size
        stream, stream_start = _stream_between(tokenized, ends, lengths, start, stop)
        ids = stream[start - stream_start : stop - stream_start].reshape(-1, block_size)
        if not documents_apart:
            return {"input_ids": ids}
        positions = document_positions(ends, start, stop, block_size).reshape(-1, block_size)
        return {"input_ids": ids, "labels": np.where(positions == 0, IGNORE_INDEX, ids), "position_ids": positions}

    return Dataset.from_dict({"block": np.arange(blocks, dtype=np.int64)}).map(
        cut,
        batched=True,
        num_proc=useful_processes(blocks, num_proc),
        remove_columns=["block"],
        features=features,
        desc=desc,
        **arrow_file("blocks"),
    )


def document_positions(ends: np.ndarray, start: int, stop: int, block_size: int) -> np.ndarray:
    """The position of each token of stream range [start, stop) within its piece of a document: the tokens since
    the document's start or the block's, whichever is later (a document that goes on into the next block starts
    again at 0 there, as a packed example cut at a block's end would)."""
    tokens = np.arange(start, stop, dtype=np.int64)
    document_start = np.concatenate([[0], ends])[np.searchsorted(ends, tokens, side="right")]
    return (tokens - np.maximum(document_start, tokens - tokens % block_size)).astype(np.int32)


def empty_rows(features: Features) -> Dataset:
    """An empty split with its columns (`Dataset.map` over no rows returns none), so that it saves and loads."""
    return Dataset.from_dict({name: [] for name in features}, features=features)


def _stream_between(
    tokenized: Dataset, ends: np.ndarray, lengths: np.ndarray, start: int, stop: int
) -> tuple[np.ndarray, int]:
    """The concatenated ids of the documents covering stream positions [start, stop), and where they begin."""
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(ends, stop - 1, side="right"))
    ids = tokenized.with_format("arrow")[first : last + 1]["input_ids"]
    stream = np.concatenate([chunk.flatten().to_numpy() for chunk in ids.chunks])
    return stream, int(ends[first] - lengths[first])
