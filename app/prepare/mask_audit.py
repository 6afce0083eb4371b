"""The loss-mask audit: which roles' tokens a chat template's masks train, read independently of those masks.

The labels come from the template's prefixes (chat_template.py). The audit reads each token's role from where it
sits in the rendered text instead: inside a message's content (system, user, assistant, an assistant message with
`"weight": 0`, other roles such as tool) or outside every content (template text: BOS, role headers, end-of-turn
tokens). Counted against the labels, it
shows what training will learn from, per role; a template whose prefixes mislead the masks, so that they train the
users' messages or almost none of the assistant's, is refused before anything is written (the trap other trainers'
users meet only after training: all-zero assistant masks with stock Llama-3.1 and Qwen3 templates).

Each message's content is searched for after the render of the messages before it (with the generation prompt
before an assistant message), never inside a header: an answer "A" is not the "A" of "### Assistant:".

The first `AUDITED_EXAMPLES` examples of each split are audited, as they were written (cut to --block_size): shares
to the percent at a fixed cost (one more render per message and one tokenization with character offsets per
example, which would add half again to encoding every example). An example whose tokens the offsets do not
reproduce (a message holding special-token text, or a tokenizer without offsets) is not audited, and counted as such.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from functools import partial
from itertools import repeat
from dataclasses import dataclass
from typing import Optional

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from app.choices import IGNORE_INDEX
from app.prepare.args import UsageError
from app.prepare.chat import template_messages, untrained

AUDITED_EXAMPLES = 1000
UNTRAINED = "assistant (weight 0)"
ROLES = ("system", "user", "assistant", UNTRAINED, "other", "template")
PROMPT_ROLES = ("system", "user", "other")
LEAST_ASSISTANT_SHARE = 0.5
"""Below this share of the assistant's tokens trained, the masks miss the responses (a cut keeps what it keeps
trained: only the first token of an example, never a response's, goes untrained)."""


@dataclass(frozen=True)
class RoleCount:
    tokens: int
    trained: int

    @property
    def share(self) -> float:
        return self.trained / self.tokens if self.tokens else 0.0


def token_roles(tokenizer: PreTrainedTokenizerBase, template: str, messages: list[dict[str, str]],
                written: list[int], tools: Optional[str] = None) -> Optional[list[str]]:
    """The role of each of the `written` tokens of a chat (offered the `tools` of its record), from its rendered
    text; None when unauditable. Tool calls and tools are template text, as headers are."""
    roles = [UNTRAINED if untrained(m) else m["role"] if m["role"] in ROLES[:3] else "other" for m in messages]
    messages = template_messages(messages)  # as the encoder renders them
    render = partial(tokenizer.apply_chat_template, chat_template=template, tokenize=False,
                     tools=json.loads(tools) if tools else None)
    text = render(messages)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    except NotImplementedError:  # a tokenizer without character offsets
        return None
    if encoded["input_ids"][: len(written)] != written:
        return None
    owner = ["template"] * len(text)
    cursor = 0
    for k, message in enumerate(messages):
        content = message["content"].strip()
        after = _prefix_end(render, messages, k, text)
        start = text.find(content, max(cursor, after - _overlap(text, after, content))) if content else -1
        if start < 0:
            continue  # a template that rewrites the content: its characters stay template text
        owner[start:start + len(content)] = [roles[k]] * len(content)
        cursor = start + len(content)
    return [owner[a] if a < len(owner) else "template" for a, _ in encoded["offset_mapping"][: len(written)]]


def _overlap(text: str, end: int, content: str, most: int = 64) -> int:
    """How many characters before `end` in `text` begin `content`: a generation prompt that writes the start of the
    answer (Qwen3-Thinking's `<think>\n`), whose answer was counted as template text."""
    return next((j for j in range(min(end, len(content), most), 0, -1) if text[end - j:end] == content[:j]), 0)


def _prefix_end(render: Callable[..., str], messages: list[dict[str, str]], k: int, text: str) -> int:
    """Where message k can start in the chat's `text`: after the render of the messages before it (with the
    generation prompt before an assistant message), so that its content is never found in a header ("A" in
    "### Assistant:"); 0 when that render is not a prefix of the text or fails (the search starts after the previous
    message anyway)."""
    if k == 0:
        return 0
    try:
        prefix = render(messages[:k], add_generation_prompt=messages[k]["role"] == "assistant")
    except Exception:  # noqa: BLE001 (a template that needs the whole chat: the cursor alone bounds the search)
        return 0
    return len(prefix) if text.startswith(prefix) else 0


def audit_split(records: Dataset, encoded: Dataset, tokenizer: PreTrainedTokenizerBase,
                template: str) -> dict[str, object]:
    """The audit of a split's first `AUDITED_EXAMPLES` examples (its records, and their encoded examples)."""
    count = min(len(records), AUDITED_EXAMPLES)
    audited = records.select(range(count))
    return audit(audited["messages"], encoded.select(range(count)), tokenizer, template, audited["tools"])


def audit(chats: Iterable[list[dict[str, str]]], examples: Iterable[dict], tokenizer: PreTrainedTokenizerBase,
          template: str, tools: Optional[Iterable[Optional[str]]] = None) -> dict[str, object]:
    """Tokens and trained tokens per role over the chats' examples that were kept (`input_ids`, `labels`, `dropped`
    as encoded), each chat offered its record's `tools` (none when not given)."""
    tokens, trained = Counter(), Counter()
    audited = unaudited = 0
    for chat, example, offered in zip(chats, examples, repeat(None) if tools is None else tools):
        if example["dropped"]:
            continue
        roles = token_roles(tokenizer, template, chat, example["input_ids"], offered)
        if roles is None:
            unaudited += 1
            continue
        audited += 1
        tokens.update(roles)
        trained.update(role for role, label in zip(roles, example["labels"]) if label != IGNORE_INDEX)
    return {"audited_examples": audited, "unaudited_examples": unaudited,
            "roles": {role: {"tokens": tokens[role], "trained": trained[role],
                             "trained_share": round(RoleCount(tokens[role], trained[role]).share, 4)}
                      for role in ROLES if tokens[role]}}


def check_audit(audit: dict[str, object], origin: str, train_on_prompt: bool, where: str) -> None:
    """Refuse masks that train the prompt's messages (unless --train_on_prompt), an answer marked not to be trained,
    or hardly any of the responses."""
    roles = {role: RoleCount(c["tokens"], c["trained"]) for role, c in audit["roles"].items()}
    examples = f"in {where}"
    for role in (*(() if train_on_prompt else PROMPT_ROLES), UNTRAINED):
        if role in roles and roles[role].trained:
            which = "which are marked not to be" if role == UNTRAINED else "which only --train_on_prompt should"
            raise UsageError(f"{origin}: its masks train {roles[role].trained} of the {roles[role].tokens} tokens "
                             f"of {role} messages {examples}, {which}; give another with --chat_template FILE")
    assistant = roles.get("assistant")
    if assistant and assistant.share < LEAST_ASSISTANT_SHARE:
        raise UsageError(f"{origin}: its masks train only {assistant.share:.0%} of the assistant messages' tokens "
                         f"{examples}; give another with --chat_template FILE")


def describe_audit(audit: dict[str, object]) -> str:
    """One line: the share of each role's tokens that is trained."""
    shares = ", ".join(f"{role} {c['trained_share']:.0%} of {c['tokens']:,}" for role, c in audit["roles"].items())
    return f"trained tokens by role ({audit['audited_examples']} examples audited): {shares}"
