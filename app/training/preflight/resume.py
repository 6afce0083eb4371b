"""The checkpoint a run continues from: the newest complete one, or --checkpoint when it is this model's and this
run's, and the data folders and seed it was trained with."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import yaml
from transformers import PretrainedConfig

from app.checkpoint import (broken_checkpoint, checkpoint_dir, is_checkpoint, latest_checkpoint, read_metadata,
                            stored_tensor_shapes)
from app.checkpoint.files import RUN_CONFIG_FILE, list_checkpoints, run_folder_of
from app.checkpoint.io import validation_measured, validation_measured_by
from app.checkpoint.state import CheckpointMismatch, check_fits, expected_shapes
from app.data.identity import identity_difference, same_folder_by_path
from app.data.mixture import parse_sources
from app.huggingface.convert import changed_fields
from app.model.build import freeze_parameters, frozen_names, meta_model, model_flag, model_source
from app.optimization.optimizer import ParameterRoles, grouped_parameter_names
from app.training.preflight.data import DataFacts
from app.training.preflight.notes import note
from app.training.preflight.out_dir import files_a_new_run_replaces
from app.training.progress import out_of_patience, patience_carried_over, saved_progress

if TYPE_CHECKING:
    from arguments import Config


@dataclass
class ChosenCheckpoint:
    """The checkpoint a run continues from (--resume) or starts from (--init_from), and what it says about the run
    that wrote it."""

    path: Path
    metadata: dict


SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads")


def why_broken(reason: str, path: Path) -> str:
    """broken_checkpoint's reason, shown beside the checkpoint's path: from its name on."""
    return reason.removeprefix(f"{path}: ").replace(str(path.parent) + os.sep, "")


def newest_whole_checkpoint(out_dir: Path) -> tuple[Optional[Path], list[str]]:
    """The newest checkpoint in out_dir that reads whole, and why each newer one does not. Checkpoints are published
    by a rename once written, so a broken one is the storage's doing (a disk that failed, a copy cut short): a requeued
    job stopped at it with exit 2 and a line naming --checkpoint, which it was not given. One that vanishes while it
    is read (another run pruning) is passed over without a word."""
    skipped = []
    for _, path in sorted(list_checkpoints(out_dir).items(), reverse=True):
        broken = broken_checkpoint(path)
        if broken is None:
            return path, skipped
        if path.exists():
            skipped.append(f"{path.name} ({why_broken(broken, path)})")
    return None, skipped


def starting_checkpoint(cfg: Config, problems: list[str]) -> Optional[ChosenCheckpoint]:
    """The checkpoint --init_from starts a run from. Where --resume true continues a run that started so, the one its
    newest checkpoint records, with that checkpoint's metadata (the architecture, the base model): the path given
    may name another checkpoint by then (a run folder's newest), or none (a copy deleted)."""
    if cfg.resume:
        newest, _ = newest_whole_checkpoint(Path(cfg.out_dir))
        metadata = read_metadata(newest) if newest is not None else {}
        started = (metadata.get("config") or {}).get("init_from")
        if started:
            return ChosenCheckpoint(Path(started), metadata)
    return resolve_init_from(cfg, problems)


def resolve_init_from(cfg: Config, problems: list[str]) -> Optional[ChosenCheckpoint]:
    """--init_from: the checkpoint whose weights start a new run (a run folder's newest that reads whole, or its
    checkpoints/ folder's), with its metadata, which gives the architecture; None after a problem."""
    path = Path(cfg.init_from)
    if not path.exists():
        problems.append(f"--init_from {path}: no such file or folder")
        return None
    if (path / "config.json").is_file():
        problems.append(f"--init_from {path} is a Hugging Face model folder; give it as --model_name")
        return None
    if not is_checkpoint(path):
        run = path.parent if path.name == checkpoint_dir(".").name else path
        newest, broken = newest_whole_checkpoint(run)
        if newest is None:
            problems.append(f"--init_from {path}: neither a checkpoint nor a run folder holding one that reads whole"
                            + (f" ({'; '.join(broken)})" if broken else "") + "; give a checkpoint of train.py")
            return None
        if broken:
            note(f"--init_from {path}: {'; '.join(broken)}; starting from {newest.name}, the newest that reads whole")
        path = newest
    metadata = train_py_metadata(f"--init_from {path}", path, problems)
    return ChosenCheckpoint(path, metadata) if metadata is not None else None


def train_py_metadata(flag: str, path: Path, problems: list[str]) -> Optional[dict]:
    """The metadata of a checkpoint that reads whole and that train.py wrote; None after a problem naming `flag`."""
    broken = broken_checkpoint(path)
    if broken:
        problems.append(f"{flag}: {why_broken(broken, path)}; pick another one")
        return None
    metadata = read_metadata(path)
    if not isinstance(metadata.get("step"), int) or "model_config" not in metadata:
        problems.append(f"{flag}: not a checkpoint written by train.py (no step/model_config); pick another one")
        return None
    return metadata


def resolve_resume(cfg: Config, model_config: Optional[PretrainedConfig],
                   problems: list[str]) -> Optional[ChosenCheckpoint]:
    if not cfg.resume:
        if latest_checkpoint(cfg.out_dir) and not cfg.estimate_memory and not cfg.eval_only:  # (out_dir.py's line)
            problems.append(f"--out_dir {cfg.out_dir} already holds checkpoints; add --resume true to continue that "
                            "run, or choose another --out_dir (nothing is overwritten)")
        return None
    if not cfg.checkpoint:
        return resolve_latest(cfg, model_config, problems)
    path = Path(cfg.checkpoint)
    if not path.exists():
        every_node = ("; every node reads it: give a path on storage all nodes share (a node that refuses its inputs "
                      "leaves the others waiting for it until --rendezvous_timeout_min)" if cfg.num_nodes > 1 else "")
        problems.append(f"--checkpoint {path}: no such file or folder{every_node}")
        return None
    metadata = check_checkpoint_matches(cfg, path, model_config, problems)
    if metadata is None or holds_another_run(cfg, path, metadata, problems):
        return None
    if relaunched_after(cfg, path, metadata):
        return resolve_latest(cfg, model_config, problems)
    return ChosenCheckpoint(path, metadata)


def resolve_latest(cfg: Config, model_config: Optional[PretrainedConfig],
                   problems: list[str]) -> Optional[ChosenCheckpoint]:
    """The newest checkpoint in out_dir that reads whole, checked; newer broken ones are named, and the resume sets
    them aside as it does every checkpoint newer than the one it continues from. A run still writing that folder
    (the same job submitted twice; the lock refuses the second once its ranks start) deletes its older checkpoints as
    it saves (--keep_last_n): one that vanished while it was read is taken as gone and the newest is read again, so
    that the second run ends in the lock's line instead of a FileNotFoundError from the middle of a read (seen in
    CI)."""
    folder = checkpoint_dir(cfg.out_dir)
    for _ in range(VANISHED_READS):
        path, broken = newest_whole_checkpoint(Path(cfg.out_dir))
        if path is None and broken:
            problems.append(f"--resume true: no checkpoint in {folder} reads whole: {'; '.join(broken)}; give "
                            "--checkpoint a copy kept elsewhere, or start again in another --out_dir")
            return None
        if path is None:
            note(f"--resume true: no checkpoint in {folder} yet, starting from step 0")
            return None
        found: list[str] = []
        try:
            metadata = check_checkpoint_matches(cfg, path, model_config, found)
        except Exception:  # FileNotFoundError, or a sharded folder's reader meeting a missing piece
            if path.exists():
                raise
            continue
        if path.exists():
            problems.extend(found)
            if metadata is not None and broken:
                note(f"--resume true: {'; '.join(broken)}; continuing from {path.name}, the newest checkpoint that "
                     f"reads whole (the resume moves the broken ones to {folder / 'rolled-back'})")
            return ChosenCheckpoint(path, metadata) if metadata is not None else None
    problems.append(f"--resume true: {VANISHED_READS} checkpoints in {checkpoint_dir(cfg.out_dir)} were deleted while "
                    "they were read; another run is writing --out_dir: wait for it to end, or choose another --out_dir")
    return None


VANISHED_READS = 5
"""How many checkpoints in a row may vanish while the preflight reads them before it gives up."""


def check_checkpoint_matches(cfg: Config, path: Path, model_config: Optional[PretrainedConfig],
                             problems: list[str]) -> Optional[dict]:
    """The checkpoint's metadata when it is this model's, checked tensor by tensor; None after a problem."""
    flag = f"--checkpoint {path}"
    metadata = train_py_metadata(flag, path, problems)
    if metadata is None or model_config is None:
        return metadata
    saved, current = metadata["model_config"], model_config.to_dict()
    differing = [k for k in SHAPE_KEYS if saved.get(k) != current.get(k)]
    if differing:
        k = differing[0]
        problems.append(f"{flag} is from a different model ({k} {saved.get(k)} != {current.get(k)}); "
                        "resume with the model it was trained with")
        return None
    try:
        changes = changed_fields(saved, model_config)
    except (KeyError, ValueError, TypeError):  # a recorded config that no longer loads: the shapes decide
        changes = []
    if changes:
        source = model_flag(cfg)
        with_overrides = " with --model_overrides" if cfg.model_overrides else ""
        problems.append(f"{flag} was trained with another config than {source} {model_source(cfg)} gives"
                        f"{with_overrides}: {', '.join(changes[:3])}{' and more' if len(changes) > 3 else ''}; the "
                        "resumed steps would train another model; resume with the config it was trained with (its "
                        "run's config.yaml records its --model_overrides)")
        return None
    model = meta_model(model_config, cfg.trust_remote_code)
    names = [name for name, _ in model.named_parameters()]
    frozen_before = (metadata.get("config") or {}).get("freeze")
    if set(frozen_names(names, frozen_before)) != set(frozen_names(names, cfg.freeze)):  # what they name counts
        problems.append(f"{flag} was trained with --freeze {frozen_before}, not {cfg.freeze}: its optimizer holds the "
                        "state of the parameters that trained; resume with the same --freeze, or start a new phase "
                        "from its weights with --init_from")
        return None
    optimizer_before = (metadata.get("config") or {}).get("optimizer", "adamw")
    if optimizer_before != cfg.optimizer:
        problems.append(f"{flag} was trained with --optimizer {optimizer_before}, not {cfg.optimizer}: its optimizer "
                        "state is that optimizer's; resume with the same --optimizer, or start a new phase from its "
                        "weights with --init_from")
        return None
    freeze_parameters(model, cfg.freeze)
    roles = ParameterRoles.of(model)
    decayed, exempt = grouped_parameter_names(model, roles.no_decay)
    try:
        check_fits(stored_tensor_shapes(path, decayed + exempt),
                   expected_shapes(model, decayed + exempt, roles.muon(cfg.optimizer)), flag)
    except CheckpointMismatch as error:
        problems.append(f"{error}; resume with the model it was trained with")
        return None
    except ValueError as error:
        problems.append(f"{flag}: {error}; pick another one")
        return None
    return metadata


def relaunched_after(cfg: Config, checkpoint: Path, metadata: dict) -> bool:
    """The run in out_dir was started from this --checkpoint (its config.yaml says so) and has saved newer
    checkpoints since: this is that start's command again (a Slurm requeue, or --config out_dir/config.yaml), and it
    continues from the newest. Taken literally, every relaunch went back to the checkpoint, set the newer ones aside
    and replaced the rolled-back copies of the same steps an earlier rollback had kept."""
    newest = max(list_checkpoints(cfg.out_dir), default=0)
    if started_from(Path(cfg.out_dir)) != checkpoint.resolve() or newest <= metadata["step"]:
        return False
    note(f"--checkpoint {checkpoint}: this run started from it and has saved up to step {newest} since; continuing "
         f"from step {newest} (to go back to it again, give a copy of it under another name)")
    return True


def holds_another_run(cfg: Config, checkpoint: Path, metadata: dict, problems: list[str]) -> bool:
    """A checkpoint of another run resumed into an --out_dir that holds a run of its own: the resumed run would set
    that run's checkpoints aside and rewrite its metrics.csv and config.yaml, one mistyped path making two runs one,
    and a job script that names --checkpoint would go back to it at every requeue. A checkpoint is the run's own
    where it lies in out_dir/checkpoints or was saved by a run in out_dir (a copy elsewhere, under a name of the
    user's); an earlier start of the same command that saved nothing (preempted before its first save) is taken
    over."""
    out_dir = Path(cfg.out_dir)
    if not out_dir.exists() or any(folder is not None and folder.resolve() == out_dir.resolve()
                                   for folder in (run_folder_of(checkpoint), saved_out_dir(metadata))):
        return False
    if latest_checkpoint(out_dir):
        problems.append(f"--checkpoint {checkpoint} is not of the run in --out_dir {out_dir}, which holds checkpoints "
                        f"up to step {max(list_checkpoints(out_dir))}: to continue that run, resume without "
                        "--checkpoint (its newest is taken); to continue this checkpoint, give a new or empty "
                        "--out_dir")
        return True
    written = files_a_new_run_replaces(out_dir)
    if not written or started_from(out_dir) == checkpoint.resolve():
        return False
    problems.append(f"--checkpoint {checkpoint} is not of the run in --out_dir {out_dir}, which holds "
                    f"{', '.join(written[:3])} of another run: resuming it there would replace them; give a new or "
                    "empty --out_dir")
    return True


def saved_out_dir(metadata: dict) -> Optional[Path]:
    """The --out_dir of the run that saved a checkpoint, as its options record it."""
    recorded = (metadata.get("config") or {}).get("out_dir")
    return Path(metadata.get("cwd") or ".") / recorded if recorded else None


def started_from(out_dir: Path) -> Optional[Path]:
    """The --checkpoint the run in `out_dir` was started with, as its config.yaml records it."""
    try:
        recorded = yaml.safe_load((out_dir / RUN_CONFIG_FILE).read_text()).get("checkpoint")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return Path(recorded).resolve() if recorded else None


def check_data_resume(cfg: Config, data: Optional[DataFacts], resume: Optional[ChosenCheckpoint],
                      problems: list[str]) -> None:
    """A resumed run reads the checkpoint's folders in their order: its position counts rows of that order, a
    mixture's positions and seeds are kept per folder name and its quarantined rows are numbered folder after folder.
    Weights may change and folders may be added at the end of a mixture's (not to a run of one folder, whose position
    counts rows of another order: its rows were read again from the start). Folders are compared by what they hold
    (app/data/identity.py), not by path: a preempted run resumes on another node, mount or working directory. The
    order is drawn from --seed: resumed with another, the rest of the epoch repeated rows it had trained and skipped
    others, without a word."""
    if resume is None or data is None:
        return
    seed = (resume.metadata.get("config") or {}).get("seed")
    if seed is not None and seed != cfg.seed:
        problems.append(f"--seed {cfg.seed}: the checkpoint's run orders its data by --seed {seed}, which a resume "
                        f"continues (another seed repeats rows it trained and skips others); give --seed {seed}")
    before = recorded_folders(resume.metadata)
    if not before:
        return
    now = data.identities
    listed = ", ".join(folder["path"] for folder in before)
    keep = "a resumed run keeps those folders in that order, wherever they lie (weights may change, folders may be " \
           "added after them)"
    if len(now) < len(before):
        problems.append(f"--train_data_dir: the checkpoint was trained on {listed}; {keep}")
        return
    if len(now) > 1 and resume.metadata.get("mixture") is None:  # a run of one folder, resumed as a mixture
        problems.append(f"--train_data_dir: the checkpoint was trained on {listed} alone, in an order a mixture does "
                        "not continue (a mixture draws each folder's rows in an order of its own): the resumed run "
                        "would read that folder again from its start; resume on that folder alone, or start the "
                        "mixture as a new run from the checkpoint's weights (--init_from)")
        return
    for place, (saved, given) in enumerate(zip(before, now), start=1):
        why = folder_mismatch(saved, given, mixture=len(before) > 1)
        if why:
            problems.append(f"--train_data_dir: {given['path']} is not folder {place} the checkpoint was trained on "
                            f"({saved['path']}): {why}; {keep}")
            return


def recorded_folders(metadata: dict) -> list[dict]:
    """The checkpoint's folders: their identities, or for a checkpoint that records none (before data_folders) their
    names and paths from its --train_data_dir, relative ones taken from where it was trained (`cwd`)."""
    if metadata.get("data_folders"):
        return metadata["data_folders"]
    spec = (metadata.get("config") or {}).get("train_data_dir")
    try:
        sources = parse_sources(spec) if spec else []
    except ValueError:
        return []
    trained_in = Path(metadata.get("cwd") or ".")
    return [{"name": source.name, "path": str(trained_in / source.path)} for source in sources]


def folder_mismatch(saved: dict, given: dict, mixture: bool) -> Optional[str]:
    """Why `given` cannot stand for the checkpoint's folder `saved`; None when it can."""
    if mixture and saved["name"] != given["name"]:
        return (f"the mixture keeps its position and seeds per name and this one was named {saved['name']} (name it: "
                f"{saved['name']}=FOLDER:WEIGHT)")
    if "stats_sha256" in saved:
        return identity_difference(saved, given)
    if not same_folder_by_path(Path(saved["path"]), Path(given["path"])):
        return "another folder (this checkpoint records paths only: give that folder, or one of its name if it moved)"
    return None


def stopped_early_note(cfg: Config, metadata: dict, data_folders: list, ranks: int) -> str:
    """What to say, training nothing, when the checkpoint is where early stopping ended the run: its evaluations
    without a new best reach --early_stopping_patience, on the rows this run's evaluations read. The same command
    with --resume true (a relaunch, as the Slurm scripts make) trained on past the stop and replaced its summary."""
    state = saved_progress(metadata, ("step", "val_loss_step", "best_val_loss", "evaluations_without_improvement"))
    patience_carried_over(state, validation_measured(metadata),
                          validation_measured_by(cfg.to_dict(), data_folders, ranks))
    if not out_of_patience(state, cfg.early_stopping_patience):
        return ""
    return (f"--resume: the checkpoint at step {state['step']} is where early stopping ends this run "
            f"({state['evaluations_without_improvement']} evaluations without a validation loss below "
            f"{state['best_val_loss']:.4f}, --early_stopping_patience {cfg.early_stopping_patience}): nothing to "
            "train, nothing written (a larger --early_stopping_patience, or none, trains on)")
