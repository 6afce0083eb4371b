"""Print a continuation from a Hugging Face model folder: the last step of the demo, and a quick check of a conversion.

python -m app.generate demo/hf-model --prompt "def parse(" --max_new_tokens 80
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jsonargparse import auto_cli
from transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass
class GenerateArgs:
    model: str
    """Folder written by convert_to_hf.py (or any Hugging Face causal LM)."""
    prompt: str = "def "
    """Text to continue."""
    max_new_tokens: int = 80
    """Tokens to generate."""
    temperature: float = 0.8
    """Sampling temperature; 0 for greedy decoding."""
    seed: int = 0
    """Sampling seed."""


def generate(args: GenerateArgs) -> str:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    inputs = tokenizer(args.prompt, return_tensors="pt")
    torch.manual_seed(args.seed)
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=50) if args.temperature > 0 else {}
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id,
                            **sampling)
    return tokenizer.decode(output[0], skip_special_tokens=True)


if __name__ == "__main__":
    print(generate(auto_cli(GenerateArgs)))
