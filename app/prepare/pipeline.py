"""prepare(): inputs → documents → train/validation by document → tokenizer → token stream → blocks → output."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from datasets import DatasetDict
from transformers import PreTrainedTokenizerBase

from app.prepare.args import PrepareArgs, UsageError, check_args
from app.prepare.corpus import read_documents
from app.prepare.output import TOKENIZER_FOLDER, save_prepared, write_atomically
from app.prepare.pack import SplitCounts, count, pack, tokenize
from app.prepare.split import split_by_document
from app.prepare.tokenizer import adds_bos, document_suffix, load_tokenizer, train_tokenizer


def prepare(args: PrepareArgs) -> dict:
    """Prepare `args.output_dir` and return its stats (also written to stats.json). Raises UsageError on bad input."""
    check_args(args)
    tokenizer = load_tokenizer(args.tokenizer, args.trust_remote_code) if args.tokenizer else None
    documents = read_documents(args)
    splits, empty_documents = split_by_document(documents, args.val_fraction, args.seed, args.num_proc)
    if tokenizer is None:
        tokenizer = train_tokenizer(splits["train"], args.vocab_size, args.seed)
    suffix = document_suffix(tokenizer)
    tokenized = {
        name: tokenize(split, tokenizer, suffix, args.num_proc, desc=f"Tokenizing {name}")
        for name, split in splits.items()
    }
    counts = {name: count(split, args.block_size) for name, split in tokenized.items()}
    check_enough_tokens(counts, args)
    blocks = DatasetDict(
        {name: pack(split, args.block_size, args.num_proc, desc=f"Packing {name}") for name, split in tokenized.items()}
    )
    stats = describe(args, tokenizer, counts, empty_documents, documents.description)
    write_atomically(Path(args.output_dir), lambda folder: save_prepared(folder, blocks, tokenizer, stats))
    return stats


def check_enough_tokens(counts: dict[str, SplitCounts], args: PrepareArgs) -> None:
    """A split with tokens but not one full block would silently train or evaluate on nothing."""
    train, validation = counts["train"], counts["validation"]
    if train.blocks == 0:
        raise UsageError(
            f"--block_size {args.block_size} is larger than the training text ({train.tokens} tokens); "
            "lower --block_size or add input"
        )
    if validation.documents and validation.blocks == 0:
        raise UsageError(
            f"--block_size {args.block_size} is larger than the validation text ({validation.tokens} tokens); "
            "raise --val_fraction or lower --block_size"
        )


def describe(
    args: PrepareArgs,
    tokenizer: PreTrainedTokenizerBase,
    counts: dict[str, SplitCounts],
    empty_documents: int,
    inputs: list[str],
) -> dict:
    """The content of stats.json: what was read, how it was tokenized, and what packing kept and dropped."""
    return {
        "inputs": inputs,
        "text_field": args.text_field,
        "tokenizer": args.tokenizer or f"trained SentencePiece BPE (saved in {TOKENIZER_FOLDER}/)",
        "tokenizer_path": TOKENIZER_FOLDER,
        "vocab_size": len(tokenizer),
        "block_size": args.block_size,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "adds_bos": adds_bos(tokenizer),
        "val_fraction": args.val_fraction,
        "seed": args.seed,
        "empty_documents_skipped": empty_documents,
        "splits": {name: asdict(split) for name, split in counts.items()},
    }
