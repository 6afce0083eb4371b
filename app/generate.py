"""Print what a Hugging Face model folder writes: the last step of the demos, and a quick check of a conversion.

python -m app.generate demo/hf-model --prompt "def parse(" --max_new_tokens 80
python -m app.generate demo/sft-model --chat true --prompt "def add(a, b):\\n    return a + b" --temperature 0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jsonargparse import auto_cli
from transformers import AutoConfig, AutoTokenizer

from app.model import model_class


@dataclass
class GenerateArgs:
    model: str
    """Folder written by convert_to_hf.py (or any Hugging Face causal LM or encoder-decoder)."""
    prompt: str = "def "
    """Text to continue; with --chat, the user's message; for an encoder-decoder, the source."""
    chat: bool = False
    """Wrap the prompt in the tokenizer's chat template, as a user message followed by the assistant's turn."""
    max_new_tokens: int = 80
    """Tokens to generate."""
    temperature: float = 0.8
    """Sampling temperature; 0 for greedy decoding."""
    seed: int = 0
    """Sampling seed."""


def model_input(tokenizer, args: GenerateArgs) -> dict[str, torch.Tensor]:
    if not args.chat:
        return tokenizer(args.prompt, return_tensors="pt")
    return tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


def generate(args: GenerateArgs) -> str:
    """What the model writes: a plain prompt and its continuation, or a chat message (a source) and the answer."""
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = AutoConfig.from_pretrained(args.model)
    model = model_class(config).from_pretrained(args.model).eval()
    inputs = model_input(tokenizer, args)
    torch.manual_seed(args.seed)
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=50) if args.temperature > 0 else {}
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id,
                            **sampling)
    new_tokens = output[0] if config.is_encoder_decoder else output[0, inputs["input_ids"].shape[1]:]
    written = tokenizer.decode(new_tokens, skip_special_tokens=True)
    answers = args.chat or config.is_encoder_decoder
    return f"{args.prompt}\n--> {written}" if answers else args.prompt + written


if __name__ == "__main__":
    print(generate(auto_cli(GenerateArgs)))
