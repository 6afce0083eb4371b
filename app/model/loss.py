"""The loss path: a micro-batch's summed token losses, computed without the full-vocabulary logits.

A causal LM ends by turning its hidden states (tokens x hidden) into logits (tokens x vocabulary) and the loss into
their cross-entropy. For Llama-3 (128,256 tokens) at 8K tokens per micro-batch the logits are 2.1 GB in bf16, the
loss makes a 4.2 GB fp32 copy and backward a 4.2 GB gradient of it, and Fabric converts whatever the model returns
to fp32 once more: the largest activations of the step, at the point where the others peak.

Here the model's output layer is replaced by `LossHead`, which holds the very same weight (and bias). While the
loop gives it the batch's labels (`LossPath.summed_loss`), it returns the summed cross-entropy as one number,
computed in chunks of tokens: each chunk's logits, their loss and their gradients (softmax minus the one-hot
target, times the weight and times the hidden states), then the next chunk. The gradients are computed in forward
and only scaled in backward, as Liger Kernel's fused linear cross-entropy does: the same three matrix products as
the materialising path, never more than one chunk's logits (`CHUNK_LOGITS` fp32 values, 512 MiB) and one fp32
weight-sized gradient. Without labels the head is the plain Linear (generation, conversion).

Written here rather than taken from Liger Kernel or Cut Cross-Entropy: both are Triton kernels for CUDA, and every
run of this project (CPU processes in the tests, GPUs for users) must be able to take the same loss path, the
default one. Measured on an H200 (`benchmarks/bench_loss.py --fused_kernels`, docs/performance.md) at 8K tokens x
2048 -> 128,256: Liger's as fast as this one, 1.50 GB above the inputs against 2.76, Cut Cross-Entropy's 1.27x
faster in 0.52 GB, its gradient filter looser (1.9e-2 against 4.5e-3 in the hidden states' gradient): `--loss_kernel
cut_cross_entropy` takes it on GPUs (`cut_cross_entropy_loss`), opt-in, the head and the loop otherwise the same.
The 2.76 GB were backward's second fp32 copy of the weight's gradient and torch.logsumexp's chunk-sized temporary,
both gone since: 1.86 GB planned (`memory_plan.chunked_loss_bytes`, checked against torch's profiler on CPU), not
yet measured on a GPU.

Two regularisers enter each trained token's loss where training asks for them (`LossTerms`): label smoothing and
the z-loss. Evaluation and the spike guard's scores take the plain cross-entropy. Without the chunked path the loss
is then computed from the model's logits (`regularised_cross_entropy`), as the Hugging Face Trainer's LabelSmoother
does: transformers' models have no place for either.

Whether a model hands its output layer's result back untouched (BART adds `final_logits_bias`, Gemma-2 soft-caps the
logits, others scale them) is not listed by name: `probe_chunked_loss` runs a small random twin of the run's config
and keeps the chunked path only when its loss equals transformers' own. Otherwise the model's own loss is used.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Linear, Module
from transformers import PretrainedConfig

from app.data.formats import IGNORE_INDEX, Batch, per_example_counts
from app.model.noise import EmbeddingNoise

CHUNK_LOGITS = 2**27
"""fp32 logits per chunk (512 MiB): 1,046 tokens of Llama-3's vocabulary, 4,194 of Llama-2's."""
FUSED_ACCUMULATION = True
"""Whether CUDA sums each chunk's weight gradient into the fp32 total in its GEMM (`accumulate_product`); the
benchmark turns it off to measure what it saves."""
PROBE_TOLERANCE = 1e-5
"""Largest relative difference between the twin's chunked loss and transformers' own that counts as equal."""
ROUTER_COEFFICIENT_NAMES = ("router_aux_loss_coef", "aux_loss_coef")
"""Where a mixture of experts keeps its router loss's coefficient: most in router_aux_loss_coef, JetMoE in
aux_loss_coef."""


def chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_LOGITS // vocab_size)


@dataclass(frozen=True)
class LossTerms:
    """What training adds to each trained token's cross-entropy: with logits z over V tokens, target t and
    lse = logsumexp(z), the token's loss is (1 - s) (lse - z_t) + s (lse - mean(z)) + c lse^2."""

    label_smoothing: float = 0.0
    """s (--label_smoothing): the target's probability spread over the vocabulary, as torch's cross_entropy and the
    Hugging Face Trainer's label_smoothing_factor take it."""
    z_loss: float = 0.0
    """c (--z_loss): PaLM's penalty on the softmax's log-normaliser, which keeps the logits from drifting."""

    def __bool__(self) -> bool:
        return bool(self.label_smoothing or self.z_loss)


PLAIN = LossTerms()
"""The cross-entropy alone: evaluation, the spike guard's scores."""


def regularised_cross_entropy(logits: Tensor, targets: Tensor, terms: LossTerms) -> Tensor:
    """The summed loss (fp32) of materialised `logits` (tokens x vocabulary) against `targets`, with `terms`: the
    path of models without the chunked loss. torch's cross_entropy leaves the masked targets out of its smoothing
    too; the z-loss is masked by multiplying (indexing by the mask would wait for the GPU)."""
    logits = logits.float()
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum",
                           label_smoothing=terms.label_smoothing)
    if terms.z_loss:
        loss = loss + terms.z_loss * (torch.logsumexp(logits, dim=-1).square() * (targets != IGNORE_INDEX)).sum()
    return loss


@torch.compiler.disable
def chunked_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                          chunk: int, terms: LossTerms = PLAIN) -> Tensor:
    """The summed cross-entropy (fp32) of `hidden` (tokens x hidden) through the output layer against `targets`
    (tokens; IGNORE_INDEX where nothing is learnt), `chunk` tokens at a time, with `terms`. Differentiable in
    hidden, weight and bias; without gradients (evaluation) only the loss is computed.

    Left out of `--compile`'s graphs: its loop of large matrix products gains nothing from fusion, and tracing it
    doubled a small model's compilation time (57 s against 27 s for 4 steps on CPU)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, chunk, terms)
    return _chunked_loss_and_gradients(hidden, weight, bias, targets, chunk, (False, False, False), terms)[0]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Computes the gradients in forward (one pass over the chunks) and scales them by the loss's gradient in
    backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, chunk: int,
                terms: LossTerms) -> Tensor:
        loss, *gradients = _chunked_loss_and_gradients(hidden, weight, bias, targets, chunk,
                                                       tuple(ctx.needs_input_grad[:3]), terms)
        ctx.gradients = gradients
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        gradients, dtypes = ctx.gradients, ctx.dtypes
        del ctx.gradients  # freed as soon as autograd has them
        scaled = [None if gradient is None else gradient.mul_(grad_loss).to(dtype)  # in place: no second fp32 copy
                  for gradient, dtype in zip(gradients, dtypes)]
        return *scaled, None, None, None


def _chunked_loss_and_gradients(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, chunk: int,
                                needs: tuple[bool, bool, bool], terms: LossTerms = PLAIN) -> tuple[Tensor, ...]:
    """The summed loss and the gradients `needs` asks for (hidden, weight, bias; None for the others).

    Per chunk: logits in the compute dtype, upcast to fp32 as transformers' loss does; loss = logsumexp - target
    logit; d(loss)/d(logits) = softmax - one-hot (with `terms`, LossTerms' loss: softmax x (1 + 2 c lse) - (1 - s)
    one-hot - s / V); then its products with the weight (the hidden states' gradient)
    and with the hidden states (the weight's, summed in fp32 over chunks). The softmax is computed over the logits
    in place (torch.logsumexp makes a chunk-sized temporary, and a chunk of Llama-3's fp32 logits is 512 MiB), and
    the previous chunk's gradient is let go before the next chunk's logits are made: at most one chunk's fp32 logits
    and their gradient in the compute dtype besides the weight's fp32 gradient (`memory_plan.chunked_loss_bytes`,
    tests/test_loss.py measures it).

    The gradients' products are in the compute dtype: autocast's (DDP and one device under *-mixed, whose hidden
    states and weight are fp32), else the hidden states'. The weight's gradient was an fp32 GEMM under autocast (an
    in-place product, which autocast leaves alone), where transformers' own loss takes bf16 operands."""
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if needs[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs[2] else None
    smoothing, target_share = terms.label_smoothing, 1.0 - terms.label_smoothing
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start:start + chunk], targets[start:start + chunk]
        logits = F.linear(h, weight, bias).float()
        trained = t != IGNORE_INDEX
        safe_targets = torch.where(trained, t, 0)
        target_logits = logits.gather(1, safe_targets[:, None]).squeeze(1)
        if smoothing:
            target_logits = target_share * target_logits + smoothing * logits.mean(dim=-1)
        maxima = logits.amax(dim=-1, keepdim=True)
        exponentials = logits.sub_(maxima).exp_()  # the logits are not needed any more
        sums = exponentials.sum(dim=-1, keepdim=True)
        log_normaliser = (sums.log() + maxima).squeeze(1)
        token_losses = log_normaliser - target_logits
        if terms.z_loss:
            token_losses = token_losses + terms.z_loss * log_normaliser.square()
        loss += (token_losses * trained).sum()
        if not any(needs):
            continue
        probabilities = exponentials.div_(sums)
        if terms.z_loss:
            probabilities.mul_((1 + 2 * terms.z_loss * log_normaliser)[:, None])
        d_logits = probabilities.scatter_add_(1, safe_targets[:, None], -target_share * trained[:, None].float())
        if smoothing:
            d_logits.sub_(smoothing / d_logits.shape[1])
        d_logits.mul_(trained[:, None])
        if grad_bias is not None:
            grad_bias += d_logits.sum(0)
        d_logits = d_logits.to(compute)
        del logits, exponentials, probabilities  # the fp32 chunk, unless it is d_logits itself (fp32 training)
        if grad_hidden is not None:
            grad_hidden[start:start + chunk] = d_logits @ weight  # under autocast in its dtype, as F.linear's
        if grad_weight is not None:
            accumulate_product(grad_weight, d_logits.t(), h.to(compute))
        del d_logits
    return loss, grad_hidden, grad_weight, grad_bias


@torch.compiler.disable
def cut_cross_entropy_loss(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """The summed cross-entropy by Cut Cross-Entropy's Triton kernel (CUDA only; the preflight checks that it is
    installed and that the run is on GPUs), at its default gradient filter. Its operands in the dtype F.linear would
    compute in: autocast's (DDP's fp32 weights under bf16-mixed), else the weight's. Left out of --compile's graphs,
    as the chunked loss is."""
    from cut_cross_entropy import linear_cross_entropy

    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, ignore_index=IGNORE_INDEX,
                                reduction="sum")


def accumulate_product(total: Tensor, a: Tensor, b: Tensor) -> None:
    """total (fp32) += a @ b of bf16/fp16 operands, the products summed in fp32. On CUDA one GEMM that reads the
    operands as they are (`out_dtype`, torch 2.8 and newer); elsewhere (and on CUDA for the benchmark's comparison,
    benchmarks/bench_loss.py) an fp32 GEMM of fp32 copies of the operands, a chunk's size: the same arithmetic. A
    product in the operands' dtype added afterwards held a weight-sized product and its fp32 copy per chunk, and on
    CPU its bf16 GEMM took 4x as long (docs/performance.md#on-an-h200-2026-11-29 has the command and figures)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif total.is_cuda and FUSED_ACCUMULATION:
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total.addmm_(a.to(total.dtype), b.to(total.dtype))


class LossHead(Linear):
    """The model's output layer, holding its weight: the plain Linear, or while `scoring` the summed loss."""

    def __init__(self, output_layer: Linear, shift: bool, kernel: str = "torch") -> None:
        Module.__init__(self)
        self.in_features, self.out_features = output_layer.in_features, output_layer.out_features
        self.weight = output_layer.weight
        self.register_parameter("bias", output_layer.bias)
        self.shift = shift
        """Causal LMs predict the next token: the target of position t is label t + 1."""
        self.targets: Optional[Tensor] = None
        self.kernel = kernel
        """--loss_kernel: "torch" (`chunked_cross_entropy`) or "cut_cross_entropy" (no bias: the preflight checks)."""
        self.terms = PLAIN
        """What `scoring` adds to the cross-entropy (LossTerms): training's --label_smoothing and --z_loss."""

    @contextmanager
    def scoring(self, labels: Tensor, terms: LossTerms = PLAIN) -> Iterator[None]:
        self.targets, self.terms = model_targets(labels, self.shift).reshape(-1), terms
        try:
            yield
        finally:
            self.targets, self.terms = None, PLAIN

    def forward(self, hidden: Tensor) -> Tensor:
        if self.targets is None:
            return super().forward(hidden)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if self.kernel == "cut_cross_entropy":
            return cut_cross_entropy_loss(hidden, self.weight, self.targets)
        return chunked_cross_entropy(hidden, self.weight, self.bias, self.targets, chunk_tokens(self.out_features),
                                     self.terms)


def model_targets(labels: Tensor, shift: bool) -> Tensor:
    """What each position's logits are scored against: a causal model's next label (`shift`), else its own."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX) if shift else labels


@dataclass
class LossPath:
    """How the loop and evaluation ask the model for a micro-batch's summed token losses."""

    head: Optional[LossHead] = None
    """The chunked path when set; else the model's own loss (it materialises the logits)."""
    decoder_inputs: Optional[Callable[[Tensor], Tensor]] = None
    """An encoder-decoder's decoder inputs from the labels (its forward builds them only when given labels)."""
    router_loss: bool = False
    """The model adds its router's auxiliary loss (a mixture of experts with output_router_logits): training
    minimises it, as intended; evaluation (`auxiliary=False`) asks for the cross-entropy alone, which val_loss and
    its perplexity are."""
    router_coefficient: Optional[float] = 0.0
    """What the model's own loss multiplies that auxiliary loss by before adding it to the mean cross-entropy; the
    chunked path adds it times the trained tokens to the summed cross-entropy: the same. None where the model does
    not show it (the preflight then refuses `terms`, whose loss must add it)."""
    noise: Optional[EmbeddingNoise] = None
    """--neftune_noise_alpha's hook on the input embeddings, told each micro-batch's example lengths."""
    terms: LossTerms = PLAIN
    """--label_smoothing and --z_loss: in training's loss, not in evaluation's (`auxiliary=False`)."""
    router_balance: Optional[Callable[..., Tensor]] = None
    """transformers' load-balancing loss of the model's class (`router_balance`), which the path calls with the
    tokens it counts in packed rows (`routed_tokens`); None: the model's own, as it computed it."""

    def summed_loss(self, model: Module, batch: Batch, auxiliary: bool = True) -> Tensor:
        """The micro-batch's token losses summed (0 with the graph intact when it trains no token: FSDP's
        collectives need every rank's backward); without the router's auxiliary loss unless `auxiliary`."""
        with self.noise.of(batch.inputs) if self.noise else nullcontext():
            return self._summed_loss(model, batch, auxiliary)

    def _summed_loss(self, model: Module, batch: Batch, auxiliary: bool) -> Tensor:
        without_router = {"output_router_logits": False} if self.router_loss and not auxiliary else {}
        terms = self.terms if auxiliary else PLAIN
        if self.head is None and not terms:
            output = model(**batch.inputs, **without_router)
            if not batch.trained_tokens:
                return output.logits.sum() * 0.0
            recount = self.router_balance is not None and self.router_coefficient is not None
            if self.router_loss and auxiliary and recount:  # its router's term recounted over the examples' tokens
                mean = output.loss + self.router_coefficient * (self._router_loss(output, batch) - output.aux_loss)
                return mean * batch.trained_tokens
            return output.loss * batch.trained_tokens
        inputs = dict(batch.inputs)
        labels = inputs.pop("labels")
        if self.decoder_inputs is not None and "decoder_input_ids" not in inputs:
            inputs["decoder_input_ids"] = self.decoder_inputs(labels)
        with self.head.scoring(labels, terms) if self.head is not None else nullcontext():
            output = model(**inputs, **without_router)
        loss = output.logits if self.head is not None else regularised_cross_entropy(
            output.logits.flatten(0, -2), model_targets(labels, self.decoder_inputs is None).reshape(-1), terms)
        if self.router_loss and auxiliary:
            return loss + self.router_coefficient * self._router_loss(output, batch) * batch.trained_tokens
        return loss

    def _router_loss(self, output: Any, batch: Batch) -> Tensor:
        """The router's load-balancing loss over the tokens of packed rows' examples, without the padding that ends a
        row: transformers counts the tokens its attention mask keeps, and packed rows reach the model without one."""
        counted = routed_tokens(batch.inputs) if self.router_balance is not None else None
        if counted is None:
            return output.aux_loss
        return self.router_balance(output.router_logits, attention_mask=counted)


def routed_tokens(inputs: dict[str, Tensor]) -> Optional[Tensor]:
    """Of packed rows (position_ids), the tokens of the examples with a trained label: not the padding run that ends
    a row, nor an example that trains nothing. None for other batches: padded rows bring the attention mask that
    transformers' balancing loss reads, and raw text's blocks hold no padding."""
    if inputs.get("position_ids") is None or inputs.get("labels") is None:
        return None
    trained = (inputs["labels"] != IGNORE_INDEX).long()
    return per_example_counts(inputs["position_ids"], trained) > 0


def router_balance(model: Module) -> Optional[Callable[..., Tensor]]:
    """transformers' load-balancing loss as the model's class computes it (`load_balancing_loss_func` of its module,
    called with the model's num_experts and num_experts_per_tok, as every mixture of experts of transformers 5
    does); None where the model does not hold those (a model of remote code)."""
    function = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if function is None or not isinstance(experts, int) or not isinstance(top_k, int) or list(
            inspect.signature(function).parameters) != ["gate_logits", "num_experts", "top_k", "attention_mask"]:
        return None
    return partial(function, num_experts=experts, top_k=top_k)


def install_loss_head(model: Module, kernel: str = "torch") -> LossPath:
    """Replace `model`'s output layer by a LossHead on the same weight (before any wrapping), its loss computed by
    `kernel` (--loss_kernel); the model's own loss when its output layer is not a Linear, or when it adds a router's
    loss whose coefficient it does not show."""
    output_layer = model.get_output_embeddings()
    path = own_loss_path(model)
    if type(output_layer) is not Linear or path.router_coefficient is None:
        return path
    head = LossHead(output_layer, shift=path.decoder_inputs is None, kernel=kernel)
    model.set_output_embeddings(head)
    return replace(path, head=head)


def own_loss_path(model: Module) -> LossPath:
    """The path of the model's own loss (from its logits with `LossPath.terms`)."""
    router_loss = adds_router_loss(model)
    return LossPath(None, model.prepare_decoder_input_ids_from_labels if model.config.is_encoder_decoder else None,
                    router_loss, router_coefficient(model) if router_loss else 0.0,
                    router_balance=router_balance(model) if router_loss else None)


def adds_router_loss(model: Module) -> bool:
    """Whether the model's own loss adds its router's auxiliary loss, which a call can turn off
    (output_router_logits, a parameter of the forward of Mixtral, Qwen-MoE, OLMoE, DBRX, JetMoE, ...)."""
    return bool(getattr(model.config, "output_router_logits", False)) and (
        "output_router_logits" in inspect.signature(type(model).forward).parameters)


def router_coefficient(model: Module) -> Optional[float]:
    """The coefficient the model's own loss multiplies its router's auxiliary loss by, as the model holds it (most
    from config.router_aux_loss_coef, DBRX from its ffn_config, JetMoE as aux_loss_coef); None if it holds none."""
    for name in ROUTER_COEFFICIENT_NAMES:
        value = getattr(model, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def probe_chunked_loss(model_config: PretrainedConfig, attn_implementation: str,
                       trust_remote_code: bool = False) -> bool:
    """Whether the chunked loss equals transformers' own for this model class: on a small random twin of the config
    (fp32, CPU), with a row whose first targets are masked (-100) as supervised data has them."""
    from app.model.build import model_class
    from app.model.isolation import small_twin

    twin = small_twin(model_config)
    model = model_class(model_config).from_config(twin, attn_implementation=_cpu_attention(attn_implementation),
                                                  trust_remote_code=trust_remote_code, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, twin.vocab_size, (2, 12), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = IGNORE_INDEX
    targets = labels if model_config.is_encoder_decoder else labels[:, 1:]
    batch = Batch({"input_ids": input_ids, "labels": labels}, trained_tokens=int((targets != IGNORE_INDEX).sum()))
    with torch.no_grad():
        own = LossPath().summed_loss(model, batch)
        path = install_loss_head(model)
        if path.head is None:
            return False
        chunked = path.summed_loss(model, batch)
    if chunked.ndim != 0:  # something was added to the head's output (a bias over the vocabulary)
        return False
    return bool((chunked - own).abs() <= PROBE_TOLERANCE * own.abs())


def _cpu_attention(attn_implementation: str) -> str:
    """FlashAttention needs a GPU; the loss does not depend on the attention kernel."""
    return "sdpa" if "flash" in attn_implementation else attn_implementation
