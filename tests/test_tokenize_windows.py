"""Documents are tokenized a bounded number of characters at a time (app/prepare/windows.py), into the very ids
the tokenizer gives each whole document: the tokenizer families users bring, on real code with Unicode and long
runs of whitespace, and through prepare's packing."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

import app.prepare.windows as windows
from app.prepare import stdlib_corpus_paths
from app.prepare.pack import tokenize
from app.prepare.tokenizer import encode_texts, train_tokenizer

WINDOW = 30_000
"""Characters per tokenizer call, two windows of 15,000: small enough for dozens of them in the test's text (the
application's calls take 262,144)."""
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@cache
def corpus() -> str:
    """The standard library's code (440 KB), Unicode the tokenizers never saw, and long words shorter than the
    part of an overlap left out of the comparison (468 characters here)."""
    files = sorted(path for folder in stdlib_corpus_paths()[:2] for path in Path(folder).rglob("*.py"))
    code = "\n".join(path.read_text(errors="replace") for path in files)
    return code + "ünïcødé 日本語 🙂 𝔘 " * 500 + " " * 200 + "\n\n\n" + "x" * 200 + "\r\n" + code[:50_000]


def byte_level_bpe(pre_tokenizer: pre_tokenizers.PreTokenizer, trim_offsets: bool = False) -> PreTrainedTokenizerFast:
    """GPT-2's kind of tokenizer (byte-level BPE after a pattern), trained on the corpus; RoBERTa's and BART's
    trim the spaces off their tokens' offsets."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    tokenizer.train_from_iterator([corpus()[:300_000]], trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def metaspace_bpe() -> PreTrainedTokenizerFast:
    """Llama-2's and Mistral's kind: SentencePiece BPE with byte fallback, converted as transformers converts it
    (Metaspace, "▁" put before the text only, the whole text merged as one word)."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    tokenizer.train_from_iterator([corpus()[:300_000]], trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def t5_unigram() -> PreTrainedTokenizerFast:
    """T5's kind: a SentencePiece Unigram model, words split at spaces (Metaspace), EOS after every text."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    tokenizer.train_from_iterator([corpus()[:300_000]], trainers.UnigramTrainer(
        vocab_size=2000, special_tokens=["<unk>", "</s>"], unk_token="<unk>"))
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {
    "gpt2": cache(lambda: byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))),
    "llama3": lambda: byte_level_bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
    "roberta": lambda: byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), trim_offsets=True),
    "llama2": metaspace_bpe,
    "t5": t5_unigram,
    "trained": cache(lambda: train_tokenizer([corpus()[:300_000]], 2000, seed=0)),
}


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(windows, "WINDOW_CHARS", WINDOW)
    monkeypatch.setattr(windows, "PARALLEL_WINDOWS", 2)


def whole(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, split_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_a_long_document_in_windows_has_the_ids_of_the_whole(kind: str, small_windows: None) -> None:
    tokenizer = TOKENIZERS[kind]()
    text = corpus()
    stitched = encode_texts(tokenizer, [text], [tokenizer.eos_token_id], documents=True)[0]
    assert stitched.tolist() == whole(tokenizer, text)
    assert len(text) > 12 * WINDOW and windows.encode_long(tokenizer, text) is not None, "it fell back"


def test_a_document_ending_in_spaces_keeps_its_last_token(small_windows: None) -> None:
    """RoBERTa's offsets of a trailing run of spaces are trimmed to (end, end): the last window keeps it."""
    tokenizer = TOKENIZERS["roberta"]()
    text = corpus()[:100_000] + "x = 1   "
    assert encode_texts(tokenizer, [text], [], documents=True)[0].tolist() == whole(tokenizer, text)[:-1]


@pytest.mark.parametrize("split", [None, " ", "\n"])
def test_a_unigram_model_is_cut_only_where_a_space_starts_a_word(split: str | None, small_windows: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A Unigram model (T5's, XLNet's) takes the best segmentation of a word as a whole: here "ab" and "ba" cost
    alike, and only the word's two ends decide between "w x ab ab ... ab y" and "w xa ba ... ba by". Windows that
    cut the word short agree with each other on the first; the whole word is the second. Without a pre-tokenizer
    the text is one word, and encoded whole; Metaspace splits words at spaces only (a newline stays inside a word),
    and a document is cut only there. (Windows of 15,000 characters overlapping by 1,500 all start on an "a".)"""
    monkeypatch.setattr(windows, "OVERLAP", 0.1)
    pieces = {"<unk>": 0.0, "</s>": 0.0, "ab": -1.0, "ba": -1.0, "a": -5.0, "b": -5.0, "w": -1.0, "x": -10.0,
              "y": -10.0, "xa": -10.4, "by": -10.4, "▁": -1.0, "▁w": -1.0, "▁ab": -1.0, "\n": -2.0, "b\na": -3.0}
    unigram = Tokenizer(models.Unigram(list(pieces.items()), unk_id=0))
    if split:
        unigram.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=unigram, eos_token="</s>", unk_token="<unk>")
    word = "ab" * 50 + (split or "")
    text = "wx" + (word * (2 * WINDOW // len(word)))[:-1] + "y"
    if split != " ":  # the whole text is one word
        assert tokenizer.convert_ids_to_tokens(whole(tokenizer, text)[:3])[-2:] == ["xa", "ba"]
    assert (windows.encode_long(tokenizer, text) is None) == (split != " ")
    assert encode_texts(tokenizer, [text], [tokenizer.eos_token_id], documents=True)[0].tolist() == whole(
        tokenizer, text)


@pytest.mark.parametrize("kind", ["llama3", "trained"])
def test_a_bpe_document_without_whitespace_is_still_cut(kind: str, small_windows: None) -> None:
    """Minified JSON (no space, no newline) is cut between any two tokens the windows agree on, so its memory stays
    bounded."""
    tokenizer = TOKENIZERS[kind]()
    text = json.dumps([{"id": index, "name": f"item{index}", "tags": ["a", "b"]} for index in range(4000)],
                      separators=(",", ":"))
    assert not any(character.isspace() for character in text) and len(text) > 5 * WINDOW
    assert windows.encode_long(tokenizer, text) is not None
    assert encode_texts(tokenizer, [text], [tokenizer.eos_token_id], documents=True)[0].tolist() == whole(
        tokenizer, text)


def test_a_word_longer_than_the_overlap_makes_the_document_encoded_whole(small_windows: None) -> None:
    """A run of spaces is one pre-token of GPT-2's pattern: windows starting inside it disagree, and the document is
    encoded at once, exactly, as before."""
    tokenizer = TOKENIZERS["gpt2"]()
    text = corpus()[:100_000] + " " * (2 * WINDOW) + corpus()[:100_000]
    assert windows.encode_long(tokenizer, text) is None
    assert encode_texts(tokenizer, [text], [tokenizer.eos_token_id], documents=True)[0].tolist() == whole(
        tokenizer, text)


def test_packing_never_hands_the_tokenizer_more_than_a_window(small_windows: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of documents goes to the tokenizer in groups of at most a window's characters, a longer document in
    windows; the tokens written are those of each whole document."""
    tokenizer = TOKENIZERS["trained"]()
    text = corpus()
    documents = [text[start:start + size] for start, size in ((0, 9_000), (50_000, 200_000), (9_000, 40))]
    documents += [text[start:start + 12_000] for start in range(250_000, 480_000, 12_000)]
    largest = []
    encode = type(tokenizer).__call__

    def recording(self: PreTrainedTokenizerBase, text: str | list[str], **kwargs: object) -> object:
        largest.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return encode(self, text, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", recording)
    tokens = tokenize(Dataset.from_dict({"text": documents}), tokenizer, [tokenizer.eos_token_id], 1, "tokens")
    monkeypatch.setattr(type(tokenizer), "__call__", encode)
    assert 0 < max(largest) <= WINDOW
    assert [row for row in tokens["input_ids"]] == [whole(tokenizer, document) for document in documents]
    assert tokens["length"] == [len(whole(tokenizer, document)) for document in documents]
    assert np.sum(tokens["length"]) > 100_000


def test_the_cpus_used_are_those_the_process_may_run_on() -> None:
    """Under `taskset -c 0` (Slurm's --cpus-per-task, a container's --cpuset-cpus) the tokenizer's windows and
    SentencePiece's threads counted every core of the machine (os.cpu_count())."""
    import shutil
    import subprocess
    import sys

    if not shutil.which("taskset"):
        pytest.skip("no taskset here")
    code = "from app.prepare.windows import usable_cpus; print(usable_cpus())"
    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    assert pinned.stdout.strip() == "1", pinned.stderr
