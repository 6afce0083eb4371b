"""Pack whole supervised examples into rows of exactly `block_size` tokens, with `position_ids` that restart at 0 for
every example, so that attention (SDPA or FlashAttention with position_ids) never crosses from one example to the next.

The algorithm is best-fit decreasing, deterministic for a seed: the examples are shuffled with the seed, sorted by
length (longest first, ties in shuffled order), and each goes into the open row with the least room that still
holds it, or starts a new row; the rows are then shuffled with the seed. An example is never split across rows.
The unused end of a row is padding: the pad id (EOS when the tokenizer has none), label -100, and position_ids
that restart at 0, so that it is an example of its own that nothing attends to. `response_spans` holds each
example's first response as (start, end) in the row, flattened: the prompts and references of generation samples.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, Features, List, Value

from app.choices import IGNORE_INDEX
from app.prepare.args import useful_processes
from app.prepare.examples import RESPONSE_SPANS
from app.prepare.pack import empty_rows
from app.prepare.workspace import arrow_file


def best_fit_decreasing(lengths: np.ndarray, capacity: int, seed: int) -> list[list[int]]:
    """Rows as lists of example indices (each row's lengths sum to at most `capacity`), in seeded random order."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row) of the rows that still have room, sorted
    for index in order.tolist():
        need = int(lengths[index])
        at = bisect_left(room, (need, -1))
        if at == len(room):
            rows.append([index])
            free, row = capacity - need, len(rows) - 1
        else:
            free, row = room.pop(at)
            rows[row].append(index)
            free -= need
        if free:
            insort(room, (free, row))
    return [rows[i] for i in rng.permutation(len(rows)).tolist()]


def packed_features(block_size: int) -> Features:
    row = List(Value("int32"), length=block_size)
    return Features({"input_ids": row, "labels": row, "position_ids": row, RESPONSE_SPANS: List(Value("int32"))})


def pack_examples(examples: Dataset, block_size: int, pad_id: int, seed: int, num_proc: int, desc: str) -> Dataset:
    """Rows of `input_ids`, `labels` and `position_ids`, each `block_size` long, from unpadded examples that fit,
    with their `response_spans`."""
    features = packed_features(block_size)
    if not len(examples):
        return empty_rows(features)
    lengths = pc.list_value_length(examples.with_format("arrow")[:].column("input_ids")).to_numpy()
    rows = best_fit_decreasing(lengths, block_size, seed)

    def assemble(batch: dict) -> dict:
        fetched = examples[[index for row in batch["examples"] for index in row]]
        members = iter(zip(fetched["input_ids"], fetched["labels"], fetched["response_start"], fetched["response_end"],
                           strict=True))
        return pack_rows([[next(members) for _ in row] for row in batch["examples"]], block_size, pad_id)

    return Dataset.from_dict({"examples": rows}).map(
        assemble,
        batched=True,
        num_proc=useful_processes(len(rows), num_proc),
        remove_columns=["examples"],
        features=features,
        desc=desc,
        **arrow_file("packed"),
    )


def pack_rows(rows: list[list[tuple[list[int], list[int], int, int]]], block_size: int, pad_id: int) -> dict:
    """Rows from their examples' (input_ids, labels, response start, response end), each example followed by the
    next, then the padding run."""
    input_ids = np.full((len(rows), block_size), pad_id, dtype=np.int32)
    labels = np.full((len(rows), block_size), IGNORE_INDEX, dtype=np.int32)
    position_ids = np.empty((len(rows), block_size), dtype=np.int32)
    spans = []
    for row, members in enumerate(rows):
        start, row_spans = 0, []
        for ids, example_labels, response_start, response_end in members:
            end = start + len(ids)
            input_ids[row, start:end], labels[row, start:end] = ids, example_labels
            position_ids[row, start:end] = np.arange(len(ids))
            row_spans += [start + response_start, start + response_end]
            start = end
        position_ids[row, start:] = np.arange(block_size - start)
        spans.append(row_spans)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, RESPONSE_SPANS: spans}
