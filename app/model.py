"""The Hugging Face model: its config, the layer classes FSDP wraps, and building it on every rank.

With FSDP, the model is created on the meta device (no memory), and FSDP materialises one wrapped layer at a time
on the rank's device, keeping only the rank's shard (`DeferredInit`):
- from a config (--model_config), each layer is initialised by the model's own `_init_weights`, which also
  recomputes non-persistent buffers such as the rotary `inv_freq` (they are in no state dict);
- from a pretrained model (--model_name), the safetensors files are then read one at a time into the sharded
  model: a rank holds at most one weight file (at most --max_shard_size of the hub repo, 5 GB for Llama-3-8B) in
  host RAM, instead of the whole model (16 GB per process for an 8B model in bf16, 128 GB on an 8-GPU node).
Models with tied input/output embeddings, weights that are not safetensors, or checkpoint keys that differ from
the model's (architectures that transformers converts while loading) take the plain route: every rank loads the
whole model with `from_pretrained` in host RAM before FSDP shards it. DDP and single-device runs need the whole
model on each device anyway and take the plain route too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn import Module
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from app.strategy import resolve_accelerator

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


def meta_model(model_config: PretrainedConfig, trust_remote_code: bool = False) -> Module:
    """A weightless instance: its classes, parameter names and shapes, and its own init function."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)


def resolve_wrap_classes(
    model_config: PretrainedConfig, names: list[str] | None, trust_remote_code: bool = False
) -> set[type[Module]]:
    """Classes for --auto_wrap_policy (default: the model's own _no_split_modules). ValueError names the choices."""
    model = meta_model(model_config, trust_remote_code)
    classes = {type(m).__name__: type(m) for m in model.modules()}
    names = names or model._no_split_modules or []
    unknown = [n for n in names if n not in classes]
    if unknown or not names:
        layers = sorted(n for n in classes if n.endswith(("Layer", "Block")))
        raise ValueError(
            f"--auto_wrap_policy {', '.join(unknown) or '(empty)'} is not a layer class of "
            f"{model_config.model_type}; choose from: {', '.join(layers or sorted(classes))}"
        )
    return {classes[n] for n in names}


def pretrained_weight_files(model_name: str) -> list[Path]:
    """The safetensors files of a local folder or hub repo (downloaded to the HF cache once, honouring offline mode)."""
    folder = Path(model_name)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model_name, allow_patterns=["*.safetensors", "*.json"]))
    return sorted(folder.glob("*.safetensors"))


def safetensors_keys(files: list[Path]) -> set[str]:
    keys: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            keys |= set(handle.keys())
    return keys


def materialize_module(module: Module, *, init_weights: Callable[[Module], None], accelerator: str) -> None:
    """FSDP's param_init_fn: real memory for one module's own tensors on this rank's device, then the model's init."""
    device = torch.device("cuda", torch.cuda.current_device()) if accelerator == "cuda" else torch.device("cpu")
    module.to_empty(device=device, recurse=False)
    init_weights(module)


@dataclass
class DeferredInit:
    """How FSDP materialises a model created on the meta device, and the weight files to read into it afterwards."""

    param_init_fn: Callable[[Module], None]
    weight_files: list[Path]


def deferred_init(cfg: Config, model_config: PretrainedConfig) -> Optional[DeferredInit]:
    """The meta-device route when it gives exactly the model transformers would build; None for the plain route."""
    if cfg.strategy != "fsdp" or cfg.tpu or model_config.tie_word_embeddings:
        return None
    twin = meta_model(model_config, cfg.trust_remote_code)
    files = pretrained_weight_files(cfg.model_name) if cfg.model_name else []
    if cfg.model_name and (not files or safetensors_keys(files) != set(twin.state_dict())):
        return None
    init = partial(materialize_module, init_weights=twin._init_weights, accelerator=resolve_accelerator(cfg))
    return DeferredInit(param_init_fn=init, weight_files=files)


def build_model(fabric: Fabric, cfg: Config, model_config: PretrainedConfig, deferred: Optional[DeferredInit]) -> Module:
    """Create the model on this rank, ready for fabric.setup_module: on the meta device when `deferred`."""
    dtype = weights_dtype(cfg.precision)
    common = dict(attn_implementation=cfg.attn_implementation, trust_remote_code=cfg.trust_remote_code, dtype=dtype)
    with fabric.init_module(empty_init=deferred is not None):
        if cfg.model_name and deferred is None:
            model = AutoModelForCausalLM.from_pretrained(cfg.model_name, config=model_config, **common)
        else:
            model = AutoModelForCausalLM.from_config(model_config, **common)
    model.config.use_cache = False
    if cfg.gradient_checkpointing and cfg.strategy != "fsdp":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@torch.no_grad()
def load_pretrained_weights(sharded_model: Module, files: list[Path], dtype: torch.dtype) -> None:
    """Read the pretrained weights into an FSDP model, one safetensors file at a time.

    Under FSDP's full-state-dict context each wrapped layer is gathered, overwritten from the file and re-sharded
    in turn, so a rank holds one file plus one layer, never the whole model. Every rank reads every file; that the
    files hold exactly the model's keys was checked by `deferred_init`.
    """
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(sharded_model, StateDictType.FULL_STATE_DICT, config):
        for file in files:
            weights = {name: tensor.to(dtype) for name, tensor in load_file(str(file)).items()}
            sharded_model.load_state_dict(weights, strict=False)
