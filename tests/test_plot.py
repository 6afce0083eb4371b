"""plot_metrics.py: sparse metrics.csv rows become per-column series, real runs become a picture, bad input exit 2."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from app.metrics.loggers import COLUMNS
from app.metrics.plot import Run, distinct_labels, main, metric_series, x_at
from tests.conftest import ROOT, run_train, train_args

HEADER = ",".join(COLUMNS)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def csv_text(*rows: dict[str, object]) -> str:
    """A metrics.csv in train.py's layout: every column present, the cells a row does not log left empty."""
    lines = [",".join(str(row.get(name, "")) for name in COLUMNS) for row in rows]
    return "\n".join([HEADER, *lines]) + "\n"


def plot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "plot_metrics.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def test_series_keep_only_the_rows_that_logged_each_column() -> None:
    text = csv_text(
        {"step": 0, "epoch": 0, "val_loss": 6.0, "val_ppl": 403.4},
        {"step": 1, "epoch": 0, "train_loss": 5.9, "lr": 0.001, "tokens_per_sec": 100.0},
        {"step": 2, "epoch": 0, "train_loss": 5.1, "lr": 0.002, "tokens_per_sec": 120.0},
        {"step": 2, "epoch": 0, "val_loss": 5.0},
        {"step": 2, "epoch": 0, "save_sec": 0.5},
        {"step": 3, "epoch": 1, "train_loss": 4.8, "lr": 0.002, "tokens_per_sec": 130.0, "mfu": ""},
    )
    series = metric_series(text)
    assert series["train_loss"] == ([1, 2, 3], [5.9, 5.1, 4.8]), "step 0 is a validation-only row"
    assert series["val_loss"] == ([0, 2], [6.0, 5.0])
    assert series["lr"] == ([1, 2, 3], [0.001, 0.002, 0.002])
    assert series["save_sec"] == ([2], [0.5])
    assert series["epoch"] == ([0, 1, 2, 3], [0.0, 0.0, 0.0, 1.0]), "a repeated step appears once"
    assert series["mfu"] == ([], []), "a CPU run logs no MFU"


def test_a_last_row_still_being_written_is_left_out() -> None:
    """plot_metrics.py plots a run while it trains (or after a kill): a row cut short was refused as not a number, or
    read as the wrong one."""
    whole = csv_text({"step": 1, "train_loss": 5.9}, {"step": 2, "train_loss": 5.1})
    for cut in ("3,0,4.78e", "3,0,4.7"):
        assert metric_series(whole + cut)["train_loss"] == ([1, 2], [5.9, 5.1]), cut


def test_a_later_row_for_the_same_step_and_column_wins() -> None:
    series = metric_series(csv_text({"step": 4, "val_loss": 3.0}, {"step": 4, "val_loss": 2.5}, {"step": 5}))
    assert series["val_loss"] == ([4], [2.5])


@pytest.mark.parametrize("text, message", [
    ("", "the header lacks step"),
    ("step,loss\n1,2.0\n", "the header lacks train_loss, val_loss, lr, tokens_per_sec"),
    (csv_text({"step": 1, "train_loss": "nan?"}), "line 2 holds a value that is not a number"),
])
def test_series_refuse_what_train_py_does_not_write(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        metric_series(text)


def assert_picture(path: Path) -> np.ndarray:
    """A real PNG of the figure's size (10x10 inches at 100 dpi) with something drawn on it."""
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = imread(path)
    assert pixels.shape[:2] == (1000, 1000)
    assert pixels.var() > 0
    return pixels


@pytest.fixture(scope="module")
def two_runs(tiny, tmp_path_factory) -> tuple[Path, Path]:
    """A short one-process run evaluated at steps 0, 4 and 8, and a second run's folder whose metrics.csv is the
    first's with every loss 0.5 higher: plot_metrics.py reads nothing else."""
    root = tmp_path_factory.mktemp("plot")
    real, shifted = root / "real-run", root / "shifted-run"
    result = run_train(train_args(tiny, real, max_step=8, devices=1, strategy="single_device", eval_step_interval=4,
                                  save_step_interval=8))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(real / "metrics.csv", newline="") as source:
        rows = list(csv.DictReader(source))
    shifted.mkdir()
    with open(shifted / "metrics.csv", "w", newline="") as target:
        writer = csv.DictWriter(target, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({**row, **{name: float(row[name]) + 0.5 for name in ("train_loss", "val_loss") if row[name]}}
                         for row in rows)
    return real, shifted


def test_plots_a_real_run_into_its_folder(two_runs) -> None:
    run, _ = two_runs
    result = plot(run)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {run / 'metrics.png'}"
    assert_picture(run / "metrics.png")
    series = metric_series((run / "metrics.csv").read_text())
    assert series["val_loss"][0] == [0, 4, 8] and series["train_loss"][0] == list(range(1, 9))


def test_overlays_runs_and_accepts_a_csv_path(two_runs, tmp_path) -> None:
    real, shifted = two_runs
    assert plot(real, "--output", tmp_path / "alone.png").returncode == 0
    result = plot("--run", real, shifted / "metrics.csv", "--output", tmp_path / "both.png")
    assert result.returncode == 0, result.stderr
    alone, both = assert_picture(tmp_path / "alone.png"), assert_picture(tmp_path / "both.png")
    assert not np.array_equal(alone, both), "the second run adds lines"
    svg = tmp_path / "both.svg"
    assert plot(real, "--run", shifted, "--output", svg).returncode == 0
    assert "shifted-run" in svg.read_text() and "real-run" in svg.read_text(), "each line is named after its run"
    assert distinct_labels([Path("/a/x/run"), Path("/b/x/run"), Path("/c/other")]) == ["a/x/run", "b/x/run", "c/other"]
    assert distinct_labels([Path("/a/run"), Path("/b/sft")]) == ["run", "sft"]  # two runs named `run` looked alike


def test_runs_of_other_global_batches_are_compared_by_trained_tokens(two_runs, tmp_path, capsys) -> None:
    """A step of a run with twice the global batch trains twice the tokens: over steps its curve looked twice as
    fast. `--x tokens_seen` puts each run's points at the tokens trained so far (logged at each log row, read
    between them for a validation loss logged elsewhere, from 0 at step 0)."""
    real, _ = two_runs
    series = metric_series((real / "metrics.csv").read_text())
    steps, tokens = series["tokens_seen"]
    assert steps == list(range(1, 9)) and tokens == [step * tokens[0] for step in steps]
    run = Run("real", series)
    assert x_at(run, "tokens_seen", [0, 4, 8]) == [0.0, 4 * tokens[0], 8 * tokens[0]]
    assert x_at(run, "tokens_seen", [1, 2]) == tokens[:2] and x_at(run, "step", [3]) == [3.0]
    assert main([str(real), "--x", "tokens_seen", "--output", str(tmp_path / "tokens.svg")]) == 0
    assert "trained tokens" in (tmp_path / "tokens.svg").read_text()
    (tmp_path / "earlier").mkdir()  # a metrics.csv of a version that did not log them
    (tmp_path / "earlier" / "metrics.csv").write_text(
        "step,train_loss,val_loss,lr,tokens_per_sec\n1,6.0,,1e-4,900\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "earlier"), "--x", "tokens_seen"])
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip() == (
        "plot_metrics.py: error: --x tokens_seen: earlier logged no tokens_seen (its metrics.csv was written by an "
        "earlier version); plot it with --x step; see plot_metrics.py --help")


def test_mfu_gets_its_own_axis_and_a_panel_without_values_says_no_data(tmp_path) -> None:
    """A GPU run logs MFU; a run stopped after its initial validation has no training row yet."""
    gpu, fresh = tmp_path / "gpu", tmp_path / "fresh"
    gpu.mkdir(), fresh.mkdir()
    (gpu / "metrics.csv").write_text(csv_text(
        *({"step": s, "train_loss": 6 - s / 10, "lr": 1e-4, "tokens_per_sec": 9000, "mfu": 0.41} for s in (1, 2))))
    (fresh / "metrics.csv").write_text(csv_text({"step": 0, "val_loss": 6.0}))
    assert main([str(gpu), "--output", str(gpu / "p.svg")]) == 0
    assert "MFU" in (gpu / "p.svg").read_text() and "no data" not in (gpu / "p.svg").read_text()
    assert main([str(fresh), "--output", str(fresh / "p.svg")]) == 0
    assert (fresh / "p.svg").read_text().count("no data") == 2 and "MFU" not in (fresh / "p.svg").read_text()


def test_a_mixtures_validation_loss_of_each_folder_is_drawn(tmp_path) -> None:
    """metrics.csv holds val_loss/<name> for each folder of a mixture, which the picture left out."""
    columns = [*COLUMNS, "val_loss/code", "val_loss/prose"]
    rows = [{"step": s, "train_loss": 6 - s / 10, "lr": 1e-4, "tokens_per_sec": 9000} for s in (1, 2)]
    rows.append({"step": 2, "val_loss": 5.5, "val_loss/code": 5.0, "val_loss/prose": 6.0})
    (tmp_path / "metrics.csv").write_text("\n".join([",".join(columns)] + [",".join(
        str(row.get(name, "")) for name in columns) for row in rows]) + "\n")
    assert main([str(tmp_path), "--output", str(tmp_path / "p.svg")]) == 0
    assert "val_loss/code" in (tmp_path / "p.svg").read_text() and "val_loss/prose" in (tmp_path / "p.svg").read_text()


def test_a_picture_that_cannot_be_written_whole_leaves_the_last_one_and_is_one_line(two_runs, tmp_path) -> None:
    """Written in place, a full disk (here a file size limit) left a cut picture over the last one, after a
    traceback."""
    import resource

    run, _ = two_runs
    (tmp_path / "metrics.png").write_bytes(PNG_MAGIC + b"the last picture")
    limited = subprocess.run([sys.executable, str(ROOT / "plot_metrics.py"), str(run), "--output",
                              str(tmp_path / "metrics.png")], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
    assert limited.returncode == 2 and limited.stderr == (
        f"plot_metrics.py: error: --output {tmp_path / 'metrics.png'}: cannot be written (File too large); it is as it "
        "was; see plot_metrics.py --help\n"), limited.stderr
    assert (tmp_path / "metrics.png").read_bytes() == PNG_MAGIC + b"the last picture"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.png"]


@pytest.fixture
def bad_inputs(two_runs, tmp_path) -> dict[tuple[str, ...], tuple[str, str]]:
    """Command lines a user gets wrong, each with the path its error must name and what the error must say."""
    run, _ = two_runs
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "empty_folder.png").mkdir()
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    (tmp_path / "header_only").mkdir()
    (tmp_path / "header_only" / "metrics.csv").write_text(HEADER + "\n")
    return {
        (str(tmp_path / "empty_folder"),): ("empty_folder", "no metrics.csv in this folder"),
        (str(tmp_path / "empty.csv"),): ("empty.csv", "not a train.py metrics.csv"),
        (str(tmp_path / "other.csv"),): ("other.csv", "not a train.py metrics.csv"),
        (str(tmp_path / "header_only"),): ("header_only", "no rows yet"),
        (str(run), "--output", str(tmp_path / "picture.jpg")): ("picture.jpg", "use a .png, .svg, .pdf file name"),
        (str(run), "--output", str(tmp_path / "no" / "p.png")): ("p.png", "does not exist"),
        (str(run), "--output", str(tmp_path / "empty_folder.png")): ("empty_folder.png", "is a folder"),  # traceback
        ("--run",): ("--run", "expected at least one argument"),
        (): ("give a run to plot", ""),
    }


def test_bad_input_is_one_line_naming_the_path_and_exit_2(bad_inputs, tmp_path, capsys) -> None:
    for args, (path, message) in bad_inputs.items():
        with pytest.raises(SystemExit) as exit_info:
            main(list(args))
        assert exit_info.value.code == 2, args
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and path in lines[0] and message in lines[0], (args, lines)
    assert not (tmp_path / "picture.jpg").exists()


def test_the_command_exits_2_without_a_traceback(tmp_path) -> None:
    result = plot(tmp_path / "missing")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"plot_metrics.py: error: --run {tmp_path / 'missing'}: no such file or folder; " \
                            "give a train.py --out_dir or its metrics.csv; see plot_metrics.py --help\n"
