"""What backward keeps of one sequence, measured on the weightless model: the memory planner's activations.

A forward of the run's model on the meta device (shapes and dtypes only: no memory, no arithmetic) under autograd's
saved-tensor hooks adds up the bytes of every storage autograd keeps for backward, parameters excluded, and notes
which wrapped layer kept it and what each layer was given. Measured rather than written down per architecture:
Llama's gated MLP and its RMSNorms in fp32, GPT-2's GELU and LayerNorm, T5's and BART's encoders at the source
length and decoders at the target length with their cross-attention, dropout masks, rotary copies: each model's own
code says what it keeps, and a model added later is planned without a new formula. The output layer and the loss are
the loss path's (app/model/loss.py), counted by the planner.

The peak comes early in backward: what forward kept, plus the gradients of one layer's activations while that layer
is differentiated (as large as what the layer kept, at most). With activation checkpointing forward keeps each
layer's inputs, and backward recomputes one layer at a time before differentiating it.

One stand-in: on the meta device SDPA always takes its math path, which keeps the attention matrix. Where the run's
kernel is fused (FlashAttention or memory-efficient attention on GPUs, the flash kernel on CPU), it keeps queries,
keys, values, the output (laid out as the kernel lays it out, which decides whether the output projection's input is
the same storage or a copy) and one fp32 log-sum-exp per head and query, and `FusedAttention` stands for it. A
kernel is fused unless the mask needs gradients (T5's relative position bias), keys have fewer heads than queries
without `enable_gqa` (Falcon's multi-query attention broadcasts one) or, on CPU, attention dropout is on (GPT-2's
and T5's 0.1 by default): then SDPA takes the math path in the run as here. With --attn_implementation eager the
model computes the matrix itself, as measured.

A run whose forward runs under autocast (Lightning's precision plugins: FSDP1 under *-mixed on GPUs, DDP and one
device under *-mixed) keeps what autocast makes: on a GPU LayerNorm's fp32 copy of its input, GPT-2's GELU in fp32
(`pow` is on CUDA's fp32 list), one-byte dropout masks; with fp32 weights a residual stream in fp32. Meta tensors
have no autocast, so that forward runs on fake tensors of the run's device (torch's FakeTensorMode: shapes and
dtypes, no memory), through torch's own autocast kernels. Measured on a GPT-2 of 355M on an H200 (gpu_check.py),
the plan without it was 1.30x short of CUDA's peak. A fake CUDA device needs a torch built with CUDA (any GPU
machine's, not necessarily with a GPU); torch's CPU-only build records a CUDA stream for every tensor autograd
sees and aborts, so there a GPU run's autocast is not measured.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, UnsupportedOperatorException)
from torch.nn import Module, Parameter
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface


PLANNED_SDPA = "planned_sdpa"
"""transformers' SDPA attention without a mask: causal attention then runs SDPA with is_causal, as a training run's
unpadded rows do; transformers' own masks look at values, which meta tensors do not have."""
AttentionInterface.register(PLANNED_SDPA, sdpa_attention_forward)
AttentionMaskInterface.register(PLANNED_SDPA, lambda *args, **kwargs: None)


@dataclass(frozen=True)
class KeptForBackward:
    """Bytes of one sequence's activations that backward needs, by where forward kept them."""

    layers: tuple[int, ...]
    """Kept inside each wrapped layer (decoder layers, T5's and BART's encoder and decoder blocks), in order."""
    layer_inputs: tuple[int, ...]
    """What each wrapped layer is given (inputs shared by layers counted once): all activation checkpointing keeps
    of a layer."""
    outside: int
    """Kept outside the wrapped layers: embeddings, positions, final norms."""
    weight_copies: int = 0
    """The compute-dtype copies autocast makes of fp32 weights, kept from forward to backward: once, whatever the
    micro batch."""
    autocast_unmeasured: str = ""
    """Why autocast, asked for, is not in the figures (measured without it); empty when it is or was not asked."""

    def scaled(self, factor: float) -> "KeptForBackward":
        """The figures of the same forward in a dtype `factor` times as large."""
        return KeptForBackward(layers=tuple(round(b * factor) for b in self.layers),
                               layer_inputs=tuple(round(b * factor) for b in self.layer_inputs),
                               outside=round(self.outside * factor), weight_copies=round(self.weight_copies * factor),
                               autocast_unmeasured=self.autocast_unmeasured)

    def peak(self, checkpoint_every: int) -> int:
        """At the peak of backward, with activation checkpointing of one layer in every `checkpoint_every` from the
        first (0: none): the most that is live as backward reaches a layer, from the last to the first, and the
        gradients of a layer's activations. There the layers before it keep what forward left (a recomputed
        layer its inputs alone), the layers after it have been freed, and it holds all its activations, kept or
        computed again. Under one layer in two the last layer's are the most (the recomputed one before it comes
        once they are freed): counting a recomputed layer on top of everything forward kept, the plan was 1.19x
        the measured peak (docs/performance.md#activation-checkpointing-of-one-layer-in-two)."""
        before = highest = 0
        for index, (kept, inputs) in enumerate(zip(self.layers, self.layer_inputs)):
            highest = max(highest, before + kept)
            before += inputs if checkpoint_every and index % checkpoint_every == 0 else kept
        return highest + self.outside + max(self.layers, default=0)


def kept_for_backward(model: Module, wrap_classes: set[type[Module]], tokens: int, target_tokens: int,
                      dtype: torch.dtype, attention: str, gpu: bool,
                      autocast: Optional[torch.dtype] = None) -> KeptForBackward:
    """One sequence of `tokens` (a seq2seq model's source; `target_tokens` its target) through `model`, changed in
    place: cast to `dtype` (the weights' during forward), in training mode, its attention as a `gpu` or a CPU
    computes it, under the device's autocast to `autocast` if given. A meta model for the planner (on fake tensors of
    the run's device under autocast); on a real device (the tests) the same count runs the real kernels."""
    weightless = next(model.parameters()).device.type == "meta"
    unmeasured = ""
    if weightless and autocast is not None and gpu and not torch.backends.cuda.is_built():
        dtype, autocast, unmeasured = autocast, None, NO_CUDA_TO_MEASURE_WITH  # as FSDP gathers the weights
    model.to(dtype).train()
    model.set_attn_implementation("eager" if attention == "eager" else PLANNED_SDPA)
    device_type = "cuda" if gpu else "cpu"
    fakes = weightless and autocast is not None
    fake_device = _on_fake_device(model, device_type) if fakes else nullcontext()
    tally = _Tally({_storage(parameter) for parameter in model.parameters()})
    layers = [module for module in model.modules() if type(module) in wrap_classes]
    handles = [handle for index, layer in enumerate(layers) for handle in tally.watch(layer, index)]
    try:
        with fake_device, _EveryLayerKept() if weightless else nullcontext(), \
                _autocast(device_type, autocast) if autocast else nullcontext(), \
                torch.autograd.graph.saved_tensors_hooks(tally.pack, _unpack), \
                FusedAttention(gpu) if attention != "eager" and weightless else nullcontext():
            _forward(model, tokens, target_tokens, next(model.parameters()).device)
    finally:
        for handle in handles:
            handle.remove()
    return KeptForBackward(layers=tuple(tally.kept.get(index, 0) for index in range(len(layers))),
                           layer_inputs=tuple(tally.inputs.get(index, 0) for index in range(len(layers))),
                           outside=tally.kept.get(None, 0), weight_copies=tally.weight_copies,
                           autocast_unmeasured=unmeasured)


NO_CUDA_TO_MEASURE_WITH = "this torch is built without CUDA, whose autocast the planner runs on fake CUDA tensors"
READS_VALUES = "this model's forward reads values that the planner's shape-only tensors do not have"
FAKE_TENSOR_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
"""What a forward that reads tensors' values, or an operator without a shape-only kernel, raises on fake tensors."""


def _on_fake_device(model: Module, device_type: str) -> FakeTensorMode:
    """The meta model's parameters and buffers replaced by fake tensors of `device_type`, and the mode their
    operations run in (new tensors, the inputs, are made fake too)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    for module in model.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None:
                module._parameters[name] = Parameter(FakeTensor(mode, parameter.data, device),
                                                     parameter.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = FakeTensor(mode, buffer, device)
    return mode


@contextmanager
def _autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """torch.autocast without its check for a GPU, which turns CUDA's off on a machine without one (the planner's
    fake CUDA tensors need none)."""
    enabled, previous = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, previous)


def _forward(model: Module, tokens: int, target_tokens: int, device: torch.device) -> None:
    """Up to the last hidden states. With the model's key-value cache (no memory on the meta device) transformers
    does not look for packed sequences in the positions' values, which meta tensors do not have."""
    source = torch.zeros(1, tokens, dtype=torch.long, device=device)
    if not model.config.is_encoder_decoder:
        model.base_model(input_ids=source, use_cache=True)
        return
    encoded = model.get_encoder()(input_ids=source).last_hidden_state
    target = torch.zeros(1, target_tokens, dtype=torch.long, device=device)
    model.get_decoder()(input_ids=target, encoder_hidden_states=encoded, use_cache=True)


def _storage(tensor: Tensor) -> int:
    """The identity of the storage behind a tensor (its views share it); meta tensors have no data pointer."""
    return tensor.untyped_storage()._cdata


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


VIEW_NODES = {"TBackward0", "PermuteBackward0", "TransposeBackward0", "ViewBackward0", "ExpandBackward0",
              "UnsqueezeBackward0", "SqueezeBackward0", "AliasBackward0"}
"""autograd's nodes of views: one input, the same storage."""


def _weight_cast(tensor: Tensor) -> bool:
    """Whether `tensor` is autocast's copy of a weight or of a view of one (Falcon multiplies by `weight.T`), or a
    view of such a copy (F.linear keeps its transpose): a cast whose input is, through views, a leaf that learns."""
    node = (tensor if tensor._base is None else tensor._base).grad_fn
    if node is None or node.name() != "ToCopyBackward0":
        return False
    source = node.next_functions[0][0]
    while source is not None and source.name() in VIEW_NODES:
        source = source.next_functions[0][0]
    return type(source).__name__ == "AccumulateGrad"


class _Tally:
    """Bytes of the distinct storages autograd keeps, credited to the wrapped layer running (None: outside).

    A storage is known by its address, so every tensor counted is held until the tally ends: a layer's input that
    nothing keeps (T5's position bias, a mask) was freed, a later layer's input took its address, and that input
    was taken for one already counted (0 bytes for a T5 decoder layer's input, now and then, in a real forward)."""

    def __init__(self, parameters: set[int]) -> None:
        self.kept_storages = set(parameters)
        self.weight_copies = 0
        self.given_storages: set[int] = set()
        self.held: list[Tensor] = []
        self.kept: dict[Optional[int], int] = {}
        self.inputs: dict[int, int] = {}
        self.current: Optional[int] = None

    def pack(self, tensor: Tensor) -> Tensor:
        key = _storage(tensor)
        if key not in self.kept_storages:
            self.kept_storages.add(key)
            self.held.append(tensor)
            if _weight_cast(tensor):
                self.weight_copies += tensor.untyped_storage().nbytes()
            else:
                self.kept[self.current] = self.kept.get(self.current, 0) + tensor.untyped_storage().nbytes()
        return tensor

    def watch(self, layer: Module, index: int) -> list[Any]:
        def enter(_: Module, args: tuple, kwargs: dict) -> None:
            self.current = index
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
            self.held += tensors
            given = {_storage(t): t.untyped_storage().nbytes() for t in tensors}
            self.inputs[index] = sum(size for key, size in given.items() if key not in self.given_storages)
            self.given_storages |= given.keys()

        def leave(*_: Any) -> None:
            self.current = None

        return [layer.register_forward_pre_hook(enter, with_kwargs=True), layer.register_forward_hook(leave)]


class _FusedAttentionFunction(torch.autograd.Function):
    """What a fused attention kernel keeps for backward: its inputs, its output and the log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, memory_efficient: bool) -> Tensor:
        output = _fused_attention_output(query, value.shape[-1], memory_efficient)
        log_sum_exp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, output, log_sum_exp)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), None


def _fused_attention_output(query: Tensor, head_size: int, memory_efficient: bool) -> Tensor:
    """The output as the kernel lays it out (torch's own shape functions in torch/_meta_registrations.py): the flash
    kernels (FlashAttention on a GPU, the CPU's) as the query is laid out, the memory-efficient kernel that a GPU
    takes for a mask or fp32 inputs (FlashAttention computes in 16 bits) with tokens before heads. A model that
    transposes the output back and flattens its heads then gives the output projection a view of it, or a copy that
    backward keeps too: the query of Llama's rotary embedding is laid out tokens before heads, the one Phi-3,
    GPT-NeoX and Falcon concatenate from a partial rotary embedding heads before tokens."""
    if head_size == query.shape[-1] and not memory_efficient:
        return torch.empty_like(query)
    batch, heads, tokens, _ = query.shape
    return query.new_empty((batch, tokens, heads, head_size)).transpose(1, 2)


def _autocast_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The inputs as autocast gives them to SDPA (on CUDA's and the CPU's lower-precision lists): this stand-in
    runs before autocast would cast them."""
    device_type = tensors[0].device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(tensor.to(dtype) if tensor.is_floating_point() else tensor for tensor in tensors)


class _EveryLayerKept(TorchFunctionMode):
    """LayerDrop (BART's, OPT's) draws `torch.rand([])` and compares it in Python, which a fake tensor cannot
    answer, and a real draw would drop layers from the count at random: here the draw is 1.0, so no layer is dropped
    (the planner counts every layer, the most a step keeps)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is torch.rand and args and isinstance(args[0], (list, tuple)) and len(args[0]) == 0:
            return 1.0
        return func(*args, **(kwargs or {}))


class FusedAttention(TorchFunctionMode):
    """SDPA as the run's fused kernel computes it, where one applies (see the module's docstring)."""

    def __init__(self, gpu: bool) -> None:
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key, value = (*args, *(kwargs[name] for name in ("query", "key", "value") if name in kwargs))[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            heads_match = key.shape[1] == query.shape[1] or kwargs.get("enable_gqa", False)
            if heads_match and (mask is None or not mask.requires_grad) and (self.gpu or not dropout):
                inputs = _autocast_inputs(query, key, value)
                memory_efficient = self.gpu and (mask is not None or inputs[0].dtype == torch.float32)
                return _FusedAttentionFunction.apply(*inputs, memory_efficient)
        return func(*args, **kwargs)
