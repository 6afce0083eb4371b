"""Choices the command line and the code share, importable without torch (arguments.py parses without it), and the
conventions of the data that prepare_data.py writes and train.py reads."""

from typing import Literal

SHARDED_STRATEGIES = ("fsdp", "fsdp2")
"""--strategy values that shard parameters, gradients and optimizer state, and take the FSDP options."""

FSDP1_ONLY_OPTIONS = ("limit_all_gathers", "backward_prefetch", "forward_prefetch")
"""FSDP options FSDP2 has no use for: it bounds its all-gathers and prefetches one unit ahead by itself."""
CHECKPOINTING_OPTIONS = ("gradient_checkpointing", "gradient_checkpointing_every")
"""Options of the FSDP group that every strategy reads: ddp, fsdp2 and one device through transformers' own
activation checkpointing."""

MAX_SEED = 2**32 - 1
"""The largest seed train.py and prepare_data.py take: numpy's (Lightning's seed_everything seeds numpy on every rank;
prepare_data.py's split and SentencePiece's training take 32-bit seeds)."""

FormatName = Literal["text", "text_documents", "supervised_packed", "supervised_padded", "seq2seq"]
"""The data formats: prepare_data.py writes one (stats.json's `format`), app/data/formats.py reads it."""

IGNORE_INDEX = -100
"""The label of a position nothing is learnt from (torch's cross-entropy default, as in Hugging Face's models)."""
