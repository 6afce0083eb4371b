"""Data preparation: `prepare(PrepareArgs(...))` is what `prepare_data.py` runs, callable in-process too.

`prepare` is imported on first use (PEP 562): it brings datasets and transformers (3 s), and `prepare_data.py` parses
its command line first, so that a mistyped flag is refused at once."""

from app.prepare.args import PrepareArgs, UsageError
from app.prepare.corpus import STDLIB_CORPUS, stdlib_corpus_paths

__all__ = ["STDLIB_CORPUS", "PrepareArgs", "UsageError", "prepare", "stdlib_corpus_paths"]


def __getattr__(name: str):
    if name == "prepare":
        from app.prepare.pipeline import prepare

        return prepare
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
