"""Pictures of a run: train/validation loss, learning rate and throughput from `<out_dir>/metrics.csv`.

metrics.csv rows are sparse (a step logs only what was due at it: the training figures every --log_interval, the
validation loss at evaluations, save_sec at saves), so the file is first turned into one (steps, values) series per
column, then drawn. Nothing here
imports torch or Lightning: plotting a run that is still training on another machine takes a second, not ten.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import jsonargparse
import numpy
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from app import cli
from app.cli import UsageError
from app.folders import replace_file

Series = tuple[list[int], list[float]]
"""Steps and the values logged at them, in step order."""

REQUIRED_COLUMNS = ("step", "train_loss", "val_loss", "lr", "tokens_per_sec")
"""What a metrics.csv written by train.py always has; the other plotted columns are drawn when present."""
PICTURE_SUFFIXES = (".png", ".svg", ".pdf")


class PlotError(UsageError):
    """A problem the user can fix, reported as one line with exit status 2."""


@dataclass
class PlotArgs:
    """Plot train/validation loss, learning rate and throughput of one or more train.py runs."""

    run: list[str] = field(default_factory=list)
    """Run folders (train.py --out_dir) or metrics.csv files, also accepted positionally. Several runs are drawn
    over each other, each labelled with its folder name."""
    output: str | None = None
    """Picture to write: .png, .svg or .pdf, replaced if it exists (default: <first run's folder>/metrics.png)."""
    x: Literal["step", "tokens_seen", "elapsed_sec"] = "step"
    """The x axis: the optimizer step; the trained tokens so far (runs of other global batches side by side); or the
    run's seconds."""


X_LABELS = {"step": "step", "tokens_seen": "trained tokens", "elapsed_sec": "seconds"}

@dataclass(frozen=True)
class Run:
    label: str
    series: dict[str, Series]


def metric_series(text: str) -> dict[str, Series]:
    """Per column, the steps that have a value and those values, from the text of a metrics.csv.

    Empty cells are skipped, so each column keeps only the rows that logged it. When one column has two values for
    the same step, the later row wins: it is the newer measurement. A last row without its line's end is being
    written (or was, when the run was killed) and is left out: "4.78e" was refused as not a number, and "4.7" read
    as one that was never logged.
    """
    if not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text))
    missing = [name for name in REQUIRED_COLUMNS if name not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"not a train.py metrics.csv: the header lacks {', '.join(missing)}")
    by_column: dict[str, dict[int, float]] = {name: {} for name in reader.fieldnames if name != "step"}
    for line, row in enumerate(reader, start=2):
        try:
            step = int(row["step"])
            for name, cell in row.items():
                if name in by_column and cell:
                    by_column[name][step] = float(cell)
        except (TypeError, ValueError):
            raise ValueError(f"line {line} holds a value that is not a number") from None
    return {name: (sorted(values), [values[s] for s in sorted(values)]) for name, values in by_column.items()}


def metrics_csv(path: Path) -> Path:
    """The metrics.csv a --run names: the file itself, or the one inside a run folder."""
    if path.is_dir():
        if not (path / "metrics.csv").is_file():
            raise PlotError(f"--run {path}: no metrics.csv in this folder; give the --out_dir of a train.py run")
        return path / "metrics.csv"
    if not path.is_file():
        raise PlotError(f"--run {path}: no such file or folder; give a train.py --out_dir or its metrics.csv")
    return path


def load_run(path: Path) -> Run:
    """Read one run, labelled with the name of the folder its metrics.csv is in."""
    csv_path = metrics_csv(path)
    try:
        series = metric_series(csv_path.read_text())
    except (OSError, csv.Error, ValueError) as error:
        raise PlotError(f"--run {csv_path}: {error}; plot the metrics.csv that train.py writes") from None
    if not any(steps for steps, _ in series.values()):
        raise PlotError(f"--run {csv_path}: no rows yet; plot again once train.py has logged a step")
    return Run(csv_path.resolve().parent.name, series)


def distinct_labels(folders: list[Path]) -> list[str]:
    """Each run's folder name, or as many of its last path parts as tell it from the others: two runs both named
    `run` were labelled alike in the title and the legend."""
    names = [folder.parts[1:] if folder.is_absolute() else folder.parts for folder in folders]
    for depth in range(1, max(map(len, names)) + 1):
        labels = ["/".join(parts[-depth:]) for parts in names]
        if len(set(labels)) == len(labels):
            return labels
    return [str(folder) for folder in folders]  # the same folder twice


def output_path(output: str | None, first_run: Path) -> Path:
    """Where the picture goes; its format follows the suffix, so an unknown suffix is refused up front."""
    path = metrics_csv(first_run).parent / "metrics.png" if output is None else Path(output)
    if path.suffix.lower() not in PICTURE_SUFFIXES:
        raise PlotError(f"--output {path}: use a {', '.join(PICTURE_SUFFIXES)} file name")
    if not path.parent.is_dir():
        raise PlotError(f"--output {path}: folder {path.parent} does not exist; create it first")
    if path.is_dir():
        raise PlotError(f"--output {path} is a folder; give a picture's file name")
    if not os.access(path.parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        raise PlotError(f"--output {path} cannot be written here; give another with --output")
    return path


def draw_lines(axes: Axes, runs: list[Run], columns: dict[str, dict], x: str = "step") -> bool:
    """Draw `columns` ({column: line style}) of every run in the run's colour, over `x`; False when none has a
    value."""
    drawn = False
    for colour, run in enumerate(runs):
        prefix = f"{run.label} " if len(runs) > 1 else ""
        for name, style in columns.items():
            steps, values = run.series.get(name, ([], []))
            if steps:
                axes.plot(x_at(run, x, steps), values, color=f"C{colour}", label=prefix + name, **style)
                drawn = True
    return drawn


def x_at(run: Run, x: str, steps: list[int]) -> list[float]:
    """`x` at each of `steps`: the step itself, or the run's logged `x` column (written at log rows) between its
    points, from 0 at step 0: a validation loss is logged at steps no log row need have."""
    if x == "step":
        return [float(step) for step in steps]
    logged_steps, logged = run.series[x]
    if logged_steps[0] > 0:
        logged_steps, logged = [0, *logged_steps], [0.0, *logged]
    return numpy.interp(steps, logged_steps, logged).tolist()


def check_x(runs: list[Run], x: str) -> None:
    lacking = [run.label for run in runs if x != "step" and not run.series.get(x, ([], []))[0]]
    if lacking:
        raise PlotError(f"--x {x}: {', '.join(lacking)} logged no {x} (its metrics.csv was written by an earlier "
                        "version); plot it with --x step")


def finish_panel(axes: Axes, drawn: bool, ylabel: str) -> None:
    """A legend for a panel with lines, a visible 'no data' instead of an empty frame for one without."""
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    if drawn:
        axes.legend(loc="best", fontsize="small")
    else:
        axes.text(0.5, 0.5, "no data", transform=axes.transAxes, ha="center", va="center", color="grey")


def draw_loss(axes: Axes, runs: list[Run], x: str) -> None:
    """Train and validation loss, and each folder's validation loss (`val_loss/<name>`: a mixture's folders',
    --eval_data_dir's), dotted."""
    folders = sorted({name for run in runs for name in run.series if name.startswith("val_loss/")})
    drawn = draw_lines(axes, runs, {"train_loss": {"linewidth": 1},
                                    "val_loss": {"marker": "o", "linestyle": "--", "linewidth": 1},
                                    **{name: {"marker": ".", "linestyle": ":", "linewidth": 1} for name in folders}}, x)
    finish_panel(axes, drawn, "loss")


def draw_lr(axes: Axes, runs: list[Run], x: str) -> None:
    finish_panel(axes, draw_lines(axes, runs, {"lr": {"linewidth": 1}}, x), "learning rate")


def draw_throughput(axes: Axes, runs: list[Run], x: str) -> None:
    """Tokens/s in total and per device; MFU on a second axis, only for runs that report it (GPU runs)."""
    drawn = draw_lines(axes, runs, {"tokens_per_sec": {"linewidth": 1},
                                    "tokens_per_sec_per_device": {"linestyle": "--", "linewidth": 1}}, x)
    finish_panel(axes, drawn, "tokens/s")
    if any(run.series.get("mfu", ([], []))[0] for run in runs):
        mfu_axes = axes.twinx()
        draw_lines(mfu_axes, runs, {"mfu": {"linestyle": ":", "linewidth": 1}}, x)
        mfu_axes.set_ylabel("MFU")
        mfu_axes.legend(loc="lower right", fontsize="small")


def draw(runs: list[Run], output: Path, x: str = "step") -> bytes:
    """One figure, three panels over a shared x axis (the step, or a column of `x_at`), drawn with the
    non-interactive Agg canvas into the bytes of `output`'s format."""
    figure = Figure(figsize=(10, 10), layout="constrained")
    FigureCanvasAgg(figure)
    loss, lr, throughput = figure.subplots(3, 1, sharex=True)
    draw_loss(loss, runs, x)
    draw_lr(lr, runs, x)
    draw_throughput(throughput, runs, x)
    throughput.set_xlabel(X_LABELS[x])
    figure.suptitle(" vs ".join(run.label for run in runs))
    picture = io.BytesIO()
    figure.savefig(picture, format=output.suffix[1:].lower(), dpi=100)
    return picture.getvalue()


def write_picture(output: Path, picture: bytes) -> None:
    """Written whole, or not at all: written in place, a full disk left a cut picture where the last one was (and a
    traceback)."""
    try:
        replace_file(output, picture)
    except OSError as error:
        raise PlotError(f"--output {output}: cannot be written ({error.strerror or error}); "
                        f"{'it is as it was' if output.exists() else 'nothing was written'}") from None


def build_parser() -> jsonargparse.ArgumentParser:
    parser = cli.command_parser("plot_metrics.py", PlotArgs.__doc__, [PlotArgs])
    parser.add_argument("paths", nargs="*", default=[], metavar="RUN", help="Same as --run.")
    return parser


def parse_args(argv: list[str] | None) -> PlotArgs:
    namespace = cli.parse(build_parser(), argv)
    args = PlotArgs(run=[*namespace.paths, *(namespace.run or [])], output=namespace.output, x=namespace.x)
    if not args.run:
        raise PlotError("give a run to plot: plot_metrics.py <train.py --out_dir> [more runs to overlay]")
    return args


def main(argv: list[str] | None = None) -> int:
    """Plot the runs and print where the picture is; bad input is one line on stderr and exit status 2."""

    def load() -> tuple[list[Run], Path, str]:
        args = parse_args(argv)
        loaded = [load_run(Path(path)) for path in args.run]
        labels = distinct_labels([metrics_csv(Path(path)).resolve().parent for path in args.run])
        runs = [Run(label, run.series) for label, run in zip(labels, loaded)]
        check_x(runs, args.x)
        return runs, output_path(args.output, Path(args.run[0])), args.x

    runs, output, x = cli.run_command("plot_metrics.py", load)
    picture = draw(runs, output, x)
    cli.run_command("plot_metrics.py", lambda: write_picture(output, picture))
    print(f"wrote {output}")
    return 0
