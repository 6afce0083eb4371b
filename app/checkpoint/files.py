"""Checkpoint files: `<out_dir>/checkpoints/step-00000016.ckpt`, made visible atomically, and which ones to keep.

A checkpoint is written under a hidden temporary name in the same folder (`temporary_path`), made durable and
renamed once complete (`publish`), so a crash at any moment leaves either the previous checkpoints or the new one,
never a partial file that resume would take; the next save removes what an interrupted one left behind.

After publishing, rank 0 records the checkpoint with the lowest validation loss in `checkpoints/best.json` (only
checkpoints evaluated at their own step compete) and, with --keep_last_n, deletes older checkpoints except that
best one and the one the run resumed from. A spike guard's rollback moves the checkpoints newer than the one it
returns to into `checkpoints/rolled-back/`, where resume and conversion never look.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from app.folders import replace_file

CHECKPOINT_NAME = re.compile(r"^step-(\d+)\.ckpt$")
LEFTOVER_NAME = re.compile(r"^\.step-\d+\.ckpt\.(partial|replaced)$")
BEST_FILE = "best.json"
ROLLED_BACK_DIR = "rolled-back"
RUN_CONFIG_FILE = "config.yaml"
"""The run's options as YAML, in out_dir (written by every start of the run)."""
LOCK_FILE = ".lock"
HELD_LOCKS: list[int] = []
"""The descriptors of the run folders this process claimed: open until it ends, however it ends."""
LOCK_WAIT_S = 150.0
"""How long a run waits for a folder locked from another machine: a crashed node's lock on a network filesystem
lasts until its lease runs out (90 s in NFSv4), and Slurm can requeue the run onto other nodes sooner."""
SHARED_VIEW_WAIT_S = 60.0
"""How long a node waits to see the lock rank 0 wrote: an NFS client caches a folder's listing, and the absence of
a file, for up to acdirmax (60 s by default)."""


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def run_tokenizer_dir(out_dir: str | Path) -> Path:
    """The copy of its tokenizer a run keeps beside its checkpoints, so that it converts without its data folder."""
    return Path(out_dir) / "tokenizer"


def claim_run_folder(out_dir: Path, say: Callable[[str], None] = print, wait_s: float = LOCK_WAIT_S,
                     poll_s: float = 5.0) -> Optional[str]:
    """Lock `out_dir` for this process's lifetime (rank 0 of a run). A second run started in the same folder (the
    same job submitted twice, a Slurm script started by hand beside its job) resumed from the checkpoints the first
    was writing and deleting (--keep_last_n) and wrote the same names. None once held (or where the filesystem
    has no locks); a line naming the holder otherwise. The kernel releases the lock when the process ends; a lock
    held from another machine is waited for (LOCK_WAIT_S), as that machine may have crashed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / LOCK_FILE).is_symlink():  # the run would truncate and write what it points to
        return f"--out_dir {out_dir}: {LOCK_FILE} is a symbolic link; remove it (a run's lock is a file of its own)"
    descriptor = os.open(out_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    deadline, waited = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = os.pread(descriptor, 200, 0).decode(errors="replace").strip() or "a process"
            if holder.endswith(f" on {socket.gethostname()}") or time.monotonic() >= deadline:
                os.close(descriptor)
                return (f"--out_dir {out_dir} is in use by another run ({holder}); wait for it to end, or choose "
                        "another --out_dir")
            if not waited:
                say(f"--out_dir {out_dir} is locked by {holder}: waiting up to {wait_s:.0f} s for it (the lock of "
                    "a machine that crashed lasts until its network filesystem's lease ends)")
            waited = True
            time.sleep(poll_s)
        except OSError:  # ENOLCK, EOPNOTSUPP: a filesystem without locks; go on unguarded, as before
            write_holder(descriptor)  # what the other nodes look for
            os.close(descriptor)
            return None
    write_holder(descriptor)
    HELD_LOCKS.append(descriptor)
    return None


def write_holder(descriptor: int) -> None:
    """This process's `holder_line` as the lock's content, on the disk (the other nodes read it while this process
    keeps the file open: an NFS client sends what it wrote on fsync or close)."""
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{holder_line()}\n".encode(), 0)
    os.fsync(descriptor)


def holder_line() -> str:
    """What a run's rank 0 writes into the lock it holds: this process, on this machine."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


def sees_lock(out_dir: Path, holder: str, wait_s: float = SHARED_VIEW_WAIT_S, poll_s: float = 2.0) -> bool:
    """Whether this machine sees `holder` (rank 0's `holder_line`) in `out_dir`'s lock: a node whose --out_dir is
    another folder, or on a disk of its own, does not. A lock naming another process answers at once (opening a
    file on NFS fetches its current content); a missing one is looked for again for `wait_s`, as the client may
    have cached the folder's listing. Reads only; creates nothing."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            found = (out_dir / LOCK_FILE).read_text().strip()
        except OSError:
            found = ""
        if found:
            return found == holder
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def run_folder_of(checkpoint: Path) -> Optional[Path]:
    """The run folder (out_dir) a checkpoint lies in: `<run>/checkpoints/step-N.ckpt`, also under rolled-back/; None
    for a checkpoint copied elsewhere."""
    for folder in checkpoint.absolute().parents:
        if folder.name == checkpoint_dir(".").name:
            return folder.parent
    return None


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(out_dir) / f"step-{step:08d}.ckpt"


def list_checkpoints(out_dir: str | Path) -> dict[int, Path]:
    """Complete checkpoints by step number (temporary files of an interrupted save never match the name)."""
    folder = checkpoint_dir(out_dir)
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = CHECKPOINT_NAME.match(path.name)
        if match:
            found[int(match.group(1))] = path
    return found


def latest_checkpoint(out_dir: str | Path) -> Optional[Path]:
    """The checkpoint with the highest step number (by number, not by string order)."""
    checkpoints = list_checkpoints(out_dir)
    return checkpoints[max(checkpoints)] if checkpoints else None


def temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def make_durable(path: Path) -> None:
    """fsync a written file, or every file of a written folder, before it is published."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())


def publish(temporary: Path, final: Path) -> None:
    """Rename `temporary` to `final` atomically (an existing folder is swapped out, then removed) and fsync the
    parent folder, so that the new name itself survives a crash (one that came between the swap and the removal left
    the old folder under its `.replaced` name: removed first, as renaming onto it fails)."""
    if final.is_dir():
        stale = final.with_name(f".{final.name}.replaced")
        if stale.exists():
            shutil.rmtree(stale)
        os.rename(final, stale)
        os.rename(temporary, final)
        try:
            shutil.rmtree(stale)
        except OSError as error:  # the new one is in place; the old one's files are another user's, or read-only
            print(f"note: {final} is written; the folder it replaced, moved to {stale}, could not be removed "
                  f"({error.strerror or error}): delete it", file=sys.stderr)
    else:
        os.replace(temporary, final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def leftovers(folder: Path) -> list[Path]:
    """What interrupted or failed saves left behind in a checkpoints folder (hidden `.partial` / `.replaced` names,
    never a checkpoint)."""
    return [path for path in folder.iterdir() if LEFTOVER_NAME.match(path.name)] if folder.is_dir() else []


def remove_leftovers(folder: Path) -> None:
    for path in leftovers(folder):
        remove(path)


def bytes_on_disk(path: Path) -> int:
    """The disk space a file or a folder takes, its blocks (a link counts for nothing: what it points to stays). Not
    its size: a save killed just after sizing its file leaves one of the full size and almost no blocks, and the
    preflight counted that size as space its removal frees (then the run trained, and its first save met a full
    disk)."""
    if path.is_symlink():
        return 0
    files = [path] if path.is_file() else [file for file in path.rglob("*") if file.is_file() and not file.is_symlink()]
    return sum(file.stat().st_blocks * 512 for file in files)


def remove(path: Path) -> None:
    """Delete a checkpoint file or folder; a link is removed, never what it points to: a checkpoint linked in from
    another run (to resume from it) stays there, and shutil.rmtree refuses a link to a folder with an OSError,
    which ended the run at the save whose --keep_last_n pruned it. A checkpoint folder is first renamed to its
    hidden `.replaced` name (what remove_leftovers deletes after a crash): whoever reads it meanwhile (a second run's
    preflight, convert_to_hf.py on the running run's folder) finds it whole or not at all, never half deleted."""
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    if CHECKPOINT_NAME.match(path.name):
        hidden = path.with_name(f".{path.name}.replaced")
        if hidden.exists():
            shutil.rmtree(hidden)
        os.rename(path, hidden)
        path = hidden
    shutil.rmtree(path)


def read_best(out_dir: str | Path) -> Optional[dict[str, Any]]:
    """`{"checkpoint": "step-00000016.ckpt", "step": 16, "val_loss": 2.31, "evaluated": {name: val_loss, ...}}`, or
    None when nothing was marked yet. `evaluated` holds every checkpoint saved at an evaluation that is still there
    (absent from files of earlier versions)."""
    path = checkpoint_dir(out_dir) / BEST_FILE
    if not path.is_file():
        return None
    try:
        best = json.loads(path.read_text())
    except (OSError, ValueError):
        best = None
    if not (isinstance(best, dict) and isinstance(best.get("checkpoint"), str) and isinstance(best.get("step"), int)
            and isinstance(best.get("val_loss"), (int, float))):  # cut short or edited: every resume ended in a
        return None  # traceback reading it; rewritten by the next evaluation
    return best


def mark_if_best(path: Path, val_loss: float, measured: Optional[str] = None) -> None:
    """Record `path`'s validation loss and point best.json at the lowest of those still there (the earlier on a
    tie). `measured` says on what rows (io.validation_measured): losses measured on other rows (a resume with another
    --eval_iters, ranks or evaluation batch, or another mixture) do not compare, and the checkpoints evaluated before
    stop being candidates: best.json kept a checkpoint whose loss over 20 rows beat a later one's over 4, though the
    later one was better on either set of rows, and --keep_last_n kept the wrong one."""
    best = read_best(path.parent.parent) or {}
    evaluated = best.get("evaluated", {best["checkpoint"]: best["val_loss"]} if best else {})
    if measured is not None and best.get("measured") not in (None, measured):
        evaluated = {}
    write_best(path.parent, {name: loss for name, loss in evaluated.items() if (path.parent / name).exists()}
               | {path.name: val_loss}, measured or best.get("measured"))


def write_best(folder: Path, evaluated: dict[str, float], measured: Optional[str] = None) -> None:
    """best.json for the checkpoints of `folder` evaluated with these losses, on the rows `measured` says (written
    atomically)."""
    name = min(evaluated, key=evaluated.__getitem__)
    best = {"checkpoint": name, "step": int(CHECKPOINT_NAME.match(name).group(1)), "val_loss": evaluated[name],
            "evaluated": evaluated} | ({"measured": measured} if measured else {})
    replace_file(folder / BEST_FILE, json.dumps(best) + "\n")


def prune_checkpoints(out_dir: str | Path, keep_last_n: Optional[int], protected: set[Path]) -> list[Path]:
    """Delete all but the newest `keep_last_n` checkpoints, never the best one nor those in `protected`."""
    if keep_last_n is None:
        return []
    checkpoints = list_checkpoints(out_dir)
    best = read_best(out_dir)
    newest = sorted(checkpoints)[-keep_last_n:]
    keep = {path.resolve() for path in protected} | {checkpoints[step].resolve() for step in newest}
    if best is not None:
        keep.add((checkpoint_dir(out_dir) / best["checkpoint"]).resolve())
    deleted = [path for step, path in sorted(checkpoints.items()) if path.resolve() not in keep]
    for path in deleted:
        remove(path)
    if best is not None and any(path.name in best.get("evaluated", {}) for path in deleted):
        folder = checkpoint_dir(out_dir)  # best.json lists the evaluated checkpoints that are still there
        write_best(folder, {name: loss for name, loss in best["evaluated"].items() if (folder / name).exists()},
                   best.get("measured"))
    return deleted


def set_aside_newer(out_dir: str | Path, step: int) -> list[Path]:
    """Move the checkpoints newer than `step` (those of the stretch a rollback or a resume from an older checkpoint
    abandons) into checkpoints/rolled-back/, with best.json when it names one of them: left in place, the latest of
    them would be what --resume true continues from after a crash. Kept, not deleted. A best.json moved aside is
    written again for the best of the evaluated checkpoints left (once, the next evaluation was marked best whatever
    its loss, and --keep_last_n then deleted the better checkpoints that were left)."""
    moved = []
    best = read_best(out_dir)
    for newer, path in sorted(list_checkpoints(out_dir).items()):
        if newer > step:
            moved.append(move_aside(path))
    if best is not None and best["step"] > step:
        moved.append(move_aside(checkpoint_dir(out_dir) / BEST_FILE))
        folder = checkpoint_dir(out_dir)
        left = {name: loss for name, loss in best.get("evaluated", {}).items() if (folder / name).exists()}
        if left:
            write_best(folder, left, best.get("measured"))
    return moved


def move_aside(path: Path) -> Path:
    """Move `path` into the rolled-back/ folder beside it. Rolled back over the same step again, the newer copy is
    numbered (step-00000008-2.ckpt): replacing the older one deleted the only copy of a stretch a user had kept."""
    folder = path.parent / ROLLED_BACK_DIR
    folder.mkdir(exist_ok=True)
    target, copy = folder / path.name, 1
    while target.exists() or target.is_symlink():
        copy += 1
        target = folder / f"{path.name.removesuffix(''.join(path.suffixes))}-{copy}{''.join(path.suffixes)}"
    path.rename(target)
    return target
