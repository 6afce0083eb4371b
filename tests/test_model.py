"""FSDP wrap-policy resolution and model construction dtypes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from app.distributed.precision import weights_dtype
from app.model.build import resolve_wrap_classes


def test_default_wrap_policy_is_the_models_decoder_layer(tiny) -> None:
    config = AutoConfig.from_pretrained(tiny.model_config)
    assert {c.__name__ for c in resolve_wrap_classes(config, None)} == {"LlamaDecoderLayer"}


def test_named_wrap_classes_resolve(tiny) -> None:
    config = AutoConfig.from_pretrained(tiny.model_config)
    names = {c.__name__ for c in resolve_wrap_classes(config, ["LlamaDecoderLayer", "LlamaMLP"])}
    assert names == {"LlamaDecoderLayer", "LlamaMLP"}


def test_unknown_wrap_class_lists_the_models_layers(tiny) -> None:
    config = AutoConfig.from_pretrained(tiny.model_config)
    with pytest.raises(ValueError, match="MistralDecoderLayer is not a module class of llama; its layer classes: "
                                         "LlamaDecoderLayer; its other classes: LlamaAttention, LlamaMLP, "):
        resolve_wrap_classes(config, ["MistralDecoderLayer"])


def test_a_model_that_names_no_layer_classes_says_which_to_give() -> None:
    """Pegasus and Marian (transformers 5.23) have no _no_split_modules: fsdp said "--auto_wrap_policy (empty) is not a
    layer class of pegasus" to a user who never gave the option."""
    from transformers import PegasusConfig

    config = PegasusConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
    with pytest.raises(ValueError) as refusal:
        resolve_wrap_classes(config, None)
    assert str(refusal.value) == ("a pegasus model names no layer classes to shard by (its _no_split_modules is "
                                  "empty); give them with --auto_wrap_policy PegasusDecoderLayer PegasusEncoderLayer")
    assert {c.__name__ for c in resolve_wrap_classes(config, ["PegasusEncoderLayer", "PegasusDecoderLayer"])} == {
        "PegasusEncoderLayer", "PegasusDecoderLayer"}


def test_choosing_one_layer_in_n_is_refused_where_transformers_would_recompute_them_all(tiny) -> None:
    """transformers' every_n_layers chooses among GradientCheckpointingLayer modules; a model whose blocks only carry
    a `gradient_checkpointing` flag (older and remote-code ones) has them all recomputed whatever it says."""
    from torch import nn
    from transformers import LlamaForCausalLM, PretrainedConfig, PreTrainedModel

    from app.model.build import enable_activation_checkpointing, recomputes_every_layer

    class Stack(nn.Module):
        gradient_checkpointing = False

    class OldStyle(PreTrainedModel):
        config_class = PretrainedConfig
        supports_gradient_checkpointing = True

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.stack = Stack()

    old_style = OldStyle(PretrainedConfig())
    enable_activation_checkpointing(old_style, 2)
    assert old_style.stack.gradient_checkpointing and recomputes_every_layer(old_style)
    llama = LlamaForCausalLM(AutoConfig.from_pretrained(tiny.model_config))
    enable_activation_checkpointing(llama, 2)
    assert not recomputes_every_layer(llama)
    assert [layer.gradient_checkpointing for layer in llama.model.layers] == [True, False]


def test_true_precisions_store_half_weights_and_mixed_keep_fp32() -> None:
    assert weights_dtype("bf16-true") == torch.bfloat16
    assert weights_dtype("bf16-mixed") == weights_dtype("32-true") == torch.float32
