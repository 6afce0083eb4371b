"""The Hugging Face model: its config, the layer classes FSDP wraps, and building it on every rank.

Memory: every rank builds (or loads) the whole model in host RAM, in the training dtype, before FSDP shards it
and moves each rank's shard to its GPU. An 8B model in bf16 therefore needs about 16 GB of host RAM per process
during set-up (128 GB on an 8-GPU node), and only its shard on the GPU afterwards. The alternatives do not hold
today: `from_pretrained` refuses a meta-device context in transformers 5, and meta-device init followed by
loading loses non-persistent buffers such as rotary `inv_freq` (shared/notes/fsdp-on-cpu.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import Module
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

if TYPE_CHECKING:
    from lightning import Fabric

    from arguments import Config

TRAINING_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def weights_dtype(precision: str) -> torch.dtype:
    """The dtype the weights are stored in: half for *-true, fp32 master weights for mixed precision and 32-true."""
    return TRAINING_DTYPES.get(precision, torch.float32)


def model_source(cfg: Config) -> str:
    return cfg.model_name or cfg.model_config


def load_model_config(cfg: Config) -> PretrainedConfig:
    """The architecture from --model_name or --model_config (a config.json file or a folder holding one)."""
    return AutoConfig.from_pretrained(model_source(cfg), trust_remote_code=cfg.trust_remote_code)


def layer_classes(model_config: PretrainedConfig, trust_remote_code: bool = False) -> dict[str, type[Module]]:
    """Every module class of the architecture by name, found on a weightless (meta) instance."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    return {type(m).__name__: type(m) for m in model.modules()} | {"_no_split_modules": model._no_split_modules or []}


def resolve_wrap_classes(
    model_config: PretrainedConfig, names: list[str] | None, trust_remote_code: bool = False
) -> set[type[Module]]:
    """Classes for --auto_wrap_policy (default: the model's own _no_split_modules). ValueError names the choices."""
    classes = layer_classes(model_config, trust_remote_code)
    names = names or classes.pop("_no_split_modules")
    classes.pop("_no_split_modules", None)
    unknown = [n for n in names if n not in classes]
    if unknown or not names:
        layers = sorted(n for n in classes if n.endswith(("Layer", "Block")))
        raise ValueError(
            f"--auto_wrap_policy {', '.join(unknown) or '(empty)'} is not a layer class of "
            f"{model_config.model_type}; choose from: {', '.join(layers or sorted(classes))}"
        )
    return {classes[n] for n in names}


def build_model(fabric: Fabric, cfg: Config, model_config: PretrainedConfig) -> Module:
    """Create (from config) or load (pretrained) the model on this rank, ready for fabric.setup_module."""
    dtype = weights_dtype(cfg.precision)
    common = dict(attn_implementation=cfg.attn_implementation, trust_remote_code=cfg.trust_remote_code, dtype=dtype)
    with fabric.init_module(empty_init=False):
        if cfg.model_name:
            model = AutoModelForCausalLM.from_pretrained(cfg.model_name, config=model_config, **common)
        else:
            model = AutoModelForCausalLM.from_config(model_config, **common)
    model.config.use_cache = False
    if cfg.gradient_checkpointing and cfg.strategy != "fsdp":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
