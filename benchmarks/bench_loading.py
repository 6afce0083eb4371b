"""Loading a pretrained model under fsdp: the meta route (each rank builds the model on the meta device, FSDP shards
it, and the rank copies its piece of every tensor from the safetensors files, app/model/build.py) against the plain
route (transformers' from_pretrained on every rank, then FSDP shards it), side by side: the peak RSS of each rank and
the wall time of a `train.py --eval_only true` run on 2 CPU processes.

The model is a Llama with tied embeddings (as Llama-3.2, Gemma, Qwen2.5's small models), saved in files of
`--shard_size` as the Hub's are. Under `--precision 32-true` the fp32 files load as they are; under `bf16-true`
each tensor is cast, which from_pretrained does for the whole model on every rank.

Run: `python benchmarks/bench_loading.py [--hidden 2048 --layers 8 --vocab 32000 --shard_size 200MB]
[--precision bf16-true]` (about 2 minutes on 2 cores at those sizes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAIN_ROUTE = f"""import runpy, sys
sys.path.insert(0, {str(ROOT)!r})
import app.training.run
app.training.run.deferred_init = lambda cfg, model_config: None  # every rank: from_pretrained
runpy.run_path({str(ROOT / 'train.py')!r}, run_name="__main__")
"""
"""train.py with the plain route forced, in a file: Lightning's launcher starts rank 1 with the same script."""


def save_model(folder: Path, args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                         num_key_value_heads=args.hidden // 128, tie_word_embeddings=True)
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, max_shard_size=args.shard_size)
    return sum(parameter.numel() for parameter in model.parameters())


def prepare_data(folder: Path) -> None:
    """A few files of the standard library's json package, tokenized with a tokenizer trained on them."""
    inputs = sorted(str(path) for path in Path(json.__file__).parent.glob("*.py"))
    subprocess.run([sys.executable, str(ROOT / "prepare_data.py"), "--input", *inputs, "--vocab_size", "1000",
                    "--block_size", "128", "--val_fraction", "0.1", "--output_dir", str(folder)],
                   check=True, capture_output=True)


def load_and_evaluate(script: list[str], work: Path, name: str, precision: str) -> dict:
    out_dir = work / name
    started = time.monotonic()
    result = subprocess.run([sys.executable, *script, "--model_name", str(work / "model"), "--train_data_dir",
                             str(work / "data"), "--out_dir", str(out_dir), "--accelerator", "cpu", "--devices", "2",
                             "--strategy", "fsdp", "--precision", precision, "--eval_only", "true",
                             "--micro_batch_size", "1", "--eval_iters", "2", "--num_workers", "0",
                             "--wandb_mode", "disabled"], cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{name}: train.py failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"wall_sec": time.monotonic() - started, "val_loss": summary["val_loss"],
            "peak_rss_gb": max(rank["peak_rss_gb"] for rank in summary["ranks"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard_size", default="200MB")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-loading-") as folder:
        work = Path(folder)
        parameters = save_model(work / "model", args)
        prepare_data(work / "data")
        (work / "plain_route.py").write_text(PLAIN_ROUTE)
        plain = load_and_evaluate([str(work / "plain_route.py")], work, "plain", args.precision)
        meta = load_and_evaluate([str(ROOT / "train.py")], work, "meta", args.precision)
        files = len(list((work / "model").glob("*.safetensors")))
    print(f"{parameters / 1e6:.0f}M parameters (tied embeddings) in {files} safetensors files, {args.precision}, "
          "2 processes, fsdp, --eval_only true")
    for name, result in (("plain route (from_pretrained on every rank)", plain), ("meta route", meta)):
        print(f"  {name:<45} peak RSS {result['peak_rss_gb']:.2f} GB per rank, {result['wall_sec']:.1f} s, "
              f"val_loss {result['val_loss']:.4f}")
    print(f"  meta / plain: peak RSS {meta['peak_rss_gb'] / plain['peak_rss_gb']:.2f}, "
          f"time {meta['wall_sec'] / plain['wall_sec']:.2f}")
    if abs(meta["val_loss"] - plain["val_loss"]) > 1e-4 * abs(plain["val_loss"]):
        sys.exit("the two routes evaluate the same weights to different losses")


if __name__ == "__main__":
    main()
