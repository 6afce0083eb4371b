"""What a run measures about itself: throughput and MFU, peak memory, model-state memory, time lost to data and saves.

Nothing here synchronises the host with the device per micro-batch: timers read the host clock, memory peaks are
the allocator's (GPU) or the kernel's (CPU) high-water marks, and the numbers of all ranks travel in one
`all_gather` per log interval (`RankStats`).
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning_fabric.utilities.throughput import Throughput, measure_flops
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.utils.flop_counter import flop_registry, register_flop_formula

from app.distributed.precision import compute_dtype
from app.metrics.console import format_duration, format_gb
from app.metrics.peaks import peak_tflops
from app.model.build import meta_model
from app.model.isolation import EXPERT_COUNT_NAMES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GB = 1024**3
PEAK_MEMORY = ("peak_rss_gb", "peak_allocated_gb", "peak_reserved_gb")


def flops_per_micro_batch(model_config: PretrainedConfig, micro_batch_size: int, tokens: int, target_tokens: int = 0,
                          trust_remote_code: bool = False) -> int:
    """FLOPs of one forward and backward pass on one device, counted by torch's FlopCounter on a weightless model:
    `tokens` per sequence (the source of an encoder-decoder, whose decoder reads `target_tokens`).

    Counted without activation checkpointing, so that the recomputation does not count as useful work (MFU, not
    hardware FLOPs utilisation). The KV cache (no FLOPs) makes transformers skip its packed-sequence check, which
    reads tensor values that the meta device does not have; so does SDPA's mask in BART's decoder, so the count runs
    eager attention, whose matrix products are the ones SDPA's formula counts (the same totals for Llama, GPT-2, T5).
    """
    # Experts run through torch's grouped_mm, which on the meta device takes bfloat16 only
    dtype = torch.bfloat16 if has_experts(model_config) else None
    model = meta_model(model_config, trust_remote_code, attn_implementation="eager", dtype=dtype)
    input_ids = torch.zeros((micro_batch_size, tokens), dtype=torch.long, device="meta")
    labels = (torch.zeros((micro_batch_size, target_tokens), dtype=torch.long, device="meta") if target_tokens
              else input_ids)
    return measure_flops(model, lambda: model(input_ids=input_ids, labels=labels, use_cache=True),
                         lambda output: output.loss)


def has_experts(model_config: PretrainedConfig) -> bool:
    return any(isinstance(getattr(model_config, name, None), int) and getattr(model_config, name) > 1
               for name in EXPERT_COUNT_NAMES)


def grouped_mm_flops(a_shape: torch.Size, b_shape: torch.Size, *args: object, **kwargs: object) -> int:
    """FLOPs of torch's grouped matrix product (the experts of a mixture of experts, transformers' default for
    them), which torch's FlopCounter does not count: without it an MoE model's count failed and its runs had no
    MFU. Every row of `a` meets one group's matrix: a (tokens, in) x b (experts, in, out) in forward and for the
    input's gradient, a (in, tokens) x b (tokens, out) for the weights' gradient, batched 3-D x 3-D alike."""
    return 2 * math.prod(a_shape) * b_shape[-1]


if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_registry:
    register_flop_formula(torch.ops.aten._grouped_mm)(grouped_mm_flops)


def peak_flops(device: torch.device, precision: str, override_tflops: Optional[float] = None) -> Optional[int]:
    """The device's dense peak FLOP/s for the compute dtype: --peak_tflops, else app/metrics/peaks.py's table; None
    on CPUs and chips it does not list (no MFU then)."""
    if override_tflops is not None:
        return int(override_tflops * 1e12)
    if device.type != "cuda":
        return None
    listed = peak_tflops(torch.cuda.get_device_name(device), compute_dtype(precision),
                         torch.get_float32_matmul_precision())
    return int(listed * 1e12) if listed else None


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """This process's memory high-water marks: host RSS always, and the CUDA caching allocator's on a GPU."""
    peaks = {"peak_rss_gb": peak_rss_bytes() / GB}
    if device.type == "cuda":
        peaks["peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / GB
        peaks["peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / GB
    return peaks


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM, which starts afresh with the program. getrusage's
    ru_maxrss survives execve, so a rank started by a large process (a notebook, a benchmark holding a model, or
    Lightning's launching rank) would report that process's peak as its own."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind the tensors: FSDP's parameters and gradients are views of flat shards,
    FSDP2's are DTensors whose local part is the rank's (padded) shard."""
    sizes = {}
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if tensor is not None and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            sizes[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


def held_gradients(model: Module) -> Iterator[Optional[torch.Tensor]]:
    """The gradients a model holds: its parameters', and FSDP2's unsharded ones between micro-batches under
    --fsdp_no_sync, on tensors of their own (in the reduce dtype when it differs: fp32 under bf16-mixed), the sharded
    parameters' `.grad` empty until the reduce-scatter; the run's report counted only the shard. torch's private
    `_fsdp_param.py` attributes, read where they exist."""
    yield from (parameter.grad for parameter in model.parameters())
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for group in filter(None, groups):
            for fsdp_param in group.fsdp_params:
                yield getattr(fsdp_param, "unsharded_accumulated_grad", None)
                yield getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)


@dataclass
class ModelStateMemory:
    """Bytes this rank holds for parameters, gradients and optimizer state, read during the first optimizer step.

    Gradients are read twice, and the larger count kept: between the first two micro-batches (what accumulation
    holds: a shard, or the whole unsharded gradient with --fsdp_no_sync) and just before the optimizer step.
    """

    parameters: float = math.nan
    gradients: float = math.nan
    optimizer: float = math.nan
    training_forwards: int = 0

    def watch(self, model: Module, optimizer: torch.optim.Optimizer) -> None:
        """Measure once, around the first step: gradients exist before the second micro-batch and before the
        optimizer step, optimizer state just after it."""

        def count_gradients() -> None:
            measured = storage_bytes(held_gradients(model))
            self.gradients = measured if math.isnan(self.gradients) else max(self.gradients, measured)

        def before_forward(module: Module, args: Any) -> None:
            if module.training:
                self.training_forwards += 1
                if self.training_forwards == 2:
                    count_gradients()
                    forward_hook.remove()

        def before_step(*_) -> None:
            self.parameters = storage_bytes(model.parameters())
            count_gradients()
            pre_hook.remove()

        def after_step(*_) -> None:
            self.optimizer = storage_bytes(t for s in optimizer.state.values() for t in s.values()
                                           if isinstance(t, torch.Tensor))
            post_hook.remove()

        forward_hook = model.register_forward_pre_hook(before_forward)
        pre_hook = optimizer.register_step_pre_hook(before_step)
        post_hook = optimizer.register_step_post_hook(after_step)


@dataclass
class Stopwatch:
    """Seconds spent inside `measure()` blocks: the last one, and the sum; `count` of them, but for those that
    finish what a counted one began (`counted=False`: the wait for the last background save)."""

    total: float = 0.0
    last: float = 0.0
    count: int = 0

    @contextmanager
    def measure(self, counted: bool = True) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.last = time.perf_counter() - start
            self.total += self.last
            self.count += counted


@dataclass
class RankStats:
    """The per-rank numbers that are gathered together: one float each, so they travel as one tensor."""

    data_wait_sec: float = 0.0
    peak_rss_gb: float = math.nan
    peak_allocated_gb: float = math.nan
    peak_reserved_gb: float = math.nan
    parameters_gb: float = math.nan
    gradients_gb: float = math.nan
    optimizer_gb: float = math.nan

    @classmethod
    def of_this_rank(cls, device: torch.device, data_wait: Stopwatch, state: ModelStateMemory) -> "RankStats":
        return cls(data_wait_sec=data_wait.total, **peak_memory_gb(device),
                   parameters_gb=state.parameters / GB, gradients_gb=state.gradients / GB,
                   optimizer_gb=state.optimizer / GB)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> "RankStats":
        return cls(*values.tolist())


def gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `local` as one row each, in rank order. torch's own all_gather rather than Fabric's, which
    goes through the autograd-aware torch.distributed.nn gather that torch 2.13 deprecates (a warning on every rank
    of every run; these numbers need no gradient)."""
    if not (dist.is_available() and dist.is_initialized()):
        return local.unsqueeze(0)
    rows = local.new_empty(dist.get_world_size(), local.numel())
    dist.all_gather(list(rows.unbind()), local)
    return rows


def largest(ranks: list[RankStats], name: str) -> float:
    values = [getattr(r, name) for r in ranks if not math.isnan(getattr(r, name))]
    return max(values) if values else math.nan


@dataclass
class StepClock:
    """Elapsed time, throughput and MFU (Lightning's Throughput over the last log interval), and the ETA."""

    start_step: int
    max_step: int
    window: int
    world_size: int
    samples_per_step: int
    tokens_per_step: int
    flops_per_step: Optional[int] = None
    """FLOPs of one optimizer step on one device; None when they could not be counted."""
    available_flops: Optional[int] = None
    started: float = field(default_factory=time.perf_counter)
    between_steps: tuple[Stopwatch, ...] = ()
    """What runs between steps and is no training (evaluation, saving): throughput leaves its time out, as the run
    summary does, so that a log interval holding an evaluation does not show a slower training."""

    first_step: Optional[tuple[int, float]] = None
    """The step the clock first ticked for and the seconds elapsed then: the ETA counts from there."""
    elapsed_before: float = 0.0
    """The run's seconds up to the checkpoint this attempt resumed from (the abandoned stretch after it not counted,
    as metrics.csv drops its rows): the logged elapsed_sec continues from there instead of starting again at 0."""

    def __post_init__(self) -> None:
        self.throughput = Throughput(available_flops=self.available_flops, world_size=self.world_size,
                                     window_size=self.window + 1)
        self._update(self.start_step, flops=0 if self.flops_per_step else None)

    def _update(self, step: int, flops: Optional[int]) -> None:
        done = step - self.start_step
        per_device = self.samples_per_step // self.world_size
        self.throughput.update(time=self.training_time(), batches=done, samples=done * per_device,
                               lengths=max(done * per_device, round(done * self.tokens_per_step / self.world_size)),
                               flops=flops)

    def elapsed(self) -> float:
        """This attempt's seconds."""
        return time.perf_counter() - self.started

    def run_elapsed(self) -> float:
        """The run's seconds, over every attempt that led to this one."""
        return self.elapsed_before + self.elapsed()

    def training_time(self, elapsed: Optional[float] = None) -> float:
        """This attempt's seconds but those between steps; of `elapsed` where given (read once: train_sec, eval_sec
        and save_sec then add up to elapsed_sec exactly, where two reads of the clock differed by microseconds)."""
        return (self.elapsed() if elapsed is None else elapsed) - sum(watch.total for watch in self.between_steps)

    def rewind(self, steps: int) -> None:
        """The step counter went back `steps` (a rollback): the steps done since the start still count."""
        self.start_step -= steps
        if self.first_step is not None:
            self.first_step = (self.first_step[0] - steps, self.first_step[1])

    def tick(self, step: int) -> dict[str, float]:
        """Record a finished step; returns the throughput of the last window of steps, or of every step since the
        start before a window has been timed (a row logged after fewer than --log_interval steps since a start or
        a resume had none)."""
        self._update(step, flops=self.flops_per_step)
        if self.first_step is None:
            self.first_step = (step, self.elapsed())
        measured = self.throughput.compute()
        if "device/items_per_sec" not in measured:
            return self.rates(step - self.start_step, self.training_time())
        per_device = measured["device/items_per_sec"]
        metrics = {
            "tokens_per_sec": per_device * self.world_size,
            "samples_per_sec": measured["device/samples_per_sec"] * self.world_size,
            "tokens_per_sec_per_device": per_device,
        }
        if "device/flops_per_sec" in measured:
            metrics["tflops_per_sec_per_device"] = measured["device/flops_per_sec"] / 1e12
        if "device/mfu" in measured:
            metrics["mfu"] = measured["device/mfu"]
        return metrics

    def rates(self, steps: int, seconds: float) -> dict[str, float]:
        """Throughput, FLOP/s and MFU of `steps` steps trained in `seconds`."""
        if steps <= 0 or seconds <= 0:
            return {}
        tokens_per_sec = self.tokens_per_step * steps / seconds
        rates = {"tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": tokens_per_sec / self.world_size,
                 "samples_per_sec": self.samples_per_step * steps / seconds}
        if self.flops_per_step:
            rates["tflops_per_sec_per_device"] = self.flops_per_step * steps / seconds / 1e12
        if self.flops_per_step and self.available_flops:
            rates["mfu"] = self.flops_per_step * steps / seconds / self.available_flops
        return rates

    def eta(self, step: int) -> float:
        """The seconds left at the pace since the first step: what only the start pays (compiling the model, the
        initial validation, the loader's first rows, CUDA's autotuning) is left out, as with --compile it made the
        early ETAs many times too long. Evaluations and saves recur, so their time stays in."""
        if self.first_step is not None and step > self.first_step[0]:
            first, at = self.first_step
            return (self.elapsed() - at) / (step - first) * (self.max_step - step)
        done = step - self.start_step
        return self.elapsed() / done * (self.max_step - step) if done else math.nan


def run_summary(*, clock: StepClock, step: int, evaluation: Stopwatch, saving: Stopwatch, ranks: list[RankStats],
                val_loss: Optional[float], val_loss_step: Optional[int]) -> dict[str, Any]:
    """The numbers of one run (this attempt, when resumed). Throughput counts training time only: evaluation and
    checkpoint saves are reported separately, so that the figures compare across eval and save intervals."""
    steps, elapsed = step - clock.start_step, clock.elapsed()
    train_sec = clock.training_time(elapsed)
    summary: dict[str, Any] = {"steps": steps, "last_step": step, "elapsed_sec": elapsed, "train_sec": train_sec,
                               "eval_sec": evaluation.total, "checkpoints_saved": saving.count,
                               "save_sec": saving.total, "val_loss": val_loss, "val_loss_step": val_loss_step}
    if steps:
        summary |= {"step_sec": train_sec / steps, **clock.rates(steps, train_sec),
                    "data_wait_pct": 100 * max(r.data_wait_sec for r in ranks) / train_sec}
    memory = [{k: v for k, v in asdict(r).items() if not k.endswith("_sec") and not math.isnan(v)} for r in ranks]
    return summary | {"ranks": memory}


def validation_part(s: dict[str, Any]) -> str:
    """The last validation loss and the step it is from (a stopped run's may be long ago; a checkpoint written before
    val_loss_step records none)."""
    if s["val_loss"] is None:
        return ""
    at = f" at step {s['val_loss_step']}" if s.get("val_loss_step") is not None else " (the step is not recorded)"
    return f", val_loss {s['val_loss']:.4f}{at}"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    s = summary
    lines = [f"summary: {s['steps']} steps in {format_duration(s['elapsed_sec'])} (training "
             f"{format_duration(s['train_sec'])}, evaluation {format_duration(s['eval_sec'])}, "
             f"checkpoints {format_duration(s['save_sec'])} for {s['checkpoints_saved']} saved"
             + (f", tracing {format_duration(s['trace_sec'])})" if "trace_sec" in s else ")") + validation_part(s)]
    if not s["steps"] and not s["checkpoints_saved"] and s["eval_sec"]:  # --eval_only
        lines = [f"summary: evaluated in {format_duration(s['eval_sec'])}" + validation_part(s)]
    if s["steps"]:
        speed = (f"  throughput: {s['tokens_per_sec']:,.0f} tokens/s ({s['tokens_per_sec_per_device']:,.0f} per "
                 f"device), {s['step_sec']:.3f} s per step, data wait {s['data_wait_pct']:.1f}% of training time")
        if "tflops_per_sec_per_device" in s:
            speed += f", {s['tflops_per_sec_per_device']:.2f} TFLOP/s per device"
        lines.append(speed + (f", MFU {s['mfu']:.1%}" if "mfu" in s else ""))
    if "spike_guard" in s:
        guard = s["spike_guard"]
        lines.append(f"  spike guard: {guard['spikes']} spikes, {guard['skipped_steps']} steps not applied, "
                     f"{guard['rollbacks']} rollbacks, {guard['quarantined_rows']} train rows set aside")
    if s.get("scaler_skipped_steps"):
        lines.append(f"  gradient scaler: {s['scaler_skipped_steps']} of the steps not applied (fp16 gradients "
                     "overflowed; their data and learning rate were spent)")
    if "tokens_by_source" in s:
        total = sum(s["tokens_by_source"].values()) or 1
        lines.append("  trained tokens by source: " + ", ".join(
            f"{name.removeprefix('tokens/')} {tokens:,} ({tokens / total:.1%})"
            for name, tokens in s["tokens_by_source"].items()))
    for rank, memory in enumerate(s["ranks"]):
        lines.append(f"  rank {rank} memory: " + ", ".join(f"{k.removesuffix('_gb').replace('_', ' ')} "
                                                          f"{format_gb(v)}" for k, v in memory.items()))
    return lines
