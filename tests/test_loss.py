"""The chunked loss path (app/model/loss.py) against transformers' own loss: values, gradients, masks, packing, the
architectures the project trains, and the probe that decides which models take it."""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import (AutoModelForCausalLM, AutoModelForSeq2SeqLM, BartConfig, GPT2Config, LlamaConfig,
                          JetMoeConfig, MixtralConfig, PretrainedConfig, T5Config)

from app.data.formats import IGNORE_INDEX, Batch, arrange
from app.metrics.memory_plan import ModelShape, Setup, chunked_loss_bytes
from app.model import loss as loss_module
from app.model.build import resolve_wrap_classes
from app.model.loss import (LossHead, LossPath, LossTerms, accumulate_product, chunk_tokens, chunked_cross_entropy,
                            install_loss_head, own_loss_path, probe_chunked_loss, routed_tokens)
from tests.conftest import run_entry

LLAMA = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
CAUSAL = {"llama": LLAMA, "gpt2": GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4)}
T5 = T5Config(vocab_size=1000, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
              decoder_start_token_id=0, pad_token_id=0)


def reference_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("bias", [False, True])
def test_chunks_give_the_loss_and_gradients_of_the_whole_logits(bias: bool) -> None:
    """Any chunk size, masked targets included: the same summed loss and the same gradients of hidden states,
    weight and bias (fp32), also through a scaled backward (the loop multiplies by world size / step tokens)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    b = torch.randn(50, generator=generator, requires_grad=True) if bias else None
    targets = torch.randint(0, 50, (37,), generator=generator)
    targets[::4] = IGNORE_INDEX
    expected = reference_loss(torch.nn.functional.linear(hidden, weight, b), targets)
    expected_grads = torch.autograd.grad(expected * 0.3, [t for t in (hidden, weight, b) if t is not None])
    for chunk in (1, 5, 37, 100):
        loss = chunked_cross_entropy(hidden, weight, b, targets, chunk)
        grads = torch.autograd.grad(loss * 0.3, [t for t in (hidden, weight, b) if t is not None])
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("terms", [LossTerms(label_smoothing=0.1), LossTerms(z_loss=1e-2),
                                   LossTerms(label_smoothing=0.2, z_loss=1e-4)], ids=str)
def test_label_smoothing_and_the_z_loss_in_chunks_give_the_loss_and_gradients_of_the_whole_logits(terms) -> None:
    """Against torch's cross_entropy with its label_smoothing, plus c x logsumexp^2 of each trained token."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    bias = torch.randn(50, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=generator)
    targets[::4] = IGNORE_INDEX
    logits = torch.nn.functional.linear(hidden, weight, bias)
    expected = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum",
                                                 label_smoothing=terms.label_smoothing)
    expected = expected + terms.z_loss * torch.logsumexp(logits, -1)[targets != IGNORE_INDEX].square().sum()
    assert abs(expected - reference_loss(logits, targets)) > 1e-3 * expected, "the terms change the cross-entropy"
    expected_grads = torch.autograd.grad(expected * 0.3, [hidden, weight, bias])
    for chunk in (1, 5, 100):
        loss = chunked_cross_entropy(hidden, weight, bias, targets, chunk, terms)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        for got, want in zip(torch.autograd.grad(loss * 0.3, [hidden, weight, bias]), expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", [LLAMA, T5], ids=["llama", "t5"])
def test_label_smoothing_is_the_trainers_and_the_same_chunked_or_from_the_models_logits(config) -> None:
    """The Hugging Face Trainer's LabelSmoother (label_smoothing_factor) on transformers' own model, this project's
    chunked loss and its loss from the model's logits (models without the chunked path): the same loss and
    gradients. Evaluation (`auxiliary=False`) gets the plain cross-entropy. In eval mode: no dropout to match."""
    from transformers.trainer_pt_utils import LabelSmoother

    own, chunked, path = model_pair(config)
    own.eval(), chunked.eval()
    materialising = copy.deepcopy(own)
    plain = own_loss_path(materialising)
    if config.is_encoder_decoder:
        generator = torch.Generator().manual_seed(3)
        labels = torch.randint(3, 1000, (2, 9), generator=generator)
        labels[1, 6:] = IGNORE_INDEX
        batch = Batch({"input_ids": torch.randint(3, 1000, (2, 11), generator=generator), "labels": labels},
                      int((labels != IGNORE_INDEX).sum()))
    else:
        batch = causal_batch(True, True, config.vocab_size)
    expected = LossPath().summed_loss(own, batch, auxiliary=False)
    for loss_path in (path, plain):
        loss_path.terms = LossTerms(label_smoothing=0.1)
        torch.testing.assert_close(loss_path.summed_loss(chunked if loss_path is path else materialising, batch,
                                                         auxiliary=False), expected.detach(), rtol=1e-5, atol=0)
    output = own(**batch.inputs)
    trainers = LabelSmoother(0.1)(output, batch.inputs["labels"], shift_labels=not config.is_encoder_decoder)
    (trainers * batch.trained_tokens / 7).backward()
    for model, loss_path in ((chunked, path), (materialising, plain)):
        loss = loss_path.summed_loss(model, batch)
        torch.testing.assert_close(loss, trainers * batch.trained_tokens, rtol=1e-5, atol=0)
        (loss / 7).backward()
        for (name, a), (_, b) in zip(own.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_without_gradients_only_the_loss_is_computed() -> None:
    hidden, weight = torch.randn(9, 8), torch.randn(20, 8)
    targets = torch.randint(0, 20, (9,))
    with torch.no_grad():
        loss = chunked_cross_entropy(hidden, weight.requires_grad_(), None, targets, 4)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference_loss(hidden @ weight.detach().t(), targets))


def test_bf16_stays_close_to_the_materialising_path() -> None:
    """In bf16 the logits are computed in bf16 and the loss in fp32, as transformers does; the weight's gradient
    is summed over chunks in fp32."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 32, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(300, 32, generator=generator) * 0.1).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (64,), generator=generator)
    expected = reference_loss(hidden @ weight.t(), targets)
    want = torch.autograd.grad(expected, [hidden, weight])
    loss = chunked_cross_entropy(hidden, weight, None, targets, 16)
    got = torch.autograd.grad(loss, [hidden, weight])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def model_pair(config: PretrainedConfig, kernel: str = "torch") -> tuple[torch.nn.Module, torch.nn.Module, LossPath]:
    """Two identical models: transformers' loss, and ours with the loss head installed."""
    kind = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    torch.manual_seed(0)
    own = kind.from_config(config, attn_implementation="sdpa")
    ours = copy.deepcopy(own)
    return own, ours, install_loss_head(ours, kernel)


def compare(own: torch.nn.Module, ours: torch.nn.Module, path: LossPath, batch: Batch) -> None:
    """Loss to 1e-5 relative and every parameter's gradient to 1e-4, through the loop's normalisation (the same
    dropout masks in both)."""
    torch.manual_seed(1)
    expected = LossPath().summed_loss(own, batch)
    torch.manual_seed(1)
    loss = path.summed_loss(ours, batch)
    assert loss.ndim == 0
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    (expected / 7).backward()
    (loss / 7).backward()
    for (name, a), (_, b) in zip(own.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def causal_batch(labels_masked: bool, packed: bool, vocab: int) -> Batch:
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(3, vocab, (2, 16), generator=generator)
    labels = input_ids.clone()
    inputs = {"input_ids": input_ids, "labels": labels}
    if labels_masked:
        labels[:, :6] = IGNORE_INDEX
    if packed:  # two examples per row; each example's first label is masked, as prepare_data.py writes them
        inputs["position_ids"] = torch.cat([torch.arange(7), torch.arange(9)]).repeat(2, 1)
        labels[:, 7] = IGNORE_INDEX
        inputs = arrange("one_row", inputs)
    trained = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
    return Batch(inputs, trained)


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("case", ["text", "supervised", "packed"])
def test_causal_models_train_as_with_their_own_loss(name: str, case: str) -> None:
    own, ours, path = model_pair(CAUSAL[name])
    assert isinstance(path.head, LossHead)
    compare(own, ours, path, causal_batch(case != "text", case == "packed", CAUSAL[name].vocab_size))


@pytest.mark.parametrize("case", ["supervised", "packed"])
def test_cut_cross_entropy_gets_the_heads_hidden_states_weight_and_shifted_targets(case: str, monkeypatch) -> None:
    """--loss_kernel cut_cross_entropy: its Triton kernel runs on CUDA only, so here the package is a stand-in of
    the same call (`linear_cross_entropy(e, c, targets, ignore_index, reduction)`) computed in torch: what the head
    hands the kernel (flattened tokens, the next token as target, masks and packing kept) trains as transformers'
    own loss, and under autocast both operands come in autocast's dtype. On a GPU `benchmarks/gpu_check.py` trains
    with the kernel itself."""
    given = []

    def linear_cross_entropy(e, c, targets, ignore_index, reduction):
        given.append((e.shape, e.dtype, c.dtype, targets.clone()))
        assert ignore_index == IGNORE_INDEX and reduction == "sum"
        return reference_loss(e @ c.t(), targets)

    monkeypatch.setitem(sys.modules, "cut_cross_entropy", SimpleNamespace(linear_cross_entropy=linear_cross_entropy))
    own, ours, path = model_pair(LLAMA, "cut_cross_entropy")
    batch = causal_batch(True, case == "packed", LLAMA.vocab_size)
    compare(own, ours, path, batch)
    (shape, dtype, weight_dtype, targets), = given
    assert shape == (batch.inputs["input_ids"].numel(), LLAMA.hidden_size) and dtype == weight_dtype == torch.float32
    assert int((targets != IGNORE_INDEX).sum()) == batch.trained_tokens
    with torch.autocast("cpu", dtype=torch.bfloat16):
        path.summed_loss(ours, batch)
    assert given[-1][1:3] == (torch.bfloat16, torch.bfloat16)


def test_under_autocast_the_weights_gradient_takes_operands_in_its_dtype_as_transformers_own(monkeypatch) -> None:
    """DDP and one device under bf16-mixed keep fp32 hidden states and weights under autocast: the weight's gradient
    was an fp32 GEMM (an in-place product autocast leaves alone), several times slower on a GPU than the bf16 one
    transformers' own loss runs. Its operands are bf16 now, summed in fp32, and the gradients stay those of
    transformers' own loss under autocast."""
    operands = []
    original = accumulate_product

    def spy(total, a, b):
        operands.append((a.dtype, b.dtype))
        original(total, a, b)

    monkeypatch.setattr("app.model.loss.accumulate_product", spy)
    own, ours, path = model_pair(LLAMA)
    batch = causal_batch(True, True, LLAMA.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, loss = LossPath().summed_loss(own, batch), path.summed_loss(ours, batch)
    expected.backward()
    loss.backward()
    assert operands and set(operands) == {(torch.bfloat16, torch.bfloat16)}, operands
    torch.testing.assert_close(loss, expected, rtol=1e-2, atol=0)
    for (name, a), (_, b) in zip(own.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=5e-2, atol=2e-3, msg=name)


def test_t5_trains_as_with_its_own_loss() -> None:
    """Targets are not shifted, and the decoder's inputs come from the labels as T5 builds them itself."""
    own, ours, path = model_pair(T5)
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(3, 1000, (2, 9), generator=generator)
    labels[1, 6:] = IGNORE_INDEX  # padding of the shorter target
    inputs = {"input_ids": torch.randint(3, 1000, (2, 11), generator=generator),
              "attention_mask": torch.ones(2, 11, dtype=torch.long), "labels": labels}
    compare(own, ours, path, Batch(inputs, int((labels != IGNORE_INDEX).sum())))


def test_a_micro_batch_without_trained_tokens_still_runs_backward() -> None:
    _, ours, path = model_pair(LLAMA)
    batch = causal_batch(False, False, 1000)
    batch.inputs["labels"][:] = IGNORE_INDEX
    loss = path.summed_loss(ours, Batch(batch.inputs, 0))
    loss.backward()
    assert loss.detach().item() == 0 and ours.lm_head.weight.grad is not None


def test_generation_still_gets_logits() -> None:
    own, ours, _ = model_pair(LLAMA)
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(ours.generate(ids, max_new_tokens=4, do_sample=False),
                               own.generate(ids, max_new_tokens=4, do_sample=False))
    assert set(ours.state_dict()) == set(own.state_dict())


@pytest.mark.parametrize("config, expected", [(LLAMA, True), (CAUSAL["gpt2"], True), (T5, True),
                                              (BartConfig(vocab_size=1000, d_model=64, encoder_layers=1,
                                                          decoder_layers=1, encoder_attention_heads=4,
                                                          decoder_attention_heads=4, encoder_ffn_dim=128,
                                                          decoder_ffn_dim=128), False)])
def test_the_probe_keeps_the_models_own_loss_where_its_output_is_changed_after_the_head(
        config: PretrainedConfig, expected: bool) -> None:
    """BART adds final_logits_bias to the output layer's result: its own loss is kept."""
    assert probe_chunked_loss(config, "sdpa") is expected


def test_weight_gradients_of_bf16_chunks_are_summed_in_fp32() -> None:
    """`accumulate_product` adds each chunk's product of bf16 operands into the fp32 total, the products in fp32 (on
    CPU an fp32 GEMM of the operands' fp32 copies; on CUDA one GEMM reading them as they are, which
    benchmarks/bench_loss.py checks on a GPU): the total of many small products keeps what a bf16 sum would round
    away, and no product is rounded to bf16 first."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(8, 16, generator=generator).bfloat16()
    b = torch.randn(16, 4, generator=generator).bfloat16()
    total = torch.full((8, 4), 1000.0)
    for _ in range(3):
        accumulate_product(total, a, b)
    assert torch.allclose(total, 1000.0 + 3 * (a.float() @ b.float()), rtol=0, atol=1e-3)
    assert not torch.allclose(total, 1000.0 + 3 * (a @ b).float(), rtol=0, atol=1e-3)  # the bf16 product's rounding


def peak_bytes_allocated(work) -> int:
    """The most bytes of tensors that `work` made and held at once: torch's profiler records every allocation and
    free on CPU, in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        work()
    events = sorted((event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
                    key=lambda event: event.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("bf16-true", torch.bfloat16)])
def test_the_planner_counts_what_the_chunked_loss_holds_at_its_most(precision, dtype, monkeypatch) -> None:
    """Forward and backward of the head, four chunks of 64 tokens, measured: the hidden states' gradient and
    exactly what `--estimate_memory` plans for the loss. Backward once scaled the weight's fp32 gradient into a
    second fp32 copy (an H200 measured the head at 2.76 GB, for 1.55 GB at 8K tokens x 128K x 2048 now), and on CPU
    each chunk's bf16 product of the weight's size went through an fp32 copy."""
    tokens, hidden_size, vocab = 256, 256, 4096
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 64 * vocab)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.1).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    targets[:40] = IGNORE_INDEX
    peak = peak_bytes_allocated(
        lambda: chunked_cross_entropy(hidden, weight, None, targets, chunk_tokens(vocab)).backward())
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4)
    setup = Setup(strategy="fsdp", sharding_strategy="FULL_SHARD", precision=precision, world_size=1,
                  devices_per_node=1, micro_batch_size=1, block_size=tokens, gradient_checkpointing=False,
                  cpu_offload=False, chunked_loss=True, gpu=False)
    planned = chunked_loss_bytes(ModelShape.of(config, resolve_wrap_classes(config, None)), setup)
    hidden_gradient = tokens * hidden_size * dtype.itemsize
    assert peak - hidden_gradient == pytest.approx(planned, rel=0.02)
    assert planned < 2 * vocab * hidden_size * 4  # never a second fp32 copy of the weight's gradient


def test_the_loss_benchmark_runs_and_its_chunked_rows_equal_the_materialising_path() -> None:
    """benchmarks/bench_loss.py --tiny (fp32 on CPU, chunks that do and do not divide the tokens): each row's loss
    and gradients against the materialising path's, as it prints them."""
    result = run_entry(["benchmarks/bench_loss.py", "--tiny"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| chunked")]
    assert len(rows) == 3, result.stdout
    for row in rows:
        differences = [float(d) for d in row.strip("| ").split("|")[-1].split(",")]
        assert max(differences) < 1e-5, row
    fewer = run_entry(["benchmarks/bench_loss.py", "--tiny", "--tokens", "64"])  # --tiny replaced what was given
    assert fewer.returncode == 0 and "64 tokens" in fewer.stdout.splitlines()[0], fewer.stdout
    for script, option in (("bench_loss.py", "--repeats"), ("bench_collectives.py", "--repeats")):
        refused = run_entry([f"benchmarks/{script}", option, "0"])  # a statistics traceback after minutes of setup
        assert refused.returncode == 2 and f"error: {option} must be 1 or more" in refused.stderr, refused.stderr


MIXTRAL = MixtralConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        output_router_logits=True, router_aux_loss_coef=0.5)
JETMOE = JetMoeConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_key_value_heads=4, kv_channels=16,
                      intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                      aux_loss_coef=0.25)
MIXTURES = {"mixtral": (MIXTRAL, 0.5), "jetmoe": (JETMOE, 0.25)}


@pytest.mark.parametrize("name, case", [("mixtral", "text"), ("mixtral", "packed"), ("jetmoe", "packed")])
def test_a_mixture_of_experts_takes_the_chunked_loss_with_its_router_loss(name: str, case: str) -> None:
    """Mixtral's own loss adds its router's auxiliary loss (x router_aux_loss_coef; JetMoE's x aux_loss_coef, which
    the model holds as such) to the mean cross-entropy; the chunked path adds it to the sum, times the trained
    tokens: the same loss and gradients, the router's included. Such models once kept their own loss, materialising
    the logits; evaluation still asks for the cross-entropy alone."""
    config, coefficient = MIXTURES[name]
    own, ours, path = model_pair(config)
    assert isinstance(path.head, LossHead) and path.router_loss and path.router_coefficient == coefficient
    batch = causal_batch(False, case == "packed", config.vocab_size)
    compare(own, ours, path, batch)
    routers = [p for n, p in ours.named_parameters() if "gate" in n or "router" in n]
    assert routers and all(parameter.grad.abs().sum() > 0 for parameter in routers)
    with torch.no_grad():
        cross_entropy = path.summed_loss(ours, batch, auxiliary=False)
        logits = own(**{k: v for k, v in batch.inputs.items() if k != "labels"}).logits
    targets = torch.nn.functional.pad(batch.inputs["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    torch.testing.assert_close(cross_entropy, reference_loss(logits.flatten(0, 1), targets.flatten()), rtol=1e-5,
                               atol=0)
    materialising = own_loss_path(own)  # with the z-loss, from its logits: the router's loss added alike
    path.terms = materialising.terms = LossTerms(z_loss=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(materialising.summed_loss(own, batch), path.summed_loss(ours, batch), rtol=1e-5,
                                   atol=0)


@pytest.mark.parametrize("name", MIXTURES)
def test_the_padding_that_ends_packed_rows_changes_no_router_loss(name: str) -> None:
    """Packed rows reach the model without an attention mask, and transformers' balancing loss counted every token
    it routed, the padding that ends a row included (11% of one audit's supervised blocks): the same examples with
    and without 3 tokens of padding after them gave other losses and router gradients. Now the same, through the
    chunked path and the model's own loss alike (in the layout these models take; one row, FlashAttention's, counts
    the same tokens)."""
    config, _ = MIXTURES[name]
    examples = torch.randint(3, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(4))
    labels = examples.clone()
    labels[:, [0, 7]] = IGNORE_INDEX  # each example's first label, as prepare_data.py writes them
    positions = torch.cat([torch.arange(7), torch.arange(6)]).repeat(2, 1)
    trimmed = {"input_ids": examples, "labels": labels, "position_ids": positions}
    padded = {"input_ids": torch.nn.functional.pad(examples, (0, 3), value=0),
              "labels": torch.nn.functional.pad(labels, (0, 3), value=IGNORE_INDEX),
              "position_ids": torch.cat([positions, torch.arange(3).repeat(2, 1)], dim=1)}
    trained = int((labels[:, 1:] != IGNORE_INDEX).sum())
    own, ours, path = model_pair(config)
    for model, loss_path in ((ours, path), (own, own_loss_path(own))):
        assert loss_path.router_balance is not None
        without, with_padding = (loss_path.summed_loss(model, Batch(inputs, trained)) for inputs in (trimmed, padded))
        torch.testing.assert_close(with_padding, without, rtol=1e-6, atol=0)
    for layout in ("position_ids", "one_row"):
        counted = routed_tokens(arrange(layout, padded))
        assert int(counted.sum()) == 26 and not counted.reshape(2, 16)[:, 13:].any(), layout


def test_a_mixture_of_experts_trains_with_its_router_loss_and_reports_the_cross_entropy(tiny, tmp_path) -> None:
    """A Mixtral with output_router_logits adds its router's auxiliary loss to the loss, which training keeps
    (as intended); val_loss, reported as the mean cross-entropy of the trained tokens, included it too (6.078 for
    6.037 in an audit)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from tests.conftest import run_train, train_args
    from tests.test_training import assert_succeeded, read_metrics

    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer)
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.5, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "mixtral")
    rows = torch.tensor(load_from_disk(str(tiny.data))["validation"]["input_ids"])
    with torch.no_grad():
        own = model(input_ids=rows, labels=rows).loss.item()
        logits = model(input_ids=rows).logits
    cross_entropy = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten()).item()
    assert own > cross_entropy * 1.01, "the router's loss shows at this coefficient"

    result = run_train(train_args(tiny, tmp_path / "run", devices=1, model_config=None, model_name=tmp_path / "mixtral",
                                  max_step=1, warmup_steps=1, eval_iters=1000, eval_batch_size=len(rows),
                                  save_step_interval=0))
    assert_succeeded(result)
    assert "adds its router's auxiliary loss (x 0.5) to the cross-entropy: train_loss includes it" in result.stdout
    assert read_metrics(tmp_path / "run")[0]["val_loss"] == pytest.approx(cross_entropy, rel=1e-5)


def test_a_mixture_of_experts_says_what_its_router_loss_is_or_that_it_trains_none() -> None:
    """JetMoE's coefficient (aux_loss_coef) was said as "x ?"; a Mixtral whose config has output_router_logits false
    (transformers' default, and the published configs') trained no load-balancing loss without a word."""
    from transformers import JetMoeConfig, LlamaConfig

    from app.training.preflight.model import note_router_loss

    def said(config) -> list[str]:
        lines = []
        note_router_loss(config, lines.append)
        return lines

    assert "auxiliary loss (x 0.25) to the cross-entropy" in said(
        JetMoeConfig(num_local_experts=4, output_router_logits=True, aux_loss_coef=0.25))[0]
    assert said(MixtralConfig(num_local_experts=4, output_router_logits=False)) == [
        "a mixtral model whose config has output_router_logits false (transformers' default, and that of the "
        "published Mixtral and Qwen-MoE configs) trains no load-balancing loss for its router, which may leave "
        "experts unused; set \"output_router_logits\": true in its config.json to train one"]
    assert said(LlamaConfig()) == []
