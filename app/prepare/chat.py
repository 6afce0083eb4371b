"""Supervised records: prompt/response pairs (Alpaca style) and chats, both read as a list of {role, content} messages.

A pair becomes `[system?] + [user: prompt (+ "\\n\\n" + input)] + [assistant: response]`, so that both shapes go
through the same chat template and the same masking (`chat_template.py`). Every row is checked as it is read, and a
bad one is refused in one line naming the option, the row and the input: an empty (or blank, or missing) prompt or
response, an empty user or assistant message, a chat without an assistant message, a message the chat template does
not render, or a value that is not text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Optional

from datasets import Dataset, Features, List, Value

from app.prepare.args import PrepareArgs
from app.prepare.corpus import Row, ToRecords, quiet_progress, require_fields
from app.prepare.workspace import arrow_file

if TYPE_CHECKING:
    from app.prepare.chat_template import ChatText

PROBE_CHAT = [
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "Say goodbye."},
    {"role": "assistant", "content": "Goodbye."},
]
"""A chat every template must handle (chat_template.check_template), checked before any data is encoded."""

MESSAGES = Features({"messages": List({"role": Value("string"), "content": Value("string")})})
PAIR_OPTIONS = ("prompt_field", "response_field", "input_field", "system_field")


def chat_records(args: PrepareArgs, rendered: Optional[ChatText] = None) -> ToRecords:
    """What turns one input's rows into `messages` records, for --messages_field or --prompt_field/--response_field;
    `rendered` gives a chat's text as the chat template renders it (or None), to refuse messages it leaves out."""
    if args.messages_field is not None:
        to_messages = partial(chat_messages, rendered=rendered)
        return partial(_records, fields={"messages_field": args.messages_field}, to_messages=to_messages)
    fields = {option: getattr(args, option) for option in PAIR_OPTIONS if getattr(args, option) is not None}
    return partial(_records, fields=fields, to_messages=pair_messages)


def _records(
    table: Dataset, source: str, fields: dict[str, str], to_messages: Callable[[dict, Row], list[dict[str, str]]]
) -> Dataset:
    """The messages of every row of one input; `fields` maps each option to the input field it names."""
    require_fields(table, fields, source)

    def convert(batch: dict, indices: list[int]) -> dict:
        values = [{option: batch[field][i] for option, field in fields.items()} for i in range(len(indices))]
        return {"messages": [to_messages(row, Row(fields, index, source)) for index, row in zip(indices, values)]}

    with quiet_progress():
        return table.map(
            convert, batched=True, with_indices=True, remove_columns=table.column_names, features=MESSAGES,
            **arrow_file("chats"),
        )


def pair_messages(values: dict, row: Row) -> list[dict[str, str]]:
    """A prompt/response row as a chat; an empty, blank or missing prompt or response is refused (the response would
    be trained without a question, or there is nothing to train), an empty system or input skipped."""
    prompt, response, extra, system = (row.text(option, values.get(option)) for option in PAIR_OPTIONS)
    if not prompt.strip():
        raise row.error("prompt_field", "is empty; every example needs a prompt to answer")
    if not response.strip():
        raise row.error("response_field", "is empty; every example needs a response to train on")
    return [*pair_prompt(prompt, extra, system), {"role": "assistant", "content": response}]


def pair_prompt(prompt: str, extra: str = "", system: str = "") -> list[dict[str, str]]:
    """The messages before the response that a prompt/response row becomes: [system?] + [user: prompt (+ "\\n\\n" +
    input)]. generate.py asks a trained model with the same (--input_field, --system_field)."""
    user = f"{prompt}\n\n{extra}" if extra else prompt
    return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": user}]


TOOL_CALL_KEYS = ("tool_calls", "function_call")
"""Where OpenAI-style chats put an assistant's calls (`content` may then be null)."""
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
"""Where chats of reasoning models put an assistant's reasoning beside its answer (Qwen3's template reads the first)."""


def chat_messages(
    values: dict, row: Row, rendered: Optional[ChatText] = None
) -> list[dict[str, str]]:
    """A chat as {role, content} messages; it must start with a system or user message and have an assistant one,
    no user or assistant message may be empty or blank, and the chat template must render every message
    (`rendered`)."""
    chat = values["messages_field"]
    calling = next((k for k, m in enumerate(chat or []) if isinstance(m, dict)
                    and any(m.get(key) for key in TOOL_CALL_KEYS)), None)
    if calling is not None:  # kept as {role, content}, the assistant's call was trained without it
        raise row.error("messages_field", f"has a message ({calling + 1}, role {chat[calling].get('role')!r}) with "
                        "tool calls, which are not trained: its text would be trained without the call, and the tool's "
                        "answer would follow a call never made; leave out chats with tool calls")
    reasoning = next(((k, key) for k, m in enumerate(chat or []) if isinstance(m, dict)
                      for key in REASONING_KEYS if m.get(key)), None)
    if reasoning is not None:  # kept as {role, content}, the answer was trained without the reasoning before it
        k, key = reasoning
        raise row.error("messages_field", f"has a message ({k + 1}) with reasoning in {key!r}, which would not be "
                        "trained: the answer would be learnt without it; put the reasoning in the message's content "
                        "as the model writes it (Qwen3: '<think>\\n...\\n</think>\\n\\n' before the answer), or leave "
                        "the field out")
    if not isinstance(chat, list) or not chat or not all(_is_message(m) for m in chat):
        raise row.error("messages_field", "is not a list of {role, content} messages with text content")
    messages = [{"role": m["role"], "content": m["content"]} for m in chat]
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise row.error("messages_field", "has no assistant message to train on")
    if roles[0] == "assistant":
        raise row.error("messages_field", "starts with an assistant message; a chat starts with system or user")
    for role in ("user", "assistant"):
        if any(not m["content"].strip() for m in messages if m["role"] == role):
            raise row.error("messages_field", f"has an empty {role} message")
    if rendered is not None:
        check_rendered(messages, rendered, row)
    return messages


def check_rendered(messages: list[dict[str, str]], rendered: ChatText, row: Row) -> None:
    """Refuse a message that the chat template does not render: a template that renders only the roles it knows
    (Qwen's skips "human") drops it silently, and the answer after it would be trained without its prompt.

    The chat is rendered with each message's content replaced by a marker of its own, so that a dropped message is
    found also where its text appears elsewhere in the chat (a question asked twice, a prompt that its answer
    quotes): searching the rendered chat for the text itself missed both. One render per chat. A template that
    raises on this chat's roles (Gemma's on a system message, turns that do not alternate) refuses the row; one that
    fails on every chat is check_template's to report, and a message with blank content (a system message) too."""
    marked = [{"role": m["role"], "content": _marker(k)} for k, m in enumerate(messages)]
    text = rendered(marked)
    if text is None and rendered(PROBE_CHAT) is not None:
        raise row.error("messages_field", f"is refused by the chat template ({rendered.failure(marked)}); leave such "
                        "chats out or give a template that takes them with --chat_template FILE")
    for k, message in enumerate(messages):
        if text is not None and message["content"].strip() and _marker(k) not in text:
            advice = ("where it stands (Mistral's v0.3 template writes a system message only before the last user "
                      "message); leave it out" if message["role"] in ("system", "user", "assistant")
                      else "; use the roles system, user and assistant")
            raise row.error("messages_field", f"has a message ({k + 1}) of role {message['role']!r} that the chat "
                            f"template does not render {advice}, or give a template that renders it with "
                            "--chat_template FILE")


def _marker(k: int) -> str:
    """Message k's stand-in content: text no template writes, and no marker inside another (k=1 in k=10)."""
    return f"@@message-{k}@@"


def _is_message(message: object) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and bool(message["role"])
        and isinstance(message.get("content"), str)
    )


def chat_texts(records: Dataset) -> Iterator[str]:
    """Every message's text, to train a tokenizer on (--vocab_size)."""
    for batch in records.iter(batch_size=1000):
        for chat in batch["messages"]:
            yield from (message["content"] for message in chat)
