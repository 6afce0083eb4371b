"""Source→target records for encoder-decoder models: `input_ids` is the source, `labels` the target.

Both are encoded as the tokenizer encodes a document (its own BOS where it adds one; literal special-token text
stays text) and hold exactly one EOS, appended where the tokenizer adds none (the T5 convention). The target is
encoded as a target (`text_target`): Marian has a SentencePiece model of its own for the target language, NLLB puts
its language code in front, mbart-large-cc25 after the EOS, where its decoder reads it from first.
Rows stay unpadded: training pads per batch, with -100 in the labels, and builds attention masks from the lengths.
A sequence longer than its limit (--max_source_length, --max_target_length) is cut before its end and keeps its EOS
and whatever the tokenizer puts after it (--too_long truncate), or the example is dropped (--too_long drop).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

from datasets import Dataset, Features, Value
from transformers import PreTrainedTokenizerBase

from app.prepare.args import PrepareArgs, UsageError
from app.prepare.corpus import Row, ToRecords, quiet_progress, require_fields
from app.prepare.examples import Example, dropped, encode_examples, length_advice
from app.prepare.tokenizer import document_frame, encode_texts
from app.prepare.workspace import arrow_file

PAIRS = Features({"source": Value("string"), "target": Value("string")})
SOURCE_TOO_LONG = "source_too_long"
TARGET_TOO_LONG = "target_too_long"


def pair_records(args: PrepareArgs) -> ToRecords:
    """What turns one input's rows into `source`/`target` records, refusing a row without text in either (or
    leaving it out, --empty_examples skip)."""
    return partial(_records, fields={"source_field": args.source_field, "target_field": args.target_field},
                   skip_empty=args.empty_examples == "skip")


def _records(table: Dataset, source: str, fields: dict[str, str], skip_empty: bool = False) -> Dataset:
    require_fields(table, fields, source)

    def convert(batch: dict, indices: list[int]) -> dict:
        columns = {}
        for column, option in (("source", "source_field"), ("target", "target_field")):
            columns[column] = [text(Row(fields, i, source), option, v, skip_empty)
                               for i, v in zip(indices, batch[fields[option]])]
        return columns

    with quiet_progress():
        pairs = table.map(convert, batched=True, with_indices=True, remove_columns=table.column_names,
                          features=PAIRS, **arrow_file("pairs"))
        if skip_empty:
            pairs = pairs.filter(lambda sources, targets: [bool(s.strip() and t.strip()) for s, t in
                                                           zip(sources, targets)],
                                 batched=True, input_columns=["source", "target"], **arrow_file("pairs"))
        return pairs


def text(row: Row, option: str, value: object, skip_empty: bool = False) -> str:
    """A source or target: text that is not empty (or, under `skip_empty`, "" for the row to be left out)."""
    value = row.text(option, value)
    if not value.strip() and not skip_empty:
        raise row.error(option, "is empty; every example needs a source and a target "
                        "(--empty_examples skip leaves such rows out, counted)")
    return value


def pair_texts(records: Dataset) -> Iterator[str]:
    """Sources and targets, to train a tokenizer on (--vocab_size)."""
    for batch in records.iter(batch_size=1000):
        yield from batch["source"]
        yield from batch["target"]


def check_room(tokenizer: PreTrainedTokenizerBase, args: PrepareArgs) -> None:
    """A limit must leave room for one token of text inside the document's frame (BOS, EOS, a language code)."""
    for option, target in (("max_source_length", False), ("max_target_length", True)):
        frame = document_frame(tokenizer, target)
        least = len(frame.prefix) + 1 + frame.tail
        if getattr(args, option) < least:
            raise UsageError(f"--{option} {getattr(args, option)} leaves no room for text: use at least {least}")


def fit(ids: list[int], max_length: int, tail: int) -> list[int]:
    """`ids` cut to `max_length` tokens by dropping text before their last `tail` tokens (the EOS, mBART's
    language code after it), which are kept."""
    return ids if len(ids) <= max_length else [*ids[: max_length - tail], *ids[-tail:]]


def fit_pair(source: list[int], target: list[int], args: PrepareArgs, tails: tuple[int, int]) -> Example:
    """The pair within --max_source_length/--max_target_length, truncated or dropped as --too_long says."""
    too_long_source, too_long_target = len(source) > args.max_source_length, len(target) > args.max_target_length
    if args.too_long == "drop" and (too_long_source or too_long_target):
        return dropped(SOURCE_TOO_LONG if too_long_source else TARGET_TOO_LONG)
    return Example(
        fit(source, args.max_source_length, tails[0]),
        fit(target, args.max_target_length, tails[1]),
        truncated=too_long_source or too_long_target,
        target_truncated=too_long_target,
    )


def encode_pairs(records: Dataset, tokenizer: PreTrainedTokenizerBase, args: PrepareArgs, desc: str) -> Dataset:
    """Every pair's source and target ids, each framed as the tokenizer frames a document with exactly one EOS,
    fitted to the limits (rows of `EXAMPLE_FEATURES`)."""
    source, target = document_frame(tokenizer), document_frame(tokenizer, target=True)

    def encode(batch: dict) -> list[Example]:
        sources = encode_texts(tokenizer, batch["source"], source.appended)
        targets = encode_texts(tokenizer, batch["target"], target.appended, target=True)
        pairs = zip(sources, targets, strict=True)
        return [fit_pair(*pair, args, (source.tail, target.tail)) for pair in pairs]

    return encode_examples(records, encode, args.num_proc, desc)


def pair_advice(args: PrepareArgs) -> dict[str, str]:
    """What to say when no example is left."""
    return {
        SOURCE_TOO_LONG: length_advice("--max_source_length", args.max_source_length),
        TARGET_TOO_LONG: length_advice("--max_target_length", args.max_target_length),
    }
