"""What `prepare_data.py` accepts, and the checks that can refuse it before any work is done."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


class UsageError(Exception):
    """A problem with the user's arguments or inputs: reported as one line, exit status 2, no traceback."""


@dataclass
class PrepareArgs:
    """Turn raw text into packed token blocks for training."""

    input: list[str] = field(default_factory=list)
    """Files (.txt .py .md .jsonl .json .parquet .csv), folders of them (searched recursively), a folder written by
    `datasets.save_to_disk`, or a Hugging Face dataset name. Several may be given."""
    output_dir: str = ""
    """Folder to create: a DatasetDict (train, validation) of `input_ids` blocks, `tokenizer/` and `stats.json`."""
    tokenizer: str | None = None
    """Hugging Face tokenizer name or local folder (the tokenizer of the model you will train)."""
    vocab_size: int | None = None
    """Instead of --tokenizer: train a byte-fallback SentencePiece BPE tokenizer of this size on the training split."""
    block_size: int = 2048
    """Tokens per training example; documents are concatenated and cut into blocks of exactly this length."""
    val_fraction: float = 0.05
    """Fraction of documents held out for validation (whole documents, never split). Ignored for inputs that bring
    their own validation split. 0 writes an empty validation split."""
    text_field: str = "text"
    """Column holding the text in .jsonl/.json/.parquet/.csv files and in datasets."""
    split_lines: bool = False
    """Treat every line of a .txt file as its own document (default: one document per file)."""
    dataset_config: str | None = None
    """Configuration name of a Hugging Face dataset (the second argument of `load_dataset`)."""
    split: str | None = None
    """Split of a Hugging Face or saved dataset to read, e.g. `train` or `train[:10%]` (default: `train`, plus its
    `validation` split when it has one)."""
    seed: int = 0
    """Seed for the train/validation split and tokenizer training: the same seed gives the same output."""
    num_proc: int = 1
    """Worker processes for tokenizing and packing."""
    overwrite: bool = False
    """Replace an existing output folder (only after the new one is completely written)."""
    trust_remote_code: bool = False
    """Allow a --tokenizer whose repository ships Python code to run it. Only for repositories you trust."""


SUPPORTED_SUFFIXES = (".txt", ".py", ".md", ".jsonl", ".json", ".parquet", ".csv")
MIN_TRAINED_VOCAB = 256 + 3 + 1
"""A trained tokenizer holds 256 byte pieces and <unk> <s> </s> before it can learn a single character."""


def check_args(args: PrepareArgs) -> None:
    """Refuse arguments that cannot work, cheaply and before reading any data."""
    if not args.input:
        raise UsageError("--input is required: give one or more files, folders or a Hugging Face dataset name")
    if not args.output_dir:
        raise UsageError("--output_dir is required: the folder to write the prepared dataset to")
    if (args.tokenizer is None) == (args.vocab_size is None):
        raise UsageError(
            "give exactly one of --tokenizer NAME_OR_DIR (use a model's tokenizer) or --vocab_size N (train one)"
        )
    if args.vocab_size is not None and args.vocab_size < MIN_TRAINED_VOCAB:
        raise UsageError(f"--vocab_size {args.vocab_size} is too small: use at least {MIN_TRAINED_VOCAB}")
    if args.block_size < 2:
        raise UsageError(f"--block_size {args.block_size} must be at least 2")
    if not 0 <= args.val_fraction < 1:
        raise UsageError(f"--val_fraction {args.val_fraction} must be in [0, 1)")
    if args.num_proc < 1:
        raise UsageError(f"--num_proc {args.num_proc} must be at least 1")
    for path in args.input:
        check_input_path(path)
    if args.tokenizer and args.tokenizer.startswith(("/", ".", "~")) and not Path(args.tokenizer).is_dir():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such folder")
    check_output_dir(Path(args.output_dir), args.overwrite, [Path(p) for p in args.input if Path(p).exists()])


def looks_like_hub_name(text: str) -> bool:
    """`owner/name` or `name` without a file suffix: what we try on the Hugging Face Hub when no such path exists."""
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not text.lower().endswith(SUPPORTED_SUFFIXES)


def check_input_path(path: str) -> None:
    """A local input must exist, be readable and have a format we read; anything else must look like a Hub name."""
    local = Path(path)
    if not local.exists():
        if looks_like_hub_name(path) and not path.startswith((".", "~")):
            return
        raise UsageError(f"--input {path}: no such file or directory")
    if not os.access(local, os.R_OK):
        raise UsageError(f"--input {path}: not readable (check its permissions)")
    if local.is_file() and local.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise UsageError(f"--input {path}: unsupported file type; use one of {', '.join(SUPPORTED_SUFFIXES)}")


def check_output_dir(output_dir: Path, overwrite: bool, local_inputs: list[Path]) -> None:
    """Never write over data unless asked, and never over (or inside) the inputs themselves."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output_dir {output_dir}: exists and is not a folder")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise UsageError(f"--output_dir {output_dir}: already holds data; choose another folder or add --overwrite")
    target = output_dir.resolve()
    for source in local_inputs:
        source = source.resolve()
        if target == source or target in source.parents or source in target.parents:
            raise UsageError(f"--output_dir {output_dir} overlaps --input {source}; write the output elsewhere")


def useful_processes(rows: int, num_proc: int) -> int | None:
    """`datasets` refuses more processes than rows, and one process is spelled None."""
    processes = min(num_proc, rows)
    return processes if processes > 1 else None
