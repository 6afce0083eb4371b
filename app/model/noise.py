"""NEFTune (--neftune_noise_alpha; Jain et al. 2023, https://arxiv.org/abs/2310.05914): while training, uniform
noise in [-1, 1] scaled by alpha / sqrt(L x d) is added to the input embeddings, L the length of the example a token
belongs to and d the embedding width; evaluation, generation and the spike guard's scoring see the embeddings as
they are.

Written here rather than taken from `transformers.integrations.neftune`: that hook scales by the length of the
whole row, so the examples packed into one row all get the noise of a sequence as long as the row (a 40-token
answer packed into 2,048 tokens, 7x too little), and it noises padding. The paper's code scales each example by
its own length and leaves padding alone; so does this, from the micro-batch's `position_ids` (packed examples each
count from 0) or `attention_mask` (padded ones). On one unpadded example per row the two agree."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from torch.nn import Module

from app.data.formats import per_example_counts


def example_lengths(inputs: dict[str, Tensor]) -> Tensor:
    """For each token of a micro-batch (rows x tokens), the length of the example it belongs to, and 0 for padding:
    packed examples are the runs of `position_ids` from 0 (the padding that ends a packed row is a run of its own,
    which attends to nothing else), padded ones their `attention_mask`, otherwise the whole row."""
    input_ids = inputs["input_ids"]
    if inputs.get("position_ids") is not None:
        return per_example_counts(inputs["position_ids"], torch.ones_like(input_ids, dtype=torch.long))
    if inputs.get("attention_mask") is not None:
        mask = inputs["attention_mask"]
        return mask.sum(-1, keepdim=True) * mask
    return torch.full_like(input_ids, input_ids.shape[1])


class EmbeddingNoise:
    """The forward hook of the model's input embeddings; `of(inputs)` gives it the lengths of the micro-batch the
    model is about to embed."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.lengths: Optional[Tensor] = None

    @contextmanager
    def of(self, inputs: dict[str, Tensor]) -> Iterator[None]:
        self.lengths = example_lengths(inputs)
        try:
            yield
        finally:
            self.lengths = None

    def __call__(self, module: Module, args: Any, output: Tensor) -> Tensor:
        if not module.training:  # evaluation, generation, the spike guard's scores
            return output
        if self.lengths is None or self.lengths.shape != output.shape[:2]:
            raise RuntimeError("NEFTune's noise: the embeddings of a micro-batch the loss path did not announce "
                               f"({tuple(output.shape[:2])} tokens); training asks through LossPath.summed_loss")
        lengths = self.lengths.to(device=output.device, dtype=torch.float32)
        scale = torch.where(lengths > 0, self.alpha / torch.sqrt(lengths.clamp(min=1) * output.shape[-1]), 0.0)
        noise = torch.empty_like(output, dtype=torch.float32).uniform_(-1, 1) * scale[..., None]
        return output + noise.to(output.dtype)


def add_embedding_noise(model: Module, alpha: float) -> Optional[EmbeddingNoise]:
    """Hook NEFTune's noise onto `model`'s input embeddings (before any wrapping: FSDP and torch.compile keep a
    submodule's hooks); None when `alpha` is 0."""
    if not alpha:
        return None
    noise = EmbeddingNoise(alpha)
    model.get_input_embeddings().register_forward_hook(noise)
    return noise
