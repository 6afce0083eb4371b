"""Whether the examples packed into one row stay isolated, proven for the run's own model class, attention
implementation and micro batch, and the layout of the model's inputs that keeps them so.

Packed supervised rows hold several examples whose `position_ids` restart at 0. Whether attention then stops at
an example's edge depends on code outside this project, and differs between models and attention kernels
(transformers 5.23): Llama, Qwen2, Mistral, Phi-3 and GPT-2 turn the restarts into a block-diagonal mask under SDPA
and eager; Falcon's and OPT's masks ignore position_ids whatever the attention; FlashAttention-2 gets no mask at
all and finds the restarts only in a batch of one row. A list of architecture names would go stale with every
release, so the run's class is asked instead: `probe_isolation` builds a small random twin of the run's config
(2 layers, a few heads, a small vocabulary; the same class and attention implementation), runs packed rows of
examples of different lengths through it in each layout below, and compares every example's logits with its
logits alone. The first layout that matches is used for training and evaluation; when none does, the run is
refused before any worker starts.

| layout (app/data/formats.py) | isolates |
| --- | --- |
| position_ids: the rows as prepared | models whose masks read position restarts; FlashAttention with one row |
| one_row: the micro batch flattened into one row | FlashAttention-2 with micro batches of several rows |
| boolean_mask: a block-diagonal causal mask of booleans | SDPA in models that ignore position restarts |
| additive_mask: the same mask as 0 / -inf added to the scores | eager attention in those models |

The same kind of probe asks an encoder-decoder's class whether its decoder tells its positions apart
(`decoder_tells_positions_apart`): T5's cannot when it reads one token at its first two; and whether it builds its
decoder's inputs from the labels at all (`decoder_inputs_error`), and how (`decoder_inputs_from_labels`: where
generation samples start).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from transformers import PretrainedConfig

from app.data.formats import LAYOUTS, Layout, arrange
from app.model.build import model_class

EXAMPLE_LENGTHS = ((5, 9, 7, 3), (8, 4, 6, 6))
"""The examples of the probe's two rows (each row's last one stands for the padding that ends a block)."""
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 5e-2}
"""Largest difference, relative to the largest logit, between an example's logits packed and alone that still
counts as isolated. Measured on CPU: 2e-7 to 1.3e-6 when isolated (the twins of Granite's and OLMo-2's full-size
configs the highest), 0.3 to 1.2 when examples attend to each other, and 6e-4 when only a convolution reads across
(LFM2's short convolutions mix an example's first tokens with the previous one's last, which attention then spreads;
small in a random twin, of the order of the model's own weights once trained). In half precision the rounding alone is
larger than such a leak: there only attention leaks are seen."""
KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
MLP_WIDTH_NAMES = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff", "moe_intermediate_size",
                   "shared_expert_intermediate_size")
EXPERT_COUNT_NAMES = ("num_local_experts", "num_experts", "n_routed_experts")
PROBE_VOCAB = 512
LOCAL_ATTENTION_NAMES = ("sliding_window", "attention_chunk_size")
PROBE_WINDOW = 4
"""The twin's local-attention window: shorter than most of the probe's examples, so that a layout that loses the
window (a 4D mask replaces the model's own sliding-window masks in every layer) leaks in the probe as in training,
where examples are longer than the window (GPT-OSS: 128 tokens)."""


@dataclass(frozen=True)
class Isolation:
    """What the probe found: the first layout that isolates (None: none does) and how far an example's logits moved
    when packed as prepared."""

    layout: Optional[Layout]
    leak: float
    least: float = 0.0
    """The smallest leak of any layout (when none isolates): what is left with attention kept within examples."""


def probe_isolation(model_config: PretrainedConfig, attn_implementation: str,
                    trust_remote_code: bool = False) -> Isolation:
    """Run packed rows through a small twin of the model and return the first layout that keeps examples apart.

    The probe's batch has two rows, whatever the micro batch: evaluation batches have their own size, and a layout
    that isolates two rows isolates one. Raises what building or running the model raises (an attention
    implementation this machine lacks)."""
    model, device, dtype = probe_twin(model_config, attn_implementation, trust_remote_code)
    model.config.use_cache = False  # as training builds it: with a cache, transformers looks for no packing
    examples = probe_examples(EXAMPLE_LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        alone = [model(input_ids=ids[None].to(device)).logits[0].float() for row in examples for ids in row]
        as_prepared = packed_difference(model, "position_ids", examples, alone, device)
        leaks = []
        for layout in LAYOUTS:
            leaks.append(as_prepared if layout == "position_ids" else packed_difference(model, layout, examples, alone,
                                                                                       device))
            if leaks[-1] <= TOLERANCE[dtype]:
                outside = leak_outside_attention(model_config, dtype, trust_remote_code) if dtype != torch.float32 \
                    else None
                return Isolation(layout, as_prepared) if outside is None else Isolation(None, outside, outside)
    return Isolation(None, as_prepared, min(leaks))


def leak_outside_attention(model_config: PretrainedConfig, dtype: torch.dtype,
                           trust_remote_code: bool) -> Optional[float]:
    """How far packed examples mix outside attention (LFM2's convolutions), which a probe in `dtype` (half
    precision) cannot see under its rounding (FlashAttention's on a GPU: LFM2 was taken as isolated there): the twin
    in float32 on the CPU with SDPA (else eager), in every layout, the block-diagonal masks included. A leak left in
    the best layout that is larger than float32's rounding but within `dtype`'s is such a mixing; a larger one is
    attention's there (GPT-OSS's window lost under eager's masks), which the half-precision probe has judged with the
    run's own kernel. None when there is none, or when neither implementation runs."""
    for attention in ("sdpa", "eager"):
        try:
            found = probe_isolation(model_config, attention, trust_remote_code)
        except Exception:  # noqa: BLE001 (the class has no such implementation: the half-precision probe decides)
            continue
        hidden = found.layout is None and TOLERANCE[torch.float32] < found.least <= TOLERANCE[dtype]
        return found.least if hidden else None
    return None


def column_scaled_from(model_config: PretrainedConfig) -> Optional[int]:
    """The column of a row from which a model's layers without RoPE scale their queries by where a token sits in the
    row rather than by its position_ids (Llama-4's attn_temperature_tuning: transformers 5.23 counts columns from the
    cache, and the scale moves at every multiple of floor_scale, 8192): an example packed past it, or a prompt padded
    on the left past it, is read at another scale than alone. None for a model without such layers. The probes'
    examples are far shorter than floor_scale, so they cannot see it."""
    for config in (model_config, getattr(model_config, "text_config", None)):
        layers = getattr(config, "no_rope_layers", None) or []
        if getattr(config, "attn_temperature_tuning", False) and getattr(config, "floor_scale", None) and \
                not all(layers):  # a 0 marks a layer without RoPE
            return int(config.floor_scale)
    return None


def longrope_limit(model_config: PretrainedConfig) -> Optional[int]:
    """original_max_position_embeddings of a longrope RoPE (of any layer kind), past which it switches factors."""
    parameters = getattr(model_config, "rope_parameters", None) or {}
    kinds = list(parameters.values()) if all(isinstance(v, dict) for v in parameters.values()) else [parameters]
    limits = [kind.get("original_max_position_embeddings") for kind in kinds if kind.get("rope_type") == "longrope"]
    return min((limit for limit in limits if limit), default=None)


def reads_ahead(model_config: PretrainedConfig, attn_implementation: str, trust_remote_code: bool = False) -> bool:
    """Whether a causal LM class's predictions read the tokens after them, probed on its small twin: the logits of
    the first positions change when the last token does. AutoModelForCausalLM also builds encoder models' LM heads
    (BERT's, with is_decoder false), which attend both ways: such a run learnt to copy the next token (validation
    loss 0.12 where a decoder reached 3.35) and converted as "verified"."""
    model, device, dtype = probe_twin(model_config, attn_implementation, trust_remote_code)
    model.config.use_cache = False
    ids = probe_examples(((PROBE_LENGTH,),), model.config.vocab_size)[0][0][None].to(device)
    changed = ids.clone()
    changed[0, -1] = 3 if int(ids[0, -1]) != 3 else 4
    with torch.no_grad():
        before = model(input_ids=ids).logits[0, :-1].float()
        after = model(input_ids=changed).logits[0, :-1].float()
    return float((before - after).abs().max() / before.abs().max().clamp_min(1e-12)) > TOLERANCE[dtype]


PROBE_LENGTH = 8
"""Tokens of the causality probe's sequence."""


def decoder_tells_positions_apart(model_config: PretrainedConfig, attn_implementation: str,
                                  trust_remote_code: bool = False) -> bool:
    """Whether an encoder-decoder's decoder writes differently at its first two positions when it reads one token at
    both, probed on a small twin of the model. Without absolute positions (T5's are relative) its attention averages
    equal values there, and it cannot: a decoder that starts from the token every target begins with must write
    that token after it and the target's next token after the same input, learns the first, and generates nothing.
    BART's learned positions tell them apart."""
    model, device, dtype = probe_twin(model_config, attn_implementation, trust_remote_code)
    source = probe_examples(((8,),), model.config.vocab_size)[0][0][None].to(device)
    with torch.no_grad():
        logits = model(input_ids=source, decoder_input_ids=torch.full((1, 2), 3, device=device)).logits[0].float()
    return float((logits[0] - logits[1]).abs().max() / logits.abs().max().clamp_min(1e-12)) > TOLERANCE[dtype]


def decoder_inputs_from_labels(model_config: PretrainedConfig,
                               trust_remote_code: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model class's own way to build its decoder's inputs from labels, as its forward does in training: T5
    and BART shift the labels right behind decoder_start_token_id, mBART behind the labels' last token (the target
    language's code). It reads only the config; the model it belongs to is weightless, on the meta device."""
    with torch.device("meta"):
        model = model_class(model_config).from_config(small_twin(model_config), trust_remote_code=trust_remote_code)
    return model.prepare_decoder_input_ids_from_labels


def decoder_inputs_error(model_config: PretrainedConfig, trust_remote_code: bool = False) -> Optional[str]:
    """What the model class raises when it builds its decoder's inputs from a batch's labels (T5 without a
    decoder_start_token_id in its config); None when it builds them."""
    build = decoder_inputs_from_labels(model_config, trust_remote_code)
    try:
        build(torch.tensor([[5, 6, 2, -100]]))
    except Exception as error:  # noqa: BLE001 (whatever it raises is the answer)
        return (str(error).strip().splitlines() or [type(error).__name__])[0]
    return None


def packed_difference(model: torch.nn.Module, layout: Layout, examples: list[list[torch.Tensor]],
                      alone: list[torch.Tensor], device: torch.device) -> float:
    """The largest difference between an example's logits packed in `layout` and alone, relative to the largest
    logit; infinite when the model refuses the layout's inputs."""
    inputs = {"input_ids": torch.stack([torch.cat(row) for row in examples]),
              "position_ids": torch.stack([torch.cat([torch.arange(len(ids)) for ids in row]) for row in examples])}
    try:
        logits = model(**{name: tensor.to(device) for name, tensor in arrange(layout, inputs).items()}).logits
    except (RuntimeError, ValueError, TypeError, IndexError):  # e.g. a model that cannot take a 4D mask
        return float("inf")
    packed = logits.float().reshape(-1, logits.shape[-1]).split([len(ids) for row in examples for ids in row])
    return max(float((p - a).abs().max() / a.abs().max().clamp_min(1e-12)) for p, a in zip(packed, alone))


def probe_examples(rows: tuple[tuple[int, ...], ...], vocab_size: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [[torch.randint(3, vocab_size, (length,), generator=generator) for length in row] for row in rows]


def probe_twin(model_config: PretrainedConfig, attn_implementation: str,
               trust_remote_code: bool) -> tuple[torch.nn.Module, torch.device, torch.dtype]:
    """The model's small twin in evaluation mode, on the device and in the dtype its attention is probed in. Its
    weights are seeded: every rank runs the preflight, and each must find what the others find (the layout of packed
    rows, whether samples are batched: ranks that batched otherwise would wait for each other for ever)."""
    device, dtype = probe_device(attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(model_config).from_config(small_twin(model_config), attn_implementation=attn_implementation,
                                                      trust_remote_code=trust_remote_code, dtype=dtype)
    return model.to(device).eval(), device, dtype


def probe_device(attn_implementation: str) -> tuple[torch.device, torch.dtype]:
    """FlashAttention kernels run on a GPU in half precision; the others are probed on the CPU in float32."""
    if "flash" in attn_implementation and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))), torch.bfloat16
    return torch.device("cpu"), torch.float32


def small_twin(config: PretrainedConfig) -> PretrainedConfig:
    """The config with 2 layers (one of each kind where layers differ), at most 4 attention heads of the same
    width in the same grouping, narrow feed-forward layers, at most 4 experts, a sliding window (or attention
    chunk) of PROBE_WINDOW tokens and a small vocabulary: the same classes and attention code, a few million
    weights (Llama-3-8B's twin: 5 million).

    Attribute names go through the config's own attribute_map (GPT-2's n_layer, n_head, n_embd)."""
    twin = copy.deepcopy(config)
    layer_types = getattr(config, "layer_types", None)
    if not writable(config, "layer_types"):  # kinds computed from other fields (Jamba, Mamba-2, Bamba)
        twin.num_hidden_layers = fewest_layers_of_every_kind(twin)
    elif isinstance(layer_types, list) and layer_types:
        kinds = list(dict.fromkeys(layer_types))
        twin.layer_types = kinds if len(kinds) > 1 else kinds * 2
        twin.num_hidden_layers = len(twin.layer_types)
    else:
        twin.num_hidden_layers = 2
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads > 4:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        twin.num_attention_heads = 4
        for name in KV_HEAD_NAMES:
            kv_heads = getattr(config, name, None)
            if isinstance(kv_heads, int) and 0 < kv_heads < heads:
                setattr(twin, name, max(1, 4 * kv_heads // heads))
            elif kv_heads == heads:
                setattr(twin, name, 4)
        if "head_dim" in vars(config):  # a value of its own, not a property computed from the others
            twin.head_dim = head_dim
        old_width, twin.hidden_size = config.hidden_size, 4 * head_dim
        if getattr(config, "word_embed_proj_dim", None) == old_width:
            twin.word_embed_proj_dim = twin.hidden_size
    for name in MLP_WIDTH_NAMES:
        if isinstance(getattr(config, name, None), int):
            setattr(twin, name, 2 * twin.hidden_size)
    for name in EXPERT_COUNT_NAMES:
        if isinstance(getattr(config, name, None), int) and getattr(config, name) > 4:
            setattr(twin, name, 4)
    if isinstance(getattr(config, "num_experts_per_tok", None), int):
        twin.num_experts_per_tok = min(config.num_experts_per_tok, 2)
    for name in LOCAL_ATTENTION_NAMES:
        window = getattr(config, name, None)
        if isinstance(window, int) and window > PROBE_WINDOW:
            setattr(twin, name, PROBE_WINDOW)
    if twin.hidden_size > MAX_TWIN_WIDTH:
        raise TwinUnavailable(f"a {config.model_type} config has no attention heads to narrow it by, and its small "
                              f"twin would be {twin.hidden_size} wide")
    if config.vocab_size > PROBE_VOCAB:
        twin.vocab_size = PROBE_VOCAB
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            if _beyond(getattr(twin, name, None), PROBE_VOCAB):
                setattr(twin, name, None)
    return twin


class TwinUnavailable(ValueError):
    """The probes' small twin cannot be made of this config (a state-space model's width follows from fields they
    do not know): building the model at full size instead ran a 24 GB machine out of memory on Mamba-2."""


MAX_TWIN_WIDTH = 1024
"""The widest a twin may be: 4 heads of 256 (Gemma's head_dim)."""


def fewest_layers_of_every_kind(config: PretrainedConfig) -> int:
    """The fewest layers whose computed kinds include every kind of the full model's (Jamba: attention every 8th
    layer from the 4th, 5 layers)."""
    kinds = set(config.layer_types or [])
    full = config.num_hidden_layers
    for layers in range(2, full):
        config.num_hidden_layers = layers
        if set(config.layer_types or []) >= kinds:
            return layers
    return full


def writable(config: PretrainedConfig, name: str) -> bool:
    """Whether the config's attribute `name` (through its attribute_map) can be set: state-space and hybrid
    configs compute their layer kinds in a property without a setter, and assigning them raised AttributeError,
    which ended every such run (packed or not) after its preflight."""
    attribute = getattr(type(config), config.attribute_map.get(name, name), None)
    return not (isinstance(attribute, property) and attribute.fset is None)


def _beyond(token_id: object, vocab_size: int) -> bool:
    ids = token_id if isinstance(token_id, list) else [token_id]
    return any(isinstance(i, int) and i >= vocab_size for i in ids)
