"""Supervised records: prompt/response pairs (Alpaca style) and chats, both read as a list of {role, content} messages.

A pair becomes `[system?] + [user: prompt (+ "\\n\\n" + input)] + [assistant: response]`, so that both shapes go
through the same chat template and the same masking (`chat_template.py`). Every row is checked as it is read, and a
bad one is refused in one line naming the option, the row and the input: an empty (or blank, or missing) prompt or
response, an empty user or assistant message, a chat without an assistant message to train, a message the chat
template does not render, or a value that is not text.

An assistant message with OpenAI's `"weight": 0` stays in the chat as context and is not trained: its records keep
`weight` 0 (None for every other message), which the masks (`chat_template.ChatEncoder`) and the loss-mask audit read.

An assistant's reasoning beside its answer (`reasoning_content`, `reasoning` or `thinking`) is given to the template,
which must write it where the answer is trained (Qwen3's writes `reasoning_content`), as tool calls are.

Chats that call tools are read in OpenAI's shape, as transformers' chat templates take them: `tools` beside the
messages (JSON schemas), an assistant's `tool_calls` and the `tool` messages that answer them. The chat template must
write the tools and every call (each checked per chat, `rendering_problem`): one that leaves them out would train the
answers without them. Records keep the calls and the tools as JSON text, since their arguments and schemas differ
from row to row, and an Arrow struct would give every row the keys of all rows (`template_messages` reads them
back; `without_struct_nulls` takes those out of inputs read as structs).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Optional

from datasets import Dataset, Features, LargeList, List, Sequence, Value

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

REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
"""Where chats of reasoning models put an assistant's reasoning beside its answer: Qwen3's template reads the first,
GPT-OSS's the last."""
TEMPLATE_KEYS = ("tool_calls", "tool_call_id", "name", *REASONING_KEYS)
"""What a message carries beside its role and content for the chat template to write: the calls of a chat that calls
tools (Mistral's needs the calls' ids and the tool messages' tool_call_id; some templates name a tool's answer by
`name`), and an assistant's reasoning."""
MESSAGES = Features({
    "messages": List({"role": Value("string"), "content": Value("string"), "weight": Value("int8"),
                      **{key: Value("string") for key in TEMPLATE_KEYS}}),
    "tools": Value("string"),
})
PAIR_OPTIONS = ("prompt_field", "response_field", "input_field", "system_field")


def chat_records(args: PrepareArgs, rendered: Optional[ChatText] = None) -> ToRecords:
    """What turns one input's rows into `messages` records, for --messages_field or --prompt_field/--response_field;
    `rendered` gives a chat's text as the chat template renders it (or None), to refuse messages it leaves out."""
    if args.messages_field is not None:
        to_messages = partial(chat_messages, rendered=rendered)
        return partial(_records, fields={"messages_field": args.messages_field}, to_messages=to_messages,
                       tools_field=args.tools_field)
    fields = {option: getattr(args, option) for option in PAIR_OPTIONS if getattr(args, option) is not None}
    skip_empty = args.empty_examples == "skip"
    return partial(_records, fields=fields, to_messages=partial(pair_messages, skip_empty=skip_empty),
                   skip_empty=skip_empty)


def _records(
    table: Dataset, source: str, fields: dict[str, str], to_messages: Callable[[dict, Row], list[dict[str, str]]],
    skip_empty: bool = False, tools_field: Optional[str] = None
) -> Dataset:
    """The messages of every row of one input, and the tools a chat offers (`tools_field`, else a `tools` field);
    `fields` maps each option to the input field it names; without the empty chats `to_messages` makes of empty rows
    under `skip_empty`."""
    require_fields(table, fields | ({"tools_field": tools_field} if tools_field else {}), source)
    tools = tools_field or ("tools" if "messages_field" in fields and "tools" in table.column_names else None)
    message = element(table.features[fields["messages_field"]]) if "messages_field" in fields else None
    calls_feature = message.get("tool_calls") if isinstance(message, dict) else None
    tools_feature = table.features[tools] if tools is not None else None

    def convert(batch: dict, indices: list[int]) -> dict:
        values = [{option: batch[field][i] for option, field in fields.items()} for i in range(len(indices))]
        if tools is not None:  # read beside the messages
            values = [value | {"tools": batch[tools][i]} for i, value in enumerate(values)]
        if "messages_field" in fields:
            values = [without_struct_nulls(value, calls_feature, tools_feature) for value in values]
        return {"messages": [to_messages(row, Row(fields, index, source)) for index, row in zip(indices, values)],
                "tools": [stored_tools(row.get("tools")) for row in values]}

    with quiet_progress():
        chats = table.map(
            convert, batched=True, with_indices=True, remove_columns=table.column_names, features=MESSAGES,
            **arrow_file("chats"),
        )
        if skip_empty:
            chats = chats.filter(lambda chats: [bool(messages) for messages in chats], batched=True,
                                 input_columns="messages", **arrow_file("chats"))
        return chats


def pair_messages(values: dict, row: Row, skip_empty: bool = False) -> list[dict[str, str]]:
    """A prompt/response row as a chat; an empty, blank or missing prompt or response is refused (the response would
    be trained without a question, or there is nothing to train), or under `skip_empty` (--empty_examples skip) an
    empty chat, left out; an empty system or input skipped."""
    prompt, response, extra, system = (row.text(option, values.get(option)) for option in PAIR_OPTIONS)
    if skip_empty and not (prompt.strip() and response.strip()):
        return []
    if not prompt.strip():
        raise row.error("prompt_field", "is empty; every example needs a prompt to answer (--empty_examples skip "
                                        "leaves such rows out, counted)")
    if not response.strip():
        raise row.error("response_field", "is empty; every example needs a response to train on (--empty_examples "
                                          "skip leaves such rows out, counted)")
    return [*pair_prompt(prompt, extra, system), {"role": "assistant", "content": response}]


def pair_prompt(prompt: str, extra: str = "", system: str = "") -> list[dict[str, str]]:
    """The messages before the response that a prompt/response row becomes: [system?] + [user: prompt (+ "\\n\\n" +
    input)]. generate.py asks a trained model with the same (--input_field, --system_field)."""
    user = f"{prompt}\n\n{extra}" if extra else prompt
    return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": user}]


KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
"""The roles chat templates are written for. Only assistant messages are trained; a role outside these (ShareGPT's
human and gpt, Gemma's model, an Assistant capitalised) was written by the templates that write any role under its
own name: a "gpt" answer was never trained, and a "human" header was learnt that inference never writes."""
RENAMED = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant"}


def chat_messages(
    values: dict, row: Row, rendered: Optional[ChatText] = None
) -> list[dict[str, str]]:
    """A chat as {role, content} messages (`chat_problem` says what a chat must be), with the tool calls of its
    assistant messages and the tools beside it, which the chat template must render whole (`rendered`)."""
    chat, tools = openai_messages(values["messages_field"]), values.get("tools")
    problem = (chat_problem(chat) or tools_problem(tools) or unoffered_call(chat, tools) or weight_problem(chat)
               or turns_problem(chat))
    if problem:
        raise row.error("messages_field", problem)
    messages = [stored_message(m) for m in chat]
    problem = None if rendered is None else rendering_problem(messages, read_tools(tools), rendered)
    if problem:
        raise row.error("messages_field", problem)
    return messages


def openai_messages(chat: object) -> object:
    """A chat's messages in OpenAI's shape: ShareGPT's ({from, value}, as axolotl and LLaMA-Factory read them) as
    {role, content}, human as user and gpt as assistant (`RENAMED`), their other keys kept ("weight"); tool calls
    written as JSON text read (as tools may be). Many chat datasets on the Hub are written so, and were refused.
    Anything else as it is, for `chat_problem` to judge."""
    if not isinstance(chat, list):
        return chat
    if chat and all(isinstance(m, dict) and {"from", "value"} <= m.keys() for m in chat):
        chat = [{key: item for key, item in m.items() if key not in ("from", "value")}
                | {"role": RENAMED.get(m["from"].lower(), m["from"]) if isinstance(m["from"], str) else m["from"],
                   "content": m["value"]} for m in chat]
    return [m | {"tool_calls": _json_or_text(m["tool_calls"])} if isinstance(m, dict)
            and isinstance(m.get("tool_calls"), str) else m for m in chat]


def _json_or_text(text: str) -> object:
    """JSON text read, or the text itself where it is not JSON (for the checks to refuse); blank text is none."""
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return text


def stored_message(message: dict) -> dict:
    """A message as records keep it (`MESSAGES`): an assistant's tool calls as JSON text (`tool_call`), the content
    of a message that only calls tools as ""."""
    calls = message.get("tool_calls")
    return {"role": message["role"], "content": message.get("content") or "",
            "weight": 0 if untrained(message) else None,
            "tool_calls": json.dumps([tool_call(call) for call in calls], ensure_ascii=False) if calls else None,
            **{key: message.get(key) if isinstance(message.get(key), str) else None for key in TEMPLATE_KEYS[1:]}}


def template_messages(messages: list[dict]) -> list[dict]:
    """Records' messages as chat templates read them, and as inference renders them: role, content, and where they
    have them the tool calls (read back from JSON text), the id a tool message answers and its name."""
    return [{"role": m["role"], "content": m["content"],
             **{key: json.loads(m[key]) if key == "tool_calls" else m[key] for key in TEMPLATE_KEYS if m.get(key)}}
            for m in messages]


def tool_call(call: dict) -> dict:
    """One call of `tool_calls` as transformers' templates read it: {"type": "function", "function": {name,
    arguments}} (and its id), the arguments an object. OpenAI writes them as JSON text, which a template's `tojson`
    would write quoted."""
    function = call.get("function", call)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = (json.loads(arguments) if arguments.strip() else None) or {}
    else:
        arguments = arguments or {}
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments},
            **({"id": call["id"]} if isinstance(call.get("id"), str) else {})}


def tool_call_problem(message: dict) -> Optional[str]:
    """What is wrong with a message's tool calls, or None: they must be a list of calls each with a name and
    arguments that are an object or its JSON text, and only an assistant calls tools."""
    calls = message.get("tool_calls")
    if not calls:
        return None
    if message.get("role") != "assistant":
        return f"with tool calls, which only an assistant message makes (role {message.get('role')!r})"
    if not isinstance(calls, list) or not all(_is_call(call) for call in calls):
        return ("whose tool_calls are not a list of {\"type\": \"function\", \"function\": {\"name\", "
                "\"arguments\"}}, each with a name and its arguments as an object or its JSON text")
    return None


def _is_call(call: object) -> bool:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
        return False
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments.strip():
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return False
    return arguments is None or isinstance(arguments, dict) or arguments == ""


def without_struct_nulls(values: dict, calls_feature: object, tools_feature: object) -> dict:
    """A chat row without the null entries that Arrow structs gave its tool calls and tools (features `calls_feature`
    and `tools_feature`, the input's): a struct gives each row's objects the keys of every row's (a tool's schema the
    `enum` of another's, a call the arguments of another function), null where a row has none. Parquet files and
    Hub datasets hold structs, and so does a JSON input when datasets reads it as one (several files, or a first
    block of rows alike, give the others' objects their keys); a null the data itself holds there is left out with
    them. Objects read as JSON (datasets' Json feature: a JSON file's rows whose keys differ) and JSON text keep
    their own."""
    chat = values["messages_field"]
    if isinstance(chat, list):
        chat = [m | {"tool_calls": struct_nulls_out(m["tool_calls"], calls_feature)}
                if isinstance(m, dict) and m.get("tool_calls") else m for m in chat]
    return values | {"messages_field": chat, "tools": struct_nulls_out(values.get("tools"), tools_feature)}


def struct_nulls_out(value: object, feature: object) -> object:
    """`value` without the null entries of the objects its `feature` reads as structs, at every depth."""
    if isinstance(value, dict) and isinstance(feature, dict):
        return {key: struct_nulls_out(item, feature.get(key)) for key, item in value.items() if item is not None}
    if isinstance(value, list) and element(feature) is not None:
        return [struct_nulls_out(item, element(feature)) for item in value]
    return value


def element(feature: object) -> object:
    """What each item of a list feature is (datasets' List, LargeList or Sequence, or a Python list); None for
    another feature."""
    if isinstance(feature, list):
        return feature[0] if feature else None
    return getattr(feature, "feature", None) if isinstance(feature, (List, LargeList, Sequence)) else None


def chat_problem(chat: object) -> Optional[str]:
    """What is wrong with a chat's messages, said after its row (prepare_data.py) or line (generate.py --prompts):
    it must be {role, content} messages with text, of the known roles, an assistant's tool calls and reasoning in
    the shapes templates read (whether the template writes them is `rendering_problem`'s to say)."""
    messages = chat if isinstance(chat, list) else []
    legacy = next((k for k, m in enumerate(messages) if isinstance(m, dict) and m.get("function_call")), None)
    if legacy is not None:  # kept as {role, content}, the assistant's call was trained without it
        return (f"has a message ({legacy + 1}) with OpenAI's legacy function_call: write it as tool_calls, "
                "[{\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}]")
    calls = next(((k, problem) for k, m in enumerate(messages) if isinstance(m, dict)
                  for problem in [tool_call_problem(m)] if problem), None)
    if calls is not None:
        return f"has a message ({calls[0] + 1}) {calls[1]}"
    reasoning = next(((k, key) for k, m in enumerate(messages) if isinstance(m, dict) for key in REASONING_KEYS
                      if m.get(key) not in (None, "")  # blank: none (a table's export fills every row's field)
                      and (m.get("role") != "assistant" or not isinstance(m[key], str))), None)
    if reasoning is not None:
        k, key = reasoning
        return (f"has a message ({k + 1}, role {messages[k].get('role')!r}) with {key!r} that is not an assistant's "
                "reasoning as text")
    parts = next((k for k, m in enumerate(messages) if isinstance(m, dict) and isinstance(m.get("content"), list)),
                 None)
    if parts is not None:
        return (f"has a message ({parts + 1}) whose content is a list of parts, not text: join its text parts into "
                "one string (text alone is trained)")
    if not messages:
        return "is not a list of {role, content} messages with text content"
    bad = next((k for k, m in enumerate(messages) if not _is_message(m)), None)
    if bad is not None:
        return (f"has a message ({bad + 1}) without a role and text content (null content only in an assistant's "
                "message that calls tools): it is not a {role, content} message")
    unknown = next((m["role"] for m in messages if m["role"] not in KNOWN_ROLES), None)
    if unknown is not None:
        rename = f" (write {unknown!r} as {RENAMED[unknown.lower()]!r})" if unknown.lower() in RENAMED else ""
        return (f"has a message of role {unknown!r}, not one of {', '.join(KNOWN_ROLES)}: only assistant messages "
                f"are trained, and a template writes another role under its own name{rename}")
    return None


def turns_problem(messages: list[dict]) -> Optional[str]:
    """A chat to train on starts with a system or user message and has an assistant one; no user message, nor an
    assistant message to train, is empty or blank (one of `"weight": 0` is context: a call-only turn whose call
    was left out)."""
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        return "has no assistant message to train on"
    if all(untrained(m) for m in messages if m["role"] == "assistant"):
        return "has no assistant message to train on: each has \"weight\": 0"
    if roles[0] == "assistant":
        return "starts with an assistant message; a chat starts with system or user"
    empty = next((k for k, m in enumerate(messages) if m["role"] in ("user", "assistant")
                  and not (m.get("content") or "").strip() and not m.get("tool_calls") and not untrained(m)), None)
    if empty is None:
        return None
    fix = ("give it the answer to train, or \"weight\": 0 to keep it as context only" if roles[empty] == "assistant"
           else "give it its text")
    return f"has an empty {roles[empty]} message ({empty + 1}); {fix}, or leave the chat out"


def untrained(message: dict) -> bool:
    """An assistant message marked not to be trained (OpenAI's `"weight": 0`): the chat's context, not its answer.
    OpenAI reads `weight` on assistant messages only."""
    return message["role"] == "assistant" and message.get("weight") == 0


def weight_problem(messages: list[dict]) -> Optional[str]:
    """An assistant message's `weight` other than OpenAI's 0 (not trained) or 1 (trained): a 0.5 would be read as
    neither."""
    odd = next((k for k, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight") is not None
                and (isinstance(m["weight"], str) or m["weight"] not in (0, 1))), None)
    if odd is None:
        return None
    return (f"has an assistant message ({odd + 1}) with \"weight\": {messages[odd]['weight']!r}: write 1 to train it "
            "or 0 to keep it as context only (OpenAI's weights)")


def read_tools(tools: object) -> Optional[list]:
    """The tools a chat offers (OpenAI's and Qwen's `tools` beside the messages: JSON schemas), None for none. Tools
    written as JSON text (many function-calling datasets) are read as such: "[]" offers none."""
    read = _json_or_text(tools) if isinstance(tools, str) else tools  # text that is not JSON: tools_problem refuses it
    return read or None


def tools_problem(tools: object) -> Optional[str]:
    """What is wrong with a chat's tools, or None: a list of JSON objects, or its text."""
    offered = read_tools(tools)
    if offered is None or (isinstance(offered, list) and all(isinstance(tool, dict) for tool in offered)
                           and all(isinstance(tool_name(tool), (str, type(None))) for tool in offered)):
        return None
    return ("offers 'tools' that are not a list of tool schemas (JSON objects, or the JSON text of that list, each "
            "named by text)")


def tool_name(tool: dict) -> object:
    """The name of an offered tool: OpenAI's {"type": "function", "function": {"name", ...}}, or {"name", ...}."""
    function = tool.get("function", tool)
    return function.get("name") if isinstance(function, dict) else None


def unoffered_call(chat: list[dict], tools: object) -> Optional[str]:
    """A call of a tool the chat does not offer, where it offers some: the call would be learnt for a tool the
    model is not shown (tools kept under another field, a misspelt name). A chat that offers none is trained as
    inference without tools renders it."""
    names = {tool_name(tool) for tool in read_tools(tools) or []} - {None}
    if not names:
        return None
    called = next(((k, tool_call(call)["function"]["name"]) for k, m in enumerate(chat) for call in m.get("tool_calls")
                   or () if tool_call(call)["function"]["name"] not in names), None)
    if called is None:
        return None
    return (f"has a message ({called[0] + 1}) that calls {called[1]!r}, which is not one of the tools it offers "
            f"({', '.join(sorted(map(str, names)))}): the call would be learnt for a tool the model is not shown")


def stored_tools(tools: object) -> Optional[str]:
    """A chat's tools as records keep them: JSON text, None for none."""
    offered = read_tools(tools)
    return json.dumps(offered, ensure_ascii=False) if offered else None


def rendering_problem(messages: list[dict], tools: Optional[list], rendered: ChatText,
                      with_template: str = " with --chat_template FILE") -> Optional[str]:
    """What the chat template would leave out of a chat (records' `messages`, offered `tools`), or None: a message
    that the chat template does not render (a template that renders only the roles it knows, Qwen's skips "human",
    drops it silently, and the answer after it would be trained without its prompt), a tool call, the tools, an
    answer's reasoning, or part of an answer to train (`dropped_from_answer`). prepare_data.py refuses such a row;
    generate.py such a line (`with_template` says where a template that renders it is given).

    The chat is rendered with each message's content replaced by a marker of its own, so that a dropped message is
    found also where its text appears elsewhere in the chat (a question asked twice, a prompt that its answer
    quotes): searching the rendered chat for the text itself missed both. One render per chat. A template that
    raises on this chat's roles (Gemma's on a system message, turns that do not alternate) refuses the row; one that
    fails on every chat is check_template's to report, and a message with blank content (a system message) too.
    Each tool call is marked by its name and its arguments, and the tools must change what the template writes; a
    trained answer's reasoning is marked as its content is."""
    marked = [m | {"content": _marker(k)} | {key: _marker(k, key) for key in REASONING_KEYS if key in m}
              | ({"tool_calls": [{**call, "function": {"name": _marker(k, f"call-{j}"),
                                                       "arguments": {_marker(k, f"arguments-{j}"): 0}}}
                                 for j, call in enumerate(m["tool_calls"])]} if "tool_calls" in m else {})
              for k, m in enumerate(template_messages(messages))]
    text = rendered(marked, tools=tools)
    if text is None:
        if rendered(PROBE_CHAT) is None:
            return None  # a template that fails on every chat: check_template says so
        return (f"is refused by the chat template ({rendered.failure(marked, tools)}); leave such chats out or give a "
                f"template that takes them{with_template}")
    for k, message in enumerate(messages):
        if message["content"].strip() and _marker(k) not in text:
            advice = ("where it stands, beside its tool calls (a template that writes only the calls of such a "
                      "message: Llama-3.1's, Mistral's); leave the content out" if message.get("tool_calls")
                      else "where it stands (Mistral's v0.3 template writes a system message only before the last "
                      "user message); leave it out" if message["role"] in ("system", "user", "assistant")
                      else "(a template for system, user and assistant only); leave it out")
            return (f"has a message ({k + 1}) of role {message['role']!r} that the chat template does not render "
                    f"{advice}, or give a template that renders it{with_template}")
    unwritten = next((k for k, m in enumerate(marked) for j in range(len(m.get("tool_calls", ())))
                      if _marker(k, f"call-{j}") not in text or _marker(k, f"arguments-{j}") not in text), None)
    if unwritten is not None:
        return (f"has a message ({unwritten + 1}) whose tool calls the chat template does not write whole (their "
                "names and arguments): the answer after them would be trained without them; give a template that "
                f"renders tool_calls{with_template}, or leave such chats out")
    in_python = next((k for k, m in enumerate(marked) for j in range(len(m.get("tool_calls", ())))
                      if f"'{_marker(k, f'arguments-{j}')}'" in text), None)
    if in_python is not None:  # `{{ tool_call.arguments }}` without tojson: a dict's repr, which no parser reads
        return (f"has a message ({in_python + 1}) whose tool calls' arguments the chat template writes as Python "
                "({'city': 'Paris'}), not JSON: the model would learn to call tools so; give a template that writes "
                f"them with tojson{with_template}")
    unthought = next(((k, key) for k, m in enumerate(marked) for key in REASONING_KEYS
                      if key in m and not untrained(messages[k]) and m[key] not in text), None)
    if unthought is not None:
        return (f"has a message ({unthought[0] + 1}) with reasoning in {unthought[1]!r} that the chat template does "
                "not write there (Qwen3's writes reasoning_content only after the last user message): the answer "
                f"would be learnt without it; give a template that renders it{with_template}, put the reasoning in "
                "the message's content as the model writes it (Qwen3: '<think>\\n...\\n</think>\\n\\n' before the "
                "answer), mark an earlier answer \"weight\": 0 to keep it as context, or leave the field out")
    if tools and rendered(marked) == text:
        return ("offers tools (its 'tools' field) that the chat template does not write: the answers would be "
                f"trained without them; give a template that renders tools{with_template}, or leave the field out")
    dropped = dropped_from_answer(messages, rendered(template_messages(messages), tools=tools) or "")
    if dropped is not None:
        part = ("its reasoning (DeepSeek-R1's first template keeps only what follows </think>)"
                if "</think>" in messages[dropped]["content"] else "part of it")
        return (f"has an assistant message ({dropped + 1}) of which the chat template drops {part}: the model would "
                f"learn the answer without it; give a template that renders it whole{with_template}, or mark the "
                "message \"weight\": 0 to keep it as context only")
    return None


def dropped_from_answer(messages: list[dict[str, str]], text: str) -> Optional[int]:
    """The first trained assistant message whose content is not in the chat's rendered `text`, all whitespace left
    out (a template may trim it, or space a reasoning block its own way, as Qwen3's does); None when each is."""
    bare = "".join(text.split())
    return next((k for k, m in enumerate(messages) if m["role"] == "assistant" and not untrained(m)
                 and "".join(m["content"].split()) not in bare), None)


def _marker(k: int, part: str = "") -> str:
    """Message k's stand-in content, or that of another part of it (a call's name, its reasoning): text no template
    writes, and no marker inside another (k=1 in k=10)."""
    return f"@@message-{k}{'-' + part if part else ''}@@"


def _is_message(message: object) -> bool:
    """A role, and text content (none, or null, in an assistant message that calls tools)."""
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and bool(message["role"])
        and (isinstance(message.get("content"), str) or (message.get("content") is None and message.get("tool_calls")))
    )


def chat_texts(records: Dataset) -> Iterator[str]:
    """Every message's text, to train a tokenizer on (--vocab_size)."""
    for batch in records.iter(batch_size=1000):
        for chat, tools in zip(batch["messages"], batch["tools"]):
            yield from (text for message in chat for key in ("content", "tool_calls", *REASONING_KEYS)
                        if (text := message[key]))
            yield from [tools] if tools else []
