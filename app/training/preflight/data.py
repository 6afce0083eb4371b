"""The facts of --train_data_dir (one prepared folder, or a mixture's folders together), read from the folders
without loading a row into Python: format, rows, block length, largest token id."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import pyarrow as pa
import pyarrow.compute as pc
from datasets import DatasetDict, load_from_disk
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.cli import first_line
from app.data import DataFormat
from app.data.identity import folder_identity
from app.data.loader import shared_columns
from app.data.mixture import Source, epoch_rows, first_folder, parse_eval_folders, parse_sources
from app.folders import STATS_FILE, prepared_tokenizer
from app.hub import CHAT_TEMPLATE_DIFFERS, tokenizer_difference
from app.training.preflight.environment import world_size
from app.training.preflight.notes import note

if TYPE_CHECKING:
    from arguments import Config


@dataclass
class DataFacts:
    format: DataFormat
    train_rows: int
    validation_rows: int
    block_size: int
    """The longest row (every row, for block formats)."""
    mean_row_tokens: float
    mean_target_tokens: float
    """Of seq2seq data's targets; 0 for the other formats, whose labels are their inputs."""
    max_token_id: int
    target_block_size: int = 0
    """Seq2seq data's longest target; 0 for the other formats."""
    target_start: Optional[int] = None
    """The token every train target of seq2seq data begins with (a BOS the tokenizer adds); None when they differ."""
    sources: Optional[list[Source]] = None
    """A mixture's folders (app/data/mixture.py), with `source_rows` their train rows; None for one folder."""
    source_rows: Optional[list[int]] = None
    identities: list[dict] = field(default_factory=list)
    """Each folder's identity (app/data/identity.py), in the order of --train_data_dir."""
    longest_example: int = 0
    """Packed rows' longest stretch of position_ids (an example, or the padding that ends a row), what transformers
    reads as a micro-batch's length; else the longest row."""
    column_types: dict[str, str] = field(default_factory=dict)
    """How each column of the train split is stored (`List(Value('int32'), length=2048)`), for a mixture's join."""
    evaluated_rows: dict[str, int] = field(default_factory=dict)
    """The validation rows of each --eval_data_dir folder, by name."""
    evaluated_longest: dict[str, int] = field(default_factory=dict)
    """The longest example of each --eval_data_dir folder (`longest_example`), by name."""


def check_data(cfg: Config, problems: list[str]) -> Optional[DataFacts]:
    """The facts of --train_data_dir's folder, or of a mixture's folders together (app/data/mixture.py)."""
    try:
        sources = parse_sources(cfg.train_data_dir)
    except ValueError as error:
        problems.append(str(error))
        return None
    facts = [check_folder(Path(source.path), problems) for source in sources]
    if any(fact is None for fact in facts):
        return None
    for source, fact in zip(sources, facts):
        if not fact.validation_rows:
            alone = ("the run trains without evaluating" if not cfg.eval_data_dir else
                     "no val_loss, nor best checkpoint: only --eval_data_dir's folders are evaluated")
            note(f"--train_data_dir {source.path} has no validation rows (prepared with --val_fraction 0): "
                 + ("it is not validated on its own" if len(sources) > 1 else alone))
    together = mixture_facts(sources, facts, problems, cfg.trust_remote_code) if len(sources) > 1 else facts[0]
    identities = [folder_identity(source.name, source.path, fact.train_rows, fact.validation_rows)
                  for source, fact in zip(sources, facts)]
    return replace(together, identities=identities) if together is not None else None


def reads_data(cfg: Config) -> bool:
    """Whether the preflight reads --train_data_dir: always for a run; for a plan with --block_size only when its
    folders are there. That plan takes its blocks from --block_size, so a config naming a folder not prepared yet
    (configs/demo.yaml before `make demo`) must not stop it; a folder that is there still gives its rows."""
    if not cfg.train_data_dir:
        return False
    if not (cfg.estimate_memory and cfg.block_size):
        return True
    try:
        missing = [source.path for source in parse_sources(cfg.train_data_dir) if not Path(source.path).is_dir()]
    except ValueError:
        return True  # check_data says why
    if missing:
        note(f"--estimate_memory: planning blocks of --block_size {cfg.block_size} tokens without --train_data_dir "
             f"({', '.join(missing)}: not prepared yet)")
    return not missing


def mixture_facts(sources: list[Source], facts: list[DataFacts], problems: list[str],
                  trust_remote_code: bool = False) -> Optional[DataFacts]:
    """One format, one block length (rows of blocks are stacked into one tensor) and one tokenizer for every folder
    of a mixture; the facts of the mixture: the rows of its epoch (one pass over its first folder), rows of the
    weighted mean."""
    def differ(what: str, values: list) -> bool:
        if len(set(values)) > 1:
            listed = ", ".join(f"{source.name}: {value}" for source, value in zip(sources, values))
            problems.append(f"--train_data_dir: a mixture's folders must hold one {what} ({listed}); prepare them "
                            "alike")
        return len(set(values)) > 1

    if differ("format", [fact.format.name for fact in facts]):
        return None
    if not facts[0].format.padded and differ("block length", [fact.block_size for fact in facts]):
        return None
    joined = shared_columns(facts[0].format, [fact.column_types for fact in facts])
    if any(differ(f"storage of column {column}", [fact.column_types.get(column) for fact in facts])
           for column in joined):  # datasets cannot join them: every rank ended in a traceback after the launch
        return None
    first = bundled_tokenizer(sources[0].path, trust_remote_code)
    for source in sources[1:]:
        difference = tokenizer_difference(bundled_tokenizer(source.path, trust_remote_code), first)
        if difference == CHAT_TEMPLATE_DIFFERS:  # one tokenizer, another --chat_template: renders unlike the rest
            problems.append(f"--train_data_dir: {source.path} was prepared with another chat template than "
                            f"{sources[0].path}: the model would learn two renderings and be converted with one; "
                            "prepare every folder of a mixture with one --chat_template")
            return None
        if difference:
            problems.append(f"--train_data_dir: {source.path} was prepared with another tokenizer than "
                            f"{sources[0].path} ({difference}); prepare every folder of a mixture with one tokenizer")
            return None
    weights = [float(source.weight) for source in sources]
    return DataFacts(format=facts[0].format, train_rows=epoch_rows([s.weight for s in sources],
                                                                   [fact.train_rows for fact in facts]),
                     validation_rows=sum(fact.validation_rows for fact in facts),
                     block_size=max(fact.block_size for fact in facts),
                     mean_row_tokens=sum(w * fact.mean_row_tokens for w, fact in zip(weights, facts)),
                     mean_target_tokens=sum(w * fact.mean_target_tokens for w, fact in zip(weights, facts)),
                     max_token_id=max(fact.max_token_id for fact in facts),
                     target_block_size=max(fact.target_block_size for fact in facts),
                     target_start=facts[0].target_start if len({f.target_start for f in facts}) == 1 else None,
                     longest_example=max(fact.longest_example for fact in facts), sources=sources,
                     source_rows=[fact.train_rows for fact in facts])


def bundled_tokenizer(folder: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer prepare_data.py wrote into a data folder."""
    return AutoTokenizer.from_pretrained(prepared_tokenizer(folder), trust_remote_code=trust_remote_code)


def check_eval_folders(cfg: Config, data: DataFacts, problems: list[str]) -> DataFacts:
    """--eval_data_dir's folders: each a prepared folder with validation rows, of the training data's format and
    tokenizer (another tokenizer's loss compares with nothing; another chat template is allowed: how a model does on
    another rendering is a question worth asking), its rows no longer than the training data's, which the memory and
    the model's positions are planned for. The facts with the largest token id of all, which the model's vocabulary
    is checked against, and the rows of each folder."""
    try:
        evaluated = parse_eval_folders(cfg.eval_data_dir, cfg.train_data_dir)
    except ValueError as error:
        problems.append(str(error))
        return data
    first = bundled_tokenizer(first_folder(cfg.train_data_dir), cfg.trust_remote_code)
    largest, rows, longest = data.max_token_id, {}, {}
    for name, path in evaluated.items():
        fact, flag = check_folder(Path(path), problems, option="--eval_data_dir"), f"--eval_data_dir {path}"
        if fact is None:
            continue
        if not fact.validation_rows:
            problems.append(f"{flag}: no validation rows to evaluate (prepared with --val_fraction 0); prepare it "
                            "with --val_fraction > 0")
        elif fact.format.name != data.format.name:
            problems.append(f"{flag} holds {fact.format.name} data, and --train_data_dir {data.format.name} data; "
                            "prepare it as the training data was")
        elif fact.block_size > data.block_size or fact.target_block_size > data.target_block_size:
            longer = (f"rows of up to {fact.block_size} tokens" if fact.block_size > data.block_size
                      else f"targets of up to {fact.target_block_size} tokens")
            problems.append(f"{flag} holds {longer}, longer than --train_data_dir's, which the run's memory and the "
                            f"model's positions are planned for; prepare it with --block_size {data.block_size}")
        else:
            difference = tokenizer_difference(bundled_tokenizer(path, cfg.trust_remote_code), first)
            if difference and difference != CHAT_TEMPLATE_DIFFERS:
                problems.append(f"{flag} was prepared with another tokenizer than --train_data_dir ({difference}): "
                                "its loss would compare with nothing; prepare it with the training data's tokenizer")
            largest = max(largest, fact.max_token_id)
            rows[name], longest[name] = fact.validation_rows, fact.longest_example
    return replace(data, max_token_id=largest, evaluated_rows=rows, evaluated_longest=longest)


def check_folder(path: Path, problems: list[str], option: str = "--train_data_dir") -> Optional[DataFacts]:
    flag = f"{option} {path}"
    if not path.is_dir():
        weight = path.name.rpartition(":")[2] if ":" in path.name else ""
        what = "a file, not the folder prepare_data.py writes" if path.is_file() else "no such folder"
        problems.append(f"{flag}: {what}; create it with prepare_data.py"
                        + (f" (a weight is a number: {weight!r} is not one)" if weight and path.parent.joinpath(
                            path.name.rpartition(":")[0]).is_dir() else ""))
        return None
    try:
        splits = load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        problems.append(f"{flag}: not a dataset saved with save_to_disk ({error}); create it with prepare_data.py")
        return None
    except OSError as error:  # pyarrow's reader of a file cut short (a copy interrupted, a full disk)
        problems.append(f"{flag}: its dataset files cannot be read ({first_line(error)}); copy it again, or prepare "
                        "it again with prepare_data.py")
        return None
    except IndexError:  # datasets' reader of a split saved without a single file (an empty selection, saved as such)
        problems.append(f"{flag}: a split of it holds no data file (an empty split saved by hand?); prepare it again "
                        "with prepare_data.py")
        return None
    missing = [s for s in ("train", "validation") if not isinstance(splits, DatasetDict) or s not in splits]
    if missing:
        problems.append(f"{flag}: missing split(s) {', '.join(missing)}; prepare_data.py writes train and validation")
        return None
    try:
        data_format = DataFormat.of(path)
    except ValueError as error:  # a stats.json that is not JSON, or not prepare_data.py's
        problems.append(f"{flag}: {first_line(error)}; prepare it again with prepare_data.py")
        return None
    if data_format.name == "text" and "labels" in splits["train"].column_names:
        said = f"its {STATS_FILE} names no other format" if (path / STATS_FILE).is_file() else f"it has no {STATS_FILE}"
        problems.append(f"{flag} would be read as text blocks ({said}), but its labels say it holds supervised or "
                        f"seq2seq examples; restore its {STATS_FILE} or prepare it again")
        return None
    lengths, max_ids, max_positions = set(), [], []
    for name in ("train", "validation"):
        split = splits[name]
        absent = [column for column in data_format.columns if column not in split.column_names]
        if absent or (len(split) == 0 and name == "train"):
            problems.append(f"{flag}: split {name} has no rows of {', '.join(absent or data_format.columns)} "
                            f"({data_format.name} data; columns: {split.column_names}); prepare it again")
            return None
        if len(split) == 0:
            continue
        row_lengths = pc.list_value_length(split.data.column("input_ids"))
        lengths |= {pc.min(row_lengths).as_py(), pc.max(row_lengths).as_py()}
        max_ids.append(pc.max(pc.list_flatten(split.data.column("input_ids"))).as_py())
        if "position_ids" in split.column_names:
            max_positions.append(pc.max(pc.list_flatten(split.data.column("position_ids"))).as_py())
    if len(lengths) != 1 and not data_format.padded:
        problems.append(f"{flag}: rows have different lengths {sorted(lengths)}; pack them into blocks with "
                        "prepare_data.py")
        return None
    train = splits["train"].data
    mean_tokens = {column: pc.mean(pc.list_value_length(train.column(column))).as_py()
                   for column in ("input_ids", "labels") if column in train.column_names}
    return DataFacts(format=data_format, train_rows=len(splits["train"]),
                     validation_rows=len(splits["validation"]), block_size=max(lengths),
                     mean_row_tokens=mean_tokens["input_ids"],
                     mean_target_tokens=mean_tokens["labels"] if data_format.encoder_decoder else 0.0,
                     max_token_id=max(max_ids),
                     target_block_size=longest_target(splits) if data_format.encoder_decoder else 0,
                     target_start=common_first_target(train) if data_format.encoder_decoder else None,
                     longest_example=max(max_positions) + 1 if max_positions else max(lengths),
                     column_types={name: str(feature) for name, feature in splits["train"].features.items()})


def common_first_target(train: pa.Table) -> Optional[int]:
    """The token every target (labels) of the train split begins with; None when they begin with different ones."""
    first = pc.unique(pc.list_element(train.column("labels"), 0))
    return first[0].as_py() if len(first) == 1 else None


def longest_target(splits: DatasetDict) -> int:
    """Seq2seq data's longest target (labels), in either split: both go through the decoder."""
    return max(pc.max(pc.list_value_length(split.data.column("labels"))).as_py() or 0 for split in splits.values())


def planned_blocks(cfg: Config) -> DataFacts:
    """Stand-in data for --estimate_memory --block_size without a data folder: blocks of that length, enough rows
    for one step."""
    rows = cfg.global_batch_size or world_size(cfg) * cfg.micro_batch_size * (cfg.gradient_accumulation_steps or 1)
    return DataFacts(format=DataFormat("text", 0), train_rows=rows, validation_rows=0, block_size=cfg.block_size,
                     mean_row_tokens=cfg.block_size, mean_target_tokens=0.0, max_token_id=0)
