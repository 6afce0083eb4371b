"""Generation samples at each evaluation (--eval_samples N): greedy answers to N fixed validation prompts, written
to `out_dir/samples/step-XXXXXXXX.jsonl` and scored against their references (exact match, ROUGE, length).

Under FSDP, `model.generate()` is a known trap: it bypasses the root forward, so parameters are not gathered, and
ranks that stop at different lengths wait for each other for ever. Here every token is one call of the sharded
model's own forward (FSDP gathers and frees each layer as in evaluation), with the key/value cache, and all ranks
make the same number of calls: each takes every world-size-th prompt, a rank out of prompts or already finished
feeds a placeholder token, and one small all-reduce per token tells them when every rank is done. No rank ever
holds the whole model.
"""

from __future__ import annotations

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
from app.model.build import evaluation_mode, strategy_module
from app.model.isolation import decoder_inputs_from_labels
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

    first: Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]
    """(prompt, reference) -> the inputs of the first forward."""
    next: Callable[[torch.Tensor, Any], dict[str, Any]]
    """(last token, previous model output) -> the inputs of the next forward."""


def causal_next(token: torch.Tensor, output: Any) -> dict[str, Any]:
    """The next token with the model's cache: its key/value cache, or the state of a state-space model (Mamba's
    `cache_params`: reading `past_key_values` from its output ended the run at its first evaluation)."""
    state = getattr(output, "cache_params", None)
    return {"input_ids": token, **({"cache_params": state} if state is not None
                                   else {"past_key_values": output.past_key_values})}


CAUSAL = Decoding(first=lambda prompt, reference: {"input_ids": prompt}, next=causal_next)


def seq2seq_decoding(decoder_inputs: Callable[[torch.Tensor], torch.Tensor]) -> Decoding:
    """An encoder-decoder reads the source once; its decoder starts from the token its inputs started with in
    training, `decoder_inputs` built from the reference (the model's own shift of the labels: T5's and BART's
    decoder_start_token_id, mBART's target-language code, which its labels end with; a fixed start token made an
    mBART write in no language it was trained for), then reads its own tokens, with the encoder's output and its
    cache passed back in."""
    return Decoding(
        first=lambda source, reference: {"input_ids": source,
                                         "decoder_input_ids": decoder_inputs(reference)[:, :1].to(source.device)},
        next=lambda token, output: {"encoder_outputs": (output.encoder_last_hidden_state,),
                                    "decoder_input_ids": token, "past_key_values": output.past_key_values})


def decoding_for(model_config: PretrainedConfig, trust_remote_code: bool = False) -> Decoding:
    if not model_config.is_encoder_decoder:
        return CAUSAL
    return seq2seq_decoding(decoder_inputs_from_labels(model_config, trust_remote_code))


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
def generate_in_lockstep(fabric: Fabric, model: torch.nn.Module, sample: Optional[Sample], *, decoding: Decoding,
                         max_new_tokens: int, stop_ids: set[int],
                         stopping: Callable[[], bool] = lambda: False) -> list[int]:
    """Greedy tokens after the sample's prompt (None: a placeholder), until a stop token or `max_new_tokens`;
    EvaluationStopped as soon as a rank is `stopping` (it has seen a stop signal)."""
    module = strategy_module(model)
    real = sample is not None
    placeholder = [next(iter(stop_ids))]
    sample = sample or Sample(prompt=placeholder, reference=placeholder)
    inputs = decoding.first(torch.tensor([sample.prompt], device=fabric.device), torch.tensor([sample.reference]))
    stops = torch.tensor(sorted(stop_ids), device=fabric.device)
    running = torch.tensor(real, device=fabric.device)
    tokens: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        with fabric.autocast():
            output = module(**inputs, use_cache=True)
        token = output.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        running = running & ~torch.isin(token, stops).reshape(())
        if all_done(fabric, running, stopping()):
            break
        inputs = decoding.next(token, output)
    generated = torch.cat(tokens).flatten().tolist() if real and tokens else []
    ends = next((index for index, token in enumerate(generated) if token in stop_ids), None)
    return generated if ends is None else generated[:ends + 1]  # the other ranks' samples may have run on


def generate_samples(fabric: Fabric, model: torch.nn.Module, samples: list[Sample], *, decoding: Decoding,
                     max_new_tokens: int, stop_ids: set[int],
                     stopping: Callable[[], bool] = lambda: False) -> list[list[int]]:
    """The generated tokens of every sample, on every rank; each rank generates every world-size-th one."""
    mine = samples[fabric.global_rank::fabric.world_size]
    rounds = -(-len(samples) // fabric.world_size)
    with evaluation_mode(model):
        outputs = [generate_in_lockstep(fabric, model, mine[i] if i < len(mine) else None, decoding=decoding,
                                        max_new_tokens=max_new_tokens, stop_ids=stop_ids, stopping=stopping)
                   for i in range(rounds)]
    gathered = [outputs]
    if fabric.world_size > 1:
        gathered = [None] * fabric.world_size
        dist.all_gather_object(gathered, outputs)
    return [gathered[i % fabric.world_size][i // fabric.world_size] for i in range(len(samples))]


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

    @property
    def stop_ids(self) -> set[int]:
        return stop_ids(self.tokenizer)

    def evaluate(self, fabric: Fabric, model: torch.nn.Module, step: int,
                 stopping: Callable[[], bool] = lambda: False) -> dict[str, float]:
        """Generate, write and score the samples; EvaluationStopped when a rank is `stopping` (a stop signal)."""
        tokens = generate_samples(fabric, model, self.samples, decoding=self.decoding,
                                  max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids, stopping=stopping)
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
