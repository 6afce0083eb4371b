"""What `prepare_data.py` accepts, and the checks that can refuse it before any work is done."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from app.cli import UsageError  # noqa: F401 (app/prepare raises it from here)
from app.choices import MAX_SEED, FormatName
from app.folders import DATASET_DICT_FILE, STATS_FILE, TOKENIZER_FOLDER, real_folder, unusable_folder
from app.hub import missing_folder_problem


@dataclass
class PrepareArgs:
    """Turn raw text, prompt/response pairs, chats or source/target pairs into token rows for training."""

    input: list[str] = field(default_factory=list)
    """Required (here or in --config): files (.txt .py .md .jsonl .json .parquet .csv), folders of them (searched
    recursively), a folder written by `datasets.save_to_disk`, or a Hugging Face dataset name. Several may be
    given."""
    output_dir: str = ""
    """Required (here or in --config): the folder to create, a DatasetDict (train, validation) of token rows,
    `tokenizer/` and `stats.json`."""
    tokenizer: str | None = None
    """Hugging Face tokenizer name or local folder (the tokenizer of the model you will train)."""
    vocab_size: int | None = None
    """Instead of --tokenizer: train a byte-fallback SentencePiece BPE tokenizer of this size on the training split."""
    block_size: int | None = None
    """Tokens per training row (default 2048). Raw text: documents are concatenated and cut into blocks of exactly
    this length. Supervised data: whole examples are packed into blocks of this length; with --packing false, it is
    the most tokens of one example."""
    val_fraction: float = 0.05
    """Fraction of documents (or examples) held out for validation, whole, never split; raw text of too few documents
    for that (whole ones would hold out more than twice the fraction: one book, three files) holds out the last
    val_fraction of each document instead. Ignored for inputs that bring their own validation split. 0 writes an empty
    validation split."""
    text_field: str | None = None
    """Column holding the text in .jsonl/.json/.parquet/.csv files and in datasets (default `text`)."""
    split_lines: bool | None = None
    """Treat every line of a .txt file as its own document (default: one document per file)."""
    document_masking: bool | None = None
    """Raw text: each document in a block attends only to itself and restarts its positions, as Llama 3 was
    pre-trained (format text_documents; default false: a block's documents read the ones before them, as GPT-2's
    blocks do). A document's first token is then not trained: nothing of it precedes it."""
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
    """Replace an earlier output (a folder with stats.json and dataset_dict.json), only after the new one is
    completely written; any other folder that is not empty is refused, not deleted."""
    trust_remote_code: bool = False
    """Allow a --tokenizer whose repository ships Python code to run it. Only for repositories you trust."""
    prompt_field: str | None = None
    """Supervised fine-tuning: the field holding each example's prompt (the user's turn); needs --response_field."""
    response_field: str | None = None
    """Supervised fine-tuning: the field holding the response to train on (the assistant's turn)."""
    system_field: str | None = None
    """With --prompt_field: a field holding a system message (rows where it is empty get none)."""
    input_field: str | None = None
    """With --prompt_field (Alpaca style): a field appended to the prompt after a blank line, when not empty."""
    messages_field: str | None = None
    """Supervised fine-tuning on chats: the field holding a list of {role, content} messages (or ShareGPT's {from,
    value}); every assistant message is trained, its tool calls included (OpenAI's `tool_calls`, with the row's
    `tools`)."""
    tools_field: str | None = None
    """With --messages_field: the field holding the tools each chat offers (OpenAI's JSON schemas, or their JSON
    text), which the chat template writes; default: `tools`, where the input has such a field."""
    chat_template: str | None = None
    """A Jinja chat template file to render examples with, instead of the tokenizer's own (or the default one for a
    tokenizer without a template). It is saved with the tokenizer."""
    train_on_prompt: bool | None = None
    """Supervised: train on every token (prompts and system messages too), not only on the responses (default
    false)."""
    packing: bool | None = None
    """Supervised: pack whole examples into rows of --block_size (position_ids restart for each example; the
    default); false writes one unpadded example per row, padded per batch at training time."""
    too_long: Literal["truncate", "drop"] | None = None
    """Supervised and source/target: what to do with an example longer than --block_size (or
    --max_source_length/--max_target_length): cut its end (the default), or leave it out. Either is counted in
    stats.json."""
    source_field: str | None = None
    """Encoder-decoder data: the field holding the source text (the encoder's input); needs --target_field."""
    target_field: str | None = None
    """Encoder-decoder data: the field holding the target text (what the decoder learns to write)."""
    max_source_length: int | None = None
    """Encoder-decoder data: most tokens of a source, its EOS included (default 1024)."""
    max_target_length: int | None = None
    """Encoder-decoder data: most tokens of a target, its EOS included (default 128)."""
    empty_examples: Literal["refuse", "skip"] | None = None
    """Prompt/response and source/target data: a row whose prompt, response, source or target is empty, blank or
    missing is refused, naming it (the default), or skipped and counted (stats.json's inputs and
    empty_examples_skipped): a WikiHow CSV has articles without text."""


SUPPORTED_SUFFIXES = (".txt", ".py", ".md", ".jsonl", ".json", ".parquet", ".csv")
MIN_TRAINED_VOCAB = 256 + 3 + 1
"""A trained tokenizer holds 256 byte pieces and <unk> <s> </s> before it can learn a single character."""
MAX_TRAINED_VOCAB = 2**20
"""Four times Gemma's 262,144 tokens; SentencePiece's trainer ended in a traceback past 2**31 - 1."""


RecordShape = Literal["text", "prompt/response", "messages", "source/target"]
SHAPE_FIELDS: dict[RecordShape, tuple[str, ...]] = {
    "prompt/response": ("prompt_field", "response_field"),
    "messages": ("messages_field",),
    "source/target": ("source_field", "target_field"),
}
"""The options that choose a record shape; all of a shape's options are required together."""
SHAPE_NAMES: dict[RecordShape, str] = {
    "text": "raw text",
    "prompt/response": "--prompt_field/--response_field data",
    "messages": "--messages_field data",
    "source/target": "--source_field/--target_field data",
}
SUPERVISED: tuple[RecordShape, ...] = ("prompt/response", "messages")
OPTION_SHAPES: dict[str, tuple[RecordShape, ...]] = {
    "text_field": ("text",),
    "split_lines": ("text",),
    "document_masking": ("text",),
    "block_size": ("text", *SUPERVISED),
    "system_field": ("prompt/response",),
    "input_field": ("prompt/response",),
    "tools_field": ("messages",),
    "chat_template": SUPERVISED,
    "train_on_prompt": SUPERVISED,
    "packing": SUPERVISED,
    "too_long": (*SUPERVISED, "source/target"),
    "max_source_length": ("source/target",),
    "max_target_length": ("source/target",),
    "empty_examples": ("prompt/response", "source/target"),
}
"""Options that mean something only for some record shapes: given for another, they are refused."""
SHAPE_OPTION_DEFAULTS = {"text_field": "text", "split_lines": False, "document_masking": False, "block_size": 2048,
                         "train_on_prompt": False, "packing": True, "too_long": "truncate", "max_source_length": 1024,
                         "max_target_length": 128, "empty_examples": "refuse"}
"""Their values when not given, filled in once they are checked (with_defaults): a default of the dataclass could
not tell `--packing true --block_size 2048`, copied from a supervised command onto source/target data, from
nothing given, and it was accepted without a word."""


def record_shape(args: PrepareArgs) -> RecordShape:
    """What one input record is, chosen by which field options are given (raw text when none is)."""
    given = _shapes_given(args)
    return given[0] if given else "text"


def _shapes_given(args: PrepareArgs) -> list[RecordShape]:
    return [shape for shape, names in SHAPE_FIELDS.items() if any(getattr(args, n) is not None for n in names)]


def data_format(args: PrepareArgs) -> FormatName:
    """The `format` of stats.json: what the rows hold, so that training knows how to batch them."""
    shape = record_shape(args)
    if shape in SUPERVISED:
        return "supervised_packed" if args.packing else "supervised_padded"
    if shape == "source/target":
        return "seq2seq"
    return "text_documents" if args.document_masking else "text"


def checked_args(args: PrepareArgs) -> PrepareArgs:
    """Refuse arguments that cannot work, cheaply and before reading any data; the arguments with the defaults of
    the options left out."""
    check_record_options(args)
    args = with_defaults(args)
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
    if args.vocab_size is not None and args.vocab_size > MAX_TRAINED_VOCAB:
        raise UsageError(f"--vocab_size {args.vocab_size} is too large: use at most {MAX_TRAINED_VOCAB}")
    for name in ("block_size", "max_source_length", "max_target_length"):
        if getattr(args, name) < 2:
            raise UsageError(f"--{name} {getattr(args, name)} must be at least 2")
    if not 0 <= args.val_fraction < 1:
        raise UsageError(f"--val_fraction {args.val_fraction} must be in [0, 1)")
    if args.num_proc < 1:
        raise UsageError(f"--num_proc {args.num_proc} must be at least 1")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed {args.seed} must be between 0 and {MAX_SEED}")
    for path in args.input:
        check_input_path(path)
    missing = args.tokenizer and missing_folder_problem("--tokenizer", args.tokenizer)
    if missing:
        raise UsageError(missing)
    check_output_dir(Path(args.output_dir), args.overwrite, [Path(p) for p in args.input if Path(p).exists()])
    return args


def with_defaults(args: PrepareArgs) -> PrepareArgs:
    """The options left out (None) at their defaults."""
    left_out = {name: value for name, value in SHAPE_OPTION_DEFAULTS.items() if getattr(args, name) is None}
    return replace(args, **left_out)


def check_record_options(args: PrepareArgs) -> None:
    """One record shape at a time, all of its field options, and no option that only another shape reads."""
    shapes = _shapes_given(args)
    if len(shapes) > 1:
        given = " and ".join("/".join(f"--{n}" for n in SHAPE_FIELDS[shape]) for shape in shapes)
        raise UsageError(f"{given}: give the fields of one kind of record only")
    shape = record_shape(args)
    for name in SHAPE_FIELDS.get(shape, ()):
        if not getattr(args, name):
            raise UsageError(f"--{name} is missing: {SHAPE_NAMES[shape]} needs the field that holds it")
    for name, shapes_reading_it in OPTION_SHAPES.items():
        if shape not in shapes_reading_it and getattr(args, name) is not None:
            readers = ", ".join(SHAPE_NAMES[s] for s in shapes_reading_it)
            raise UsageError(f"--{name} applies only to {readers}, not to {SHAPE_NAMES[shape]}; remove it")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise UsageError(f"--chat_template {args.chat_template}: no such file (give a Jinja template file)")



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
    if not (local.is_file() or local.is_dir()):  # /dev/stdin, a pipe: read once, and whole, it may never end
        raise UsageError(f"--input {path}: is a pipe or a device, not a file or folder; write it to a file first")
    if local.is_file() and local.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise UsageError(f"--input {path}: unsupported file type; use one of {', '.join(SUPPORTED_SUFFIXES)}")


def check_output_dir(output_dir: Path, overwrite: bool, local_inputs: list[Path]) -> None:
    """Never write over data unless asked, never replace a folder that is not an earlier output (--overwrite would
    delete it whole), and never write over (or inside) the inputs themselves."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output_dir {output_dir}: exists and is not a folder")
    unusable = unusable_folder(real_folder(output_dir).absolute().parent)  # staged beside it (a link's target)
    if unusable:
        raise UsageError(f"--output_dir {output_dir}: {unusable}; choose a folder you can write to")
    if output_dir.is_dir() and any(output_dir.iterdir()):
        if not overwrite:
            raise UsageError(f"--output_dir {output_dir}: already holds data; choose another folder or add --overwrite")
        check_replaceable(output_dir)
    target = output_dir.resolve()
    for source in local_inputs:
        source = source.resolve()
        if target == source or target in source.parents or source in target.parents:
            raise UsageError(f"--output_dir {output_dir} overlaps --input {source}; write the output elsewhere")


PREPARED_FILES = (STATS_FILE, DATASET_DICT_FILE)
"""What every folder prepare_data.py writes holds: --overwrite replaces only such a folder (or an empty one)."""


def check_replaceable(output_dir: Path) -> None:
    """Refuse to replace a folder that holds something other than an earlier prepare_data.py output, or more than
    it: --overwrite replaces the whole folder, and a train.py run given it as --out_dir (its checkpoints), or the
    user's notes beside the data, went with it."""
    if any(output_dir.iterdir()) and not all((output_dir / name).is_file() for name in PREPARED_FILES):
        raise UsageError(f"--output_dir {output_dir}: --overwrite replaces only an empty folder or an earlier "
                         f"prepare_data.py output (with {' and '.join(PREPARED_FILES)}), and this is neither; "
                         "choose another folder")
    prepared = prepared_entries(output_dir)
    others = sorted(path.name for path in output_dir.iterdir() if path.name not in prepared)
    if others:
        raise UsageError(f"--output_dir {output_dir}: --overwrite would also delete {', '.join(others[:5])}"
                         f"{' and more' if len(others) > 5 else ''}, which prepare_data.py did not write; move "
                         "them out of it, or choose another folder")


def prepared_entries(output_dir: Path) -> set[str]:
    """The names prepare_data.py writes into its output: its files, the tokenizer and a folder per split."""
    try:
        splits = json.loads((output_dir / DATASET_DICT_FILE).read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        splits = []
    return {*PREPARED_FILES, TOKENIZER_FOLDER, *map(str, splits)}


def useful_processes(rows: int, num_proc: int) -> int | None:
    """`datasets` refuses more processes than rows, and one process is spelled None."""
    processes = min(num_proc, rows)
    return processes if processes > 1 else None
