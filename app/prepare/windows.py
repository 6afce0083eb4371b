"""Texts encoded a bounded number of characters at a time, with the ids the tokenizer gives the whole text.

A Hugging Face fast tokenizer holds about 150 bytes per character of the text it encodes (the normalised string,
its alignments, pre-tokens, offsets): a 10 MB document on one line peaked at 1.5 GB, a 1 GB book dump or a whole
corpus saved as one `.txt` would need 150 GB, and a batch of documents needs as much as their sum. So the tokenizer
is given at most `WINDOW_CHARS` characters per call: texts together up to that size, and a longer document in
overlapping windows.

Two neighbouring windows' tokens are kept only where both encoded their overlap alike, away from either window's
edge: the same ids starting at the same characters throughout the overlap's middle (`EDGE`). The ids are then the
first window's before a token in that middle (a word's first where there is one) and the second window's from it.
A BPE or WordPiece tokenizer decides a token from nearby text (its pre-tokenizer's pattern, merges of neighbouring
pieces), so what both windows agree on, with thousands of characters of context either side, is what the whole
text gives; a Unigram model's best segmentation of a word depends on all of the word, so it is cut only between
words (`_spaces_only`). A text whose windows disagree (a single "word" longer than the part of the overlap left out
of the comparison) is encoded whole, as before; so is every text of a tokenizer without offsets (the slow Python
ones), or of a Unigram model whose pre-tokenizer leaves the whole text one word.

No library does this: `tokenizers` encodes what it is given at once, and `datasets` batches by rows, not
characters. Tested against whole encodings of real code for byte-level BPE (GPT-2's and Llama-3's patterns),
Llama-2's SentencePiece conversion, RoBERTa's trimmed offsets, Unigram models, and the tokenizer `--vocab_size`
trains (tests/test_tokenize_windows.py).
"""

from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import numpy as np
from transformers import PreTrainedTokenizerBase

WINDOW_CHARS = 1 << 18
"""Characters encoded in one call (about 40 MB of the tokenizer's memory): a group of texts, or a few windows of a
longer one (as many as the tokenizer has cores to spread them over, up to `PARALLEL_WINDOWS`)."""
PARALLEL_WINDOWS = 4
OVERLAP = 1 / 8
"""The part of a window that it shares with the next (16,384 characters of 131,072 on 2 cores)."""
EDGE = 1 / 4
"""The part of an overlap at each of its ends whose tokens are not compared: a window's edge can change its last or
first tokens (a word cut in two, a prefix the tokenizer adds to the start of a text)."""


@dataclass
class Window:
    """One window's tokens: their ids and the character of the text each starts at."""

    ids: list[int]
    starts: list[int]
    begin: int
    """The window's first character in the text."""
    end: int
    """The character after its last."""

    def span(self, first: int, stop: int) -> tuple[int, int]:
        """The indices of the tokens starting at characters [first, stop)."""
        return _bisect(self.starts, first), _bisect(self.starts, stop)


def encode_bounded(tokenizer: PreTrainedTokenizerBase, texts: list[str], suffix: list[int], target: bool = False,
                   frame: Optional[tuple[list[int], list[int]]] = None) -> list[Union[list[int], np.ndarray]]:
    """Each text's ids as `tokenizer(texts)` gives them (a seq2seq target's when `target`), then `suffix`, encoded
    `WINDOW_CHARS` characters at a time: texts together up to that size. With `frame` (the ids the tokenizer puts
    before a document's text and after it), a longer text in windows, and every text's ids an int32 array (a
    Python list holds 36 bytes per id)."""
    encoded: list[Union[list[int], np.ndarray, None]] = [None] * len(texts)
    for group in _groups(texts):
        if frame is not None and not target and len(texts[group[0]]) > WINDOW_CHARS and getattr(
                tokenizer, "is_fast", False):  # offsets; mistral-common's tokenizer has no is_fast
            ids = encode_long(tokenizer, texts[group[0]], frame[0], frame[1] + suffix)
            if ids is not None:
                encoded[group[0]] = ids
                continue
        side = [texts[index] for index in group]
        arguments = {"text_target": side} if target else {"text": side}
        # split_special_tokens: a literal "</s>" or "<|end_of_text|>" in the text is text, not a document boundary
        for index, ids in zip(group, tokenizer(**arguments, split_special_tokens=True, verbose=False)["input_ids"]):
            encoded[index] = ids + suffix if frame is None else np.array(ids + suffix, dtype=np.int32)
    return encoded  # type: ignore[return-value]


def _groups(texts: list[str]) -> Iterator[list[int]]:
    """Consecutive indices of texts whose characters add up to at most WINDOW_CHARS (a longer text alone)."""
    group: list[int] = []
    size = 0
    for index, text in enumerate(texts):
        if group and size + len(text) > WINDOW_CHARS:
            yield group
            group, size = [], 0
        group.append(index)
        size += len(text)
    if group:
        yield group


def encode_long(tokenizer: PreTrainedTokenizerBase, text: str, before: Sequence[int] = (),
                after: Sequence[int] = ()) -> Optional[np.ndarray]:
    """The text's ids stitched from its windows (without special tokens), between `before` and `after`, as int32;
    None where two neighbours disagree on their overlap."""
    spaces_only = _spaces_only(tokenizer)
    if spaces_only is None:
        return None
    ids = [np.array(before, dtype=np.int32)]
    kept_from = 0
    previous: Optional[Window] = None
    for window in _windows(tokenizer, text):
        if previous is not None:
            boundary = _agreed_boundary(previous, window, text, spaces_only)
            if boundary is None:
                return None
            first, stop = previous.span(kept_from, boundary)
            ids.append(np.array(previous.ids[first:stop], dtype=np.int32))
            kept_from = boundary
        previous = window
    assert previous is not None
    first = _bisect(previous.starts, kept_from)  # to the end: a trailing space's offsets can be trimmed to (end, end)
    ids += [np.array(previous.ids[first:], dtype=np.int32), np.array(after, dtype=np.int32)]
    return np.concatenate(ids)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: `taskset`, Slurm's --cpus-per-task, a container's
    --cpuset-cpus), not every core of the machine, which os.cpu_count() gives."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _windows(tokenizer: PreTrainedTokenizerBase, text: str) -> Iterator[Window]:
    """The text's overlapping windows, a few per call (the tokenizer spreads a batch over the cores)."""
    batch = max(1, min(PARALLEL_WINDOWS, usable_cpus()))
    spans = _spans(text, WINDOW_CHARS // batch)
    for group in range(0, len(spans), batch):
        chunk = spans[group:group + batch]
        encoded = tokenizer([text[begin:end] for begin, end in chunk], add_special_tokens=False,
                            split_special_tokens=True, return_offsets_mapping=True, verbose=False)
        for (begin, end), ids, offsets in zip(chunk, encoded["input_ids"], encoded["offset_mapping"]):
            yield Window(ids, [begin + offset[0] for offset in offsets], begin, end)


def _spans(text: str, size: int) -> list[tuple[int, int]]:
    """Windows of at most `size` characters, each sharing about `OVERLAP` of one with the next, beginning and
    ending at the start of a line where one is near: a window cut inside a long word (a run of spaces, a line of
    dashes) encodes that word otherwise, and a line that starts with a visible character starts a word for every
    tokenizer pattern (one that starts with indentation does not: GPT-2's joins the newline to the spaces)."""
    overlap = int(size * OVERLAP)
    spans, begin = [], 0
    while begin + size < len(text):
        end = _line_start(text, begin + size, overlap // 2)
        spans.append((begin, end))
        begin = _line_start(text, end - overlap, overlap // 2)
    return spans + [(begin, len(text))]


def _line_start(text: str, position: int, reach: int) -> int:
    """The last start of a line at or before `position`, within `reach` characters, whose first character is not
    whitespace; `position` if there is none."""
    stop = position
    while True:
        newline = text.rfind("\n", max(0, position - reach), stop)
        if newline < 0:
            return position
        if not text[newline + 1].isspace():
            return newline + 1
        stop = newline


def _agreed_boundary(before: Window, after: Window, text: str, spaces_only: bool) -> Optional[int]:
    """A character where a token starts in both windows, in the middle of their overlap, where both hold the same
    tokens at the same characters; None if they differ there (or, `spaces_only`, if no token there starts at a
    space). The start of a word (next to whitespace) is preferred, near the middle."""
    edge = int((before.end - after.begin) * EDGE)
    lo, hi = after.begin + edge, before.end - edge
    a_first, a_stop = before.span(lo, hi)
    b_first, b_stop = after.span(lo, hi)
    if a_stop - a_first < 2 or (before.ids[a_first:a_stop] != after.ids[b_first:b_stop]
                                or before.starts[a_first:a_stop] != after.starts[b_first:b_stop]):
        return None
    middle = (a_first + a_stop) // 2
    # the byte pieces of one character share its start: a cut goes before the character, not inside it
    starts = [before.starts[index] for index in [*range(middle, a_stop), *range(middle - 1, a_first, -1)]
              if before.starts[index] != before.starts[index - 1]]
    if spaces_only:
        return next((start for start in starts if text[start] == " "), None)
    words = (start for start in starts if text[start - 1].isspace() or text[start].isspace())
    return next(words, starts[0] if starts else None)


def _spaces_only(tokenizer: PreTrainedTokenizerBase) -> Optional[bool]:
    """Where this tokenizer's windows may be cut. BPE and WordPiece segment a word by local rules (merges of
    neighbouring pieces, the longest known prefix): what two windows agree on, with thousands of characters either
    side, is the document's segmentation, at any token. A Unigram model (T5's, XLNet's, ALBERT's) takes the best
    segmentation of a whole word: a long word's two ends can decide between segmentations of all of it, and windows
    that both cut it short can agree with each other and not with the document. So a Unigram tokenizer is cut only
    where a space starts a word (Metaspace's split: tabs and newlines stay inside words), or not at all (None) when
    its pre-tokenizer does not split words (the whole text is then one word)."""
    backend = tokenizer.backend_tokenizer
    if type(backend.model).__name__ != "Unigram":
        return False
    splits = backend.pre_tokenizer is not None and len(backend.pre_tokenizer.pre_tokenize_str("a b")) > 1
    return True if splits else None


def _bisect(starts: list[int], value: int) -> int:
    """The index of the first token starting at or after `value`."""
    return bisect_left(starts, value)
