"""The user's path on one GPU in one prepared command (`make gpu-check`), and the same script on CPU in a tiny mode
(`--tiny`, run by the test suite) so that it cannot rot.

Every step is what a user runs: `prepare_data.py`'s preparation, `python train.py` and `convert_to_hf.py` as
separate processes on one device, nothing downloaded (models from configs, data from the Python standard library):
1. a Llama-architecture model of about 1.5B parameters (2048 wide, 16 layers, Llama-3's 128K vocabulary, untied)
   under fsdp and fsdp2 with bf16-mixed: every step's loss of one against the other, tokens/s, MFU and the peak
   memory against what `--estimate_memory` planned;
2. the same model under bf16-true, 16-mixed (fsdp), `--compile`, activation checkpointing and, under fsdp2,
   `--optimizer muon` (its Newton-Schulz iterations' cost);
3. a 128K-vocabulary model at 8K tokens per micro-batch with the chunked loss and with the model's own
   (`--chunked_loss false`): peak memory and tokens/s;
4. an `--async_save` half-way, then a resume from it in a new run folder: its losses against the uninterrupted run's
   (the first resumed step's forward reads exactly the saved weights); later, the same from GPT-2's synchronous save
   (on a GPU copied through pinned memory);
5. `convert_to_hf.py` on the last checkpoint, whose logits it verifies against the training model's, and the trace
   `--profile_steps` wrote of the resumed run's last step (on a GPU, with its kernels);
6. GPT-2 and T5 under bf16-mixed: what `train.py --estimate_memory` plans for each run against its peak;
7. a supervised step on packed examples under flash_attention_2 where the image has flash-attn, else SDPA;
8. on a GPU, the fsdp run again with `--loss_kernel cut_cross_entropy` (Triton: not in the tiny mode).
Prints one table (also written as JSON to --out) with the card, driver and versions.

On a GPU machine that lacks this project's pure-Python dependencies, `make gpu-wheels` downloads them (.whl/) and
the command installs them first (docs/performance.md#gpu-check). Takes about 8 minutes on one H100; `--tiny` about a
minute on 2 CPU cores (a 2-layer model in fp32, and bf16-true with activation checkpointing in one run, Muon in
another; no 16-mixed or compile, which need a GPU). The memory planned is the planner's own figure for each run (in
process).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import torch  # noqa: E402
    import transformers  # noqa: E402
except ImportError as missing:  # make gpu-check with a python3 that lacks them: say so, no traceback
    sys.exit(f"gpu_check.py: error: {missing.name} is not installed for {sys.executable}; run it with a Python that "
             "has torch 2.11+ and transformers 5.17+ (GPU_PYTHON=... make gpu-check)")
from transformers import LlamaConfig  # noqa: E402

from app.metrics.memory_plan import RUNTIME_BYTES, ModelShape, Setup, estimate_memory, report_total_gb  # noqa: E402

MFU_TARGET = 0.40
"""Of the 1.5B model compiled, with the loss that is fastest on a GPU (issue 45; torchtitan publishes 33-39% for
Llama-3-8B under FSDP on 8 H100s)."""
CORPUS = ("asyncio", "email", "json", "logging", "http", "unittest")


@dataclass(frozen=True)
class Scale:
    """What changes between the GPU check and its tiny CPU mode."""

    model: dict
    vocabulary_model: dict
    block_size: int
    long_block_size: int
    steps: int
    micro_batch_size: int
    """Of the 1.5B model's runs: 4 x 2048 tokens, as torchtitan's 8K tokens per GPU (the 128K-vocabulary model at
    8K tokens runs 1)."""
    lr: float
    """Large enough for the loss to fall visibly within `steps` steps of one micro-batch."""
    hardware: list[str]
    precisions: dict[str, Optional[str]]
    """The row name -> the --precision it runs with (None: not run at this scale)."""
    variants: list[tuple[str, list[str]]]
    """Runs that show the other precisions and options train, each a row: its name and train.py options."""
    loss_tolerance: float
    """fsdp2 against fsdp, relative, per step."""
    architectures: list[tuple[str, str, dict, int]]
    """GPT-2 and T5 (name, model type, config, micro batch): the planner against their peak under bf16-mixed."""
    architecture_run: tuple[str, list[str]] = ("bf16-mixed", ["--precision", "bf16-mixed"])
    """Their runs' name and options. On CPU, ddp: the CPU's autocast, which the planner measures on CPU as it
    measures CUDA's for fsdp on a GPU."""


GPU = Scale(model=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256),
            vocabulary_model=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
            block_size=2048, long_block_size=8192, steps=12, micro_batch_size=4, lr=3e-4,
            hardware=["--accelerator", "gpu", "--devices", "1"],
            precisions={"bf16-mixed": "bf16-mixed"},
            variants=[("fsdp bf16-true", ["--precision", "bf16-true"]),
                      ("fsdp bf16-true --stochastic_rounding (its AdamW's cost against the row above)",
                       ["--precision", "bf16-true", "--stochastic_rounding", "true"]),
                      ("fsdp 16-mixed", ["--precision", "16-mixed"]),
                      ("fsdp bf16-mixed --compile (the model's own loss, the default)",
                       ["--precision", "bf16-mixed", "--compile", "true"]),
                      ("fsdp bf16-mixed, activation checkpointing",
                       ["--precision", "bf16-mixed", "--gradient_checkpointing", "true"]),
                      ("fsdp2 bf16-mixed --optimizer muon (its cost against fsdp2's AdamW row above)",
                       ["--strategy", "fsdp2", "--precision", "bf16-mixed", "--optimizer", "muon"])],
            loss_tolerance=1e-2,
            architectures=[("GPT-2 (355M)", "gpt2", dict(n_embd=1024, n_layer=24, n_head=16, n_positions=2048,
                                                         vocab_size=50257), 4),
                           ("T5 (223M)", "t5", dict(d_model=768, d_ff=3072, d_kv=64, num_layers=12, num_heads=12,
                                                    vocab_size=32128, pad_token_id=2, decoder_start_token_id=2), 32)])
TINY = Scale(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=2000),
             vocabulary_model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=8192),
             block_size=64, long_block_size=256, steps=6, micro_batch_size=1, lr=3e-3,
             hardware=["--accelerator", "cpu", "--devices", "1"],
             precisions={"bf16-mixed": "32-true"},
             variants=[("fsdp bf16-true, activation checkpointing",
                        ["--precision", "bf16-true", "--gradient_checkpointing", "true"]),
                       ("fsdp2 --optimizer muon", ["--strategy", "fsdp2", "--optimizer", "muon"])],
             loss_tolerance=1e-4,
             architectures=[("GPT-2", "gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                                   vocab_size=2000), 2),
                            ("T5", "t5", dict(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
                                              vocab_size=2000, pad_token_id=2, decoder_start_token_id=2), 4)],
             architecture_run=("ddp bf16-mixed", ["--strategy", "ddp", "--precision", "bf16-mixed"]))


@dataclass
class Row:
    check: str
    result: str
    expected: str = ""
    ok: Optional[bool] = None
    numbers: dict = field(default_factory=dict)


class Check:
    """The work folder, the scale and the rows found so far, written to `out` as each is found (a check cut off by
    the GPU machine's time limit still leaves what it found)."""

    def __init__(self, scale: Scale, work: Path, out: Path, tiny: bool, minutes: Optional[float] = None) -> None:
        self.scale, self.work, self.out, self.rows, self.minutes = scale, work, out, [], minutes
        self.on_gpu = not tiny and torch.cuda.is_available()
        """Whether the checks run on the GPU: the tiny mode runs on CPU also where a GPU is (the suite on a GPU
        machine), and its verdicts are the CPU's."""
        self.machine, self.started = machine(self.on_gpu) | {"tiny": tiny}, time.monotonic()

    def time_left(self, name: str) -> bool:
        """Whether `name` may start within --minutes; if not, a row says it was not run (the GPU machine's time
        is counted, and the checks run in the order of what they prove)."""
        if self.minutes is None or time.monotonic() - self.started < self.minutes * 60:
            return True
        self.add(Row(name, f"not run: the --minutes {self.minutes:g} budget was spent"))
        return False

    def add(self, row: Row) -> None:
        self.rows.append(row)
        verdict = "" if row.ok is None else (" ok" if row.ok else " FAILED")
        print(f"  {row.check}: {row.result}{verdict}", flush=True)
        self.write()

    def write(self) -> None:
        self.machine["minutes"] = round((time.monotonic() - self.started) / 60, 1)
        self.out.write_text(json.dumps({"machine": self.machine, "rows": [asdict(r) for r in self.rows]}, indent=1))

    def script(self, *arguments: str) -> subprocess.CompletedProcess:
        """A script of the project run as a user runs it; in the tiny mode on CPU, whatever the machine holds."""
        hidden = {} if self.on_gpu else {"CUDA_VISIBLE_DEVICES": ""}
        return subprocess.run([sys.executable, *arguments], cwd=ROOT, capture_output=True, text=True,
                              env=os.environ | hidden)

    def model(self, name: str, shape: dict) -> Path:
        folder = self.work / name
        LlamaConfig(**shape, max_position_embeddings=self.scale.long_block_size, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2).save_pretrained(folder)
        return folder

    def train_arguments(self, model: Path, data: Path, out: Path, *options: str) -> list[str]:
        """train.py's command line for a run of --steps steps logging every step. It writes no checkpoint unless
        `options` ask for one: the GPU model's training state is 18 GB, and the GPU machine's disk holds 64 GB."""
        return ["train.py", "--model_config", str(model), "--train_data_dir", str(data), "--out_dir", str(out),
                "--max_step", str(self.scale.steps), "--micro_batch_size", str(self.scale.micro_batch_size),
                "--log_interval", "1", "--eval_iters", "2", "--eval_step_interval", "1000",
                "--save_step_interval", "0", "--initial_validation", "false", "--warmup_steps", "2",
                "--lr", str(self.scale.lr), "--wandb_mode", "disabled", "--num_workers", "0",
                *self.scale.hardware, *options]

    def train(self, name: str, model: Path, data: Path, *options: str) -> Optional[dict]:
        """The run; its summary with the per-step losses, None if it failed."""
        out = self.work / name
        result = self.script(*self.train_arguments(model, data, out, *options))
        if result.returncode != 0:
            self.add(Row(name, f"train.py exited {result.returncode}: {last_line(result.stderr)}", ok=False,
                         numbers={"output": (result.stdout + result.stderr).splitlines()[-40:]}))
            return None
        summary = json.loads((out / "summary.json").read_text())
        with open(out / "metrics.csv") as file:
            logged = [r for r in csv.DictReader(file) if r.get("train_loss")]
        summary["losses"] = {int(r["step"]): float(r["train_loss"]) for r in logged}
        return summary | steady_throughput(logged)

    def estimate_gb(self, model: Path, strategy: str, precision: str) -> float:
        """What --estimate_memory plans for one device of this check's runs (app/metrics/memory_plan.py), less the
        runtime it adds (the CUDA context, kernels and NCCL's buffers, which CUDA's allocator does not hold and
        `check_runtime` measures)."""
        from app.model.build import resolve_wrap_classes

        config = LlamaConfig.from_pretrained(model)
        shape = ModelShape.of(config, resolve_wrap_classes(config, None))
        setup = Setup(strategy=strategy, sharding_strategy="NO_SHARD" if strategy == "fsdp" else "FULL_SHARD",
                      precision=precision, world_size=1, devices_per_node=1,
                      micro_batch_size=self.scale.micro_batch_size,
                      block_size=self.scale.block_size, gradient_checkpointing=False, cpu_offload=False,
                      chunked_loss=True)
        return (estimate_memory(shape, setup).total - setup.runtime) / 2**30

    def plan_gb(self, name: str, model: Path, data: Path, *options: str) -> Optional[float]:
        """The total that `train.py ... --estimate_memory true` prints for the run with these options, as a user
        plans it (GB); None, with a failed row, if it printed none."""
        result = self.script(*self.train_arguments(model, data, self.work / f"{name}-plan", *options),
                             "--estimate_memory", "true")
        total = report_total_gb(result.stdout)
        if total is None:
            self.add(Row(name, f"--estimate_memory exited {result.returncode}: {last_line(result.stderr)}", ok=False))
        return total


def last_line(text: str) -> str:
    return (text.strip().splitlines() or ["(nothing printed)"])[-1][:300]


def peak_gb(summary: dict) -> float:
    """The device's peak: reserved by CUDA's allocator on a GPU (what the card must hold), RSS on a CPU."""
    rank = summary["ranks"][0]
    return rank.get("peak_reserved_gb", rank.get("peak_rss_gb", float("nan")))


def steady_throughput(logged: list[dict]) -> dict:
    """tokens/s and MFU of the steps' second half, each step's as logged (--log_interval 1), their median: the run's
    mean would count CUDA's warm-up and --compile's compilation in the first steps."""
    second_half = logged[len(logged) // 2:]
    return {name: statistics.median(float(r[name]) for r in second_half)
            for name in ("tokens_per_sec", "mfu") if second_half and all(r.get(name) for r in second_half)}


def throughput(summary: dict) -> str:
    """tokens/s, MFU and the peak; on a GPU also the peak of the tensors themselves (CUDA's allocated memory), so that
    a plan's shortfall tells tensors it left out from the allocator's fragmentation."""
    mfu = f", MFU {summary['mfu']:.1%}" if "mfu" in summary else ""
    allocated = summary["ranks"][0].get("peak_allocated_gb")
    tensors = f" ({allocated:.2f} allocated)" if allocated is not None and allocated == allocated else ""
    return f"{summary['tokens_per_sec']:,.0f} tokens/s{mfu}, peak {peak_gb(summary):.2f} GB{tensors}"


def largest_difference(ours: dict[int, float], theirs: dict[int, float]) -> float:
    steps = sorted(set(ours) & set(theirs))
    return max((abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in steps), default=float("inf"))


def prepare_text(work: Path, block_size: int, name: str, tokenizer: Optional[Path] = None) -> Path:
    """Standard-library source in blocks, with a 2,000-piece tokenizer trained on it (or `tokenizer`)."""
    from app.prepare import PrepareArgs, prepare, stdlib_corpus_paths
    from app.prepare.corpus import quiet_progress

    out = work / name
    with quiet_progress():
        prepare(PrepareArgs(input=stdlib_corpus_paths(CORPUS), output_dir=str(out), block_size=block_size,
                            val_fraction=0.05, seed=0, **({"tokenizer": str(tokenizer)} if tokenizer else
                                                          {"vocab_size": 2000})))
    return out


def prepare_seq2seq(check: Check, tokenizer: Path) -> Path:
    """The standard library's code -> summary pairs as `make summarize-demo` prepares them for T5."""
    from app.prepare import PrepareArgs, prepare
    from app.prepare.corpus import quiet_progress
    from app.prepare.stdlib_tasks import code_summary_pairs, write_pairs

    pairs, out = check.work / "seq2seq-pairs.jsonl", check.work / "seq2seq-data"
    write_pairs(code_summary_pairs(), pairs)
    with quiet_progress():
        prepare(PrepareArgs(input=[str(pairs)], source_field="code", target_field="summary", tokenizer=str(tokenizer),
                            max_source_length=check.scale.block_size // 4, max_target_length=48, val_fraction=0.1,
                            seed=0, output_dir=str(out)))
    return out


def prepare_supervised(check: Check, tokenizer: Path) -> Path:
    """The standard library's code -> summary pairs (`make sft-demo`'s task), packed with the default chat template."""
    from app.prepare import PrepareArgs, prepare
    from app.prepare.corpus import quiet_progress
    from app.prepare.stdlib_tasks import code_summary_pairs, write_pairs

    pairs, out = check.work / "pairs.jsonl", check.work / "sft-data"
    write_pairs(code_summary_pairs(), pairs)
    with quiet_progress():
        prepare(PrepareArgs(input=[str(pairs)], prompt_field="code", response_field="summary",
                            tokenizer=str(tokenizer), block_size=check.scale.block_size, val_fraction=0.1,
                            output_dir=str(out)))
    return out


RUNTIME_PROBE = """
import json, os, torch, torch.distributed as dist
torch.cuda.set_device(0)
free, total = torch.cuda.mem_get_info()
context = total - free - torch.cuda.memory_reserved()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
x = torch.ones(2**20, device="cuda", dtype=torch.bfloat16)
dist.all_reduce(x)
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
(torch.nn.functional.scaled_dot_product_attention(a[None, None], a[None, None], a[None, None]) + a @ a).sum().item()
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
print(json.dumps({"context": context, "runtime": total - free - torch.cuda.memory_reserved()}))
dist.destroy_process_group()
"""


def check_runtime(check: Check) -> None:
    """The card's memory that no tensor holds: the CUDA context alone, then with NCCL's communicator (one rank),
    cuBLAS's and the attention kernels' workspaces loaded, against the planner's flat RUNTIME_BYTES."""
    if not check.on_gpu:
        return
    result = check.script("-c", RUNTIME_PROBE)
    if result.returncode != 0:
        check.add(Row("CUDA context, kernels and NCCL", f"probe exited {result.returncode}: "
                      f"{last_line(result.stderr)}", ok=False))
        return
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    check.add(Row("CUDA context, kernels and NCCL (1 rank), outside the allocator",
                  f"context {measured['context'] / 2**30:.2f} GB, with NCCL and kernels "
                  f"{measured['runtime'] / 2**30:.2f} GB; planned {RUNTIME_BYTES / 2**30:.2f} GB",
                  "within the plan", measured["runtime"] <= RUNTIME_BYTES, measured))


LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)


def check_llama_3_8b_plan(check: Check) -> None:
    """What --estimate_memory plans for Llama-3-8B at 8K tokens per GPU on one node of 8 such cards (FULL_SHARD,
    bf16-mixed, chunked loss; weightless, nothing downloaded), with and without activation checkpointing: with it
    (as torchtitan trains this model on H100s), it must fit the card. On CPU, against an H100's 80 GB."""
    from app.model.build import resolve_wrap_classes

    config = LlamaConfig(**LLAMA_3_8B)
    shape = ModelShape.of(config, resolve_wrap_classes(config, None))
    card = torch.cuda.get_device_properties(0).total_memory if check.on_gpu else 80e9
    planned = {}
    for checkpointing in (False, True):
        setup = Setup(strategy="fsdp", sharding_strategy="FULL_SHARD", precision="bf16-mixed", world_size=8,
                      devices_per_node=8, micro_batch_size=1, block_size=8192,
                      gradient_checkpointing=checkpointing, cpu_offload=False, chunked_loss=True)
        planned[checkpointing] = estimate_memory(shape, setup).total
    check.add(Row(f"Llama-3-8B ({shape.parameters / 1e9:.2f}B), 1 x 8192 tokens per GPU, fsdp FULL_SHARD over 8, "
                  "bf16-mixed: planned", f"{planned[False] / 2**30:.1f} GB, {planned[True] / 2**30:.1f} GB with "
                  f"activation checkpointing, of the card's {card / 2**30:.1f} GB",
                  "fits with 10% free (with checkpointing)", planned[True] <= 0.9 * card,
                  {"planned_gb": planned[False] / 2**30, "checkpointing_gb": planned[True] / 2**30,
                   "card_gb": card / 2**30}))


def check_loss_head(check: Check) -> None:
    """The loss head alone (benchmarks/bench_loss.py): the chunked loss's default against the materialising path,
    its time, memory and its loss and gradients against the materialising path's (bf16 on a GPU: the products'
    rounding; fp32 on CPU)."""
    result = check.script("benchmarks/bench_loss.py", *([] if check.on_gpu else ["--tiny"]))
    rows = bench_loss_rows(result.stdout)
    if result.returncode != 0 or len(rows) < 2:
        check.add(Row("loss head", f"bench_loss.py exited {result.returncode}: {last_line(result.stderr)}", ok=False))
        return
    table = {row[0]: row[1:] for row in rows}
    chunked = default_chunk_row(table)
    if chunked is None or "materialised logits" not in table:
        check.add(Row("loss head", f"bench_loss.py printed no default chunk: {last_line(result.stdout)}", ok=False))
        return
    (own_ms, own_gb, _), (ms, gb, differences) = table["materialised logits"], table[chunked]
    loss_difference, *gradient_differences = (float(d) for d in differences.split(","))
    tolerance = 5e-2 if check.on_gpu else 1e-5
    check.add(Row(f"loss head alone, {chunked} / materialised logits",
                  f"{ms} / {own_ms} ms, {gb} / {own_gb} GB; loss within {loss_difference:.1e}, gradients within "
                  f"{max(gradient_differences):.1e}", f"loss within 1e-4, gradients within {tolerance:g}",
                  loss_difference <= 1e-4 and max(gradient_differences) <= tolerance,
                  {"table": result.stdout.splitlines()}))


def check_fused_kernels(check: Check) -> None:
    """The fused kernels installed (Liger Kernel, Cut Cross-Entropy; `make gpu-wheels` brings them) in the same
    benchmark, for the record: last, since their Triton kernels compile and tune first. Not on CPU."""
    if not check.on_gpu:
        return
    result = check.script("benchmarks/bench_loss.py", "--fused_kernels")
    table = {row[0]: row[1:] for row in bench_loss_rows(result.stdout)}
    if result.returncode != 0 or "materialised logits" not in table or default_chunk_row(table) is None:
        check.add(Row("fused kernels", f"bench_loss.py exited {result.returncode}: {last_line(result.stderr)}",
                      ok=False))
        return
    own_ms, own_gb, _ = table["materialised logits"]
    chunked_ms, chunked_gb, _ = table[default_chunk_row(table)]
    for kernel in [name for name in table if not name.startswith(("materialised", "chunked"))]:
        ms, gb, differences = table[kernel]
        check.add(Row(f"loss head alone, {kernel} / chunked (default) / materialised logits",
                      f"{ms} / {chunked_ms} / {own_ms} ms, {gb} / {chunked_gb} / {own_gb} GB; {kernel}'s loss, "
                      f"gradients within {differences}", ok=False if ms == "failed" else None,
                      numbers={"table": result.stdout.splitlines()}))


def default_chunk_row(table: dict[str, list[str]]) -> Optional[str]:
    """The chunked loss as training runs it: the default chunk, on a GPU with the fp32 sum in the GEMM."""
    return next((name for name in table if "(default)" in name and "fp32 copies" not in name), None)


def bench_loss_rows(printed: str) -> list[list[str]]:
    """The rows of bench_loss.py's table, header and rule left out."""
    return [line.strip("| ").split(" | ", 3) for line in printed.splitlines()  # a message may hold " | "
            if line.startswith("| ") and not line.startswith("| ---")][1:]


def check_strategies(check: Check, model: Path, data: Path) -> dict[str, Optional[dict]]:
    """fsdp against fsdp2 under the mixed precision users train in, and each run's speed and memory. The fsdp run
    also saves in the background half-way, for the resume check (its final checkpoint is deleted at once: the
    model's training state is 18 GB, the GPU machine's disk 64 GB)."""
    precision, steps = check.scale.precisions["bf16-mixed"], check.scale.steps
    saves = {"fsdp": ["--save_step_interval", str(steps // 2), "--async_save", "true"], "fsdp2": []}
    runs = {}
    for strategy in ("fsdp", "fsdp2"):
        runs[strategy] = check.train(f"{strategy}-{precision}", model, data, "--strategy", strategy,
                                     "--precision", precision, *saves[strategy])
        delete_checkpoints(check.work / f"{strategy}-{precision}", keep=steps // 2)
    if not all(runs.values()):
        return runs
    difference = largest_difference(runs["fsdp2"]["losses"], runs["fsdp"]["losses"])
    check.add(Row(f"losses, fsdp2 against fsdp, {precision}, {check.scale.steps} steps",
                  f"largest relative difference {difference:.1e}", f"<= {check.scale.loss_tolerance:g}",
                  difference <= check.scale.loss_tolerance, {"difference": difference}))
    on_gpu = check.on_gpu  # on CPU the peak is the process's RSS, not its tensors
    for strategy, summary in runs.items():
        planned = check.estimate_gb(model, strategy, precision)
        ratio = peak_gb(summary) / planned
        check.add(Row(f"{strategy} {precision}", f"{throughput(summary)}; planned {planned:.2f} GB of tensors"
                      + (f" ({ratio:.2f}x)" if on_gpu else ""), "peak within 10% of the plan" if on_gpu else "",
                      abs(ratio - 1) <= 0.10 if on_gpu else None,
                      {k: summary.get(k) for k in ("tokens_per_sec", "mfu")} | {"peak_gb": peak_gb(summary),
                                                                                 "planned_gb": planned}))
    check_staging_memory(check, model, runs)
    return runs


def check_staging_memory(check: Check, model: Path, runs: dict[str, dict]) -> None:
    """The host memory the fsdp run's --async_save staging holds (its peak RSS less the fsdp2 run's, which saves
    nothing) against the training state it copies, the fp32 weights and AdamW's two moments: on a GPU it is pinned,
    at its exact size (app/checkpoint/writers.py `pin_exactly`), where torch's pinned allocator would have rounded
    it up to the next power of two (32 GiB for the 16.7 GiB of the 1.5B model)."""
    from app.model.build import resolve_wrap_classes

    config = LlamaConfig.from_pretrained(model)
    state = ModelShape.of(config, resolve_wrap_classes(config, None)).parameters * 12 / 2**30
    held = runs["fsdp"]["ranks"][0]["peak_rss_gb"] - runs["fsdp2"]["ranks"][0]["peak_rss_gb"]
    on_gpu = check.on_gpu
    check.add(Row("--async_save's staging: host peak RSS of fsdp with it less fsdp2 without",
                  f"{held:.2f} GB for {state:.2f} GB of training state", "within 10% of the state" if on_gpu else "",
                  abs(held / state - 1) <= 0.10 if on_gpu else None, {"held_gb": held, "state_gb": state}))


def check_variants(check: Check, model: Path, data: Path, variants: list[tuple[str, list[str]]]) -> None:
    """The other precisions, --compile and activation checkpointing: each trains, with its speed and memory."""
    for name, options in variants:
        if not check.time_left(name):
            continue
        summary = check.train(re.sub(r"\W+", "-", name), model, data, *options)
        if summary:
            losses = summary["losses"]
            first, last = losses[min(losses)], losses[max(losses)]
            compiled_default = "--compile" in options
            target = MFU_TARGET if check.on_gpu and compiled_default else None
            check.add(Row(name, f"loss {first:.3f} -> {last:.3f}, {throughput(summary)}", "the loss falls"
                          + (f", MFU >= {target:.0%}" if target else ""),
                          last < first and (target is None or summary.get("mfu", 0) >= target),
                          {k: summary.get(k) for k in ("tokens_per_sec", "mfu")} | {"peak_gb": peak_gb(summary)}))


def check_chunked_loss(check: Check, model: Path, data: Path) -> None:
    mixed = check.scale.precisions["bf16-mixed"]
    runs = {chunked: check.train(f"vocabulary-chunked-{chunked}", model, data, "--precision", mixed,
                                 "--chunked_loss", chunked, "--micro_batch_size", "1") for chunked in ("true", "false")}
    if all(runs.values()):
        chunked, full = runs["true"], runs["false"]
        on_gpu = check.on_gpu  # the tiny model's logits are too small to show
        check.add(Row(f"{check.scale.vocabulary_model['vocab_size']:,}-token vocabulary, 1 x "
                      f"{check.scale.long_block_size} tokens: chunked loss / own loss",
                      f"peak {peak_gb(chunked):.2f} / {peak_gb(full):.2f} GB, tokens/s "
                      f"{chunked['tokens_per_sec']:,.0f} / {full['tokens_per_sec']:,.0f}",
                      "less memory" if on_gpu else "", peak_gb(chunked) < peak_gb(full) if on_gpu else None,
                      {"peak_gb": [peak_gb(chunked), peak_gb(full)],
                       "tokens_per_sec": [chunked["tokens_per_sec"], full["tokens_per_sec"]]}))


def check_cut_cross_entropy(check: Check, model: Path, data: Path, straight: dict) -> None:
    """`--loss_kernel cut_cross_entropy` (GPU only) against the chunked loss of the fsdp run: the same losses (its
    logits are not rounded to bf16 before the loss, and its gradient filter drops small gradients), its speed and
    memory."""
    precision = check.scale.precisions["bf16-mixed"]
    summary = check.train(f"fsdp-{precision}-cut-cross-entropy", model, data, "--strategy", "fsdp", "--precision",
                          precision, "--loss_kernel", "cut_cross_entropy")
    if summary:
        difference = largest_difference(summary["losses"], straight["losses"])
        check.add(Row(f"fsdp {precision} --loss_kernel cut_cross_entropy", f"{throughput(summary)}; losses within "
                      f"{difference:.1e} of the chunked loss's (tokens/s {straight['tokens_per_sec']:,.0f}, peak "
                      f"{peak_gb(straight):.2f} GB)", f"losses within {check.scale.loss_tolerance:g}",
                      difference <= check.scale.loss_tolerance,
                      {k: summary.get(k) for k in ("tokens_per_sec", "mfu")} | {"peak_gb": peak_gb(summary),
                                                                                 "difference": difference}))


def delete_checkpoints(run: Path, keep: Optional[int]) -> None:
    """A run's checkpoints but the one of step `keep`, once no check needs them."""
    from app.checkpoint import list_checkpoints

    for step, path in list_checkpoints(run).items():
        if step != keep:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def check_resume(check: Check, model: Path, data: Path, straight: dict, run: str, options: list[str], kind: str,
                 save_last: bool = False, profile: bool = False) -> None:
    """Resume the straight run in folder `run` (trained with `options`) from its half-way `kind` save, in the
    folder `run`-resumed: the same losses. With `save_last` the resumed run saves its last step, which the
    conversion reads; with `profile` it traces its last step (--profile_steps), which changes none of its losses."""
    from app.checkpoint import list_checkpoints

    middle, last = check.scale.steps // 2, check.scale.steps
    saved = list_checkpoints(check.work / run).get(middle)
    if saved is None:
        check.add(Row(f"resume ({run})", f"no checkpoint of step {middle} was written", ok=False))
        return
    traced = ["--profile_steps", str(last)] if profile else []
    resumed = check.train(f"{run}-resumed", model, data, *options, "--resume", "true", "--checkpoint", str(saved),
                          "--save_step_interval", str(last if save_last else 0), *traced)
    delete_checkpoints(check.work / run, keep=None)
    if resumed:
        first = middle + 1
        exact = abs(resumed["losses"][first] - straight["losses"][first]) <= 1e-6 * abs(straight["losses"][first])
        rest = largest_difference(resumed["losses"], straight["losses"])
        check.add(Row(f"resume from the {kind} save of step {middle} ({run})", f"step {first} loss "
                      f"{resumed['losses'][first]:.6f} against {straight['losses'][first]:.6f}; later steps within "
                      f"{rest:.1e}", "the first resumed step's loss identical", exact, {"later": rest}))
        if profile:
            check_trace(check, check.work / f"{run}-resumed" / "profile" / f"steps-{last}-{last}-rank-0.json.gz")


def check_trace(check: Check, path: Path) -> None:
    """The trace --profile_steps wrote: the model's matrix products, and on a GPU the kernels that ran them."""
    if not path.is_file():
        check.add(Row("--profile_steps", f"no trace at {path}", "a trace of the step", False))
        return
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    kernels = sum(event.get("cat") == "kernel" for event in events)
    products = sum(event.get("name") in ("aten::mm", "aten::addmm", "aten::matmul") for event in events)
    check.add(Row("--profile_steps", f"{products} matrix products and {kernels} GPU kernels traced in one step",
                  "matrix products, and kernels on a GPU", products > 0 and (kernels > 0 or not check.on_gpu),
                  {"kernels": kernels, "products": products}))


def check_conversion(check: Check, run: str) -> None:
    """convert_to_hf.py on the last checkpoint of the run in folder `run`."""
    output = check.work / "hf-model"
    result = check.script("convert_to_hf.py", "--checkpoint", str(check.work / run), "--output_dir", str(output))
    verified = re.search(r"logits verified.*", result.stdout + result.stderr)
    check.add(Row("convert_to_hf.py", verified.group(0) if verified else last_line(result.stderr),
                  "logits verified", result.returncode == 0 and verified is not None))


def check_architectures(check: Check, text_data: Path) -> None:
    """GPT-2 on the text blocks and T5 on code -> summary pairs, bf16-mixed: what `--estimate_memory` plans
    for the very run (its total less the runtime, which CUDA's allocator does not hold) against its peak, with the
    loss falling, its tokens/s and MFU. GPT-2's run also saves synchronously half-way (on a GPU through the pinned
    staging arena), and a resume from that save must give its next loss (4.3 GB of training state a checkpoint,
    where the Llama model's 18 GB would not leave the disk room for a second run's)."""
    from transformers import AutoConfig

    (run, run_options), seq2seq = check.scale.architecture_run, None
    for label, model_type, shape, micro_batch in check.scale.architectures:
        name = f"{label} {run}, micro batch {micro_batch}"
        if not check.time_left(name):
            continue
        config = AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=2, **shape)  # the tokenizer's
        if config.is_encoder_decoder:
            seq2seq = seq2seq or prepare_seq2seq(check, text_data / "tokenizer")
        model, data = check.work / f"{model_type}-model", seq2seq if config.is_encoder_decoder else text_data
        config.save_pretrained(model)
        options = [*run_options, "--micro_batch_size", str(micro_batch)]
        planned = check.plan_gb(name, model, data, *options)
        saves = ["--save_step_interval", str(check.scale.steps // 2)] if model_type == "gpt2" else []
        summary = check.train(f"{model_type}-architecture", model, data, *options, *saves) if planned is not None \
            else None
        if summary is None:
            continue
        losses, on_gpu = summary["losses"], check.on_gpu
        first, last = losses[min(losses)], losses[max(losses)]
        tensors = planned - RUNTIME_BYTES / 2**30 if on_gpu else planned  # on CPU the peak is the RSS: no verdict
        ratio = peak_gb(summary) / tensors
        check.add(Row(name, f"loss {first:.3f} -> {last:.3f}, {throughput(summary)}; planned {tensors:.2f} GB"
                      + (f" of tensors ({ratio:.2f}x)" if on_gpu else ""),
                      "the loss falls" + (", peak within 10% of the plan" if on_gpu else ""),
                      last < first and (abs(ratio - 1) <= 0.10 or not on_gpu),
                      {k: summary.get(k) for k in ("tokens_per_sec", "mfu")} | {"peak_gb": peak_gb(summary),
                                                                                 "planned_gb": tensors}))
        if saves and check.time_left(f"resume ({label})"):
            check_resume(check, model, data, summary, f"{model_type}-architecture", options, "synchronous")


def check_supervised(check: Check, model: Path, tokenizer: Path) -> None:
    data = prepare_supervised(check, tokenizer)
    attention = "flash_attention_2" if importlib.util.find_spec("flash_attn") and check.on_gpu else "sdpa"
    summary = check.train("supervised", model, data, "--precision", check.scale.precisions["bf16-mixed"],
                          "--attn_implementation", attention)
    if summary:
        losses = summary["losses"]
        check.add(Row(f"supervised, packed, {attention}", throughput(summary), "finite losses",
                      all(loss == loss and abs(loss) != float("inf") for loss in losses.values())))


def run_checks(check: Check, scale: Scale) -> None:
    """In the order of what each proves, so that a run cut short by --minutes or the machine's limit has the most:
    the runtime, the 8B plan and the loss head alone (seconds), fsdp against fsdp2, --compile's MFU, the chunked
    loss at 128K x 8K, the resume and conversion, the planner on GPT-2 (with a resume from its synchronous save) and
    T5, then the other precisions, activation checkpointing, the supervised step, Cut Cross-Entropy in training and
    the fused kernels on the loss head alone."""
    check_runtime(check)
    check_llama_3_8b_plan(check)
    check_loss_head(check)
    data = prepare_text(check.work, scale.block_size, "data")
    model = check.model("model", scale.model)
    straight = check_strategies(check, model, data)
    compiled = [variant for variant in scale.variants if "--compile" in variant[1]]
    check_variants(check, model, data, compiled)
    if check.time_left("chunked loss"):
        long_data = prepare_text(check.work, scale.long_block_size, "long-data", data / "tokenizer")
        check_chunked_loss(check, check.model("vocabulary-model", scale.vocabulary_model), long_data)
    if straight["fsdp"] and check.time_left("resume"):
        precision = scale.precisions["bf16-mixed"]
        check_resume(check, model, data, straight["fsdp"], f"fsdp-{precision}",
                     ["--strategy", "fsdp", "--precision", precision], "async", save_last=True, profile=True)
        if check.time_left("convert_to_hf.py"):
            check_conversion(check, f"fsdp-{precision}-resumed")
    check_architectures(check, data)
    check_variants(check, model, data, [variant for variant in scale.variants if variant not in compiled])
    if check.time_left("supervised"):
        check_supervised(check, model, data / "tokenizer")
    if check.on_gpu and straight["fsdp"] and check.time_left("--loss_kernel cut_cross_entropy"):
        check_cut_cross_entropy(check, model, data, straight["fsdp"])
    if check.time_left("fused kernels"):
        check_fused_kernels(check)


def machine(on_gpu: bool) -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}
    if on_gpu:
        found["device"] = torch.cuda.get_device_name(0)
        smi = shutil.which("nvidia-smi")
        if smi:
            found["driver"] = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True).stdout.strip()
    else:
        found["device"] = f"CPU ({platform.processor() or platform.machine()})"
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the CPU mode the test suite runs")
    parser.add_argument("--out", default="gpu-check.json", help="the table as JSON")
    parser.add_argument("--minutes", type=float, help="start no check after this many minutes (each not run gets a "
                        "row saying so): the GPU machine's time is counted")
    options = parser.parse_args()
    scale = TINY if options.tiny else GPU
    if not options.tiny and not torch.cuda.is_available():
        print("gpu_check.py: error: no GPU here; run it on a GPU machine, or --tiny on CPU", file=sys.stderr)
        return 2
    if not Path(options.out).absolute().parent.is_dir():
        print(f"gpu_check.py: error: --out {options.out}: no such folder to write it in", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        check = Check(scale, Path(folder), Path(options.out), options.tiny, options.minutes)
        run_checks(check, scale)
    check.write()
    print("\n" + ", ".join(f"{k} {v}" for k, v in check.machine.items() if k != "tiny"))
    print("\n| check | result | expected | |\n| --- | --- | --- | --- |")
    for row in check.rows:
        verdict = "" if row.ok is None else "ok" if row.ok else "FAILED"
        print(f"| {row.check} | {row.result} | {row.expected} | {verdict} |")
    return 0 if all(row.ok is not False for row in check.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
