"""Data preparation: `prepare(PrepareArgs(...))` is what `prepare_data.py` runs, callable in-process too."""

from app.prepare.args import PrepareArgs, UsageError
from app.prepare.corpus import STDLIB_CORPUS, stdlib_corpus_paths
from app.prepare.pipeline import prepare

__all__ = ["STDLIB_CORPUS", "PrepareArgs", "UsageError", "prepare", "stdlib_corpus_paths"]
