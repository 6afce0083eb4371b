"""Supervised and source/target examples after tokenization: fitting them to the length limits, counting what was
kept, truncated and dropped (and why), and refusing data of which nothing would be trained.

Every tokenized example is one row of `EXAMPLE_FEATURES`: `input_ids` and `labels` (-100 where nothing is
trained), where its first response starts and ends (what generation samples prompt with and score against, from
the chat's structure: with --train_on_prompt the labels no longer show it), `truncated`, and `dropped`, the reason
it was left out ("" when kept; a dropped example keeps no tokens).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, Features, List, Value

from app.choices import IGNORE_INDEX
from app.prepare.args import UsageError, useful_processes
from app.prepare.pack import empty_rows
from app.prepare.workspace import arrow_file

EXAMPLE_FEATURES = Features(
    {
        "input_ids": List(Value("int32")),
        "labels": List(Value("int32")),
        "response_start": Value("int32"),
        "response_end": Value("int32"),
        "truncated": Value("bool"),
        "target_truncated": Value("bool"),
        "dropped": Value("string"),
    }
)
ROW_COLUMNS = ("input_ids", "labels", "response_start", "response_end")
RESPONSE_SPANS = "response_spans"
"""The column of supervised rows that holds (start, end) of every example's first response, flattened."""

TOO_LONG = "too_long"
"""Longer than --block_size with --too_long drop."""
PROMPT_FILLS_BLOCK = "prompt_fills_block"
"""Truncated to --block_size, nothing trained or no response token was left."""


@dataclass(frozen=True)
class Example:
    """One tokenized example, fitted to the limits: what `EXAMPLE_FEATURES` stores."""

    input_ids: list[int]
    labels: list[int]
    response_start: int = 0
    response_end: int = 0
    truncated: bool = False
    target_truncated: bool = False
    """Source/target pairs: the target was cut (the references ROUGE scores against are then cut too)."""
    dropped: str = ""


def dropped(reason: str) -> Example:
    return Example([], [], dropped=reason)


def causal_advice(block_size: int) -> dict[str, str]:
    """What to change when `fit_to_block` left no example."""
    return {
        TOO_LONG: length_advice("--block_size", block_size),
        PROMPT_FILLS_BLOCK: f"--block_size {block_size} is too small for any example: truncated, none keeps a "
        "response token; raise it",
    }


def fit_to_block(example: Example, block_size: int, too_long: str) -> Example:
    """A causal example cut to `block_size` tokens (its end is lost, EOS included: the model is not taught to stop
    early), or dropped; an example whose cut leaves nothing to train, or no token of its first response, is dropped
    too (under --train_on_prompt its prompt alone was kept: the prompt trained as if it were the answer). The cut
    ends at the last trained token: a chat cut inside a later user message kept that message's start, untrained."""
    if example.dropped or len(example.input_ids) <= block_size:
        return example
    if too_long == "drop":
        return dropped(TOO_LONG)
    labels = example.labels[:block_size]
    no_response = example.response_start < example.response_end and example.response_start >= block_size
    if no_response or all(label == IGNORE_INDEX for label in labels):
        return dropped(PROMPT_FILLS_BLOCK)
    end = max(k for k, label in enumerate(labels) if label != IGNORE_INDEX) + 1
    return Example(example.input_ids[:end], labels[:end], min(example.response_start, end),
                   min(example.response_end, end), truncated=True)


def encode_examples(
    records: Dataset, encode: Callable[[dict], list[Example]], num_proc: int, desc: str
) -> Dataset:
    """Rows of `EXAMPLE_FEATURES` from the records, a batch at a time (`encode` turns a batch of records into its
    examples); an empty split keeps the columns."""
    if not len(records):
        return empty_rows(EXAMPLE_FEATURES)

    def columns(batch: dict) -> dict[str, list]:
        examples = encode(batch)
        return {name: [getattr(example, name) for example in examples] for name in EXAMPLE_FEATURES}

    return records.map(
        columns,
        batched=True,
        num_proc=useful_processes(len(records), num_proc),
        remove_columns=records.column_names,
        features=EXAMPLE_FEATURES,
        desc=desc,
        **arrow_file("examples"),
    )


@dataclass(frozen=True)
class ExampleCounts:
    """What happened to the examples of one split: the numbers stats.json reports."""

    examples: int
    kept: int
    truncated: int
    dropped: dict[str, int]
    tokens: int
    trained_tokens: int
    rows: int
    padding_tokens: int
    examples_per_row: float
    padding_fraction: float
    loss_mask: Optional[dict] = None
    """Chats only: tokens and trained tokens per role (app/prepare/mask_audit.py)."""
    target_truncated: Optional[int] = None
    """Source/target pairs only: of the truncated, those whose target was cut."""


def kept_examples(encoded: Dataset) -> Dataset:
    """The examples that were not dropped: `input_ids`, `labels` (unpadded) and where their response is."""
    kept = encoded.filter(lambda reasons: [not reason for reason in reasons], batched=True, input_columns="dropped",
                          **arrow_file("kept"))
    return kept.select_columns(list(ROW_COLUMNS))


def one_example_per_row(examples: Dataset) -> Dataset:
    """Unpacked supervised rows: each example with its response's (start, end) as `response_spans`, int32 as packed
    rows hold them (inferred, they were int64)."""

    def spans(starts: list[int], ends: list[int]) -> dict:
        return {RESPONSE_SPANS: [[start, end] for start, end in zip(starts, ends)]}

    kept = [name for name in examples.column_names if name not in ("response_start", "response_end")]
    features = Features({name: examples.features[name] for name in kept} | {RESPONSE_SPANS: List(Value("int32"))})
    return examples.map(spans, batched=True, input_columns=["response_start", "response_end"],
                        remove_columns=["response_start", "response_end"], features=features,
                        desc="Recording responses", **arrow_file("rows"))


def count_examples(encoded: Dataset, rows: Dataset) -> ExampleCounts:
    """Counts of one split from its encoded examples and the rows written from them (packed or not)."""
    table = _table(encoded)
    reasons = _drop_reasons(table)
    kept = reasons.pop("", 0)
    tokens = _total(pc.list_value_length(table.column("input_ids")))
    row_tokens = _total(pc.list_value_length(_table(rows).column("input_ids")))
    padding = row_tokens - tokens
    return ExampleCounts(
        examples=len(encoded),
        kept=kept,
        truncated=_total(table.column("truncated")),
        dropped=dict(sorted(reasons.items())),
        tokens=tokens,
        trained_tokens=_total(pc.not_equal(pc.list_flatten(table.column("labels")), IGNORE_INDEX)),
        rows=len(rows),
        padding_tokens=padding,
        examples_per_row=round(kept / len(rows), 3) if len(rows) else 0.0,
        padding_fraction=round(padding / row_tokens, 4) if row_tokens else 0.0,
    )


def drop_reasons(examples: Dataset) -> Counter:
    """How many of the encoded `examples` were dropped for each reason; the kept ones count under ""."""
    return _drop_reasons(_table(examples))


def _drop_reasons(table: pa.Table) -> Counter:
    return Counter({item["values"]: item["counts"] for item in pc.value_counts(table.column("dropped")).to_pylist()})


def _table(dataset: Dataset) -> pa.Table:
    """The dataset's rows as Arrow (an indices mapping, as `filter` leaves, applied)."""
    return dataset.with_format("arrow")[:]


def _total(values: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.sum(values).as_py() or 0)


def check_kept(encoded: dict[str, Dataset], advice: dict[str, str]) -> None:
    """Refuse a split of which no example is left (it would train or evaluate on nothing), in one line that says
    what to change: `advice` maps each drop reason to that line (naming the option)."""
    for split, examples in encoded.items():
        reasons = drop_reasons(examples)
        if len(examples) and not reasons[""]:
            reason, count = reasons.most_common(1)[0]
            raise UsageError(
                f"{advice[reason]} (no {split} example is left: {count} of {len(examples)} dropped as {reason})"
            )


def length_advice(option: str, value: int) -> str:
    """What to say when every example is longer than an option allows."""
    return f"{option} {value} is too small for any example; raise it or use --too_long truncate"


def examples_to_rows(
    encoded: dict[str, Dataset], advice: dict[str, str], arrange: Callable[[Dataset, str], Dataset]
) -> tuple[DatasetDict, dict[str, ExampleCounts]]:
    """The rows of every split (`arrange` packs the kept examples, or keeps them one per row) and their counts;
    refused when a split has examples but keeps none."""
    check_kept(encoded, advice)
    rows = DatasetDict({name: arrange(kept_examples(split), name) for name, split in encoded.items()})
    return rows, {name: count_examples(split, rows[name]) for name, split in encoded.items()}
