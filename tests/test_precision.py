"""Precision on the path GPU users take: bf16 and fp16 train, rotary frequencies stay fp32, the gradient norm is
fp32, MFU has a dense peak for every listed GPU, and activation checkpointing saves memory without changing a loss.

The decisions that depend on a GPU (bf16 support, TF32, peak FLOP/s) are pure functions tested here on their inputs;
everything else runs for real in 2 CPU processes.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from lightning_fabric.plugins import FSDPPrecision, MixedPrecision
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from app.checkpoint.checksums import CHECKSUMS_KEY, decode, encode, with_metadata
from app.checkpoint.writers import METADATA_KEY
from app.distributed.precision import (bf16_moment_problem, bf16_rounding_note, bf16_support_problem,
                                       float32_matmul_precision, fp32_modules_problem, fsdp_mixed_precision,
                                       kept_in_fp32_units, precision_plugin, reduce_dtype)
from app.metrics.peaks import PEAKS, listed_peak, peak_tflops
from app.model.build import meta_model
from app.optimization.optimizer import (ParameterRoles, build_optimizer, clip_gradients, gradient_square_sum,
                                        no_decay_names)
from tests.conftest import (ROOT, interpreter, read_checkpoint, run_environment, run_script, run_train,
                            train_args)
from tests.test_training import assert_succeeded, read_metrics

# --- decisions that depend on the GPU, as pure functions ---------------------------------------------------------


@pytest.mark.parametrize("name, capability, refused", [
    ("Tesla V100-SXM2-32GB", (7, 0), True), ("Tesla T4", (7, 5), True),
    ("NVIDIA A100-SXM4-80GB", (8, 0), False), ("NVIDIA H100 80GB HBM3", (9, 0), False)])
def test_bf16_is_refused_on_gpus_without_it_with_a_hint_to_16_mixed(name, capability, refused) -> None:
    for precision in ("bf16-true", "bf16-mixed"):
        problem = bf16_support_problem(precision, name, capability)
        assert (problem is not None) == refused
        if refused:
            assert f"--precision {precision}" in problem and "--precision 16-mixed" in problem and name in problem
    assert bf16_support_problem("16-mixed", "Tesla T4", (7, 5)) is None
    assert bf16_support_problem("32-true", "Tesla T4", (7, 5)) is None


@pytest.mark.parametrize("model_type, refused", [("deepseek_v3", {"bf16-true", "16-mixed"}),
                                                ("glm4_moe", {"bf16-true", "16-mixed"}),
                                                ("llama", set()), ("mixtral", set())])
def test_modules_transformers_keeps_in_fp32_under_bfloat16_refuse_bf16_true(model_type, refused) -> None:
    """transformers' bf16 DeepSeek-V3 keeps its router bias in float32 (`_keep_in_fp32_modules_strict`); bf16-true
    would round it and route tokens elsewhere, while bf16-mixed keeps every weight in float32."""
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
    model = meta_model(config, False)
    for precision in ("bf16-true", "bf16-mixed", "16-mixed", "32-true"):
        problem = fp32_modules_problem(precision, model)
        assert (problem is not None) == (precision in refused), (precision, problem)
    if "bf16-true" in refused:
        assert fp32_modules_problem("bf16-true", model).startswith(
            f"--precision bf16-true: {type(model).__name__} keeps e_score_correction_bias in float32 also under "
            "bfloat16") and fp32_modules_problem("bf16-true", model).endswith("use --precision bf16-mixed")
    assert fp32_modules_problem("bf16-mixed", model, "fsdp2") is None, "a buffer: FSDP casts no buffer"


def small_moe(model_type: str = "ernie4_5_moe", **overrides):
    """A 2-layer config of a model that keeps parameters in float32: Ernie-4.5-MoE (its router `gate`, experts in
    every layer) or Flint (an attention's `sinks`)."""
    options = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=256)
    if model_type == "ernie4_5_moe":
        options |= dict(moe_intermediate_size=32, moe_num_experts=4, moe_k=2, moe_layer_start_index=0)
    return AutoConfig.for_model(model_type, **options | overrides)


def test_modules_kept_in_fp32_get_fsdp_units_of_their_own_and_parameters_beside_others_are_refused() -> None:
    """Ernie keeps its router's gate in float32 under bfloat16; bf16-mixed keeps it so in its master copy, but
    fsdp's and fsdp2's mixed precision gathered it in bfloat16 for every forward (a bias of 1.0068 was used as 1.0078,
    routing tokens to other experts). Each gate is now a unit of its own that casts nothing. Flint's attention sinks
    sit beside the attention's bf16 projections in one module, which FSDP cannot keep apart: refused; DDP's autocast
    keeps them."""
    ernie, flint = meta_model(small_moe(), False), meta_model(small_moe("flint"), False)
    units, apart = kept_in_fp32_units(ernie)
    assert units == [layer.mlp.gate for layer in ernie.model.layers] and apart == []
    assert [name for name, _ in units[0].named_parameters()] == ["weight", "moe_statics.e_score_correction_bias"]
    assert kept_in_fp32_units(flint)[1] == ["model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"]
    for strategy in ("fsdp", "fsdp2", "ddp"):
        assert fp32_modules_problem("bf16-mixed", ernie, strategy) is None
        assert fp32_modules_problem("bf16-true", ernie, strategy).endswith("use --precision bf16-mixed")
    for strategy in ("fsdp", "fsdp2"):
        assert fp32_modules_problem("bf16-mixed", flint, strategy) == (
            f"--precision bf16-mixed --strategy {strategy}: FlintForCausalLM keeps model.layers.0.self_attn.sinks, "
            "model.layers.1.self_attn.sinks in float32 (transformers' _keep_in_fp32_modules_strict) in modules beside "
            "bf16 weights, which FSDP's mixed precision gathers in bfloat16 for the forward (a rounded router sends "
            "tokens to other experts); use --strategy ddp, whose autocast keeps them, or --precision 32-true")
        assert fp32_modules_problem("bf16-true", flint, strategy).endswith(
            "use --precision bf16-mixed with --strategy ddp, or --precision 32-true"), "not sent back and forth"
    assert fp32_modules_problem("bf16-mixed", flint, "ddp") is None
    assert fp32_modules_problem("32-true", flint, "fsdp") is None


ROUTER_DTYPES = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, OffloadPolicy
from transformers import AutoModelForCausalLM
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeDecoderLayer
from app.distributed.fsdp2 import UnitsWithEmbeddings, mixed_precision_policy, shard_model
from app.distributed.precision import fsdp_mixed_precision
from tests.test_precision import small_moe
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
model = AutoModelForCausalLM.from_config(small_moe())
layers = {Ernie4_5_MoeDecoderLayer}
if sys.argv[2] == "fsdp2":
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    shard_model(model, mesh, wrap_classes=layers, sharding_strategy="FULL_SHARD", num_nodes=1,
                mp_policy=mixed_precision_policy("bf16-mixed", None), offload_policy=OffloadPolicy(),
                param_init_fn=None)
    forward = model
else:
    forward = FullyShardedDataParallel(model, auto_wrap_policy=UnitsWithEmbeddings(layers), use_orig_params=True,
                                       device_id=torch.device("cpu"),
                                       mixed_precision=fsdp_mixed_precision("bf16-mixed", None))
seen = {}
def record(name):
    def hook(module, args):
        seen.setdefault(name, str(next(module.parameters(recurse=False)).dtype).removeprefix("torch."))
    return hook
layer = model.model.layers[0]
for name, module in (("gate", layer.mlp.gate), ("bias", layer.mlp.gate.moe_statics),
                     ("attention", layer.self_attn.q_proj)):
    getattr(module, "module", module).register_forward_pre_hook(record(name))  # inside FSDP1's wrapper
tokens = torch.randint(0, 256, (1, 8))
forward(input_ids=tokens, labels=tokens).loss.backward()
print(seen["gate"], seen["bias"], seen["attention"])
dist.destroy_process_group()
"""


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_under_fsdps_bf16_mixed_a_router_kept_in_fp32_computes_in_fp32_and_the_rest_in_bf16(tmp_path,
                                                                                           strategy) -> None:
    """The weights each module's forward reads, as FSDP gathered them: the gate and its statistics in float32 (they
    were bfloat16), the attention's projections in bfloat16."""
    result = run_script([sys.executable, "-c", ROUTER_DTYPES, str(tmp_path / "store"), strategy], timeout=120,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["float32", "float32", "bfloat16"]


def test_a_model_with_a_router_kept_in_fp32_and_frozen_statistics_trains_and_resumes_under_fsdp(tiny,
                                                                                               tmp_path) -> None:
    """Ernie-4.5-MoE under fsdp and bf16-mixed: its routers computed in float32 (their own units), and a checkpoint
    of a model with a frozen parameter (the router's statistics, requires_grad=False, no AdamW state) is written and
    resumed exactly; its first save ended in KeyError 'step' under FSDP1 whatever the precision."""
    vocabulary = len(AutoTokenizer.from_pretrained(tiny.tokenizer))
    small_moe(vocab_size=vocabulary, max_position_embeddings=64).save_pretrained(tmp_path / "ernie")
    options = dict(model_config=tmp_path / "ernie", precision="bf16-mixed", max_step=4, save_step_interval=2,
                   eval_step_interval=100, gradient_accumulation_steps=1)
    straight = run_train(train_args(tiny, tmp_path / "straight", **options))
    assert_succeeded(straight)
    assert "Disabling autocast" not in straight.stderr, "Lightning's CUDA autocast, off on CPU processes: no warning"
    resumed = run_train(train_args(tiny, tmp_path / "resumed", resume=True, **options,
                                   checkpoint=tmp_path / "straight" / "checkpoints" / "step-00000002.ckpt"))
    assert_succeeded(resumed)
    first, then = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    for step in (3, 4):
        assert then[step]["train_loss"] == pytest.approx(first[step]["train_loss"], rel=1e-6), step


def test_no_16_true_because_adamw_state_in_float16_loses_the_squared_gradients(capsys) -> None:
    """AdamW's second moment in float16 stores the squared gradient of every entry below ~2.4e-4 as 0: the updates of
    those weights grow with the square root of the step (a 2-layer Llama's loss went 6.0 -> 21.6 in 4 steps on one
    process, while 32-true went to 5.67, and the run finished with exit 0). The choice is not offered."""
    weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    optimizer = torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.0, fused=True)  # as train.py builds it
    for _ in range(5):
        weight.grad = torch.tensor([1e-2, 1e-4, 1e-5], dtype=torch.float16)
        optimizer.step()
    assert optimizer.state[weight]["exp_avg_sq"][1:].eq(0).all(), "the squared gradients underflow"
    assert (weight[1:].float().abs() > 1.5 * 5e-3).all(), "AdamW's steps are lr each, 1.7x larger here"
    from arguments import parse_config

    with pytest.raises(SystemExit) as refused:
        parse_config(["--train_data_dir", "data", "--model_config", "cfg", "--precision", "16-true"])
    assert refused.value.code == 2
    assert "--precision: expected one of bf16-true, bf16-mixed, 16-mixed, 32-true" in capsys.readouterr().err


def test_bf16_true_says_when_adamw_steps_of_the_size_of_lr_are_rounded_away() -> None:
    """bf16-true has no fp32 master weights: a step of 2e-5 leaves a weight of 0.0102 as it was (half a bf16 spacing
    there is 3.1e-5), while one of 0.005 still moves; the note names the magnitude above which steps are lost."""
    step = torch.tensor(2e-5, dtype=torch.bfloat16)
    for weight, moves in ((0.0102, False), (0.02, False), (0.005, True)):
        w = torch.tensor(weight, dtype=torch.bfloat16)
        assert bool(w + step != w) == moves, weight
    note = bf16_rounding_note("bf16-true", 2e-5)
    assert note.startswith("note: --precision bf16-true with --lr 2e-05: bf16 keeps 8 significant bits, and AdamW's "
                           "steps are rounded away on every weight above 1.0e-02 in magnitude")
    assert bf16_rounding_note("bf16-mixed", 2e-5) is None and bf16_rounding_note("bf16-true", 3e-3) is None
    muon = bf16_rounding_note("bf16-true", 2e-5, optimizer="muon")  # which refuses --stochastic_rounding
    assert "Muon's and AdamW's steps are rounded away" in muon and "--stochastic_rounding" not in muon


def test_bf16_true_says_that_norm_gains_and_weight_decay_stand_still_at_a_pre_training_lr() -> None:
    """At lr 1e-3 the note said nothing, while a norm gain of 1.0 never moved (half a bf16 spacing there is 2^-8)
    and decay by lr x weight_decay of a weight is rounded away at any usual lr."""
    gain, step = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1e-3, dtype=torch.bfloat16)
    assert gain - step == gain and gain * (1 - 1e-3 * 0.1) == gain
    assert bf16_rounding_note("bf16-true", 1e-3, 0.1) == (
        "note: --precision bf16-true with --lr 0.001: bf16 keeps 8 significant bits, and AdamW's steps are rounded "
        "away on the norm layers' gains (~1; every weight above 5.1e-01) and on --weight_decay 0.1 (a relative "
        "shrink of 1e-04 per step), more as lr decays; --stochastic_rounding true moves them by their steps on average "
        "for no memory, and --precision bf16-mixed keeps fp32 master weights (twice the training state: "
        "--estimate_memory true shows whether it fits)")
    assert bf16_rounding_note("bf16-true", 3e-3, 0.0) is None


def test_bf16_true_refuses_a_beta2_whose_second_moment_could_never_decrease() -> None:
    """AdamW keeps its moments in the weights' dtype: 0.999 x v rounds back to v in bf16, so after a large gradient
    v stays high and that weight's steps stay small for good; 0.99 still decays."""
    v = torch.tensor(0.0198, dtype=torch.bfloat16)
    assert v * 0.999 + 0.001 * 1e-4 == v and v * 0.99 + 0.01 * 1e-4 < v
    assert bf16_moment_problem("bf16-true", 0.999) == (
        "--beta2 0.999 under --precision bf16-true: AdamW's second moment is stored in bf16, where 0.999 x v rounds "
        "back to v, so it can never decrease after a large gradient; use --beta2 0.99 or lower (0.95, the default), "
        "--stochastic_rounding true, or --precision bf16-mixed")
    assert bf16_moment_problem("bf16-true", 0.99) is None and bf16_moment_problem("bf16-mixed", 0.999) is None


def test_tf32_only_for_fp32_matmuls_on_ampere_and_newer_unless_turned_off() -> None:
    assert float32_matmul_precision("32-true", True, (8, 0)) == "high"
    assert float32_matmul_precision("32-true", False, (9, 0)) == "highest"
    assert float32_matmul_precision("32-true", True, (7, 0)) == "highest"
    assert float32_matmul_precision("32-true", True, None) == "highest", "CPU: no TF32"
    assert float32_matmul_precision("bf16-mixed", True, (9, 0)) == "highest"


def test_gradients_reduce_in_fp32_under_mixed_precision_and_buffers_are_left_alone() -> None:
    assert reduce_dtype("bf16-mixed", None) == torch.float32
    assert reduce_dtype("bf16-mixed", "bfloat16") == torch.bfloat16
    assert reduce_dtype("bf16-true", None) == torch.bfloat16
    assert reduce_dtype("32-true", None) == torch.float32
    policy = fsdp_mixed_precision("bf16-mixed", None)
    assert (policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype) == (torch.bfloat16, torch.float32, None)


def test_16_mixed_gets_an_enabled_fp16_scaler_on_cpu_too() -> None:
    """Lightning's connector would turn 16-mixed into bf16-mixed on CPU and give FSDP a disabled CUDA scaler."""
    ddp = precision_plugin("16-mixed", "ddp", device_type="cpu")
    assert isinstance(ddp, MixedPrecision) and ddp._desired_input_dtype == torch.float16 and ddp.scaler.is_enabled()
    fsdp = precision_plugin("16-mixed", "fsdp", device_type="cpu")
    assert isinstance(fsdp, FSDPPrecision) and fsdp.scaler.is_enabled()
    assert precision_plugin("bf16-mixed", "fsdp", device_type="cpu").scaler is None


def test_a_step_the_spike_guard_does_not_apply_closes_the_scalers_step() -> None:
    """16-mixed with the default --spike_guard skip failed on the step after a skipped one: `unscale_() has already
    been called on this optimizer since the last update()`."""
    from app.optimization.optimizer import GradientPolicy
    from app.training.loop import skip_update

    plugin = precision_plugin("16-mixed", "ddp", device_type="cpu")  # FSDP's scaler is the same but all-reduces
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = GradientPolicy(max_norm=1.0, replicas=1, scaled=True, defer_sync=False)
    for _ in range(2):  # two steps in a row not applied
        plugin.scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        plugin.unscale_gradients(optimizer)
        skip_update(plugin, policy)
        optimizer.zero_grad()


@pytest.mark.parametrize("name, bf16, fp32", [
    ("NVIDIA H200", 989.4, 67.0), ("NVIDIA H200 NVL", 835.5, 60.0), ("NVIDIA H100 80GB HBM3", 989.4, 66.9),
    ("NVIDIA H100 NVL", 835.5, 60.0), ("NVIDIA H100 PCIe", 756.0, 51.2), ("NVIDIA A100-SXM4-80GB", 312.0, 19.5),
    ("NVIDIA A100 80GB PCIe", 312.0, 19.5), ("NVIDIA L4", 121.0, 30.3), ("NVIDIA L40S", 362.05, 91.6),
    ("NVIDIA A10", 125.0, 31.2), ("NVIDIA GeForce RTX 4090", 165.2, 82.6),
    # Lightning's table, which these fell back to, read MFU 24% low for the first (the PCIe card names itself so) and
    # up to 4 times too high for the L40 (as an L4), the A6000, the A40 and GeForce cards (CUDA-core figures)
    ("NVIDIA H100 80GB HBM2e", 756.0, 51.2), ("NVIDIA L40", 181.05, 90.5), ("NVIDIA RTX A6000", 154.8, 38.7),
    ("NVIDIA A40", 149.7, 37.4), ("NVIDIA GeForce RTX 3090", 71.0, 35.6), ("NVIDIA GeForce RTX 4080", 97.5, 48.7),
    ("NVIDIA RTX 6000 Ada Generation", 364.2, 91.1), ("NVIDIA H800", 989.4, 66.9), ("NVIDIA H800 PCIe", 756.0, 51.2),
    ("NVIDIA A800-SXM4-80GB", 312.0, 19.5), ("NVIDIA H20", 148.0, 44.0), ("NVIDIA B200", 2250.0, 75.0),
    ("NVIDIA GB200", 2500.0, 80.0)])
def test_dense_peak_per_gpu_as_torch_names_it(name, bf16, fp32) -> None:
    assert peak_tflops(name, torch.bfloat16, "highest") == bf16
    assert peak_tflops(name, torch.float16, "highest") == bf16
    assert peak_tflops(name, torch.float32, "highest") == fp32
    assert peak_tflops(name, torch.float32, "high") == listed_peak(name).tf32


def test_gpus_without_bf16_and_unlisted_ones() -> None:
    assert peak_tflops("Tesla V100-SXM2-32GB", torch.float16, "highest") == 125.0
    assert peak_tflops("Tesla V100-PCIE-32GB", torch.float16, "highest") == 112.0
    assert peak_tflops("Tesla V100S-PCIE-32GB", torch.float16, "highest") == 130.0, "not the V100 PCIe's 112"
    assert peak_tflops("Tesla T4", torch.bfloat16, "highest") is None
    assert peak_tflops("Tesla T4", torch.float32, "high") == 8.1, "no TF32 before Ampere"
    assert peak_tflops("Some Future GPU", torch.bfloat16, "highest") is None
    for name in ("NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 4080 SUPER", "NVIDIA RTX A4000"):
        assert peak_tflops(name, torch.bfloat16, "highest") is None, f"{name} is not its neighbour in the table"
    assert all(peak.source.startswith("https://") for peak in PEAKS)


def test_mfu_peak_can_be_given_and_cpus_and_unlisted_gpus_have_none(monkeypatch) -> None:
    """An unlisted GPU has no MFU (run.step_clock says to give --peak_tflops), not Lightning's CUDA-core figure."""
    from app.metrics.observe import peak_flops

    assert peak_flops(torch.device("cpu"), "bf16-true") is None
    assert peak_flops(torch.device("cpu"), "bf16-true", override_tflops=989.4) == int(989.4e12)
    for name, peak in (("NVIDIA RTX A5000", None), ("NVIDIA H200", int(989.4e12))):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(torch.device("cuda", 0), "bf16-mixed") == peak


# --- the gradient norm ----------------------------------------------------------------------------------------------


def gradients_of(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(dtype)
    model(torch.randn(16, 64, dtype=dtype)).square().sum().backward()
    return model, torch.optim.AdamW(model.parameters())


def test_weight_decay_spares_norms_and_biases_of_every_shape_as_the_hugging_face_trainer_does() -> None:
    """T5's relative_attention_bias is a 2-D table of attention biases: it was decayed."""
    t5 = meta_model(AutoConfig.for_model("t5", d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64), False)
    exempt = no_decay_names(t5)
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in exempt
    assert "encoder.block.0.layer.0.layer_norm.weight" in exempt and "shared.weight" not in exempt
    assert "encoder.block.0.layer.0.SelfAttention.q.weight" not in exempt
    gpt2 = meta_model(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64), False)
    assert no_decay_names(gpt2) == {name for name, p in gpt2.named_parameters() if p.ndim == 1}


def test_the_built_optimizer_decays_exactly_the_weights_that_are_not_exempt() -> None:
    """The names above reach AdamW's groups: a group of norms and biases built with --weight_decay decayed them
    with no test noticing."""
    from arguments import Config

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    exempt = no_decay_names(gpt2)
    names = {id(p): name for name, p in gpt2.named_parameters()}
    for optimizer_name in ("adamw", "muon"):
        optimizer = build_optimizer(gpt2, Config(weight_decay=0.1, eps=1e-6, optimizer=optimizer_name),
                                    ParameterRoles.of(gpt2))
        adamw = getattr(optimizer, "adamw", optimizer)
        assert {group["eps"] for group in adamw.param_groups} == {1e-6}, "--eps reaches every AdamW group"
        decays = {names[id(p)]: group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
        assert decays == {name: 0.0 if name in exempt else 0.1 for name, _ in gpt2.named_parameters()}
        assert 0 < len(exempt) < len(decays)
    # Muon steps the layers' matrices (GPT-2's Conv1D weights); AdamW the embeddings (positions too), the output
    # layer tied to them, norms and biases
    muon = {names[id(p)] for group in optimizer.muon.param_groups for p in group["params"]}
    assert muon == {f"transformer.h.0.{name}.weight" for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                   "mlp.c_proj")}


def test_gradient_norm_and_clipping_match_torch_in_fp32() -> None:
    model, optimizer = gradients_of(torch.float32)
    norm = gradient_square_sum(optimizer, torch.device("cpu")).sqrt()
    clip_gradients(optimizer, norm, max_norm=1.0)
    clipped = [p.grad.clone() for p in model.parameters()]
    model, _ = gradients_of(torch.float32)
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6) and norm.item() > 1
    assert all(torch.allclose(a, p.grad) for a, p in zip(clipped, model.parameters()))
    before = [p.grad.clone() for p in model.parameters()]
    clip_gradients(torch.optim.AdamW(model.parameters()), norm, max_norm=2 * norm.item())
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters())), "a norm under the limit is kept"


def test_gradient_norm_of_bf16_gradients_is_computed_in_fp32() -> None:
    _, optimizer = gradients_of(torch.bfloat16)
    norm = gradient_square_sum(optimizer, torch.device("cpu")).sqrt()
    exact = torch.cat([p.grad.double().flatten() for group in optimizer.param_groups for p in group["params"]]).norm()
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(exact.item(), rel=1e-6), "a bf16 norm is off by up to 0.4%"


# --- real runs ------------------------------------------------------------------------------------------------------


def probe(tiny, tmp_path: Path, **overrides: object) -> dict:
    """tests/helpers/probe_setup.py: the model set up by train.py's own code in 2 processes, one forward."""
    report = tmp_path / "probe.json"
    args = train_args(tiny, tmp_path / "out", **overrides)
    python, variables = interpreter()
    result = run_script([python, str(ROOT / "tests/helpers/probe_setup.py"), str(report), *args], timeout=300,
                        env=run_environment(variables))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "olmo3"])
def test_rotary_frequencies_named_per_layer_type_are_recomputed_in_fp32_too(model_type) -> None:
    """Gemma-3 and OLMo-3 keep one inv_freq per layer type (`full_attention_inv_freq`, ...): under bf16-true they
    stayed in bf16 (0.01-0.04 of logit difference at 4K tokens against transformers' own bf16 model)."""
    from transformers import AutoConfig

    from app.model.build import keep_rotary_in_fp32

    config = AutoConfig.for_model(model_type, vocab_size=300, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  **({} if model_type == "llama" else
                                     {"layer_types": ["sliding_attention", "full_attention"]}))
    reference = AutoModelForCausalLM.from_config(config)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    keep_rotary_in_fp32(model)
    expected = {name: buffer for name, buffer in reference.named_buffers() if name.endswith("inv_freq")}
    assert len(expected) >= (4 if model_type != "llama" else 2)
    got = dict(model.named_buffers())
    for name, buffer in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], buffer), name


@pytest.mark.slow
@pytest.mark.parametrize("strategy, precision", [("fsdp", "bf16-true"), ("fsdp", "bf16-mixed"), ("fsdp2", "bf16-mixed")])
def test_rotary_frequencies_stay_fp32_and_exact_under_fsdp(tiny, tmp_path, strategy, precision) -> None:
    """bf16-true: Lightning casts every buffer; bf16-mixed: FSDP's buffer_dtype would, at the first forward.
    FSDP2 never casts buffers, and gathers the fp32 weights in bf16 by its own policy (no autocast)."""
    report = probe(tiny, tmp_path, strategy=strategy, precision=precision, gradient_checkpointing=True)
    for moment in ("after_setup", "after_forward"):
        assert report[moment] == {"dtype": "torch.float32", "original_dtype": "torch.float32", "max_difference": 0.0}
    assert report["buffer_dtype"] == "None"
    assert report["reduce_dtype"] == ("torch.float32" if precision == "bf16-mixed" else "torch.bfloat16")
    assert report["param_dtype"] == "torch.bfloat16"
    if strategy == "fsdp":
        assert report["checkpoint_wrappers"] == 2 and not report["hf_gradient_checkpointing"], "each layer wrapped once"
    else:
        assert report["checkpoint_wrappers"] == 0 and report["hf_gradient_checkpointing"], "transformers' own"
    assert report["recomputed_layers"] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_gradient_checkpointing_every_2_recomputes_the_first_of_every_two_layers(tiny, tmp_path, strategy) -> None:
    """FSDP1's checkpoint wrapper (EveryNthLayer) and transformers' own (every_n_layers, under fsdp2, ddp and one
    device) choose the same layers."""
    report = probe(tiny, tmp_path, strategy=strategy, gradient_checkpointing=True, gradient_checkpointing_every=2)
    assert report["recomputed_layers"] == [0]
    assert report["checkpoint_wrappers"] == (1 if strategy == "fsdp" else 0)


@pytest.mark.slow
def test_rotary_frequencies_stay_fp32_under_ddp_with_checkpointing_wrapped_once(tiny, tmp_path) -> None:
    report = probe(tiny, tmp_path, precision="bf16-true", strategy="ddp", gradient_checkpointing=True)
    assert report["after_forward"]["dtype"] == "torch.float32" and report["after_forward"]["max_difference"] == 0
    assert report["checkpoint_wrappers"] == 0 and report["hf_gradient_checkpointing"], "transformers' own, only"


@pytest.fixture(scope="module")
def sharp_model(tiny, tmp_path_factory) -> Path:
    """A 'pretrained' model whose attention is sharp and far-reaching (scaled query/key/value weights), so that its
    loss at 1024 tokens moves by 0.16% when the rotary frequencies are rounded to bf16."""
    folder = tmp_path_factory.mktemp("sharp")
    config = AutoConfig.from_pretrained(tiny.model_config, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for projection, scale in (("q_proj", 50), ("k_proj", 50), ("v_proj", 10), ("o_proj", 10)):
                getattr(layer.self_attn, projection).weight.mul_(scale)
        model.lm_head.weight.mul_(20)
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_long_context_loss_of_a_pretrained_model_in_bf16_matches_transformers(tiny, long_blocks, sharp_model,
                                                                               tmp_path) -> None:
    result = run_train(train_args(tiny, tmp_path, model_config=None, model_name=sharp_model, train_data_dir=long_blocks,
                                  precision="bf16-true", max_step=1, lr=1e-30, min_lr=0, warmup_steps=0, devices=1,
                                  eval_batch_size=2, eval_iters=2, micro_batch_size=1, gradient_accumulation_steps=1))
    assert_succeeded(result)
    logged = read_metrics(tmp_path)[0]["val_loss"]
    reference = AutoModelForCausalLM.from_pretrained(sharp_model, dtype=torch.bfloat16).eval()
    rows = load_from_disk(str(long_blocks))["validation"].with_format("torch")[:4]["input_ids"].long()
    with torch.no_grad():  # the rows of each evaluation batch: 0-1, then 2-3
        expected = sum(reference(input_ids=rows[i:i + 2], labels=rows[i:i + 2]).loss.double() for i in (0, 2)) / 2
    print(f"\nstep-0 validation loss at 1024 tokens, bf16-true: the run's {logged:.4f}, transformers' "
          f"{expected.item():.4f}")
    assert logged == pytest.approx(expected.item(), rel=2e-4), "bf16 rotary frequencies shift this loss by 1.6e-3"


@pytest.mark.slow
def test_16_mixed_trains_with_loss_scaling_under_fsdp_resumes_exactly_and_reports_the_steps_its_scaler_skips(
        tiny, tmp_path) -> None:
    """fp16 with a gradient scaler: Lightning refuses to clip with fused AdamW, so 16-mixed uses foreach AdamW; the
    scaler's state is part of the checkpoint, so a resumed run scales, skips and grows exactly like a straight one.
    A step the scaler skips (overflowed fp16 gradients) spends its data and learning rate without changing a weight:
    the run says so at that step and counts them in its summary (it used to say "0 steps not applied")."""
    options = dict(precision="16-mixed", max_step=8, save_step_interval=4, eval_step_interval=8)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert_succeeded(run_train(train_args(tiny, straight, **options)))
    assert_succeeded(run_train(train_args(tiny, resumed, **options, resume=True,
                                          checkpoint=straight / "checkpoints/step-00000004.ckpt")))
    expected, got = read_metrics(straight), read_metrics(resumed)
    assert expected[8]["train_loss"] < expected[1]["train_loss"] - 0.3
    for step in range(5, 9):
        assert got[step]["train_loss"] == pytest.approx(expected[step]["train_loss"], rel=1e-5)
    scaler = read_checkpoint(resumed / "checkpoints/step-00000008.ckpt")["grad_scaler"]
    assert scaler["scale"] == 2.0 ** 16 and scaler["_growth_tracker"] == 8, "eight scaled steps, none overflowed"
    overflowing = tmp_path / "overflowing" / "checkpoints"
    overflowing.mkdir(parents=True)
    with safe_open(straight / "checkpoints/step-00000004.ckpt", "pt") as file:  # a full checkpoint's layout
        tensors, metadata = {name: file.get_tensor(name) for name in file.keys()}, file.metadata()
    state = json.loads(metadata[METADATA_KEY])
    state["grad_scaler"]["scale"] = 2.0 ** 60  # the next fp16 gradients overflow, as they do at a run's start
    text = json.dumps(state)  # recorded with its checksum, as such a checkpoint would be
    save_file(tensors, overflowing / "step-00000004.ckpt", metadata | {
        METADATA_KEY: text, CHECKSUMS_KEY: encode(with_metadata(decode(metadata[CHECKSUMS_KEY]), text))})
    result = run_train(train_args(tiny, overflowing.parent, **options | dict(max_step=6), resume=True))
    assert_succeeded(result)
    skipped = [step for step, row in read_metrics(overflowing.parent).items() if not math.isfinite(row["grad_norm"])]
    assert skipped and skipped[0] == 5, read_metrics(overflowing.parent)
    for step in skipped:
        assert f"step {step}: fp16 gradients overflowed: the gradient scaler did not apply this step" in result.stdout
    assert f"gradient scaler: {len(skipped)} of the steps not applied" in result.stdout
    assert json.loads((overflowing.parent / "summary.json").read_text())["scaler_skipped_steps"] == len(skipped)
    assert read_checkpoint(overflowing / "step-00000006.ckpt")["scaler_skipped_steps"] == len(skipped)


def test_a_scaler_that_skips_every_step_down_to_a_scale_below_1_stops_the_run_as_non_finite() -> None:
    """Gradients not finite at any scale (an inf in a masked fp16 activation): the scaler halved its scale at every
    step and skipped them all, and the run finished with exit 0 and an untrained model."""
    from types import SimpleNamespace

    from app.training.loop import Loop

    printed: list[str] = []
    for scale, outcome in ((1024.0, False), (0.5, True)):
        precision = SimpleNamespace(scaler=SimpleNamespace(get_scale=lambda scale=scale: scale))
        loop = SimpleNamespace(state={"scaler_skipped_steps": 16}, console=SimpleNamespace(print=printed.append),
                               fabric=SimpleNamespace(strategy=SimpleNamespace(precision=precision)))
        assert Loop.report_scaler_skip(loop, 17) == outcome
    assert printed[-1].startswith("step 17: fp16 gradients overflowed even at a loss scale of 1 (unscaled): stopped "
                                  "without applying this step or saving it")


@pytest.mark.slow
def test_16_mixed_trains_under_ddp(tiny, tmp_path) -> None:
    result = run_train(train_args(tiny, tmp_path, strategy="ddp", precision="16-mixed", max_step=4,
                                  save_step_interval=4, eval_step_interval=4))
    assert_succeeded(result)
    assert "--chunked_loss: --precision 16-mixed keeps the model's own loss" in result.stdout
    assert "deprecated" not in result.stderr, "torch 2.13's DDP warned of broadcast_buffers on every rank"
    metrics = read_metrics(tmp_path)
    assert metrics[4]["train_loss"] < metrics[1]["train_loss"]
    checkpoint = read_checkpoint(tmp_path / "checkpoints/step-00000004.ckpt")
    assert checkpoint["grad_scaler"]["scale"] > 1
    assert "model.embed_tokens.weight" in checkpoint["model"] and checkpoint["step"] == 4, "Hugging Face names"


@pytest.mark.slow
def test_activation_checkpointing_keeps_the_losses_and_lowers_peak_memory(tiny, long_blocks, tmp_path) -> None:
    """A 4-layer, 256-wide Llama on 4 x 1024 tokens, where activations dominate memory (one rank: they are per rank)."""
    wide = tmp_path / "wide"
    LlamaConfig(vocab_size=AutoConfig.from_pretrained(tiny.model_config).vocab_size, hidden_size=256,
                intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=1024).save_pretrained(wide)
    runs = {}
    for checkpointing in (False, True):
        out_dir = tmp_path / f"checkpointing-{checkpointing}"
        assert_succeeded(run_train(train_args(tiny, out_dir, model_config=wide, train_data_dir=long_blocks, devices=1,
                                              gradient_checkpointing=checkpointing, max_step=2, warmup_steps=1,
                                              gradient_accumulation_steps=1, initial_validation=False, eval_iters=1,
                                              eval_batch_size=1), fresh=True))  # its peak RSS is measured
        runs[checkpointing] = read_metrics(out_dir)
    for step in (1, 2):
        assert runs[True][step]["train_loss"] == pytest.approx(runs[False][step]["train_loss"], rel=1e-5)
    saved = runs[False][2]["peak_rss_gb"] - runs[True][2]["peak_rss_gb"]
    print(f"\nactivation checkpointing: peak RSS {runs[False][2]['peak_rss_gb']:.2f} -> "
          f"{runs[True][2]['peak_rss_gb']:.2f} GB")
    assert saved > 0.15, saved


@pytest.mark.parametrize("checkpointing", [True, False])
def test_tpu_runs_checkpoint_their_layers_when_asked(checkpointing, monkeypatch) -> None:
    """--tpu takes Lightning's XLA FSDP strategy, which was given no checkpointing policy, while transformers' own
    checkpointing is only asked for under ddp, fsdp2 and one device: --gradient_checkpointing was dropped, and the
    memory plan still counted it. (torch_xla is not installed here: the strategy is built as far as its arguments.)"""
    from types import SimpleNamespace

    import lightning_fabric.plugins.environments.xla as xla_environment
    import lightning_fabric.strategies.xla_fsdp as xla_fsdp
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from app.distributed.strategy import build_strategy

    for module in (xla_fsdp, xla_environment):
        monkeypatch.setattr(module, "_XLA_AVAILABLE", True)
    cfg = SimpleNamespace(tpu=True, accelerator="auto", strategy="fsdp", state_dict_type="sharded",
                          gradient_checkpointing=checkpointing, gradient_checkpointing_every=1)
    strategy = build_strategy(cfg, world_size=8, wrap_classes={LlamaDecoderLayer})
    assert strategy._activation_checkpointing_policy == ({LlamaDecoderLayer} if checkpointing else None)
