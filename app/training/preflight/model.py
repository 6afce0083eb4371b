"""Whether the model trains on this data as asked: its config loads, the attention and activation checkpointing the
options name exist for its class, the data fits its positions and vocabulary, packed examples stay apart (probed),
the chunked loss equals its own, an encoder-decoder has a decoder start that can generate."""

from __future__ import annotations

import copy
import importlib.util
import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
from huggingface_hub import snapshot_download
from transformers import PretrainedConfig
from transformers.utils import is_flash_attn_2_available

from app.cli import first_line
from app.data.formats import Layout
from app.distributed.precision import compute_dtype
from app.distributed.strategy import resolve_accelerator
from app.evaluation.samples import pads_apart
from app.hub import (CONFIG_ERRORS, REMOTE_CODE, load_problem, missing_model_problem, missing_weights_problem,
                     quiet_hub)
from app.huggingface.convert import config_from_dict
from app.model.build import (checkpoints_through_transformers, enable_activation_checkpointing, frozen_names,
                             load_model_config, meta_model, model_class, model_flag, model_source,
                             recomputes_every_layer, resolve_wrap_classes, stored_tensors, tied_names)
from app.model.isolation import (LOCAL_ATTENTION_NAMES, TwinUnavailable, column_scaled_from, decoder_inputs_error,
                                 decoder_tells_positions_apart, longrope_limit, probe_isolation, reads_ahead)
from app.metrics.observe import has_experts
from app.model.loss import ROUTER_COEFFICIENT_NAMES, adds_router_loss, probe_chunked_loss, router_coefficient
from app.training.preflight.data import DataFacts
from app.training.preflight.environment import output_of_train_py
from app.training.preflight.notes import note
from app.training.preflight.resume import ChosenCheckpoint
from app.training.preflight.tokenizer import TOKEN_ID_PAST_VOCAB, room_for_tokens

if TYPE_CHECKING:
    from arguments import Config


def check_model(cfg: Config, problems: list[str],
                init: Optional[ChosenCheckpoint] = None) -> Optional[PretrainedConfig]:
    """The model's config (for --init_from, the one its checkpoint, `init`, recorded), with --model_overrides."""
    if not cfg.init_from:
        config = loaded_config(cfg, problems)
    elif init is not None:
        config = recorded_config(init, problems)
    else:  # --init_from's checkpoint was refused
        return None
    config = overridden_config(cfg, config, problems) if config is not None and cfg.model_overrides else config
    return config if config is None or sizes_positive(cfg, config, problems) else None


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "d_model", "d_ff", "d_kv", "num_layers",
         "num_decoder_layers", "num_heads", "n_embd", "n_inner", "n_layer", "n_head", "n_positions", "encoder_layers",
         "decoder_layers", "encoder_ffn_dim", "decoder_ffn_dim", "encoder_attention_heads", "decoder_attention_heads")
"""A config's sizes and counts, by the names of the architectures the project trains."""


def sizes_positive(cfg: Config, config: PretrainedConfig, problems: list[str]) -> bool:
    """Every size of the config above 0: hidden_size 0 built a model that ended every rank in FSDP's assertion after
    the launch, and max_position_embeddings 0 passed for no limit and trained."""
    bad = [name for name in SIZES if type(getattr(config, name, None)) is int and getattr(config, name) <= 0]
    if bad:
        given = ("--model_overrides" if set(bad) & set(cfg.model_overrides or {})
                 else f"{model_flag(cfg)} {model_source(cfg)}")
        problems.append(f"{given}: {', '.join(f'{name} {getattr(config, name)}' for name in bad)}: a model's sizes "
                        "and counts are positive")
    return not bad


def overridden_config(cfg: Config, config: PretrainedConfig, problems: list[str]) -> Optional[PretrainedConfig]:
    """The config with --model_overrides, built again by its class so that it checks them as a config file's
    (a longer context's rope_parameters without their factor is refused there). A mapping's fields are merged into
    the config's own (the yarn scaling of a `rope_parameters` override keeps the model's rope_theta, which replacing
    it reset to the class's default, 10,000 for Llama-3's 500,000), and every field that changes is said. Pretrained
    weights must still fit: an override that reshapes one is refused here, not when every rank loads them."""
    fields = config.to_dict()
    unknown = [name for name in cfg.model_overrides if name not in fields]
    if unknown:
        problems.append(f"--model_overrides: {', '.join(unknown)}: not a field of the {config.model_type} config; "
                        f"its fields: {', '.join(sorted(fields))}")
        return None
    if cfg.model_overrides.get("model_type", config.model_type) != config.model_type:
        # the run kept the config's class, and the converted folder's config.json named another
        problems.append(f"--model_overrides: model_type names the model's class, which a {config.model_type} config "
                        "keeps; give --model_config a config of the other type")
        return None
    merged = {name: fields[name] | value if isinstance(value, dict) and isinstance(fields[name], dict) else value
              for name, value in cfg.model_overrides.items()}
    try:  # the model too: a value its config takes and its code does not (`"hidden_act": "nonexistent"`)
        with config_warnings() as already:  # of the config as it was: not the overrides'
            type(config).from_dict(fields)
        with config_warnings() as warned:
            changed = type(config).from_dict(fields | merged)
        warned = {key: [line for line in lines if line not in already[key]] for key, lines in warned.items()}
        refused = [line for line in warned["rope"] if "must be" in line or "Unrecognized keys" in line]
        if refused:
            problems.append(f"--model_overrides: {refused[0]} (transformers' check of RoPE, which builds the model "
                            "anyway)")
            return None
        if not sizes_positive(cfg, changed, problems):  # before a model of them is built, with torch's warnings
            return None
        for line in warned["rope"] + warned["config"]:
            note(f"--model_overrides: {line}")
        before, after = ({name: parameter.shape for name, parameter in meta_model(
            c, cfg.trust_remote_code).named_parameters()} for c in (config, changed))
    except CONFIG_ERRORS as error:
        problems.append(f"--model_overrides: the {config.model_type} config refuses them ({first_line(error)})")
        return None
    if cfg.model_config is None:  # pretrained weights, or a checkpoint's: a weight reshaped, or tied to another
        reshaped = [f"{name} {tuple(before[name])} -> {tuple(after[name])}" for name in before
                    if name in after and before[name] != after[name]] + sorted(set(before) ^ set(after))
        if reshaped:
            more = " and more" if reshaped[1:] else ""
            problems.append(f"--model_overrides changes the weights of {model_flag(cfg)} {model_source(cfg)} "
                            f"({reshaped[0]}{more}: a shape, or a weight tied or untied), which load only as they "
                            "are; give only fields that keep them (positions, RoPE, dropout)")
            return None
    broken = meta_forward_error(changed, cfg.trust_remote_code)
    if broken and not meta_forward_error(config, cfg.trust_remote_code):  # (a model the probe cannot run: not this)
        problems.append(f"--model_overrides: the {config.model_type} model does not run with them ({broken})")
        return None
    after = changed.to_dict()
    moved = [f"{name} {fields.get(name)} -> {after[name]}" for name in sorted(after)
             if after[name] != fields.get(name) and name != "transformers_version"]
    if moved:
        note(f"--model_overrides: {', '.join(moved)}")
    return changed


CONFIG_LOGGERS = {"rope": "transformers.modeling_rope_utils", "config": "transformers.configuration_utils"}
"""Where transformers warns of a config's values while it builds the config anyway."""


@contextmanager
def config_warnings() -> Iterator[dict[str, list[str]]]:
    """What transformers warns of as it builds a config, by CONFIG_LOGGERS' keys, kept from the console for the
    preflight to refuse or note: a RoPE factor of 0 trained to NaN at step 1, its one warning lost among the start's
    lines, and a misspelt RoPE key was left out."""
    warned: dict[str, list[str]] = {key: [] for key in CONFIG_LOGGERS}
    kept = []
    for key, name in CONFIG_LOGGERS.items():
        handler = logging.Handler()
        handler.emit = lambda record, said=warned[key]: said.append(record.getMessage())  # type: ignore
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        kept.append((logger, handler, logger.propagate))
        logger.propagate = False
    try:
        yield warned
    finally:
        for logger, handler, propagate in kept:
            logger.removeHandler(handler)
            logger.propagate = propagate


def meta_forward_error(config: PretrainedConfig, trust_remote_code: bool) -> Optional[str]:
    """Why a forward of the weightless model fails (values that build a model that cannot run: 3 key/value heads
    for 4 query heads ended every rank at its first step), or None."""
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            meta_model(config, trust_remote_code)(input_ids=ids, **({"decoder_input_ids": ids}
                                                                   if config.is_encoder_decoder else {}))
    except Exception as error:  # noqa: BLE001 (whatever the model's code raises)
        return first_line(error)
    return None


def loaded_config(cfg: Config, problems: list[str]) -> Optional[PretrainedConfig]:
    """--model_name's or --model_config's config; a Hub id that is neither cached nor reachable is refused at once,
    with the prefetch.py command, instead of after a minute of huggingface_hub's retries."""
    flag = model_flag(cfg)
    output = output_of_train_py(Path(model_source(cfg)))
    if output:  # its config.json (none) was the first line, and the advice another option than the one it needs
        continued = f", or continue it with --resume true --out_dir {model_source(cfg)}" if output == "a run folder" \
            else ""
        problems.append(f"{flag} {model_source(cfg)} is {output} of train.py; start a new run from its weights with "
                        f"--init_from {model_source(cfg)}{continued}")
        return None
    if cfg.model_name and Path(cfg.model_name).is_file():  # its config loaded, and every rank failed to find weights
        problems.append(f"--model_name {cfg.model_name} is a file; give the folder of the model's config.json and "
                        f"weights ({Path(cfg.model_name).parent}), or --model_config {cfg.model_name} to train that "
                        "config from scratch")
        return None
    trains = cfg.model_name and not (cfg.estimate_memory or cfg.print_config)  # a plan reads the config alone
    missing = missing_model_problem(flag, model_source(cfg)) or (
        trains and missing_weights_problem(flag, cfg.model_name))
    if missing:
        problems.append(missing)
        return None
    try:
        with quiet_hub():
            return load_model_config(cfg)
    except CONFIG_ERRORS as error:
        reason = load_problem(error)
        advice = ("" if reason == REMOTE_CODE else "; fix its config.json" if Path(model_source(cfg)).is_dir()
                  else "; check the name, or log in for gated models")
        problems.append(f"{flag} {model_source(cfg)}: cannot load its config ({reason}){advice}")
        return None


def check_frozen(cfg: Config, model_config: PretrainedConfig, problems: list[str]) -> None:
    """--freeze's patterns: each a regular expression that names some parameter, and some parameter left to train
    (a mistyped pattern froze nothing, and the run trained what was to stay)."""
    if not cfg.freeze:
        return
    for pattern in cfg.freeze:
        try:
            re.compile(pattern)
        except re.error as error:
            problems.append(f"--freeze {pattern!r}: not a regular expression ({error})")
            return
    names = [name for name, _ in meta_model(model_config, cfg.trust_remote_code).named_parameters()]
    for pattern in cfg.freeze:
        if not frozen_names(names, [pattern]):
            problems.append(f"--freeze {pattern!r} names no parameter of the {model_config.model_type} model (its "
                            f"names: {', '.join(names[:4])}, ...; a weight tied to another goes by the other's name)")
    if len(frozen_names(names, cfg.freeze)) == len(names):
        problems.append("--freeze names every parameter of the model: nothing would train")


def recorded_config(init: ChosenCheckpoint, problems: list[str]) -> Optional[PretrainedConfig]:
    """The architecture a checkpoint recorded, for the run that starts from its weights."""
    try:
        return config_from_dict(init.metadata["model_config"])
    except CONFIG_ERRORS as error:
        problems.append(f"--init_from {init.path}: its recorded model config does not load ({load_problem(error)})")
        return None


def check_model_with(cfg: Config, model_config: PretrainedConfig, data: Optional[DataFacts],
                     problems: list[str]) -> tuple[Layout, bool]:
    """The model against the options and the data (None when the run reads none, planning by --block_size): how
    packed examples reach it so that they stay apart, and whether the loss is computed in chunks. The checks that
    build the model need its attention implementation to exist here (else that is the one problem reported)."""
    attention_works = check_attention_supported(cfg, model_config, problems)
    check_ties_hold(cfg, model_config, problems)
    check_frozen(cfg, model_config, problems)
    if attention_works:
        check_activation_checkpointing(cfg, model_config, problems)
    if data is not None:
        check_model_fits_data(cfg, model_config, data, problems)
    if cfg.neftune_noise_alpha and model_config.is_encoder_decoder:
        problems.append(f"--neftune_noise_alpha: a {model_config.model_type} model embeds its sources and its "
                        "targets with one table, and NEFTune's noise is for a causal model's inputs; drop it")
    if not attention_works:
        return "position_ids", False
    if not model_config.is_encoder_decoder:
        check_causal(cfg, model_config, problems)
    packed_layout: Layout = "position_ids"
    if data is not None:
        packed_layout = check_packed_isolation(cfg, model_config, data, problems)
        check_length_dependent_rope(cfg, model_config, data, problems)
        check_decoder_start(cfg, model_config, data, problems)
    # refused already: a note on the loss (its probe failing for the same reason) would read as going ahead
    chunked_loss = check_chunked_loss(cfg, model_config, note if not problems else lambda _: None)
    check_loss_kernel(cfg, model_config, chunked_loss, problems)
    check_loss_terms(cfg, model_config, problems)
    return packed_layout, chunked_loss


def check_ties_hold(cfg: Config, model_config: PretrainedConfig, problems: list[str]) -> None:
    """A config that ties the output layer to the embedding (tie_word_embeddings) over weights that hold the two as
    different tensors (a config edited, or exported wrong): transformers then loads them untied, with a warning per
    rank, and the run trained a model its recorded config says is tied, which convert_to_hf.py could not verify.
    Only a local folder's or the cache's files are read (two tensors), and only when both names are stored."""
    if not cfg.model_name or not getattr(model_config, "tie_word_embeddings", False):
        return
    try:
        folder = Path(cfg.model_name) if Path(cfg.model_name).is_dir() else Path(
            snapshot_download(cfg.model_name, allow_patterns=["*.safetensors"], local_files_only=True))
    except Exception:  # noqa: BLE001 (not cached yet: the weights load later, as they are)
        return
    groups = {tuple(sorted([name, *others])) for name, others in tied_names(model_config,
                                                                            cfg.trust_remote_code).items() if others}
    for names in groups:
        tensors = stored_tensors(sorted(folder.glob("*.safetensors")), names)
        if len(tensors) > 1 and any(not torch.equal(tensors[0], other) for other in tensors[1:]):
            problems.append(f"--model_name {cfg.model_name}: its config ties {' and '.join(names)} "
                            "(tie_word_embeddings true), but its weights hold them as different tensors; set "
                            "\"tie_word_embeddings\": false in its config.json if they were trained apart")


def check_attention_supported(cfg: Config, model_config: PretrainedConfig, problems: list[str]) -> bool:
    """Whether the model class takes --attn_implementation at all (Gemma-2 has no SDPA path in transformers): built
    weightless from the run's own config, as the ranks would build it, where every rank would otherwise end in a
    ValueError traceback. FlashAttention is asked of the class only (T5 has none): building with it needs its
    kernels, and whether they are here is check_runs_here's."""
    flash = cfg.attn_implementation == "flash_attention_2"
    try:
        asked = None if flash else cfg.attn_implementation
        with torch.device("meta"):  # a copy of the config: the model records the attention it was asked for
            model = model_class(model_config).from_config(copy.deepcopy(model_config), attn_implementation=asked,
                                                          trust_remote_code=cfg.trust_remote_code)
    except Exception as error:  # noqa: BLE001 (only an attention the class lacks is this check's to refuse)
        if flash or not (isinstance(error, ValueError) and "attention implementation" in str(error)):
            return True
        others = [other for other in ("sdpa", "eager") if other != cfg.attn_implementation]
        problems.append(f"--attn_implementation {cfg.attn_implementation}: a {model_config.model_type} model does "
                        f"not support it ({first_line(error).split('. ')[0]}); use --attn_implementation {others[0]}")
        return False
    if flash and not model._supports_flash_attn:  # what transformers checks first when asked for it
        problems.append(f"--attn_implementation flash_attention_2: a {model_config.model_type} model does not support "
                        f"it ({type(model).__name__} has no FlashAttention path in transformers); use "
                        f"--attn_implementation {model.config._attn_implementation}")
        return False
    return True


def check_activation_checkpointing(cfg: Config, model_config: PretrainedConfig, problems: list[str]) -> None:
    """--gradient_checkpointing where it is transformers' own (app/model/build.py), tried on the model built weightless
    from the run's config: a class without it (CTRL, JetMoE) ended every rank in a ValueError traceback after the
    launch. FSDP1's checkpoint wrapper takes any layer class, so --strategy fsdp is named where it can wrap this one."""
    if not checkpoints_through_transformers(cfg):
        return
    try:
        model = meta_model(model_config, cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 (a model that cannot be built is another check's to refuse)
        return
    every = cfg.gradient_checkpointing_every
    try:
        enable_activation_checkpointing(model, every)
    except ValueError as error:
        try:
            resolve_wrap_classes(model_config, cfg.auto_wrap_policy, cfg.trust_remote_code)
            instead = "--strategy fsdp (its checkpoint wrapper takes every layer class), or "
        except ValueError:
            instead = ""
        reason = first_line(error).rstrip(".")
        problems.append(f"--gradient_checkpointing true: a {model_config.model_type} model has no activation "
                        f"checkpointing of its own, which --strategy {cfg.strategy} uses ({reason}); use {instead}"
                        "--gradient_checkpointing false")
        return
    if every > 1 and recomputes_every_layer(model):
        problems.append(f"--gradient_checkpointing_every {every}: a {model_config.model_type} model's own activation "
                        f"checkpointing, which --strategy {cfg.strategy} uses, recomputes all of its layers; use "
                        "--strategy fsdp (its checkpoint wrapper chooses among the wrapped layers), or drop it")


def check_model_fits_data(cfg: Config, model_config: PretrainedConfig, data: DataFacts, problems: list[str]) -> None:
    if data.format.encoder_decoder != bool(model_config.is_encoder_decoder):
        kind = "an encoder-decoder model" if model_config.is_encoder_decoder else "a causal LM"
        wanted = ("--source_field/--target_field" if model_config.is_encoder_decoder
                  else "--prompt_field/--response_field or --messages_field (raw text: --text_field)")
        problems.append(f"--train_data_dir holds {data.format.name} data but {model_source(cfg)} is {kind}; "
                        f"prepare the data with {wanted}, or train a matching model")
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if max_positions:
        problems += positions_problems(data, max_positions, rotary=bool(getattr(model_config, "rope_parameters", None)))
    if data.max_token_id >= model_config.vocab_size:
        problems.append(f"{TOKEN_ID_PAST_VOCAB} {data.max_token_id} but the model's vocab_size is "
                        f"{model_config.vocab_size}; {room_for_tokens(cfg, data.max_token_id + 1)}")


def positions_problems(data: DataFacts, max_positions: int, rotary: bool = False) -> list[str]:
    """Rows longer than a model's learned positions end the run at the first batch (IndexError on every rank); a
    rotary model's (`rotary`) would train positions its config says it never meets, which its RoPE scaling may cover
    (Qwen3's YaRN leaves max_position_embeddings at 40,960 for 131,072): that is the config's to say. An
    encoder-decoder's (BART's) encoder reads the sources and its decoder the targets, each from position 0: both
    must fit, and prepare_data.py cuts them with --max_source_length and --max_target_length, not --block_size."""
    if not data.format.encoder_decoder:
        what = "examples of up to" if data.format.padded else "blocks of"
        raise_it = ", or raise max_position_embeddings (--model_overrides) where the model's RoPE scaling covers them"
        lengths = [(what, data.block_size, "a smaller --block_size" + (raise_it if rotary else ""))]
    else:
        lengths = [("sources of up to", data.block_size, f"--max_source_length {max_positions} or less"),
                   ("targets of up to", data.target_block_size, f"--max_target_length {max_positions} or less")]
    where = " (in the folder of the mixture prepared with them)" if data.sources else ""
    return [f"--train_data_dir {what} {length} tokens{where} exceed the model's max_position_embeddings "
            f"({max_positions}); prepare the data with {advice}" for what, length, advice in lengths
            if length > max_positions]


def windowed(model_config: PretrainedConfig) -> bool:
    """Whether some layers attend within a window (Mistral, GPT-OSS, Gemma-2/3): a block mask given in its place would
    drop the window."""
    return any(isinstance(getattr(model_config, name, None), int) for name in LOCAL_ATTENTION_NAMES)


def check_causal(cfg: Config, model_config: PretrainedConfig, problems: list[str]) -> None:
    """A causal LM must not read the token it predicts: an encoder's LM head (BERT's) built as one does (reads_ahead).
    A twin that cannot be built or run here says nothing either way (the other checks name what fails)."""
    if cfg.attn_implementation == "flash_attention_2" and not is_flash_attn_2_available():
        return
    try:
        ahead = reads_ahead(model_config, cfg.attn_implementation, cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 (TwinUnavailable, an implementation that does not run here)
        return
    if ahead:
        problems.append(f"--model_config: a {model_config.model_type} model built as a causal LM reads the tokens "
                        "after each position, so it would learn to copy the next token; train a decoder model (an "
                        "encoder's, BERT's, reads is_decoder: true in its config)")


def percent(fraction: float) -> str:
    """73%, or 0.06% for a leak through a convolution (it read 0%)."""
    return f"{fraction:.0%}" if fraction >= 0.01 else f"{fraction * 100:.1g}%"


def check_packed_isolation(cfg: Config, model_config: PretrainedConfig, data: DataFacts,
                           problems: list[str]) -> Layout:
    """Packed examples must never attend to each other: the layout that keeps them apart in the run's own model
    class and attention implementation, found by a probe (app/model/isolation.py); refused when there is none."""
    if not data.format.packs_examples or model_config.is_encoder_decoder:  # the latter refused above
        return "position_ids"
    attention, kind = cfg.attn_implementation, model_config.model_type
    scaled_from = column_scaled_from(model_config)
    if scaled_from is not None and data.block_size > scaled_from - 1:
        problems.append(f"--train_data_dir {cfg.train_data_dir} packs examples into rows of {data.block_size} tokens, "
                        f"but a {kind} model's layers without RoPE scale attention by a token's column in the row "
                        f"once a row reaches {scaled_from} tokens (attn_temperature_tuning, floor_scale), not by its "
                        "position: an example packed there would train at another scale than it has alone; prepare "
                        f"the data with --block_size {scaled_from - 1} or less, or with --packing false")
        return "position_ids"
    if attention == "flash_attention_2" and not is_flash_attn_2_available():
        return "one_row"  # a run is refused for it (check_runs_here); a plan made where it is missing needs no probe
    try:
        found = probe_isolation(model_config, attention, cfg.trust_remote_code)
    except TwinUnavailable as error:
        problems.append(f"--train_data_dir {cfg.train_data_dir} holds packed examples, but whether a {kind} model "
                        f"keeps them apart cannot be probed ({error}); prepare the data with --packing false")
        return "position_ids"
    except Exception as error:  # the implementation does not run here (FlashAttention without a GPU) or at all
        other = "eager" if attention == "sdpa" else "sdpa"
        problems.append(f"--attn_implementation {attention}: a {kind} model cannot run with it here, so packed "
                        f"examples cannot be checked to stay apart ({first_line(error)}); use --attn_implementation "
                        f"{other}, or a machine where it runs")
        return "position_ids"
    if found.layout is None:
        others = [other for other in ("sdpa", "eager") if other != attention and isolates(model_config, other, cfg)]
        instead = f"use --attn_implementation {others[0]}, or " if others else ""
        problems.append(f"--train_data_dir {cfg.train_data_dir} holds packed examples, but a {kind} model with "
                        f"--attn_implementation {attention} lets them attend to each other (probed: an example's "
                        f"logits change by {percent(found.leak)} when packed) and takes no mask that stops it"
                        f"{' while keeping its sliding window' if windowed(model_config) else ''}; "
                        f"{instead}prepare the data with --packing false")
    elif found.layout != "position_ids":
        note(f"packed examples: a {kind} model with --attn_implementation {attention} would let them attend to each "
             f"other as prepared (probed: an example's logits change by {percent(found.leak)} when packed); they are "
             f"kept apart as {found.layout} (docs/supervised.md#packing)")
    return found.layout or "position_ids"


def check_length_dependent_rope(cfg: Config, model_config: PretrainedConfig, data: DataFacts,
                                problems: list[str]) -> None:
    """Phi-3's longrope switches every position of a micro-batch to its long factors once the batch's largest
    position passes original_max_position_embeddings (transformers' longrope_frequency_update): a short example
    packed or padded with a longer one trained with factors it never gets alone, nor at inference (an audit: its
    per-token loss moved by 4e-3). Refused where a micro-batch can mix lengths across that limit, of the training
    data or of an --eval_data_dir folder (evaluated so, its loss was not the model's on its examples); blocks of raw
    text are all one length, each of them trained as it runs alone."""
    limit = longrope_limit(model_config)
    if limit is None:
        return
    fix = (f"prepare the data with --block_size {limit} or less, or with --packing false and train with "
           "--micro_batch_size 1 --eval_batch_size 1")
    folders = {f"--train_data_dir {cfg.train_data_dir}": data.longest_example} | {
        f"--eval_data_dir {name}": longest for name, longest in data.evaluated_longest.items()}
    for given, longest in folders.items():
        if data.format.packs_examples and longest > limit:
            problems.append(f"{given} packs examples of up to {longest} tokens with shorter ones, past the {limit} "
                            f"positions of a {model_config.model_type} model's longrope "
                            "(original_max_position_embeddings): transformers then gives every example of the "
                            f"micro-batch the long factors, which a short one does not get alone; {fix}")
        elif data.format.padded and longest > limit and max(
                cfg.micro_batch_size, cfg.eval_batch_size or cfg.micro_batch_size) > 1:
            problems.append(f"{given} holds examples of up to {longest} tokens, past the {limit} positions of a "
                            f"{model_config.model_type} model's longrope (original_max_position_embeddings): padded "
                            "into one micro-batch with them, a short example gets the long factors, which it does "
                            "not get alone; train with --micro_batch_size 1 --eval_batch_size 1")


def samples_pad_apart(cfg: Config, model_config: PretrainedConfig) -> bool:
    """Whether --eval_samples may pad a rank's prompts into one batch (app/evaluation/samples.py pads_apart, probed
    on the model's twin), and no longrope gives a batch's short prompts the factors of its longest one
    (check_length_dependent_rope), nor a scale by the column (Llama-4's) the scale of another column."""
    if not cfg.eval_samples or cfg.estimate_memory or longrope_limit(model_config) is not None or \
            column_scaled_from(model_config) is not None:
        return False
    if cfg.attn_implementation == "flash_attention_2" and not is_flash_attn_2_available():
        return False
    try:
        return pads_apart(model_config, cfg.attn_implementation, cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 (a twin that cannot be built here: one prompt at a time, as always)
        return False


def note_router_loss(model_config: PretrainedConfig, say: Callable[[str], None] = note) -> None:
    """What a mixture of experts trains besides the cross-entropy. Its router's load-balancing loss is added only
    where the config asks for it (output_router_logits), which transformers' default and the published Mixtral and
    Qwen-MoE configs do not: such runs trained no balancing loss, unsaid."""
    if not hasattr(model_config, "output_router_logits"):
        return
    if model_config.output_router_logits:
        coefficient = next((value for name in ROUTER_COEFFICIENT_NAMES
                            if isinstance(value := getattr(model_config, name, None), (int, float))), "?")
        say(f"a {model_config.model_type} model with output_router_logits adds its router's auxiliary loss "
            f"(x {coefficient}) to the cross-entropy: train_loss includes it, val_loss leaves it out (where the "
            "model's forward takes output_router_logits)")
    elif has_experts(model_config):
        say(f"a {model_config.model_type} model whose config has output_router_logits false (transformers' default, "
            "and that of the published Mixtral and Qwen-MoE configs) trains no load-balancing loss for its router, "
            "which may leave experts unused; set \"output_router_logits\": true in its config.json to train one")


def check_chunked_loss(cfg: Config, model_config: PretrainedConfig, say: Callable[[str], None] = note) -> bool:
    """--chunked_loss where the run's model class gives the same loss through it (app/model/loss.py's probe), and
    not in fp16: the chunked loss computes its gradients before backward's loss scaling, and fp16 products of
    unscaled gradients lose the small ones (rare tokens' rows of the output weight) that the scaler exists to keep.
    Unless asked for, not under --compile on GPUs either: there the compiled model's own loss was faster (41.2%
    against 36.3% MFU on an H200) and held 2.1 GB more at 8K tokens of a 128K vocabulary."""
    note_router_loss(model_config, say)
    if cfg.chunked_loss is None and cfg.compile and resolve_accelerator(cfg) == "cuda":
        say("--chunked_loss: with --compile on GPUs the model's own loss is compiled into its graph, faster than the "
            "chunked loss for a little more memory; --chunked_loss true keeps it chunked")
        return False
    if cfg.chunked_loss is False:
        return False
    if cfg.precision.startswith("16"):
        say(f"--chunked_loss: --precision {cfg.precision} keeps the model's own loss (fp16 gradients need the loss "
            "scaling that the chunked loss would come before); its logits are materialised")
        return False
    try:
        if probe_chunked_loss(model_config, cfg.attn_implementation, cfg.trust_remote_code):
            return True
        reason = "it changes the logits after its output layer"
    except Exception as error:  # a model the probe cannot build or run here: its own loss is the safe choice
        reason = f"probing it failed: {first_line(error)}"
    say(f"--chunked_loss: a {model_config.model_type} model keeps its own loss ({reason}); its logits are "
        "materialised")
    return False


def check_loss_kernel(cfg: Config, model_config: PretrainedConfig, chunked_loss: bool, problems: list[str]) -> None:
    """--loss_kernel cut_cross_entropy: Cut Cross-Entropy's Triton kernel runs on CUDA GPUs, from its package (not
    needed to plan), in place of the chunked loss (so only where the run takes that), in 16 bits (its backward
    asserts bf16 or fp16 embeddings: under 32-true every rank ended in an AssertionError at the first backward) and
    without a bias over the vocabulary, which the kernel has no place for."""
    if cfg.loss_kernel == "torch":
        return
    flag, accelerator = f"--loss_kernel {cfg.loss_kernel}", resolve_accelerator(cfg)
    if accelerator != "cuda":
        problems.append(f"{flag} is a Triton kernel for CUDA GPUs and this run is on {accelerator}: drop it (the "
                        "default, torch, runs on every device)")
    elif not cfg.estimate_memory and not all(importlib.util.find_spec(name) for name in ("cut_cross_entropy",
                                                                                          "triton")):
        problems.append(f"{flag} needs the cut-cross-entropy package (and Triton, which CUDA builds of torch bring): "
                        "pip install cut-cross-entropy==25.1.1")
    if compute_dtype(cfg.precision) == torch.float32:
        problems.append(f"{flag} computes in bf16 or fp16 only (its backward refuses fp32): use --precision "
                        f"bf16-mixed or bf16-true, not {cfg.precision}")
    if not chunked_loss:
        problems.append(f"{flag} computes the chunked loss, which this run does not take (see the note above): drop "
                        "it, or take the chunked loss (--chunked_loss true)")
    elif meta_model(model_config, cfg.trust_remote_code).get_output_embeddings().bias is not None:
        problems.append(f"{flag}: a {model_config.model_type} model's output layer adds a bias, which Cut "
                        "Cross-Entropy's kernel has no place for: drop it")


def check_loss_terms(cfg: Config, model_config: PretrainedConfig, problems: list[str]) -> None:
    """--label_smoothing and --z_loss enter the loss this project computes, chunked or from the model's logits, to
    which a mixture of experts' router loss is added at the coefficient its model shows; Cut Cross-Entropy's kernel
    computes the plain cross-entropy."""
    given = [f"--{name} {getattr(cfg, name)}" for name in ("label_smoothing", "z_loss") if getattr(cfg, name)]
    if not given:
        return
    if cfg.loss_kernel != "torch":
        problems.append(f"{' and '.join(given)}: --loss_kernel {cfg.loss_kernel} computes the plain cross-entropy; "
                        "drop it (the default, torch, adds them)")
    if getattr(model_config, "output_router_logits", False):
        model = meta_model(model_config, cfg.trust_remote_code)
        if adds_router_loss(model) and router_coefficient(model) is None:
            problems.append(f"{' and '.join(given)}: a {model_config.model_type} model adds its router's loss at a "
                            "coefficient it does not show, which a loss computed from its logits must add too: drop "
                            "them")


def check_decoder_start(cfg: Config, model_config: PretrainedConfig, data: DataFacts, problems: list[str]) -> None:
    """The token an encoder-decoder's decoder starts from. Without one in the config, a T5 cannot build its decoder's
    inputs and generation samples cannot start: each rank ended in a traceback after the launch; refused here. A
    decoder without absolute positions (T5) that starts from the token every target begins with (the BOS of a
    tokenizer that adds one) trains to a normal-looking validation loss but generates nothing (ROUGE 0): refused.
    A model the probe cannot build or run here is not refused."""
    if not model_config.is_encoder_decoder:
        return
    start = getattr(model_config, "decoder_start_token_id", None)
    if start is None:
        problems += missing_decoder_start(cfg, model_config)
        return
    if not data.format.encoder_decoder or data.target_start != start:
        return
    try:
        if decoder_tells_positions_apart(model_config, cfg.attn_implementation, cfg.trust_remote_code):
            return
    except Exception:  # noqa: BLE001 (not this check's to refuse)
        return
    problems.append(f"--train_data_dir: every target begins with token {start}, the decoder_start_token_id of "
                    f"{model_source(cfg)}: a {model_config.model_type} decoder reads it at its first two positions "
                    f"and cannot tell them apart, so it learns to write it for ever and generates nothing; set "
                    f"decoder_start_token_id to the pad token ({data.format.pad_token_id}) in the model's config")


def missing_decoder_start(cfg: Config, model_config: PretrainedConfig) -> list[str]:
    """The refusal of a config without decoder_start_token_id where the model class needs one to build its
    decoder's inputs from the labels, in training and generation alike (mBART builds them from the labels alone)."""
    try:
        error = decoder_inputs_error(model_config, cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 (a model the probe cannot build here: not this check's to refuse)
        error = None
    if not error:
        return []
    return [f"{model_flag(cfg)} {model_source(cfg)}: its config names no decoder_start_token_id, the token the "
            f"{model_config.model_type} decoder starts from, which training needs; add it to the model's config.json "
            "(T5 starts from its pad token, BART from </s>)"]


def isolates(model_config: PretrainedConfig, attention: str, cfg: Config) -> bool:
    """Whether another attention implementation would keep packed examples apart (to name it when refusing)."""
    try:
        return probe_isolation(model_config, attention, cfg.trust_remote_code).layout is not None
    except Exception:
        return False
