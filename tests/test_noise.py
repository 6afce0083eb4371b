"""NEFTune (--neftune_noise_alpha, app/model/noise.py): each example's noise scaled by its own length, none on
padding nor outside training, transformers' own hook's where a row is one unpadded example."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.neftune import neftune_post_forward_hook

from app.data.formats import Batch
from app.model.loss import LossPath, install_loss_head
from app.model.noise import EmbeddingNoise, add_embedding_noise, example_lengths


def test_each_token_is_given_the_length_of_its_own_example() -> None:
    packed = {"input_ids": torch.zeros(2, 6, dtype=torch.long),
              "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])}
    assert example_lengths(packed).tolist() == [[3, 3, 3, 2, 2, 1], [6] * 6]
    padded = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    assert example_lengths(padded).tolist() == [[2, 2, 0], [3, 3, 3]]
    assert example_lengths({"input_ids": torch.zeros(1, 4, dtype=torch.long)}).tolist() == [[4] * 4]


def noised(hook, inputs: dict[str, torch.Tensor], width: int = 4096) -> torch.Tensor:
    """The noise `hook` adds to embeddings of `inputs`' shape (zeros), in training mode."""
    embedding = torch.nn.Embedding(8, width).train()
    embedding.neftune_noise_alpha = 5.0
    zeros = torch.zeros(*inputs["input_ids"].shape, width)
    torch.manual_seed(0)
    if isinstance(hook, EmbeddingNoise):
        with hook.of(inputs):
            return hook(embedding, (), zeros)
    return hook(embedding, (), zeros)


def test_one_unpadded_example_a_row_gets_transformers_noise_and_packed_ones_their_own_scale() -> None:
    inputs = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    assert torch.allclose(noised(EmbeddingNoise(5.0), inputs), noised(neftune_post_forward_hook, inputs), atol=1e-6)
    packed = inputs | {"position_ids": torch.cat([torch.arange(4), torch.arange(12)]).repeat(2, 1)}
    largest = noised(EmbeddingNoise(5.0), packed).abs().amax(-1)  # of 4096 draws: the bound, within 0.1%
    bound = 5.0 / torch.sqrt(example_lengths(packed) * 4096.0)
    assert torch.allclose(largest, bound, rtol=1e-3), "each token's noise reaches its own example's bound"
    assert float(bound[0, 0]) == pytest.approx(float(bound[0, 4]) * 3 ** 0.5), "4 tokens against 12"
    padded = inputs | {"attention_mask": (torch.arange(16) < 10).long().repeat(2, 1)}
    noise = noised(EmbeddingNoise(5.0), padded)
    assert noise[:, 10:].eq(0).all() and noise[:, :10].ne(0).all(), "padding is left as it is"


def test_the_loss_path_noises_training_alone_and_an_unannounced_forward_is_refused() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=64))
    path = install_loss_head(model)
    path.noise = add_embedding_noise(model, 5.0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = Batch(inputs={"input_ids": ids, "labels": ids}, trained_tokens=22)
    clean = LossPath(path.head).summed_loss(model.eval(), batch)
    assert path.summed_loss(model.eval(), batch) == clean, "evaluation sees no noise"
    first, second = (path.summed_loss(model.train(), batch) for _ in range(2))
    assert first != clean and second != first, "each training forward draws its noise"
    with pytest.raises(RuntimeError, match="did not announce"):
        model.train()(input_ids=ids)
    assert add_embedding_noise(model, 0.0) is None
