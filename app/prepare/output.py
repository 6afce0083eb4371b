"""Write the prepared folder so that a failure, or a wrong argument, never leaves a half-written or lost dataset."""

from __future__ import annotations

import errno
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from datasets import DatasetDict
from transformers import PreTrainedTokenizerBase

from app.cli import UsageError
from app.folders import real_folder, staging_folder
from app.folders import PREPARED_WITH, STATS_FILE, TOKENIZER_FOLDER
from app.versions import PREPARING_LIBRARIES, library_versions
from app.prepare.args import check_replaceable
from app.prepare.workspace import removed_if_stopped



def write_atomically(output_dir: Path, write: Callable[[Path], None], overwrite: bool) -> None:
    """Write into a new folder beside `output_dir`, then swap it in; an old output is removed only after the swap,
    and only if it is an earlier output or empty, and replaced only under --overwrite (checked again: another
    prepare_data.py into the same folder may have written it meanwhile, and the later one replaced it, both saying
    they had written their data)."""
    output_dir = real_folder(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(output_dir)
    staging.mkdir()
    try:
        with removed_if_stopped(staging):
            write(staging)
        if not output_dir.exists() or not any(output_dir.iterdir()):
            try:
                staging.rename(output_dir)  # onto nothing or an empty folder, atomically; else ENOTEMPTY
                return
            except OSError as error:
                if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        if not overwrite:  # filled since the start (an empty or absent folder is all it accepted)
            raise UsageError(f"--output_dir {output_dir}: written by another command while this one prepared its "
                             "data (another prepare_data.py into the same folder?); nothing of it was replaced: choose "
                             "another folder, or add --overwrite")
        check_replaceable(output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    retired = staging_folder(output_dir, "replaced")
    output_dir.rename(retired)
    staging.rename(output_dir)
    try:
        shutil.rmtree(retired)
    except OSError as error:  # the new output is in place: the old one's files are another owner's, or read-only
        print(f"prepare_data.py: note: the earlier output, moved to {retired}, could not be removed "
              f"({error.strerror or error}); delete it", file=sys.stderr)


def save_prepared(folder: Path, blocks: DatasetDict, tokenizer: PreTrainedTokenizerBase, stats: dict) -> None:
    """The DatasetDict of rows, the tokenizer training will load by default, and stats.json.

    An empty split (--val_fraction 0) is written as one empty shard: by default `save_to_disk` writes no data file
    for it, and `load_from_disk` (datasets 5.2) then fails with an IndexError.
    """
    blocks.save_to_disk(str(folder), num_shards={name: 1 for name, split in blocks.items() if not len(split)})
    tokenizer.save_pretrained(str(folder / TOKENIZER_FOLDER))
    stats = stats | {PREPARED_WITH: library_versions(PREPARING_LIBRARIES)}  # last: app/data/identity.py stats_digest
    (folder / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
