"""train.py computes what a plain single-process PyTorch loop computes.

The loop below is the definition of supervised training on packed data, written without the application: the
pretrained model loaded with transformers; each epoch one seeded permutation of the train rows, taken a global batch
at a time (a tail too short for a whole step left out); every packed example run alone, as packing must mean; a
step's loss the sum of its token cross-entropies over the trained tokens of the whole step (all micro-batches, all
ranks); AdamW with weight decay on the matrices only; torch's gradient clipping; linear warmup, then a cosine to
--min_lr reached at --max_step.

train.py runs the same 12 steps with FSDP and with FSDP2 on 2 CPU processes, 2 accumulated micro-batches of 3 packed
rows each (micro-batches and ranks holding different numbers of trained tokens), across an epoch's end, from a model
whose biases and norm weights are not their initial zeros and ones, with clipping active at every step. Its per-step
train_loss and grad_norm (metrics.csv) agree with the loop's within 2.2e-7 relative and its lr exactly; the weights
of its last checkpoint within 1.8e-5 of each tensor's largest value (2026-11-29).

The tolerances (2e-6 for losses and norms, 1e-4 for weights) fail on the usual mistakes, each checked by putting it
into the loop: weight decay on biases and norm weights as well moves the losses up to 4e-4 (from step 3 on, 1.7e-5),
the norms 1.2e-3 and the biases 2e-3; the mean of the micro-batches' mean losses moves the losses 3.5e-4 and the
norms 8e-3 at step 1 (up to 1.5e-3 and 2e-2 later) and the weights 0.26; packed examples that attend to
each other (every row run whole) move the norms 4e-5 at step 1 (up to 1.3e-4), the losses up to 7e-5 and the
weights 0.28.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import read_checkpoint, run_train, train_args
from tests.test_training import assert_succeeded, read_metrics

BLOCK = 256
IGNORE_INDEX = -100
RUN = dict(micro_batch_size=3, gradient_accumulation_steps=2, max_step=12, warmup_steps=3, lr=3e-3, min_lr=3e-4,
           weight_decay=0.1, grad_clip=0.5, seed=7)
"""2 ranks x 2 micro-batches x 3 rows: 12 rows a step, 9 steps in the 112 rows of an epoch here (4 left out), then
the next epoch's order."""


@pytest.fixture(scope="module")
def packed(tiny, pairs, tmp_path_factory) -> Path:
    """Code -> summary pairs, prompts masked, packed into rows of 256 tokens (about 2 examples a row)."""
    from app.prepare import PrepareArgs, prepare

    folder = tmp_path_factory.mktemp("parity") / "data"
    prepare(PrepareArgs(input=[str(pairs)], prompt_field="code", response_field="summary",
                        tokenizer=str(tiny.tokenizer), block_size=BLOCK, val_fraction=0.1, packing=True,
                        output_dir=str(folder)))
    return folder


@pytest.fixture(scope="module")
def pretrained(tiny, tmp_path_factory) -> Path:
    """The tiny Llama with biases in its attention and MLP, every bias non-zero and every norm weight away from 1:
    decaying them, or not, then shows."""
    folder = tmp_path_factory.mktemp("parity-pretrained")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny.model_config, max_position_embeddings=2 * BLOCK, attention_bias=True,
                                        mlp_bias=True)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
            elif parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
    model.save_pretrained(folder)
    return folder


def step_rows(num_rows: int, global_batch: int, seed: int, steps: int) -> list[list[int]]:
    """The train rows of each optimizer step: per epoch one permutation seeded by (seed, epoch), whole global
    batches of it, the tail left out (app/data/order.py)."""
    rows, epoch = [], 0
    while len(rows) < steps:
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        rows += [order[start:start + global_batch] for start in range(0, num_rows - global_batch + 1, global_batch)]
        epoch += 1
    return rows[:steps]


def examples(row: dict) -> list[tuple[list[int], list[int]]]:
    """The examples packed into a row, (input_ids, labels) each: they start where position_ids restart at 0 (a row's
    padding at its end is one more, with nothing to learn)."""
    starts = [i for i, position in enumerate(row["position_ids"]) if position == 0] + [len(row["input_ids"])]
    return [(row["input_ids"][a:b], row["labels"][a:b]) for a, b in zip(starts, starts[1:])]


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_step: int) -> float:
    """Linear warmup to lr over warmup_steps, then a cosine down to min_lr at max_step (steps counted from 1)."""
    if step <= warmup_steps:
        return lr * step / warmup_steps
    progress = (step - warmup_steps) / (max_step - warmup_steps)
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)


def reference_training(pretrained: Path, data: Path, *, micro_batch_size: int, gradient_accumulation_steps: int,
                       ranks: int, max_step: int, warmup_steps: int, lr: float, min_lr: float, weight_decay: float,
                       grad_clip: float, seed: int) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """Single-process training as the definition: each step's {train_loss, lr, grad_norm}, and the final weights.
    How the rows of a step are split into micro-batches and ranks changes nothing here: the step's loss is one sum
    over all of them divided by one count."""
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    model.train()
    train = load_from_disk(str(data))["train"]
    matrices = {name for name, p in model.named_parameters() if p.ndim >= 2 and "bias" not in name}
    optimizer = torch.optim.AdamW(
        [{"params": [p for name, p in model.named_parameters() if name in matrices], "weight_decay": weight_decay},
         {"params": [p for name, p in model.named_parameters() if name not in matrices], "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95))
    global_batch = micro_batch_size * ranks * gradient_accumulation_steps
    history = []
    for step, rows in enumerate(step_rows(len(train), global_batch, seed, max_step), start=1):
        pieces = [piece for row in rows for piece in examples(train[row])]
        trained_tokens = sum(sum(label != IGNORE_INDEX for label in labels[1:]) for _, labels in pieces)
        step_loss = 0.0
        for input_ids, labels in pieces:
            targets = torch.tensor(labels[1:])
            if (targets == IGNORE_INDEX).all():
                continue  # padding, or an example cut before its response: nothing to learn
            logits = model(input_ids=torch.tensor([input_ids])).logits[0, :-1]
            summed = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
            (summed / trained_tokens).backward()  # gradients add up over the step's examples
            step_loss += summed.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        rate = learning_rate(step, lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, max_step=max_step)
        for group in optimizer.param_groups:
            group["lr"] = rate
        optimizer.step()
        optimizer.zero_grad()
        # the loss and the norm of the weights before this step's update, the norm before clipping
        history.append({"train_loss": step_loss / trained_tokens, "lr": rate, "grad_norm": grad_norm.item()})
    return history, {name: p.detach() for name, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(packed, pretrained) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    return reference_training(pretrained, packed, ranks=2, **RUN)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_training_on_packed_examples_equals_a_plain_pytorch_loop(tiny, packed, pretrained, reference, strategy,
                                                                 tmp_path) -> None:
    out_dir = tmp_path / "run"
    assert_succeeded(run_train(train_args(tiny, out_dir, strategy=strategy, model_config=None, model_name=pretrained,
                                          tokenizer=None, train_data_dir=packed, eval_step_interval=100, eval_iters=1,
                                          eval_batch_size=1, save_step_interval=RUN["max_step"], **RUN)))
    history, weights = reference

    metrics = read_metrics(out_dir)
    assert all(h["grad_norm"] > RUN["grad_clip"] for h in history), "clipping is part of what is compared"
    for step, expected in enumerate(history, start=1):
        logged = metrics[step]
        assert logged["lr"] == pytest.approx(expected["lr"], rel=1e-12), step
        assert logged["train_loss"] == pytest.approx(expected["train_loss"], rel=2e-6), step
        assert logged["grad_norm"] == pytest.approx(expected["grad_norm"], rel=2e-6), step

    saved = read_checkpoint(out_dir / "checkpoints" / f"step-{RUN['max_step']:08d}.ckpt")
    assert saved["step"] == RUN["max_step"]
    assert sorted(saved["model"]) == sorted(weights)
    for name, expected in weights.items():
        difference = (saved["model"][name].float() - expected).abs().max() / expected.abs().max()
        assert difference < 1e-4, (name, difference.item())
