"""Folders and files written whole: a command writes its output under a hidden name beside it and renames it into
place, so that a crash or a kill leaves the old one or the new one, never half of one; and what a killed writer left
beside a folder is cleaned up by the next. Shared by prepare_data.py's dataset, convert_to_hf.py's model folder, and
the files a run rewrites (metrics.csv, the generation samples). And the names inside a folder prepare_data.py
writes, which train.py, convert_to_hf.py and generate.py read (here, not in app/prepare/, whose import brings
datasets)."""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import sys
from contextlib import suppress
from pathlib import Path
from typing import Callable, Iterable, Optional

import psutil

STATS_FILE = "stats.json"
"""A prepared folder's description: its format, pad token, counts (app/data/formats.py reads it)."""
PREPARED_WITH = "prepared_with"
"""stats.json's last entry: the versions of the libraries that prepared the folder (app/versions.py)."""
DATASET_DICT_FILE = "dataset_dict.json"
"""What datasets' save_to_disk writes beside the splits."""
TOKENIZER_FOLDER = "tokenizer"
"""The tokenizer a prepared folder was tokenized with."""


def prepared_tokenizer(data_dir: str | Path) -> Path:
    """The tokenizer folder inside a prepared data folder."""
    return Path(data_dir) / TOKENIZER_FOLDER


def staging_folder(final: Path, kind: str = "partial") -> Path:
    """A new hidden folder beside `final` to write it in (`kind` "partial") or to retire the old one to ("replaced"),
    named for this machine and process: `.NAME.partial-HOST-PID-XXXXXXXX`. What a killed writer of the same
    `final` on this machine left there (its process gone) is deleted first: a prepared dataset or a converted
    model half written, gigabytes nothing would ever read. Another machine's, or a live process's, is left alone."""
    host = socket.gethostname()
    leftover = re.compile(rf"^\.{re.escape(final.name)}\.(partial|replaced|work)-{re.escape(host)}-(\d+)-")
    for path in final.parent.iterdir() if final.parent.is_dir() else ():
        match = leftover.match(path.name)
        if match and not psutil.pid_exists(int(match.group(2))):
            shutil.rmtree(path, ignore_errors=True)
    return final.with_name(f".{final.name}.{kind}-{host}-{os.getpid()}-{os.urandom(4).hex()}")


def remove_own_staging(*folders: Path) -> None:
    """Delete the folders this process is writing (`kind` "partial") in `folders`: a stopped conversion's."""
    own = re.compile(rf"^\..+\.partial-{re.escape(socket.gethostname())}-{os.getpid()}-")
    for folder in folders:
        for path in folder.iterdir() if folder.is_dir() else ():
            if own.match(path.name):
                shutil.rmtree(path, ignore_errors=True)


def real_folder(final: Path) -> Path:
    """The folder to write when `final` is asked for: a link's target, so that a data or model folder linked to
    other storage stays linked and is replaced where it lives (renaming the link itself left a plain folder in its
    place, the old data behind, and a traceback), and `.` or `..` by their real names, beside which it is staged."""
    return final.resolve() if final.is_symlink() or final.name in ("", ".", "..") else final


def unusable_folder(path: Path) -> Optional[str]:
    """Why a folder cannot be made or written at `path` (absolute), or None: asked before the work, not found after
    it (a conversion, a test set's answers, a corpus prepared for an hour) as a traceback."""
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def replace_file(path: Path, text: str | bytes | Iterable[str]) -> None:
    """Write `path` under a temporary name and rename it into place: a resumed run rewrites metrics.csv with the rows
    it keeps, and a full disk (ENOSPC) or a kill while writing must leave the old file, not a truncated history.
    The temporary name is created new, never opened through what is there: a link placed at `.metrics.csv.partial`
    had the run overwrite the file it pointed to, and the rename then made metrics.csv itself that link. `text` may
    come in pieces, written as they come (a long run's metrics.csv, read from the old file meanwhile); in UTF-8,
    whatever the locale; or bytes (a picture)."""
    temporary = path.with_name(f".{path.name}.partial")
    discard(temporary)
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        if isinstance(text, bytes):
            with open(descriptor, "wb") as binary:
                binary.write(text)
        else:
            with open(descriptor, "w", newline="", encoding="utf-8") as handle:
                handle.writelines([text] if isinstance(text, str) else text)
    except BaseException:
        with suppress(OSError):  # a read-only folder refuses this too; the first error is the one to see
            temporary.unlink(missing_ok=True)
        raise
    os.replace(temporary, path)


def append_whole(path: Path, text: str) -> None:
    """Append `text` to the file at `path`, or nothing of it: a write the storage refuses part way (a full disk) is
    cut off again, so that the next line does not begin inside this one."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(descriptor).st_size
        data = text.encode()
        try:
            written = 0
            while written < len(data):
                written += os.write(descriptor, data[written:])
        except OSError:
            os.ftruncate(descriptor, size)
            raise
    finally:
        os.close(descriptor)


def storage_error(error: OSError, writing: Path | str) -> str:
    """'No space left on device (ENOSPC) writing PATH' from an OSError (os.write leaves it without a path)."""
    code = f" ({errno.errorcode[error.errno]})" if error.errno in errno.errorcode else ""
    return f"{error.strerror or error}{code} writing {error.filename or writing}"


UNWRITTEN: set[Path] = set()
"""The files `written_or_warned` could not write last time."""
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A full disk, a quota reached: every command says them in one line (with what else its writes may meet)."""
STORAGE_FULL = NO_ROOM | {errno.EROFS, errno.EIO}
"""The errors of storage that refuses writes for now (full, over quota, remounted read-only, failing), which a run
can outlast; others (a permission, a folder deleted) say the run is set up wrong, and still end it."""


def written_or_warned(path: Path, write: Callable[[], object]) -> bool:
    """`write()` (which writes `path`), or, when the storage refuses it (a full disk), one warning line, once until it
    works again: for what rank 0 writes beside the checkpoints (metrics.csv's rows, rows.jsonl, the generation
    samples, quarantine.jsonl, summary.json). They are written again from the run's state, or from the checkpoint a
    resume starts at, and the next save meets the same storage: if it is still full, the save stops the run in one
    line (app/checkpoint/failures.py). Before, rank 0's traceback ended the run, the others' "connection closed by
    peer". Whether it was written."""
    try:
        write()
    except OSError as error:
        if error.errno not in STORAGE_FULL:
            raise
        if path not in UNWRITTEN:
            UNWRITTEN.add(path)
            print(f"warning: {storage_error(error, path)}; the run goes on without it until it can be written again",
                  file=sys.stderr, flush=True)
        return False
    if path in UNWRITTEN:
        UNWRITTEN.discard(path)
        print(f"{path} is written again", file=sys.stderr, flush=True)
    return True


def discard(path: Path) -> None:
    """Remove what is at `path` (a leftover file or folder, or a link, itself: never what a link points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
