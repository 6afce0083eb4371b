"""The prepared data folder, read as training steps and evaluation batches on this rank's device.

Worker processes (--num_workers) start as app/reliability/workers.py says: forked by a forkserver, never by the rank,
and deaf to the stop signals meant for the rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset, DatasetDict, concatenate_datasets, load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from app.data.formats import Batch, DataFormat, Layout, Sample, with_trained_tokens, without_training
from app.data.mixture import Position, Source, mixture_steps, parse_eval_folders, parse_sources
from app.data.order import StepBatches, epoch_permutation, epochs_of_steps, eval_plan
from app.optimization.schedule import TrainingPlan
from app.reliability.workers import worker_options

if TYPE_CHECKING:
    from lightning_fabric import Fabric


@dataclass(frozen=True)
class SourceRows:
    """Where one folder's rows sit in the joined splits (a mixture's; a single folder's are the whole splits)."""

    source: Source
    train: range
    validation: range


@dataclass
class TrainingData:
    format: DataFormat
    train: Dataset
    validation: Dataset
    train_trained_tokens: np.ndarray
    """Each train row's trained tokens: a step's total is known on every rank without a collective."""
    set_aside: set[int] = field(default_factory=set)
    """Train rows in quarantine (the spike guard's): read as every other row, trained on by no token."""
    sources: list[SourceRows] = field(default_factory=list)
    """The folders read, in order: more than one make a mixture."""
    evaluated: dict[str, Dataset] = field(default_factory=dict)
    """--eval_data_dir's folders' validation splits by name: evaluated alongside, never trained on."""

    @property
    def mixture(self) -> bool:
        return len(self.sources) > 1

    def evaluable(self) -> bool:
        """Whether an evaluation has rows to measure: the training data's validation split, or --eval_data_dir's."""
        return bool(len(self.validation) or self.evaluated)

    def quarantine(self, rows: Iterable[int]) -> None:
        """From the next step on (and in the loaders made after this call) `rows` train nothing."""
        rows = set(rows)
        self.set_aside |= rows
        self.train_trained_tokens[sorted(rows)] = 0

    def row_batch(self, row: int) -> Batch:
        """One train row alone as a batch, on the host."""
        return self.format.collate(WithoutRows(self.train, self.set_aside).__getitems__([row]))

    def locate(self, row: int) -> tuple[str, int]:
        """The folder of a train row and its row there."""
        part = next(part for part in self.sources if row in part.train)
        return part.source.path, row - part.train.start

    def tokens_by_source(self, rows: list[int]) -> list[int]:
        """The trained tokens of `rows` (a step's) from each folder of the mixture."""
        starts = [part.train.start for part in self.sources]
        folder = np.searchsorted(starts, rows, side="right") - 1
        return np.bincount(folder, weights=self.train_trained_tokens[rows], minlength=len(starts)).astype(int).tolist()

    def rows_by_source(self, rows: list[int]) -> dict[str, list[int]]:
        """`rows` (a step's) as each folder's own row numbers, by folder name, in the step's order."""
        found: dict[str, list[int]] = {part.source.name: [] for part in self.sources}
        for row in rows:
            part = next(part for part in self.sources if row in part.train)
            found[part.source.name].append(row - part.train.start)
        return found

    def validation_samples(self) -> Iterator[Sample]:
        """Every validation sample (`DataFormat.every_sample`), a mixture's folders taking turns, each in its own
        order: --eval_samples then shows every folder (the first N of the joined split were all the first one's)."""
        streams = [self.format.every_sample(split) for split in self.validation_splits().values()]
        return (sample for turn in zip_longest(*streams) for sample in turn if sample is not None)

    def validation_splits(self) -> dict[str, Dataset]:
        """The validation split of each folder of a mixture by name; of a single folder, under the name ''."""
        if not self.mixture:
            return {"": self.validation}
        return {part.source.name: self.validation.select(part.validation) for part in self.sources
                if len(part.validation)}  # a folder prepared with --val_fraction 0 has none


class WithoutRows(TorchDataset):
    """A split whose rows in `excluded` come without training (formats.without_training)."""

    def __init__(self, split: Dataset, excluded: set[int]) -> None:
        self.split, self.excluded = split, excluded

    def __len__(self) -> int:
        return len(self.split)

    def __getitems__(self, rows: list[int]) -> list[dict]:
        found = self.split.__getitems__(rows)
        return [without_training(item) if row in self.excluded else item for row, item in zip(rows, found)]


def load_data(train_data_dir: str | Path, layout: Layout = "position_ids",
              eval_data_dir: Optional[str] = None) -> TrainingData:
    """The folder's splits, or a mixture's (`--train_data_dir`, mixture.py) joined folder after folder, and the
    validation splits of `--eval_data_dir`'s folders; packed rows reach the model in `layout` (the one the
    preflight's probe chose)."""
    sources = parse_sources(str(train_data_dir))
    data_format = replace(DataFormat.of(sources[0].path), layout=layout)
    folders = [load_from_disk(source.path) for source in sources]
    kept = {name: shared_columns(data_format, [folder[name].column_names for folder in folders])
            for name in ("train", "validation")}
    splits = {name: concatenate_datasets([folder[name].select_columns(columns) for folder in folders])
              if len(folders) > 1 else folders[0][name] for name, columns in kept.items()}
    train, counts = with_trained_tokens(splits["train"], data_format)
    validation, _ = with_trained_tokens(splits["validation"], data_format)
    return TrainingData(data_format, train, validation, counts, sources=joined(sources, folders),
                        evaluated=evaluated_splits(eval_data_dir, str(train_data_dir), data_format))


def evaluated_splits(eval_data_dir: Optional[str], train_data_dir: str, data_format: DataFormat) -> dict[str, Dataset]:
    """The validation split of each folder of --eval_data_dir, by name (the preflight checked their format and
    tokenizer against the training data's)."""
    if not eval_data_dir:
        return {}
    return {name: with_trained_tokens(load_from_disk(path)["validation"], data_format)[0]
            for name, path in parse_eval_folders(eval_data_dir, train_data_dir).items()}


def shared_columns(data_format: DataFormat, folders_columns: list[Iterable[str]]) -> list[str]:
    """The columns a mixture's joined split keeps, given each folder's: the format's, and those its samples read
    where every folder has them (without `response_spans` a sample's prompt is found from the labels, wrong where
    prompts were trained)."""
    return data_format.columns + [column for column in data_format.sample_columns
                                  if all(column in columns for columns in folders_columns)]


def joined(sources: list[Source], folders: list[DatasetDict]) -> list[SourceRows]:
    parts, train, validation = [], 0, 0
    for source, folder in zip(sources, folders):
        rows, held_out = len(folder["train"]), len(folder["validation"])
        parts.append(SourceRows(source, range(train, train + rows), range(validation, validation + held_out)))
        train, validation = train + rows, validation + held_out
    return parts


@dataclass
class Step:
    """One optimizer step's micro-batches on this rank, and the trained tokens of the whole step on all ranks."""

    micro_batches: Sequence[Batch]
    """A list, or MicroBatches read as the step runs them."""
    trained_tokens: int
    rows: list[int]
    """The rows of the whole step, all ranks' (order.step_rows)."""
    mixture: Optional[dict[str, Any]] = None
    """A mixture's position after this step (state["mixture"])."""


class MicroBatches:
    """A step's micro-batches, each read from the loader (and copied to the device) when the step comes to it: read
    all before the first forward, they kept a GPU idle while the host collated and copied every one (64 a step in
    a shipped config), where it now does so while the device runs the ones before. `reading` measures each read
    (the loop's data wait). Read once, in order: the step that reads them is the only one."""

    def __init__(self, loader: Iterator[Batch], count: int,
                 reading: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.loader, self.count, self.reading = loader, count, reading

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Batch]:
        for _ in range(self.count):
            with self.reading():
                batch = next(self.loader)
            yield batch


def step_sequence(data: TrainingData, plan: TrainingPlan, *, seed: int, epoch: int, position: int,
                  mixture: Optional[dict[str, Any]]) -> Iterator[tuple[list[int], Optional[dict[str, Any]]]]:
    """The rows of every step from the state's position on (all ranks'), with a mixture's position after each."""
    if not data.mixture:
        return ((rows, None) for rows in epochs_of_steps(len(data.train), plan, seed=seed, epoch=epoch,
                                                          position=position))
    sources = [part.source for part in data.sources]
    steps = mixture_steps(sources, [len(part.train) for part in data.sources],
                          [part.train.start for part in data.sources], plan.global_batch_size,
                          Position.from_dict(mixture, sources), epoch_permutation, seed)
    return ((rows, after.to_dict(sources)) for rows, after in steps)


SHARED_MEMORY = Path("/dev/shm")
BATCHES_IN_FLIGHT_PER_WORKER = 2
"""torch's DataLoader prefetch_factor: the batches each worker keeps ready, in shared memory until the rank reads
them."""


def batch_bytes(data: TrainingData, micro_batch_size: int) -> int:
    """The most bytes a training micro-batch holds: packed and text rows are all one block, so the first rows tell
    (masks included); a padded batch (input_ids, attention_mask and labels, int64) pads each to the split's longest
    row, and a seq2seq batch its labels to the longest target."""
    if not data.format.padded:
        batch = data.format.collate(data.train.__getitems__(list(range(min(micro_batch_size, len(data.train))))))
        return sum(tensor.numel() * tensor.element_size() for tensor in batch.inputs.values())
    table = data.train.data  # load_from_disk's rows, in their order (no indices mapping)
    longest = {name: pc.max(pc.list_value_length(table.column(name))).as_py() or 0 for name in ("input_ids", "labels")}
    return micro_batch_size * 8 * (2 * longest["input_ids"] + longest["labels"])


def workers_that_fit(num_workers: int, data: TrainingData, micro_batch_size: int, ranks_on_node: int,
                     shared_memory: Path = SHARED_MEMORY) -> tuple[int, Optional[str]]:
    """--num_workers, or 0 with a note when the batches the node's workers keep in flight do not fit in /dev/shm:
    a container's is 64 MB unless started with --ipc=host or --shm-size (Kubernetes' too), and a worker that could
    not put its batch there lost it (a traceback of its queue's thread), while the rank waited for it until the stall
    watchdog ended the run, whose advice to resume stalled again. Counted for a micro-batch of the split's longest
    rows (a padded batch pads to its longest), the batches waiting and the one each rank reads."""
    if not num_workers or not shared_memory.is_dir():
        return num_workers, None
    stats = os.statvfs(shared_memory)
    free = stats.f_bavail * stats.f_frsize
    needed = ranks_on_node * (num_workers * BATCHES_IN_FLIGHT_PER_WORKER + 1) * batch_bytes(data, micro_batch_size)
    if needed <= free:
        return num_workers, None
    ranks = f"{ranks_on_node} rank{'s' if ranks_on_node > 1 else ''}"
    return 0, (f"note: --num_workers {num_workers}: the batches the loader workers of this node's {ranks} keep in "
               f"{shared_memory} need about {needed / 2**20:,.1f} MB, and it has {free / 2**20:,.1f} MB free (a "
               "container's is 64 MB): each rank reads its batches itself "
               "(--num_workers 0); start the container with --ipc=host or a larger --shm-size to use workers")


def train_steps(fabric: Fabric, data: TrainingData, plan: TrainingPlan, *, seed: int, epoch: int, position: int,
                num_workers: int, mixture: Optional[dict[str, Any]] = None,
                reading: Callable[[], AbstractContextManager] = nullcontext) -> Iterator[Step]:
    """Steps from the state's position (epoch, position and a mixture's) onwards, without end, their micro-batches
    read as they run (`reading` measures each read). The loader's sampler and the steps read two copies of the same
    sequence: the loader's workers may run ahead of the steps."""
    where = dict(seed=seed, epoch=epoch, position=position, mixture=mixture)
    sampler = StepBatches((rows for rows, _ in step_sequence(data, plan, **where)), plan, rank=fabric.global_rank)
    split = WithoutRows(data.train, set(data.set_aside)) if data.set_aside else data.train
    # A generator of its own: without one, starting the loader draws its workers' base seed from torch's global
    # generator, which a resumed run restored just before, and every dropout mask after a resume would differ.
    loader = DataLoader(split, batch_sampler=sampler, collate_fn=data.format.collate, num_workers=num_workers,
                        pin_memory=fabric.device.type == "cuda", generator=torch.Generator().manual_seed(seed),
                        **worker_options(num_workers))
    micro_batches = iter(fabric.setup_dataloaders(loader, use_distributed_sampler=False, move_to_device=True))
    for rows, after in step_sequence(data, plan, **where):
        yield Step(MicroBatches(micro_batches, plan.accumulation, reading), int(data.train_trained_tokens[rows].sum()),
                   rows, after)


def eval_batches(fabric: Fabric, data_format: DataFormat, split: Dataset, *, batch_size: int,
                 max_batches: int) -> Iterator[Batch]:
    """This rank's batches of a validation split; padding rows (a rank past the end of the split) have no trained
    tokens."""
    for planned in eval_plan(len(split), batch_size=batch_size, rank=fabric.global_rank,
                             world_size=fabric.world_size, max_batches=max_batches):
        rows = split.__getitems__(planned.rows)
        for row in rows[planned.real_rows:]:
            without_training(row)
        batch = data_format.collate(rows)
        batch.inputs = fabric.to_device(batch.inputs)
        yield batch
