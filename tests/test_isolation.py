"""Packed examples stay apart in every model, attention implementation and micro batch, or the run is refused: the
probe of the run's own class (app/model/isolation.py) and the layouts it chooses (app/data/formats.py).

The configs are tiny random ones of each architecture; FlashAttention-2 runs transformers' own code with reference
kernels on the CPU (tests/helpers/flash_attention_on_cpu.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, FalconConfig, Gemma2Config, Gemma3TextConfig, GPT2Config,
                          GptOssConfig, JambaConfig, Lfm2Config, LlamaConfig, Mamba2Config, MistralConfig, OPTConfig,
                          Phi3Config, PretrainedConfig, Qwen2Config)

from app.data.formats import arrange, block_causal
from app.model.build import materializes_like_from_config
from app.model.isolation import EXAMPLE_LENGTHS, TwinUnavailable, column_scaled_from, probe_isolation, small_twin
from tests.helpers.flash_attention_on_cpu import flash_attention_on_cpu

WIDTH = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
LLAMA_LIKE = dict(WIDTH, intermediate_size=128, num_key_value_heads=2)
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**LLAMA_LIKE),
    "qwen2": Qwen2Config(**LLAMA_LIKE),
    "mistral": MistralConfig(**LLAMA_LIKE),
    "phi3": Phi3Config(**LLAMA_LIKE, pad_token_id=0),
    "gpt2": GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4),
    "falcon": FalconConfig(**WIDTH),
    "opt": OPTConfig(**WIDTH, ffn_dim=128, word_embed_proj_dim=64),
    "falcon-alibi": FalconConfig(**WIDTH, alibi=True),
    "lfm2": Lfm2Config(**LLAMA_LIKE, layer_types=["conv", "full_attention"]),
}
EXPECTED = {  # (sdpa, eager)
    "llama": ("position_ids", "position_ids"), "qwen2": ("position_ids", "position_ids"),
    "mistral": ("position_ids", "position_ids"), "phi3": ("position_ids", "position_ids"),
    "gpt2": ("position_ids", "position_ids"),
    "falcon": ("boolean_mask", "additive_mask"), "opt": ("boolean_mask", "additive_mask"),
    "falcon-alibi": (None, None), "lfm2": (None, None),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_probe_finds_the_layout_that_keeps_packed_examples_apart(name: str) -> None:
    """Models whose masks read position restarts take the rows as prepared; Falcon and OPT, whose masks ignore them,
    need a block-diagonal mask (booleans for SDPA, added to the scores for eager); Falcon with ALiBi takes no mask
    of ours and is refused, and so is LFM2, whose convolutions read the previous example's last tokens whatever the
    mask (a leak of 6e-4 in the random twin, taken for isolation under a tolerance of 1e-3)."""
    for attention, expected in zip(("sdpa", "eager"), EXPECTED[name]):
        found = probe_isolation(CONFIGS[name], attention)
        assert found.layout == expected, (attention, found)
        leaks_as_prepared = expected != "position_ids"
        assert (found.leak > 1e-4) == leaks_as_prepared, (attention, found)


@pytest.mark.parametrize("name", ["llama", "qwen2", "opt"])
def test_flash_attention_2_with_several_rows_leaks_as_prepared_and_one_row_keeps_examples_apart(name: str) -> None:
    """transformers gives FlashAttention-2 no mask and looks for packed examples only in a batch of one row: with
    two rows each example sees the ones before it. Flattened into one row, every example is alone again."""
    with flash_attention_on_cpu():
        found = probe_isolation(CONFIGS[name], "flash_attention_2")
    assert found.layout == "one_row" and found.leak > 0.1, found


def test_a_leak_outside_attention_is_refused_also_when_attention_is_probed_in_half_precision(monkeypatch) -> None:
    """On a GPU FlashAttention is probed in bf16, whose tolerance (5e-2) is far above LFM2's convolution leak (6e-4):
    LFM2 was taken as isolated in one row. Here the GPU's half-precision probe on the CPU (the flash-attn kernels
    replaced by SDPA)."""
    from app.model import isolation

    def half_for_flash(attention: str) -> tuple[torch.device, torch.dtype]:
        return torch.device("cpu"), torch.bfloat16 if "flash" in attention else torch.float32

    monkeypatch.setattr(isolation, "probe_device", half_for_flash)
    with flash_attention_on_cpu():
        lfm2, llama = (probe_isolation(CONFIGS[name], "flash_attention_2") for name in ("lfm2", "llama"))
    assert lfm2.layout is None and 1e-4 < lfm2.leak < 1e-2, lfm2
    assert llama.layout == "one_row", "a leak of attention alone stays the half-precision probe's to judge"
    gpt_oss, _, _ = WINDOWED["gpt_oss"]  # no SDPA; under eager its window is lost to the masks: attention's leak
    assert isolation.leak_outside_attention(gpt_oss, torch.bfloat16, False) is None


def test_llama4s_column_scaled_layers_refuse_packed_rows_that_reach_floor_scale_and_samples_go_one_at_a_time() -> None:
    """Llama-4's layers without RoPE scale their queries by the column a token sits in, counted by transformers from
    the cache, not by position_ids: an example packed at column 8,191 or later trains at another scale than alone
    (a twin whose floor_scale the probe's rows reach leaks 0.2%), which the probe's short rows cannot see at 8,192."""
    from types import SimpleNamespace

    from transformers import Llama4TextConfig

    from app.data.formats import DataFormat
    from app.training.preflight.model import check_packed_isolation, samples_pad_apart

    def llama4(**overrides) -> PretrainedConfig:
        return Llama4TextConfig(**{"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "head_dim": 16,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                   "intermediate_size_mlp": 128, "num_local_experts": 2, "num_experts_per_tok": 1,
                                   "no_rope_layers": [1, 0]} | overrides)

    assert probe_isolation(llama4(), "sdpa").layout == "position_ids", "blind at 8,192"
    assert probe_isolation(llama4(floor_scale=4), "sdpa").layout is None, "the leak, where the probe reaches it"
    assert column_scaled_from(llama4()) == 8192 and column_scaled_from(llama4(no_rope_layers=[1, 1])) is None
    assert column_scaled_from(CONFIGS["llama"]) is None
    from transformers import Llama4Config

    assert column_scaled_from(Llama4Config(text_config=llama4().to_dict())) == 8192, "as the Hub's Llama-4 loads"
    cfg = SimpleNamespace(train_data_dir="data", attn_implementation="sdpa", trust_remote_code=False, eval_samples=4,
                          estimate_memory=False)
    for block, refused in ((8191, False), (8192, True)):
        problems: list[str] = []
        data = SimpleNamespace(format=DataFormat("supervised_packed", 0), block_size=block)
        check_packed_isolation(cfg, llama4(), data, problems)
        assert bool(problems) == refused and all("--block_size 8191 or less" in p for p in problems), problems
    assert not samples_pad_apart(cfg, llama4()) and samples_pad_apart(cfg, CONFIGS["llama"])


def test_block_causal_mask_lets_a_token_see_only_its_own_examples_earlier_tokens() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]])
    mask = block_causal(positions)
    example = (positions == 0).cumsum(-1)
    for row in range(2):
        for i in range(6):
            for j in range(6):
                assert mask[row, 0, i, j] == (j <= i and example[row, i] == example[row, j])
    inputs = {"input_ids": torch.arange(12).reshape(2, 6), "labels": torch.arange(12).reshape(2, 6),
              "position_ids": positions}
    assert {k: v.tolist() for k, v in arrange("one_row", inputs).items()} == {
        k: [v.flatten().tolist()] for k, v in inputs.items()}
    additive = arrange("additive_mask", inputs)["attention_mask"]
    assert additive.dtype == torch.float32 and ((additive == 0) == mask).all()


def test_the_probes_twin_keeps_the_class_and_the_attention_grouping_at_a_fraction_of_the_size() -> None:
    """Llama-3-8B's shape: 32 layers of 32 heads in 8 groups, 128K vocabulary -> 2 layers of 4 heads in 1 group of
    the same width, 512 tokens; the probe runs in well under a second."""
    llama3 = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, bos_token_id=128000, eos_token_id=128001)
    twin = small_twin(llama3)
    assert (twin.num_hidden_layers, twin.num_attention_heads, twin.num_key_value_heads, twin.hidden_size,
            twin.intermediate_size, twin.vocab_size) == (2, 4, 1, 512, 1024, 512)
    assert twin.bos_token_id is None and llama3.num_hidden_layers == 32, "the run's own config is untouched"
    falcon7b = FalconConfig(vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                            multi_query=True)
    assert probe_isolation(falcon7b, "sdpa").layout == "boolean_mask"


def test_a_hybrid_models_twin_keeps_every_layer_kind_and_a_state_space_models_is_refused() -> None:
    """Jamba, Mamba-2 and Bamba compute their layer kinds in properties without a setter: the twin's assignment raised
    AttributeError, which ended every run of such a model built from a config (packed or not) after its preflight.
    Built at full width instead, Mamba-2's twin (no attention heads to narrow) ran the machine out of memory."""
    jamba = JambaConfig()  # attention every 8th layer from the 4th: the twin needs 5 layers to hold one
    twin = small_twin(jamba)
    assert (twin.num_hidden_layers, set(twin.layer_types), jamba.num_hidden_layers) == (5, set(jamba.layer_types), 32)
    with pytest.raises(TwinUnavailable, match="a mamba2 config has no attention heads to narrow it by"):
        small_twin(Mamba2Config())
    tiny_jamba = JambaConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_experts=2, attn_layer_period=2,
                             attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4,
                             mamba_dt_rank=8, use_mamba_kernels=False)
    built_like_from_config = materializes_like_from_config(tiny_jamba, trust_remote_code=False, pretrained=False)
    assert built_like_from_config, "the meta route (False also when the twin could not be made) builds Jamba exactly"


WINDOWED: dict[str, tuple[PretrainedConfig, str, object]] = {  # config, attention, layout expected
    "gpt_oss": (GptOssConfig(**LLAMA_LIKE, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                             layer_types=["sliding_attention", "full_attention"]), "eager", None),
    "mistral": (MistralConfig(**LLAMA_LIKE, sliding_window=128), "sdpa", "position_ids"),
    "gemma2": (Gemma2Config(**LLAMA_LIKE, head_dim=16, sliding_window=128), "eager", "position_ids"),
    "gemma3": (Gemma3TextConfig(**LLAMA_LIKE, head_dim=16, sliding_window=128,
                                layer_types=["sliding_attention", "full_attention"]), "sdpa", "position_ids"),
}


@pytest.mark.parametrize("name", WINDOWED)
def test_a_layout_that_drops_the_sliding_window_is_never_chosen(name: str) -> None:
    """A block-diagonal 4D mask replaces the model's own masks in every layer, sliding-window layers included: it
    keeps examples apart only while they are shorter than the window (GPT-OSS: 128 tokens, far shorter than a block).
    The twin's window is shorter than the probe's examples, so GPT-OSS with eager attention (whose masks read no
    position restarts) is refused instead of trained with full attention where it slides; models whose masks apply
    the window and the restarts together keep the rows as prepared."""
    config, attention, expected = WINDOWED[name]
    assert probe_isolation(config, attention).layout == expected
    assert small_twin(config).sliding_window < max(map(max, EXAMPLE_LENGTHS)) and config.sliding_window == 128
    if expected is None:  # what the probe chose before: the mask, which loses the window past it
        model = AutoModelForCausalLM.from_config(small_twin(config), attn_implementation=attention).eval()
        lengths = (7, 10, 5, 12)
        examples = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
        inputs = {"input_ids": torch.stack([torch.cat(examples[:2]), torch.cat(examples[2:])]),
                  "position_ids": torch.stack([torch.cat([torch.arange(n) for n in lengths[:2]]),
                                               torch.cat([torch.arange(n) for n in lengths[2:]])])}
        with torch.no_grad():
            packed = model(**arrange("additive_mask", inputs)).logits.reshape(-1, 300).split(lengths)
            alone = [model(input_ids=ids[None]).logits[0] for ids in examples]
        assert not all(torch.allclose(p, a, atol=1e-4) for p, a in zip(packed, alone))
