"""The Hugging Face model: its config, the layer classes FSDP wraps, and building it on every rank.

With FSDP, the model is created on the meta device (no memory), and FSDP materialises one wrapped layer at a time
on the rank's device, keeping only the rank's shard (`DeferredInit`):
- from a config (--model_config), each layer is initialised by the model's own `_init_weights`, which also
  recomputes non-persistent buffers such as the rotary `inv_freq` (they are in no state dict);
- from a pretrained model (--model_name), the safetensors files are then read one at a time into the sharded
  model: a rank holds at most one weight file (at most --max_shard_size of the hub repo, 5 GB for Llama-3-8B) in
  host RAM, instead of the whole model (16 GB per process for an 8B model in bf16, 128 GB on an 8-GPU node).
Tied input and output embeddings (Llama-3.2, Gemma, GPT-2, T5, BART) stay one tensor on this route, stored under
the embedding's name. Weights that are not safetensors, checkpoint keys that differ from the model's (architectures
that transformers converts while loading), or models whose meta twin does not initialise like transformers' own
(`materializes_like_from_config`) take the plain route: every rank loads the
whole model with `from_pretrained` in host RAM before FSDP shards it. DDP and single-device runs need the whole
model on each device anyway: they read pretrained weights by the plain route, and materialise a model built from
a config from the meta device at once, in FSDP's order, so that a --seed gives the same initial weights everywhere.
"""

from __future__ import annotations

import copy
import logging
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn import Module, Parameter
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, PretrainedConfig, PreTrainedModel

from app.choices import SHARDED_STRATEGIES
from app.distributed.fsdp2 import shard_like, sharding_units
from app.distributed.precision import weights_dtype
from app.distributed.strategy import resolve_accelerator
from app.model.loss import LossPath, LossTerms, install_loss_head, own_loss_path
from app.model.noise import add_embedding_noise
from app.model.pieces import parameter_pieces, persistent_buffers, tied_aliases
from app.optimization.optimizer import ParameterRoles, canonical_name

if TYPE_CHECKING:
    from lightning_fabric import Fabric

    from arguments import Config


def model_source(cfg: Config) -> str:
    return cfg.model_name or cfg.model_config or cfg.init_from


def model_flag(cfg: Config) -> str:
    """The option that gives the model: --model_name, --model_config or --init_from."""
    return "--model_name" if cfg.model_name else "--model_config" if cfg.model_config else "--init_from"


def load_model_config(cfg: Config) -> PretrainedConfig:
    """The architecture from --model_name or --model_config (a config.json file or a folder holding one)."""
    return AutoConfig.from_pretrained(model_source(cfg), trust_remote_code=cfg.trust_remote_code)


def model_class(model_config: PretrainedConfig) -> type:
    """The one place the model kind is decided: an encoder-decoder (T5, BART) or a causal LM (Llama, Mistral)."""
    return AutoModelForSeq2SeqLM if model_config.is_encoder_decoder else AutoModelForCausalLM


def meta_model(model_config: PretrainedConfig, trust_remote_code: bool = False,
               attn_implementation: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> Module:
    """A weightless instance: its classes, parameter names and shapes, and its own init function. With an
    `attn_implementation`, built from a copy of the config (the model records the attention it is given there)."""
    if attn_implementation:
        model_config = copy.deepcopy(model_config)
    with torch.device("meta"):
        return model_class(model_config).from_config(model_config, trust_remote_code=trust_remote_code,
                                                     attn_implementation=attn_implementation,
                                                     **({"dtype": dtype} if dtype else {}))


def resolve_wrap_classes(
    model_config: PretrainedConfig, names: list[str] | None, trust_remote_code: bool = False
) -> set[type[Module]]:
    """Classes for --auto_wrap_policy (default: the model's own _no_split_modules). ValueError names the choices."""
    model = meta_model(model_config, trust_remote_code)
    classes = {type(m).__name__: type(m) for m in model.modules()}
    layers = sorted(n for n in classes if n.endswith(("Layer", "Block")))
    if not names and not model._no_split_modules:  # Pegasus's and Marian's classes (transformers 5.23) name none
        raise ValueError(f"a {model_config.model_type} model names no layer classes to shard by (its "
                         f"_no_split_modules is empty); give them with --auto_wrap_policy {' '.join(layers)}")
    names = names or model._no_split_modules
    unknown = [n for n in names if n not in classes]
    if unknown:  # any class of the model is a unit (attention and MLP apart): the layers are the usual choice
        others = sorted(name for name, kind in classes.items() if name not in layers and kind is not type(model)
                        and not kind.__module__.startswith(("torch.", "transformers.activations")))
        raise ValueError(
            f"--auto_wrap_policy {', '.join(unknown)} is not a module class of "
            f"{model_config.model_type}; its layer classes: {', '.join(layers) or 'none'}; its other classes: "
            f"{', '.join(others)}"
        )
    return {classes[n] for n in names}


def tied_names(config: PretrainedConfig, trust_remote_code: bool) -> dict[str, list[str]]:
    """Name -> the other names of the same tensor (the lm_head tied to the embedding): save_pretrained writes one."""
    return tied_names_of(meta_model(config, trust_remote_code))


def tied_names_of(model: Module) -> dict[str, list[str]]:
    """`tied_names` of a model at hand, with every name of its state dict (buffers have no others)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    tied = {name: [other for other in names if other != name] for names in groups.values() for name in names}
    return {name: tied.get(name, []) for name in model.state_dict()}


def weights_fit(stored: set[str], tied: dict[str, list[str]]) -> bool:
    """Whether weight files holding the names `stored` give every tensor of a model whose state dict's names and ties
    are `tied` (a tied one under any of its names, as save_pretrained keeps one), and nothing else."""
    return stored <= set(tied) and stored | {other for name in stored for other in tied[name]} == set(tied)


def stored_tensors(files: list[Path], names: Iterable[str]) -> list[torch.Tensor]:
    """The tensors of `names` that the safetensors `files` hold, read alone (not their whole files)."""
    found = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            found += [handle.get_tensor(name) for name in names if name in handle.keys()]
    return found


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


def holds_meta(module: Module, recurse: bool) -> bool:
    return any(t.is_meta for t in (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)))


def breadth_first(module: Module) -> Iterator[Module]:
    """The order FSDP hands a unit's modules to param_init_fn (app/distributed/fsdp2.py modules_to_materialize)."""
    queue = [module]
    while queue:
        part = queue.pop(0)
        yield part
        queue.extend(part.children())


def initialise_parents_again(module: Module, materialised: set[int], init_weights: Callable[[Module], None]) -> bool:
    """Children first, initialise again every module holding others that has a module just materialised below it
    (transformers' `apply` initialises a parent after its children); True when `module`'s subtree has one."""
    below = False
    for child in module.children():
        below |= initialise_parents_again(child, materialised, init_weights)
    if below:
        init_weights(module)
    return below or id(module) in materialised


def to_empty_keeping_ties(module: Module, device: torch.device, made: dict[int, tuple[Parameter, Parameter]]) -> None:
    """`module.to_empty(recurse=False)`, except that a parameter held by several modules (tied input and output
    embeddings) stays one tensor: to_empty gives each holder a tensor of its own, which unties them. `made` maps a
    meta parameter's id to it and its real tensor, for the holders materialised later."""
    for name, parameter in module.named_parameters(recurse=False):
        if parameter.is_meta:
            if id(parameter) not in made:
                real = Parameter(torch.empty_like(parameter, device=device), requires_grad=parameter.requires_grad)
                made[id(parameter)] = (parameter, real)
            setattr(module, name, made[id(parameter)][1])
    for name, buffer in module.named_buffers(recurse=False):
        if buffer.is_meta:
            setattr(module, name, torch.empty_like(buffer, device=device))


def materialize_module(module: Module, *, init_weights: Callable[[Module], None], accelerator: str) -> None:
    """FSDP's param_init_fn, which FSDP1 and fsdp2 call on a unit's modules parent before child: the first call
    gives every module of the subtree still on the meta device real memory on this rank's device and initialises it,
    in that order, then initialises the parents again (GPT-2's attention rescales its c_proj, which the Conv1D's own
    init, run after it, had undone: the residual projections started 2 x n_layer ** 0.5 too large). Parents that
    hold no tensors of their own draw nothing, so most models get the values they got before. Later calls find
    nothing left. Tied weights stay tied (they are in one unit: the root, `separate_embeddings`)."""
    device = torch.device("cuda", torch.cuda.current_device()) if accelerator == "cuda" else torch.device("cpu")
    pending = [part for part in breadth_first(module) if holds_meta(part, recurse=False)]
    made: dict[int, tuple[Parameter, Parameter]] = {}
    for part in pending:
        to_empty_keeping_ties(part, device, made)
        init_weights(part)
    if pending:
        initialise_parents_again(module, {id(part) for part in pending}, init_weights)


def materializes_like_from_config(model_config: PretrainedConfig, trust_remote_code: bool, pretrained: bool) -> bool:
    """Whether the meta route gives the model from_config gives, tried on the config's small twin materialised unit by
    unit as FSDP does: every constant tensor (norms, buffers, an activation's constants) equal, every random one of
    the same spread (where it has enough values to tell). A model that sets values in its constructor that its
    _init_weights does not set again fails (Apertus's xIELU activation kept whatever memory it got). With
    `pretrained` weights to read, only what they do not hold counts: the non-persistent buffers."""
    from app.model.isolation import small_twin  # which imports this module

    try:
        config = small_twin(model_config)
        reference = model_class(config).from_config(config, trust_remote_code=trust_remote_code)
        twin = meta_model(config, trust_remote_code)
        materialize_in_sharding_order(twin, resolve_wrap_classes(config, None, trust_remote_code),
                                      partial(materialize_module, init_weights=twin._init_weights, accelerator="cpu"))
    except Exception:  # noqa: BLE001 (a twin this architecture cannot be made at: the plain route, which is exact)
        return False
    if tied_names_of(twin) != tied_names_of(reference):  # a tie the model makes some other way than transformers' own
        return False
    built = dict(twin.named_parameters()) | dict(twin.named_buffers())
    loaded = set(reference.state_dict()) if pretrained else set()
    for name, expected in [*reference.named_parameters(), *reference.named_buffers()]:
        if name in loaded:
            continue
        if name not in built:
            return False
        got = built[name].detach()
        if got.is_meta or got.shape != expected.shape:
            return False
        if expected.numel() < 2 or not expected.is_floating_point() or expected.std() == 0:
            if not torch.equal(got, expected):
                return False
        elif expected.numel() >= 256 and not 0.8 < got.float().std() / expected.float().std() < 1.25:
            return False
    return True


def materialize_in_sharding_order(model: Module, wrap_classes: set[type[Module]],
                                  param_init_fn: Callable[[Module], None]) -> None:
    """A meta model materialised unit by unit as fsdp and fsdp2 do it: drawn in this order, the same --seed gives the
    same initial weights under every strategy."""
    for unit in sharding_units(model, wrap_classes):
        param_init_fn(unit)


@dataclass
class DeferredInit:
    """How FSDP materialises a model created on the meta device, and the weight files to read into it afterwards.
    Under ddp and on one device the model is materialised as soon as it is built, in the same order
    (`wrap_classes`, the default units, as FSDP's)."""

    param_init_fn: Callable[[Module], None]
    weight_files: list[Path]
    wrap_classes: set[type[Module]]


def deferred_init(cfg: Config, model_config: PretrainedConfig) -> Optional[DeferredInit]:
    """The meta-device route when it gives exactly the model transformers would build; None for the plain route.
    Under ddp and on one device only for a model built from a config, whose initial weights then match fsdp's;
    pretrained weights are read whole there anyway."""
    sharded = cfg.strategy in SHARDED_STRATEGIES
    if cfg.tpu or (cfg.model_name and not sharded):
        return None
    twin = meta_model(model_config, cfg.trust_remote_code)
    files = pretrained_weight_files(cfg.model_name) if cfg.model_name else []
    if cfg.model_name and (not files or not weights_fit(safetensors_keys(files), tied_names_of(twin))):
        return None
    if not materializes_like_from_config(model_config, cfg.trust_remote_code, pretrained=bool(cfg.model_name)):
        return None
    init = partial(materialize_module, init_weights=twin._init_weights, accelerator=resolve_accelerator(cfg))
    return DeferredInit(param_init_fn=init, weight_files=files,
                        wrap_classes=resolve_wrap_classes(model_config, None, cfg.trust_remote_code))


def build_model(fabric: Fabric, cfg: Config, model_config: PretrainedConfig, deferred: Optional[DeferredInit]) -> Module:
    """Create the model on this rank, ready for fabric.setup_module: on the meta device when `deferred` (materialised
    at once under ddp and on one device)."""
    dtype = weights_dtype(cfg.precision)
    common = dict(attn_implementation=cfg.attn_implementation, trust_remote_code=cfg.trust_remote_code, dtype=dtype)
    materialize_here = deferred is not None and cfg.strategy not in SHARDED_STRATEGIES
    on_meta = torch.device("meta") if materialize_here else nullcontext()  # FSDP's empty init is on meta already
    with fabric.init_module(empty_init=deferred is not None), on_meta:
        if cfg.model_name and deferred is None:
            model, loading = model_class(model_config).from_pretrained(cfg.model_name, config=model_config,
                                                                       output_loading_info=True, **common)
            check_all_weights_loaded(cfg.model_name, set(loading["missing_keys"]) | set(loading["mismatched_keys"]),
                                     set(loading["unexpected_keys"]))
        else:
            model = model_class(model_config).from_config(model_config, **common)
    if materialize_here:
        materialize_in_sharding_order(model, deferred.wrap_classes, deferred.param_init_fn)
    for module in model.modules():  # T5's encoder and decoder stacks read copies of the config of their own
        if isinstance(getattr(module, "config", None), PretrainedConfig):
            module.config.use_cache = False  # else T5's decoder kept a key/value cache in training
    freeze_parameters(model, cfg.freeze)
    model.train()  # from_pretrained returns it in eval mode: dropout would stay off until the first evaluation
    if checkpoints_through_transformers(cfg):
        enable_activation_checkpointing(model, cfg.gradient_checkpointing_every)
    return model


def frozen_names(names: list[str], patterns: Optional[list[str]]) -> list[str]:
    """The parameter names --freeze names: those a pattern is found in (a tied weight goes by its first name)."""
    return [name for name in names if any(re.search(pattern, name) for pattern in patterns or [])]


def freeze_parameters(model: Module, patterns: Optional[list[str]]) -> None:
    """--freeze: the parameters it names take no gradient, and so no optimizer state (optimizer.py groups only the
    parameters that require one); set before wrapping, where the names are the model's own."""
    frozen = set(frozen_names([name for name, _ in model.named_parameters()], patterns))
    for name, parameter in model.named_parameters():
        if name in frozen:
            parameter.requires_grad_(False)


def checkpoints_through_transformers(cfg: Config) -> bool:
    """Whether --gradient_checkpointing is transformers' own (ddp, fsdp2, one device), which some model classes lack;
    FSDP1 wraps each unit in torch's checkpoint wrapper instead (app/distributed/strategy.py), whatever its class."""
    return cfg.gradient_checkpointing and cfg.strategy != "fsdp"


def enable_activation_checkpointing(model: PreTrainedModel, every: int = 1) -> None:
    """The activations of one layer in every `every` (--gradient_checkpointing_every) recomputed in backward,
    non-reentrant (the variant that composes with DDP, FSDP2 and torch.compile). ValueError for a model class
    without it (CTRL, JetMoE): the preflight refuses those.

    transformers chooses the layers among its GradientCheckpointingLayer modules (`every_n_layers`); a model whose
    layers are not such modules is checkpointed whole, which the preflight refuses for `every` > 1
    (`recomputes_every_layer`). transformers 5.23 renamed gradient_checkpointing_enable (deprecated there, with a
    warning at every start); the 5.17 of the GPU image (benchmarks/gpu_check.py) has only the old name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=every)
    elif every == 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError("transformers before 5.23 checkpoints every layer: --gradient_checkpointing_every needs 5.23")


def recomputes_every_layer(model: Module) -> bool:
    """Whether transformers' activation checkpointing, enabled on `model`, recomputes each of its checkpointed
    modules whatever `every_n_layers` said: it chooses among GradientCheckpointingLayer modules only."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return not any(isinstance(module, GradientCheckpointingLayer) for module in model.modules())


def check_all_weights_loaded(source: str, missing: set[str], unexpected: set[str]) -> None:
    """A fine-tune that starts from partly random weights trains and logs like a real one: refuse it instead."""
    if missing or unexpected:
        raise RuntimeError(
            f"--model_name {source}: the pretrained weights do not fit the model: {len(missing)} missing "
            f"({', '.join(sorted(missing)[:3]) or 'none'}), {len(unexpected)} unexpected "
            f"({', '.join(sorted(unexpected)[:3]) or 'none'}); check that the folder holds this model's weights")


@torch.no_grad()
def load_pretrained_weights(sharded_model: Module, files: list[Path], dtype: torch.dtype,
                            expected: dict[str, list[str]]) -> None:
    """Read the pretrained weights into an FSDP model, one safetensors file at a time, and check that every one of
    the `expected` keys was loaded (a tied one under any of its names, the others of `expected[key]`) and nothing
    else was offered.

    Under FSDP1 each rank copies its piece of every tensor into its flat shards (`read_into_flat_shards`); under
    FSDP2 its rows of every tensor into its DTensor shards; where FSDP1 exposes no pieces, under its full-state-dict
    context, which gathers every wrapped layer, overwrites it from the file and re-shards it in turn. A rank holds one
    file (or one tensor) plus its shards, never the whole model. Every rank reads every file.
    `sharded_model` must be the FSDP module itself: through a compiled wrapper every key would miss (`_orig_mod.`).
    """
    if FSDP.fsdp_modules(sharded_model) and parameter_pieces(sharded_model):
        loaded, unexpected = read_into_flat_shards(sharded_model, files)
    else:
        loaded, unexpected = read_through_state_dicts(sharded_model, files, dtype)
    loaded |= {other for name in loaded if name in expected for other in expected[name]}
    check_all_weights_loaded(str(files[0].parent), set(expected) - loaded, unexpected)


def read_through_state_dicts(sharded_model: Module, files: list[Path], dtype: torch.dtype) -> tuple[set[str], set[str]]:
    """`load_state_dict` of each file whole (FSDP2's rows of it, FSDP1's full state dict); the names loaded and
    those the model refused."""
    loaded: set[str] = set()
    unexpected: set[str] = set()
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    fsdp1 = bool(FSDP.fsdp_modules(sharded_model))
    shards = {} if fsdp1 else sharded_model.state_dict()
    full_state_dict = FSDP.state_dict_type(sharded_model, StateDictType.FULL_STATE_DICT, config) if fsdp1 else nullcontext()
    with full_state_dict:
        for file in files:
            weights = {name: shard_like(tensor.to(dtype), shards.get(name)) for name, tensor in load_file(str(file)).items()}
            result = sharded_model.load_state_dict(weights, strict=False)
            rejected = {canonical_name(key) for key in result.unexpected_keys}
            unexpected |= rejected
            loaded |= set(weights) - rejected
    return loaded, unexpected


@torch.no_grad()
def read_into_flat_shards(model: Module, files: list[Path]) -> tuple[set[str], set[str]]:
    """FSDP1: each tensor of the weight files read alone, and this rank's piece of it copied into its flat shard
    (cast to the shard's dtype): no unit is gathered. The full-state-dict route gathered every unit once per file:
    a 477M model in 11 files loaded in 128 s on 2 CPU processes against 41 s by from_pretrained on each. Returns the
    names loaded and those the model has no place for (or of another shape)."""
    pieces = {name: (parameter, shape, start) for parameter, (name, shape, start) in parameter_pieces(model).items()}
    aliases, buffers = tied_aliases(model), persistent_buffers(model)
    loaded, unexpected = set(), set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                name = aliases.get(key, key)
                if name in buffers and tuple(handle.get_slice(key).get_shape()) == tuple(buffers[name].shape):
                    buffers[name].copy_(handle.get_tensor(key))
                elif name in pieces and tuple(handle.get_slice(key).get_shape()) == pieces[name][1]:
                    parameter, _, start = pieces[name]
                    if parameter.numel():  # a piece of it is this rank's (on one rank: all of it, in its shape)
                        piece = handle.get_tensor(key).view(-1)[start:start + parameter.numel()]
                        parameter.data.view(-1).copy_(piece)
                else:
                    unexpected.add(key)
                    continue
                loaded.add(key)
    return loaded, unexpected


def strategy_module(model: Module) -> Module:
    """The model as the strategy wrapped it (FSDP, DDP or the plain model), inside Fabric's and torch.compile's
    wrappers: the object whose state dict has the model's own names."""
    module = getattr(model, "_forward_module", model)
    return getattr(module, "_orig_mod", module)


@contextmanager
def evaluation_mode(model: Module) -> Iterator[None]:
    """Dropout off inside the block, then the mode the model was in (training, as build_model leaves it)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def hugging_face_model(module: Module) -> PreTrainedModel:
    return next(m for m in module.modules() if isinstance(m, PreTrainedModel))


@torch.no_grad()
def keep_rotary_in_fp32(module: Module) -> None:
    """Recompute rotary frequencies in fp32 after set-up cast them to the training dtype (see
    app/distributed/precision.py).

    The modules are the ones transformers' own initialisation recognises as rotary embeddings; it computes their
    buffers (`inv_freq`, `original_inv_freq`, and per layer type, `full_attention_inv_freq` in Gemma-3 and OLMo-3)
    in fp32 into whatever tensor they hold, so they are given fp32 tensors first. A buffer that the init does not
    compute again (its value, rounded to the training dtype, is not what it was) keeps the value it had.
    """
    model = hugging_face_model(module)
    for rotary in model.modules():
        if "RotaryEmbedding" not in type(rotary).__name__:
            continue
        cast = {name: buffer for name, buffer in rotary.named_buffers(recurse=False)
                if name.endswith("inv_freq") and buffer.is_floating_point() and buffer.dtype != torch.float32}
        for name, buffer in cast.items():
            rotary.register_buffer(name, torch.empty(buffer.shape, dtype=torch.float32, device=buffer.device),
                                   persistent=False)
        if cast:
            model._init_weights(rotary)
        for name, before in cast.items():
            if not torch.equal(getattr(rotary, name).to(before.dtype), before):
                rotary.register_buffer(name, before.float(), persistent=False)


PROFILER_NOTES = ("Profiler record function", "Profiler function")
"""Dynamo's warning, once per rank, that it leaves out the `record_function` regions FSDP and DDP mark in their hooks:
they name regions for a profiler and change nothing the model computes."""


def compiled(model: Module) -> Module:
    """torch.compile(model), without Dynamo's PROFILER_NOTES lines."""
    for name in ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch"):
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith(PROFILER_NOTES))
    return torch.compile(model)


def setup_model(fabric: Fabric, cfg: Config, model_config: PretrainedConfig, deferred: Optional[DeferredInit],
                chunked_loss: bool = False) -> tuple[Module, ParameterRoles, LossPath]:
    """Build, wrap (and compile) the model, load pretrained weights into its shards, restore fp32 rotary buffers.
    Returns the Fabric module, how the optimizer treats each parameter (read before wrapping) and how to ask it
    for a loss (chunked, without full logits, when the preflight's probe found that it may)."""
    model = build_model(fabric, cfg, model_config, deferred)
    loss_path = install_loss_head(model, cfg.loss_kernel) if chunked_loss else own_loss_path(model)
    loss_path.terms = LossTerms(cfg.label_smoothing, cfg.z_loss)
    loss_path.noise = add_embedding_noise(model, cfg.neftune_noise_alpha)
    roles = ParameterRoles.of(model)
    expected = tied_names_of(model)
    model = fabric.setup_module(compiled(model) if cfg.compile else model)
    if deferred and deferred.weight_files:
        load_pretrained_weights(strategy_module(model), deferred.weight_files, weights_dtype(cfg.precision), expected)
    keep_rotary_in_fp32(strategy_module(model))
    return model, roles, loss_path
