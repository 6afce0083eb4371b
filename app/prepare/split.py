"""Hold out validation by whole documents (or examples), so that none is seen in both splits: identical records
(duplicates in the input) stay together on one side."""

from __future__ import annotations

import hashlib
import json
import math

import datasets
import numpy as np
from datasets import Dataset, DatasetDict

from app.prepare.args import UsageError, useful_processes
from app.prepare.corpus import Documents, quiet_progress
from app.prepare.workspace import arrow_file


def split_by_document(
    documents: Documents, val_fraction: float, seed: int, num_proc: int, unit: str = "document"
) -> tuple[DatasetDict, int]:
    """Train/validation records, and how many empty documents were left out (they would add only BOS/EOS).

    Supervised and source/target examples (`unit="example"`) are never empty here: an empty one is refused when read.
    """
    drop = _drop_empty if unit == "document" else lambda part, _: (part, 0)
    pool, empty = drop(documents.pool, num_proc)
    own_train, empty_train = drop(documents.own_train, num_proc)
    own_validation, empty_validation = drop(documents.own_validation, num_proc)
    if not any(len(part or []) for part in (pool, own_train)):
        raise UsageError(f"--input {' '.join(documents.description)}: no non-empty {unit}s to train on")
    train, validation = [own_train], [own_validation]
    if pool is not None:
        pool_train, pool_validation = _hold_out(pool, val_fraction, seed, unit)
        train.append(pool_train)
        validation.append(pool_validation)
    splits = DatasetDict(train=_concatenate(train), validation=_concatenate(validation))
    return splits, empty + empty_train + empty_validation


def _hold_out(pool: Dataset, val_fraction: float, seed: int, unit: str) -> tuple[Dataset, Dataset]:
    """Hold out `ceil(val_fraction * records)` records of a shuffle with `seed` (datasets' train_test_split), and
    with them every record identical to one of them: a duplicated example (common in scraped data) is never both
    trained on and evaluated. Without duplicates the split is train_test_split's, record for record."""
    if val_fraction == 0:
        return pool, pool.select([])
    content = _content_keys(pool)
    distinct = len(set(content))
    if distinct < 2:
        more = "documents (or --split_lines for .txt)" if unit == "document" else "examples"
        raise UsageError(
            f"--val_fraction {val_fraction}: the input has {distinct} distinct {unit} and validation is held out "
            f"by {unit}; give more {more}, or --val_fraction 0"
        )
    order = np.random.default_rng(seed).permutation(len(pool)).tolist()
    wanted = math.ceil(val_fraction * len(pool))
    held = {content[i] for i in order[:wanted]}
    if len(held) == distinct:  # something must train
        held.discard(content[order[wanted - 1]])
    return (pool.select([i for i in order if content[i] not in held]),
            pool.select([i for i in order if content[i] in held]))


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
