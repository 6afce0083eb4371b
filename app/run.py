"""One training run: preflight and launch in the launching process, then set-up, fit and save on every rank."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning import Fabric

from app.checkpoint import load_checkpoint
from app.data import load_splits
from app.console import Console
from app.loop import Loop
from app.metrics import make_loggers, report_summary
from app.memory_plan import ModelShape, memory_report, setup_of
from app.model import DeferredInit, build_model, deferred_init, load_pretrained_weights, weights_dtype
from app.observe import StepClock, Stopwatch, flops_per_micro_batch, peak_flops
from app.optim import build_optimizer, no_decay_names
from app.preflight import RunInputs, preflight
from app.exit_codes import EXIT_FINISHED, EXIT_INTERRUPTED, EXIT_NON_FINITE, EXIT_PREEMPTED
from app.signals import StopRequest, exit_run, requeue_slurm_job
from app.strategy import build_fabric, resolve_accelerator
from app.watchdog import LAUNCHER_HEAD_START_SEC, RendezvousDeadline, StallWatchdog, print_stacks_on_signal
from app.workers import start_worker_server

if TYPE_CHECKING:
    from arguments import Config

EXIT_CODES = {"finished": EXIT_FINISHED, "preempted": EXIT_PREEMPTED, "interrupted": EXIT_INTERRUPTED,
              "non_finite": EXIT_NON_FINITE}


def run(cfg: Config) -> None:
    print_stacks_on_signal()
    inputs = preflight(cfg)
    if cfg.estimate_memory:
        shape = ModelShape.of(inputs.model_config, inputs.wrap_classes, cfg.trust_remote_code)
        print(memory_report(cfg, shape, setup_of(cfg, inputs.plan.world_size, inputs.plan.block_size)))
        return
    resume_step = int(inputs.resume_from.name.split("-")[1].split(".")[0]) if inputs.resume_from else None
    deferred = deferred_init(cfg, inputs.model_config)
    param_init_fn = deferred.param_init_fn if deferred else None
    if cfg.num_workers:
        start_worker_server()
    fabric = build_fabric(cfg, inputs.wrap_classes, make_loggers(cfg, resume_step), param_init_fn)
    bound_rendezvous(cfg, fabric, inputs.plan.world_size)
    fabric.launch(main, cfg, inputs, deferred)


def bound_rendezvous(cfg: Config, fabric: Fabric, world_size: int) -> None:
    """Start the rendezvous deadline (for torch.distributed: XLA's ranks meet otherwise), and block SIGINT in this
    thread until StopRequest unblocks it: the ranks Lightning's launcher starts inherit the mask, so that a Ctrl-C
    while their interpreter starts cannot print a KeyboardInterrupt; here the deadline's thread takes it meanwhile
    (SIGINT's default action ends the process)."""
    if world_size == 1 or resolve_accelerator(cfg) == "tpu":
        return
    RendezvousDeadline(cfg.rendezvous_timeout_min * 60, nodes=cfg.num_nodes, world_size=world_size,
                       node_rank=fabric.node_rank, local_rank=fabric.local_rank).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


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


def step_clock(fabric: Fabric, cfg: Config, inputs: RunInputs, start_step: int) -> StepClock:
    """Throughput from the step counts; FLOP/s and MFU when the model's FLOPs can be counted and the chip is known."""
    plan = inputs.plan
    try:
        flops = flops_per_micro_batch(inputs.model_config, plan.micro_batch_size, plan.block_size,
                                      cfg.trust_remote_code) * plan.accumulation
    except Exception as error:  # an architecture FlopCounter cannot trace on the meta device: throughput only
        fabric.print(f"FLOP/s and MFU are not reported: counting the model's FLOPs failed ({error})")
        flops = None
    return StepClock(start_step=start_step, max_step=plan.max_step, window=cfg.log_interval,
                     world_size=plan.world_size, samples_per_step=plan.global_batch_size,
                     tokens_per_step=plan.tokens_per_step, flops_per_step=flops,
                     available_flops=peak_flops(fabric.device, cfg.precision))


def stall_watchdog(fabric: Fabric, cfg: Config) -> StallWatchdog:
    head_start = 0.0 if fabric.local_rank == 0 else LAUNCHER_HEAD_START_SEC
    return StallWatchdog(cfg.stall_timeout_min * 60, rank=fabric.global_rank, head_start_sec=head_start).start()


def main(fabric: Fabric, cfg: Config, inputs: RunInputs, deferred: Optional[DeferredInit]) -> None:
    stop = StopRequest()
    stop.install(announce=fabric.is_global_zero)
    fabric.seed_everything(cfg.seed)
    splits = load_splits(cfg.train_data_dir)
    model = build_model(fabric, cfg, inputs.model_config, deferred)
    no_decay = no_decay_names(model)
    model = fabric.setup_module(torch.compile(model) if cfg.compile else model)
    if deferred and deferred.weight_files:
        load_pretrained_weights(model._forward_module, deferred.weight_files, weights_dtype(cfg.precision))
    optimizer = fabric.setup_optimizers(build_optimizer(model, cfg, no_decay))
    state = initial_state(model, optimizer, cfg, inputs)
    if inputs.resume_from:
        loading = Stopwatch()
        with loading.measure():
            load_checkpoint(fabric, inputs.resume_from, state)
        fabric.print(f"resumed from {inputs.resume_from} at step {state['step']} (epoch {state['epoch']}) "
                     f"in {loading.last:.1f} s")
    write_run_files(fabric, cfg)
    plan = inputs.plan
    fabric.print(f"training {plan.max_step} steps of {plan.global_batch_size} sequences x {plan.block_size} tokens "
                 f"({plan.accumulation} accumulation x {plan.micro_batch_size} micro-batch x {plan.world_size} ranks)")
    console = Console(enabled=fabric.is_global_zero, start_step=state["step"], max_step=plan.max_step)
    loop = Loop(fabric=fabric, cfg=cfg, plan=plan, splits=splits, state=state, stop=stop,
                clock=step_clock(fabric, cfg, inputs, state["step"]), console=console,
                watchdog=stall_watchdog(fabric, cfg), resumed_from=inputs.resume_from)
    outcome = loop.fit()
    loop.watchdog.disarm()
    console.close()
    report_summary(fabric, cfg.out_dir, loop.summarize(), console)
    if outcome == "preempted" and cfg.requeue_on_signal and fabric.is_global_zero:
        requeue_slurm_job()
    exit_run(fabric, EXIT_CODES[outcome])
