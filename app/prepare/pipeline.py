"""prepare(): inputs → records → train/validation (whole documents or examples) → tokenizer → tokens (and
labels) → rows (blocks of raw text, packed examples, or unpadded examples) → output, whose stats.json says which."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerBase

from app.folders import TOKENIZER_FOLDER
from app.prepare.args import PrepareArgs, RecordShape, UsageError, checked_args, data_format, record_shape
from app.prepare.chat import chat_records, chat_texts
from app.prepare.chat_template import (PREFIX_MISMATCH, ChatEncoder, chat_advice, chat_text, check_template,
                                       check_turns_found, choose_template, encode_chats, end_of_turn_id)
from app.prepare.corpus import (Documents, ToRecords, document_texts, local_files, not_utf8, quiet_progress,
                                read_documents)
from app.prepare.examples import (PROMPT_FILLS_BLOCK, TOO_LONG, ExampleCounts, examples_to_rows,
                                  one_example_per_row)
from app.prepare.mask_audit import audit_split, check_audit, describe_audit
from app.prepare.output import save_prepared, write_atomically
from app.prepare.pack import SplitCounts, count, pack, tokenize
from app.prepare.pack_examples import pack_examples
from app.prepare.seq2seq import (SOURCE_TOO_LONG, TARGET_TOO_LONG, check_room, encode_pairs, pair_advice,
                                 pair_records, pair_texts)
from app.prepare.split import Splits, split_by_document
from app.prepare.tokenizer import adds_bos, document_suffix, load_tokenizer, pad_token_id, train_tokenizer
from app.prepare.workspace import workspace

FIELD_OPTIONS = (
    "prompt_field",
    "response_field",
    "system_field",
    "input_field",
    "messages_field",
    "tools_field",
    "source_field",
    "target_field",
)


def prepare(args: PrepareArgs) -> dict:
    """Prepare `args.output_dir` and return its stats (also written to stats.json). Raises UsageError on bad input.

    Progress bars only on a terminal: in a log (Slurm, CI) their carriage returns make one unreadable line, and a
    refusal must stay a single line on stderr; there, a few lines on stdout say which stage is running."""
    fork_the_workers()
    with nullcontext() if sys.stderr.isatty() else quiet_progress():
        args = checked_args(args)
        with workspace(Path(args.output_dir)):
            try:
                return prepare_folder(args)
            except UnicodeDecodeError as error:  # a local file's bytes, let through by the JSON reader
                raise UsageError(f"--input: {not_utf8(local_files(args.input)) or error}") from error


def fork_the_workers() -> None:
    """--num_proc's workers (datasets' pools, of the `multiprocess` package) forked from this process, as Python
    3.13 and earlier start them on Linux. Python 3.14 starts them from a forkserver instead (reproduced on 3.11 by
    making it the default): each pool's workers imported datasets and transformers again at every map (5 to 13
    times slower on small inputs), and a stop, which app/stopping.py's fork hooks follow, printed a traceback before
    its one line, or left the workers running under a limit on threads."""
    if sys.platform.startswith("linux"):
        import multiprocess

        multiprocess.set_start_method("fork", force=True)


def prepare_folder(args: PrepareArgs) -> dict:
    shape = record_shape(args)
    tokenizer = load_tokenizer(args.tokenizer, args.trust_remote_code) if args.tokenizer else None
    documents = read_documents(args, to_records(shape, args, tokenizer))
    unit = "document" if shape == "text" else "example"
    held = split_by_document(documents, args.val_fraction, args.seed, args.num_proc, unit)
    splits = held.records
    validation = (f"validation from the last {args.val_fraction:.0%} of each (too few to hold out whole ones)"
                  if held.held_out == "document_ends" else f"{len(splits['validation']):,} validation {unit}s")
    log(f"read {', '.join(documents.description)}: {len(splits['train']):,} training {unit}s, {validation}")
    if tokenizer is None:
        log(f"training a tokenizer of {args.vocab_size:,} pieces on the training split")
        tokenizer = train_tokenizer(TEXTS[shape](splits["train"]), args.vocab_size, args.seed)
    # The model's length is not this stage's: documents are cut into blocks, examples to --block_size (and train.py
    # checks blocks against the model's positions); transformers' warning about it read as an error.
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    log("tokenizing" + (" and packing" if shape == "text" or (args.packing and shape != "source/target") else ""))
    if shape == "text":
        rows, stats = text_blocks(held, tokenizer, args, documents.description)
    else:
        rows, counts, options = BUILDERS[shape](splits, tokenizer, args)
        stats = describe_examples(args, tokenizer, counts, options, documents)
    log(f"writing {args.output_dir}")
    write_atomically(Path(args.output_dir), lambda folder: save_prepared(folder, rows, tokenizer, stats),
                     args.overwrite)
    return stats


def to_records(shape: RecordShape, args: PrepareArgs, tokenizer: Optional[PreTrainedTokenizerBase]
               ) -> Optional[ToRecords]:
    """What turns each input's rows into records of the shape (None for raw text); chats are checked against the text
    their chat template renders."""
    if shape in ("prompt/response", "messages"):
        return chat_records(args, chat_text(tokenizer, args))
    return pair_records(args) if shape == "source/target" else None


def log(message: str) -> None:
    """A stage of the work, outside a terminal (a Slurm log, CI), where progress bars are off: a few lines in all,
    on stdout, so that a refusal stays the one line on stderr."""
    if not sys.stderr.isatty():
        print(f"prepare_data.py: {message}", flush=True)


def text_blocks(
    held: Splits, tokenizer: PreTrainedTokenizerBase, args: PrepareArgs, inputs: list[str]
) -> tuple[DatasetDict, dict]:
    """Raw text: each split's documents as one token stream, cut into blocks of exactly --block_size tokens."""
    suffix = document_suffix(tokenizer)
    tokenized = {
        name: tokenize(split, tokenizer, suffix, args.num_proc, desc=f"Tokenizing {name}")
        for name, split in held.records.items()
    }
    counts = {name: count(split, args.block_size) for name, split in tokenized.items()}
    check_enough_tokens(counts, args, held.held_out)
    blocks = DatasetDict(
        {name: pack(split, args.block_size, args.num_proc, desc=f"Packing {name}",
                    documents_apart=args.document_masking) for name, split in tokenized.items()}
    )
    return blocks, describe_text_blocks(args, tokenizer, counts, held, inputs)


def supervised_rows(
    splits: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: PrepareArgs
) -> tuple[DatasetDict, dict[str, ExampleCounts], dict]:
    """Chats rendered with the chat template, labels on the assistant turns, packed into blocks or one per row."""
    template = choose_template(tokenizer, args)
    encoder = ChatEncoder(tokenizer, template, args.train_on_prompt)
    check_template(encoder, splits.values())
    encoded = {name: encode_chats(split, encoder, args, desc=f"Encoding {name}") for name, split in splits.items()}
    check_turns_found(encoder, encoded)
    rows, counts = examples_to_rows(encoded, chat_advice(template, args.block_size), _arrange(tokenizer, args))
    for name, split in encoded.items():
        audit = audit_split(splits[name], split, tokenizer, template.text)
        check_audit(audit, template.origin, args.train_on_prompt,
                    f"the first {audit['audited_examples']} {name} examples")
        counts[name] = replace(counts[name], loss_mask=audit)
    if not template.tokenizers_own:
        tokenizer.chat_template = template.text  # saved with the tokenizer, so the converted model keeps it
    options = {
        "chat_template": template.origin,
        "end_of_turn_token_id": end_of_turn_id(tokenizer),
        "train_on_prompt": args.train_on_prompt,
        "packing": args.packing,
        "block_size": args.block_size,
        "too_long": args.too_long,
    }
    return rows, counts, options


def _arrange(tokenizer: PreTrainedTokenizerBase, args: PrepareArgs) -> Callable[[Dataset, str], Dataset]:
    """--packing true: whole examples packed into rows of --block_size; false: the examples as they are."""
    if not args.packing:
        return lambda examples, name: one_example_per_row(examples)
    pad_id = pad_token_id(tokenizer)
    return lambda examples, name: pack_examples(
        examples, args.block_size, pad_id, args.seed, args.num_proc, desc=f"Packing {name}"
    )


def seq2seq_rows(
    splits: DatasetDict, tokenizer: PreTrainedTokenizerBase, args: PrepareArgs
) -> tuple[DatasetDict, dict[str, ExampleCounts], dict]:
    """Source and target ids, each ending with EOS, one unpadded pair per row."""
    check_room(tokenizer, args)
    encoded = {name: encode_pairs(split, tokenizer, args, desc=f"Encoding {name}") for name, split in splits.items()}
    rows, counts = examples_to_rows(encoded, pair_advice(args),
                                    lambda examples, name: examples.select_columns(["input_ids", "labels"]))
    counts = {name: replace(count, target_truncated=sum(encoded[name]["target_truncated"]))
              for name, count in counts.items()}
    options = {
        "max_source_length": args.max_source_length,
        "max_target_length": args.max_target_length,
        "too_long": args.too_long,
    }
    return rows, counts, options


TEXTS: dict[RecordShape, Callable[[Dataset], Iterable[str]]] = {
    "text": document_texts,
    "prompt/response": chat_texts,
    "messages": chat_texts,
    "source/target": pair_texts,
}
"""Every text of a training split, for a tokenizer trained with --vocab_size."""
BUILDERS = {"prompt/response": supervised_rows, "messages": supervised_rows, "source/target": seq2seq_rows}


def check_enough_tokens(counts: dict[str, SplitCounts], args: PrepareArgs, held_out: str) -> None:
    """A split with tokens but not one full block would silently train or evaluate on nothing."""
    train, validation = counts["train"], counts["validation"]
    if train.blocks == 0:
        raise UsageError(
            f"--block_size {args.block_size} is larger than the training text ({train.tokens} tokens); "
            "lower --block_size or add input"
        )
    if validation.documents and validation.blocks == 0:
        raise UsageError(
            f"--block_size {args.block_size} is larger than the validation text ({validation.tokens} tokens"
            + (f": the last {args.val_fraction:.0%} of each of {validation.documents} documents, too few to hold out "
               "whole ones" if held_out == "document_ends" else "")
            + "); raise --val_fraction or lower --block_size"
        )


def describe_text_blocks(
    args: PrepareArgs,
    tokenizer: PreTrainedTokenizerBase,
    counts: dict[str, SplitCounts],
    held: Splits,
    inputs: list[str],
) -> dict:
    """The content of stats.json for raw text: what was read, how it was tokenized, what packing kept and dropped."""
    return {
        "format": data_format(args),
        "inputs": inputs,
        "text_field": args.text_field,
        **describe_tokenizer(args, tokenizer),
        "block_size": args.block_size,
        "val_fraction": args.val_fraction,
        "validation_held_out": held.held_out,
        "seed": args.seed,
        "empty_documents_skipped": held.empty_documents,
        "splits": {name: asdict(split) for name, split in counts.items()},
    }


def describe_examples(
    args: PrepareArgs,
    tokenizer: PreTrainedTokenizerBase,
    counts: dict[str, ExampleCounts],
    options: dict,
    documents: Documents,
) -> dict:
    """The content of stats.json for supervised and source/target data: the format of the rows, the options that
    shaped them, what each split kept, truncated and dropped, and the empty rows --empty_examples skip left out."""
    skipped = {"empty_examples_skipped": documents.empty_examples_skipped} if args.empty_examples == "skip" else {}
    return {
        "format": data_format(args),
        "inputs": documents.description,
        **skipped,
        "fields": {option: getattr(args, option) for option in FIELD_OPTIONS if getattr(args, option) is not None},
        **describe_tokenizer(args, tokenizer),
        "pad_token_id": pad_token_id(tokenizer),
        **options,
        "val_fraction": args.val_fraction,
        "seed": args.seed,
        "splits": {name: asdict(split) for name, split in counts.items()},
    }


NOTED_DROP_SHARE = 0.05
"""A split that drops this share of its examples for a reason an option changes says which (38% of the pairs of a
run went as `prompt_fills_block` with no word of what to do)."""
DROP_ADVICE = {PROMPT_FILLS_BLOCK: "the prompt alone fills --block_size, so no response token is kept: raise it",
               TOO_LONG: "longer than --block_size under --too_long drop: raise it, or use --too_long truncate",
               SOURCE_TOO_LONG: "sources longer than --max_source_length: raise it, or use --too_long truncate",
               TARGET_TOO_LONG: "targets longer than --max_target_length: raise it, or use --too_long truncate",
               PREFIX_MISMATCH: "the chat template renders an earlier turn otherwise once the chat goes on (Mistral's "
                                "writes the tools before the last user message): leave such chats out, or give a "
                                "template that renders every turn alike with --chat_template FILE"}


def summary(stats: dict, output_dir: str) -> str:
    """What prepare_data.py prints when it is done: per split, what was kept, cut and dropped and why, the tokens,
    trained tokens and padding, which roles' tokens are trained; then where it wrote (stats.json holds the same)."""
    lines, said = [], set()  # the advice on a reason for dropping examples, once
    for name, split in stats["splits"].items():
        if stats["format"] in ("text", "text_documents"):
            ends = name == "validation" and stats.get("validation_held_out") == "document_ends"
            lines.append(f"{name}: {split['blocks']:,} blocks of {stats['block_size']} tokens from "
                         f"{'the last ' + format(stats['val_fraction'], '.0%') + ' of ' if ends else ''}"
                         f"{split['documents']:,} documents ({split['dropped_tokens']:,} tokens left over)"
                         f"{'; too few documents to hold out whole ones' if ends else ''}")
            continue
        dropped = ", ".join(f"{reason} {count:,}" for reason, count in split["dropped"].items())
        cut = split.get("target_truncated")
        targets = "" if cut is None else f", {cut:,} of them in the target"
        lines.append(f"{name}: {split['kept']:,} of {split['examples']:,} examples kept ({split['truncated']:,} "
                     f"truncated{targets}; dropped: {dropped or 'none'}), {split['rows']:,} rows, "
                     f"{split['tokens']:,} tokens, "
                     f"{split['trained_tokens']:,} trained, {split['padding_fraction']:.1%} padding")
        if split.get("loss_mask") and split["loss_mask"].get("audited_examples"):  # an empty split audits nothing
            lines.append(f"  {describe_audit(split['loss_mask'])}")
        noted = [reason for reason, count in split["dropped"].items() if reason in DROP_ADVICE and reason not in said
                 and count >= NOTED_DROP_SHARE * split["examples"]]
        lines += [f"  {split['dropped'][reason]:,} examples ({split['dropped'][reason] / split['examples']:.0%}) "
                  f"dropped as {reason}: {DROP_ADVICE[reason]}" for reason in noted]
        said.update(noted)
    if "chat_template" in stats:  # a tokenizer prefetched without its chat_template.jinja fell back to the default
        lines.append(f"rendered with {stats['chat_template']}")
    if stats.get("empty_documents_skipped"):  # 30% of an input with misnamed or null fields went unsaid
        lines.append(f"skipped {stats['empty_documents_skipped']:,} documents without text (empty files, or records "
                     f"whose --text_field {stats.get('text_field', 'text')} is missing, null or empty)")
    if stats.get("empty_examples_skipped"):  # --empty_examples skip
        lines.append(f"skipped {stats['empty_examples_skipped']:,} rows with an empty prompt, response, source or "
                     "target (--empty_examples skip)")
    lines.append(f"wrote {output_dir} ({stats['format']} rows, tokenizer/, stats.json)")
    return "\n".join(lines)


def describe_tokenizer(args: PrepareArgs, tokenizer: PreTrainedTokenizerBase) -> dict:
    return {
        "tokenizer": args.tokenizer or f"trained SentencePiece BPE (saved in {TOKENIZER_FOLDER}/)",
        "tokenizer_path": TOKENIZER_FOLDER,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "adds_bos": adds_bos(tokenizer),
    }
