"""generate.py --prompts: the file of prompts a converted model answers (a held-out test set), and what is made of
the answers: each answer's line, and their scores against the references (train.py's sample metrics). No torch here:
a file that cannot be read is refused before the model loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from app.cli import UsageError


@dataclass(frozen=True)
class PromptRow:
    """One prompt of the file, with its line number (for messages) and its expected answer, if the file has one."""

    line: int
    prompt: str
    reference: Optional[str]


@dataclass(frozen=True)
class Answer:
    """What the model wrote for one prompt: the continuation of a plain prompt, or the answer to a chat message or a
    source; how many tokens it wrote and why it stopped."""

    text: str
    new_tokens: int
    stopped: str


def read_prompts(path: Path, prompt_field: str, reference_field: Optional[str]) -> list[PromptRow]:
    """Every non-blank line of a JSON lines file, each an object with text in `prompt_field` (and in
    `reference_field` when given); the first line that is not is refused, with its number and its fields."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--prompts {path}: not readable as UTF-8 text ({error})") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise UsageError(f"--prompts {path}: line {number} is not a JSON object; give one object a line")
        values = [text_field(path, number, record, "--prompt_field", prompt_field)]
        values.append(None if reference_field is None else
                      text_field(path, number, record, "--reference_field", reference_field))
        rows.append(PromptRow(number, *values))
    if not rows:
        raise UsageError(f"--prompts {path}: holds no prompts")
    return rows


def text_field(path: Path, number: int, record: dict, flag: str, field: str) -> str:
    value = record.get(field)
    if not isinstance(value, str):
        kind = "has no field" if value is None else f"has a {type(value).__name__}, not text, in"
        raise UsageError(f"--prompts {path}: line {number} {kind} {field!r} ({flag}); its fields: "
                         f"{', '.join(map(str, record)) or 'none'}")
    return value


def answer_record(row: PromptRow, answer: Answer) -> dict[str, object]:
    """A line of --output: the keys of train.py's samples files, and the answer's length and ending."""
    record: dict[str, object] = {"prompt": row.prompt}
    if row.reference is not None:
        record["reference"] = row.reference
    return record | {"generated": answer.text, "new_tokens": answer.new_tokens, "stopped": answer.stopped}


def scores_line(rows: list[PromptRow], answers: list[Answer], reference_field: str) -> str:
    """The answers scored against the references as train.py scores its generation samples."""
    from app.evaluation.samples import sample_metrics

    metrics = sample_metrics([answer.text for answer in answers], [row.reference or "" for row in rows],
                             [answer.new_tokens for answer in answers])
    return (f"{len(answers)} answers scored against {reference_field!r}: exact match "
            f"{metrics['sample_exact_match']:.4f} | ROUGE-1 {metrics['sample_rouge1']:.4f} | ROUGE-2 "
            f"{metrics['sample_rouge2']:.4f} | ROUGE-L {metrics['sample_rougeL']:.4f} | ROUGE-Lsum "
            f"{metrics['sample_rougeLsum']:.4f} | mean length {metrics['sample_length']:.1f} tokens")
