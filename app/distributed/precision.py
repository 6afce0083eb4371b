"""Every decision --precision implies, in one place: dtypes, the Lightning precision plugin, FSDP's mixed-precision
policy, the gradient scaler, TF32, and whether the GPU supports the choice at all.

What each precision means here:

| --precision | weights and AdamW state | matmuls | gradients reduced in (FSDP, default) | scaler |
| --- | --- | --- | --- | --- |
| 32-true | fp32 | fp32 (TF32 on Ampere+ unless --tf32 false) | fp32 | no |
| bf16-mixed | fp32 | bf16 | fp32 (--reduce_dtype bfloat16 halves the traffic) | no |
| bf16-true | bf16 | bf16 | bf16 | no |
| 16-mixed | fp32 | fp16 | fp32 | yes: loss scaling, AdamW not fused |

16-true (weights and AdamW state in fp16) is not offered: AdamW's second moment, the squared gradient, is 0 in fp16
for every gradient below ~2.4e-4, most of an LLM's, and the bias correction then grows those updates with the square
root of the step (a 2-layer Llama's loss rose 6.0 -> 21.6 in 4 steps, nothing non-finite to stop it).

Buffers keep the dtype the model gives them (FSDP's `buffer_dtype` is left unset), and the rotary frequencies are
recomputed in fp32 after set-up (`app.model.build.keep_rotary_in_fp32`): in bf16 their ~0.3% error becomes radians of
phase error at positions in the thousands.
"""

from __future__ import annotations

import re
import warnings
from typing import Optional

import torch
from lightning_fabric.plugins import FSDPPrecision, HalfPrecision, MixedPrecision, Precision
from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision

from app.choices import SHARDED_STRATEGIES

WEIGHT_DTYPES = {"bf16-true": torch.bfloat16}
COMPUTE_DTYPES = {"bf16-true": torch.bfloat16, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AMPERE = (8, 0)


def weights_dtype(precision: str) -> torch.dtype:
    """The dtype the weights are stored in: half for *-true, fp32 master weights for mixed precision and 32-true."""
    return WEIGHT_DTYPES.get(precision, torch.float32)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matrix multiplications run in, which sets the device's peak FLOP/s."""
    return COMPUTE_DTYPES.get(precision, torch.float32)


def uses_grad_scaler(precision: str) -> bool:
    """fp16's narrow range needs loss scaling; bf16 and fp32 do not."""
    return precision == "16-mixed"


def restore_grad_scaler(plugin: Precision, saved: dict) -> None:
    """The gradient scaler's scale and growth tracker as a checkpoint (`saved`) holds them, by a resume or a
    rollback; nothing where the run that saved it had no scaler (a precision other than 16-mixed)."""
    if saved.get("grad_scaler"):
        plugin.load_state_dict(saved["grad_scaler"])


def reduce_dtype(precision: str, requested: Optional[str]) -> torch.dtype:
    """Gradients are reduced in fp32 under mixed precision (as torchtitan does), in the weights' dtype otherwise."""
    if requested is not None:
        return DTYPE_NAMES[requested]
    return torch.float32 if "mixed" in precision else weights_dtype(precision)


def fsdp_mixed_precision(precision: str, requested_reduce_dtype: Optional[str]) -> FSDPMixedPrecision:
    """FSDP's policy: parameters gathered in the compute dtype, gradients reduced in `reduce_dtype`, buffers left in
    the dtype the model built them in (Lightning's default casts them, rotary frequencies included, to bf16)."""
    return FSDPMixedPrecision(param_dtype=compute_dtype(precision),
                              reduce_dtype=reduce_dtype(precision, requested_reduce_dtype), buffer_dtype=None)


def precision_plugin(precision: str, strategy: str, device_type: str) -> Precision:
    """Lightning's plugin for `precision`, built here rather than by Lightning's connector because the connector
    silently turns 16-mixed into bf16-mixed on CPU and gives FSDP a CUDA-only scaler: the CPU tests would then not run
    the code a GPU runs. Under FSDP2 mixed precision is its MixedPrecisionPolicy (app/distributed/fsdp2.py), so no
    autocast."""
    if strategy == "fsdp2" and "mixed" in precision:
        return Precision()
    if strategy == "fsdp":
        if device_type == "cpu":  # its forward's autocast is CUDA's, off on CPU processes (FSDP's MixedPrecision casts)
            warnings.filterwarnings("ignore", message="CUDA is not available or torch_xla is imported")
        with warnings.catch_warnings():  # its default scaler is CUDA's, disabled with a warning on CPU; replaced below
            warnings.filterwarnings("ignore", message=".*GradScaler is enabled, but CUDA is not available")
            plugin = FSDPPrecision(precision)
        if uses_grad_scaler(precision):
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            plugin.scaler = ShardedGradScaler(device=device_type)
        return plugin
    if "mixed" in precision:
        scaler = torch.amp.GradScaler(device=device_type) if uses_grad_scaler(precision) else None
        return MixedPrecision(precision, device=device_type, scaler=scaler)
    if precision in WEIGHT_DTYPES:
        return HalfPrecision(precision)
    return Precision()


def float32_matmul_precision(precision: str, tf32: bool, capability: Optional[tuple[int, int]]) -> str:
    """torch's setting for fp32 matmuls: TF32 tensor cores ("high") for 32-true on Ampere and newer GPUs unless
    --tf32 false. The other precisions multiply in 16 bits, CPUs have no TF32, so they keep "highest"."""
    if precision == "32-true" and tf32 and capability is not None and capability >= AMPERE:
        return "high"
    return "highest"


def kept_in_fp32_units(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[str]]:
    """The modules that hold only parameters transformers keeps in float32 under bfloat16
    (`_keep_in_fp32_modules_strict`: Ernie's router `gate`), outermost first, and the kept parameters no such module
    holds (an attention's `sinks`, beside its bf16 projections).

    FSDP gives each module of the first list a unit of its own whose mixed precision casts nothing, so that under
    bf16-mixed it computes in float32 beside bf16 units, as transformers loads such a model in bfloat16: these modules
    take bf16 inputs and compute in float32 themselves. FSDP cannot keep the second list's parameters apart."""
    strict = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    if not strict:
        return [], []
    pattern = re.compile("|".join(rf"(^|\.){re.escape(name)}($|\.)" for name in strict))
    kept = {name for name, _ in model.named_parameters() if pattern.search(name)}
    units, covered = [], set()
    for prefix, module in model.named_modules():
        names = {f"{prefix}.{name}" if prefix else name for name, _ in module.named_parameters()}
        if names and names <= kept and not names <= covered:
            units.append(module)
            covered |= names
    return units, sorted(kept - covered)


def fp32_modules_problem(precision: str, model: torch.nn.Module, strategy: str = "fsdp") -> Optional[str]:
    """Modules transformers keeps in float32 when it loads a model in 16 bits, which this run would cast down.

    Under fp16 both its lists count (T5's feed-forward output `wo`, `_keep_in_fp32_modules`): 16-mixed's autocast
    overflows there, and the run would stop at its first non-finite loss. Under bf16-true only the
    strict list counts (`_keep_in_fp32_modules_strict`, kept in float32 under bfloat16 too: DeepSeek-V3's and GLM-4's
    router bias `e_score_correction_bias`, Ernie's gate): rounded to bfloat16 they route tokens to other experts than
    the model was trained with, with no error to show it. bf16-mixed keeps every weight in float32; FSDP's mixed
    precision (fsdp's and fsdp2's) gathers them for the forward in bfloat16 (a router bias of 1.0068 was used as
    1.0078) but for the units of their own that `kept_in_fp32_units` finds: a kept parameter beside others in one
    module (an attention's `sinks`) is still refused under FSDP. Autocast (ddp, one device) leaves them in float32.
    Buffers (DeepSeek-V3's bias) are not cast."""
    strict = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if precision == "16-mixed":
        kept = set(getattr(model, "_keep_in_fp32_modules", None) or []) | strict
        if kept:
            return (f"--precision {precision}: {type(model).__name__} keeps {', '.join(sorted(kept))} in float32 "
                    "under float16 (transformers' _keep_in_fp32_modules), which 16-bit training would cast down and "
                    "overflow; use --precision 32-true, or bf16-mixed on a GPU with bfloat16 (Ampere or newer)")
    _, apart = kept_in_fp32_units(model)
    sharded = strategy in SHARDED_STRATEGIES and apart  # FSDP gathers them in bfloat16 under bf16-mixed too
    if precision == "bf16-true" and strict:
        return (f"--precision bf16-true: {type(model).__name__} keeps {', '.join(sorted(strict))} in float32 also "
                "under bfloat16 (transformers' _keep_in_fp32_modules_strict), which bf16-true would round to "
                "bfloat16 (a rounded router bias sends tokens to other experts); use "
                + ("--precision bf16-mixed with --strategy ddp, or --precision 32-true" if sharded
                   else "--precision bf16-mixed"))
    if precision == "bf16-mixed" and sharded:
        return (f"--precision bf16-mixed --strategy {strategy}: {type(model).__name__} keeps {', '.join(apart)} in "
                "float32 (transformers' _keep_in_fp32_modules_strict) in modules beside bf16 weights, which FSDP's "
                "mixed precision gathers in bfloat16 for the forward (a rounded router sends tokens to other experts); "
                "use --strategy ddp, whose autocast keeps them, or --precision 32-true")
    return None


BF16_LOST_BELOW = 2.0 ** -9
"""bf16 keeps 8 significant bits: an update below half the spacing of bf16 numbers at a weight, |w| x 2^-9 at
least, is rounded away."""
TYPICAL_WEIGHT = 0.02
"""The spread LLMs are initialised with (Llama, GPT-2, T5's `initializer_range`); trained weights stay near it."""
NORM_GAIN = 1.0
"""What RMSNorm and LayerNorm gains start at, and stay near."""
BF16_MOMENT_DECAY = 2.0 ** -8
"""The smallest relative decrease bf16 keeps for every value (the spacing is 2^-8 to 2^-7 of a value, half of it is
rounded away)."""


def bf16_rounding_note(precision: str, lr: float, weight_decay: float = 0.0,
                       stochastic_rounding: bool = False, optimizer: str = "adamw") -> Optional[str]:
    """Under bf16-true the weights themselves are bf16, with no fp32 master copy: AdamW moves a weight by about lr per
    step, which is rounded away on every weight above lr x 2^9 in magnitude. At a fine-tune's lr of 2e-5 that is every
    weight above 0.01, most of an LLM's: they stop learning with nothing to show it but a loss that plateaus early.
    Below lr 2e-3 the norm layers' gains (1.0 at the start) never move at all (100% of them unchanged after 4 steps
    at lr 1e-3, measured), and weight decay shrinks a weight by lr x weight_decay of itself, below bf16's
    resolution at any usual lr. A note, not a refusal: it is a trade of accuracy for memory users make knowingly
    (seed 001's default). None with --stochastic_rounding, which moves such weights by their steps on average;
    under --optimizer muon, which it does not step, only bf16-mixed is advised (Muon's steps, scaled to AdamW's
    size, are rounded alike)."""
    if precision != "bf16-true" or stochastic_rounding:
        return None
    threshold = lr / BF16_LOST_BELOW
    lost = []
    if threshold < TYPICAL_WEIGHT:
        lost.append(f"every weight above {threshold:.1e} in magnitude (LLM weights are ~{TYPICAL_WEIGHT:g})")
    elif threshold < NORM_GAIN:
        lost.append(f"the norm layers' gains (~{NORM_GAIN:g}; every weight above {threshold:.1e})")
    if weight_decay and lr * weight_decay < BF16_LOST_BELOW:
        lost.append(f"--weight_decay {weight_decay:g} (a relative shrink of {lr * weight_decay:.0e} per step)")
    if not lost:
        return None
    steps, remedies = ("Muon's and AdamW's steps", "") if optimizer == "muon" else (
        "AdamW's steps", "--stochastic_rounding true moves them by their steps on average for no memory, and ")
    return (f"note: --precision bf16-true with --lr {lr:g}: bf16 keeps 8 significant bits, and {steps} are "
            f"rounded away on {' and on '.join(lost)}, more as lr decays; {remedies}--precision bf16-mixed keeps fp32 "
            "master weights (twice the training state: --estimate_memory true shows whether it fits)")


def offloaded_rounding_note(stochastic_rounding: bool, cpu_offload: bool) -> Optional[str]:
    """--cpu_offload moves the optimizer step to the CPU, where --stochastic_rounding's AdamW (elementwise passes and
    a random number per weight) took 27x torch's fused AdamW (benchmarks/bench_optimizer.py): a slow step, said."""
    if not (stochastic_rounding and cpu_offload):
        return None
    return ("note: --stochastic_rounding with --cpu_offload: the optimizer steps on the CPU, where its AdamW took 27x "
            "torch's fused one (0.9 s per 50M weights on 2 cores, docs/training.md#precision); without --cpu_offload "
            "it steps on the GPU")


def bf16_moment_problem(precision: str, beta2: float, stochastic_rounding: bool = False) -> Optional[str]:
    """AdamW's second moment is kept in the weights' dtype: under bf16-true, beta2 x v differs from v by (1 - beta2) of
    it, and below about 2^-8 that is rounded away: v can grow but never decrease, so after a burst of large
    gradients (the first steps, a spike) the steps of those weights stay small for good (14x too small after 20
    steps of gradient 1 then 0.01 at --beta2 0.999, measured with this project's optimizer). Refused, not noted:
    0.999 is torch's and transformers' default, which users copy. None with --stochastic_rounding, whose AdamW
    rounds v stochastically: it decreases by its share on average."""
    if precision != "bf16-true" or 1 - beta2 >= BF16_MOMENT_DECAY or stochastic_rounding:
        return None
    return (f"--beta2 {beta2:g} under --precision bf16-true: AdamW's second moment is stored in bf16, where "
            f"{beta2:g} x v rounds back to v, so it can never decrease after a large gradient; use --beta2 0.99 or "
            "lower (0.95, the default), --stochastic_rounding true, or --precision bf16-mixed")


def bf16_support_problem(precision: str, device_name: str, capability: tuple[int, int]) -> Optional[str]:
    """Seed 002's readiness check: bf16 needs Ampere (compute capability 8.0) or newer; V100 and T4 only emulate it."""
    if "bf16" not in precision or capability >= AMPERE:
        return None
    major, minor = capability
    return (f"--precision {precision} needs bfloat16 support (compute capability 8.0+, Ampere or newer), but this "
            f"{device_name} has {major}.{minor}: use --precision 16-mixed")
