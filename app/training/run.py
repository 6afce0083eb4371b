"""One training run: preflight and launch in the launching process, then set-up, fit and save on every rank."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from contextlib import nullcontext, redirect_stdout
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning_fabric import Fabric

from app.checkpoint import (CheckpointError, CheckpointSaver, SaveFailed, checkpoint_dir, list_checkpoints,
                            load_on_every_rank, read_metadata, resume_rng, run_tokenizer_dir, set_aside_newer)
from app.checkpoint.files import (RUN_CONFIG_FILE, claim_run_folder, make_durable, move_aside, publish,
                                  remove_leftovers, temporary_path)
from app.checkpoint.io import validation_measured, validation_measured_by
from app.choices import SHARDED_STRATEGIES
from app.cli import first_line
from app.data import TrainingData, load_data
from app.data.loader import workers_that_fit
from app.data.mixture import parse_sources, position_at_weight
from app.distributed.device_memory import expandable_segments
from app.distributed.host_memory import tune_cpu_heap
from app.distributed.precision import compute_dtype, float32_matmul_precision, restore_grad_scaler, uses_grad_scaler
from app.distributed.strategy import build_fabric, gradient_replicas, resolve_accelerator
from app.evaluation.samples import (SampleEvaluator, decoding_for, fit_to_context, references_past, sample_notes,
                                    set_aside_samples_after, stop_ids, whole_samples)
from app.exit_codes import (EXIT_BAD_INPUT, EXIT_CORRUPT_CHECKPOINT, EXIT_CRASHED, EXIT_FINISHED, EXIT_INTERRUPTED,
                            EXIT_NON_FINITE, EXIT_PREEMPTED, EXIT_RENDEZVOUS_TIMEOUT, EXIT_SAVE_FAILED, EXIT_SPIKES)
from app.folders import discard, replace_file
from app.hub import hub_commit
from app.metrics.console import Console
from app.metrics.loggers import SUMMARY_FILE, RowRecord, WandbFailed, log_lost_row, make_loggers, report_summary
from app.metrics.memory_plan import ModelShape, Unplannable, memory_report, setup_of
from app.metrics.observe import StepClock, Stopwatch, flops_per_micro_batch, peak_flops
from app.metrics.profiling import profile_window, profiled_steps
from app.model.build import DeferredInit, deferred_init, setup_model
from app.model.loss import LossPath
from app.optimization.optimizer import GradientPolicy, build_optimizer
from app.optimization.schedule import TrainingPlan, continuing_position, tokens_read
from app.reliability.signals import (StopRequest, end_ranks_on_signal_until_training, requeue_slurm_job,
                                     requeues_itself, run_and_exit)
from app.reliability.spikes import QUARANTINE_FILE, SpikeGuard, SpikeHistory, SpikeRules, write_quarantine
from app.reliability.watchdog import (LAUNCHER_HEAD_START_SEC, RendezvousDeadline, StallWatchdog, end_process_tree,
                                     print_stacks_on_signal, say, take_over_launcher_observer)
from app.reliability.workers import start_worker_server
from app.tasks import LAUNCHER_PID, exit_refused
from app.training.loop import Loop
from app.training.nodes import nodes_disagree, resume_disagreement, unshared_out_dir
from app.training.preflight import RunInputs, note, preflight
from app.training.print_config import resolved_run
from app.training.progress import SAVED_FOR_THE_RANKS, patience_carried_over, progress_at_start, saved_progress
from app.versions import library_versions

if TYPE_CHECKING:
    from arguments import Config

EXIT_CODES = {"finished": EXIT_FINISHED, "preempted": EXIT_PREEMPTED, "interrupted": EXIT_INTERRUPTED,
              "non_finite": EXIT_NON_FINITE, "spikes": EXIT_SPIKES}


def run(cfg: Config, sources: Optional[dict[str, str]] = None) -> None:
    """Train as `cfg` says; `sources` (arguments.option_sources) says where each option came from, for
    --print_config."""
    print_stacks_on_signal()
    with redirect_stdout(sys.stderr) if cfg.print_config else nullcontext():  # what it notes stays out of the YAML
        inputs = preflight(cfg, sources)
    if cfg.print_config:
        print(resolved_run(cfg, inputs, sources or {}))
        return
    cfg = inputs.config
    if cfg.estimate_memory:
        shape = ModelShape.of(inputs.model_config, inputs.wrap_classes, cfg.trust_remote_code, cfg.freeze)
        block_size = cfg.block_size or inputs.plan.block_size
        try:
            report, fits = memory_report(cfg, shape, setup_of(cfg, inputs.plan.world_size, block_size,
                                                              inputs.plan.accumulation, inputs.chunked_loss,
                                                              inputs.target_block_size))
        except Unplannable as error:
            exit_refused([f"error: {error}"])
        print(report + (f"\ndata: a mixture of\n{inputs.mixture}" if inputs.mixture else ""))
        if not fits:  # a script planning runs reads the answer from the exit code
            sys.exit(EXIT_BAD_INPUT)
        return
    if inputs.resume_step is not None and inputs.resume_step >= inputs.plan.max_step:
        note(f"--resume: the checkpoint at step {inputs.resume_step} is where this run ends: nothing to train, "
             "nothing written (give a larger --max_step, --max_tokens or --number_epochs to train on)")
        return  # a relaunch of a finished run replaced its summary.json with one of 0 steps
    if inputs.resume_stopped_early:
        note(inputs.resume_stopped_early)
        return
    if resolve_accelerator(cfg) == "cpu":
        tune_cpu_heap()
    elif resolve_accelerator(cfg) == "cuda":
        expandable_segments()
    deferred = deferred_init(cfg, inputs.model_config)
    param_init_fn = deferred.param_init_fn if deferred else None
    if cfg.num_workers:
        start_worker_server()
    fabric = build_fabric(cfg, inputs.plan.world_size, inputs.wrap_classes, make_loggers(cfg, inputs.resume_step),
                          param_init_fn)
    bound_rendezvous(cfg, fabric, inputs.plan.world_size)
    take_over_launcher_observer()
    try:
        fabric.launch(run_and_exit, main, cfg, inputs, deferred)
    except dist.DistNetworkError as error:  # the ranks could not meet: the node hosting the store ended first
        if dist.is_initialized():
            raise
        if "EADDRINUSE" in str(error):  # another job's rendezvous on this node: requeued by the Slurm scripts
            say(f"rank {fabric.global_rank}: the ranks could not meet: port {os.environ.get('MASTER_PORT', '?')} on "
                "this node is another process's (another job's on a shared node?); set MASTER_PORT to a free port, "
                f"as the Slurm scripts do (exit {EXIT_RENDEZVOUS_TIMEOUT})\n")
            end_process_tree(EXIT_RENDEZVOUS_TIMEOUT, stacks=False)
        say(f"rank {fabric.global_rank}: the run's other processes could not be reached as the ranks met "
            f"({first_line(error)}): a node that ended first says why in its own output\n")
        end_process_tree(EXIT_CRASHED, stacks=False)


def bound_rendezvous(cfg: Config, fabric: Fabric, world_size: int) -> None:
    """Start the rendezvous deadline (for torch.distributed: XLA's ranks meet otherwise); until StopRequest takes
    over, a stop signal or Ctrl-C ends this process with the ranks it starts; and block SIGINT in this thread until
    StopRequest unblocks it: the ranks Lightning's launcher starts inherit the mask, so that a Ctrl-C while their
    interpreter starts cannot print a KeyboardInterrupt (here the signals' thread takes it meanwhile)."""
    if world_size == 1 or resolve_accelerator(cfg) == "tpu":
        return
    RendezvousDeadline(cfg.rendezvous_timeout_min * 60, nodes=cfg.num_nodes, world_size=world_size,
                       node_rank=fabric.node_rank, local_rank=fabric.local_rank).start()
    end_ranks_on_signal_until_training(cfg.requeue_on_signal)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    if int(os.environ.get("LOCAL_RANK") or 0) == 0:  # the launching process (a rank keeps its launcher's)
        os.environ[LAUNCHER_PID] = str(os.getpid())  # for the ranks it starts: app/tasks.py end_with_the_launcher


def initial_state(model: Any, optimizer: Any, cfg: Config, inputs: RunInputs) -> dict[str, Any]:
    """Everything a checkpoint holds: the model and optimizer, where training stands (app/training/progress.py), what
    the ranks restore for themselves, and what describes the run; values other than model and optimizer are plain
    data."""
    return {
        "model": model,
        "optimizer": optimizer,
        **progress_at_start(),
        **dict.fromkeys(SAVED_FOR_THE_RANKS),  # set when saving
        "global_batch_size": inputs.plan.global_batch_size,
        "config": cfg.to_dict(),
        "cwd": os.getcwd(),  # where the config's relative paths (--model_name) lead: convert_to_hf.py reads from it
        "model_config": inputs.model_config.to_dict(),
        # the commit of a Hub model's files (none for a folder), which a resume keeps whatever the Hub id loads by
        # then: conversion reads the model's generation config there
        "base_revision": inputs.base_revision or hub_commit(cfg.model_name),
        "base_model": inputs.base_model,  # for --init_from: the model its checkpoint's run started from
        "tokenizer": inputs.tokenizer,  # as given; out_dir/tokenizer/ holds a copy (keep_tokenizer_with_run)
        "data_folders": inputs.data_folders,  # what identifies each data folder, for a resume from anywhere
        "versions": library_versions(),  # of the libraries that wrote it (the converted model's card lists them)
    }


def resume(fabric: Fabric, cfg: Config, path: Path, state: dict[str, Any], plan: TrainingPlan) -> Optional[str]:
    """Load the checkpoint into the model and optimizer, then continue its counters, random states and scaler.
    Returns, the same on every rank, why the checkpoint could not be read whole (a piece whose checksum differs: the
    checkpoint is corrupt)."""
    loading = Stopwatch()
    with loading.measure():
        saved, unreadable = load_on_every_rank(path, state["model"], state["optimizer"])
    if unreadable:
        return unreadable
    state |= saved_progress(saved)
    patience_carried_over(state, validation_measured(saved),
                          validation_measured_by(state["config"], state["data_folders"], fabric.world_size))
    state["tokens_read"] = tokens_read(saved, plan)
    if state["mixture"]:  # its rows follow state["mixture"]; its epoch is a pass over the first folder, at its weight
        state["position"] = position_at_weight(state["position"], state["mixture"], parse_sources(cfg.train_data_dir))
    state["epoch"], state["position"] = continuing_position(state["epoch"], state["position"], plan)
    own_rng = resume_rng(saved["rng"], fabric.global_rank, cfg.seed, state["step"])
    restore_grad_scaler(fabric.strategy.precision, saved)
    say_once(fabric, f"resumed from {path} at step {state['step']} (epoch {state['epoch']}, sample "
                     f"{state['position']} of the epoch) in {loading.last:.1f} s")
    if fabric.is_global_zero:  # resumed from an older checkpoint: the next --resume true must not take a newer one
        kept = state["step"] - 1 if another_branch_at(cfg.out_dir, state["step"], path, saved) else state["step"]
        for moved in set_aside_newer(cfg.out_dir, kept):
            say_once(fabric, f"set aside, of the stretch this resume abandons: {moved}")
        samples = set_aside_samples_after(Path(cfg.out_dir), kept)
        if samples:
            say_once(fabric, f"moved {len(samples)} samples files written after step {kept} to {samples[0].parent}")
    if not own_rng:
        print(f"rank {fabric.global_rank}: no random state saved for this rank; seeded from --seed and the step",
              flush=True)


def start_from_weights(fabric: Fabric, path: Path, state: dict[str, Any], training: bool = True) -> bool:
    """--init_from: the checkpoint's model weights into the model, in whatever layout this run shards them; the
    optimizer, the step and the schedule start anew (when `training`). False, said, when a piece of it is corrupt.
    Collective."""
    loading = Stopwatch()
    with loading.measure():
        saved, unreadable = load_on_every_rank(path, state["model"], state["optimizer"], model_only=True)
    if unreadable:
        fabric.print(f"error: --init_from {unreadable}; start from another checkpoint", file=sys.stderr)
        return False
    say_once(fabric, f"started from the weights of {path} (step {saved['step']} of its run) in {loading.last:.1f} s"
                     + ("; the optimizer, the step and the learning-rate schedule start anew" if training else ""))
    return True


def evaluate_only(fabric: Fabric, loop: Loop) -> int:
    """--eval_only: one evaluation, logged as step 0's row, and the summary (with each --eval_data_dir folder's
    loss: the numbers such a run is for); its exit code (a stop signal cuts the evaluation short)."""
    metrics = loop.evaluate()
    if metrics:
        fabric.log_dict(metrics, step=0)
    loop.watchdog.disarm()
    loop.console.close()
    summary = loop.summarize() | {name: value for name, value in metrics.items() if name.startswith("val_loss/")}
    summary.pop("spike_guard", None)  # nothing trained
    report_summary(fabric, loop.cfg.out_dir, summary, loop.console)
    if not loop.stop.requested:
        return EXIT_CODES["finished"]
    return EXIT_CODES["interrupted" if loop.stop.interrupted else "preempted"]


def another_branch_at(out_dir: str, step: int, resumed_from: Path, saved: dict[str, Any]) -> bool:
    """Whether out_dir/checkpoints holds a checkpoint of `step` other than the one resumed (nor a copy of it): one
    saved after another resume from an earlier step (a rollback resumed from rolled-back/). Left in place, it stood
    among this run's checkpoints, best.json could name it, and a crash resumed the other stretch from it."""
    same_step = list_checkpoints(out_dir).get(step)
    if same_step is None or same_step.resolve() == resumed_from.resolve():
        return False
    try:
        return read_metadata(same_step) != saved
    except CheckpointError:
        return True


def say_once(fabric: Fabric, line: str) -> None:
    """A line of the run's, said by its first process: fabric.print says it on each node's first process, and a
    Slurm log, which gathers every node's output, held it once per node (errors are still said on each node)."""
    if fabric.is_global_zero:
        print(line, flush=True)


def refusal_at_start(fabric: Fabric, cfg: Config, inputs: RunInputs) -> Optional[str]:
    """What the ranks find wrong once they have met, before anything is read or written, the same line on every rank
    (None: go on): out_dir in use by another run (rank 0 locks it), nodes that chose different checkpoints, nodes
    started with other options, data or code, or nodes that do not share out_dir (app/training/nodes.py)."""
    in_use = claim_run_folder(Path(cfg.out_dir)) if fabric.is_global_zero else None
    if fabric.world_size == 1 or not dist.is_initialized():  # one process, or XLA's ranks (no torch.distributed)
        return in_use
    chosen: list = [None] * fabric.world_size
    dist.all_gather_object(chosen, (fabric.node_rank, inputs.resume_step, str(inputs.resume_from),
                                    inputs.resume_identity, in_use))
    refusal = chosen[0][4] or resume_disagreement([choice[:4] for choice in chosen])
    if refusal or cfg.num_nodes == 1:
        return refusal
    return nodes_disagree(fabric, cfg, inputs) or unshared_out_dir(fabric, Path(cfg.out_dir))


def write_run_files(fabric: Fabric, cfg: Config, tokenizer: Optional[str]) -> None:
    if fabric.is_global_zero:
        out_dir = Path(cfg.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        replace_file(out_dir / RUN_CONFIG_FILE, cfg.to_yaml())
        # The summary of an earlier start of the run: this start writes its own at its end, and a crash before
        # that left the earlier one there as if it were the run's last word
        (out_dir / SUMMARY_FILE).unlink(missing_ok=True)
        keep_tokenizer_with_run(out_dir, tokenizer, cfg.trust_remote_code)
    try:
        for logger in fabric.loggers:
            logger.log_hyperparams(cfg.to_dict())
    except WandbFailed as failure:  # on rank 0 alone: the run ends here, its other ranks with it
        say(f"error: {failure}\n")
        end_process_tree(EXIT_CRASHED, stacks=False)


def keep_tokenizer_with_run(out_dir: Path, tokenizer: Optional[str], trust_remote_code: bool) -> None:
    """A copy of the run's tokenizer in out_dir/tokenizer/, so that the run converts on its own after its data folder
    moved or was deleted (the checkpoint records only the tokenizer's path or hub id). Written once, under a temporary
    name made durable and renamed into place (what a killed start left there is deleted by the next); one already
    there is the same tokenizer (the preflight refuses another) and is kept."""
    kept = run_tokenizer_dir(out_dir)
    if tokenizer is None or kept.exists():
        return
    staging = temporary_path(kept)
    discard(staging)  # a link there was skipped by rmtree, and the tokenizer written through it
    # The tokenizer as transformers loads and saves it, from a folder or a hub id: never the folder's other files (a
    # --tokenizer or --model_name that is a model folder holds its weights, gigabytes copied before the first step)
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code).save_pretrained(str(staging))
        make_durable(staging)
        publish(staging, kept)
    except (OSError, ValueError) as error:  # a convenience: rank 0 must not end the run (the others would wait)
        shutil.rmtree(staging, ignore_errors=True)
        print(f"note: the run's tokenizer was not copied to {kept} ({first_line(error)}); convert_to_hf.py "
              "will need --tokenizer if its recorded path moves", flush=True)


def step_clock(fabric: Fabric, cfg: Config, inputs: RunInputs, state: dict[str, Any]) -> StepClock:
    """Throughput from the step counts; FLOP/s and MFU when the model's FLOPs can be counted and the chip is known.
    Only rank 0 reports them (console, loggers, summary), so only rank 0 counts the FLOPs: a trace of the model on
    the meta device, 1.2 CPU-s for Llama-3-8B at 8K tokens, which the other ranks of a node would repeat at once."""
    plan = inputs.plan
    try:
        flops = (flops_per_micro_batch(inputs.model_config, plan.micro_batch_size, round(plan.row_tokens),
                                       round(plan.target_tokens), cfg.trust_remote_code) * plan.accumulation
                 if fabric.is_global_zero else None)
    except Exception as error:  # an architecture FlopCounter cannot trace on the meta device: throughput only
        say_once(fabric, f"FLOP/s and MFU are not reported: counting the model's FLOPs failed ({error})")
        flops = None
    peak = peak_flops(fabric.device, cfg.precision, cfg.peak_tflops)
    if peak is None and flops and fabric.device.type == "cuda":
        say_once(fabric, f"MFU is not reported: no dense {compute_dtype(cfg.precision)} peak is known for "
                         f"{torch.cuda.get_device_name(fabric.device)}; give --peak_tflops (its datasheet's dense "
                         "figure, half the one \"with sparsity\")")
    return StepClock(start_step=state["step"], elapsed_before=state["elapsed_sec"], max_step=plan.max_step,
                     window=cfg.log_interval, world_size=plan.world_size, samples_per_step=plan.global_batch_size,
                     tokens_per_step=plan.tokens_per_step, flops_per_step=flops, available_flops=peak)


def set_matmul_precision(fabric: Fabric, cfg: Config) -> None:
    """TF32 tensor cores for fp32 matmuls on Ampere and newer GPUs (app/distributed/precision.py), before the first
    kernel."""
    capability = torch.cuda.get_device_capability(fabric.device) if fabric.device.type == "cuda" else None
    torch.set_float32_matmul_precision(float32_matmul_precision(cfg.precision, cfg.tf32, capability))


def spike_rules(cfg: Config) -> SpikeRules:
    """The guard's options from the run's (tests/test_spikes.py checks that SpikeRules' defaults are the options'
    defaults, which are written twice)."""
    return SpikeRules(mode=cfg.spike_guard, z=cfg.spike_z, grad_norm_z=cfg.spike_grad_norm_z, window=cfg.spike_window,
                      warmup=cfg.spike_warmup, min_rise=cfg.spike_min_rise, incident_spikes=cfg.spike_incident,
                      incident_steps=cfg.spike_incident_steps, max_rollbacks=cfg.spike_max_rollbacks,
                      rewarm_steps=cfg.spike_rewarm_steps)


def spike_guard(fabric: Fabric, cfg: Config, state: dict[str, Any], data: TrainingData) -> SpikeGuard:
    """The guard with what the run (or the checkpoint it resumes) knows; the rows it set aside train nothing, also
    resumed under `detect` (which sets none aside itself: they trained again while the summary counted them set
    aside); under `off`, they train again, and the run says so."""
    guard = SpikeGuard(spike_rules(cfg), SpikeHistory.from_dict(state["spike_guard"]))
    mixture = [[part.source.name, str(part.source.weight)] for part in data.sources] if data.mixture else []
    if guard.judged_on(mixture) and guard.active:
        say_once(fabric, f"the data's folders or weights changed since the checkpoint: the spike guard gathers its "
                         f"statistics again ({cfg.spike_warmup} steps before it judges)")
    if fabric.is_global_zero:  # what this run skips, from its state: a file of an abandoned stretch's is stale
        write_quarantine(Path(cfg.out_dir), guard.history.quarantine if guard.active else [], data.locate)
    if guard.active and guard.history.quarantine:
        data.quarantine(guard.history.quarantined_rows())
        say_once(fabric, f"{len(guard.history.quarantine)} train rows set aside by the spike guard train nothing "
                         f"({Path(cfg.out_dir) / QUARANTINE_FILE})")
    elif guard.history.quarantine:
        say_once(fabric, f"{len(guard.history.quarantine)} train rows the spike guard had set aside train again "
                         "(--spike_guard off)")
    return guard


def sample_evaluator(fabric: Fabric, cfg: Config, inputs: RunInputs, data: TrainingData) -> Optional[SampleEvaluator]:
    """--eval_samples: the first N examples of the validation split (a mixture's folders taking turns), generated at
    every evaluation."""
    if not cfg.eval_samples:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(inputs.tokenizer, trust_remote_code=cfg.trust_remote_code)
    stops = stop_ids(tokenizer)
    whole, passed_over = whole_samples(data.validation_samples(), cfg.eval_samples, stops)
    samples = fit_to_context(whole, inputs.model_config, cfg.eval_max_new_tokens)
    cut = sum(len(fitted.prompt) < len(sample.prompt) for fitted, sample in zip(samples, whole))
    for said in sample_notes(cfg.eval_samples, len(samples), passed_over, cut) + [
            references_past(samples, cfg.eval_max_new_tokens, stops)]:
        if said:
            say_once(fabric, said)
    return SampleEvaluator(samples=samples, tokenizer=tokenizer,
                           decoding=decoding_for(inputs.model_config, cfg.trust_remote_code),
                           max_new_tokens=cfg.eval_max_new_tokens, out_dir=Path(cfg.out_dir),
                           token_budget=samples_token_budget(cfg, inputs))


def samples_token_budget(cfg: Config, inputs: RunInputs) -> int:
    """The tokens of a rank's --eval_samples prompts generated together, with their answers: those of one prompt of
    a whole block, which generation held alone before (0: one prompt at a time, for a model whose logits padding
    changes). Each keeps its keys and values in every layer for the whole loop; a budget of an evaluation batch's
    tokens held 2.9 times validation's memory in an audit (a 7B model's cache is 512 KiB a token)."""
    return inputs.plan.block_size + cfg.eval_max_new_tokens if inputs.samples_pad_apart else 0


def corrupt_checkpoint(fabric: Fabric, cfg: Config, path: Path, unreadable: str) -> int:
    """The exit code of a resume whose checkpoint holds a piece whose checksum differs (found only as it is read).
    One that --resume true chose is moved to rolled-back/, as the preflight moves one that does not read whole, so
    that the next attempt resumes from the one before it: a requeued job stopped at it with exit 2 every time. One
    that --checkpoint names is the user's: refused (exit 2), with the newest earlier one named."""
    named = bool(cfg.checkpoint) and Path(cfg.checkpoint).resolve() == path.resolve()
    if fabric.is_global_zero:  # every rank has read what it could of it: it may move
        step = read_metadata(path)["step"]
        earlier = [older for number, older in sorted(list_checkpoints(cfg.out_dir).items()) if number < step]
        from_where = f"the newest: {earlier[-1]}" if earlier else "none is left in --out_dir: from step 0"
        if named:
            line = f"--checkpoint {unreadable}; resume from an earlier checkpoint with --checkpoint ({from_where})"
        else:
            line = (f"--resume true: {unreadable}; moved it to {move_aside(path)}: run the same command again to "
                    f"resume from the checkpoint before it ({from_where}); the Slurm scripts requeue")
        print(f"error: {line}", file=sys.stderr, flush=True)
    fabric.barrier()  # the ranks end together: one that ended first had gloo's "connection closed" printed after it
    return EXIT_BAD_INPUT if named else EXIT_CORRUPT_CHECKPOINT


def stall_watchdog(fabric: Fabric, cfg: Config) -> StallWatchdog:
    head_start = 0.0 if fabric.local_rank == 0 else LAUNCHER_HEAD_START_SEC
    return StallWatchdog(cfg.stall_timeout_min * 60, rank=fabric.global_rank, head_start_sec=head_start).start()


def build_loop(fabric: Fabric, cfg: Config, inputs: RunInputs, state: dict[str, Any], data: TrainingData,
               stop: StopRequest, console: Console, loss_path: LossPath) -> Loop:
    """The training loop with everything it decides with: the loader workers that fit this node's shared memory,
    how gradients are clipped and synchronised, the samples, the watchdog, the saver, the spike guard, and what
    validation reads (for best.json)."""
    plan = inputs.plan
    workers, said = workers_that_fit(cfg.num_workers, data, plan.micro_batch_size, fabric.world_size // cfg.num_nodes)
    if said and fabric.local_rank == 0:  # on each node: its own /dev/shm
        print(said, flush=True)
    gradients = GradientPolicy(max_norm=cfg.grad_clip, replicas=gradient_replicas(cfg, plan.world_size),
                               scaled=uses_grad_scaler(cfg.precision),
                               defer_sync=cfg.strategy not in SHARDED_STRATEGIES or cfg.fsdp_no_sync)
    measured = validation_measured_by(cfg.to_dict(), inputs.data_folders, fabric.world_size)
    return Loop(fabric=fabric, cfg=replace(cfg, num_workers=workers), plan=plan, data=data, state=state, stop=stop,
                loss_path=loss_path, clock=step_clock(fabric, cfg, inputs, state), console=console,
                gradients=gradients, samples=sample_evaluator(fabric, cfg, inputs, data),
                watchdog=stall_watchdog(fabric, cfg),
                saver=CheckpointSaver(fabric, state, sharded=cfg.state_dict_type == "sharded",
                                      background=cfg.async_save),
                guard=spike_guard(fabric, cfg, state, data), resumed_from=inputs.resume_from, measured=measured,
                rows_record=RowRecord(cfg.out_dir, state["step"]) if cfg.record_rows and fabric.is_global_zero
                else None)


def main(fabric: Fabric, cfg: Config, inputs: RunInputs, deferred: Optional[DeferredInit]) -> int:
    """One rank's run, from setting up the model to the summary; its exit code."""
    stop = StopRequest(cfg.requeue_on_signal)
    stop.install(announce=fabric.is_global_zero)
    refusal = refusal_at_start(fabric, cfg, inputs)
    if refusal:
        fabric.print(f"error: {refusal}", file=sys.stderr)  # on each node: where nodes log apart, each says why
        return EXIT_BAD_INPUT
    if fabric.is_global_zero:  # the folder is this run's: what an interrupted or failed save left goes now, not at
        remove_leftovers(checkpoint_dir(cfg.out_dir))  # the first save (a whole checkpoint's size, on a full disk)
    fabric.seed_everything(cfg.seed, verbose=False)
    set_matmul_precision(fabric, cfg)
    data = load_data(cfg.train_data_dir, inputs.packed_layout, cfg.eval_data_dir)
    model, roles, loss_path = setup_model(fabric, cfg, inputs.model_config, deferred, inputs.chunked_loss)
    optimizer = fabric.setup_optimizers(build_optimizer(model, cfg, roles))
    state = initial_state(model, optimizer, cfg, inputs)
    if inputs.resume_from:
        unreadable = resume(fabric, cfg, inputs.resume_from, state, inputs.plan)
        if unreadable:
            return corrupt_checkpoint(fabric, cfg, inputs.resume_from, unreadable)
    elif cfg.init_from and not start_from_weights(fabric, Path(cfg.init_from), state, training=not cfg.eval_only):
        return EXIT_BAD_INPUT
    write_run_files(fabric, cfg, inputs.tokenizer)
    if inputs.resume_from:
        log_lost_row(fabric.loggers, state["step"], state["step_row"])
    plan = inputs.plan
    if not cfg.eval_only:
        say_once(fabric, f"training {plan.max_step} steps of {plan.global_batch_size} sequences x "
                         f"{plan.row_tokens:.0f} tokens ({plan.accumulation} accumulation x {plan.micro_batch_size} "
                         f"micro-batch x {plan.world_size} ranks)"
                         + ("; no checkpoints (--save_step_interval 0) unless a signal stops it"
                            if not cfg.save_step_interval else ""))
    console = Console(enabled=fabric.is_global_zero, start_step=state["step"], max_step=plan.max_step)
    loop = build_loop(fabric, cfg, inputs, state, data, stop, console, loss_path)
    if cfg.eval_only:
        return evaluate_only(fabric, loop)
    try:
        with profiled_steps(profile_window(cfg.profile_steps), state["step"], plan.max_step, Path(cfg.out_dir),
                            fabric.global_rank, console.print) as loop.trace_step:
            outcome: str = loop.fit()
        with loop.saving.measure(counted=False):  # checkpoint time, not training time, in the summary
            loop.saver.close()  # a background write of the last step may fail here
    except SaveFailed as failure:  # on every rank alike
        fabric.print(f"error: {failure}. {failure.advice()}", file=sys.stderr)  # on each node, as a refusal
        outcome = "save_failed"
        loop.saver.close()
    loop.watchdog.disarm()
    console.close()
    if outcome == "save_failed":  # no summary.json either: the storage is full, or gone
        return EXIT_SAVE_FAILED
    report_summary(fabric, cfg.out_dir, loop.summarize(), console)
    if outcome == "preempted" and requeues_itself(cfg.requeue_on_signal, stop.signal) and fabric.is_global_zero:
        requeue_slurm_job()
    return EXIT_CODES[outcome]
