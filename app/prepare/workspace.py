"""Where prepare_data.py's intermediate Arrow files go: a hidden folder beside the output, made when the work starts
and deleted when it ends (a killed run's is deleted by the next one, as its staging folder is: app/folders.py).

Without it, `datasets` put them where each input lay. A local file was converted into the shared cache
(~/.cache/huggingface/datasets), 2.5 times its size and kept for ever, a new copy at every run whose tokenizer was
trained; and that cache knows a local file by its path and modification time, so a file regenerated with its time
kept (rsync -a, tar --mtime, build tools that fix times) was read as it had been before, silently. A saved dataset
given as --input got cache-*.arrow files among its own. And a table built in memory (the packed blocks) stayed
there until the output was written: every block of the corpus in RAM at once.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from pathlib import Path
from typing import Optional

from app.folders import real_folder, staging_folder

_folder: ContextVar[Optional[Path]] = ContextVar("prepare_workspace", default=None)
_numbers = itertools.count()
_unfinished: list[Callable[[], None]] = []
"""What removes each open workspace and the folders made for its output, for a stop that cannot unwind (abandon)."""


@contextmanager
def workspace(output_dir: Path) -> Iterator[Path]:
    """The folder for this run's intermediate files, beside `output_dir` (on its filesystem, which must hold the
    output anyway), for the duration of the `with` block."""
    final = real_folder(output_dir)
    made = [parent for parent in final.absolute().parents if not parent.exists()]
    final.parent.mkdir(parents=True, exist_ok=True)
    folder = staging_folder(final, "work")
    folder.mkdir()

    def discard() -> None:  # a refused input or a stop leaves no folder made for its output
        shutil.rmtree(folder, ignore_errors=True)
        for parent in made:
            with suppress(OSError):
                parent.rmdir()

    token = _folder.set(folder)
    _unfinished.append(discard)
    try:
        yield folder
        made.clear()  # the output is in them now
    finally:
        _folder.reset(token)
        _unfinished.remove(discard)
        discard()


@contextmanager
def removed_if_stopped(folder: Path) -> Iterator[None]:
    """`folder` (the output being staged) removed by `abandon` while the block runs: a stop while the output was
    written left the whole staged dataset beside it, after saying that nothing was written."""
    def discard() -> None:
        shutil.rmtree(folder, ignore_errors=True)

    _unfinished.append(discard)
    try:
        yield
    finally:
        _unfinished.remove(discard)


def abandon() -> None:
    """Remove every open workspace now: the work stops without unwinding (app/stopping.py stopped_in_one_line)."""
    for discard in reversed(_unfinished):
        discard()


def cache_dir() -> Optional[str]:
    """`load_dataset`'s cache_dir for local files: this run's, read afresh (None outside a workspace)."""
    folder = _folder.get()
    return str(folder / "inputs") if folder else None


def arrow_file(stage: str) -> dict[str, str]:
    """`map`/`filter`'s cache_file_name for one stage: a new file in the workspace (no option outside one)."""
    folder = _folder.get()
    return {"cache_file_name": str(folder / f"{stage}-{next(_numbers)}.arrow")} if folder else {}
