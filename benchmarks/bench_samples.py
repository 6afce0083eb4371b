"""--eval_samples' generation on 2 CPU processes under FSDP (gloo): each rank's prompts one at a time, as the
application generated them before, against the padded batches it generates now (app/evaluation/samples.py
generation_batches, within the tokens of one prompt of a block and its answer), side by side in one invocation,
alternating, on the same model and prompts. Every generated token is one forward, and under FSDP each forward gathers
every weight: the forwards a rank makes are counted, and one evaluation's samples timed. Both must generate the same
tokens (float32).

Run: python benchmarks/bench_samples.py [--samples 16] [--max_new_tokens 64] [--block 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.data.formats import Sample  # noqa: E402
from app.evaluation.samples import CAUSAL, generate_samples  # noqa: E402


def prompts(count: int, block: int, vocab: int) -> list[Sample]:
    """Prompts of a 32nd to an 8th of the block, as supervised data packed into long blocks has them (the answers
    are not read)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(block // 32, block // 8, (count,), generator=generator).tolist()
    return [Sample(prompt=torch.randint(3, vocab, (length,), generator=generator).tolist(), reference=[2])
            for length in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from app.distributed.strategy import build_fabric
    from arguments import Config

    config = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2 * options.block)
    fabric = build_fabric(Config(accelerator="cpu", devices=2, strategy="fsdp", precision="32-true"), 2,
                          {LlamaDecoderLayer}, [])
    fabric.launch()
    torch.manual_seed(0)
    hugging_face = LlamaForCausalLM(config)
    forwards: list[int] = []
    hugging_face.register_forward_hook(lambda *_: forwards.append(1))
    model = fabric.setup_module(hugging_face)
    samples = prompts(options.samples, options.block, config.vocab_size)
    budgets = {"one at a time": 0, "batched": options.block + options.max_new_tokens}
    seconds: dict[str, list[float]] = {name: [] for name in budgets}
    generated, made = {}, {}
    for repeat in range(options.repeats):
        for name in (list(budgets) if repeat % 2 == 0 else list(reversed(budgets))):
            forwards.clear()
            dist.barrier()
            start = time.perf_counter()
            generated[name] = generate_samples(fabric, model, samples, decoding=CAUSAL,
                                               max_new_tokens=options.max_new_tokens, stop_ids={2},
                                               token_budget=budgets[name])
            seconds[name].append(time.perf_counter() - start)
            made[name] = len(forwards)
    if fabric.is_global_zero:
        same = generated["one at a time"] == generated["batched"]
        median = {name: statistics.median(values) for name, values in seconds.items()}
        lengths = [len(sample.prompt) for sample in samples]
        print(f"{options.samples} prompts of {min(lengths)}-{max(lengths)} tokens, {options.max_new_tokens} new tokens "
              f"each, 2 ranks (fsdp, gloo), {options.repeats} repeats")
        print("| generation | forwards per rank | seconds (median) | range |")
        print("| --- | --- | --- | --- |")
        for name in budgets:
            print(f"| {name} | {made[name]} | {median[name]:.2f} | {min(seconds[name]):.2f}-{max(seconds[name]):.2f} |")
        print(f"batched / one at a time: {median['batched'] / median['one at a time']:.2f} of the time; "
              f"the same tokens: {same}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
