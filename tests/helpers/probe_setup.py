"""Set a model up exactly as train.py does, run one forward, and write what tests cannot see from outside a run.

    python tests/helpers/probe_setup.py REPORT.json <train.py options>

Runs on every rank (Lightning's launcher re-runs this script for the other ranks); rank 0 writes the report:
the rotary buffers' dtype and their largest difference from transformers' own fp32 values, the wrappers applied
for activation checkpointing and the layers they recompute, and FSDP's (or FSDP2's) mixed-precision policy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

from app.data import load_data  # noqa: E402
from app.distributed.strategy import build_fabric  # noqa: E402
from app.exit_codes import EXIT_FINISHED  # noqa: E402
from app.model.build import deferred_init, hugging_face_model, setup_model, strategy_module  # noqa: E402
from app.reliability.signals import run_and_exit  # noqa: E402
from app.training.preflight import preflight  # noqa: E402
from arguments import parse_config  # noqa: E402


def rotary_report(module: torch.nn.Module, model_config) -> dict:
    reference = AutoModelForCausalLM.from_config(model_config).model.rotary_emb.inv_freq
    rotary = hugging_face_model(module).model.rotary_emb
    return {"dtype": str(rotary.inv_freq.dtype), "original_dtype": str(rotary.original_inv_freq.dtype),
            "max_difference": (rotary.inv_freq.cpu().double() - reference.double()).abs().max().item()}


def recomputed_layers(module: torch.nn.Module) -> list[int]:
    """The decoder layers recomputed in backward, by index: in FSDP1's checkpoint wrapper, or by transformers."""
    layers = [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]
    wrapped = {id(m._checkpoint_wrapped_module) for m in module.modules() if isinstance(m, CheckpointWrapper)}
    return [index for index, layer in enumerate(layers) if layer.gradient_checkpointing or id(layer) in wrapped]


def probe(fabric, cfg, inputs, deferred, report: str) -> int:
    model, _, _ = setup_model(fabric, cfg, inputs.model_config, deferred)
    module = strategy_module(model)
    after_setup = rotary_report(module, inputs.model_config)
    rows = fabric.to_device(load_data(cfg.train_data_dir).train[:2]["input_ids"])
    with torch.no_grad():
        model(input_ids=rows)
    mixed_precision = getattr(module, "mixed_precision", None)  # FSDP1's policy
    if isinstance(module, FSDPModule):
        mixed_precision = fully_shard.state(module)._mp_policy
    if fabric.is_global_zero:
        Path(report).write_text(json.dumps({
            "after_setup": after_setup,
            "after_forward": rotary_report(module, inputs.model_config),
            "checkpoint_wrappers": sum(isinstance(m, CheckpointWrapper) for m in module.modules()),
            "hf_gradient_checkpointing": hugging_face_model(module).is_gradient_checkpointing,
            "recomputed_layers": recomputed_layers(module),
            "reduce_dtype": str(mixed_precision.reduce_dtype) if mixed_precision else None,
            "buffer_dtype": str(getattr(mixed_precision, "buffer_dtype", None)) if mixed_precision else None,
            "param_dtype": str(mixed_precision.param_dtype) if mixed_precision else None,
        }))
    return EXIT_FINISHED


def main() -> None:
    report, cfg = sys.argv[1], parse_config(sys.argv[2:])
    inputs = preflight(cfg)
    deferred = deferred_init(cfg, inputs.model_config)
    fabric = build_fabric(cfg, inputs.plan.world_size, inputs.wrap_classes, [],
                          deferred.param_init_fn if deferred else None)
    fabric.launch(run_and_exit, probe, cfg, inputs, deferred, report)


if __name__ == "__main__":
    main()
