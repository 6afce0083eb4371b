"""FlashAttention-2 on the CPU, for tests: transformers' own FlashAttention code path (its masks, its packed-sequence
detection, its varlen calls) with the flash-attn package's two kernels replaced by a reference written with
torch's scaled_dot_product_attention.

transformers refuses flash_attention_2 without the flash-attn package and a GPU, and the decisions that let packed
examples see each other (no mask, packing found only in one-row batches) are made in its Python code, not in the
kernel. With `flash_attention_on_cpu()`, a model built with attn_implementation="flash_attention_2" takes that
code on the CPU, and only the kernels' arithmetic is ours (the same results as the real kernels up to rounding).
On a GPU nothing stands in: the preflight's probe runs the real kernels before every run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
import torch.nn.functional as F
from transformers import modeling_flash_attention_utils, modeling_utils


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None,
               causal: bool) -> torch.Tensor:
    """One sequence, flash-attn's layout (tokens, heads, head_dim), keys with fewer heads shared as in GQA."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=softmax_scale,
                                         is_causal=causal and q.shape[0] > 1, enable_gqa=True)
    return out.transpose(0, 1)


def _no_extras(window_size: tuple[int, int], softcap: float) -> None:
    if tuple(window_size) != (-1, -1) or softcap:
        raise NotImplementedError("the CPU reference of FlashAttention has no sliding window or softcap")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False):
    """flash_attn.flash_attn_func: every row of the batch is one sequence; (batch, tokens, heads, head_dim)."""
    _no_extras(window_size, softcap)
    return torch.stack([_attention(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """flash_attn.flash_attn_varlen_func: sequences concatenated along the tokens, cut at cu_seqlens."""
    _no_extras(window_size, softcap)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return torch.cat([_attention(q[a:b], k[c:d], v[c:d], softmax_scale, causal)
                      for a, b, c, d in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:])])


def _kernels(implementation, attention_wrapper=None, allow_all_kernels=False):
    return (flash_attn_func, flash_attn_varlen_func, None, modeling_flash_attention_utils._pad_input,
            modeling_flash_attention_utils._unpad_input)


def _accept(self, attn_implementation, is_init_check=False, allow_all_kernels=False):
    return attn_implementation


@contextmanager
def flash_attention_on_cpu() -> Iterator[None]:
    """Within: models accept attn_implementation="flash_attention_2" and run it with the reference kernels."""
    modeling_flash_attention_utils._loaded_implementation = None  # load ours, not a kernel loaded before
    with mock.patch.object(modeling_flash_attention_utils, "_lazy_imports", _kernels), \
            mock.patch.object(modeling_utils.PreTrainedModel, "_check_and_adjust_attn_implementation", _accept):
        yield
    modeling_flash_attention_utils._loaded_implementation = None
