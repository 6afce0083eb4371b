"""Generation samples at each evaluation (--eval_samples N): greedy answers to N fixed validation prompts, written
to `out_dir/samples/step-XXXXXXXX.jsonl` and scored against their references (exact match, ROUGE, length).

Under FSDP, `model.generate()` is a known trap: it bypasses the root forward, so parameters are not gathered, and
ranks that stop at different lengths wait for each other for ever. Here every token is one call of the sharded
model's own forward (FSDP gathers and frees each layer as in evaluation), with the key/value cache, and all ranks
make the same number of calls: each takes every world-size-th prompt, a rank out of prompts or already finished
feeds a placeholder token, and one small all-reduce per token tells them when every rank is done. No rank ever
holds the whole model.

A rank's prompts go through together, as many as fit in the tokens of one prompt of a block with its answer
(`generation_batches`), padded on the left (a causal LM, with the positions each has alone) or on the right (an
encoder's sources): each forward gathers every weight of the model, and a rank that generated its prompts one by one
gathered them once per token of every prompt. Whether padding leaves every prompt's logits as they are alone is a
property of the model class, probed on its small twin (`pads_apart`); where it does not, prompts go one at a time.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import regex
import torch
import torch.distributed as dist

from app.checkpoint.files import move_aside
from app.data.formats import Sample
from app.evaluation.validation import EvaluationStopped
from app.folders import replace_file, written_or_warned
from app.model.build import evaluation_mode, hugging_face_model, strategy_module
from app.model.isolation import (TOLERANCE, decoder_inputs_from_labels, longrope_limit, probe_examples,
                                 probe_twin)
from app.prepare.chat_template import end_of_turn_id

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

SAMPLES_DIR = "samples"
"""Where a run writes the generated samples of each evaluation, in out_dir."""
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
WRITTEN_WITHOUT_SPACES = ("\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                          "\uf900-\ufaff\U00020000-\U0002ffff")
"""Thai, Lao, Burmese, Khmer, kana and CJK ideographs: scripts whose words are not separated by spaces."""
WORD = regex.compile(f"(?=[{WRITTEN_WITHOUT_SPACES}])[\\p{{L}}\\p{{N}}]\\p{{M}}*"
                     f"|(?:(?![{WRITTEN_WITHOUT_SPACES}])[\\p{{L}}\\p{{N}}\\p{{M}}])+")
"""A character of a script written without spaces, with its marks; else a run of letters, digits and marks (the
`regex` module: the standard library's `\\w` leaves out the marks of Devanagari, Arabic and Hebrew, which split
their words into letters, and scored two different Hindi sentences 1.0)."""
STEMMED = re.compile("[a-z0-9]{4,}")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？।॥؟۔])\s*")
"""Where a sentence ends inside a line, for rougeLsum: Hugging Face's run_summarization.py puts each of nltk's
sentences on its own line first, and a SentencePiece vocabulary like T5's cannot write a newline at all. Chinese and
Japanese (。！？), Hindi (। ॥) and Arabic or Urdu (؟ ۔) end one with or without a space after it: without them,
rougeLsum there was rougeL."""


@dataclass(frozen=True)
class Decoding:
    """How one model kind is stepped: the inputs of the first forward, and of every next one."""

    first: Callable[[list[list[int]], list[list[int]]], dict[str, Any]]
    """(prompts, their references) -> the inputs of the first forward, one row per prompt."""
    next: Callable[[torch.Tensor, Any, dict[str, Any]], dict[str, Any]]
    """(last tokens, the model's output, the inputs it read) -> the inputs of the next forward."""
    restart_at: Optional[int] = None
    """A longrope model's original_max_position_embeddings: once a prompt and its answer pass it, every position
    switches to the long factors, and the cache of the positions before is computed again, as transformers'
    Phi-3 generation does (its answers and the converted model's differed from the token that crossed it)."""


def padded(prompts: list[list[int]], left: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The prompts as rows of one tensor, and which of its tokens are theirs (None when every row is whole). The
    padding token is 0: it is never attended to."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        columns = slice(width - len(prompt), width) if left else slice(0, len(prompt))
        ids[row, columns], mask[row, columns] = torch.tensor(prompt), 1
    return ids, (None if bool(mask.all()) else mask)


def causal_first(prompts: list[list[int]], references: list[list[int]]) -> dict[str, Any]:
    """Prompts padded on the left, so that every row's next token is its last column, with the positions each has
    alone (transformers counts them from the first column otherwise)."""
    ids, mask = padded(prompts, left=True)
    if mask is None:
        return {"input_ids": ids}
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def causal_next(token: torch.Tensor, output: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The next token with the model's cache: its key/value cache, or the state of a state-space model (Mamba's
    `cache_params`: reading `past_key_values` from its output ended the run at its first evaluation); padded rows
    keep their mask and count their own positions."""
    state = getattr(output, "cache_params", None)
    step = {"input_ids": token, **({"cache_params": state} if state is not None
                                   else {"past_key_values": output.past_key_values})}
    if "attention_mask" in inputs:
        step["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
        step["position_ids"] = inputs["position_ids"][:, -1:] + 1
    return step


CAUSAL = Decoding(first=causal_first, next=causal_next)


def seq2seq_decoding(decoder_inputs: Callable[[torch.Tensor], torch.Tensor]) -> Decoding:
    """An encoder-decoder reads the sources once (padded on the right, masked); its decoder starts from the token its
    inputs started with in training, `decoder_inputs` built from the reference (the model's own shift of the labels:
    T5's and BART's decoder_start_token_id, mBART's target-language code, which its labels end with; a fixed start
    token made an mBART write in no language it was trained for), then reads its own tokens, with the encoder's
    output, its mask and the cache passed back in."""
    def first(sources: list[list[int]], references: list[list[int]]) -> dict[str, Any]:
        ids, mask = padded(sources, left=False)
        starts = torch.cat([decoder_inputs(torch.tensor([reference]))[:, :1] for reference in references])
        return {"input_ids": ids, "decoder_input_ids": starts, **({"attention_mask": mask} if mask is not None else {})}

    def next_step(token: torch.Tensor, output: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        mask = {"attention_mask": inputs["attention_mask"]} if "attention_mask" in inputs else {}
        return {"encoder_outputs": (output.encoder_last_hidden_state,), "decoder_input_ids": token,
                "past_key_values": output.past_key_values, **mask}

    return Decoding(first=first, next=next_step)


def decoding_for(model_config: PretrainedConfig, trust_remote_code: bool = False) -> Decoding:
    if not model_config.is_encoder_decoder:
        return replace(CAUSAL, restart_at=longrope_limit(model_config))
    return seq2seq_decoding(decoder_inputs_from_labels(model_config, trust_remote_code))


def pads_apart(model_config: PretrainedConfig, attn_implementation: str, trust_remote_code: bool = False) -> bool:
    """Whether prompts of different lengths padded into one batch each get the logits they get alone, at the first
    token and at the next (read with the cache), probed on a small twin of the model: one whose forward ignores the
    mask, or takes no positions (Mamba's state reads the padding as text), generates its samples one at a time."""
    model, device, dtype = probe_twin(model_config, attn_implementation, trust_remote_code)
    decoding = decoding_for(model_config, trust_remote_code)
    prompts = [ids.tolist() for ids in probe_examples(((3, 7),), model.config.vocab_size)[0]]
    try:
        together = two_tokens_logits(model, decoding, prompts, device)
        alone = torch.cat([two_tokens_logits(model, decoding, [prompt], device) for prompt in prompts])
    except (RuntimeError, ValueError, TypeError, IndexError, AttributeError):  # a forward refusing a mask
        return False
    return float((together - alone).abs().max() / alone.abs().max().clamp_min(1e-12)) <= TOLERANCE[dtype]


@torch.no_grad()
def two_tokens_logits(model: torch.nn.Module, decoding: Decoding, prompts: list[list[int]],
                      device: torch.device) -> torch.Tensor:
    """The logits of each prompt's next token, and of the one after a fixed token: (prompts, 2, vocabulary)."""
    inputs = {name: tensor.to(device) for name, tensor in decoding.first(prompts, prompts).items()}
    output = model(**inputs, use_cache=True)
    following = model(**decoding.next(torch.full((len(prompts), 1), 5, device=device), output, inputs),
                      use_cache=True)
    return torch.stack([output.logits[:, -1], following.logits[:, -1]], dim=1).float()


def fit_to_context(samples: list[Sample], model_config: PretrainedConfig, max_new_tokens: int) -> list[Sample]:
    """Causal prompts cut from the left so that prompt and answer fit the model's positions
    (`max_position_embeddings`), as text-generation pipelines truncate: GPT-2's learned positions end at 1024, and a
    prompt of nearly a block plus --eval_max_new_tokens new tokens ended the run at an evaluation (IndexError on a
    CPU, a device-side assert on a GPU). An encoder-decoder reads its source whole; its positions are checked with
    the data."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if model_config.is_encoder_decoder or not limit:
        return samples
    keep = limit - max_new_tokens
    return [replace(sample, prompt=sample.prompt[-keep:]) if len(sample.prompt) > keep else sample
            for sample in samples]


def whole_samples(candidates: Iterable[Sample], count: int, stop_ids: set[int]) -> tuple[list[Sample], int]:
    """The first `count` samples whose reference ends with a stop token, and how many were passed over to find them.
    A reference that does not was cut when the data was prepared (--too_long truncate), and generations were scored
    against its first tokens ("E" for a one-line summary), unsaid. (A seq2seq target cut at --max_target_length
    keeps its EOS, and is scored as cut: docs/seq2seq.md.)
    When no reference ends with a stop token, the tokenizer's end of turn is not the one the data's references end
    with: the first `count` samples are taken, none passed over. At most `max(10 * count, 1000)` are looked at (a
    split of millions is not read at every start to find that)."""
    first: list[Sample] = []
    whole: list[Sample] = []
    passed_over = 0
    for sample in islice(candidates, max(10 * count, 1000)):
        if len(first) < count:
            first.append(sample)
        if sample.reference[-1] in stop_ids:
            whole.append(sample)
            if len(whole) == count:
                break
        else:
            passed_over += 1
    return (whole, passed_over) if whole else (first, 0)


def sample_notes(count: int, found: int, passed_over: int, cut_prompts: int = 0) -> list[str]:
    """What --eval_samples scores when it is not the first `count` examples of the validation split as they are."""
    notes = []
    if cut_prompts:  # a chat prompt so cut loses its header and system turn
        notes.append(f"note: --eval_samples: {cut_prompts} prompt{'s are' if cut_prompts > 1 else ' is'} cut from "
                     "the left to leave --eval_max_new_tokens of the model's positions to the answer")
    if passed_over:
        notes.append(f"note: --eval_samples passed over {passed_over} validation examples whose references were cut "
                     "when the data was prepared (--too_long truncate): no generation could match them")
    if found < count:
        notes.append(f"note: --eval_samples {count}: the validation split holds {found} whole examples to score")
    return notes


def stop_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """EOS, and the token that ends an assistant turn in the tokenizer's chat template (<|eot_id|>, <|im_end|>);
    never a reference's last token, which is any token when the example was cut to the block."""
    return {tokenizer.eos_token_id} | ({end_of_turn_id(tokenizer)} - {None})


def references_past(samples: list[Sample], max_new_tokens: int, stops: set[int] = frozenset()) -> Optional[str]:
    """A note when references are longer than --eval_max_new_tokens: their generations are cut before they could
    match, and ROUGE and exact match stay low for that alone (a BART run scored 2 of its 4 samples so, unsaid). A
    reference's closing stop token (in `stops`) is not text to match: a generation cut just before it matches."""
    lengths = [len(sample.reference) - (sample.reference[-1] in stops) for sample in samples]
    longer = [length for length in lengths if length > max_new_tokens]
    if not longer:
        return None
    return (f"note: {len(longer)} of the {len(samples)} sample references are longer than --eval_max_new_tokens "
            f"{max_new_tokens} (the longest {max(longer)} tokens): their generations stop before they could match; "
            "raise it for scores that can reach them")


def all_done(fabric: Fabric, running: torch.Tensor, stopping: bool = False) -> bool:
    """True when no rank's sample is `running` (a flag on the device); EvaluationStopped when a rank is `stopping` (it
    has seen a stop signal). The one collective, and the one wait for the device, of a generated token: the tokens
    themselves come back to the host once the sample ends (each was read back as it came, a second wait)."""
    flags = torch.stack([running.float(), torch.tensor(float(stopping), device=running.device)])
    if fabric.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    still_running, stop = flags.tolist()
    if stop:
        raise EvaluationStopped
    return still_running == 0


@torch.no_grad()
def generate_in_lockstep(fabric: Fabric, model: torch.nn.Module, batch: list[Sample], *, decoding: Decoding,
                         max_new_tokens: int, stop_ids: set[int],
                         stopping: Callable[[], bool] = lambda: False) -> list[list[int]]:
    """Greedy tokens after each prompt of `batch` (empty: a placeholder row), until a stop token or
    `max_new_tokens`; EvaluationStopped as soon as a rank is `stopping` (it has seen a stop signal)."""
    module = strategy_module(model)
    placeholder = [next(iter(stop_ids))]
    rows = batch or [Sample(prompt=placeholder, reference=placeholder)]
    inputs = {name: tensor.to(fabric.device) for name, tensor in
              decoding.first([row.prompt for row in rows], [row.reference for row in rows]).items()}
    last_logits = {"logits_to_keep": 1} if keeps_last_logits(model) else {}  # not a prompt's worth of vocabularies
    stops = torch.tensor(sorted(stop_ids), device=fabric.device)
    running = torch.full((len(rows),), bool(batch), device=fabric.device)
    tokens: list[torch.Tensor] = []
    prompt = inputs["input_ids"]
    for _ in range(max_new_tokens):
        with fabric.autocast():
            output = module(**inputs, **last_logits, use_cache=True)
        token = output.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        running = running & ~torch.isin(token, stops).flatten()
        if all_done(fabric, running.any(), stopping()):
            break
        if prompt.shape[1] + len(tokens) - 1 == decoding.restart_at and len(rows) == 1:  # the last token crosses it
            inputs = {"input_ids": torch.cat([prompt, *tokens], dim=1)}  # no cache: every position anew
        else:
            inputs = decoding.next(token, output, inputs)
    generated = torch.cat(tokens, dim=1).tolist() if batch and tokens else [[] for _ in batch]
    return [up_to_stop(row, stop_ids) for row in generated]  # other rows, and other ranks' samples, may run on


def up_to_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    ends = next((index for index, token in enumerate(tokens) if token in stop_ids), None)
    return tokens if ends is None else tokens[:ends + 1]


def keeps_last_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward can compute the logits of the last position only (transformers' causal LMs):
    a prompt's logits over the whole vocabulary, which the loss path never builds in training, were computed at
    every sample's first token (4.2 GB in float32 for an 8K prompt of a 128K vocabulary)."""
    return "logits_to_keep" in inspect.signature(type(hugging_face_model(model)).forward).parameters


def generation_batches(lengths: list[int], max_new_tokens: int, token_budget: int) -> list[list[int]]:
    """Which prompts (indices into `lengths`) go through together: longest first, as many as fit
    `token_budget` tokens once padded to the longest and grown by `max_new_tokens`; one at a time when the budget
    is 0 (padding changes the model's logits) or cannot hold two."""
    batches: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * (lengths[batches[-1][0]] + max_new_tokens) <= token_budget:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def generate_samples(fabric: Fabric, model: torch.nn.Module, samples: list[Sample], *, decoding: Decoding,
                     max_new_tokens: int, stop_ids: set[int], token_budget: int = 0,
                     stopping: Callable[[], bool] = lambda: False) -> list[list[int]]:
    """The generated tokens of every sample, on every rank; each rank generates every world-size-th one, in the
    batches `generation_batches` makes of them within `token_budget`. Every rank makes as many batches' calls as
    the rank with the most, which each rank counts from the samples alone: no collective decides it."""
    shares = [list(range(rank, len(samples), fabric.world_size)) for rank in range(fabric.world_size)]
    batches = [[[share[i] for i in batch] for batch in
                generation_batches([len(samples[i].prompt) for i in share], max_new_tokens, token_budget)]
               for share in shares]
    mine = batches[fabric.global_rank]
    generated: dict[int, list[int]] = {}
    with evaluation_mode(model):
        for round_ in range(max(len(rank_batches) for rank_batches in batches)):
            batch = mine[round_] if round_ < len(mine) else []
            generated |= zip(batch, generate_in_lockstep(fabric, model, [samples[i] for i in batch],
                                                         decoding=decoding, max_new_tokens=max_new_tokens,
                                                         stop_ids=stop_ids, stopping=stopping))
    gathered = [generated]
    if fabric.world_size > 1:
        gathered = [{}] * fabric.world_size
        dist.all_gather_object(gathered, generated)
    every = {index: tokens for part in gathered for index, tokens in part.items()}
    return [every[index] for index in range(len(samples))]


class RougeWords:
    """Words for ROUGE in every script, stemmed as published English summarization scores are.

    rouge_score's own tokenizer keeps only [a-z0-9]: a Cyrillic or Chinese answer identical to its reference scores
    0. Here a word is a run of letters, digits and their marks in any script, lower-cased, except in scripts written
    without spaces (Thai, kana, CJK ideographs), where each character (with its marks) is a word, as multilingual
    ROUGE does; ASCII words longer
    than 3 characters go through rouge_score's Porter stemmer, so that on ASCII text this gives exactly the words
    of rouge_score's default tokenizer with use_stemmer=True. (rouge_score accepts any object with `tokenize`.)
    """

    def __init__(self) -> None:
        from nltk.stem import porter

        self.stemmer = porter.PorterStemmer()

    def tokenize(self, text: str) -> list[str]:
        return [self.stemmer.stem(word) if STEMMED.fullmatch(word) else word for word in WORD.findall(text.lower())]


def one_sentence_per_line(text: str) -> str:
    """The text with each sentence on a line of its own: a line ends one, and so does `.`, `!` or `?` before a space,
    or another script's full stop (SENTENCE_END) (nltk's punkt, which run_summarization.py uses, also knows
    abbreviations, but needs data downloaded first)."""
    sentences = (sentence for line in text.splitlines() for sentence in SENTENCE_END.split(line.strip()))
    return "\n".join(sentence for sentence in sentences if sentence)


def sample_metrics(generated: list[str], references: list[str], lengths: list[int]) -> dict[str, float]:
    """Exact match, mean ROUGE-1/2/L/Lsum F-measures (Google's rouge-score, words of every script, stemmed; rougeLsum
    matches sentence by sentence, as published summarization results do) and the mean generated length in tokens.
    Splitting into sentences changes only rougeLsum: the other three read the text as one sequence of words."""
    from rouge_score.rouge_scorer import RougeScorer

    scorer = RougeScorer(list(ROUGE_KEYS), tokenizer=RougeWords())
    scores = [scorer.score(target=one_sentence_per_line(r), prediction=one_sentence_per_line(g))
              for g, r in zip(generated, references)]
    metrics = {f"sample_{key}": sum(score[key].fmeasure for score in scores) / len(scores) for key in ROUGE_KEYS}
    exact = sum(g.strip() == r.strip() for g, r in zip(generated, references)) / len(references)
    return metrics | {"sample_exact_match": exact, "sample_length": sum(lengths) / len(lengths)}


def set_aside_samples_after(out_dir: Path, step: int) -> list[Path]:
    """Move the samples written after `step` (by a stretch a rollback or a resume from an older checkpoint abandons)
    into samples/rolled-back/, as their checkpoints go: show_samples.py shows the latest file."""
    written = {path: re.fullmatch(r"step-(\d+)", path.stem) for path in samples_written(out_dir)}
    return [move_aside(path) for path, name in sorted(written.items()) if name and int(name.group(1)) > step]


def samples_written(out_dir: Path) -> list[Path]:
    """The samples files a run wrote into `out_dir` (samples/step-N.jsonl), in no particular order."""
    return list((out_dir / SAMPLES_DIR).glob("step-*.jsonl"))


def write_samples(path: Path, prompts: list[str], references: list[str], generated: list[str]) -> None:
    """Written whole (show_samples.py may read it meanwhile; a kill must not leave half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, "".join(json.dumps({"prompt": prompt, "reference": reference, "generated": text}) + "\n"
                               for prompt, reference, text in zip(prompts, references, generated)))


@dataclass
class SampleEvaluator:
    """The fixed samples of a run and how to score them; `evaluate` is called by every rank at each evaluation."""

    samples: list[Sample]
    tokenizer: PreTrainedTokenizerBase
    decoding: Decoding
    max_new_tokens: int
    out_dir: Path
    token_budget: int = 0
    """The tokens of a rank's prompts generated together, padded and grown by max_new_tokens (0: one at a time):
    their keys and values stay in every layer until the last token."""

    @property
    def stop_ids(self) -> set[int]:
        return stop_ids(self.tokenizer)

    def evaluate(self, fabric: Fabric, model: torch.nn.Module, step: int,
                 stopping: Callable[[], bool] = lambda: False) -> dict[str, float]:
        """Generate, write and score the samples; EvaluationStopped when a rank is `stopping` (a stop signal)."""
        tokens = generate_samples(fabric, model, self.samples, decoding=self.decoding,
                                  max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids,
                                  token_budget=self.token_budget, stopping=stopping)
        if not fabric.is_global_zero:
            return {}
        generated = [self.text(ids) for ids in tokens]
        references = [self.text(sample.reference) for sample in self.samples]
        folder = self.out_dir / SAMPLES_DIR
        written_or_warned(folder, partial(write_samples, folder / f"step-{step:08d}.jsonl",
                                          [self.text(sample.prompt, special=True) for sample in self.samples],
                                          references, generated))
        return sample_metrics(generated, references, [len(ids) for ids in tokens])

    def text(self, ids: list[int], special: bool = False) -> str:
        """Generated text and references without special tokens (what ROUGE scores); prompts with them but for the
        BOS, where a chat template's role markers are special tokens (Llama-3's `<|start_header_id|>user
        <|end_header_id|>`): without them the roles ran into the text ("code.user def ...")."""
        if not special:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode([i for i in ids if i != self.tokenizer.bos_token_id], skip_special_tokens=False)
