"""The baselines bench_training.py measures the application against, each launched by torchrun in 2 processes.

- `bare_fsdp`: the plain torch FSDP loop of PyTorch's FSDP tutorial (seed 002) with the application's FSDP settings
  (wrapping the decoder layers, FULL_SHARD, use_orig_params, limit_all_gathers, gradient clipping, warmup + cosine):
  what a user would write by hand, without checkpoints, guards or metrics.
- `hf_trainer`: Hugging Face Trainer with its defaults, which runs DDP over gloo on CPU;
- `hf_trainer_compiled`: the same with `torch_compile=True`.

Both train the same model from the same config on the same packed data, and print on rank 0 one JSON line:
{"steps": N, "train_sec": seconds from just before the first step to the end of the last}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import (AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments,
                          get_cosine_schedule_with_warmup)


@dataclass(frozen=True)
class Workload:
    """What every contender trains: the same model, data, batch, steps and optimizer settings."""

    model_config: str
    data: str
    out_dir: str
    steps: int
    micro_batch_size: int
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 5
    grad_clip: float = 1.0
    log_interval: int = 10
    seed: int = 0


def token_batches(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Packed blocks need no padding: the labels are the inputs (the model shifts them)."""
    input_ids = torch.stack([torch.as_tensor(row["input_ids"], dtype=torch.long) for row in rows])
    return {"input_ids": input_ids, "labels": input_ids}


def fresh_model(work: Workload) -> torch.nn.Module:
    torch.manual_seed(work.seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(work.model_config))


def bare_fsdp(work: Workload) -> float:
    dist.init_process_group("gloo")
    model = fresh_model(work)
    layer_classes = {type(m) for m in model.modules() if type(m).__name__ in model._no_split_modules}
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(layer_classes),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"), use_orig_params=True,
                 limit_all_gathers=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=work.lr, weight_decay=work.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, work.warmup_steps, work.steps)
    train = load_from_disk(work.data)["train"]
    loader = DataLoader(train, batch_size=work.micro_batch_size, collate_fn=token_batches, drop_last=True,
                        sampler=DistributedSampler(train, shuffle=True, seed=work.seed))
    batches = iter(loader)
    dist.barrier()
    started = time.perf_counter()
    for step in range(1, work.steps + 1):
        batch = next(batches)
        loss = model(**batch).loss
        loss.backward()
        model.clip_grad_norm_(work.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % work.log_interval == 0 or step == work.steps:
            dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
            loss.item()
    return time.perf_counter() - started


class StepTimer(TrainerCallback):
    """Trainer's own hooks around its loop: the same span the application's summary calls train_sec."""

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.ended = time.perf_counter()


def hf_trainer(work: Workload, compile: bool = False) -> float:
    arguments = TrainingArguments(
        output_dir=work.out_dir, max_steps=work.steps, per_device_train_batch_size=work.micro_batch_size,
        learning_rate=work.lr, weight_decay=work.weight_decay, warmup_steps=work.warmup_steps,
        lr_scheduler_type="cosine", max_grad_norm=work.grad_clip, logging_steps=work.log_interval,
        save_strategy="no", eval_strategy="no", report_to="none", use_cpu=True, seed=work.seed,
        dataloader_num_workers=0, disable_tqdm=True, torch_compile=compile)
    timer = StepTimer()
    trainer = Trainer(model=fresh_model(work), args=arguments, train_dataset=load_from_disk(work.data)["train"],
                      data_collator=token_batches, callbacks=[timer])
    trainer.train()
    return timer.ended - timer.started


BASELINES = {"bare_fsdp": bare_fsdp, "hf_trainer": hf_trainer, "hf_trainer_compiled": partial(hf_trainer, compile=True)}


def main() -> None:
    """`torchrun --nproc_per_node 2 baselines.py NAME WORKLOAD_JSON`."""
    if len(sys.argv) != 3 or sys.argv[1] not in BASELINES:
        sys.exit(f"usage: torchrun --nproc_per_node 2 benchmarks/baselines.py {{{','.join(BASELINES)}}} WORKLOAD_JSON "
                 "(bench_training.py starts it)")
    name, workload = sys.argv[1], Workload(**json.loads(sys.argv[2]))
    train_sec = BASELINES[name](workload)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({"steps": workload.steps, "train_sec": train_sec}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
