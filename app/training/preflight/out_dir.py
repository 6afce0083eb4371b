"""--out_dir: a folder the run can write, with room for a checkpoint, outside the data, and never an earlier run's
files overwritten by a new run."""

from __future__ import annotations

import os
import shutil
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
import yaml
from transformers import PretrainedConfig

from app.checkpoint import checkpoint_dir, latest_checkpoint, run_tokenizer_dir
from app.checkpoint.files import RUN_CONFIG_FILE, bytes_on_disk, leftovers
from app.data.mixture import parse_sources
from app.distributed.precision import weights_dtype
from app.evaluation.samples import SAMPLES_DIR, samples_written
from app.metrics.console import format_gb
from app.metrics.loggers import METRICS_FILE, ROWS_FILE, RUN_ID_FILE, SUMMARY_FILE, TENSORBOARD_DIR
from app.metrics.observe import GB
from app.model.build import meta_model
from app.reliability.spikes import QUARANTINE_FILE

if TYPE_CHECKING:
    from arguments import Config


def check_out_dir(cfg: Config, model_config: Optional[PretrainedConfig], problems: list[str]) -> None:
    out_dir = Path(cfg.out_dir)
    ancestor = existing_ancestor(out_dir)
    if not ancestor.is_dir():  # the folder, or one it would be made in (else the first rank fails to create it)
        where = "" if ancestor == out_dir.absolute() else f": {ancestor}"
        problems.append(f"--out_dir {out_dir}{where} is a file; give a folder")
        return
    if not os.access(ancestor, os.W_OK):
        problems.append(f"--out_dir {out_dir}: {ancestor} is not writable; choose a folder you can write to")
        return
    files = [path.name for path in folders_a_run_makes(out_dir) if path.exists() and not path.is_dir()]
    if files:  # else the run trained until its first save, then failed to write there
        problems.append(f"--out_dir {out_dir} holds {' and '.join(files)} as a file, where a run makes a folder of "
                        "that name; move it away, or choose another --out_dir")
    if model_config is not None:
        left = sum(bytes_on_disk(path) for path in leftovers(checkpoint_dir(out_dir)))  # the run removes them first
        needed, free = estimated_checkpoint_bytes(model_config, cfg), shutil.disk_usage(ancestor).free + left
        if free < needed:
            problems.append(f"--out_dir {out_dir}: {size(free)} free, one checkpoint needs about {size(needed)}; "
                            "free space or choose another folder")
    data_folder = data_folder_holding(cfg, out_dir)
    if data_folder:
        problems.append(f"--out_dir {out_dir} lies in the data folder {data_folder}: the run would write its "
                        "checkpoints among the data (and prepare_data.py --overwrite refuses such a folder); choose "
                        "a folder outside it")
    written_in = data_folder_written_in(cfg, out_dir)
    if written_in:
        problems.append(f"--train_data_dir {written_in} is a folder the run writes in (its checkpoints, tokenizer or "
                        f"samples under --out_dir {out_dir}); move the data elsewhere, or choose another --out_dir")
    written = files_a_new_run_replaces(out_dir)
    if not written or latest_checkpoint(out_dir) and not cfg.eval_only:  # with checkpoints: resolve_resume's line
        return
    if cfg.eval_only:
        problems.append(f"--out_dir {out_dir} already holds {', '.join(written)}, which --eval_only true would "
                        "replace with its metrics.csv and summary.json; give it an --out_dir of its own")
    elif not cfg.resume:
        problems.append(f"--out_dir {out_dir} already holds {', '.join(written)} (of an earlier run, or yours), which "
                        "a new run would overwrite; it holds no checkpoint, so nothing of that run can be continued: "
                        "choose another --out_dir, or add --resume true to start that run again from step 0 there, "
                        "replacing those files (this refusal changed nothing)")
    elif not written_by_a_run(out_dir, cfg):  # the Slurm scripts always pass --resume true
        which = (f"its {RUN_CONFIG_FILE} is not one a run of train.py wrote" if (out_dir / RUN_CONFIG_FILE).exists()
                 else f"it holds no {RUN_CONFIG_FILE}, which a run writes first")
        problems.append(f"--out_dir {out_dir} holds {', '.join(written)}, which --resume true would replace, but "
                        f"{which}: they are not a run's to take over; choose another --out_dir (this refusal changed "
                        "nothing)")


def folders_a_run_makes(out_dir: Path) -> list[Path]:
    return [checkpoint_dir(out_dir), run_tokenizer_dir(out_dir), out_dir / SAMPLES_DIR, out_dir / TENSORBOARD_DIR]


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def estimated_checkpoint_bytes(model_config: PretrainedConfig, cfg: Config) -> int:
    """Weights plus AdamW's two moments, all in the weights' dtype: what one full checkpoint holds. A tied weight is
    written under each of its names (Llama's tied output layer twice, T5's shared embedding four times), its moments
    once: counted once, the estimate fell short by that much (7 to 9% of a small model's checkpoint)."""
    model = meta_model(model_config, cfg.trust_remote_code)
    parameters = sum(p.numel() for p in model.parameters())
    written = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    return (written + 2 * parameters) * torch.finfo(weights_dtype(cfg.precision)).bits // 8


def size(nbytes: int) -> str:
    """In the binary units of every other figure the run prints (and of `df -h`)."""
    return format_gb(nbytes / GB)


def data_folder_holding(cfg: Config, out_dir: Path) -> Optional[Path]:
    """The --train_data_dir folder that is `out_dir` or holds it, if any."""
    out_dir = out_dir.resolve()
    return next((folder for folder in data_folders(cfg) if folder == out_dir or folder in out_dir.parents), None)


def written_by_a_run(out_dir: Path, cfg: Config) -> bool:
    """Whether out_dir's config.yaml is one a run writes (options of train.py, out_dir among them; most of them today's:
    an earlier version's may name options since renamed): a run writes it before any other file, so the files beside
    it are that run's."""
    try:
        written = yaml.safe_load((out_dir / RUN_CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    options = {option.name for option in fields(cfg)}
    return isinstance(written, dict) and "out_dir" in written and len(set(written) & options) >= 0.8 * len(written)


def data_folder_written_in(cfg: Config, out_dir: Path) -> Optional[Path]:
    """A --train_data_dir folder inside a folder the run writes in (out_dir/checkpoints, its tokenizer copy, its
    samples): checkpoints and best.json were written among the dataset's files, without a word."""
    written = [path.resolve() for path in (checkpoint_dir(out_dir), run_tokenizer_dir(out_dir), out_dir / SAMPLES_DIR)]
    return next((folder for folder in data_folders(cfg) for place in written
                 if folder == place or place in folder.parents), None)


def data_folders(cfg: Config) -> list[Path]:
    """The --train_data_dir folders, resolved; none when the option does not parse (check_data's line)."""
    try:
        return [Path(source.path).resolve() for source in parse_sources(cfg.train_data_dir or "")]
    except ValueError:
        return []


def files_a_new_run_replaces(out_dir: Path) -> list[str]:
    """The files in `out_dir` that a run starting there writes over: those of an earlier run that saved no checkpoint
    (--save_step_interval 0, or stopped before its first save), or a user's of the same names. Only a run asked to
    continue (--resume true) takes them over: metrics.csv keeps its rows up to the step resumed from."""
    if not out_dir.is_dir():
        return []
    names = [name for name in (RUN_CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, ROWS_FILE, QUARANTINE_FILE, RUN_ID_FILE)
             if (out_dir / name).exists()]
    samples = samples_written(out_dir)
    return names + ([f"{samples[0].parent.name}/{samples[0].name}"] if samples else [])
