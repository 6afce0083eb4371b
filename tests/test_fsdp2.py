"""--strategy fsdp2: the mapping of the FSDP options onto fully_shard, the refusals, and a pretrained model trained
the way GPU users run it (bf16-mixed, --compile, activation checkpointing) on 2 CPU processes.

Equality with FSDP1 step by step, resume across strategies and conversion are in tests/test_resume_anywhere.py;
exact pretrained weights in tests/test_model_loading.py; rotary buffers in tests/test_precision.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.fsdp2 import mesh_shape, mixed_precision_policy
from app.precision import precision_plugin
from arguments import read_config, validate_config
from tests.conftest import ROOT, read_checkpoint, run_train, train_args
from tests.test_model_loading import pretrained, transformers_loss  # noqa: F401 (fixture)
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
    (["--backward_prefetch", "BACKWARD_POST"], "--backward_prefetch only apply to --strategy fsdp, not fsdp2"),
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
from app.fsdp2 import mixed_precision_policy, shard_model
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=4))
shard_model(model, mesh, wrap_classes={LlamaDecoderLayer}, sharding_strategy="FULL_SHARD", num_nodes=1,
            mp_policy=mixed_precision_policy("32-true", None), offload_policy=OffloadPolicy(), param_init_fn=None)
tokens = torch.randint(0, 64, (1, 8))
loss = model(input_ids=tokens, labels=tokens).loss
print([isinstance(layer.mlp.up_proj.weight, DTensor) for layer in model.model.layers])
loss.backward()
print([isinstance(layer.mlp.up_proj.weight, DTensor) for layer in model.model.layers])
dist.destroy_process_group()
"""


def test_full_shard_keeps_only_the_last_layer_gathered_from_forward_to_backward(tmp_path) -> None:
    """Backward starts with the layer forward ended with: resharding it after forward would only gather it again
    (torchtitan does the same). Every other layer is back to its shard (a DTensor) after forward, and all are after
    backward."""
    result = subprocess.run([sys.executable, "-c", LAST_UNIT_KEPT, str(tmp_path / "store")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["[True, True, False]", "[True, True, True]"]


def test_cpu_offload_on_cpu_processes_is_refused_before_any_work(tiny, tmp_path) -> None:
    result = run_train(train_args(tiny, tmp_path / "out", strategy="fsdp2", cpu_offload=True))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--cpu_offload true with --strategy fsdp2 needs GPUs" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_pretrained_model_trains_under_fsdp2_in_bf16_mixed_compiled_with_checkpointing(tiny, pretrained,
                                                                                          tmp_path) -> None:
    result = run_train(train_args(tiny, tmp_path, model_config=None, model_name=pretrained, strategy="fsdp2",
                                  precision="bf16-mixed", compile=True, gradient_checkpointing=True, max_step=4,
                                  save_step_interval=4, eval_step_interval=4),
                       timeout=600, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert_succeeded(result)
    assert any((tmp_path / "inductor").rglob("*.py")), "torch.compile generated no code: the model ran eagerly"
    metrics = read_metrics(tmp_path)
    reference = transformers_loss(AutoModelForCausalLM.from_pretrained(pretrained), tiny.data)
    assert metrics[0]["val_loss"] == pytest.approx(reference, rel=1e-2), "step 0 is the pretrained model (bf16 matmuls)"
    assert metrics[4]["val_loss"] < metrics[0]["val_loss"]
    saved = read_checkpoint(tmp_path / "checkpoints" / "step-00000004.ckpt")["model"]
    expected = AutoModelForCausalLM.from_pretrained(pretrained).state_dict()
    assert sorted(saved) == sorted(expected), "Hugging Face names, no wrapper prefixes"
    assert all(tensor.dtype == torch.float32 for tensor in saved.values()), "fp32 master weights under bf16-mixed"
