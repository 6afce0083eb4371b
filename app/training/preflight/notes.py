"""The preflight's notes: said once, by the process the user started, not by every rank."""

from __future__ import annotations

from app.tasks import launching_process


def note(message: str) -> None:
    if launching_process():
        print(message, flush=True)
