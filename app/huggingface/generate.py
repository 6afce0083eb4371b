"""Print what a Hugging Face model folder writes: the last step of the demos, and a quick check of a conversion.

python generate.py demo/hf-model --prompt "def parse(" --max_new_tokens 80
python generate.py demo/sft/hf-model --chat true --prompt $'def add(a, b):\\n    return a + b' --temperature 0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer

from app.checkpoint.io import is_checkpoint
from app.cli import UsageError, first_line
from app.folders import DATASET_DICT_FILE
from app.hub import load_problem, missing_model_problem, quiet_hub, unloadable_tokenizer
from app.huggingface.generate_cli import GenerateArgs
from app.model.build import model_class
from app.prepare.tokenizer import document_suffix, encode_texts


def model_input(tokenizer, args: GenerateArgs, config: Any) -> dict[str, torch.Tensor]:
    """The prompt encoded as prepare_data.py encodes training text: special-token text in it ("</s>",
    "<|eot_id|>" in code about tokenizers) stays text, where the tokenizer alone made it an end of sequence in the
    middle of the prompt, which the model never saw in training."""
    if args.chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True, sanitize_control_tokens=True)
    if config.is_encoder_decoder:
        return source_input(tokenizer, args.prompt)
    return tokenizer(args.prompt, return_tensors="pt", split_special_tokens=True)


def source_input(tokenizer, text: str) -> dict[str, torch.Tensor]:
    """An encoder-decoder's source encoded as prepare_data.py encodes every training source (app/prepare/seq2seq.py):
    ending with exactly one EOS. The tokenizer alone adds none when it is the SentencePiece one prepare_data.py trains
    (T5's own does): the model then read a source unlike any it was trained on, and 30 of 60 greedy summaries of a
    T5 trained for 250 steps changed."""
    ids = torch.tensor([encode_texts(tokenizer, [text], document_suffix(tokenizer))[0]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def check_positions(config: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt and the answer within the model's positions (max_position_embeddings), before generating: past
    them BART's and GPT-2's learned positions ended in an IndexError traceback, and rotary ones go where training
    never went. An encoder-decoder's source fills the encoder's positions, its answer the decoder's."""
    positions = getattr(config, "max_position_embeddings", None)
    if not positions:
        return
    if config.is_encoder_decoder and prompt_tokens > positions:
        raise UsageError(f"--prompt is {prompt_tokens} tokens, more than the {positions} the model's encoder reads "
                         "(max_position_embeddings); shorten it")
    answer_room = positions - 1 if config.is_encoder_decoder else positions - prompt_tokens
    if max_new_tokens > answer_room:
        where = "the decoder's" if config.is_encoder_decoder else f"a prompt of {prompt_tokens} tokens and the model's"
        raise UsageError(f"--max_new_tokens {max_new_tokens} passes {where} {positions} positions "
                         f"(max_position_embeddings); give at most {max(answer_room, 0)}"
                         + ("" if answer_room > 0 else ", with a shorter --prompt"))


def sampling(args: GenerateArgs, own_config: Any) -> dict[str, Any]:
    """generate()'s sampling options: --temperature when given, else the model's own generation config when it
    samples, else a temperature of 0.8 among the 50 likeliest tokens."""
    if args.temperature == 0:
        return {"do_sample": False}
    if args.temperature is None and own_config.do_sample:
        return {}
    return {"do_sample": True, "temperature": args.temperature or 0.8, "top_k": 50}


def generate(args: GenerateArgs) -> str:
    """What the model writes: a plain prompt and its continuation, or a chat message (a source) and the answer,
    then how many tokens it wrote and why it stopped (a stop token of its generation config, or the limit)."""
    tokenizer, config = load_tokenizer_and_config(args)
    if args.chat and not tokenizer.chat_template:
        raise UsageError(f"MODEL {args.model} has no chat template; drop --chat")
    device = generation_device(args.device)
    inputs = model_input(tokenizer, args, config)
    if inputs["input_ids"].shape[1] == 0:
        raise UsageError("--prompt is empty and the tokenizer adds no BOS token to begin with: give some text")
    check_positions(config, inputs["input_ids"].shape[1], args.max_new_tokens)
    model = load_model(args, config).to(device)
    torch.manual_seed(args.seed)
    output = model.generate(**{name: value.to(device) for name, value in inputs.items()},
                            max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id,
                            **sampling(args, model.generation_config)).cpu()
    prompt_ids = inputs["input_ids"][0]
    new_tokens = output[0, 1:] if config.is_encoder_decoder else output[0, len(prompt_ids):]
    if args.chat or config.is_encoder_decoder:
        text = f"{args.prompt}\n--> {tokenizer.decode(new_tokens, skip_special_tokens=True)}"
    else:
        text = args.prompt + continuation(tokenizer, prompt_ids, output[0])
    ending = why_it_stopped(new_tokens.tolist(), model.generation_config, tokenizer, args.max_new_tokens)
    return f"{text}\n({len(new_tokens)} new tokens, {ending})"


def continuation(tokenizer: Any, prompt_ids: torch.Tensor, output_ids: torch.Tensor) -> str:
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


def load_model(args: GenerateArgs, config: Any) -> Any:
    """The folder's weights; a folder without them, or with a file cut short (an interrupted copy), in one line."""
    try:
        with quiet_hub():
            return model_class(config).from_pretrained(args.model, trust_remote_code=args.trust_remote_code).eval()
    except (OSError, ValueError, SafetensorError) as error:
        raise UsageError(f"MODEL {args.model}: its weights do not load ({first_line(error)}); convert the checkpoint "
                         "again (convert_to_hf.py) or copy the folder again") from None


def load_tokenizer_and_config(args: GenerateArgs) -> tuple[Any, Any]:
    """The folder's (or Hub model's) tokenizer and config, before any weights are read; an uncached Hub id without the
    Hub is refused at once (app/hub.py), not after a minute of retries."""
    missing = missing_model_problem("MODEL", args.model) or training_folder_problem(Path(args.model))
    if missing:
        raise UsageError(missing)
    try:
        with quiet_hub():
            config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as error:
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
    if path.name.startswith("step-") and is_checkpoint(path) or (path / "checkpoints").is_dir():  # not --all's
        return (f"MODEL {path} is a train.py checkpoint or run folder: convert it first (python convert_to_hf.py "
                f"--checkpoint {path} --output_dir DIR), then give DIR")
    if (path / DATASET_DICT_FILE).is_file():
        return f"MODEL {path} is a prepared data folder; give a folder written by convert_to_hf.py"
    return None


def why_it_stopped(new_tokens: list[int], own_config: Any, tokenizer: Any, max_new_tokens: int) -> str:
    """A stop token the model wrote, or the limit: a generation config's forced_eos_token_id (BART's) puts the stop
    token in the last place the limit leaves, which the model did not choose."""
    stops = own_config.eos_token_id if isinstance(own_config.eos_token_id, list) else [own_config.eos_token_id]
    forced = getattr(own_config, "forced_eos_token_id", None) is not None and len(new_tokens) >= max_new_tokens
    if new_tokens and new_tokens[-1] in stops and not forced:
        return f"stopped at {tokenizer.convert_ids_to_tokens(new_tokens[-1])}"
    return "--max_new_tokens reached"
