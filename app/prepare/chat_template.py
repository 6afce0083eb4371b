"""Chat templates, and which tokens of a rendered chat are trained: every assistant turn, through its end-of-turn.

The template is `--chat_template FILE`, else the tokenizer's own, else `DEFAULT_CHAT_TEMPLATE`, which ends every
assistant turn with the tokenizer's EOS:

    <s>### System:
    {system message}

    ### User:
    {user message}

    ### Assistant:
    {assistant message}</s>### User:
    ...

Masks come from the template itself, never from searching the text for a marker. For the assistant message at
position k, the tokens of `render(messages[:k], add_generation_prompt=True)` must be a prefix of the tokens of
`render(messages[:k + 1])`, which must be a prefix of the whole chat's tokens; the tokens in between are that
turn, and they are trained, unless the message has OpenAI's `"weight": 0` (context only, untrained also with
--train_on_prompt). The last of them must be a special token (EOS, or an end-of-turn token such as
`<|eot_id|>`), so that the model learns to stop; whitespace a template writes after it (`<|im_end|>\\n`) is not
trained. Everything else (system, user, the template's headers) has label -100, as has the first token of every
example, also with --train_on_prompt: packed after another example, it must not be predicted from that example's
last token.

Messages are rendered with `sanitize_control_tokens` (`app.prepare.tokenizer.render_chat`): special-token text inside
a message (`</s>` in code) is encoded as text, and only the template's own special tokens are special; ordinary added
tokens (Qwen3's `<think>`) are matched as `apply_chat_template` matches them at inference.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from app.choices import IGNORE_INDEX
from app.prepare.args import PrepareArgs, UsageError
from app.prepare.chat import PROBE_CHAT, REASONING_KEYS, template_messages, untrained
from app.prepare.examples import Example, causal_advice, drop_reasons, dropped, encode_examples, fit_to_block
from app.prepare.mask_audit import audit, check_audit
from app.prepare.tokenizer import render_chat, special_token_ids

DEFAULT_CHAT_TEMPLATE = (
    "{{- bos_token if bos_token is defined and bos_token else '' -}}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{{- '### Assistant:\\n' + message['content'] + eos_token -}}\n"
    "{%- else -%}\n"
    "{{- '### ' + message['role'] | capitalize + ':\\n' + message['content'] + '\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '### Assistant:\\n' -}}\n"
    "{%- endif -%}\n"
)
"""For tokenizers without a chat template (such as the one --vocab_size trains). Documented in docs/prepare-data.md."""

PREFIX_MISMATCH = "template_prefix_mismatch"
NO_END_OF_TURN = "no_end_of_turn"
NOTHING_TRAINED = "nothing_trained"


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    origin: str
    """Where it comes from, as error messages and stats.json name it."""
    tokenizers_own: bool = False
    """The tokenizer already holds it (with any other named templates it has): nothing to add before saving."""


def choose_template(tokenizer: Optional[PreTrainedTokenizerBase], args: PrepareArgs) -> ChatTemplate:
    """--chat_template FILE, else the tokenizer's own template, else the default one (also for the tokenizer that
    --vocab_size trains, None until the training split is read)."""
    if args.chat_template is not None:
        try:
            text = Path(args.chat_template).read_text(encoding="utf-8")
        except UnicodeDecodeError:  # else said of --input (pipeline.prepare)
            raise UsageError(f"--chat_template {args.chat_template}: not UTF-8 text; save it as UTF-8") from None
        if not text.strip():
            raise UsageError(f"--chat_template {args.chat_template} is empty; give a Jinja chat template")
        return ChatTemplate(text, f"--chat_template {args.chat_template}")
    if tokenizer is not None and tokenizer.chat_template:
        return ChatTemplate(tokenizer.get_chat_template(), f"the chat template of --tokenizer {args.tokenizer}", True)
    return ChatTemplate(DEFAULT_CHAT_TEMPLATE, "the default chat template")


@dataclass(frozen=True)
class ChatText:
    """The text a template renders a chat to, as `apply_chat_template` renders it (the tokenizer's special tokens as
    variables), so that records can be checked against it as they are read, before the (trained) tokenizer exists."""

    template: str
    variables: dict[str, str]

    def __call__(self, messages: list[dict], generation_prompt: bool = False,
                 tools: Optional[list] = None) -> Optional[str]:
        """The rendered chat (offered `tools`); None when the template fails on it (the encoder refuses that, with
        the template's error)."""
        try:
            rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.template, tools=tools,
                                                add_generation_prompt=generation_prompt, **self.variables)
        except Exception:  # noqa: BLE001 (reported by `failure`, or ChatEncoder.tokens, which renders it again)
            return None
        return rendered[0]

    def failure(self, messages: list[dict], tools: Optional[list] = None) -> str:
        """Why the template fails on the chat (offered `tools`), in one line (its own raise_exception message)."""
        try:
            render_jinja_template(conversations=[messages], chat_template=self.template, tools=tools, **self.variables)
        except Exception as error:  # noqa: BLE001 (whatever the template raised)
            return " ".join(str(error).split()) or type(error).__name__
        return "it renders"


def chat_text(tokenizer: Optional[PreTrainedTokenizerBase], args: PrepareArgs) -> ChatText:
    """What renders chats to text with the template `supervised_rows` will use; the trained tokenizer's special
    tokens (`train_tokenizer`) before it exists."""
    variables = dict(tokenizer.special_tokens_map) if tokenizer is not None else TRAINED_SPECIAL_TOKENS
    return ChatText(choose_template(tokenizer, args).text, variables)


REASONING_PROBE = ("Which?", "REASONING-0d1f", "ANSWER-7c2e")
"""A question, and an answer's reasoning and content to find in what the template renders of them."""


@dataclass(frozen=True)
class ReasoningBlock:
    """How a chat template writes an answer's reasoning before it: between `opening` and `closing` (Qwen3's
    `<think>` and `</think>`), as a reasoning model writes it before its answer at inference."""

    opening: str
    closing: str

    def split(self, text: str) -> tuple[Optional[str], str]:
        """A written answer's reasoning (None without a block) and its answer: what follows the last `closing`, or
        nothing when the block was opened and never closed (the tokens ran out while it reasoned)."""
        head, closed, answer = text.rpartition(self.closing)
        if closed:
            return head.strip().removeprefix(self.opening).strip(), answer.strip()
        if self.opening and text.lstrip().startswith(self.opening):
            return text.strip().removeprefix(self.opening).strip(), ""
        return None, text


def reasoning_block(rendered: ChatText) -> Optional[ReasoningBlock]:
    """How the template writes an answer's reasoning, read from what it renders of a probe answer with reasoning
    (in any of the fields chats carry it in, Qwen3's `reasoning_content` first); None for a template that writes
    none, or writes it after the answer."""
    question, reasoning, answer = REASONING_PROBE
    asked = [{"role": "user", "content": question}]
    prompt = rendered(asked, generation_prompt=True) or ""
    for key in REASONING_KEYS:
        text = rendered([*asked, {"role": "assistant", "content": answer, key: reasoning}]) or ""
        start, end = text.find(reasoning), text.find(answer)
        if -1 < start < end:
            opening = text[len(prompt):start] if text.startswith(prompt) else ""
            closing = text[start + len(reasoning):end].strip()
            return ReasoningBlock(opening.strip(), closing) if closing else None
    return None


TRAINED_SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
"""The special tokens of the tokenizer that --vocab_size trains (SentencePiece's, as Llama's)."""


class ChatEncoder:
    """Renders chats with one template and returns their tokens with the labels of the assistant turns."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: ChatTemplate, train_on_prompt: bool) -> None:
        self.tokenizer, self.template, self.train_on_prompt = tokenizer, template, train_on_prompt
        self.special_ids = special_token_ids(tokenizer)

    def tokens(self, messages: list[dict], generation_prompt: bool, tools: Optional[list] = None) -> list[int]:
        """The chat's tokens, offered `tools`, as inference renders it (`template_messages`)."""
        messages = template_messages(messages)
        try:
            return render_chat(self.tokenizer, messages, generation_prompt, chat_template=self.template.text,
                               tools=tools, tokenizer_kwargs={"verbose": False})["input_ids"]
        except Exception as error:  # a template error (raise_exception, a Jinja error): the user's template or data
            first = " ".join(str(error).split()) or type(error).__name__
            raise UsageError(
                f"{self.template.origin} fails on a chat starting {messages[0]['content'][:40]!r}: {first}; "
                "fix the data or give another template with --chat_template FILE"
            ) from error

    def encode(self, messages: list[dict], tools: Optional[str] = None) -> Example:
        """The chat's tokens and labels (offered the `tools` of its record, JSON text), or a dropped example naming
        what the template did wrong. The turns of untrained messages are found only to mask them under
        --train_on_prompt. A turn that calls tools is trained like any other: the calls are what it writes."""
        offered = json.loads(tools) if tools else None
        chat = self.tokens(messages, generation_prompt=False, tools=offered)
        spans, untrained_spans = [], []
        for k, message in enumerate(messages):
            if message["role"] != "assistant" or (untrained(message) and not self.train_on_prompt):
                continue
            before = self.tokens(messages[:k], generation_prompt=True, tools=offered)
            through = (chat if k == len(messages) - 1
                       else self.tokens(messages[: k + 1], generation_prompt=False, tools=offered))
            if through[: len(before)] != before or chat[: len(through)] != through:
                return dropped(PREFIX_MISMATCH)
            if len(through) == len(before):
                return dropped(NOTHING_TRAINED)
            end = end_of_turn(self.tokenizer, self.special_ids, through, len(before))
            if end is None:
                return dropped(NO_END_OF_TURN)
            (untrained_spans if untrained(message) else spans).append((len(before), end))
        (first_start, first_end), *_ = spans
        return Example(chat, chat_labels(chat, spans, self.train_on_prompt, untrained_spans), first_start, first_end)



def end_of_turn(tokenizer: PreTrainedTokenizerBase, special_ids: set[int], tokens: list[int],
                start: int) -> Optional[int]:
    """Where the turn `tokens[start:]` ends: after its last special token, when only whitespace follows that (a
    turn may start with one of its own, Mistral's [TOOL_CALLS])."""
    for end in range(len(tokens), start, -1):
        if tokens[end - 1] in special_ids:
            trailing = tokenizer.decode(tokens[end:]) if end < len(tokens) else ""
            return None if trailing.strip() else end
    return None


def chat_labels(tokens: list[int], spans: list[tuple[int, int]], train_on_prompt: bool,
                untrained_spans: Iterable[tuple[int, int]] = ()) -> list[int]:
    """Labels: the tokens of the trained spans (or all tokens but the untrained spans), -100 elsewhere and always on
    the first token."""
    labels = list(tokens) if train_on_prompt else [IGNORE_INDEX] * len(tokens)
    for start, end in spans:
        labels[start:end] = tokens[start:end]
    for start, end in untrained_spans:
        labels[start:end] = [IGNORE_INDEX] * (end - start)
    labels[0] = IGNORE_INDEX
    return labels


def check_template(encoder: ChatEncoder, chats: Iterable[Dataset] = ()) -> None:
    """Refuse a template that cannot be masked, masks every token, never ends an assistant turn, or whose masks
    train the user's messages or little of the assistant's, before any data is encoded (the same checks then run
    on every example, and the loss-mask audit on the first ones of each split).

    A template that masks a chat of one assistant turn but renders that turn otherwise once the chat goes on (the
    stock templates of Qwen3 and Phi-3) is taken when the data's chats of more than one assistant turn are masked
    (Qwen3's renders every turn after the last user message alike: an agent's calls and answer): the first
    `PROBED_CHATS` of them are encoded here, and any that is not refuses the data at once; the others are checked as
    they are encoded (`check_turns_found`). It was refused for single-turn data, then for any longer chat."""
    probe, where = PROBE_CHAT, "a two-turn chat"
    example = encoder.encode(probe)
    if example.dropped == PREFIX_MISMATCH and not encoder.encode(PROBE_CHAT[:2]).dropped:
        longer = [records.select(multi_turn_chats(records, encoder.train_on_prompt)) for records in chats]
        probed = (chat for records in longer for chat in records.select(range(min(len(records), PROBED_CHATS))))
        if any(encoder.encode(chat["messages"], chat["tools"]).dropped == PREFIX_MISMATCH for chat in probed):
            raise UsageError(turns_otherwise(encoder, sum(map(len, longer)), "have more than one"))
        probe, where = PROBE_CHAT[:2], "a one-turn chat"
        example = encoder.encode(probe)
    if example.dropped:
        difference = prefix_difference(encoder, probe) if example.dropped == PREFIX_MISMATCH else ""
        raise UsageError(template_problem(encoder.template, example.dropped, difference))
    check_generation_prompt(encoder)
    encoded = {"input_ids": example.input_ids, "labels": example.labels, "dropped": ""}
    masks = audit([probe], [encoded], encoder.tokenizer, encoder.template.text)
    check_audit(masks, encoder.template.origin, encoder.train_on_prompt, where)


PROBED_CHATS = 1000
"""Chats of more than one assistant turn encoded before the data, under a template that renders a turn otherwise
once the chat goes on: a data set of such chats that it cannot mask is refused at once, not once all is encoded."""


def turns_otherwise(encoder: ChatEncoder, count: int, which: str) -> str:
    """The refusal of data whose chats of more than one assistant turn the template renders otherwise."""
    return (f"{encoder.template.origin}: it masks chats of one assistant turn only, as it renders an earlier turn "
            f"otherwise once the chat goes on{prefix_difference(encoder, PROBE_CHAT)}, and {count:,} "
            f"chat{'s' if count > 1 else ''} {which if count > 1 else which.replace('have', 'has')}; leave those out, "
            "or give a template that renders every turn alike with --chat_template FILE")


def check_turns_found(encoder: ChatEncoder, encoded: dict[str, Dataset]) -> None:
    """Refuse data of which some chats' earlier turns the template renders otherwise once the chat goes on, after
    `check_template` took the template (the first chats of more than one turn were masked): dropped, they would be
    left out of training unsaid."""
    mismatched = sum(drop_reasons(split)[PREFIX_MISMATCH] for split in encoded.values())
    if mismatched and encoder.encode(PROBE_CHAT).dropped == PREFIX_MISMATCH:
        raise UsageError(turns_otherwise(encoder, mismatched, "have an earlier turn it renders so"))


def multi_turn_chats(records: Dataset, train_on_prompt: bool = False) -> list[int]:
    """The chats of `records` (rows of `messages`) with an assistant message whose turn is found (a trained one;
    under --train_on_prompt also one of "weight": 0, which is masked) before another assistant message, found with
    Arrow and numpy: a template that renders an earlier turn otherwise once the chat goes on may not find it. An
    untrained answer after the last trained one, or before a trained one, is only rendered, as at inference."""
    found_in, offset = [], 0
    for batch in records.with_format("arrow").iter(batch_size=100_000):
        chats = batch.column("messages").combine_chunks()
        messages = pc.list_flatten(chats)
        chat_of = pc.list_parent_indices(chats).to_numpy()
        assistant = pc.equal(pc.struct_field(messages, "role"), "assistant").to_numpy(zero_copy_only=False)
        trained = pc.fill_null(pc.not_equal(pc.struct_field(messages, "weight"), 0), True)
        found = assistant & (train_on_prompt | trained.to_numpy(zero_copy_only=False))
        position = np.arange(len(chat_of))
        last_answer = np.full(len(chats), -1)
        np.maximum.at(last_answer, chat_of[assistant], position[assistant])
        found_in += (offset + np.unique(chat_of[found & (position < last_answer[chat_of])])).tolist()
        offset += len(chats)
    return found_in


def check_generation_prompt(encoder: ChatEncoder) -> None:
    """Refuse a template that ignores add_generation_prompt but writes a header in front of each assistant message
    (ChatML without its generation branch): the header would fall inside the trained turn, and the model would learn
    to write it. A template whose prompt already ends with the answer's cue (Llama 2's "[/INST]") needs none."""
    text = ChatText(encoder.template.text, dict(encoder.tokenizer.special_tokens_map))
    prompt = text(PROBE_CHAT[:1], generation_prompt=True)
    if prompt is None or prompt != text(PROBE_CHAT[:1]):
        return  # it writes a generation prompt (or fails, which encode() has reported)
    turn = (text(PROBE_CHAT[:2]) or "")[len(prompt):]
    header = turn.split(PROBE_CHAT[1]["content"], 1)[0].strip()
    if header:
        raise UsageError(f"{encoder.template.origin} renders no generation prompt (add_generation_prompt changes "
                         f"nothing), so the assistant header {header!r} would be trained; give a template with an "
                         "add_generation_prompt branch that writes the header, with --chat_template FILE")


TEMPLATE_PROBLEMS = {
    PREFIX_MISMATCH: "the tokens of a chat rendered up to an assistant turn (with the generation prompt) are not a "
    "prefix of the whole chat's tokens, so the prompt cannot be masked",
    NOTHING_TRAINED: "it masks every token: assistant messages render to nothing after the generation prompt",
    NO_END_OF_TURN: "assistant turns do not end with a special token (EOS or an end-of-turn token), so the model "
    "would never learn to stop",
}


def template_problem(template: ChatTemplate, problem: str, where: str = "") -> str:
    return f"{template.origin}: {TEMPLATE_PROBLEMS[problem]}{where}; give another with --chat_template FILE"


def prefix_difference(encoder: ChatEncoder, messages: list[dict[str, str]]) -> str:
    """Where a chat rendered up to an assistant turn stops being the start of the longer rendering, as text: Qwen3's
    template writes an empty reasoning block only after the last user message, Phi-3's its EOS only after the last
    turn; the refusal named neither the turn nor the text."""
    chat = encoder.tokens(messages, generation_prompt=False)
    for k in (k for k, message in enumerate(messages) if message["role"] == "assistant"):
        before = encoder.tokens(messages[:k], generation_prompt=True)
        through = encoder.tokens(messages[: k + 1], generation_prompt=False)
        for shorter, longer in ((before, through), (through, chat)):
            i = next((i for i, token in enumerate(shorter) if i >= len(longer) or longer[i] != token), None)
            if i is not None:
                decode = encoder.tokenizer.decode
                return (f" (in a test chat of {len(messages)} messages, not your data's, at assistant message "
                        f"{k + 1}: {decode(shorter[i:i + 6])!r} where the longer rendering has "
                        f"{decode(longer[i:i + 6])!r})")
    return ""


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> Optional[int]:
    """The special token that ends an assistant turn in the tokenizer's chat template (EOS in the default template,
    <|eot_id|> in Llama-3's, <|im_end|> in Qwen's): where generation stops. None without a template, or when its
    turns do not end with a special token."""
    if not tokenizer.chat_template:
        return None
    template = ChatTemplate(tokenizer.get_chat_template(), "the tokenizer's chat template", tokenizers_own=True)
    try:
        example = ChatEncoder(tokenizer, template, train_on_prompt=False).encode(PROBE_CHAT[:2])
    except UsageError:
        return None
    return None if example.dropped else example.input_ids[example.response_end - 1]


def chat_advice(template: ChatTemplate, block_size: int) -> dict[str, str]:
    """What to say when no example is left, by the reason the examples were dropped."""
    template_advice = {problem: template_problem(template, problem) for problem in TEMPLATE_PROBLEMS}
    return {**causal_advice(block_size), **template_advice}


def encode_chats(records: Dataset, encoder: ChatEncoder, args: PrepareArgs, desc: str) -> Dataset:
    """Every chat's tokens and labels, fitted to --block_size (rows of `EXAMPLE_FEATURES`)."""

    def encode(batch: dict) -> list[Example]:
        examples = (encoder.encode(messages, tools) for messages, tools in zip(batch["messages"], batch["tools"]))
        return [fit_to_block(example, args.block_size, args.too_long) for example in examples]

    return encode_examples(records, encode, args.num_proc, desc)
