"""Shared fixtures: a tiny Llama built from a config, a tokenizer trained here, and real text packed into blocks.

Nothing is downloaded: the text is the Python standard library's own source, the tokenizer is trained on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 32


@dataclass(frozen=True)
class TinySetup:
    model_config: Path
    tokenizer: Path
    data: Path


def stdlib_texts(package: str = "json") -> list[str]:
    folder = Path(sysconfig.get_paths()["stdlib"]) / package
    return [path.read_text() for path in sorted(folder.glob("*.py"))]


def build_tiny_setup(root: Path) -> TinySetup:
    import datasets
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    texts = stdlib_texts()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    hf_tokenizer.save_pretrained(root / "tokenizer")

    stream: list[int] = []
    for text in texts:
        stream += hf_tokenizer(text)["input_ids"] + [hf_tokenizer.eos_token_id]
    blocks = [stream[i:i + BLOCK_SIZE] for i in range(0, len(stream) - BLOCK_SIZE + 1, BLOCK_SIZE)]
    held_out = len(blocks) // 10
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"input_ids": blocks[held_out:]}),
        "validation": datasets.Dataset.from_dict({"input_ids": blocks[:held_out]}),
    }).save_to_disk(str(root / "data"))

    LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                eos_token_id=hf_tokenizer.eos_token_id, bos_token_id=None).save_pretrained(root / "model")
    return TinySetup(model_config=root / "model", tokenizer=root / "tokenizer", data=root / "data")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinySetup:
    return build_tiny_setup(tmp_path_factory.mktemp("tiny"))


def train_args(tiny: TinySetup, out_dir: Path, **overrides: object) -> list[str]:
    """The issue's reference command line, with overrides (`devices=1`, `resume=True`, ...)."""
    options = {
        "accelerator": "cpu", "devices": 2, "strategy": "fsdp", "precision": "32-true",
        "model_config": tiny.model_config, "tokenizer": tiny.tokenizer, "train_data_dir": tiny.data,
        "out_dir": out_dir, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "max_step": 24, "lr": 3e-3,
        "min_lr": 3e-4, "warmup_steps": 4, "eval_step_interval": 8, "eval_iters": 4, "save_step_interval": 8,
        "log_interval": 1, "wandb_mode": "disabled", "seed": 7, "num_workers": 0,
    } | overrides
    args = []
    for name, value in options.items():
        if value is not None:
            args += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def run_train(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """train.py in real processes, as a user runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
