"""The tokenizer: the model's own, or a SentencePiece BPE trained on the training split that round-trips any text."""

from __future__ import annotations

import io
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import sentencepiece
from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerBase

from app.cli import first_line
from app.hub import missing_model_problem, quiet_hub
from app.prepare.args import UsageError
from app.prepare.windows import encode_bounded, usable_cpus

SENTENCEPIECE_OPTIONS = {
    "model_type": "bpe",
    "byte_fallback": True,  # characters never seen in training become byte pieces instead of <unk>
    "remove_extra_whitespaces": False,  # keep indentation, repeated spaces and newlines
    "normalization_rule_name": "identity",  # no NFKC: decode(encode(x)) == x
    "allow_whitespace_only_pieces": True,  # runs of indentation become single pieces
    "split_digits": True,  # numbers are spelled digit by digit, as in Llama
    "add_dummy_prefix": False,  # no "▁" added in front of every document
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": -1,
    "input_sentence_size": 2_000_000,  # a sample of lines is enough to learn the merges of a large corpus
    "shuffle_input_sentence": True,
    "minloglevel": 2,
}
"""Llama-style settings; sentencepiece's defaults normalise whitespace and would not round-trip code."""


def load_tokenizer(name_or_dir: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The tokenizer of the model to be trained, from the Hub (or its cache) or a local folder; an uncached Hub id
    without the Hub is refused at once with the prefetch.py command (app/hub.py)."""
    missing = missing_model_problem("--tokenizer", name_or_dir)
    if missing:
        raise UsageError(missing)
    try:
        with quiet_hub():
            tokenizer = AutoTokenizer.from_pretrained(name_or_dir, trust_remote_code=trust_remote_code)
    except Exception as error:  # missing, gated, offline, remote code refused: each is the user's to fix
        raise UsageError(f"--tokenizer {name_or_dir}: could not load it: {first_line(error)}") from error
    if tokenizer.eos_token_id is None:
        raise UsageError(f"--tokenizer {name_or_dir} has no EOS token, so documents could not be separated")
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int, seed: int) -> PreTrainedTokenizerBase:
    """Train SentencePiece BPE on the texts (every text field of the training split) and return it as a Hugging Face
    (Llama) tokenizer."""
    model = io.BytesIO()
    sentencepiece.set_random_generator_seed(seed)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=_lines(texts),
            model_writer=model,
            vocab_size=vocab_size,
            num_threads=usable_cpus(),
            **SENTENCEPIECE_OPTIONS,
        )
    except RuntimeError as error:  # "INTERNAL: trainer_interface.cc(744) [...] Vocabulary size too high (600). ..."
        raise UsageError(f"--vocab_size {vocab_size}: {vocab_size_problem(str(error))}") from error
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "tokenizer.model").write_bytes(model.getvalue())
        # LlamaTokenizer(vocab_file=...) silently encodes to nothing in transformers 5; from_pretrained converts.
        return LlamaTokenizer.from_pretrained(folder, add_prefix_space=False, add_bos_token=True, add_eos_token=False)


def vocab_size_problem(message: str) -> str:
    """What to do about SentencePiece's refusal. "Vocabulary size is smaller than required_chars. 300 vs 545": every
    distinct character of the text (all but the rarest 0.05%) plus the byte and special pieces must fit, so the text
    is too varied, not too small; "Vocabulary size too high": the text has too few distinct merges for the size."""
    reason = message.strip().splitlines()[-1].split("] ", 1)[-1]
    required = re.search(r"smaller than required_chars\. \d+ vs (\d+)", reason)
    if required:
        return (f"the vocabulary must hold every distinct character of the training text, and its byte and special "
                f"pieces; raise --vocab_size to at least {required.group(1)}")
    return f"{reason} (the training text is too small for it)"


SENTENCE_BYTES = 4192
"""SentencePiece's max_sentence_length: it skips, without a word, every sentence longer than this."""
LINE_PIECE_CHARS = SENTENCE_BYTES // 4
"""The longest piece of a line too long for SentencePiece that it is given: at most SENTENCE_BYTES of UTF-8."""


def _lines(texts: Iterable[str]) -> Iterator[str]:
    """SentencePiece learns from lines: newlines themselves are encoded as the byte piece <0x0A>, like Llama. A long
    line (a paragraph per line, minified code, a text without line breaks) is given in pieces, cut before a space
    where there is one, so that its text is learnt from rather than skipped; the lines SentencePiece takes are given
    whole, as before."""
    for text in texts:
        for line in text.split("\n"):
            if len(line) > LINE_PIECE_CHARS and len(line.encode()) > SENTENCE_BYTES:
                yield from _pieces(line)
            elif line:
                yield line


def _pieces(line: str) -> Iterator[str]:
    """The line in pieces of at most LINE_PIECE_CHARS, each cut before a space where one lies in its second half;
    by position, not by slicing off the rest (a 100 MB line without a break would be copied once per piece)."""
    start = 0
    while len(line) - start > LINE_PIECE_CHARS:
        cut = line.rfind(" ", start + LINE_PIECE_CHARS // 2, start + LINE_PIECE_CHARS)
        cut = cut if cut > start else start + LINE_PIECE_CHARS
        yield line[start:cut]
        start = cut
    yield line[start:]


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str], suffix: list[int], target: bool = False,
                 documents: bool = False) -> list[Union[list[int], np.ndarray]]:
    """Each text as the tokenizer encodes a document (with its own BOS or EOS), then `suffix`, a bounded number of
    characters at a time (app/prepare/windows.py).

    split_special_tokens: a literal "</s>" or "<|end_of_text|>" in the text is text, not a document boundary.
    target: encoded as a seq2seq target (`text_target`), which some tokenizers encode differently from a source:
    Marian with its own target SentencePiece model, mBART and NLLB with the target language's code.
    documents: raw text's documents, of any length: each text's ids an int32 array, a text longer than
    `WINDOW_CHARS` encoded in windows (the tokenizer would hold 150 bytes per character of it).
    """
    if not documents:
        return encode_bounded(tokenizer, texts, suffix, target)
    around = document_frame(tokenizer, target)
    return encode_bounded(tokenizer, texts, suffix, target, (around.prefix, around.suffix))


def _probe(tokenizer: PreTrainedTokenizerBase, target: bool, special: bool = True) -> list[int]:
    """How the tokenizer encodes the document "a", as a source (or plain text) or as a seq2seq target."""
    side = {"text_target": "a"} if target else {"text": "a"}
    return tokenizer(**side, add_special_tokens=special)["input_ids"]


@dataclass(frozen=True)
class DocumentFrame:
    """The special tokens around a document's text: those the tokenizer puts before it (Llama's BOS, NLLB's language
    code) and after it (T5's EOS; mBART's EOS then the language code), and the EOS appended where the tokenizer's
    own end holds none, so that every document holds exactly one. Truncation cuts text only: the frame stays."""

    prefix: list[int]
    suffix: list[int]
    appended: list[int]

    @property
    def tail(self) -> int:
        """How many tokens end every encoded document whatever its text."""
        return len(self.suffix) + len(self.appended)


def document_frame(tokenizer: PreTrainedTokenizerBase, target: bool = False) -> DocumentFrame:
    """The frame of a document (a seq2seq target when `target`), found in how the tokenizer encodes a probe with its
    special tokens and without them. Transformers 5 does not keep `add_bos_token`/`add_eos_token` in the saved
    config (the post-processor in tokenizer.json decides), so what the tokenizer does is asked, not its flags; an
    EOS was once appended after mBART's language code ("X </s> ro_RO </s>"), and its decoder, which starts from the
    labels' last token, started from </s>."""
    framed, text = _probe(tokenizer, target), _probe(tokenizer, target, special=False)
    start = next((i for i in range(len(framed) - len(text) + 1) if framed[i:i + len(text)] == text), None)
    if start is None:  # a tokenizer that encodes the text otherwise once framed: only a final EOS is recognised
        prefix, suffix = [], framed[-1:] if framed[-1:] == [tokenizer.eos_token_id] else []
    else:
        prefix, suffix = framed[:start], framed[start + len(text):]
    return DocumentFrame(prefix, suffix, [] if tokenizer.eos_token_id in suffix else [tokenizer.eos_token_id])


def document_suffix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """What to append to each encoded document so that it holds exactly one EOS."""
    return document_frame(tokenizer).appended


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether encoding a document puts BOS in front of it (Llama 2/3, CodeLlama and our trained tokenizer do)."""
    probe = _probe(tokenizer, target=False)
    return tokenizer.bos_token_id is not None and bool(probe) and probe[0] == tokenizer.bos_token_id


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that fills rows: the tokenizer's pad token, or EOS when it has none (labels there are always -100)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every special token, named (BOS, EOS, ...) or added as special (e.g. `<|eot_id|>`, `<|im_end|>`)."""
    added = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added | set(tokenizer.all_special_ids)


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool,
                **options: object) -> dict[str, Any]:
    """`apply_chat_template` as training encodes chats: special-token text inside a message (`</s>`, `<|im_end|>` in
    code) is text (`sanitize_control_tokens`), and only special-token text, as in raw documents. transformers also
    marks the ordinary added tokens a template names: Qwen3's template then found no `</think>` in a message's
    reasoning (its split and strip ran on the marked text), and trained a rendering with extra newlines that its
    own apply_chat_template, at inference, never gives."""
    kept = getattr(tokenizer, "chat_control_tokens", None)
    tokenizer.chat_control_tokens = ()  # the special tokens alone
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=True,
                                             sanitize_control_tokens=True, **options)
    finally:
        tokenizer.chat_control_tokens = kept
