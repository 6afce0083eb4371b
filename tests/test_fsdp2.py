"""--strategy fsdp2: the mapping of the FSDP options onto fully_shard, the refusals, and a pretrained model trained
the way GPU users run it (bf16-mixed, --compile, activation checkpointing) under fsdp2 and fsdp, step by step like
the same run without --compile.

Equality with FSDP1 step by step, resume across strategies and conversion are in tests/test_resume_anywhere.py (and
here for a vocabulary large enough that the embeddings get units of their own);
exact pretrained weights in tests/test_model_loading.py; rotary buffers in tests/test_precision.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch.nn import Module
from transformers import (AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, T5Config,
                          T5ForConditionalGeneration)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.t5.modeling_t5 import T5Block

from app.distributed.fsdp2 import (UnitsWithEmbeddings, mesh_shape, mixed_precision_policy, separate_embeddings,
                                   wrap_units)
from app.distributed.precision import precision_plugin
from app.model.build import meta_model
from app.training.preflight import preflight
from arguments import parse_config, read_config, validate_config
from tests.conftest import ROOT, read_checkpoint, run_entry, run_train, train_args
from tests.test_model_loading import pretrained_wide_vocabulary, transformers_loss  # noqa: F401 (fixture)
from tests.test_training import assert_succeeded, read_metrics


@pytest.mark.parametrize("sharding, shape", [("FULL_SHARD", (8,)), ("SHARD_GRAD_OP", (8,)), ("HYBRID_SHARD", (2, 4)),
                                             ("NO_SHARD", (8, 1))])
def test_sharding_strategies_map_onto_device_meshes(sharding, shape) -> None:
    assert mesh_shape(sharding, world_size=8, num_nodes=2) == shape


def test_mixed_precision_is_fsdp2s_policy_and_not_autocast() -> None:
    mixed = mixed_precision_policy("bf16-mixed", None)
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy("bf16-mixed", "bfloat16").reduce_dtype == torch.bfloat16
    true = mixed_precision_policy("bf16-true", None)
    assert (true.param_dtype, true.reduce_dtype) == (None, torch.bfloat16), "the weights are bf16 already"
    assert type(precision_plugin("bf16-mixed", "fsdp2", "cpu")).__name__ == "Precision", "no autocast on top"


@pytest.mark.parametrize("options, message", [
    (["--backward_prefetch", "BACKWARD_POST"], "--backward_prefetch applies only to --strategy fsdp, not fsdp2"),
    (["--precision", "16-mixed"], "--precision 16-mixed needs FSDP1's sharded gradient scaler"),
])
def test_options_fsdp2_has_no_use_for_are_refused(options, message) -> None:
    cfg = read_config(["--strategy", "fsdp2", "--model_config", "m", "--train_data_dir", "d", *options])
    assert any(message in problem for problem in validate_config(cfg))


LAST_UNIT_KEPT = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from app.distributed.fsdp2 import mixed_precision_policy, shard_model
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
model = LlamaForCausalLM(LlamaConfig(vocab_size=int(sys.argv[2]), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4))
shard_model(model, mesh, wrap_classes={LlamaDecoderLayer}, sharding_strategy="FULL_SHARD", num_nodes=1,
            mp_policy=mixed_precision_policy("32-true", None), offload_policy=OffloadPolicy(), param_init_fn=None)
tokens = torch.randint(0, 64, (1, 8))
loss = model(input_ids=tokens, labels=tokens).loss
def sharded():
    return ([isinstance(layer.mlp.up_proj.weight, DTensor) for layer in model.model.layers],
            [isinstance(module.weight, DTensor) for module in (model.model.embed_tokens, model.lm_head)])
print(*sharded())
loss.backward()
print(*sharded())
dist.destroy_process_group()
"""


@pytest.mark.parametrize("vocab_size, embeddings_after_forward", [(64, "[False, False]"), (1024, "[True, False]")],
                         ids=["embeddings-in-the-root", "embeddings-as-units"])
def test_full_shard_keeps_only_the_last_layer_gathered_from_forward_to_backward(tmp_path, vocab_size,
                                                                                embeddings_after_forward) -> None:
    """Backward starts with the layer forward ended with, and with lm_head: resharding them after forward would only
    gather them again (torchtitan does the same). Every other layer is back to its shard (a DTensor) after forward,
    and so are the input embeddings when they are a unit of their own (else the root keeps them); all are after
    backward."""
    result = subprocess.run([sys.executable, "-c", LAST_UNIT_KEPT, str(tmp_path / "store"), str(vocab_size)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [f"[True, True, False] {embeddings_after_forward}",
                                          "[True, True, True] [True, True]"]


def small_llama(vocab_size: int, **overrides) -> LlamaForCausalLM:
    """Layers of 10,304 parameters; embeddings of 32 x vocab_size."""
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, **overrides))


def embedding_units(model: Module, wrap_class: type[Module]) -> tuple[Module | None, Module | None]:
    return separate_embeddings(model, wrap_units(model, {wrap_class}))


def test_embeddings_as_large_as_a_layer_get_units_of_their_own_unless_tied_or_shared() -> None:
    """Llama-3-8B's embeddings (128K x 4096) are 2.4 layers each; Mistral-7B's (32K x 4096) 0.6 of one."""
    large = small_llama(vocab_size=1024)  # 32,768 parameters
    assert embedding_units(large, LlamaDecoderLayer) == (large.lm_head, large.model.embed_tokens)
    assert embedding_units(small_llama(vocab_size=320), LlamaDecoderLayer) == (None, None), "10,240 parameters"
    assert embedding_units(small_llama(vocab_size=1024, tie_word_embeddings=True), LlamaDecoderLayer) == (None, None)
    assert separate_embeddings(large, []) == (None, None), "no layers to compare with: all in the root"
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=1024, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))
    assert embedding_units(t5, T5Block) == (None, None), "transformers ties T5's embeddings"
    t5.lm_head.weight = torch.nn.Parameter(t5.lm_head.weight.detach().clone())
    assert embedding_units(t5, T5Block) == (t5.lm_head, None), "the encoder and the decoder share the input embeddings"


def test_fsdp1_wraps_the_units_fsdp2_shards_in_the_same_order() -> None:
    """FSDP1's auto-wrap policy makes the embeddings units too (they stayed gathered in its root all step), and
    FSDP1 materialises a meta model unit by unit in this order: fsdp2 follows it, so both start from the same
    weights."""
    large = small_llama(vocab_size=1024)
    units = set(UnitsWithEmbeddings({LlamaDecoderLayer})._run_policy(large, set(), {}))
    expected = wrap_units(large, {LlamaDecoderLayer}, also={large.lm_head, large.model.embed_tokens})
    assert expected == [large.model.embed_tokens, *large.model.layers, large.lm_head]
    assert units == set(expected), "and the root, which FSDP wraps whatever the policy"
    small = small_llama(vocab_size=320)
    assert set(UnitsWithEmbeddings({LlamaDecoderLayer})._run_policy(small, set(), {})) == set(small.model.layers)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_cpu_offload_on_cpu_processes_is_refused_before_any_work(tiny, tmp_path, capsys, strategy) -> None:
    """FSDP1 failed in every rank pinning memory, after the run had written config.yaml and metrics.csv (and the
    same command was then refused for them)."""
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, tmp_path / "out", strategy=strategy, cpu_offload=True)))
    assert exit_info.value.code == 2
    assert f"--cpu_offload true with --strategy {strategy} needs GPUs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fsdp1_cpu_offload_with_accumulation_outside_no_sync_is_refused(tiny, tmp_path) -> None:
    """FSDP1 copies each micro-batch's reduced gradient over the offloaded one instead of adding it (torch documents
    it unsupported; `prepare_gradient_for_backward` leaves an offloaded gradient out of the sum): on GPUs every step
    trained on its last micro-batch alone. On CPU processes offloading is refused before; the check is asked here."""
    from app.optimization.schedule import make_plan
    from app.training.preflight.plan import check_offloaded_accumulation

    def problems(accumulation: int, **options) -> list[str]:
        cfg = parse_config(train_args(tiny, tmp_path / "out", cpu_offload=True, **options))
        plan = make_plan(train_rows=100, block_size=32, world_size=2, micro_batch_size=4, accumulation=accumulation,
                         number_epochs=1, max_step=None)
        found: list[str] = []
        check_offloaded_accumulation(cfg, plan, found)
        return found

    assert problems(2) == ["--cpu_offload true with 2 micro-batches per step: FSDP1 keeps only the last one's offloaded "
                           "gradient; add --fsdp_no_sync true (gradients add up unsharded until the last "
                           "micro-batch), or use --strategy fsdp2"]
    assert problems(2, fsdp_no_sync=True) == problems(1) == problems(2, strategy="fsdp2") == []


ONE_RANK = dict(devices=1, gradient_accumulation_steps=4, eval_iters=8)
COMPILED_RUNS = {
    "fsdp compiled, 1 rank": dict(strategy="fsdp", compile=True, **ONE_RANK),
    "fsdp2 compiled, 1 rank": dict(strategy="fsdp2", compile=True, **ONE_RANK),
    "fsdp2 eager": dict(strategy="fsdp2", compile=False),
}
"""The same steps and evaluation rows in each (1 rank x 4 accumulation = 2 ranks x 2). The compiled runs share one
inductor cache: after FSDP1's graphs, FSDP2 costs 27 CPU-s instead of 67. One rank is enough for both: the units'
hooks, and so their collectives, run outside the compiled graphs, which see the same gathered parameters (FSDP2's
hooks are `_dynamo_disable`d; FSDP1's units run their hooks around the compiled layers). Two ranks compiled every
graph twice, at once (FSDP1: 120 CPU-s on 2 ranks), for nothing the graphs see."""


@pytest.mark.slow
def test_a_pretrained_model_trains_compiled_in_bf16_mixed_with_checkpointing_like_eager_under_both_strategies(
        tiny, pretrained_wide_vocabulary, tmp_path) -> None:
    """Every kind of unit under compile: the layers, the embeddings (a padded vocabulary, as Llama-3's; fsdp2 gives
    them units of their own) and the root. The weights are loaded through the compiled wrapper, whose keys carry
    `_orig_mod.`: once that loaded nothing (5 of 21 tensors right, the all-ones norms) and the run trained from
    random weights without a word."""
    inductor_cache, runs = tmp_path / "inductor", {}
    for name, options in COMPILED_RUNS.items():
        out_dir = tmp_path / name.replace(" ", "-").replace(",", "")
        result = run_train(train_args(tiny, out_dir, model_config=None, model_name=pretrained_wide_vocabulary,
                                      precision="bf16-mixed", gradient_checkpointing=True, max_step=4,
                                      save_step_interval=4, eval_step_interval=4, **options),
                           timeout=600, env={"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)})
        assert_succeeded(result)
        assert "Profiler" not in result.stderr, "Dynamo's line that it ignores the strategy's profiler annotations"
        runs[name] = read_metrics(out_dir), read_checkpoint(out_dir / "checkpoints" / "step-00000004.ckpt")["model"]
    assert any(inductor_cache.rglob("*.py")), "torch.compile generated no code: the models ran eagerly"
    reference = transformers_loss(AutoModelForCausalLM.from_pretrained(pretrained_wide_vocabulary), tiny.data)
    expected = AutoModelForCausalLM.from_pretrained(pretrained_wide_vocabulary).state_dict()
    eager, _ = runs["fsdp2 eager"]
    for name, (metrics, saved) in runs.items():
        assert metrics[0]["val_loss"] == pytest.approx(reference, rel=1e-4), f"{name}: step 0 is the pretrained model"
        assert metrics[4]["val_loss"] < metrics[0]["val_loss"], name
        for step in (1, 2, 3, 4):  # 2e-5 apart here: the fused kernels round bf16 otherwise than eager's
            assert metrics[step]["train_loss"] == pytest.approx(eager[step]["train_loss"], rel=1e-3), (name, step)
        assert sorted(saved) == sorted(expected), f"{name}: Hugging Face names, no wrapper prefixes"
        assert all(tensor.dtype == torch.float32 for tensor in saved.values()), f"{name}: fp32 master weights"


@pytest.fixture(scope="module")
def wide_vocabulary(tiny, tmp_path_factory):
    """The tiny setup with its vocabulary padded to 2048 rows (as users pad theirs): each embedding then has more
    parameters than a layer, so fsdp2 gives lm_head and the input embeddings units of their own."""
    config = AutoConfig.from_pretrained(tiny.model_config)
    config.vocab_size = 2048
    path = tmp_path_factory.mktemp("wide-vocabulary")
    config.save_pretrained(path)
    model = meta_model(config)
    assert embedding_units(model, LlamaDecoderLayer) == (model.lm_head, model.model.embed_tokens)
    return replace(tiny, model_config=path)


@pytest.mark.slow
def test_embeddings_with_units_of_their_own_train_like_fsdp_resume_exactly_and_convert(wide_vocabulary,
                                                                                       tmp_path) -> None:
    """FSDP2 with the embeddings as units starts from FSDP1's weights (initialised in FSDP1's order), takes its
    steps, resumes exactly from its sharded checkpoint, and converts with identical logits."""
    constant = dict(lr_decay=False, min_lr=None, warmup_steps=0, eval_step_interval=100, save_step_interval=2)
    assert_succeeded(run_train(train_args(wide_vocabulary, tmp_path / "fsdp", max_step=4, **constant)))
    fsdp2 = tmp_path / "fsdp2"
    for max_step in (2, 4):
        assert_succeeded(run_train(train_args(wide_vocabulary, fsdp2, strategy="fsdp2", state_dict_type="sharded",
                                              max_step=max_step, resume=max_step > 2, **constant)))
    reference, resumed = read_metrics(tmp_path / "fsdp"), read_metrics(fsdp2)
    for step in range(1, 5):
        assert resumed[step]["train_loss"] == pytest.approx(reference[step]["train_loss"], rel=1e-4), step
    converted = run_entry(["convert_to_hf.py", "--checkpoint", str(fsdp2), "--output_dir", str(tmp_path / "hf"),
                           "--dtype", "float32"])
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert "logits verified (max relative difference 0.0e+00)" in converted.stdout + converted.stderr
