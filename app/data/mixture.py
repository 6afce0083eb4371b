"""Weighted mixtures of prepared folders (`--train_data_dir wiki-es:0.7,wiki-en:0.2,code:0.1`), as pure functions.

A mixture is a source of rows for the order (order.py), not a data format: its folders hold one format and one
tokenizer (the preflight refuses others), their train splits are read as one split whose rows are numbered folder
after folder, and only which rows make each step changes.

**Shares.** Every global batch of G rows holds each source's share as exactly as integers allow: source i gets
floor(G x w_i) rows, and the R rows left over (R = G - sum of the floors) go to the R sources whose share is most
behind: their credit (the rows they were due over the steps so far, minus the rows they got) plus this step's
fraction, ties to the earlier source. Each step therefore holds the floor or the ceiling of every share, and a
source's rows over any number of steps from the start stay within one row of its exact share (checked for random
weights in tests/test_mixture.py). The sequence is a function of the weights and the global batch: no coin flips,
so a 3:1 mixture with a global batch of 16 takes 12 and 4 rows at every step.

**Rows.** Each source is read as its own stream of epochs: a seeded permutation of its rows per epoch (order.py's,
with a seed salted by the source's name), so a source smaller than its share repeats, epoch after epoch in a new
order, and none of its rows comes again before all of them came. A step's rows of each source are spread evenly over
the step, so every micro-batch mixes the sources alike.

**Position.** Per source, the rows taken so far and the credit: that is the mixture's position, kept in the
checkpoint (state["mixture"]); with it a run resumed on any number of ranks or micro batch continues the same
sequence of rows. The weights may change at a resume (an annealing phase), and folders may be added at the end.

Why by hand: LitData's CombinedStreamingDataset and datasets' interleave_datasets draw each row's source at random
(a batch's shares vary from step to step) and resume by replaying their sampler; Megatron's blends are exact but
index whole preprocessed corpora ahead of time. Neither fits an order that is a pure function of the state.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Source:
    """One folder of a mixture: the name its metrics carry, its path and its weight (normalised over the mixture)."""

    name: str
    path: str
    weight: Fraction


def parse_sources(spec: str) -> list[Source]:
    """`--train_data_dir`: one folder, or `[name=]folder:weight,...`. Raises ValueError with one line naming the flag.

    A name defaults to the folder's own name; weights are any positive numbers (3:1 is 0.75:0.25) and are normalised.
    A single folder with a weight is a single folder.
    """
    items = [item.strip() for item in spec.split(",")]
    if any(not item for item in items):
        raise ValueError(f"--train_data_dir {spec!r}: an empty entry; write folder:weight,folder:weight")
    parsed = [_parse_item(item) for item in items]
    if len(parsed) > 1 and any(weight is None for _, _, weight in parsed):
        unweighted = next(path for _, path, weight in parsed if weight is None)
        raise ValueError(f"--train_data_dir: {unweighted} has no weight; give every folder of a mixture one "
                         "(folder:weight,folder:weight)")
    names = [name for name, _, _ in parsed]
    odd = next((path for name, path, _ in parsed if not NAME.fullmatch(name)), None) if len(parsed) > 1 else None
    if odd:
        raise ValueError(f"--train_data_dir: {odd} needs a name of letters, digits, '.', '_' or '-' for its metrics; "
                         "write name=folder:weight")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--train_data_dir: two folders are named {repeated[0]}; name them (name=folder:weight)")
    weights = [weight or Fraction(1) for _, _, weight in parsed]
    total = sum(weights)
    sources = [Source(name, path, weight / total) for (name, path, _), weight in zip(parsed, weights)]
    negligible = next((source for source in sources if source.weight < SMALLEST_SHARE), None)
    if negligible:  # 1e-30 planned 4e31 steps; 1e400 ended in an OverflowError traceback
        raise ValueError(f"--train_data_dir: the weights leave {negligible.path} less than a millionth of every "
                         "step; give weights within a factor of a million of each other")
    return sources


SMALLEST_SHARE = Fraction(1, 10**6)  # said in words in parse_sources
"""The smallest share of a step a mixture's folder may have: less is no useful mixture."""


def _named(item: str) -> tuple[str | None, str]:
    """`name=folder` as (name, folder), and (None, item) where what comes before a '=' is no name: a '=' inside a
    folder's path (`runs/lr=3e-4/data`)."""
    name, equals, path = item.partition("=")
    return (name, path) if equals and NAME.fullmatch(name) else (None, item)


def _parse_item(item: str) -> tuple[str, str, Fraction | None]:
    name, path = _named(item)
    weight = None
    if ":" in path:
        folder, text = path.rsplit(":", 1)
        try:
            weight = Fraction(text)
        except ZeroDivisionError:
            raise ValueError(f"--train_data_dir: the weight of {folder} divides by zero ({text})") from None
        except ValueError:
            if text.strip().lstrip("+-").lower() in ("inf", "infinity", "nan"):  # read as part of the folder's name
                raise ValueError(f"--train_data_dir: the weight of {folder} must be a finite positive number, "
                                 f"got {text}") from None
            folder = path  # a colon inside the folder's own name
        else:
            path = folder
            if weight <= 0:
                raise ValueError(f"--train_data_dir: the weight of {folder} must be positive, got {text}")
    return name or Path(path.rstrip("/")).name, path, weight


def parse_eval_folders(spec: str, train_data_dir: str) -> dict[str, str]:
    """`--eval_data_dir`: `[name=]folder,...`, folders evaluated and never trained on, as {name: folder}. Named as a
    mixture's folders are (their metrics are val_loss/<name>), by no name a training folder of a mixture has; each
    folder given once and none a training folder (whose validation rows val_loss scores already: the same rows under
    two names, where a user may have meant its training rows). Raises ValueError with one line naming the flag."""
    evaluated: dict[str, str] = {}
    for item in (item.strip() for item in spec.split(",")):
        name, path = _named(item)
        name = name if name is not None else Path(path.rstrip("/")).name
        if not item or not path:
            raise ValueError(f"--eval_data_dir {spec!r}: an empty entry; write name=folder,name=folder")
        if not NAME.fullmatch(name):
            raise ValueError(f"--eval_data_dir: {path} needs a name of letters, digits, '.', '_' or '-' for its "
                             "metrics; write name=folder")
        if name in evaluated:
            raise ValueError(f"--eval_data_dir: two folders are named {name}; name them (name=folder)")
        evaluated[name] = path
    trained = parse_sources(train_data_dir)
    mixture_names = {source.name for source in trained} if len(trained) > 1 else set()
    clash = next((name for name in evaluated if name in mixture_names), None)
    if clash:
        raise ValueError(f"--eval_data_dir: {clash} names a folder of the training mixture too, whose metrics are "
                         f"val_loss/{clash}; name it otherwise (name=folder)")
    _refuse_folders_twice(evaluated, {_same_folder(source.path): source for source in trained}, len(trained) > 1)
    return evaluated


def _same_folder(path: str) -> Path:
    return Path(path).expanduser().resolve()


def _refuse_folders_twice(evaluated: dict[str, str], trained: dict[Path, Source], mixture: bool) -> None:
    seen: dict[Path, str] = {}
    for path in evaluated.values():
        folder = _same_folder(path)
        if folder in trained:
            metric = f"val_loss/{trained[folder].name}" if mixture else "val_loss"
            raise ValueError(f"--eval_data_dir {path} is a --train_data_dir folder, whose validation rows {metric} "
                             "scores already; give a folder the run does not train on")
        if folder in seen:
            raise ValueError(f"--eval_data_dir: {seen[folder]} and {path} are the same folder; give it once")
        seen[folder] = path


def first_folder(spec: str) -> str:
    """The first folder of `--train_data_dir` (the one whose tokenizer/ the run records); the text itself when it
    does not parse (the preflight says why)."""
    try:
        return parse_sources(spec)[0].path
    except ValueError:
        return spec


def describe_mixture(sources: list[Source], rows: list[int]) -> str:
    """One line per source, for --print_config and --estimate_memory."""
    return "\n".join(f"{source.name}: {float(source.weight):.1%} of every step, {count:,} train rows ({source.path})"
                     for source, count in zip(sources, rows))


def epoch_rows(weights: list[Fraction], rows: list[int]) -> int:
    """The rows of a mixture's epoch: one pass over its first folder (the data the run is for, listed first; the
    folders replayed beside it may be far larger), as rows of the mixture. Its steps are floor(N / (w G)) for any
    global batch G, as floor(floor(N / w) / G) is; the first folder's tail shorter than its share of a step is read in
    the next epoch."""
    return math.floor(rows[0] / weights[0])


def step_counts(weights: list[Fraction], global_batch: int,
                credits: list[Fraction]) -> tuple[list[int], list[Fraction]]:
    """Each source's rows in the next step, and the credits after it (see the module docstring)."""
    due = [credit + global_batch * weight for credit, weight in zip(credits, weights)]
    counts = [math.floor(global_batch * weight) for weight in weights]
    left = global_batch - sum(counts)
    behind = sorted(range(len(weights)), key=lambda i: (counts[i] - due[i], i))[:left]
    for i in behind:
        counts[i] += 1
    return counts, [owed - count for owed, count in zip(due, counts)]


@dataclass(frozen=True)
class Position:
    """Where a mixture stands: per source, the rows taken so far and the credit."""

    taken: tuple[int, ...]
    credits: tuple[Fraction, ...]

    @classmethod
    def start(cls, sources: int) -> "Position":
        return cls((0,) * sources, (Fraction(0),) * sources)

    def to_dict(self, sources: list[Source]) -> dict[str, Any]:
        """The state's plain-data form (the checkpoint's JSON), fractions exact."""
        return {source.name: {"weight": str(source.weight), "taken": taken, "credit": str(credit)}
                for source, taken, credit in zip(sources, self.taken, self.credits)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any] | None, sources: list[Source]) -> "Position":
        """The position saved for these sources: a source the checkpoint did not read starts at its first row; when
        the folders or weights changed, the credits start again from zero (the shares follow the new weights)."""
        saved = saved or {}
        taken = tuple(int(saved.get(source.name, {}).get("taken", 0)) for source in sources)
        same = {name: entry.get("weight") for name, entry in saved.items()} == {
            source.name: str(source.weight) for source in sources}
        credits = tuple(Fraction(saved[source.name]["credit"]) if same else Fraction(0) for source in sources)
        return cls(taken, credits)


def position_at_weight(position: int, saved: dict[str, Any] | None, sources: list[Source]) -> int:
    """A mixture's position in its epoch (rows of the mixture) counted at the first folder's weight now. Its epoch is
    a pass over the first folder (epoch_rows), of which position x the saved weight rows were taken: a resume that
    changed that weight (adding a folder changes it too) read the saved position at the new one, and the epoch ran
    backwards (0.47 to 0.27) and ended a pass early or late."""
    entry = (saved or {}).get(sources[0].name)
    if entry is None or Fraction(entry["weight"]) == sources[0].weight:
        return position
    return math.floor(position * Fraction(entry["weight"]) / sources[0].weight)


def source_seed(seed: int, name: str) -> int:
    """The seed of a source's permutations: the run's, salted by the source's name (not its place in the list)."""
    return seed * 65_537 + zlib.crc32(name.encode())


def interleave(per_source: list[list[int]]) -> list[int]:
    """The step's rows, each source's spread evenly over the step (its j-th of n rows at (j + 1/2) / n)."""
    keyed = [((j + 0.5) / len(rows), i, row) for i, rows in enumerate(per_source) for j, row in enumerate(rows)]
    return [row for *_, row in sorted(keyed)]


def mixture_steps(sources: list[Source], rows: list[int], offsets: list[int], global_batch: int, position: Position,
                  permutation: Callable[..., list[int]], seed: int) -> Iterator[tuple[list[int], Position]]:
    """The rows of every step from `position` on (numbered as in the joined split: a source's rows from its offset),
    each with the position after it. `permutation(num_rows, seed=, epoch=)` is order.epoch_permutation."""
    weights = [source.weight for source in sources]
    orders: dict[tuple[int, int], list[int]] = {}

    def row_of(i: int, index: int) -> int:
        epoch = index // rows[i]
        if (i, epoch) not in orders:
            for past in [key for key in orders if key[0] == i and key[1] < epoch]:  # not read again; another folder's
                del orders[past]  # order stays: clearing them all recomputed a large folder's at every step or two
            orders[(i, epoch)] = permutation(rows[i], seed=source_seed(seed, sources[i].name), epoch=epoch)
        return offsets[i] + orders[(i, epoch)][index % rows[i]]

    taken, credits = list(position.taken), list(position.credits)
    while True:
        counts, credits = step_counts(weights, global_batch, credits)
        step = [[row_of(i, taken[i] + j) for j in range(count)] for i, count in enumerate(counts)]
        taken = [before + count for before, count in zip(taken, counts)]
        yield interleave(step), Position(tuple(taken), tuple(credits))
