"""Hold out validation by whole documents (or examples), so that none is seen in both splits: identical records
(duplicates in the input) stay together on one side. A corpus of too few documents to hold out whole ones (one book,
a handful of files) gives validation the end of each document instead."""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass

import datasets
import numpy as np
from datasets import Dataset, DatasetDict

from app.prepare.args import UsageError, useful_processes
from app.prepare.corpus import Documents, quiet_progress
from app.prepare.workspace import arrow_file


@dataclass(frozen=True)
class Splits:
    """The train and validation records; how many empty documents were left out (they would add only BOS/EOS); and
    how the validation records were held out of the pool: `"documents"`, `"document_ends"`, `"examples"`, or
    `"none"` (--val_fraction 0, or every input brought its own validation split)."""

    records: DatasetDict
    empty_documents: int
    held_out: str


def split_by_document(
    documents: Documents, val_fraction: float, seed: int, num_proc: int, unit: str = "document"
) -> Splits:
    """Hold out validation from the records without a split of their own.

    Supervised and source/target examples (`unit="example"`) are never empty here: an empty one is refused when read.
    """
    drop = _drop_empty if unit == "document" else lambda part, _: (part, 0)
    pool, empty = drop(documents.pool, num_proc)
    own_train, empty_train = drop(documents.own_train, num_proc)
    own_validation, empty_validation = drop(documents.own_validation, num_proc)
    if not any(len(part or []) for part in (pool, own_train)):
        raise UsageError(f"--input {' '.join(documents.description)}: no non-empty {unit}s to train on")
    train, validation = [own_train], [own_validation]
    held_out = f"{unit}s" if pool is not None and val_fraction > 0 else "none"
    if pool is not None and val_fraction > 0:
        content = _content_keys(pool)
        if unit == "document" and too_few_to_hold_out_whole(len(set(content)), val_fraction):
            pool_train, pool_validation = _hold_out_ends(pool, val_fraction, num_proc)
            held_out = "document_ends"
        else:
            pool_train, pool_validation = _hold_out(pool, content, val_fraction, seed, unit)
        train.append(pool_train)
        validation.append(pool_validation)
    elif pool is not None:
        train.append(pool)
        validation.append(pool.select([]))
    splits = DatasetDict(train=_concatenate(train), validation=_concatenate(validation))
    return Splits(splits, empty + empty_train + empty_validation, held_out)


def _hold_out(pool: Dataset, content: list[bytes], val_fraction: float, seed: int, unit: str
              ) -> tuple[Dataset, Dataset]:
    """Hold out `ceil(val_fraction * records)` records of a shuffle with `seed` (datasets' train_test_split), and
    with them every record identical to one of them (`content` holds each record's key): a duplicated example
    (common in scraped data) is never both trained on and evaluated. A record whose copies would take validation
    past that count is passed over for the next one (one example repeated in three of four rows held out 78% of
    them at --val_fraction 0.05), unless no other fits. Without duplicates the split is train_test_split's, record
    for record."""
    distinct = len(set(content))
    if distinct < 2:
        more = "documents (or --split_lines for .txt)" if unit == "document" else "examples"
        raise UsageError(
            f"--val_fraction {val_fraction}: the input has {distinct} distinct {unit} and validation is held out "
            f"by {unit}; give more {more}, or --val_fraction 0"
        )
    order = np.random.default_rng(seed).permutation(len(pool)).tolist()
    wanted, copies = math.ceil(val_fraction * len(pool)), Counter(content)
    shuffled = list(dict.fromkeys(content[i] for i in order))  # each distinct record once, in the shuffle's order
    held: dict[bytes, None] = {}
    taken = 0
    for key in shuffled:
        if taken + copies[key] <= wanted:
            held[key] = None
            taken += copies[key]
        if taken == wanted:
            break
    if not held:  # every record has more copies than validation's share: the rarest
        held[min(shuffled, key=copies.__getitem__)] = None
    if len(held) == distinct:  # something must train
        held.popitem()
    return (pool.select([i for i in order if content[i] not in held]),
            pool.select([i for i in order if content[i] in held]))


def too_few_to_hold_out_whole(documents: int, val_fraction: float) -> bool:
    """Whether whole documents would hold out more than twice `val_fraction` of them (one of three books, at 0.05),
    or there is only one."""
    return documents < 2 or math.ceil(val_fraction * documents) / documents > 2 * val_fraction


def _hold_out_ends(pool: Dataset, val_fraction: float, num_proc: int) -> tuple[Dataset, Dataset]:
    """Too few documents to hold out whole ones: validation is the last `val_fraction` of each document's text
    instead, as nanoGPT splits one text. The two parts share no text, and the stream of every document is in both."""
    def cut(batch: dict, keep_head: bool) -> dict:
        points = [end_cut(text, val_fraction) for text in batch["text"]]
        return {"text": [text[:at] if keep_head else text[at:] for text, at in zip(batch["text"], points)]}

    with quiet_progress():
        return tuple(pool.map(cut, batched=True, fn_kwargs={"keep_head": keep_head},
                              num_proc=useful_processes(len(pool), num_proc), **arrow_file("ends"))
                     for keep_head in (True, False))


def end_cut(text: str, val_fraction: float) -> int:
    """Where the last `val_fraction` of `text` begins: just after the line break (else the space) nearest to that
    point, within a quarter of the held-out part either side, so that a line is not cut in two; at the point itself
    when there is none."""
    point = max(len(text) - max(1, round(val_fraction * len(text))), 1)
    reach = (len(text) - point) // 4
    low, high = max(point - reach, 1), min(point + reach, len(text) - 1)
    for separator in ("\n", " "):
        breaks = [at + 1 for at in (text.rfind(separator, low - 1, point), text.find(separator, point - 1, high))
                  if at >= 0]
        if breaks:
            return min(breaks, key=lambda at: abs(at - point))
    return point


def _content_keys(pool: Dataset) -> list[bytes]:
    """A hash of each record's content (every column): identical records, identical keys."""
    keys = []
    for batch in pool.iter(batch_size=1000):
        for values in zip(*(batch[column] for column in pool.column_names)):
            content = json.dumps(values, ensure_ascii=False, sort_keys=True).encode()
            keys.append(hashlib.blake2b(content, digest_size=16).digest())
    return keys


def _drop_empty(documents: Dataset | None, num_proc: int) -> tuple[Dataset | None, int]:
    if documents is None:
        return None, 0
    with quiet_progress():
        kept = documents.filter(
            lambda batch: [bool(text) for text in batch["text"]],
            batched=True,
            num_proc=useful_processes(len(documents), num_proc),
            **arrow_file("documents"),
        )
    return kept, len(documents) - len(kept)


def _concatenate(parts: list[Dataset | None]) -> Dataset:
    return datasets.concatenate_datasets([part for part in parts if part is not None])
