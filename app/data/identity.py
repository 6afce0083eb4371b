"""What identifies a prepared folder wherever it lies: its stats.json and the row counts of its splits.

A resumed run must read the rows its checkpoint's position counts: the order of one folder is a function of the seed
and the folder's row count, a mixture's folders are numbered one after the other, and a mixture's positions and seeds
are kept per folder name. The path a folder is reached by enters none of these, and it changes when a preempted run
resumes on another node, mount or working directory. So a checkpoint records each folder's identity (`data_folders`
in its metadata) and a resume compares identities; paths only for checkpoints that record none.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from app.folders import PREPARED_WITH, STATS_FILE



def folder_identity(name: str, path: str | Path, train_rows: int, validation_rows: int) -> dict[str, Any]:
    """What a checkpoint records of one folder: its name (a mixture's key), where it was (for messages only), a
    hash of its stats.json (written by prepare_data.py, copied with the folder) and its rows."""
    stats = Path(path) / STATS_FILE
    return {"name": name, "path": str(Path(path).absolute()),
            "stats_sha256": stats_digest(stats.read_bytes()) if stats.is_file() else None,
            "train_rows": train_rows, "validation_rows": validation_rows}


def stats_digest(written: bytes) -> str:
    """The hash of a stats.json without the library versions that prepared it (PREPARED_WITH, written last): the same
    data prepared again after an upgrade is the same folder to a resume, and a folder written before versions were
    recorded keeps the hash its checkpoints hold."""
    try:
        stats = json.loads(written)
    except ValueError:
        stats = None
    if isinstance(stats, dict) and PREPARED_WITH in stats:
        del stats[PREPARED_WITH]
        written = (json.dumps(stats, indent=2) + "\n").encode()
    return hashlib.sha256(written).hexdigest()


def identity_difference(saved: dict[str, Any], now: dict[str, Any]) -> Optional[str]:
    """Why the folder `now` is not the folder the checkpoint recorded as `saved`; None when it is the same data."""
    for split in ("train", "validation"):
        before, rows = saved.get(f"{split}_rows"), now[f"{split}_rows"]
        if before != rows:
            return f"its {split} split has {rows} rows, the checkpoint's had {before}"
    if saved.get("stats_sha256") != now["stats_sha256"]:
        return "its stats.json differs from the one the checkpoint recorded (prepared from other input or options)"
    return None


def same_folder_by_path(saved_path: Path, now_path: Path) -> bool:
    """For checkpoints that record no identity: the same folder, or one of the same name when the recorded folder is
    gone (the run moved to another node, mount or working directory)."""
    saved_path, now_path = saved_path.resolve(), now_path.resolve()
    return saved_path == now_path or (not saved_path.exists() and saved_path.name == now_path.name)
