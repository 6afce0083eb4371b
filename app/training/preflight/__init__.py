"""Checks of every input, in the launching process, before any worker starts or any file is written.

Each check appends one line per problem (naming the flag and what to do); all problems are reported together, once
for the run where srun or torchrun runs every device's process whole (app/tasks.py), and the run exits
with status 2. What the checks resolve along the way (the model config, the FSDP layer classes, the
checkpoint to resume from) is returned, so the workers never re-derive it differently.

One module per concern (`preflight` runs a check once what it needs is resolved): wandb_options.py, data.py
(--train_data_dir), model.py (the model against the options and the data), resume.py (the checkpoint, and the data
it was trained on), plan.py (batches and schedule), tokenizer.py, out_dir.py, environment.py (this machine and the
launcher), tensorboard_option.py; notes.py says what is resolved without being a problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from torch.nn import Module
from transformers import PretrainedConfig

from app.checkpoint.io import identity
from app.choices import SHARDED_STRATEGIES
from app.cli import naming_config_files
from app.data.formats import Layout
from app.data.mixture import describe_mixture
from app.distributed.precision import bf16_rounding_note, offloaded_rounding_note
from app.huggingface.convert import recorded_base_model
from app.model.build import resolve_wrap_classes
from app.optimization.schedule import TrainingPlan
from app.reliability.signals import first_of_the_run
from app.tasks import exit_refused
from app.training.preflight.data import check_data, check_eval_folders, planned_blocks, reads_data
from app.training.preflight.environment import (check_devices, check_launcher, check_precision, check_runs_here,
                                                world_size)
from app.training.preflight.model import check_model, check_model_with, samples_pad_apart
from app.training.preflight.notes import held, note
from app.training.preflight.out_dir import check_out_dir
from app.training.preflight.plan import (check_offloaded_accumulation, check_plan, note_changed_options,
                                         resolve_learning_rates, resolve_shares)
from app.training.preflight.resume import (ChosenCheckpoint, check_data_resume, resolve_resume, starting_checkpoint,
                                           stopped_early_note)
from app.training.preflight.tensorboard_option import check_tensorboard
from app.training.preflight.tokenizer import check_run_tokenizer, check_samples, resolve_tokenizer
from app.training.preflight.wandb_options import check_wandb, note_wandb_history, resolve_wandb

if TYPE_CHECKING:
    from arguments import Config


@dataclass
class RunInputs:
    """What the preflight resolved, passed to every rank."""

    config: Config
    """The options, with --lr and --min_lr resolved for the global batch (--lr_scaling)."""
    model_config: PretrainedConfig
    wrap_classes: set[type[Module]]
    plan: TrainingPlan
    tokenizer: Optional[str]
    resume_from: Optional[Path]
    resume_step: Optional[int] = None
    """The step the checkpoint resumed from holds (its metadata's; a copied checkpoint's name may say nothing)."""
    resume_identity: str = ""
    """Which checkpoint it is (app/checkpoint/io.py identity): the nodes compare it before anything is read."""
    resume_stopped_early: str = ""
    """Said where the checkpoint is where early stopping ends the run (resume.stopped_early_note): nothing trains."""
    packed_layout: Layout = "position_ids"
    """How packed examples reach the model so that they stay apart (app/model/isolation.py)."""
    chunked_loss: bool = False
    """Whether the loss is computed in chunks without the full logits (app/model/loss.py)."""
    samples_pad_apart: bool = False
    """Whether --eval_samples generates a rank's prompts in padded batches (app/evaluation/samples.py)."""
    mixture: str = ""
    """A mixture's folders, one line each (app/data/mixture.py describe_mixture); empty for one folder."""
    target_block_size: int = 0
    """Seq2seq data's longest target, for the memory planner; 0 for the other formats."""
    data_folders: list[dict] = field(default_factory=list)
    """What identifies each data folder (app/data/identity.py), recorded by every checkpoint for a resume anywhere."""
    base_model: Optional[str] = None
    """For --init_from, the base model (and its Hub commit) of the run that wrote the checkpoint, which the converted
    model's generation config and card come from."""
    base_revision: Optional[str] = None


def preflight(cfg: Config, sources: Optional[dict[str, str]] = None) -> RunInputs:
    """Check everything; exit with status 2 and one line per problem, or return what the run needs, with the notes
    of the checks said then (not before a refusal). `sources` (arguments.option_sources) names the config file of an
    option a problem names."""
    with held():
        return checked_inputs(cfg, sources)


def inherited_base(init: Optional[ChosenCheckpoint]) -> dict[str, Optional[str]]:
    """The base model a --init_from checkpoint's run started from (or inherited itself), and its commit."""
    if init is None:
        return {}
    metadata = init.metadata
    return {"base_model": recorded_base_model(metadata), "base_revision": metadata.get("base_revision")}


def checked_inputs(cfg: Config, sources: Optional[dict[str, str]]) -> RunInputs:
    problems: list[str] = []
    cfg = resolve_wandb(cfg, problems)
    data = check_data(cfg, problems) if reads_data(cfg) else None
    if data is not None and cfg.eval_data_dir:
        data = check_eval_folders(cfg, data, problems)
    given_init = cfg.init_from
    init = starting_checkpoint(cfg, problems) if cfg.init_from else None
    if init is not None:  # a run folder given: its checkpoint, which config.yaml records and a resume keeps
        cfg = replace(cfg, init_from=str(init.path))
    model_config = check_model(cfg, problems, init)
    check_runs_here(cfg, problems)
    wrap_classes: set[type[Module]] = set()
    if model_config is not None and (cfg.strategy in SHARDED_STRATEGIES or cfg.tpu):
        try:
            wrap_classes = resolve_wrap_classes(model_config, cfg.auto_wrap_policy, cfg.trust_remote_code)
        except ValueError as error:
            problems.append(str(error))
    packed_layout, chunked_loss = (check_model_with(cfg, model_config, data, problems) if model_config is not None
                                   else ("position_ids", False))
    resume = resolve_resume(cfg, model_config, problems)
    if resume is not None and init is not None:
        note(f"--init_from {given_init}: not read: --resume true continues this run from its checkpoint at step "
             f"{resume.metadata['step']} (it started from {init.path})")
    check_data_resume(cfg, data, resume, problems)
    plan = check_plan(cfg, data or planned_blocks(cfg), resume, problems) if data or cfg.block_size else None
    if plan is not None:
        check_offloaded_accumulation(cfg, plan, problems)
        if cfg.fsdp_no_sync and plan.accumulation == 1 and not cfg.estimate_memory:
            note("--fsdp_no_sync true is not used: each step is one micro-batch per rank, with nothing to accumulate")
    tokenizer = resolve_tokenizer(cfg, model_config, problems)
    if data is not None:
        check_samples(cfg, data, tokenizer, problems, model_config)
    if not cfg.estimate_memory:  # planning writes nothing
        check_out_dir(cfg, model_config, problems)
        check_run_tokenizer(cfg, tokenizer, problems)
    check_precision(cfg, model_config, problems)
    check_devices(cfg, problems)
    if not cfg.estimate_memory:  # planning logs nothing and starts no node: it plans a cluster from a laptop
        if first_of_the_run():  # only rank 0 logs: another node's WANDB_* (or network) is not the run's
            check_wandb(cfg, problems)
        check_tensorboard(cfg, problems)  # on every node: each rank makes Fabric's logger, which needs the package
        check_launcher(cfg, problems)
    if problems:
        exit_refused([f"error: {naming_config_files(p, sources or {})}" for p in problems])
    cfg = resolve_shares(resolve_learning_rates(cfg, plan), plan)
    if resume is not None:
        note_changed_options(cfg, resume.metadata, plan)
        note_wandb_history(cfg, resume.metadata["step"], resume.metadata.get("config") or {})
    updates = () if cfg.eval_only else (  # what becomes of the weight updates: --eval_only makes none
        bf16_rounding_note(cfg.precision, cfg.lr, cfg.weight_decay, cfg.stochastic_rounding, cfg.optimizer),
        offloaded_rounding_note(cfg.stochastic_rounding, cfg.cpu_offload))
    for said in updates:
        if said:
            note(said)
    if cfg.strategy == "fsdp" and cfg.sharding_strategy == "NO_SHARD" and world_size(cfg) > 1:
        note("torch deprecates --sharding_strategy NO_SHARD under --strategy fsdp (FSDP1): --strategy ddp, or "
             "--strategy fsdp2 with NO_SHARD, trains the same")
    return RunInputs(config=cfg, model_config=model_config, wrap_classes=wrap_classes,
                     plan=plan, tokenizer=tokenizer, resume_from=resume.path if resume else None,
                     resume_step=resume.metadata["step"] if resume else None,
                     resume_identity=identity(resume.metadata) if resume else "",
                     resume_stopped_early=stopped_early_note(cfg, resume.metadata, data.identities if data else [],
                                                             world_size(cfg)) if resume else "",
                     packed_layout=packed_layout, chunked_loss=chunked_loss,
                     samples_pad_apart=samples_pad_apart(cfg, model_config),
                     mixture=describe_mixture(data.sources, data.source_rows) if data and data.sources else "",
                     target_block_size=data.target_block_size if data else 0,
                     data_folders=data.identities if data else [], **inherited_base(init))
