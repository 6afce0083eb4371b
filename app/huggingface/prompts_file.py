"""generate.py --prompts: the file of prompts a converted model answers (a held-out test set), and what is made of
the answers: each answer's line, and their scores against the references (train.py's sample metrics). No torch here:
a file that cannot be read is refused before the model loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from app.cli import UsageError
from app.prepare.chat import (chat_problem, openai_messages, pair_prompt, read_tools, stored_message,
                              template_messages, tools_problem, unoffered_call)


Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PromptRow:
    """One prompt of the file (a text, or a chat's messages before its last), with its line number (for messages)
    and its expected answer, if the file has one."""

    line: int
    prompt: Union[str, Messages]
    reference: Optional[str]
    tools: Optional[list] = None
    """The tools a chat offers, which the chat template writes with its messages, as prepare_data.py trained it."""
    chat: Optional[list[dict]] = None
    """A chat line's messages as prepare_data.py records them, its last one included: generate.py checks them
    against the chat template, and scores a last message that calls tools as the template writes it
    (`generate.with_reference`)."""


@dataclass(frozen=True)
class Answer:
    """What the model wrote for one prompt: the continuation of a plain prompt, or the answer to a chat message or a
    source; how many tokens it wrote and why it stopped."""

    text: str
    new_tokens: int
    stopped: str
    reasoning: Optional[str] = None
    """The reasoning the model wrote before its answer, in its chat template's block (Qwen3's `<think>`); None
    without one."""
    final: Optional[str] = None
    """What follows that block, the answer proper; None without one."""

    @property
    def scored(self) -> str:
        """What is scored against the reference: the answer after its reasoning, as a reasoning model is evaluated
        (the reference is the test chat's answer, and the reasoning scored with it lowered every score)."""
        return self.text if self.final is None else self.final


def read_prompts(path: Path, prompt_field: str, reference_field: Optional[str], messages_field: Optional[str] = None,
                 input_field: Optional[str] = None, system_field: Optional[str] = None,
                 tools_field: str = "tools") -> list[PromptRow]:
    """Every non-blank line of a JSON lines file, each an object with text in `prompt_field` (and in
    `reference_field` when given), or a chat in `messages_field`; the first line that is not is refused, with its
    number and its fields. With `input_field` or `system_field` the prompt is the chat prepare_data.py makes of a
    prompt/response row (`pair_prompt`): the model was trained on that, not on the prompt alone."""
    try:  # utf-8-sig: a byte-order mark (Windows editors) is not part of line 1
        lines = path.read_text(encoding="utf-8-sig").split("\n")  # splitlines() also cuts at U+2028 in a string
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
        if messages_field is not None:
            rows.append(chat_row(path, number, record, messages_field, tools_field))
            continue
        prompt: Union[str, Messages] = text_field(path, number, record, "--prompt_field", prompt_field)
        if input_field is not None or system_field is not None:
            extra, system = (text_field(path, number, record, flag, field, optional=True) if field else ""
                             for flag, field in (("--input_field", input_field), ("--system_field", system_field)))
            prompt = pair_prompt(prompt, extra, system)
        reference = None if reference_field is None else text_field(path, number, record, "--reference_field",
                                                                     reference_field)
        rows.append(PromptRow(number, prompt, reference))
    if not rows:
        raise UsageError(f"--prompts {path}: holds no prompts")
    return rows


def text_field(path: Path, number: int, record: dict, flag: str, field: str, optional: bool = False) -> str:
    """The line's text in `field`; an optional field may be missing or null ("", as prepare_data.py reads it)."""
    value = record.get(field)
    if optional and value is None:
        return ""
    if not isinstance(value, str):
        kind = ("has no field" if field not in record else "has null in" if value is None
                else f"has a {type(value).__name__}, not text, in")
        raise UsageError(f"--prompts {path}: line {number} {kind} {field!r} ({flag}); its fields: "
                         f"{', '.join(map(str, record)) or 'none'}")
    return value


def chat_row(path: Path, number: int, record: dict, field: str, tools_field: str = "tools") -> PromptRow:
    """A chat whose last message, an assistant's, is the reference, and the messages before it the prompt."""
    chat = openai_messages(record.get(field))
    where = f"--prompts {path}: line {number}"
    if chat is None:
        raise UsageError(f"{where} has no field {field!r} (--messages_field); its fields: "
                         f"{', '.join(map(str, record)) or 'none'}")
    tools = record.get(tools_field)
    problem = chat_problem(chat) or tools_problem(tools) or unoffered_call(chat, tools)  # as prepare_data.py reads it
    if problem:
        raise UsageError(f"{where}: {field!r} {problem}")
    if len(chat) < 2 or chat[-1]["role"] != "assistant" or chat[0]["role"] == "assistant":
        raise UsageError(f"{where}: {field!r} does not end with an assistant message after a system or user one; "
                         "the last assistant message is the answer to score")
    stored = [stored_message(m) for m in chat]
    *prompt, last = template_messages(stored)
    return PromptRow(number, prompt, last["content"], read_tools(tools), stored)


def answer_record(row: PromptRow, answer: Answer) -> dict[str, object]:
    """A line of --output: the keys of train.py's samples files, and the answer's length and ending."""
    record: dict[str, object] = {"prompt": row.prompt}
    if row.reference is not None:
        record["reference"] = row.reference
    if answer.final is not None:
        record |= {"reasoning": answer.reasoning, "answer": answer.final}
    return record | {"generated": answer.text, "new_tokens": answer.new_tokens, "stopped": answer.stopped}


def scores_line(references: list[str], answers: list[Answer], against: str) -> str:
    """The answers scored against the references as train.py scores its generation samples."""
    from app.evaluation.samples import sample_metrics

    metrics = sample_metrics([answer.scored for answer in answers], references,
                             [answer.new_tokens for answer in answers])
    return (f"{len(answers)} answers scored against {against}: exact match "
            f"{metrics['sample_exact_match']:.4f} | ROUGE-1 {metrics['sample_rouge1']:.4f} | ROUGE-2 "
            f"{metrics['sample_rouge2']:.4f} | ROUGE-L {metrics['sample_rougeL']:.4f} | ROUGE-Lsum "
            f"{metrics['sample_rougeLsum']:.4f} | mean length {metrics['sample_length']:.1f} tokens")
