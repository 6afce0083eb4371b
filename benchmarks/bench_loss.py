"""The loss head alone on one device: the chunked cross-entropy (app/model/loss.py) against the path that materialises
the logits (`F.linear`, the fp32 upcast transformers makes, `F.cross_entropy`), forward and backward, at Llama-3's
vocabulary and 8K tokens: time and the peak memory above the inputs, for several chunk sizes and with the fp32
accumulation of the weight's gradient inside the GEMM (CUDA) or in an fp32 GEMM of the operands' fp32 copies (as on
CPU); and each one's loss and gradients (hidden states, output weight) against the materialising path's. On a GPU,
the maintained fused kernels too where they are installed (Liger Kernel's fused linear cross-entropy, Apple's Cut
Cross-Entropy; Triton, CUDA only): the measurement behind app/model/loss.py's choice of its own.

The training runs of `gpu_check.py` show the whole step; this isolates the head, where the two paths differ, so
that a choice of chunk size is a measurement. On CPU (`--tiny`) a small shape checks that it runs.

Run: python benchmarks/bench_loss.py [--tokens 8192 --hidden 2048 --vocab 128256] [--tiny] [--fused_kernels]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from importlib.metadata import PackageNotFoundError, version
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.model import loss as loss_module  # noqa: E402
from app.model.loss import IGNORE_INDEX, chunk_tokens, chunked_cross_entropy  # noqa: E402


def materialised(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def liger_kernel() -> Callable:
    """Liger Kernel's fused linear cross-entropy, the weight's gradient summed in fp32 as the chunked loss's is."""
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", accum_dtype=torch.float32)
    return lambda hidden, weight, targets: liger(weight, hidden, targets)


def cut_cross_entropy() -> Callable:
    """Cut Cross-Entropy's default implementation (`cce`, its gradient filter at its default)."""
    from cut_cross_entropy import linear_cross_entropy

    return lambda hidden, weight, targets: linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX,
                                                                reduction="sum")


FUSED_KERNELS = {"liger-kernel": liger_kernel, "cut-cross-entropy": cut_cross_entropy}
"""Each installed distribution's loss of (hidden, weight, targets), made when measured."""


def installed_version(distribution: str) -> Optional[str]:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def measure(step: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> tuple[float, float]:
    """Median seconds of forward + backward, and the peak bytes allocated above what existed before."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        step().backward()
    synchronize()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step().backward()
        synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def results(step: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The loss and the inputs' gradients of one forward + backward."""
    for tensor in inputs:
        tensor.grad = None
    loss = step()
    loss.backward()
    return [loss.detach().float()] + [tensor.grad.float() for tensor in inputs]


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, help="default 8192 (--tiny: 256)")
    parser.add_argument("--hidden", type=int, help="default 2048 (--tiny: 64)")
    parser.add_argument("--vocab", type=int, help="default 128256 (--tiny: 2048)")
    parser.add_argument("--repeats", type=int, help="default 10 (--tiny: 2)")
    parser.add_argument("--tiny", action="store_true", help="a small shape on CPU in fp32")
    parser.add_argument("--fused_kernels", action="store_true",
                        help="also the fused kernels installed (liger-kernel, cut-cross-entropy; on a GPU)")
    options = parser.parse_args()
    defaults = dict(tokens=256, hidden=64, vocab=2048, repeats=2) if options.tiny else dict(
        tokens=8192, hidden=2048, vocab=128256, repeats=10)
    for name, default in defaults.items():
        value = getattr(options, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be 1 or more, got {value}")
        setattr(options, name, default if value is None else value)
    device = torch.device("cuda" if torch.cuda.is_available() and not options.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(options.tokens, options.hidden, device=device, dtype=dtype, generator=generator,
                         requires_grad=True)
    weight = (torch.randn(options.vocab, options.hidden, device=device, dtype=dtype, generator=generator) * 0.02
              ).requires_grad_()
    targets = torch.randint(0, options.vocab, (options.tokens,), device=device, generator=generator)
    default = chunk_tokens(options.vocab)
    rows = [("materialised logits", lambda: materialised(hidden, weight, targets), True)]
    chunks = [37, 64, default] if options.tiny else [default // 256 * 256, default, 2 * default, 4 * default]
    for chunk in chunks:
        for fused in (True, False) if device.type == "cuda" else (True,):
            label = f"chunked, {chunk} tokens{' (default)' if chunk == default else ''}" + (
                "" if device.type != "cuda" else ", fp32 sum in the GEMM" if fused else ", fp32 GEMM of fp32 copies")
            rows.append((label, lambda c=chunk: chunked_cross_entropy(hidden, weight, None, targets, c), fused))
    print(f"{device.type}, {dtype}, {options.tokens} tokens x {options.hidden} hidden -> {options.vocab} "
          f"vocabulary, forward + backward, median of {options.repeats}")
    print("| path | ms | peak above inputs (GB) | loss, gradients: largest relative difference |\n"
          "| --- | --- | --- | --- |")
    reference = results(rows[0][1], [hidden, weight])

    def row(label: str, step: Callable[[], torch.Tensor]) -> str:
        differences = [relative_difference(a, b) for a, b in zip(results(step, [hidden, weight]), reference)]
        seconds, peak = measure(step, device, options.repeats)
        hidden.grad = weight.grad = None
        return f"| {label} | {seconds * 1e3:.2f} | {peak / 2**30:.2f} | {', '.join(f'{d:.1e}' for d in differences)} |"

    for label, step, fused in rows:
        loss_module.FUSED_ACCUMULATION = fused
        print(row(label, step), flush=True)
    loss_module.FUSED_ACCUMULATION = True
    for distribution, make in FUSED_KERNELS.items() if device.type == "cuda" and options.fused_kernels else ():
        installed = installed_version(distribution)
        if installed is None:
            continue
        label = f"{distribution} {installed}"
        try:  # another version's API or a kernel that does not build: its row says so, the others stand
            loss = make()
            print(row(label, lambda: loss(hidden, weight, targets)), flush=True)
        except Exception as error:
            hidden.grad = weight.grad = None
            message = (str(error).splitlines() or [""])[0][:200]
            print(f"| {label} | failed | - | {type(error).__name__}: {message} |", flush=True)


if __name__ == "__main__":
    main()
