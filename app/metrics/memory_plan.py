"""The memory planner (`train.py ... --estimate_memory`): what one device will hold, before anything runs.

For a model of N parameters whose model state is divided over S ranks (the world size for FULL_SHARD and
SHARD_GRAD_OP, the devices of one node for HYBRID_SHARD, 1 for NO_SHARD and DDP), per device:
- parameters: N x the stored dtype (fp32 for 32-true and the *-mixed precisions, 16 bits for *-true) / S
  (SHARD_GRAD_OP shards the stored parameters but keeps whole layers gathered from forward to backward: those
  count as working memory);
- gradients: as the parameters, / S except for NO_SHARD and DDP; with --fsdp_no_sync and gradient accumulation,
  the whole unsharded gradient in the compute dtype instead (FSDP keeps it on every rank between micro-batches);
- optimizer state: AdamW's two moments in the parameters' dtype, / S except for NO_SHARD and DDP;
- working memory: FSDP's gathered layers in the compute dtype (the root module, i.e. embeddings, final norm and
  head, plus two decoder layers in flight; every layer for SHARD_GRAD_OP; less input embeddings that are a unit of
  their own, resharded after forward), DDP's gradient buckets (a second copy of the gradients), the chunked loss's
  buffers (one chunk's logits, the output weight's fp32 gradient and its compute-dtype product), and about 1 GiB per
  process for the runtime (CUDA context and kernels, or the Python process itself on a CPU) measured before any
  tensor exists;
- activations: per sequence, what backward keeps of each decoder layer (with activation checkpointing only the
  layer inputs, plus one layer recomputed at a time), and of the loss: the hidden states' gradient with the chunked
  loss, else the logits with their fp32 loss copies.
With --cpu_offload the parameters, gradients and optimizer state live in host RAM, not on the device.
Parameters, gradients and optimizer state are exact up to FSDP's padding (tests compare them with the tensors a
real run holds); activations are an estimate from the layer shapes, so 10% of the device is kept free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import psutil
import torch
from torch.nn import Module

from app.choices import SHARDED_STRATEGIES
from app.distributed.fsdp2 import parameter_count, separate_embeddings
from app.distributed.precision import compute_dtype, weights_dtype
from app.metrics.console import format_gb
from app.metrics.observe import GB
from app.model.build import meta_model
from app.model.loss import chunk_tokens

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from arguments import Config

RUNTIME_BYTES = 1 * GB
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about the model, read from a weightless instance."""

    parameters: int
    root_parameters: int
    """Parameters outside the wrapped layers (embeddings, final norm, head): FSDP's root unit."""
    layer_parameters: int
    """Parameters of the largest wrapped layer."""
    input_embedding_unit: int
    """Parameters of the input embeddings when they are a unit of their own
    (`app.distributed.fsdp2.separate_embeddings`), else 0."""
    layers: int
    hidden_size: int
    kv_size: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, model_config: PretrainedConfig, wrap_classes: set[type[Module]],
           trust_remote_code: bool = False) -> "ModelShape":
        model = meta_model(model_config, trust_remote_code)
        layers = [m for m in model.modules() if type(m) in wrap_classes]
        total = parameter_count(model)
        per_layer = [parameter_count(layer) for layer in layers] or [0]
        _, input_embeddings = separate_embeddings(model, layers)
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        return cls(parameters=total, root_parameters=total - sum(per_layer), layer_parameters=max(per_layer),
                   input_embedding_unit=parameter_count(input_embeddings) if input_embeddings else 0,
                   layers=len(layers) or model_config.num_hidden_layers, hidden_size=model_config.hidden_size,
                   kv_size=head_dim * getattr(model_config, "num_key_value_heads", heads),
                   intermediate_size=feed_forward_size(model_config), vocab_size=model_config.vocab_size)


FEED_FORWARD_NAMES = ("intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "n_inner")
"""The MLP's inner width in the configs of Llama, Mistral and Qwen; T5; OPT; BART; GPT-2 (where None means 4 x hidden).
transformers' attribute maps give every config `hidden_size`, `num_attention_heads` and `num_hidden_layers`, but
not this."""


def feed_forward_size(model_config: PretrainedConfig) -> int:
    for name in FEED_FORWARD_NAMES:
        if getattr(model_config, name, None):
            return getattr(model_config, name)
    return 4 * model_config.hidden_size


@dataclass(frozen=True)
class Setup:
    """The run options that change memory."""

    strategy: str
    sharding_strategy: str
    precision: str
    world_size: int
    devices_per_node: int
    micro_batch_size: int
    block_size: int
    gradient_checkpointing: bool
    cpu_offload: bool
    unsharded_accumulation: bool = False
    """--fsdp_no_sync with more than one micro-batch per step."""
    chunked_loss: bool = False
    """The loss computed in chunks without the full logits (app/model/loss.py)."""

    @property
    def shards(self) -> int:
        """Ranks over which parameters, gradients and optimizer state are divided."""
        if self.strategy not in SHARDED_STRATEGIES or self.sharding_strategy == "NO_SHARD":
            return 1
        return self.devices_per_node if self.sharding_strategy == "HYBRID_SHARD" else self.world_size


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device by category."""

    parameters: float
    gradients: float
    optimizer: float
    working: float
    activations: float
    activations_per_sequence: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.working + self.activations


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def activation_bytes_per_sequence(shape: ModelShape, setup: Setup) -> float:
    """What backward keeps for one sequence of block_size tokens, in the compute dtype unless noted.

    Per decoder layer and token (SDPA keeps no attention matrix): the normalised inputs of attention and MLP (2h),
    queries and keys before and after rotary embedding (2(h + kv)), values (kv), the attention output and its
    projection input (2h), the MLP's gate, up, activation and product (4i), and each RMSNorm's fp32 input and
    normalised value (4h in fp32). The loss: chunked, the hidden states' gradient (computed in forward); else the
    compute-dtype logits, their fp32 copy, log-softmax and its gradient.
    """
    h, kv, i = shape.hidden_size, shape.kv_size, shape.intermediate_size
    size = dtype_bytes(compute_dtype(setup.precision))
    layer = size * (4 * h + 2 * (h + kv) + kv + 4 * i) + 4 * (4 * h)
    fp32_copy = 0 if size == 4 else 4
    logits = size * h if setup.chunked_loss else shape.vocab_size * (size + fp32_copy + 4 + 4)
    if setup.gradient_checkpointing:
        layers = shape.layers * size * h + layer
    else:
        layers = shape.layers * layer
    return setup.block_size * (layers + logits)


def chunked_loss_bytes(shape: ModelShape, setup: Setup) -> float:
    """The chunked loss's buffers, whatever the micro batch: one chunk's logits in the compute dtype and in fp32,
    the output weight's gradient summed in fp32 and, below fp32, each chunk's product in the compute dtype."""
    if not setup.chunked_loss:
        return 0.0
    size = dtype_bytes(compute_dtype(setup.precision))
    tokens = min(chunk_tokens(shape.vocab_size), setup.micro_batch_size * setup.block_size)
    weight = shape.vocab_size * shape.hidden_size
    return tokens * shape.vocab_size * (size + (4 if size != 4 else 0)) + weight * (4 + (size if size != 4 else 0))


def estimate_memory(shape: ModelShape, setup: Setup) -> MemoryEstimate:
    stored = dtype_bytes(weights_dtype(setup.precision))
    computed = dtype_bytes(compute_dtype(setup.precision))
    on_device = 0 if setup.cpu_offload else 1
    parameters = on_device * shape.parameters * stored / setup.shards
    gradients = on_device * shape.parameters * stored / setup.shards
    if setup.unsharded_accumulation:
        gradients = shape.parameters * computed
    optimizer = on_device * 2 * shape.parameters * stored / setup.shards
    if setup.strategy not in SHARDED_STRATEGIES:
        working = gradients
    elif setup.sharding_strategy == "NO_SHARD":
        working = 0.0
    elif setup.sharding_strategy == "SHARD_GRAD_OP":
        working = shape.parameters * computed
    else:
        working = (shape.root_parameters - shape.input_embedding_unit + 2 * shape.layer_parameters) * computed
    working += chunked_loss_bytes(shape, setup)
    per_sequence = activation_bytes_per_sequence(shape, setup)
    return MemoryEstimate(parameters=parameters, gradients=gradients, optimizer=optimizer,
                          working=working + RUNTIME_BYTES, activations=per_sequence * setup.micro_batch_size,
                          activations_per_sequence=per_sequence)


def largest_micro_batch(estimate: MemoryEstimate, device_bytes: float) -> int:
    """The largest micro batch whose estimate fits in the usable part of the device; 0 when none does."""
    fixed = estimate.total - estimate.activations
    return max(0, int((device_bytes * USABLE_FRACTION - fixed) // estimate.activations_per_sequence))


def device_memory_bytes(cfg: Config, devices_per_node: int) -> tuple[float, str]:
    """The memory of one device, and where the figure comes from."""
    if cfg.device_memory_gb is not None:
        return cfg.device_memory_gb * GB, "--device_memory_gb"
    if torch.cuda.is_available() and cfg.accelerator in ("auto", "gpu", "cuda"):
        properties = torch.cuda.get_device_properties(0)
        return properties.total_memory, properties.name
    return psutil.virtual_memory().total / devices_per_node, f"host RAM / {devices_per_node} processes"


def setup_of(cfg: Config, world_size: int, block_size: int, accumulation: int, chunked_loss: bool) -> Setup:
    return Setup(strategy=cfg.strategy, sharding_strategy=cfg.sharding_strategy, precision=cfg.precision,
                 world_size=world_size, devices_per_node=world_size // cfg.num_nodes,
                 micro_batch_size=cfg.micro_batch_size, block_size=block_size,
                 gradient_checkpointing=cfg.gradient_checkpointing, cpu_offload=cfg.cpu_offload,
                 chunked_loss=chunked_loss,
                 unsharded_accumulation=cfg.strategy in SHARDED_STRATEGIES and cfg.fsdp_no_sync and accumulation > 1)


def memory_report(cfg: Config, shape: ModelShape, setup: Setup,
                  device: Optional[tuple[float, str]] = None) -> tuple[str, bool]:
    """The plan as printed, and whether the run as configured fits."""
    estimate = estimate_memory(shape, setup)
    device_bytes, source = device or device_memory_bytes(cfg, setup.devices_per_node)
    fits = estimate.total <= device_bytes * USABLE_FRACTION
    rows = [("parameters", estimate.parameters), ("gradients", estimate.gradients),
            ("optimizer state", estimate.optimizer), ("working memory", estimate.working),
            (f"activations ({setup.micro_batch_size} x {setup.block_size} tokens)", estimate.activations),
            ("total", estimate.total)]
    sharding = {"fsdp": setup.sharding_strategy, "fsdp2": f"FSDP2 {setup.sharding_strategy}"}.get(setup.strategy,
                                                                                                  setup.strategy)
    lines = [f"memory per device: {shape.parameters / 1e6:,.1f}M parameters, {sharding} over {setup.world_size} "
             f"device(s), {setup.precision}, activation checkpointing {'on' if setup.gradient_checkpointing else 'off'}"
             f"{', cpu offload' if setup.cpu_offload else ''}"
             f"{', unsharded gradient accumulation (--fsdp_no_sync)' if setup.unsharded_accumulation else ''}"
             f", {'chunked loss' if setup.chunked_loss else 'full logits'}"]
    lines += [f"  {name:<40} {format_gb(value / GB):>10}" for name, value in rows]
    lines.append(f"  device: {device_bytes / GB:.1f} GB ({source}); {'fits' if fits else 'does NOT fit'} "
                 f"with {1 - USABLE_FRACTION:.0%} kept free")
    largest = largest_micro_batch(estimate, device_bytes)
    lines.append(f"  largest micro batch that fits: {largest}" if largest else
                 "  no micro batch fits: shard more (FULL_SHARD, more devices), --gradient_checkpointing true, "
                 "--precision bf16-true or --cpu_offload true")
    return "\n".join(lines), fits
