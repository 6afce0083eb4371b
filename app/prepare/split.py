"""Hold out validation by whole documents (or examples), so that none is seen in both splits: identical records
(duplicates in the input) stay together on one side."""

from __future__ import annotations

import hashlib
import json
import math

import datasets
from datasets import Dataset, DatasetDict

from app.prepare.args import UsageError, useful_processes
from app.prepare.corpus import Documents, quiet_progress


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
    """Hold out about `ceil(val_fraction * records)` records, identical records always on the same side.

    Records are ordered by a hash of their content salted with `seed` (a shuffle that is the same for a seed, whatever
    the order of the input) and taken into validation a group of identical records at a time: a duplicated example
    (common in scraped data) is never both trained on and evaluated.
    """
    if val_fraction == 0:
        return pool, pool.select([])
    groups = _identical_records(pool, seed)
    if len(groups) < 2:
        more = "documents (or --split_lines for .txt)" if unit == "document" else "examples"
        raise UsageError(
            f"--val_fraction {val_fraction}: the input has {len(groups)} distinct {unit} and validation is held out "
            f"by {unit}; give more {more}, or --val_fraction 0"
        )
    ordered = [groups[digest] for digest in sorted(groups)]
    wanted, validation = math.ceil(val_fraction * len(pool)), []
    while len(validation) < wanted and len(ordered) > 1:  # the last group always trains
        validation.extend(ordered.pop())
    return pool.select([i for group in ordered for i in group]), pool.select(validation)


def _identical_records(pool: Dataset, seed: int) -> dict[bytes, list[int]]:
    """The indices of the records, grouped by a hash of their content (every column) salted with `seed`."""
    groups: dict[bytes, list[int]] = {}
    salt = seed.to_bytes(16, "little", signed=True)
    index = 0
    for batch in pool.iter(batch_size=1000):
        for values in zip(*(batch[column] for column in pool.column_names)):
            content = json.dumps(values, ensure_ascii=False, sort_keys=True).encode()
            groups.setdefault(hashlib.blake2b(content, digest_size=16, salt=salt).digest(), []).append(index)
            index += 1
    return groups


def _drop_empty(documents: Dataset | None, num_proc: int) -> tuple[Dataset | None, int]:
    if documents is None:
        return None, 0
    with quiet_progress():
        kept = documents.filter(
            lambda batch: [bool(text) for text in batch["text"]],
            batched=True,
            num_proc=useful_processes(len(documents), num_proc),
        )
    return kept, len(documents) - len(kept)


def _concatenate(parts: list[Dataset | None]) -> Dataset:
    return datasets.concatenate_datasets([part for part in parts if part is not None])
