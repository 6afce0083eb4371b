"""The preflight's notes: said once, by the process the user started, not by every rank, and only by a run that
starts (`held`): a refused run's notes ("no checkpoint yet, starting from step 0") read as if it had started."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

from app.tasks import launching_process

_held: Optional[list[str]] = None


def note(message: str) -> None:
    if not launching_process():
        return
    if _held is not None:
        _held.append(message)
    else:
        print(message, flush=True)


@contextmanager
def held() -> Iterator[None]:
    """Notes kept until the checks pass, then said in order; dropped when they refuse the run (exit_refused's
    SystemExit), said before anything else that ends them (a crash, which they may explain)."""
    global _held
    _held = []
    try:
        yield
    except SystemExit:
        _held = None
        raise
    finally:
        notes, _held = _held or [], None
        for message in notes:
            print(message, flush=True)
