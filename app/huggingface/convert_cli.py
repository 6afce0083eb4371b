"""The `convert_to_hf.py` command line: its options, and `main`, which parses them before it imports the conversion
(app/huggingface/convert.py: torch and transformers, 5 s), so that a mistyped flag is refused at once."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal, Optional

from jsonargparse import ArgumentParser

from app.cli import bars_only_on_a_terminal, command_parser, parse, run_command
from app.folders import real_folder, remove_own_staging
from app.huggingface.upload import HubArgs
from app.stopping import stopped_in_one_line


@dataclass
class ConvertArgs:
    """Conversion"""

    checkpoint: str
    """A checkpoint file, a sharded checkpoint folder, a checkpoints/ folder or a run folder (its latest checkpoint)."""
    output_dir: str
    """Folder to write the Hugging Face model to (with --all: one step-NNNNNNNN subfolder per checkpoint)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the written weights."""
    all: bool = False
    """Convert every checkpoint of the folder given as --checkpoint, not only the latest."""
    overwrite: bool = False
    """Replace a non-empty --output_dir (only after the new folder has been written and verified)."""
    max_shard_size: str = "5GB"
    """Largest safetensors file; bigger models are split into several with an index."""
    model_name: Optional[str] = None
    """Take the architecture from this hub id or folder instead of the checkpoint's recorded config."""
    model_config: Optional[str] = None
    """Take the architecture from this config.json (or folder holding one) instead of the checkpoint's."""
    tokenizer: Optional[str] = None
    """Tokenizer to save with the model; default: the one the run recorded (--tokenizer, data folder, model)."""
    trust_remote_code: bool = False
    """Run the Python code a tokenizer's folder or Hub repository ships (its tokenizer class), as train.py
    --trust_remote_code does; off by default: that code runs on this machine."""


@dataclass
class Args(HubArgs, ConvertArgs):
    """Every option of convert_to_hf.py, flat."""


def build_parser() -> ArgumentParser:
    return command_parser("convert_to_hf.py", "Convert a train.py checkpoint into a Hugging Face model folder, verify "
                                              "it, and optionally push it to the Hub.", [ConvertArgs, HubArgs])


def parse_args(argv: Optional[list[str]] = None) -> Args:
    namespace = parse(build_parser(), argv)
    return Args(**{f.name: namespace[f.name] for f in fields(Args)})


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: one line on stderr and exit 2 for bad input, exit 1 when verification or the upload fails."""
    args = run_command("convert_to_hf.py", lambda: parse_args(argv))
    from app.huggingface.convert import EXIT_VERIFY_FAILED, PushFailed, VerificationFailed, run

    output_dir = real_folder(Path(args.output_dir))
    said = [f"{args.output_dir} holds a model folder only where one was written and verified whole (the one being "
            "written is removed)"]  # what a stop leaves: another line once the push begins
    try:
        with bars_only_on_a_terminal(), stopped_in_one_line(
                "convert_to_hf.py", lambda: said[-1], lambda: remove_own_staging(output_dir.parent, output_dir)):
            run_command("convert_to_hf.py", lambda: run(args, pushing=said.append))
    except (VerificationFailed, PushFailed) as error:
        print(f"convert_to_hf.py: error: {error}", file=sys.stderr)
        sys.exit(EXIT_VERIFY_FAILED)
