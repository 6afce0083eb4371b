"""One training run: preflight and launch in the launching process, then set-up, fit and save on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning import Fabric

from app.checkpoint import load_checkpoint
from app.data import load_splits
from app.loop import Loop
from app.metrics import make_loggers
from app.model import build_model
from app.optim import build_optimizer
from app.preflight import RunInputs, preflight
from app.exit_codes import EXIT_NON_FINITE, EXIT_PREEMPTED
from app.signals import StopRequest, exit_run, requeue_slurm_job
from app.strategy import build_fabric

if TYPE_CHECKING:
    from arguments import Config


def run(cfg: Config) -> None:
    inputs = preflight(cfg)
    resume_step = int(inputs.resume_from.name.split("-")[1].split(".")[0]) if inputs.resume_from else None
    fabric = build_fabric(cfg, inputs.wrap_classes, make_loggers(cfg, resume_step))
    fabric.launch(main, cfg, inputs)


def initial_state(model: Any, optimizer: Any, cfg: Config, inputs: RunInputs) -> dict[str, Any]:
    """Everything a checkpoint holds and resume restores; values other than model and optimizer are plain data."""
    return {
        "model": model,
        "optimizer": optimizer,
        "step": 0,
        "epoch": 0,
        "position": 0,
        "val_loss": None,
        "rng": None,
        "config": cfg.to_dict(),
        "model_config": inputs.model_config.to_dict(),
        "tokenizer": inputs.tokenizer,
    }


def write_run_files(fabric: Fabric, cfg: Config) -> None:
    from arguments import config_to_yaml

    if fabric.is_global_zero:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "config.yaml").write_text(config_to_yaml(cfg))
    for logger in fabric.loggers:
        logger.log_hyperparams(cfg.to_dict())


def main(fabric: Fabric, cfg: Config, inputs: RunInputs) -> None:
    stop = StopRequest()
    stop.install()
    fabric.seed_everything(cfg.seed)
    splits = load_splits(cfg.train_data_dir)
    model = build_model(fabric, cfg, inputs.model_config)
    optimizer = build_optimizer(model, cfg)
    model, optimizer = fabric.setup(model, optimizer)
    state = initial_state(model, optimizer, cfg, inputs)
    if inputs.resume_from:
        load_checkpoint(fabric, inputs.resume_from, state)
        fabric.print(f"resumed from {inputs.resume_from} at step {state['step']} (epoch {state['epoch']})")
    write_run_files(fabric, cfg)
    plan = inputs.plan
    fabric.print(f"training {plan.max_step} steps of {plan.global_batch_size} sequences x {plan.block_size} tokens "
                 f"({plan.accumulation} accumulation x {plan.micro_batch_size} micro-batch x {plan.world_size} ranks)")
    loop = Loop(fabric=fabric, cfg=cfg, plan=plan, splits=splits, state=state, stop=stop,
                resumed_from=inputs.resume_from)
    outcome = loop.fit()
    if outcome == "non_finite":
        exit_run(fabric, EXIT_NON_FINITE)
    if outcome == "preempted":
        if cfg.requeue_on_signal and fabric.is_global_zero:
            requeue_slurm_job()
        exit_run(fabric, EXIT_PREEMPTED)
    fabric.print(f"done: step {state['step']}, val_loss {state['val_loss']:.4f}")
