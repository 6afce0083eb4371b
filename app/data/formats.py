"""The data formats prepare_data.py writes (stats.json `format`), and all that training needs to know of each.

| format | columns | a batch for the model |
| --- | --- | --- |
| text | input_ids (blocks) | labels = input_ids |
| text_documents | input_ids, labels, position_ids (blocks) | as supervised_packed: each document apart (--document_masking) |
| supervised_packed | input_ids, labels, position_ids (blocks) | in the layout that keeps the examples apart in the run's model (below) |
| supervised_padded | input_ids, labels (one example per row) | padded to the longest row: pad id, label -100, attention_mask 0 |
| seq2seq | input_ids (source), labels (target) | padded the same way; the model builds its decoder inputs from the labels |

Packed examples are kept apart by the layout the preflight's probe of the run's model chose (app/model/isolation.py):
`position_ids` (the rows as prepared: their restarts at 0 become example boundaries in models that read them),
`one_row` (the micro batch flattened into one row, as transformers' DataCollatorWithFlattening does: FlashAttention
finds packed examples only in a one-row batch), or a block-diagonal causal `attention_mask` for models whose masks
ignore position_ids, as booleans (`boolean_mask`, SDPA) or added to the scores (`additive_mask`, eager). Flattening
changes no loss: every example's first token has label -100, so no row's last token learns to predict the next
row's first one. A mask costs rows x block^2 bytes per micro batch (4x that when additive).

Every row also gets its count of trained tokens, the targets that count in the loss (labels other than -100, after
the causal models' one-token shift): the loop divides a step's summed token losses by the step's count, which it
knows from these counts without any collective or device synchronisation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset
from torch.nn.utils.rnn import pad_sequence

from app.choices import IGNORE_INDEX, FormatName
from app.folders import STATS_FILE

Layout = Literal["position_ids", "one_row", "boolean_mask", "additive_mask"]
LAYOUTS: tuple[Layout, ...] = ("position_ids", "one_row", "boolean_mask", "additive_mask")
COLUMNS = {"text": ["input_ids"], "text_documents": ["input_ids", "labels", "position_ids"],
           "supervised_packed": ["input_ids", "labels", "position_ids"],
           "supervised_padded": ["input_ids", "labels"], "seq2seq": ["input_ids", "labels"]}
TRAINED_TOKENS = "trained_tokens"


@dataclass(frozen=True)
class Sample:
    """A validation example as a prompt (or a source) and the tokens it was trained to produce."""

    prompt: list[int]
    reference: list[int]


@dataclass
class Batch:
    """A micro-batch: the model's keyword arguments (labels included) and its number of trained tokens."""

    inputs: dict[str, torch.Tensor]
    trained_tokens: int

    def pin_memory(self) -> "Batch":
        """The batch in pinned host memory, which the DataLoader's pin_memory=True (on GPUs) asks of any object it
        does not know: without this method it passed the batch on as it was, and the copies to the GPU ran from
        pageable memory."""
        return Batch({name: tensor.pin_memory() for name, tensor in self.inputs.items()}, self.trained_tokens)


def read_stats(data_dir: str | Path) -> dict[str, Any]:
    """A prepared folder's stats.json ({} when it has none); ValueError when it is not a JSON object."""
    stats_file = Path(data_dir) / STATS_FILE
    try:
        stats = json.loads(stats_file.read_text()) if stats_file.is_file() else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"its {STATS_FILE} is not JSON ({error})") from None
    if not isinstance(stats, dict):
        raise ValueError(f"its {STATS_FILE} is not a JSON object")
    return stats


@dataclass(frozen=True)
class DataFormat:
    name: FormatName
    pad_token_id: int
    layout: Layout = "position_ids"
    """How packed rows reach the model (the formats that pack examples only)."""

    @classmethod
    def of(cls, data_dir: str | Path) -> "DataFormat":
        """From the folder's stats.json; a folder prepared before formats existed holds text blocks. ValueError for a
        stats.json that is not a JSON object or names a format this version does not read."""
        stats = read_stats(data_dir)
        if stats.get("format", "text") not in COLUMNS:
            raise ValueError(f"its {STATS_FILE} names the format {stats['format']!r}, not one of {', '.join(COLUMNS)}")
        pad = stats.get("pad_token_id")
        return cls(stats.get("format", "text"), pad if pad is not None else stats.get("eos_token_id") or 0)

    @property
    def columns(self) -> list[str]:
        return COLUMNS[self.name]

    @property
    def sample_columns(self) -> list[str]:
        """Columns beyond `columns` that `samples` reads: where each example's response lies."""
        return ["response_spans"] if self.supervised and not self.encoder_decoder else []

    @property
    def encoder_decoder(self) -> bool:
        return self.name == "seq2seq"

    @property
    def padded(self) -> bool:
        return self.name in ("supervised_padded", "seq2seq")

    @property
    def packs_examples(self) -> bool:
        """Several examples (or documents) in one row, which must not attend to each other
        (app/model/isolation.py)."""
        return self.name in ("supervised_packed", "text_documents")

    @property
    def supervised(self) -> bool:
        return self.name not in ("text", "text_documents")

    def collate(self, rows: list[dict[str, torch.Tensor]]) -> Batch:
        """The model's inputs for a list of rows (as `Dataset.__getitems__` gives them)."""
        trained = sum(int(row[TRAINED_TOKENS]) for row in rows)
        if self.padded:
            inputs = {"input_ids": self._pad(rows, "input_ids", self.pad_token_id),
                      "attention_mask": pad_sequence([torch.ones_like(row["input_ids"]) for row in rows],
                                                     batch_first=True, padding_value=0),
                      "labels": self._pad(rows, "labels", IGNORE_INDEX)}
            return Batch(inputs, trained)
        inputs = {name: torch.stack([row[name] for row in rows]) for name in self.columns}
        if self.packs_examples:
            return Batch(arrange(self.layout, inputs), trained)
        if self.name == "text":  # a row may bring its own labels: -100 for evaluation's padding rows
            inputs["labels"] = torch.stack([row.get("labels", row["input_ids"]) for row in rows])
        return Batch(inputs, trained)

    @staticmethod
    def _pad(rows: list[dict[str, torch.Tensor]], column: str, value: int) -> torch.Tensor:
        return pad_sequence([row[column] for row in rows], batch_first=True, padding_value=value)

    def trained_tokens(self, split: Dataset) -> np.ndarray:
        """Each row's number of trained tokens (int64)."""
        column = split.data.column("input_ids" if self.name == "text" else "labels")
        if self.name == "text":
            return np.maximum(pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64) - 1, 0)
        targets = column if self.encoder_decoder else pc.list_slice(column, 1)
        trained = pc.not_equal(pc.list_flatten(targets), IGNORE_INDEX).to_numpy(zero_copy_only=False)
        rows = pc.list_parent_indices(targets).to_numpy(zero_copy_only=False)
        return np.bincount(rows, weights=trained, minlength=len(split)).astype(np.int64)

    def samples(self, split: Dataset, count: int) -> list[Sample]:
        """The first `count` examples of a split as prompt and reference: the source and target of seq2seq data; of
        supervised data, what precedes an example's first response, and that response (through its end-of-turn).

        The response is where prepare_data.py recorded it from the chat's structure (`response_spans`); data
        prepared before it recorded them falls back to the first run of trained tokens, which is the response only
        when the prompt was not trained."""
        return list(islice(self.every_sample(split), count))

    def every_sample(self, split: Dataset) -> Iterator[Sample]:
        """`samples`, one by one, to the end of the split."""
        for row in split.with_format(None):
            if self.encoder_decoder:
                yield Sample(prompt=row["input_ids"], reference=row["labels"])
            else:
                yield from (sample for sample in map(_sample, packed_examples(row)) if sample.reference)


def arrange(layout: Layout, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's inputs for packed rows (`input_ids`, `labels`, `position_ids`, each rows x block) in `layout`."""
    if layout == "position_ids":
        return inputs
    if layout == "one_row":
        return {name: tensor.reshape(1, -1) for name, tensor in inputs.items()}
    allowed = block_causal(inputs["position_ids"])
    if layout == "boolean_mask":
        return inputs | {"attention_mask": allowed}
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return inputs | {"attention_mask": additive}


def per_example_counts(position_ids: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """For each token of packed rows (rows x tokens), the sum of `counted` (integers, same shape) over the example it
    belongs to: the runs of `position_ids` from 0, the padding that ends a row a run of its own. On the device, with
    no host synchronisation (scatter_add, not bincount, which waits for its largest index on a GPU)."""
    rows, tokens = position_ids.shape
    example = (position_ids == 0).cumsum(-1)  # from 1 in each row (0 before a row's first start)
    example = example + torch.arange(rows, device=example.device)[:, None] * (tokens + 1)
    sums = torch.zeros(rows * (tokens + 1), dtype=counted.dtype, device=example.device)
    sums.scatter_add_(0, example.flatten(), counted.flatten())
    return sums[example]


def block_causal(position_ids: torch.Tensor) -> torch.Tensor:
    """(rows, 1, T, T) booleans: query i may attend to key j when j <= i and both belong to the same example (an
    example starts wherever the positions restart at 0)."""
    example = (position_ids == 0).cumsum(-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return ((example[:, :, None] == example[:, None, :]) & causal)[:, None]


@dataclass(frozen=True)
class PackedExample:
    """One supervised example of a row: its tokens, labels and first response (start, end), None if unrecorded."""

    input_ids: list[int]
    labels: list[int]
    response: Optional[tuple[int, int]]


def packed_examples(row: dict[str, Any]) -> list[PackedExample]:
    """The examples of one supervised row: cut where position_ids restart at 0 (one example when unpacked)."""
    length = len(row["input_ids"])
    positions = row.get("position_ids") or range(length)
    starts = [i for i, position in enumerate(positions) if position == 0] + [length]
    spans = row.get("response_spans")
    responses = list(zip(spans[::2], spans[1::2])) if spans is not None else []
    examples = []
    for index, (a, b) in enumerate(zip(starts, starts[1:])):
        response = (responses[index][0] - a, responses[index][1] - a) if index < len(responses) else None
        examples.append(PackedExample(row["input_ids"][a:b], row["labels"][a:b], response))
    return examples


def _sample(example: PackedExample) -> Sample:
    if example.response is not None:
        start, end = example.response
    else:
        trained = [i for i, label in enumerate(example.labels) if label != IGNORE_INDEX]
        start = trained[0] if trained else len(example.labels)
        end = next((i for i in range(start, len(example.labels)) if example.labels[i] == IGNORE_INDEX),
                   len(example.labels))
    return Sample(prompt=example.input_ids[:start], reference=example.input_ids[start:end])


def without_training(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The row with every label IGNORE_INDEX and no trained token: it still goes through the model (every rank runs
    the same batches) but adds nothing to the loss or the gradients."""
    row["labels"] = row.get("labels", row["input_ids"]).clone().fill_(IGNORE_INDEX)
    row[TRAINED_TOKENS] = 0
    return row


def with_trained_tokens(split: Dataset, data_format: DataFormat) -> tuple[Dataset, np.ndarray]:
    """The split yielding int64 tensors of the format's columns and each row's trained tokens, and those counts."""
    counts = data_format.trained_tokens(split)
    split = split.add_column(TRAINED_TOKENS, counts.tolist())
    return split.with_format("torch", columns=[*data_format.columns, TRAINED_TOKENS], dtype=torch.long), counts
