"""Write the prepared folder so that a failure, or a wrong argument, never leaves a half-written or lost dataset."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from datasets import DatasetDict
from transformers import PreTrainedTokenizerBase

from app.folders import real_folder, staging_folder
from app.folders import STATS_FILE, TOKENIZER_FOLDER
from app.prepare.args import check_replaceable
from app.prepare.workspace import removed_if_stopped



def write_atomically(output_dir: Path, write: Callable[[Path], None]) -> None:
    """Write into a new folder beside `output_dir`, then swap it in; an old output is removed only after the swap,
    and only if it is an earlier output or empty (checked again: it may have changed while the data was prepared)."""
    output_dir = real_folder(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(output_dir)
    staging.mkdir()
    try:
        with removed_if_stopped(staging):
            write(staging)
        if output_dir.exists():
            check_replaceable(output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not output_dir.exists():
        staging.rename(output_dir)
        return
    retired = staging_folder(output_dir, "replaced")
    output_dir.rename(retired)
    staging.rename(output_dir)
    shutil.rmtree(retired)


def save_prepared(folder: Path, blocks: DatasetDict, tokenizer: PreTrainedTokenizerBase, stats: dict) -> None:
    """The DatasetDict of rows, the tokenizer training will load by default, and stats.json.

    An empty split (--val_fraction 0) is written as one empty shard: by default `save_to_disk` writes no data file
    for it, and `load_from_disk` (datasets 5.2) then fails with an IndexError.
    """
    blocks.save_to_disk(str(folder), num_shards={name: 1 for name, split in blocks.items() if not len(split)})
    tokenizer.save_pretrained(str(folder / TOKENIZER_FOLDER))
    (folder / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
