"""Print what a Hugging Face model folder writes: the last step of the demos, and a quick check of a conversion.

python generate.py demo/hf-model --prompt "def parse(" --max_new_tokens 80
python generate.py demo/sft/hf-model --chat true --prompt $'def add(a, b):\\n    return a + b' --temperature 0
python generate.py demo/summarize/hf-model --prompts test.jsonl --prompt_field code --reference_field summary \\
    --output answers.jsonl

One prompt and a file of them take the same path (`answer_batch`): a prompt answered alone is a batch of one.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from app.checkpoint.files import LEFTOVER_NAME
from app.checkpoint.io import is_checkpoint
from app.cli import UsageError, first_line
from app.folders import DATASET_DICT_FILE, replace_file
from app.hub import (CONFIG_ERRORS, load_problem, missing_model_problem, missing_weights_problem, quiet_hub,
                     unloadable_tokenizer)
from app.huggingface.generate_cli import GenerateArgs, offered_tools
from app.huggingface.prompts_file import Answer, Messages, PromptRow, answer_record, read_prompts, scores_line
from app.model.build import model_class
from app.prepare.chat import rendering_problem, template_messages
from app.prepare.chat_template import ChatText, ReasoningBlock, end_of_turn, reasoning_block
from app.prepare.seq2seq import fit
from app.prepare.tokenizer import document_frame, document_suffix, encode_texts, render_chat, special_token_ids


DEFAULT_PROMPT = "def "
TRAINED_LENGTHS_FILE = "trained_lengths.json"
"""In a folder convert_to_hf.py wrote for an encoder-decoder: the length its training sources were cut to."""
PROGRESS_EVERY_SEC = 10


def model_input(tokenizer, text: Union[str, Messages], chat: bool, config: Any,
                tools: Optional[list] = None) -> dict[str, torch.Tensor]:
    """A prompt encoded as prepare_data.py encodes training text: special-token text in it ("</s>",
    "<|eot_id|>" in code about tokenizers) stays text, where the tokenizer alone made it an end of sequence in the
    middle of the prompt, which the model never saw in training. A chat's messages (or `text` as a user's message,
    when `chat`) go through the chat template with the `tools` it offers, ending with the assistant's turn."""
    if chat or not isinstance(text, str):
        messages = text if not isinstance(text, str) else [{"role": "user", "content": text}]
        return render_chat(tokenizer, messages, generation_prompt=True, return_tensors="pt", tools=tools)
    if config.is_encoder_decoder:
        return source_input(tokenizer, text)
    return tokenizer(text, return_tensors="pt", split_special_tokens=True)


def encoded_prompt(tokenizer, config: Any, text: Union[str, Messages], args: GenerateArgs, what: str,
                   tools: Optional[list] = None) -> list[int]:
    """A prompt's tokens, refused in one line (naming `what`) when empty."""
    ids = model_input(tokenizer, text, args.chat, config, tools)["input_ids"][0].tolist()
    if not ids:
        raise UsageError(f"{what} is empty and the tokenizer adds no BOS token to begin with: give some text")
    return ids


def source_input(tokenizer, text: str) -> dict[str, torch.Tensor]:
    """An encoder-decoder's source encoded as prepare_data.py encodes every training source (app/prepare/seq2seq.py):
    ending with exactly one EOS. The tokenizer alone adds none when it is the SentencePiece one prepare_data.py trains
    (T5's own does): the model then read a source unlike any it was trained on, and 30 of 60 greedy summaries of a
    T5 trained for 250 steps changed."""
    ids = torch.tensor([encode_texts(tokenizer, [text], document_suffix(tokenizer))[0]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def check_positions(config: Any, prompt_tokens: int, max_new_tokens: int, what: str = "--prompt") -> None:
    """The prompt and the answer within the model's positions (max_position_embeddings), before generating: past
    them BART's and GPT-2's learned positions ended in an IndexError traceback, and rotary ones go where training
    never went. An encoder-decoder's source fills the encoder's positions, its answer the decoder's."""
    positions = getattr(config, "max_position_embeddings", None)
    if not positions:
        return
    if config.is_encoder_decoder and prompt_tokens > positions:
        raise UsageError(f"{what} is {prompt_tokens} tokens, more than the {positions} the model's encoder reads "
                         "(max_position_embeddings); shorten it")
    answer_room = positions - 1 if config.is_encoder_decoder else positions - prompt_tokens
    if answer_room <= 0:  # the prompt, not --max_new_tokens, is what to change
        raise UsageError(f"{what} is {prompt_tokens} tokens, as many as the model's {positions} positions or more "
                         "(max_position_embeddings), leaving none to answer in; shorten it")
    if max_new_tokens > answer_room:
        named = "" if what == "--prompt" else f" ({what})"
        where = ("the decoder's" if config.is_encoder_decoder
                 else f"a prompt of {prompt_tokens} tokens{named} and the model's")
        raise UsageError(f"--max_new_tokens {max_new_tokens} passes {where} {positions} positions "
                         f"(max_position_embeddings); give at most {answer_room}")


def decoding(args: GenerateArgs, own: GenerationConfig) -> GenerationConfig:
    """What generate() decodes with: the model's own generation config when --temperature is not given and it
    samples; else its start, pad and stop tokens alone, with --temperature (0: greedy, as train.py's samples are)
    and the model's own top-p and top-k when it samples (Llama-3-Instruct's 0.9: a given temperature sampled among
    the 50 likeliest tokens instead), else top-k 50, at 0.8 by default. The rest of a base model's config applied
    too, under any temperature: its repetition_penalty (Qwen's 1.05) made 4 of 6 greedy answers differ from the
    run's samples of the same checkpoint, and BART's beams, no-repeat n-grams and minimum length would have done
    the same."""
    if args.temperature is None and own.do_sample:
        return own
    tokens = {name: getattr(own, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                     "decoder_start_token_id")}
    if args.temperature == 0:
        return GenerationConfig(do_sample=False, **tokens)
    among = {"top_p": own.top_p, "top_k": own.top_k, "min_p": own.min_p} if own.do_sample else {"top_k": 50}
    return GenerationConfig(do_sample=True, temperature=args.temperature or 0.8, **among, **tokens)


def generate(args: GenerateArgs) -> str:
    """What the model writes for --prompt: see `shown`."""
    tokenizer, config, device = tokenizer_config_and_device(args)
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    tools = offered_tools(args)
    check_tools_written(tokenizer, tools, f"--tools {args.tools}")
    ids = encoded_prompt(tokenizer, config, prompt, args, "--prompt", tools)
    (ids,) = trained_sources(tokenizer, config, [ids], args)
    check_positions(config, len(ids), args.max_new_tokens)
    model = load_model(args, config, tokenizer).to(device)
    torch.manual_seed(args.seed)
    (answer,) = answer_batch(model, tokenizer, config, [ids], args, device)
    return shown(prompt, answer, answered_alone(args, config))


def answer_file(args: GenerateArgs) -> None:
    """The answers to every prompt of --prompts, in batches of prompts of similar lengths (less padding), printed
    (`shown`) or written to --output in the file's order; scored against --reference_field when given. Every prompt
    is checked before the model loads."""
    tokenizer, config, device = tokenizer_config_and_device(args)
    rows = read_prompts(Path(args.prompts), args.prompt_field, args.reference_field, args.messages_field,
                        args.input_field, args.system_field, args.tools_field or "tools")
    rows = [with_reference(tokenizer, row, line_of(row, args)) for row in rows]
    tools = offered_tools(args)
    check_tools_written(tokenizer, tools, f"--tools {args.tools}")
    encoded = [encoded_prompt(tokenizer, config, row.prompt, args, line_of(row, args), row.tools or tools)
               for row in rows]
    prompts = trained_sources(tokenizer, config, encoded, args)
    longest = max(range(len(rows)), key=lambda index: len(prompts[index]))  # what fits it fits every prompt
    check_positions(config, len(prompts[longest]), args.max_new_tokens, f"{line_of(rows[longest], args)}, the longest")
    model = load_model(args, config, tokenizer).to(device)
    torch.manual_seed(args.seed)
    reasoning = written_reasoning(tokenizer, args)
    order = sorted(range(len(rows)), key=lambda index: len(prompts[index]))
    found: dict[int, Answer] = {}
    said = time.monotonic()
    for start in range(0, len(order), args.batch_size):
        batch = order[start:start + args.batch_size]
        found |= zip(batch, answer_batch(model, tokenizer, config, [prompts[index] for index in batch], args, device,
                                         reasoning))
        if time.monotonic() - said > PROGRESS_EVERY_SEC or len(found) == len(rows):
            print(f"answered {len(found)} of {len(rows)} prompts", file=sys.stderr, flush=True)
            said = time.monotonic()
    answers = [found[index] for index in range(len(rows))]
    against = (repr(args.reference_field) if args.reference_field is not None else
               f"the last assistant message of {args.messages_field!r}" if args.messages_field is not None else None)
    references = [as_the_model_writes(tokenizer, row.reference or "") for row in rows]
    if reasoning is not None:  # a reference with reasoning (a tool call's turn as the template writes it) alike
        references = [reasoning.split(reference)[1] for reference in references]
        against = against and f"{against} (the answers after their reasoning's {reasoning.closing})"
    scores = scores_line(references, answers, against) if against else None  # seconds of ROUGE: before --output
    if args.output is None:
        alone = answered_alone(args, config)
        print("\n\n".join(shown(row.prompt, answer, alone) for row, answer in zip(rows, answers)))
    else:
        replace_file(Path(args.output), (json.dumps(answer_record(row, answer), ensure_ascii=False) + "\n"
                                          for row, answer in zip(rows, answers)))
        print(f"wrote {len(answers)} answers to {args.output}")
    if scores:
        print(scores)


def trained_source_length(model: str) -> Optional[int]:
    """The length the training sources were cut to, as convert_to_hf.py recorded it in the model's folder; None for
    another folder or a Hub name."""
    try:
        recorded = json.loads((Path(model) / TRAINED_LENGTHS_FILE).read_text()).get("max_source_length")
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, int) and recorded > 0 else None


def trained_sources(tokenizer: Any, config: Any, prompts: list[list[int]], args: GenerateArgs) -> list[list[int]]:
    """An encoder-decoder's sources cut to --max_source_length, else to the length its training sources were cut to
    (recorded by convert_to_hf.py), before their end and keeping their EOS as prepare_data.py --max_source_length
    cuts them, with a note saying how many: read whole, a source longer than any the model trained on gave another
    answer than the run's samples, unsaid. Other models' sources, and a decoder-only model's prompts, stay whole."""
    if args.max_source_length and not config.is_encoder_decoder:
        raise UsageError(f"--max_source_length applies to an encoder-decoder's sources; MODEL {args.model} is a "
                         "decoder-only model: drop it")
    limit = args.max_source_length or trained_source_length(args.model)
    if not config.is_encoder_decoder or not limit:
        return prompts
    longer = sum(len(prompt) > limit for prompt in prompts)
    if longer:
        given = ("--max_source_length" if args.max_source_length else
                 f"the --max_source_length the model trained with, from its {TRAINED_LENGTHS_FILE}; give "
                 "--max_source_length to read more")
        print(f"note: {longer} of {len(prompts)} sources {'are' if longer > 1 else 'is'} longer than {limit} tokens: "
              f"cut to them before their end, keeping the EOS ({given})", file=sys.stderr, flush=True)
    tail = document_frame(tokenizer).tail
    return [fit(prompt, limit, tail) for prompt in prompts]


def template_text(tokenizer: Any) -> ChatText:
    """What renders chats to text with the tokenizer's chat template, as prepare_data.py checks them."""
    return ChatText(tokenizer.get_chat_template(), dict(tokenizer.special_tokens_map))


def check_tools_written(tokenizer: Any, tools: Optional[list], what: str) -> None:
    """Refuse --tools where the chat template fails on them or does not write them: the model would be asked
    without them, unsaid, or the template's error would end in a traceback."""
    if tools is None:
        return
    rendered, chat = template_text(tokenizer), [{"role": "user", "content": "Hello."}]
    if rendered(chat, tools=tools) is None and rendered(chat) is not None:
        raise UsageError(f"{what}: the model's chat template fails on these tools ({rendered.failure(chat, tools)}); "
                         "give them in the shape it reads")
    if rendered(chat, tools=tools) == rendered(chat):
        raise UsageError(f"{what}: the model's chat template does not write tools, so it would be asked without them")


def with_reference(tokenizer: Any, row: PromptRow, what: str) -> PromptRow:
    """A chat line checked against the chat template as prepare_data.py checks a row (a message, a tool call, the
    tools or reasoning it would leave out is refused: the model would be asked without them, or scored against
    nothing). One whose last message calls tools has for reference the text the template writes for that turn (its
    content, then its calls in the template's format) through its end-of-turn, decoded as answers are: what the
    model learnt to write. Any other row as it is."""
    if row.chat is None:
        return row
    context = [m | {"weight": 0} if m["role"] == "assistant" else m for m in row.chat[:-1]]  # as inference renders
    problem = rendering_problem([*context, row.chat[-1]], row.tools, template_text(tokenizer), with_template="")
    if problem:
        raise UsageError(f"{what}: its chat {problem}")
    *_, last = template_messages(row.chat)
    if "tool_calls" not in last:
        return row
    before = render_chat(tokenizer, row.prompt, generation_prompt=True, tools=row.tools)["input_ids"]
    whole = render_chat(tokenizer, [*row.prompt, last], generation_prompt=False, tools=row.tools)["input_ids"]
    if whole[:len(before)] != before:
        raise UsageError(f"{what}: the chat template renders the chat before its last message otherwise than the "
                         "whole chat, so the tool calls to score cannot be read from it; leave such chats out")
    turn = whole[len(before):]
    end = end_of_turn(tokenizer, special_token_ids(tokenizer), turn, 0) or len(turn)
    return replace(row, reference=tokenizer.decode(turn[:end], skip_special_tokens=True))


def written_reasoning(tokenizer: Any, args: GenerateArgs) -> Optional[ReasoningBlock]:
    """How the chat template writes an answer's reasoning, for chat answers: a reasoning model (Qwen3) writes its
    reasoning block before the answer, and that block is not part of what the test set's answer is scored against."""
    return reasoning_block(template_text(tokenizer)) if args.chat or args.messages_field is not None else None


def as_the_model_writes(tokenizer: Any, reference: str) -> str:
    """A reference as its tokens decode, as train.py's references are (its tokenized targets): a tokenizer that
    normalises (T5's and mT5's NFKC: full-width `２０２４`, half-width kana) or lacks a character cannot write the
    file's text, and the answer equal to it as far as the model can tell scored exact match 0. Special-token text
    in a reference (`</s>` in code) is text, as in prompts and in prepare_data.py's data: encoded as the special
    token, decoding dropped it, and an answer without it scored exact match 1."""
    return tokenizer.decode(tokenizer.encode(reference, add_special_tokens=False, split_special_tokens=True),
                            skip_special_tokens=True)


def line_of(row: PromptRow, args: GenerateArgs) -> str:
    return f"line {row.line} of --prompts {args.prompts}"


def answered_alone(args: GenerateArgs, config: Any) -> bool:
    """Whether the answer is decoded on its own (a chat's, a source's) rather than as the prompt's continuation."""
    return args.chat or args.messages_field is not None or config.is_encoder_decoder


def shown(prompt: Union[str, Messages], answer: Answer, alone: bool) -> str:
    """A plain prompt and its continuation, or a chat message (a source) and the answer, then how many tokens it
    wrote and why it stopped (a stop token of its generation config, or the limit). A chat shows its last message."""
    prompt = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    text = f"{prompt}\n--> {answer.text}" if alone else prompt + answer.text
    return f"{text}\n({answer.new_tokens} new tokens, {answer.stopped})"


def tokenizer_config_and_device(args: GenerateArgs) -> tuple[Any, Any, torch.device]:
    tokenizer, config = load_tokenizer_and_config(args)
    if (args.chat or args.messages_field) and not tokenizer.chat_template:
        raise UsageError(f"MODEL {args.model} has no chat template; drop --chat" if args.chat else
                         f"MODEL {args.model} has no chat template to render the chats of --messages_field with")
    return tokenizer, config, generation_device(args.device)


def answer_batch(model: Any, tokenizer: Any, config: Any, prompts: list[list[int]], args: GenerateArgs,
                 device: torch.device, reasoning: Optional[ReasoningBlock] = None) -> list[Answer]:
    """The answers to a batch of encoded prompts, generated at once. A decoder-only model's prompts are padded on
    the left, so that every answer follows its prompt directly (generate() derives the positions from the attention
    mask); an encoder-decoder's sources on the right. Each answer ends at its first stop token: generate() fills a
    finished one with padding until the batch ends. An answer that starts with `reasoning`'s block is split into
    its reasoning and what follows."""
    pad = next((token for token in (tokenizer.pad_token_id, tokenizer.eos_token_id,
                                     *stop_tokens(model.generation_config)) if token is not None), 0)  # masked out
    inputs = padded(prompts, pad, left=not config.is_encoder_decoder)
    output = model.generate(**{name: value.to(device) for name, value in inputs.items()},
                            max_new_tokens=args.max_new_tokens, pad_token_id=pad).cpu()
    start = 1 if config.is_encoder_decoder else inputs["input_ids"].shape[1]  # after the decoder's start token
    stops = stop_tokens(model.generation_config)
    answers = []
    for prompt, row in zip(prompts, output):
        new = up_to_first_stop(row[start:].tolist(), stops)
        text = (tokenizer.decode(new, skip_special_tokens=True) if answered_alone(args, config)
                else continuation(tokenizer, prompt, prompt + new))
        thought, final = reasoning.split(text) if reasoning is not None else (None, text)
        answers.append(Answer(text, len(new), why_it_stopped(new, model.generation_config, tokenizer,
                                                             args.max_new_tokens),
                              thought, final if thought is not None else None))
    return answers


def padded(prompts: list[list[int]], pad: int, left: bool) -> dict[str, torch.Tensor]:
    """Prompts of different lengths as one batch, with the attention mask that leaves the padding out."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        place = slice(width - len(prompt), width) if left else slice(0, len(prompt))
        ids[row, place], mask[row, place] = torch.tensor(prompt), 1
    return {"input_ids": ids, "attention_mask": mask}


def stop_tokens(own_config: Any) -> list[Optional[int]]:
    """The tokens the model's generation config stops at."""
    return own_config.eos_token_id if isinstance(own_config.eos_token_id, list) else [own_config.eos_token_id]


def up_to_first_stop(tokens: list[int], stops: list[Optional[int]]) -> list[int]:
    """The tokens written up to the first stop token, included: what follows it is the batch's padding."""
    ends = [index for index, token in enumerate(tokens) if token in stops]
    return tokens[:ends[0] + 1] if ends else tokens


def continuation(tokenizer: Any, prompt_ids: list[int], output_ids: list[int]) -> str:
    """The text the model wrote after the prompt: the whole sequence decoded, less the decoded prompt, as
    transformers' text-generation pipeline does. The new tokens decoded alone lost their first space under
    tokenizers that strip a leading space when decoding (Llama-2's, Mistral's, CodeLlama's): `def parse(` continued
    with ` is` came out as `def parse(is`."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return tokenizer.decode(output_ids, skip_special_tokens=True)[len(prompt_text):]


def generation_device(name: str) -> torch.device:
    """--device as a torch device: auto is the first GPU where there is one (an 8B model converted on a GPU node
    generated on its CPU), else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device: Optional[torch.device] = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: not a device generate.py runs on; give auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA GPU is visible here; give --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} GPUs (cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1})")
    return device


def load_model(args: GenerateArgs, config: Any, tokenizer: Any) -> Any:
    """The folder's weights, decoding as --temperature says (`decoding`) from the decoder start training used
    (`trained_decoder_start`); a folder without them, with a file cut short (an interrupted copy), with weights of
    other shapes than its config.json's, or without some of them (transformers would start those at random and
    generate from them), in one line."""
    try:
        with quiet_hub(), without_load_report():
            model, loading = model_class(config).from_pretrained(args.model, trust_remote_code=args.trust_remote_code,
                                                                 output_loading_info=True)
    except (OSError, ValueError, SafetensorError, RuntimeError) as error:
        reason = ("other shapes than its config.json says" if "mismatched" in str(error)
                  else first_line(error))
        raise UsageError(f"MODEL {args.model}: its weights do not load ({reason}); convert the checkpoint "
                         "again (convert_to_hf.py) or copy the folder again") from None
    if loading["missing_keys"]:
        missing = sorted(loading["missing_keys"])
        raise UsageError(f"MODEL {args.model}: its weights lack {missing[0]}" + (
            f" and {len(missing) - 1} more" if missing[1:] else "") + "; convert the checkpoint again "
            "(convert_to_hf.py) or copy the folder again")
    model.eval()
    model.generation_config = decoding(args, model.generation_config)
    if config.is_encoder_decoder:
        model.generation_config.decoder_start_token_id = trained_decoder_start(model, tokenizer)
    if getattr(model.config, "output_router_logits", False):  # a mixture of experts trained with its router's loss:
        model.config.output_router_logits = False  # computed while decoding a padded batch, that loss raised
    return model


@contextmanager
def without_load_report() -> Iterator[None]:
    """transformers' LOAD REPORT table of the weights that did not fit or were missing, printed before its error:
    load_model says what matters in one line. A filter, not a level: below WARNING, transformers checks a tensor
    parallel plan and logs what it did not shard."""
    logger = logging.getLogger("transformers.modeling_utils")  # the logger the report is written to

    def not_the_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()

    logger.addFilter(not_the_report)
    try:
        yield
    finally:
        logger.removeFilter(not_the_report)


def trained_decoder_start(model: Any, tokenizer: Any) -> Optional[int]:
    """The token an encoder-decoder's decoder started from in training: the model's own shift of a target's labels,
    encoded as prepare_data.py encodes targets (`text_target`), as train.py's samples start (app/evaluation/samples.py
    seq2seq_decoding). T5's and BART's decoder_start_token_id; mBART's target-language code, which its labels end
    with, where its config's decoder_start_token_id (EOS) had it write in no language it was trained for."""
    labels = torch.tensor([tokenizer(text_target="x")["input_ids"]])
    try:
        return int(model.prepare_decoder_input_ids_from_labels(labels=labels)[0, 0])
    except (ValueError, TypeError, AttributeError):  # no start in its config (refused in training): generate() says
        return model.generation_config.decoder_start_token_id


def load_tokenizer_and_config(args: GenerateArgs) -> tuple[Any, Any]:
    """The folder's (or Hub model's) tokenizer and config, before any weights are read; an uncached Hub id without the
    Hub is refused at once (app/hub.py), not after a minute of retries."""
    missing = (missing_model_problem("MODEL", args.model) or missing_weights_problem("MODEL", args.model)
               or training_folder_problem(Path(args.model)))
    if missing:
        raise UsageError(missing)
    try:
        with quiet_hub():
            config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except CONFIG_ERRORS as error:
        if isinstance(error, (KeyError, TypeError, ArithmeticError)):  # read, and found wanting
            raise UsageError(f"MODEL {args.model}: its config does not load ({load_problem(error)}); fix its "
                             "config.json")
        raise UsageError(f"MODEL {args.model}: not a model folder or Hub id it can load ({load_problem(error)}); "
                         "give a folder written by convert_to_hf.py")
    try:
        with quiet_hub():
            return AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code), config
    except (OSError, ValueError) as error:  # "Couldn't instantiate the backend tokenizer" for a folder without one
        raise UsageError(f"MODEL {unloadable_tokenizer(args.model, error)}; give a folder written by "
                         "convert_to_hf.py, which saves the run's tokenizer with the model")


def training_folder_problem(path: Path) -> Optional[str]:
    """A run folder, a checkpoint or a prepared data folder given for MODEL, said as such: transformers' own reason
    ("Couldn't instantiate the backend tokenizer", "not a valid JSON file") did not say what to do."""
    if LEFTOVER_NAME.match(path.name):
        return (f"MODEL {path} is what a checkpoint save left unfinished; convert a finished checkpoint (python "
                f"convert_to_hf.py --checkpoint {path.parent.parent} --output_dir DIR takes the latest), then give DIR")
    run = path.parent if path.name == "checkpoints" and any(path.glob("step-*")) else path
    if path.name.startswith("step-") and is_checkpoint(path) or (run / "checkpoints").is_dir():  # not --all's
        return (f"MODEL {path} is a train.py checkpoint{' folder' if run != path else ''} or run folder: convert it "
                f"first (python convert_to_hf.py --checkpoint {run} --output_dir DIR), then give DIR")
    if (path / DATASET_DICT_FILE).is_file():
        return f"MODEL {path} is a prepared data folder; give a folder written by convert_to_hf.py"
    return None


def why_it_stopped(new_tokens: list[int], own_config: Any, tokenizer: Any, max_new_tokens: int) -> str:
    """A stop token the model wrote, or the limit: a generation config's forced_eos_token_id (BART's) puts the stop
    token in the last place the limit leaves, which the model did not choose."""
    stops = stop_tokens(own_config)
    forced = getattr(own_config, "forced_eos_token_id", None) is not None and len(new_tokens) >= max_new_tokens
    if new_tokens and new_tokens[-1] in stops and not forced:
        return f"stopped at {tokenizer.convert_ids_to_tokens(new_tokens[-1])}"
    return "--max_new_tokens reached"
