"""show_samples.py: the samples that a run's last evaluation wrote (app/evaluation/samples.py), printed next to their
references. Kept apart from the generation code so that the command imports neither torch nor transformers: it
answers, or refuses a bad command line, at once."""

from __future__ import annotations

import json
import os
import re
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from app import cli
from app.cli import UsageError

PROG = "show_samples.py"


def latest_samples(out_dir: Path) -> Path:
    """The samples file of a run's last evaluation."""
    if out_dir.is_file():
        raise UsageError(f"RUN {out_dir}: a file; give the run's folder (a train.py --out_dir)")
    if not out_dir.is_dir():
        raise UsageError(f"RUN {out_dir}: no such folder; give a train.py --out_dir")
    files = sorted(path for path in (out_dir / "samples").glob("step-*.jsonl") if re.fullmatch(r"step-\d+", path.stem))
    if not files:
        raise UsageError(f"RUN {out_dir}: no samples/ in it; give a train.py --out_dir that ran with --eval_samples N")
    return files[-1]


def show(out_dir: Path, count: int) -> str:
    """Each prompt (whitespace collapsed; its start and end when long), its reference and what the model wrote."""
    path = latest_samples(out_dir)
    lines = [f"{path}:"]
    for record in samples_in(path)[:count]:
        lines += [f"  prompt     {shortened(visible(' '.join(record['prompt'].split())))}",
                  f"  reference  {indented(visible(record['reference']))}",
                  f"  generated  {indented(visible(record['generated']))}", ""]
    return "\n".join(lines)


def visible(text: str) -> str:
    """Control characters as escapes (`\\x07`), line ends and tabs as they are: an untrained model's BEL rang the
    terminal, and its escape sequences could rewrite what the terminal shows."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


def indented(text: str) -> str:
    """A reference or an answer of several lines (code, a list) with its later lines under its first."""
    return text.replace("\n", "\n" + " " * len("  generated  "))


def shortened(text: str, width: int = 110) -> str:
    """`text`, or its start and its end when longer than `width`: a chat prompt's start is the template's header,
    its end the question and the turn the model answers."""
    if len(text) <= width:
        return text
    return f"{text[:width // 3]} ... {text[-(width - width // 3 - 5):]}"


def samples_in(path: Path) -> list[dict[str, str]]:
    """The records of a samples file; one that is not what train.py writes is one line, not a traceback."""
    try:
        records = [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: not readable as train.py's samples ({error})") from None
    fields = ("prompt", "reference", "generated")
    if not records or not all(isinstance(r, dict) and all(isinstance(r.get(name), str) for name in fields)
                              for r in records):
        raise UsageError(f"{path}: not train.py's samples (each line a prompt, a reference and what was generated)")
    return records


@dataclass
class ShowArgs:
    """Print the first samples of a run's latest evaluation: each prompt's start, its reference and the answer."""

    count: int = 4
    """How many samples to print."""


def parse_show_args(argv: Optional[list[str]] = None) -> tuple[Path, int]:
    parser = cli.command_parser(PROG, ShowArgs.__doc__, [ShowArgs], config=False)
    parser.add_argument("run", metavar="RUN", help="A train.py --out_dir.")
    parser.add_argument("positional_count", metavar="N", nargs="?", type=int, help="Same as --count.")
    arguments = sys.argv[1:] if argv is None else argv
    namespace = cli.parse(parser, arguments)
    counted = any(word == "--count" or word.startswith("--count=") for word in arguments)
    if namespace.positional_count is not None and counted:
        raise UsageError(f"N {namespace.positional_count} and --count {namespace.count}: give one of them")
    count = namespace.positional_count if namespace.positional_count is not None else namespace.count
    if count < 1:
        raise UsageError(f"{'--count' if counted else 'N'} {count}: give at least 1")
    return Path(namespace.run), count


def main(argv: Optional[list[str]] = None) -> None:
    cli.any_text_printable()
    shown = cli.run_command(PROG, lambda: show(*parse_show_args(argv)))
    try:
        print(shown, flush=True)
    except BrokenPipeError:  # `show_samples.py RUN | head`: the reader has what it wanted (a traceback, before)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
