"""Read every kind of input into one table of records, keeping any validation split it brings.

Raw text becomes documents (column `text`); the other record shapes (prompt/response, messages, source/target) are
turned into their records by their own module, which validates every row of an input as it is read.
"""

from __future__ import annotations

import codecs
import io
import json
import logging
import os
import re
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from itertools import islice
from pathlib import Path

import datasets
import yaml
from datasets import Dataset, DatasetDict
from datasets.data_files import get_data_patterns, resolve_pattern
from datasets.packaged_modules.json.json import JsonConfig
from datasets.table import CastError
from huggingface_hub import DatasetCard, constants

from app.cli import counted, first_line
from app.folders import DATASET_DICT_FILE
from app.hub import dataset_card_configs, go_offline, hub_reachable, is_hub_id, quiet_hub
from app.prepare.args import SHAPE_FIELDS, SHAPE_NAMES, SUPPORTED_SUFFIXES, PrepareArgs, UsageError, record_shape
from app.prepare.workspace import arrow_file, cache_dir
from app.stopping import exhausted

STDLIB_CORPUS = ("json", "email", "http", "urllib", "logging", "html", "xml", "concurrent", "wsgiref", "collections")
"""Standard-library packages whose sources (about 1.5 MB of Python) make a corpus every machine already has."""

VALIDATION_SPLIT_NAMES = ("validation", "valid", "val", "dev")
BUILDER_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""Everything else we accept (.txt .py .md) is plain text, read with the `text` builder."""
PACKED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".tar", ".7z")
"""Compressed data, which prepare_data.py does not read: in a folder, it is refused rather than passed over (three
`shard-N.jsonl.gz` beside a README.md made a corpus of the README alone); is_packed_data."""
ToRecords = Callable[[Dataset, str], Dataset]
"""Turns the table of one input (named by the second argument) into records of the chosen shape, or refuses it."""


def stdlib_corpus_paths(packages: tuple[str, ...] = STDLIB_CORPUS) -> list[str]:
    """Folders of the running interpreter's own standard library, usable as `--input` on any fresh machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [str(root / name) for name in packages if (root / name).is_dir()]


def document_texts(documents: Dataset) -> Iterator[str]:
    """The text of every document, to train a tokenizer on (--vocab_size)."""
    for batch in documents.iter(batch_size=1000):
        yield from batch["text"]


@dataclass
class Documents:
    """The documents of all inputs: a pool to split by --val_fraction, and inputs that brought their own split."""

    pool: Dataset | None
    own_train: Dataset | None
    own_validation: Dataset | None
    description: list[str]
    empty_examples_skipped: int = 0
    """Rows left out by --empty_examples skip, also said in `description`."""


def read_documents(args: PrepareArgs, to_records: ToRecords | None = None) -> Documents:
    """Read every --input, keeping apart the validation split an input brings with it.

    `to_records` makes the records of a supervised or source/target shape; by default, each input's --text_field
    becomes the documents' `text`.
    """
    to_records = to_records or (lambda table, source: _text_column(table, args.text_field, source))
    if args.split_lines and not any(_holds_text_files(Path(source)) for source in args.input):
        raise UsageError("--split_lines true makes each line of a .txt file a document, and no --input holds a .txt "
                         "file; drop it")
    refuse_overlapping_inputs(args.input)
    if args.text_field not in (None, "text") and all(_only_plain_text(Path(source)) for source in args.input):
        raise UsageError(f"--text_field {args.text_field} names a field of .jsonl/.json/.parquet/.csv files and "
                         "datasets, and every --input is plain-text files, read whole; drop it")
    pool, own_train, own_validation, description = [], [], [], []
    skipped = [0]

    def records_counting_skipped(table: Dataset, source: str) -> Dataset:
        records = to_records(table, source)
        skipped[0] += len(table) - len(records)
        return records

    for source in args.input:
        before = skipped[0]
        train, validation, what = read_source(source, args, records_counting_skipped)
        left_out = skipped[0] - before
        description.append(f"{what.removesuffix(')')}; {left_out:,} empty rows skipped)" if left_out else what)
        if validation is None:
            pool.append(train)
        else:
            own_train.append(train)
            own_validation.append(validation)
    return Documents(_concatenate(pool), _concatenate(own_train), _concatenate(own_validation), description,
                     skipped[0])


def refuse_overlapping_inputs(inputs: list[str]) -> None:
    """Two --input that hold the same file (a folder and a file in it, one path given twice): its records were read,
    and trained on, twice."""
    seen: dict[str, str] = {}
    for source in inputs:
        path = Path(source)
        if not path.exists() or path.is_dir() and _is_saved_dataset(path):
            continue
        for file in _supported_files(path):
            real = os.path.realpath(file)
            if real in seen:
                raise UsageError(f"--input {source} holds {real} twice (through a link); give each file once"
                                 if seen[real] == source else f"--input {seen[real]} and --input {source} both hold "
                                 f"{file}, which would be read twice; give each file once")
            seen[real] = source


def _concatenate(parts: list[Dataset]) -> Dataset | None:
    """The records of several inputs as one dataset; a part whose columns the reader typed otherwise (pandas reads a
    .csv's text as large_string, the JSON and text readers as string) is cast to the first part's types: they
    could not be joined, and a .csv beside any other raw-text input ended in a traceback."""
    if not parts:
        return None
    first = parts[0].features
    return datasets.concatenate_datasets([part if part.features == first else part.cast(first, **arrow_file("cast"))
                                          for part in parts])


def read_source(source: str, args: PrepareArgs, to_records: ToRecords) -> tuple[Dataset, Dataset | None, str]:
    """One --input as (records, its own validation records or None, a description for stats.json)."""
    path = Path(source)
    if not path.exists():
        return _from_dataset(_load_hub(source, args), source, args, to_records, split_applied=args.split is not None)
    if args.dataset_config is not None:
        raise UsageError(f"--dataset_config {args.dataset_config} applies to a Hugging Face dataset, not to --input "
                         f"{source}")
    with quiet_progress():
        if path.is_dir() and _is_saved_dataset(path):
            return _from_dataset(datasets.load_from_disk(str(path)), source, args, to_records)
        if args.split is not None:
            raise UsageError(
                f"--split {args.split} applies to a Hugging Face or saved dataset, not to --input {source}"
            )
        splits = _split_layout(path) if path.is_dir() else None
        if splits:
            return _read_split_layout(splits, source, args, to_records)
        files = _supported_files(path)
        cards = [file.name for file in _folder_files(path) if is_dataset_card(file) and file not in files] \
            if path.is_dir() else []
        said = f"; not read: {', '.join(cards)}, a dataset card" if cards else ""
        return _read_local(files, source, args, to_records), None, f"{source} ({counted(len(files), 'file')}{said})"


def _read_local(files: list[Path], source: str, args: PrepareArgs, to_records: ToRecords) -> Dataset:
    groups = _group_by_builder(files, args)
    return _concatenate([_read_files(group, builder, source, args, to_records) for builder, group in groups.items()])


def _split_layout(folder: Path) -> dict[str, list[Path]] | None:
    """The files of each split of a folder laid out as a Hugging Face dataset repository (`data/train-*.parquet`,
    `test.jsonl`, `validation/`), found as `load_dataset` finds them; None for a folder without a train split and
    another, or whose splits are not all data files (a code corpus's `test/` folder is code). Read as one pool, such
    a folder trained on its test split (and on its dataset card)."""
    try:
        patterns = get_data_patterns(str(folder))
    except Exception:  # noqa: BLE001 (datasets' EmptyDatasetError and the like: no layout it knows)
        return None
    splits = {str(split): sorted({Path(file) for pattern in found for file in _matching(pattern, folder)})
              for split, found in patterns.items()}
    suffixes = {file.suffix.lower() for files in splits.values() for file in files}
    if "train" not in splits or len(splits) == 1 or not (suffixes <= BUILDER_BY_SUFFIX.keys() or suffixes == {".txt"}):
        return None  # (train.txt, validation.txt and test.txt were pooled, and the test split trained on)
    return splits


def _matching(pattern: str, folder: Path) -> list[str]:
    """The files of one of datasets' split patterns (it tries several per split; most match nothing)."""
    try:
        return resolve_pattern(pattern, str(folder))
    except FileNotFoundError:
        return []


def _read_split_layout(splits: dict[str, list[Path]], source: str, args: PrepareArgs,
                       to_records: ToRecords) -> tuple[Dataset, Dataset | None, str]:
    """Train from the train split's files, and the validation split's as the input's own validation; other splits
    (test), and files of no split, are not read, and said."""
    checked = {split: _readable(files, Path(source)) for split, files in splits.items()}
    in_splits = {os.path.realpath(file) for files in checked.values() for file in files}
    outside = [file.name for file in _supported_files(Path(source)) if os.path.realpath(file) not in in_splits]
    validation_name = next((name for name in VALIDATION_SPLIT_NAMES if name in checked), None)
    train = _read_local(checked["train"], source, args, to_records)
    validation = (_read_local(checked[validation_name], f"{source} ({validation_name} split)", args, to_records)
                  if validation_name else None)
    unread = [f"its {name} split" for name in checked if name not in ("train", validation_name)] + outside
    return train, validation, (f"{source} (train: {counted(len(checked['train']), 'file')}"
                               + (f", own validation: {counted(len(checked[validation_name]), 'file')}"
                                  if validation_name else "")
                               + (f"; not read: {', '.join(unread)}" if unread else "") + ")")


@contextmanager
def quiet_progress() -> Iterator[None]:
    """No progress bars while reading local inputs: it is quick, and a refusal must stay a single line on stderr
    (the JSON reader also logs the error it raises, "Failed to load JSON from file ...", before ours says it)."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    readers = [logging.getLogger(name) for name in READER_LOGGERS]
    levels = [reader.level for reader in readers]
    for reader in readers:
        reader.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for reader, level in zip(readers, levels):
            reader.setLevel(level)
        if was_enabled:
            datasets.enable_progress_bars()


READER_LOGGERS = tuple(f"datasets.packaged_modules.{name}.{name}" for name in ("json", "csv", "parquet"))
"""The readers that log the error they raise ("Failed to read file ...") before ours says it."""


def _holds_text_files(path: Path) -> bool:
    """Whether a local --input is or holds .txt files (which --split_lines reads line by line)."""
    if not path.exists() or path.is_dir() and _is_saved_dataset(path):
        return False
    return any(file.suffix.lower() == ".txt" for file in _supported_files(path))


def _only_plain_text(path: Path) -> bool:
    """Whether a local --input is or holds only plain-text files (.txt .py .md), which have no fields."""
    if not path.exists() or path.is_dir() and _is_saved_dataset(path):
        return False
    return all(file.suffix.lower() not in BUILDER_BY_SUFFIX for file in _supported_files(path))


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / DATASET_DICT_FILE).is_file() or (folder / "state.json").is_file()


def _supported_files(path: Path) -> list[Path]:
    """The file itself, or every supported file below a folder, sorted (_folder_files, _readable)."""
    if path.is_file():
        return [path]
    files = _readable(_folder_files(path), path)
    if not files:
        raise UsageError(f"--input {path}: folder holds no {'/'.join(SUPPORTED_SUFFIXES)} files")
    return files


def _folder_files(folder: Path) -> list[Path]:
    """Every file below `folder`, through links to folders (each folder once: Path.rglob passed over linked folders
    without a word), hidden files and folders, caches, and datasets prepared or saved there skipped (a prepared
    folder's stats.json and tokenizer files were read as records)."""
    files, seen = [], set()
    for root, folders, names in os.walk(folder, followlinks=True):
        if os.path.realpath(root) in seen:
            folders[:] = []
            continue
        seen.add(os.path.realpath(root))
        folders[:] = [name for name in folders if not name.startswith(".") and name != "__pycache__"
                      and not _is_saved_dataset(Path(root, name))]
        files += [Path(root, name) for name in names if not name.startswith(".")]
    return sorted(files)


def _readable(files: list[Path], folder: Path) -> list[Path]:
    """The files of `files` that prepare_data.py reads, but a dataset card (README.md) beside data files, which
    became a document; a broken link, a pipe or a device (reading one hung), compressed data, or a dataset card
    alone beside files not read (its data zipped: the card was the corpus) is refused in one line."""
    broken = [file for file in files if not file.exists()]
    special = [file for file in files if file.exists() and not file.is_file()]
    packed = [file for file in files if is_packed_data(file)]
    if broken or special or packed:
        raise UsageError(f"--input {folder}: " + (
            f"{_names(broken)}: a broken link; fix or remove it" if broken else
            f"{_names(special)}: a pipe or a device, not a file; write it to a file or leave it out" if special else
            f"holds compressed or archived files, which prepare_data.py does not read ({_names(packed)}); "
            "decompress them (gunzip, zstd -d) or leave them out"))
    readable = [file for file in files if file.suffix.lower() in SUPPORTED_SUFFIXES]
    if any(file.suffix.lower() in BUILDER_BY_SUFFIX for file in readable):
        return [file for file in readable if not is_dataset_card(file)]
    unread = [file for file in files if file not in readable]
    if readable and all(map(is_dataset_card, readable)) and unread:
        raise UsageError(f"--input {folder}: holds a dataset card ({_names(readable)}) and no file prepare_data.py "
                         f"reads beside it ({_names(unread)}); give the data as {'/'.join(SUPPORTED_SUFFIXES)} files "
                         "(decompress or unpack it)")
    return readable


def is_packed_data(file: Path) -> bool:
    """Compressed data (`shard-1.jsonl.gz`, `part.csv.zst`) or an Arrow file; an archive of anything else (a test
    fixture's `.zip` in a code corpus) is no data, and passed over as other files are."""
    suffixes = [suffix.lower() for suffix in file.suffixes]
    return bool(suffixes) and (suffixes[-1] == ".arrow" or suffixes[-1] in PACKED_SUFFIXES
                               and len(suffixes) > 1 and suffixes[-2] in SUPPORTED_SUFFIXES)


def is_dataset_card(file: Path) -> bool:
    return file.suffix.lower() == ".md" and file.stem.lower() == "readme"


def _names(files: list[Path], shown: int = 3) -> str:
    return ", ".join(str(file) for file in files[:shown]) + (f" and {len(files) - shown} more" if len(files) > shown
                                                             else "")


def _group_by_builder(files: list[Path], args: PrepareArgs) -> dict[tuple[str, str | None], list[str]]:
    """Group files by the `datasets` builder that reads them; .txt follows --split_lines, .py/.md are whole files."""
    groups: dict[tuple[str, str | None], list[str]] = {}
    for file in files:
        suffix = file.suffix.lower()
        if suffix in BUILDER_BY_SUFFIX:
            key = (BUILDER_BY_SUFFIX[suffix], None)
        else:
            key = ("text", "line" if args.split_lines and suffix == ".txt" else "document")
        groups.setdefault(key, []).append(str(file))
    return groups


def _read_files(
    files: list[str], builder: tuple[str, str | None], source: str, args: PrepareArgs, to_records: ToRecords
) -> Dataset:
    name, sample_by = builder
    shape = record_shape(args)
    if name == "text" and shape != "text":
        raise UsageError(
            f"--input {source}: holds plain-text files ({files[0]}); {SHAPE_NAMES[shape]} is read from "
            ".jsonl/.json/.parquet/.csv files or datasets"
        )
    options = ({"sample_by": sample_by, "encoding": "utf-8-sig"} if name == "text"  # a BOM is no text to train on
               else csv_as_written(files) if name == "csv" else {})
    if name == "json":  # rows whose keys look like an agent's trace to datasets 5 ("source", "model", "system_prompt"
        options["parse_agent_traces"] = False  # beside "messages") needed a package of its own: the file was refused
        check_json_kinds(files, fields_read(args), source)
        note_whole_arrays(files)
    try:
        dataset = datasets.load_dataset(name, data_files=files, split="train", cache_dir=cache_dir(), **options)
    except Exception as error:  # datasets wraps parse errors of any kind; the user needs the file and the reason
        if exhausted(error):  # a full disk or a refused thread, not the input: app/stopping.py says it
            raise
        where = (empty_file(files) or not_utf8(files) or (_bad_json_line(files) if name == "json" else None)
                 or columns_problem(error))
        raise UsageError(f"--input {source}: could not read it as {name}: {where or first_line(error)}") from error
    return _text_column(dataset, "text", source) if name == "text" else to_records(dataset, source)


def columns_problem(error: BaseException) -> str | None:
    """The reason datasets' "An error occurred while generating the dataset" wraps when files' columns differ: a
    file of other columns than the first (its own log line, which named it, said so on a line of its own)."""
    cause = error.__cause__
    if isinstance(cause, CastError):
        return (f"its files do not all hold the same columns ({cause.details()} in a file after the first); give "
                "files of one layout, or each layout as an --input of its own")
    return None


def fields_read(args: PrepareArgs) -> dict[str, str]:
    """The options naming the fields prepare_data.py reads from a record, and those fields."""
    shape = record_shape(args)
    if shape == "text":
        return {"text_field": args.text_field or "text"}
    names = (*SHAPE_FIELDS[shape], "input_field", "system_field")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


JSON_KIND_CHANGE = re.compile(r"Column\(/([^)]*)\) changed from (\w+) to (\w+) in row (\d+)")
JSON_KINDS = {"string": "text", "object": "an object", "number": "a number", "array": "a list",
              "boolean": "true or false"}
JSON_BLOCK_BYTES = 16 << 20
MESSAGE_TEXT = ("role", "content")


WHOLE_ARRAY_NOTE_BYTES = 100 << 20


def is_json_array(file: str) -> bool:
    with open(file, "rb") as handle:
        return handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def note_whole_arrays(files: list[str]) -> None:
    """A note for a large file of one JSON array: datasets reads it whole (a 284 MB array took 1.94 GB of memory,
    the same records as JSON Lines 0.73 GB), where JSON Lines are read in pieces."""
    for file in files:
        size = os.path.getsize(file)
        if size > WHOLE_ARRAY_NOTE_BYTES and is_json_array(file):
            print(f"prepare_data.py: note: {file} is one JSON array of {size / 2**20:,.0f} MB, read whole (about five "
                  f"times its size in memory); as JSON Lines it is read in pieces: jq -c '.[]' {file} > "
                  f"{Path(file).with_suffix('.jsonl')}", flush=True)


def json_row(file: str, index: int) -> dict:
    """Row `index` (from 0) of a JSON Lines file, counting its lines that hold anything, as pyarrow counts them."""
    with open(file, encoding="utf-8-sig") as lines:
        return json.loads(next(islice((line for line in lines if line.strip()), index, None)))


def kept_kind(kind: Any) -> Any:
    """The type every later value of a field must have, or None: text, a number, true or false, or a list of them;
    of a chat's messages, the role and content only, as text. Their other keys are not checked: a key null in the
    first rows (`"name": null`) and text later is a chat as good as any, which that type would refuse."""
    import pyarrow as pa

    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    inner = kind.value_type if is_list else kind
    if not pa.types.is_nested(inner):
        return None if pa.types.is_null(inner) else kind
    if is_list and pa.types.is_struct(inner) and all(
            inner.get_field_index(key) >= 0 and pa.types.is_string(inner.field(key).type) for key in MESSAGE_TEXT):
        return pa.list_(pa.struct([(key, pa.string()) for key in MESSAGE_TEXT]))
    return None


def first_rows_schema(file: str) -> Any:
    """The types pyarrow reads from the rows datasets typed a JSON Lines file by: its first chunk, 10 MB and the rest
    of the line it cut (a larger block missed a change between 10 and 16 MB; a smaller one, in a first line longer
    than it, stopped the check)."""
    import pyarrow.json as paj

    with open(file, "rb") as lines:
        first_chunk = lines.read(JsonConfig.chunksize) + lines.readline()
    whole = paj.ReadOptions(block_size=len(first_chunk) + 1)  # one block: any line of it fits
    return paj.read_json(io.BytesIO(first_chunk), read_options=whole).schema


def check_json_kinds(files: list[str], fields: dict[str, str], source: str) -> None:
    """Refuse a field read from JSON Lines whose values change kind after the first rows: datasets takes a column's
    type from the first rows it reads and turns later values into it, so an object or a number in a text field (in
    a later file, or past the first 10 MB of one) was trained as its JSON text (`{"title": ...}`, `987654321`),
    where the same row first in the file was refused. Each file is streamed through pyarrow's JSON reader with the
    first file's types for the fields read (`kept_kind`), which stops at the first value of another kind; the types
    are those of at most the rows datasets typed (its first chunk: 16 MB missed a change between 10 and 16). A JSON
    array file is read whole by datasets, as one table, and not checked here; neither is a problem the reader meets
    first (a bad line: datasets' reading says it)."""
    import pyarrow as pa
    import pyarrow.json as paj

    schema = None
    for file in files:
        if is_json_array(file):
            continue
        if schema is None:
            try:  # a change within the first rows: datasets' first rows, which the records' checks refuse
                inferred = first_rows_schema(file)
            except pa.ArrowInvalid:
                return
            schema = pa.schema([pa.field(name, kind) for name in fields.values() if name in inferred.names
                                and (kind := kept_kind(inferred.field(name).type)) is not None])
            if not len(schema):
                return
        rows = 0
        try:
            reader = paj.open_json(file, read_options=paj.ReadOptions(block_size=JSON_BLOCK_BYTES),
                                   parse_options=paj.ParseOptions(explicit_schema=schema,
                                                                  unexpected_field_behavior="ignore"))
            for batch in reader:
                rows += batch.num_rows
        except pa.ArrowInvalid as error:
            change = JSON_KIND_CHANGE.search(str(error))
            if change is None:
                return
            path, was, now, row = change.groups()
            field, index = path.split("/")[0], rows + int(row)
            option = next(option for option, name in fields.items() if name == field)  # the schema's fields only
            try:
                value = json_row(file, index).get(field)
            except (ValueError, StopIteration, AttributeError):  # a line that is no JSON object: datasets says it
                return
            item = path.split("/")[-1]
            within = (f" as a message's {item}" if item in MESSAGE_TEXT else " in its list" if path != field else "")
            if not within:
                Row(fields, index, file).text(option, value)  # as in the first rows: "holds int 12345, not text"
            raise UsageError(f"--{option} {field}: row {index + 1} of {file} holds {JSON_KINDS.get(now, now)}{within} "
                             f"where the rows before (of --input {source}) hold {JSON_KINDS.get(was, was)}: give every "
                             "row the same kind there, or leave such rows out") from None


def csv_as_written(files: list[str]) -> dict:
    """The CSV reader's options for every cell as the text it holds: pandas typed a column of numbers as int (the
    answers of a maths task were refused as "holds int 2, not text") and read "None", "null" or "N/A" as a missing
    value (raw text dropped those documents; a response "N/A" was refused as empty). The columns are the first
    file's header's, as pandas names them (an empty one, as `DataFrame.to_csv` writes for the index, is
    `Unnamed: 0`)."""
    import pandas

    try:
        header = list(pandas.read_csv(files[0], nrows=0, encoding="utf-8-sig").columns)
    except (OSError, UnicodeDecodeError, ValueError):  # pandas' ParserError and EmptyDataError are ValueErrors
        return {}  # the reader's own error says why
    return {"keep_default_na": False, "na_filter": False,
            "features": datasets.Features({column: datasets.Value("string") for column in header})}


def empty_file(files: Iterable[str | Path]) -> str | None:
    """The first file without a record (nothing but white space, or a CSV header alone): the JSON reader said only
    "StopIteration", the CSV reader 'Instruction "train" corresponds to no data!'."""
    for file in files:
        held = Path(file).read_bytes().strip() if os.path.getsize(file) < 1 << 20 else b"-\n-"
        if not held:
            return f"{file} is empty; leave it out"
        if Path(file).suffix.lower() == ".csv" and b"\n" not in held:
            return f"{file} holds a header and no rows; leave it out"
    return None


def not_utf8(files: Iterable[str | Path]) -> str | None:
    """The first file that is not UTF-8 text, and where (read a MiB at a time; Parquet files hold typed columns and
    are skipped): the text reader said only "An error occurred while generating the dataset", and the JSON reader
    let the bytes through to a UnicodeDecodeError traceback at their first use."""
    for file in files:
        if str(file).lower().endswith(".parquet"):
            continue
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as error:
                    return (f"{file} is not UTF-8 text (byte {offset + error.start}: {error.reason}); "
                            f"{conversion(chunk if offset == 0 else b'')} or leave it out")
                offset += len(chunk)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError as error:
                return (f"{file} is not UTF-8 text (it ends within a character: {error.reason}); convert it or "
                        "leave it out")
    return None


UNICODE_MARKS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
                 (codecs.BOM_UTF16_BE, "UTF-16"))


def conversion(start: bytes) -> str:
    """How to convert a file that is not UTF-8, from its first bytes: a UTF-16 one (Notepad's "Unicode", PowerShell
    5's `>`) converted as latin1, which the advice named for every file, became NULs and mojibake that prepared and
    trained without a word."""
    named = next((name for mark, name in UNICODE_MARKS if start.startswith(mark)), None)
    if named is None and b"\0" in start[:4096]:
        named = "UTF-16"  # text with NULs between its letters, without a byte-order mark
    if named:
        return f"it looks {named}: convert it (iconv -f {named} -t UTF-8)"
    return "convert it from its encoding (iconv -f ENCODING -t UTF-8, ENCODING cp1252, gbk or shift_jis, for example)"


def local_files(inputs: list[str]) -> Iterator[Path]:
    """The files of the local --input paths, as they are read (Hub names and saved datasets left out)."""
    for source in inputs:
        path = Path(source)
        if path.is_file() or (path.is_dir() and not _is_saved_dataset(path)):
            yield from _supported_files(path)


def _bad_json_line(files: list[str]) -> str | None:
    """The file, line and reason of the first record that is not a JSON object, found again after `datasets` failed:
    its reader names only a byte position in a block ("Expected object or value at position 25"). JSON Lines are
    read a line at a time (a corpus may be many gigabytes); a single JSON document is parsed whole, as datasets does."""
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as handle:
            first = next((line for line in handle if line.strip()), "")
        if file.lower().endswith(".json") and not _is_json_object(first):
            try:
                json.loads(Path(file).read_text(encoding="utf-8", errors="replace"))
                continue  # one JSON document: its shape, not its syntax, is what `datasets` refused
            except json.JSONDecodeError as error:
                return f"{file} line {error.lineno}, column {error.colno}: {error.msg}"
        with open(file, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as error:
                    return f"{file} line {number}, column {error.colno}: {error.msg}"
                if not isinstance(record, dict):
                    return f"{file} line {number} is a JSON {type(record).__name__}, not an object"
    return None


def _is_json_object(line: str) -> bool:
    """A .json file may hold JSON Lines, as `datasets` accepts: its first line is then a whole object."""
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _load_hub(name: str, args: PrepareArgs) -> Dataset | DatasetDict:
    """A Hub dataset, asked of the Hub once and briefly (app/hub.py: without network, huggingface_hub retried for
    minutes, logging each retry). Without the Hub, the files prefetch.py cached are read from their snapshot (offline,
    `load_dataset` by name looked only in its own cache and refused them), else `load_dataset`'s own cache."""
    source, advice = name, ""
    if is_hub_id(name) and not hub_reachable():
        source = cached_dataset(name) or name
        if source == name:  # perhaps in load_dataset's own cache, read offline
            if not constants.HF_HUB_OFFLINE:
                go_offline(name)
            advice = (f"; run `python prefetch.py --dataset {name}` on a machine with internet access using the same "
                      "HF_HOME, then set HF_HUB_OFFLINE=1")
        else:
            refuse_config_not_cached(name, Path(source), args.dataset_config)
    try:
        with quiet_hub():
            return datasets.load_dataset(source, args.dataset_config, split=args.split)
    except Exception as error:  # not found, offline, gated, bad config or split: all are the user's to fix
        raise UsageError(f"--input {name}: not a local path, and loading it as a Hugging Face dataset failed: "
                         f"{load_dataset_problem(error)}{advice}") from error


LOAD_DATASET_ERRORS = (
    (re.compile(r"Config name is missing.*available configs: \[(?P<known>.*?)\]", re.S),
     "it has several configs ({known}): choose one with --dataset_config"),
    (re.compile(r"BuilderConfig '(?P<asked>.*)' not found\. Available: \[(?P<known>.*?)\]"),
     "--dataset_config {asked}: no such config (configs: {known})"),
    (re.compile(r'Unknown split "(?P<asked>.*)"\. Should be one of \[(?P<known>.*?)\]'),
     "--split {asked}: no such split (splits: {known})"),
)
"""`load_dataset`'s refusals of a config or split, in the names of prepare_data.py's flags (its own say what to call
in Python, over several lines)."""


def load_dataset_problem(error: Exception) -> str:
    for pattern, problem in LOAD_DATASET_ERRORS:
        if found := pattern.search(str(error)):
            return problem.format(**{key: value.replace("'", "") for key, value in found.groupdict().items()})
    return first_line(error)


def refuse_config_not_cached(name: str, snapshot: Path, config: str | None) -> None:
    """Refuse a --dataset_config of which the cached snapshot holds no data file: prefetch.py --dataset_config fetched
    another config's, and `load_dataset` failed with a bare `StopIteration`. A card this cannot read is left to
    `load_dataset`, whose refusal is one line."""
    card = snapshot / "README.md"
    try:
        patterns = dataset_card_configs(DatasetCard.load(card).data.to_dict()).get(config) if card.is_file() else None
    except (ValueError, yaml.YAMLError, KeyError, TypeError, AttributeError):  # malformed YAML or configs
        return
    if patterns and not any(next(snapshot.glob(pattern), None) for pattern in patterns):
        raise UsageError(f"--dataset_config {config}: the Hugging Face cache holds none of its files of {name} "
                         f"({', '.join(patterns)}); run `python prefetch.py --dataset {name} --dataset_config "
                         f"{config}` on a machine with internet access using the same HF_HOME")


def cached_dataset(name: str) -> str | None:
    """The snapshot folder of a Hub dataset's main revision in the Hugging Face cache, or None. prefetch.py
    --dataset_config fetches one configuration's files, which snapshot_download offline refuses as incomplete."""
    repo = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}"
    main = repo / "refs" / "main"
    snapshot = repo / "snapshots" / main.read_text().strip() if main.is_file() else None
    return str(snapshot) if snapshot and snapshot.is_dir() else None


def _from_dataset(
    loaded: Dataset | DatasetDict, source: str, args: PrepareArgs, to_records: ToRecords, split_applied: bool = False
) -> tuple[Dataset, Dataset | None, str]:
    """Take `train` (or --split) and, without --split, the dataset's own validation split when it has one. A Hub
    dataset comes with --split applied by `load_dataset`; a saved one (`load_from_disk`) gets it here (a saved
    Dataset without splits took none: --split was silently ignored)."""
    if isinstance(loaded, Dataset):
        if args.split is not None and not split_applied:
            raise UsageError(f"--split {args.split}: --input {source} is a saved dataset without splits "
                             f"({len(loaded)} rows); drop --split")
        taken = f"{args.split}: " if split_applied else ""
        return to_records(loaded, source), None, f"{source} ({taken}{len(loaded)} rows)"
    if args.split is not None:
        return _from_dataset(saved_split(loaded, args.split, source), source, args, to_records, split_applied=True)
    if "train" not in loaded:
        raise UsageError(f"--input {source} has no train split (it has {', '.join(loaded)}); choose one with --split")
    validation = next((loaded[name] for name in VALIDATION_SPLIT_NAMES if name in loaded), None)
    train = to_records(loaded["train"], source)
    read = f"{source} (train: {len(loaded['train'])} rows"  # as read, as a file's count: empty rows skipped are said
    if validation is None:
        return train, None, f"{read})"
    said = f"{read}, own validation: {len(validation)} rows)"
    return train, to_records(validation, f"{source} (validation split)"), said


def saved_split(loaded: DatasetDict, spec: str, source: str) -> Dataset:
    """--split of a saved dataset, read as `load_dataset` reads it from the Hub: `train`, `train[:10%]`,
    `train[100:200]+test[:50]`."""
    try:
        rows = {name: len(split) for name, split in loaded.items()}
        parts = datasets.ReadInstruction.from_spec(spec).to_absolute(rows)
    except (ValueError, KeyError, AssertionError) as error:
        raise UsageError(f"--split {spec}: {first_line(error)} (--input {source} has {', '.join(loaded)})") from None
    return datasets.concatenate_datasets([loaded[part.splitname].select(range(part.from_, part.to)) for part in parts])


def require_fields(dataset: Dataset, fields: dict[str, str], source: str) -> None:
    """Every field an option names (option → field) must be a column of the input; else say which ones it has."""
    for option, field in fields.items():
        if field not in dataset.column_names:
            raise UsageError(
                f"--{option} {field}: no such field in --input {source}; it has: {', '.join(dataset.column_names)}"
            )


@dataclass(frozen=True)
class Row:
    """One row of one input, so that a bad value is named in one line: option, field, row (from 1) and input."""

    fields: dict[str, str]
    """Option → the input field it names."""
    index: int
    source: str

    def error(self, option: str, problem: str) -> UsageError:
        return UsageError(f"--{option} {self.fields[option]}: row {self.index + 1} of --input {self.source} {problem}")

    def text(self, option: str, value: object) -> str:
        """The value of a text field ("" when missing); anything else is refused."""
        if value is None or isinstance(value, str):
            return value or ""
        raise self.error(option, f"holds {type(value).__name__} {repr(value)[:40]}, not text")


def _text_column(dataset: Dataset, field: str, source: str) -> Dataset:
    """Keep only the text, renamed `text`, so that inputs of every format concatenate."""
    require_fields(dataset, {"text_field": field}, source)
    feature = dataset.features[field]
    dataset = dataset.select_columns([field])
    if _is_list_of_text(feature):  # e.g. the chess games' `Moves`: one game = the moves joined by spaces
        def join(batch: dict, indices: list[int]) -> dict:
            rows = (Row({"text_field": field}, i, source) for i in indices)
            return {field: [joined(items, row) for items, row in zip(batch[field], rows)]}

        dataset = dataset.map(
            join,
            batched=True,
            with_indices=True,
            features=datasets.Features({field: datasets.Value("string")}),
            desc=f"Joining {field}",
            **arrow_file("joined"),
        )
    elif getattr(feature, "dtype", None) not in ("string", "large_string"):
        if not isinstance(feature, datasets.Value):  # mixed values (JSON Lines): name the first row that is not text
            row, value = next(((i, v) for i, v in enumerate(dataset[field])
                               if v is not None and not isinstance(v, str)), (None, None))
            if row is not None:
                Row({"text_field": field}, row, source).text("text_field", value)
        raise UsageError(f"--text_field {field} in --input {source} holds {feature}, not text; pick a text field")
    return dataset.rename_column(field, "text") if field != "text" else dataset


def joined(items: list[str | None] | None, row: Row) -> str:
    """A list-of-text value as one text, its items joined by spaces; a null item is refused, never dropped."""
    if any(item is None for item in items or []):
        raise row.error("text_field", "holds a null item in its list; remove or fill it")
    return " ".join(items or [])


def _is_list_of_text(feature: object) -> bool:
    inner = getattr(feature, "feature", None)
    return isinstance(feature, (datasets.List, datasets.Sequence)) and getattr(inner, "dtype", None) == "string"
