"""The memory planner (`train.py ... --estimate_memory`): what one device will hold, before anything runs.

For a model of N parameters whose model state is divided over S ranks (the world size for FULL_SHARD and
SHARD_GRAD_OP, the devices of one node for HYBRID_SHARD, 1 for NO_SHARD and DDP), per device:
- parameters: N x the stored dtype (fp32 for 32-true and the *-mixed precisions, 16 bits for *-true) / S
  (SHARD_GRAD_OP shards the stored parameters but keeps whole layers gathered from forward to backward: those
  count as working memory);
- gradients: as the parameters, / S except for NO_SHARD and DDP; with --fsdp_no_sync and gradient accumulation,
  the whole unsharded gradient instead, which FSDP keeps on every rank between micro-batches: in the compute dtype,
  and under fsdp2 in the reduce dtype (fp32 under *-mixed: FSDP2's `unsharded_accumulated_grad`);
- optimizer state: AdamW's two moments in the parameters' dtype (with --optimizer muon, Muon's one momentum for the
  layers' weight matrices), / S except for NO_SHARD and DDP;
- working memory: FSDP's gathered layers in the compute dtype (the root module, i.e. embeddings, final norm and
  head, plus two decoder layers in flight; every layer for SHARD_GRAD_OP; less input embeddings that are a unit of
  their own, resharded after forward), under *-mixed the fp32 copy of the largest unit's gradient that FSDP and
  FSDP2 make to reduce it (FSDP1 `_runtime_utils.py`, FSDP2 `_fsdp_collectives.py`; DDP's gradients are views of its
  buckets, `gradient_as_bucket_view`, so its buckets add nothing), the chunked loss's buffers (one chunk's logits
  and their gradient, the output weight's fp32 gradient and its compute-dtype copy), under *-mixed with NO_SHARD
  every unit's compute-dtype copy (held from forward to backward), and the runtime: on a GPU 1.25 GiB for the CUDA
  context, kernels and NCCL's buffers (measured on an H200 with one rank, `RUNTIME_BYTES`); on CPU processes this
  planning process's own resident memory (the same interpreter, libraries and model code a rank imports) plus the
  free space glibc's heap keeps (app/distributed/host_memory.py);
- activations: per sequence, what backward keeps of the model's body, measured on the weightless model
  (app/metrics/activations.py; under autocast, on fake tensors of the run's device through torch's autocast, whose
  copies of fp32 weights count once, as working memory), and of the loss: the hidden states' gradient with the
  chunked loss, else the logits with their fp32 loss copies.
With --cpu_offload the parameters, gradients and optimizer state live in host RAM, not on the device.
Parameters, gradients and optimizer state are exact up to FSDP's padding (tests compare them with the tensors a
real run holds); activations are measured on the meta device with a stand-in for fused attention kernels, and the
CPU total is compared with real runs' peak RSS (benchmarks/bench_training.py --parts planner); 10% of the device is
kept free.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

import psutil
import torch
from torch.nn import Module

from app.choices import SHARDED_STRATEGIES
from app.cli import first_line
from app.distributed.fsdp2 import parameter_count, separate_embeddings
from app.distributed.host_memory import CPU_HEAP_SETTINGS
from app.distributed.precision import compute_dtype, reduce_dtype, weights_dtype
from app.distributed.strategy import resolve_accelerator
from app.metrics.activations import FAKE_TENSOR_LIMITS, READS_VALUES, KeptForBackward, kept_for_backward
from app.metrics.console import format_gb
from app.metrics.observe import GB, has_experts
from app.model.build import freeze_parameters, meta_model
from app.model.loss import chunk_tokens
from app.optimization.optimizer import matrix_names

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from arguments import Config

RUNTIME_BYTES = int(1.25 * GB)
"""A GPU process's memory outside CUDA's allocator: measured by benchmarks/gpu_check.py on an H200 (torch 2.11,
CUDA 13, one rank) as 0.51 GiB of CUDA context and 1.21 GiB once NCCL's communicator and the cuBLAS and attention
kernels are loaded."""
USABLE_FRACTION = 0.9


class Unplannable(Exception):
    """A model whose memory the planner cannot measure; its message says so in one line."""


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
    hidden_size: int
    vocab_size: int
    model_config: PretrainedConfig = field(compare=False, repr=False)
    wrap_classes: set[type[Module]] = field(compare=False, repr=False)
    trust_remote_code: bool = False
    trained_parameters: int = -1
    """Parameters that take gradients and optimizer state: all but those --freeze names (-1: all)."""
    unit_trained_parameters: int = -1
    """Parameters of the FSDP1 units that hold a trained one: FSDP1 keeps a unit's flat gradient whole (-1: all)."""
    trained_matrix_parameters: int = 0
    """Trained parameters that --optimizer muon steps with Muon (`matrix_names`), whose state is one momentum."""
    measured: dict[tuple, KeptForBackward] = field(default_factory=dict, compare=False, repr=False)
    """What backward keeps of one sequence, by (tokens, target tokens, dtype, attention, gpu, autocast): measured
    once each."""

    @classmethod
    def of(cls, model_config: PretrainedConfig, wrap_classes: set[type[Module]],
           trust_remote_code: bool = False, freeze: Optional[list[str]] = None) -> "ModelShape":
        """`wrap_classes`: FSDP's units; none (DDP, one device) stands for the model's own layer classes, which
        activation checkpointing recomputes there too (transformers' own): without them the plan counted every
        activation outside a layer, and so checkpointing freed none (1.5x the measured peak under DDP)."""
        model = meta_model(model_config, trust_remote_code)
        freeze_parameters(model, freeze)
        own = set(model._no_split_modules or [])
        wrap_classes = wrap_classes or {type(m) for m in model.modules() if type(m).__name__ in own}
        layers = [m for m in model.modules() if type(m) in wrap_classes]
        total = parameter_count(model)
        per_layer = [parameter_count(layer) for layer in layers] or [0]
        _, input_embeddings = separate_embeddings(model, layers)
        trained = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
        in_layers = {id(parameter) for layer in layers for parameter in layer.parameters()}
        units = [list(layer.parameters()) for layer in layers] + [
            [parameter for parameter in model.parameters() if id(parameter) not in in_layers]]
        unit_trained = sum(sum(p.numel() for p in unit) for unit in units if any(p.requires_grad for p in unit))
        matrices = matrix_names(model)
        trained_matrices = sum(parameter.numel() for name, parameter in model.named_parameters()
                               if parameter.requires_grad and name in matrices)
        return cls(parameters=total, root_parameters=total - sum(per_layer), layer_parameters=max(per_layer),
                   trained_parameters=trained, unit_trained_parameters=unit_trained,
                   trained_matrix_parameters=trained_matrices,
                   input_embedding_unit=parameter_count(input_embeddings) if input_embeddings else 0,
                   hidden_size=model_config.hidden_size,
                   vocab_size=model_config.vocab_size, model_config=model_config, wrap_classes=wrap_classes,
                   trust_remote_code=trust_remote_code)

    @property
    def largest_unit(self) -> int:
        """Parameters of FSDP's largest unit: a layer, the input embeddings or the rest of the root."""
        return max(self.layer_parameters, self.input_embedding_unit, self.root_parameters - self.input_embedding_unit)

    def kept_for_backward(self, tokens: int, target_tokens: int, dtype: torch.dtype, attention: str,
                          gpu: bool, autocast: Optional[torch.dtype] = None) -> KeptForBackward:
        """Measured once per key. Under autocast, a forward that fails on the fake tensors (one that reads values;
        transformers asking a machine without a GPU for its CUDA capability) is measured as without autocast, with
        the weights in the compute dtype, and says why (the report shows it): the plan never fails for it."""
        key = (tokens, target_tokens, dtype, attention, gpu, autocast)
        if key not in self.measured:
            try:
                self.measured[key] = self.measure(*key)
            except Unplannable as unplannable:
                if autocast is None:
                    raise
                error = unplannable.__cause__
                why = READS_VALUES if isinstance(error, FAKE_TENSOR_LIMITS) else f"measuring it failed ({error})"
                kept = self.measure(tokens, target_tokens, autocast, attention, gpu, None)
                self.measured[key] = replace(kept, autocast_unmeasured=why.splitlines()[0][:200])
        return self.measured[key]

    def measure(self, *key: object) -> KeptForBackward:
        """Unplannable for a forward that does not run on a meta model at all (JetMoE's experts read their token
        counts with `.tolist()`: a traceback from --estimate_memory, whose runs train)."""
        try:
            return kept_for_backward(meta_model(self.model_config, self.trust_remote_code), self.wrap_classes, *key)
        except Exception as error:
            if not isinstance(error, FAKE_TENSOR_LIMITS) and "meta" not in str(error):  # the planner's own error
                raise
            raise Unplannable(f"--estimate_memory: a {self.model_config.model_type} model's activations cannot be "
                              "measured on the planner's weightless (meta) copy, whose tensors have no values "
                              f"({first_line(error)}); train a few steps instead: every log row has the peak "
                              "memory") from error


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
    checkpoint_every: int = 1
    """--gradient_checkpointing_every: one layer in this many is recomputed."""
    unsharded_accumulation: bool = False
    """--fsdp_no_sync with more than one micro-batch per step."""
    chunked_loss: bool = False
    """The loss computed in chunks without the full logits (app/model/loss.py)."""
    loss_kernel: str = "torch"
    """--loss_kernel: what computes the chunked loss."""
    target_block_size: int = 0
    """An encoder-decoder's longest target (its decoder's tokens); 0 for causal models."""
    attention: str = "sdpa"
    """--attn_implementation: eager keeps the attention matrix, the fused kernels do not."""
    reduce_dtype: Optional[torch.dtype] = None
    """The dtype gradients are reduced in (--reduce_dtype); default: fp32 under *-mixed, else the weights'."""
    gpu: bool = True
    """Whether the run is on GPUs, whose fused attention kernels also take dropout (app/metrics/activations.py)."""
    autocast: bool = False
    """Whether forward runs under autocast: Lightning's precision plugins under *-mixed for DDP and one device, and
    for FSDP1 on GPUs (its `torch.autocast("cuda")` is off on CPU); FSDP2's MixedPrecisionPolicy does not."""
    runtime: float = RUNTIME_BYTES
    """A process's own memory before any tensor (`runtime_bytes`)."""
    heap_kept_free: float = 0.0
    """On CPU, the most free space glibc's heap keeps at its top (MALLOC_TRIM_THRESHOLD_); 0 on GPUs."""
    optimizer: str = "adamw"
    """--optimizer: muon keeps one momentum of the layers' matrices where AdamW keeps two moments."""

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


def kept_by_body(shape: ModelShape, setup: Setup) -> KeptForBackward:
    """What the model's body keeps for backward of one sequence (app/metrics/activations.py), its weights in the
    dtype forward sees them in: gathered in the compute dtype by FSDP, stored ones for DDP and one device (whose
    autocast casts them). A mixture of experts' are measured in bfloat16 without autocast, scaled to the compute
    dtype's size: its experts run through torch's grouped_mm, whose shape-only kernel takes bfloat16 alone (under
    32-true its few fp32 tensors then count twice: the figure errs high)."""
    computed = compute_dtype(setup.precision)
    target_tokens = setup.target_block_size or setup.block_size
    if has_experts(shape.model_config):
        kept = shape.kept_for_backward(setup.block_size, target_tokens, torch.bfloat16, setup.attention, setup.gpu)
        return kept.scaled(dtype_bytes(computed) / 2)
    weights = computed if setup.strategy in SHARDED_STRATEGIES else weights_dtype(setup.precision)
    return shape.kept_for_backward(setup.block_size, target_tokens, weights, setup.attention, setup.gpu,
                                   computed if setup.autocast else None)


def activation_bytes_per_sequence(shape: ModelShape, setup: Setup) -> float:
    """What the body keeps for one sequence at the peak of backward, and the loss: chunked, the hidden states'
    gradient (computed in forward); else the compute-dtype logits, their fp32 copy, log-softmax and its gradient. An
    encoder-decoder's loss is over its target tokens."""
    size = dtype_bytes(compute_dtype(setup.precision))
    fp32_copy = 0 if size == 4 else 4
    loss = size * shape.hidden_size if setup.chunked_loss else shape.vocab_size * (size + fp32_copy + 4 + 4)
    target_tokens = setup.target_block_size or setup.block_size
    every = setup.checkpoint_every if setup.gradient_checkpointing else 0
    return kept_by_body(shape, setup).peak(every) + target_tokens * loss


def runtime_bytes(cfg: Config) -> tuple[float, float]:
    """A process's memory before any tensor, and what its heap keeps free. A GPU's CUDA context, kernels and NCCL
    buffers: `RUNTIME_BYTES`, as measured on an H200. A CPU process: this one's resident memory, which has imported
    what a rank imports; its heap keeps up to MALLOC_TRIM_THRESHOLD_ of what a step freed (app/distributed/
    host_memory.py), which `estimate_memory` bounds by the step's activations."""
    if resolve_accelerator(cfg) != "cpu":
        return RUNTIME_BYTES, 0.0
    kept_free = int(os.environ.get("MALLOC_TRIM_THRESHOLD_", CPU_HEAP_SETTINGS["MALLOC_TRIM_THRESHOLD_"][1]))
    return psutil.Process().memory_info().rss, kept_free


def gradient_reduce_bytes(shape: ModelShape, setup: Setup) -> float:
    """FSDP and FSDP2 reduce a unit's gradient in the reduce dtype: under *-mixed, an fp32 copy of the largest."""
    if setup.strategy not in SHARDED_STRATEGIES:
        return 0.0
    reduced = setup.reduce_dtype or reduce_dtype(setup.precision, None)
    return shape.largest_unit * dtype_bytes(reduced) if reduced != compute_dtype(setup.precision) else 0.0


def chunked_loss_bytes(shape: ModelShape, setup: Setup) -> float:
    """The chunked loss's buffers at their most, whatever the micro batch (app/model/loss.py), the larger of:
    - in forward, the output weight's gradient summed in fp32, and one chunk's fp32 logits (turned into their
      gradient in place) and, below fp32, that gradient in the compute dtype (on CPU then an fp32 copy of it for
      the GEMM that sums into the weight's gradient, made once the fp32 logits are let go: `accumulate_product`);
    - in backward, the weight's fp32 gradient and, below fp32, its copy in the compute dtype that autograd gets.
    Cut Cross-Entropy's kernel holds the weight's gradient in the compute dtype: 0.52 GB above its inputs for
    128,256 x 2048 in bf16 on an H200 (docs/performance.md), that gradient's 0.525 GB."""
    if not setup.chunked_loss:
        return 0.0
    size = dtype_bytes(compute_dtype(setup.precision))
    if setup.loss_kernel == "cut_cross_entropy":
        return shape.vocab_size * shape.hidden_size * size
    predicted = setup.target_block_size or setup.block_size  # an encoder-decoder's loss is over its targets
    tokens = min(chunk_tokens(shape.vocab_size), setup.micro_batch_size * predicted)
    weight = shape.vocab_size * shape.hidden_size
    lower = size if size != 4 else 0  # bytes of the compute dtype's copies, below fp32
    return max(tokens * shape.vocab_size * (4 + lower) + weight * 4, weight * (4 + lower))


def estimate_memory(shape: ModelShape, setup: Setup) -> MemoryEstimate:
    stored = dtype_bytes(weights_dtype(setup.precision))
    computed = dtype_bytes(compute_dtype(setup.precision))
    on_device = 0 if setup.cpu_offload else 1
    trained = shape.parameters if shape.trained_parameters < 0 else shape.trained_parameters
    with_gradients = (shape.unit_trained_parameters if setup.strategy == "fsdp" else shape.trained_parameters)
    with_gradients = shape.parameters if with_gradients < 0 else with_gradients
    parameters = on_device * shape.parameters * stored / setup.shards
    gradients = on_device * with_gradients * stored / setup.shards
    if setup.unsharded_accumulation:
        gradients = with_gradients * (dtype_bytes(setup.reduce_dtype) if setup.strategy == "fsdp2"
                                      and setup.reduce_dtype is not None else computed)
    moments = 2 * trained - (shape.trained_matrix_parameters if setup.optimizer == "muon" else 0)
    optimizer = on_device * moments * stored / setup.shards  # AdamW's two moments, Muon's one, of what trains
    if setup.strategy not in SHARDED_STRATEGIES:  # one device, or DDP, whose gradients are its buckets' views
        working = 0.0
    elif setup.sharding_strategy == "NO_SHARD":  # under *-mixed every unit's compute-dtype copy, forward to backward
        working = shape.parameters * computed if computed != stored else 0.0
    elif setup.sharding_strategy == "SHARD_GRAD_OP":
        working = shape.parameters * computed
    else:
        working = (shape.root_parameters - shape.input_embedding_unit + 2 * shape.layer_parameters) * computed
    working += (chunked_loss_bytes(shape, setup) + gradient_reduce_bytes(shape, setup)
                + kept_by_body(shape, setup).weight_copies)
    per_sequence = activation_bytes_per_sequence(shape, setup)
    activations = per_sequence * setup.micro_batch_size
    runtime = setup.runtime + min(setup.heap_kept_free, activations)
    return MemoryEstimate(parameters=parameters, gradients=gradients, optimizer=optimizer,
                          working=working + runtime, activations=activations,
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


def setup_of(cfg: Config, world_size: int, block_size: int, accumulation: int, chunked_loss: bool,
             target_block_size: int = 0) -> Setup:
    runtime, heap_kept_free = runtime_bytes(cfg)
    gpu = resolve_accelerator(cfg) != "cpu"
    autocast = "mixed" in cfg.precision and (cfg.strategy not in SHARDED_STRATEGIES or (cfg.strategy == "fsdp" and gpu))
    return Setup(strategy=cfg.strategy, sharding_strategy=cfg.sharding_strategy, precision=cfg.precision,
                 world_size=world_size, devices_per_node=world_size // cfg.num_nodes,
                 micro_batch_size=cfg.micro_batch_size, block_size=block_size,
                 gradient_checkpointing=cfg.gradient_checkpointing, cpu_offload=cfg.cpu_offload,
                 checkpoint_every=cfg.gradient_checkpointing_every,
                 chunked_loss=chunked_loss, loss_kernel=cfg.loss_kernel, target_block_size=target_block_size,
                 attention=cfg.attn_implementation,
                 reduce_dtype=reduce_dtype(cfg.precision, cfg.reduce_dtype), gpu=gpu, autocast=autocast,
                 runtime=runtime, heap_kept_free=heap_kept_free, optimizer=cfg.optimizer,
                 unsharded_accumulation=cfg.strategy in SHARDED_STRATEGIES and cfg.fsdp_no_sync and accumulation > 1)


ENCODER_DECODER_ON_GPU = ("a T5 run on an H200 peaked at 1.30x what this planner plans for it (CUDA's reserved "
                          "memory, padded batches of sources; measured before autocast was measured, not since; "
                          "docs/performance.md#gpu-check), for a reason not yet found: keep that headroom")
"""Said with every GPU plan of an encoder-decoder until measured otherwise (a 1.5B Llama's peak: 1.05x its plan under
fsdp, 1.01x under fsdp2; a 355M GPT-2's, 1.03x what is planned for it since autocast is measured)."""


def report_total_gb(printed: str) -> Optional[float]:
    """The total in GB that a printed `memory_report` holds (console.format_gb: GB, or MB below 0.1 GB); None if
    `printed` holds none (benchmarks read their plans from train.py's output)."""
    total = re.search(r"^\s+total\s+([\d.]+) (GB|MB)$", printed, re.MULTILINE)
    return None if total is None else float(total.group(1)) / (1024 if total.group(2) == "MB" else 1)


def checkpointing_said(setup: Setup) -> str:
    if not setup.gradient_checkpointing:
        return "off"
    return "on" if setup.checkpoint_every == 1 else f"of 1 layer in {setup.checkpoint_every}"


def fit_advice(setup: Setup) -> str:
    """What could make a micro batch fit, of what the run does not do yet. On CPU the processes of a node share its
    memory, so only more nodes shard the state further, and offloading it to that memory frees nothing."""
    sharding = ["--strategy fsdp" if setup.strategy not in SHARDED_STRATEGIES else
                "--sharding_strategy FULL_SHARD" if setup.sharding_strategy != "FULL_SHARD" else "",
                "more devices" if setup.gpu else "more nodes"]
    untried = [advice for advice, tried in (("--gradient_checkpointing true", setup.gradient_checkpointing),
                                            ("--precision bf16-true", setup.precision == "bf16-true"),
                                            ("--cpu_offload true", setup.cpu_offload or not setup.gpu)) if not tried]
    options = [f"shard more ({', '.join(filter(None, sharding))})", *untried]
    return ", ".join(options[:-1]) + " or " + options[-1] if len(options) > 1 else options[0]


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
             f"device(s), {setup.precision}, activation checkpointing {checkpointing_said(setup)}"
             f"{', cpu offload' if setup.cpu_offload else ''}"
             f"{', unsharded gradient accumulation (--fsdp_no_sync)' if setup.unsharded_accumulation else ''}"
             f", {'chunked loss' if setup.chunked_loss else 'full logits'}"]
    lines += [f"  {name:<40} {format_gb(value / GB):>10}" for name, value in rows]
    lines.append(f"  device: {device_bytes / GB:.1f} GB ({source}); {'fits' if fits else 'does NOT fit'} "
                 f"with {1 - USABLE_FRACTION:.0%} kept free")
    if setup.cpu_offload:  # the device's share of the model state, held in the node's memory instead
        held = estimate_memory(shape, replace(setup, cpu_offload=False))
        host = (held.parameters + held.gradients + held.optimizer) * setup.devices_per_node
        lines.append(f"  host RAM for the offloaded state: {format_gb(host / GB)} per node ({setup.devices_per_node} "
                     "devices' parameters, gradients and optimizer state)")
    largest = largest_micro_batch(estimate, device_bytes)
    lines.append(f"  largest micro batch that fits: {largest}" if largest
                 else f"  no micro batch fits: {fit_advice(setup)}")
    if setup.gpu and shape.model_config.is_encoder_decoder:
        lines.append(f"  note: {ENCODER_DECODER_ON_GPU}")
    unmeasured = kept_by_body(shape, setup).autocast_unmeasured
    if unmeasured:
        lines.append(f"  note: the activations leave out what autocast keeps in fp32 (LayerNorm's input, GELU's pow: "
                     f"GPT-2's were 1.3x these on an H200), as {unmeasured}")
    return "\n".join(lines), fits
