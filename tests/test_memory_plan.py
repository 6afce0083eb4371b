"""The memory planner: its arithmetic, its command line, and its figures against the tensors a real run holds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from transformers import (AutoConfig, BartConfig, FalconConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MixtralConfig,
                          OPTConfig, Phi3Config, T5Config)

from app.distributed.strategy import DDP_OPTIONS
from app.exit_codes import EXIT_BAD_INPUT
from app.metrics.activations import _Tally, kept_for_backward
from app.metrics import memory_plan
from app.metrics.memory_plan import (RUNTIME_BYTES, ModelShape, Setup, chunked_loss_bytes, estimate_memory,
                                     fit_advice, kept_by_body, largest_micro_batch, memory_report)
from app.metrics.observe import GB
from app.model.build import meta_model, model_class, resolve_wrap_classes
from app.training.run import run
from arguments import parse_config, read_config
from tests.conftest import ROOT, run_entry, run_train, train_args

LLAMA_3_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
EIGHT_GPUS = Setup(strategy="fsdp", sharding_strategy="FULL_SHARD", precision="bf16-mixed", world_size=8,
                   devices_per_node=8, micro_batch_size=1, block_size=8192, gradient_checkpointing=True,
                   cpu_offload=False)


@pytest.fixture(scope="module")
def llama_3_8b() -> ModelShape:
    return ModelShape.of(LLAMA_3_8B, resolve_wrap_classes(LLAMA_3_8B, None))


def test_llama_3_8b_shape_is_read_from_the_config(llama_3_8b) -> None:
    assert llama_3_8b.parameters == 8_030_261_248
    assert llama_3_8b.root_parameters == 2 * 128256 * 4096 + 4096, "embeddings, head and final norm"
    assert llama_3_8b.layer_parameters * 32 + llama_3_8b.root_parameters == llama_3_8b.parameters
    assert llama_3_8b.largest_unit == 128256 * 4096 + 4096, "the head with the final norm"


def test_model_state_is_divided_by_the_ranks_that_shard_it(llama_3_8b) -> None:
    full = estimate_memory(llama_3_8b, EIGHT_GPUS)
    assert full.parameters == pytest.approx(8_030_261_248 * 4 / 8), "bf16-mixed keeps fp32 master weights"
    assert full.optimizer == 2 * full.gradients == 2 * full.parameters
    replicated = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, sharding_strategy="NO_SHARD"))
    assert replicated.parameters == 8 * full.parameters and replicated.optimizer == 8 * full.optimizer
    hybrid = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, sharding_strategy="HYBRID_SHARD", world_size=16))
    assert hybrid.parameters == full.parameters, "HYBRID_SHARD shards within a node of 8, whatever the node count"
    bf16 = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, precision="bf16-true"))
    assert bf16.parameters + bf16.gradients + bf16.optimizer == pytest.approx(
        (full.parameters + full.gradients + full.optimizer) / 2)
    offloaded = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, cpu_offload=True))
    assert offloaded.parameters == offloaded.gradients == offloaded.optimizer == 0


def test_large_input_embeddings_are_not_held_gathered_with_the_root(llama_3_8b) -> None:
    """Llama-3-8B's input embeddings (2.4 layers) are a unit of their own under fsdp and fsdp2, resharded after
    forward."""
    assert llama_3_8b.input_embedding_unit == 128256 * 4096
    fsdp = estimate_memory(llama_3_8b, EIGHT_GPUS)
    fsdp2 = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, strategy="fsdp2"))
    layers = 2 * llama_3_8b.layer_parameters
    reduced = (128256 * 4096 + 4096) * 4
    assert fsdp.working == fsdp2.working == (128256 * 4096 + 4096 + layers) * 2 + reduced + RUNTIME_BYTES, \
        "bf16: head, norm, 2 layers; the largest unit's gradient in fp32 to reduce it"
    assert estimate_memory(llama_3_8b, replace(EIGHT_GPUS, reduce_dtype=torch.bfloat16)).working == fsdp.working - reduced
    kept = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, strategy="fsdp2", sharding_strategy="SHARD_GRAD_OP"))
    assert kept.working == estimate_memory(llama_3_8b, replace(EIGHT_GPUS, sharding_strategy="SHARD_GRAD_OP")).working
    mistral = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=32768)
    assert ModelShape.of(mistral, resolve_wrap_classes(mistral, None)).input_embedding_unit == 0, "0.6 of a layer"


def test_ddp_gradients_are_its_buckets_so_it_plans_what_one_device_plans(llama_3_8b) -> None:
    """DDP's gradients are views of its communication buckets (gradient_as_bucket_view): the plan counted the buckets
    as a second copy, 15% above the measured peak of an 85.6M-parameter model (2.19 GB planned, 1.90 GB measured,
    one device 1.89 GB); earlier it counted that copy for one device too."""
    one = replace(EIGHT_GPUS, world_size=1, devices_per_node=1)
    ddp = estimate_memory(llama_3_8b, replace(one, strategy="ddp"))
    single = estimate_memory(llama_3_8b, replace(one, strategy="single_device"))
    assert ddp == single and ddp.gradients == llama_3_8b.parameters * 4, "bf16-mixed: fp32 gradients"
    assert DDP_OPTIONS["gradient_as_bucket_view"], "without it, DDP's buckets are a second copy of the gradients"


def test_the_chunked_loss_holds_one_chunk_of_logits_instead_of_all(llama_3_8b) -> None:
    """At 8K tokens Llama-3's logits are 2 + 4 + 4 + 4 bytes x 128,256 per token (14.7 GB); chunked, the hidden
    states' gradient and the larger of forward's buffers (one chunk of 1,046 tokens in fp32 and bf16, the head's
    fp32 gradient) and backward's (the head's fp32 gradient and its bf16 copy): backward's, on CPU too. Cut
    Cross-Entropy's kernel holds the head's gradient in bf16 (measured on an H200)."""
    full = estimate_memory(llama_3_8b, EIGHT_GPUS)
    chunked = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, chunked_loss=True))
    assert full.activations - chunked.activations == 8192 * (128256 * 14 - 4096 * 2)
    assert chunked.working - full.working == 128256 * 4096 * (4 + 2) > 1046 * 128256 * 6 + 128256 * 4096 * 4
    on_cpu = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, chunked_loss=True, gpu=False))
    assert on_cpu.working - chunked.working == 0
    fused = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, chunked_loss=True, loss_kernel="cut_cross_entropy"))
    assert fused.working - full.working == 128256 * 4096 * 2  # Cut Cross-Entropy: the head's bf16 gradient
    assert full.total - chunked.total > 9.5 * GB


def test_activation_checkpointing_and_batch_size_scale_the_activations(llama_3_8b) -> None:
    checkpointed = estimate_memory(llama_3_8b, EIGHT_GPUS)
    stored = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, gradient_checkpointing=False))
    assert stored.activations > 3 * checkpointed.activations
    doubled = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, micro_batch_size=2))
    assert doubled.activations == pytest.approx(2 * checkpointed.activations)


def test_the_report_advises_only_what_is_not_on_and_says_what_offloading_holds_in_host_ram(llama_3_8b) -> None:
    """"no micro batch fits" advised --gradient_checkpointing true to a run that had it on, and --cpu_offload's plan
    showed its device's model state as 0 without the node's memory it moves to (128 GB for 8B on 8 GPUs)."""
    cfg = read_config(["--model_config", "unused", "--train_data_dir", "unused"])
    report, fits = memory_report(cfg, llama_3_8b, EIGHT_GPUS, device=(20 * GB, "test"))
    assert not fits and report.splitlines()[-1] == ("  no micro batch fits: shard more (more devices), "
                                                    "--precision bf16-true or --cpu_offload true")
    assert fit_advice(replace(EIGHT_GPUS, strategy="ddp", gradient_checkpointing=False)) == (
        "shard more (--strategy fsdp, more devices), --gradient_checkpointing true, --precision bf16-true or "
        "--cpu_offload true")
    on_cpu = replace(EIGHT_GPUS, sharding_strategy="NO_SHARD", precision="bf16-true", gpu=False)
    assert fit_advice(on_cpu) == "shard more (--sharding_strategy FULL_SHARD, more nodes)", \
        "the processes of a node share its memory: more of them, or offloading to it, frees nothing"
    offloaded, _ = memory_report(cfg, llama_3_8b, replace(EIGHT_GPUS, cpu_offload=True), device=(80 * GB, "test"))
    assert "  host RAM for the offloaded state: 119.66 GB per node (8 devices' parameters, gradients and " \
           "optimizer state)" in offloaded.splitlines()


def test_activation_checkpointing_frees_activations_under_ddp_and_on_one_device_too() -> None:
    """DDP and one device have no FSDP units, and the plan was given no layers: every activation counted outside
    them, and --gradient_checkpointing true freed none (planned 1.66 GB against 1.09 measured under DDP)."""
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                         vocab_size=2000)
    shape = ModelShape.of(config, set())  # what the preflight resolves for --strategy ddp and single_device
    for strategy in ("ddp", "single_device"):
        setup = replace(EIGHT_GPUS, strategy=strategy, world_size=2, devices_per_node=2, micro_batch_size=16,
                        block_size=128, precision="32-true", gpu=False)
        checkpointed = estimate_memory(shape, setup)
        stored = estimate_memory(shape, replace(setup, gradient_checkpointing=False))
        assert stored.activations > 2 * checkpointed.activations, strategy


def test_recomputing_one_layer_in_two_keeps_what_the_plan_counts_for_it() -> None:
    """--gradient_checkpointing_every 2: a recomputed layer keeps its inputs alone, the others all they computed.
    FSDP1's checkpoint wrapper (EveryNthLayer) and transformers' own keep the same, and the gradients are those of a
    run without checkpointing."""
    from lightning_fabric.strategies.fsdp import _activation_checkpointing_kwargs, _setup_activation_checkpointing
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from app.distributed.strategy import EveryNthLayer
    from app.metrics.activations import KeptForBackward
    from app.model.build import enable_activation_checkpointing

    kept = KeptForBackward(layers=(10, 20, 30, 40), layer_inputs=(1, 1, 1, 1), outside=5)
    assert [kept.peak(every) for every in (0, 1, 2, 3)] == [100 + 5 + 40, 3 + 40 + 5 + 40, 22 + 40 + 5 + 40,
                                                           51 + 40 + 5 + 40], "at the last layer's backward"
    assert KeptForBackward(layers=(40, 10), layer_inputs=(1, 1), outside=5).peak(2) == 40 + 5 + 40, (
        "the recomputed first layer's activations are the most, once the second's are freed")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         vocab_size=256)
    input_ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def saved_and_gradients(checkpointing) -> tuple[int, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).train()
        checkpointing(model)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().nbytes()) or t,
                                                      lambda t: t):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return sum(saved), [parameter.grad for parameter in model.parameters()]

    def wrapped(every: int):
        policy = EveryNthLayer({LlamaDecoderLayer}, every)
        return lambda model: _setup_activation_checkpointing(model, _activation_checkpointing_kwargs(None, policy))

    none, gradients = saved_and_gradients(lambda model: None)
    every_layer, _ = saved_and_gradients(lambda model: enable_activation_checkpointing(model, 1))
    every_second, second_gradients = saved_and_gradients(lambda model: enable_activation_checkpointing(model, 2))
    assert saved_and_gradients(wrapped(2))[0] == every_second and saved_and_gradients(wrapped(1))[0] == every_layer
    assert every_second == pytest.approx((none + every_layer) / 2, rel=0.02), (none, every_second, every_layer)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(gradients, second_gradients))


def test_frozen_parameters_take_no_optimizer_state_and_fsdp1_units_keep_their_gradient_whole() -> None:
    """--freeze: the plan counted every parameter's gradient and moments (a job freezing most of a model was told
    it did not fit). FSDP1 keeps a unit's flat gradient whole while any parameter of the unit trains."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         vocab_size=1000, tie_word_embeddings=False)
    wrap = resolve_wrap_classes(config, None)
    full, layers_frozen, embeddings_frozen = (ModelShape.of(config, wrap, freeze=freeze)
                                              for freeze in (None, [r"model\.layers\."], ["embed_tokens"]))
    setup = replace(EIGHT_GPUS, strategy="fsdp2", precision="32-true")
    assert layers_frozen.trained_parameters == full.parameters - 4 * full.layer_parameters
    assert estimate_memory(layers_frozen, setup).optimizer == pytest.approx(
        estimate_memory(full, setup).optimizer * layers_frozen.trained_parameters / full.parameters)
    fsdp1 = replace(setup, strategy="fsdp")
    assert estimate_memory(embeddings_frozen, fsdp1).gradients == estimate_memory(full, fsdp1).gradients, (
        "the embedding shares FSDP1's root unit with the head, which trains")
    assert estimate_memory(embeddings_frozen, setup).gradients < estimate_memory(full, setup).gradients


def test_llama_3_8b_on_eight_80gb_gpus_fits_as_users_run_it(llama_3_8b) -> None:
    """FULL_SHARD, bf16-mixed, 8k tokens with activation checkpointing on 8 x 80 GB: what torchtitan and peers run."""
    estimate = estimate_memory(llama_3_8b, EIGHT_GPUS)
    assert 20 * GB < estimate.total < 60 * GB
    largest = largest_micro_batch(estimate, 80 * GB)
    assert largest >= 1
    assert estimate_memory(llama_3_8b, replace(EIGHT_GPUS, micro_batch_size=largest)).total <= 0.9 * 80 * GB
    assert estimate_memory(llama_3_8b, replace(EIGHT_GPUS, micro_batch_size=largest + 1)).total > 0.9 * 80 * GB
    one_gpu = estimate_memory(llama_3_8b, replace(EIGHT_GPUS, world_size=1, devices_per_node=1))
    assert largest_micro_batch(one_gpu, 80 * GB) == 0, "8B with AdamW in fp32 needs 128 GB of model state alone"


T5 = T5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_decoder_layers=3, num_heads=4)
BART = BartConfig(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=192,
                  decoder_ffn_dim=192, encoder_attention_heads=4, decoder_attention_heads=4)
GPT2 = GPT2Config(vocab_size=1000, n_embd=64, n_layer=3, n_head=4)
TINY_LLAMA = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
PHI3 = Phi3Config(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, eos_token_id=2, bos_token_id=1)
NEOX = GPTNeoXConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4)
FALCON = FalconConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("config, layers", [(T5, 5), (BART, 4), (GPT2, 3)], ids=["t5", "bart", "gpt2"])
def test_every_architecture_the_project_trains_is_planned(config, layers) -> None:
    """T5, BART and GPT-2 name their sizes otherwise than Llama (`d_ff`, `encoder_ffn_dim`, `n_inner` = None): the
    planner crashed on them with AttributeError; an encoder-decoder's decoder runs at the target length."""
    shape = ModelShape.of(config, resolve_wrap_classes(config, None))
    assert len(shape.kept_for_backward(128, 16, torch.float32, "sdpa", gpu=True).layers) == layers
    assert shape.layer_parameters * layers + shape.root_parameters >= shape.parameters
    report, fits = memory_report(read_config(["--model_config", "unused", "--train_data_dir", "unused"]), shape,
                                 replace(EIGHT_GPUS, block_size=128), device=(80 * GB, "test"))
    assert fits and "largest micro batch that fits" in report
    assert ("note: a T5 run on an H200 peaked at 1.30x" in report) == config.is_encoder_decoder  # a GPU plan
    if config.is_encoder_decoder:
        short_targets = estimate_memory(shape, replace(EIGHT_GPUS, block_size=128, target_block_size=16))
        assert short_targets.activations < estimate_memory(shape, replace(EIGHT_GPUS, block_size=128)).activations
        loss = replace(EIGHT_GPUS, block_size=128, micro_batch_size=1, chunked_loss=True)  # over the targets only
        assert chunked_loss_bytes(shape, replace(loss, target_block_size=16)) < chunked_loss_bytes(shape, loss)


@pytest.mark.parametrize("config, dtype, attention, tokens, target_tokens, autocast", [
    (TINY_LLAMA, torch.float32, "sdpa", 48, 0, None), (TINY_LLAMA, torch.bfloat16, "sdpa", 48, 0, None),
    (TINY_LLAMA, torch.float32, "eager", 48, 0, None), (GPT2, torch.float32, "sdpa", 48, 0, None),
    (T5, torch.float32, "sdpa", 48, 16, None), (BART, torch.float32, "sdpa", 48, 16, None),
    (TINY_LLAMA, torch.float32, "sdpa", 48, 0, torch.bfloat16), (GPT2, torch.float32, "sdpa", 48, 0, torch.bfloat16),
    (T5, torch.float32, "sdpa", 48, 16, torch.bfloat16), (BART, torch.float32, "sdpa", 48, 16, torch.bfloat16),
    (PHI3, torch.float32, "sdpa", 48, 0, None), (NEOX, torch.float32, "sdpa", 48, 0, None),
    (FALCON, torch.float32, "sdpa", 48, 0, None)],
    ids=["llama", "llama-bf16", "llama-eager", "gpt2", "t5", "bart", "llama-autocast", "gpt2-autocast", "t5-autocast",
         "bart-autocast", "phi3", "gpt-neox", "falcon"])
def test_what_backward_keeps_is_measured_on_the_meta_device_as_a_real_forward_keeps_it(
        config, dtype, attention, tokens, target_tokens, autocast) -> None:
    """The planner's activations come from a forward of the weightless model, with a stand-in for the fused
    attention kernel: byte for byte what a real forward on CPU keeps, layer by layer (its flash kernel where there is
    no dropout, the math path for GPT-2's and T5's attention dropout, T5's learned position bias and Falcon's one key
    head for four queries). Its output is laid out as the kernel lays it out: Phi-3's and GPT-NeoX's output projection
    then keeps a copy of it (their partial rotary embedding concatenates the query heads before tokens), Llama's a
    view. Under autocast
    (DDP and one device under bf16-mixed) the weightless forward runs on fake CPU tensors through torch's autocast:
    fp32 weights cast to bf16, GPT-2's LayerNorm and T5's norms in fp32, the attention's inputs cast for SDPA."""
    wrap_classes = resolve_wrap_classes(config, None)
    planned = kept_for_backward(meta_model(config), wrap_classes, tokens, target_tokens, dtype, attention, gpu=False,
                                autocast=autocast)
    torch.manual_seed(0)
    real = kept_for_backward(model_class(config).from_config(config), wrap_classes, tokens, target_tokens, dtype,
                             attention, gpu=False, autocast=autocast)
    assert planned == real
    assert len(planned.layers) == len(planned.layer_inputs) > 0 and min(planned.layers) > 0
    if autocast:  # what autocast changes is measured, not the plain forward's figure, and its weight copies apart
        plain = kept_for_backward(meta_model(config), wrap_classes, tokens, target_tokens, dtype, attention, gpu=False)
        assert planned.layers != plain.layers
        assert planned.weight_copies > 0


def test_the_autocast_setting_follows_what_lightnings_precision_plugins_do() -> None:
    """FSDP1's plugin autocasts on CUDA only (`torch.autocast("cuda")`, off on a CPU), DDP's and one device's on
    either device, FSDP2's MixedPrecisionPolicy never; *-true never."""
    def autocast(strategy: str, precision: str, accelerator: str) -> bool:
        cfg = read_config(["--model_config", "unused", "--train_data_dir", "unused", "--strategy", strategy,
                           "--precision", precision])
        cfg.accelerator = accelerator  # resolve_accelerator reads it; no GPU is needed to plan for one
        return memory_plan.setup_of(cfg, 1, 128, 1, chunked_loss=False).autocast

    assert autocast("fsdp", "bf16-mixed", "gpu") and not autocast("fsdp", "bf16-mixed", "cpu")
    assert autocast("ddp", "bf16-mixed", "cpu") and autocast("single_device", "16-mixed", "gpu")
    assert not autocast("fsdp2", "bf16-mixed", "gpu") and not autocast("fsdp", "bf16-true", "gpu")


def test_the_plan_docs_training_md_shows_is_the_one_its_command_prints(tmp_path) -> None:
    """The example of docs/training.md, run as written on Llama-3-8B's config.json: it prints every line shown (its
    working memory had drifted by 0.23 GB from what the planner printed)."""
    example = re.search(r"```\n\$ python (train\.py .*?)\n(memory per device.*?)```",
                        (ROOT / "docs" / "training.md").read_text(), re.S)
    LLAMA_3_8B.save_pretrained(tmp_path / "llama-3-8b")
    command = example.group(1).replace("\\\n", " ").replace("llama-3-8b/", str(tmp_path / "llama-3-8b"))
    printed = run_entry(command.split()).stdout
    assert [line for line in example.group(2).splitlines() if line not in printed] == []
    assert printed.startswith("memory per device"), "a plan logs nothing: no line about W&B before it"


def test_a_gpu_plan_from_a_torch_without_cuda_says_what_it_leaves_out() -> None:
    """`--accelerator gpu` plans a GPU run from a machine without one; a torch built without CUDA cannot run CUDA's
    autocast on fake tensors, and the plan says so (a torch built with CUDA measures it, with or without a GPU)."""
    shape = ModelShape.of(GPT2, resolve_wrap_classes(GPT2, None))
    setup = replace(EIGHT_GPUS, block_size=128, gpu=True, autocast=True)
    report, _ = memory_report(read_config(["--model_config", "unused", "--train_data_dir", "unused"]), shape, setup,
                              device=(80 * GB, "test"))
    assert ("as this torch is built without CUDA" in report) == (not torch.backends.cuda.is_built())


def test_autocasts_copies_of_weights_count_once_also_through_a_transposed_weight() -> None:
    """Falcon multiplies by `weight.T`, whose autocast copy is a cast of a view: still a weight's copy, counted once
    (weight_copies) and not with every sequence; the layers keep less under bf16 autocast than in fp32."""
    config = FalconConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    wrap_classes = resolve_wrap_classes(config, None)
    plain = kept_for_backward(meta_model(config), wrap_classes, 48, 0, torch.float32, "sdpa", gpu=False)
    autocast = kept_for_backward(meta_model(config), wrap_classes, 48, 0, torch.float32, "sdpa", gpu=False,
                                 autocast=torch.bfloat16)
    matrices = sum(parameter.numel() for layer in meta_model(config).modules() if type(layer) in wrap_classes
                   for parameter in layer.parameters() if parameter.ndim == 2)
    assert autocast.weight_copies >= 2 * matrices  # every layer's matrices, in bf16
    assert sum(autocast.layers) < sum(plain.layers)


@pytest.mark.parametrize("precision, strategy", [("16-mixed", "ddp"), ("32-true", "fsdp"), ("bf16-mixed", "fsdp2"),
                                                 ("bf16-mixed", "ddp")])
def test_a_mixture_of_experts_is_planned_in_every_precision(precision, strategy) -> None:
    """torch's shape-only grouped_mm (Mixtral's experts) takes bfloat16 alone: the body is measured in bfloat16 and
    scaled to the compute dtype's size, where fp16, fp32 or fp32 weights under autocast made the plan fail."""
    config = MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    shape = ModelShape.of(config, resolve_wrap_classes(config, None))
    setup = replace(EIGHT_GPUS, strategy=strategy, precision=precision, block_size=64, gpu=False,
                    autocast="mixed" in precision and strategy == "ddp")
    bf16 = shape.kept_for_backward(64, 64, torch.bfloat16, "sdpa", gpu=False)
    assert kept_by_body(shape, setup).layers == tuple(b * (2 if precision == "32-true" else 1) for b in bf16.layers)


def test_layer_drop_never_takes_a_layer_out_of_the_count() -> None:
    """OPT and BART draw `torch.rand([])` per layer to skip it with probability `layerdrop`: the planner counts every
    layer, the same figure at every measurement."""
    config = OPTConfig(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, ffn_dim=128,
                       word_embed_proj_dim=64, layerdrop=0.5)
    wrap_classes = resolve_wrap_classes(config, None)
    counts = {kept_for_backward(meta_model(config), wrap_classes, 32, 0, torch.float32, "sdpa", gpu=False).layers
              for _ in range(4)}
    assert len(counts) == 1 and min(next(iter(counts))) > 0


def test_a_freed_input_or_kept_tensor_whose_storage_address_comes_back_still_counts_each_time() -> None:
    """The tally knows a storage by its address. A layer's input that nothing keeps is freed when the layer returns,
    and the allocator gives the next storage of its size the same address: without the tally holding what it has
    counted, the second layer's input (and the second tensor kept) would be taken for the first and count 0, as a T5
    decoder layer's input once did in the CI. Freed then allocated at once, the address comes back every time."""
    tally = _Tally(parameters=set())
    layers = [torch.nn.Identity(), torch.nn.Identity()]
    for index, layer in enumerate(layers):
        tally.watch(layer, index)
    for layer in layers:
        layer(torch.empty(1024, device="meta"))
    for _ in range(2):
        tally.pack(torch.empty(256, device="meta"))
    assert tally.inputs == {0: 4096, 1: 4096}
    assert tally.kept == {None: 2 * 1024}


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a torch built with CUDA (any "
                    "GPU machine's; `make gpu-rehearsal`'s image here): the CPU-only build aborts on them")
def test_a_gpu_plan_measures_what_cudas_autocast_keeps() -> None:
    """Under CUDA's autocast GPT-2 keeps LayerNorm's input and its GELU's intermediates in fp32 (`pow` is on CUDA's
    fp32 list) and one-byte dropout masks: measured on fake CUDA tensors, without a GPU. On an H200
    the plan without it was 1.30x short of the peak (docs/performance.md#gpu-check)."""
    wrap_classes = resolve_wrap_classes(GPT2, None)
    plain = kept_for_backward(meta_model(GPT2), wrap_classes, 48, 0, torch.bfloat16, "sdpa", gpu=True)
    cuda = kept_for_backward(meta_model(GPT2), wrap_classes, 48, 0, torch.bfloat16, "sdpa", gpu=True,
                             autocast=torch.bfloat16)
    assert sum(cuda.layers) > 1.3 * sum(plain.layers)
    assert not cuda.autocast_unmeasured


def test_a_forward_that_reads_values_is_planned_without_autocast_and_the_report_says_so(monkeypatch) -> None:
    """A model whose forward reads a tensor's value cannot run on the planner's fake tensors: its activations are
    measured as before, on the meta device without autocast, and the report says the figure may be short."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    measure = memory_plan.kept_for_backward

    def reads_values(*args):
        if len(args) > 7 and args[7] is not None:  # autocast asked for
            raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
        return measure(*args)

    monkeypatch.setattr(memory_plan, "kept_for_backward", reads_values)
    shape = ModelShape.of(GPT2, resolve_wrap_classes(GPT2, None))
    setup = replace(EIGHT_GPUS, strategy="ddp", precision="bf16-mixed", block_size=128, gpu=False, autocast=True)
    body = kept_by_body(shape, setup)
    assert body.autocast_unmeasured.startswith("this model's forward reads values")
    assert body.layers == shape.kept_for_backward(128, 128, torch.bfloat16, "sdpa", gpu=False).layers
    report, _ = memory_report(read_config(["--model_config", "unused", "--train_data_dir", "unused"]), shape, setup,
                              device=(80 * GB, "test"))
    assert "note: the activations leave out what autocast keeps in fp32" in report
    without_autocast, _ = memory_report(read_config(["--model_config", "unused", "--train_data_dir", "unused"]), shape,
                                        replace(setup, autocast=False), device=(80 * GB, "test"))
    assert "leave out" not in without_autocast


@pytest.mark.parametrize("strategy, sharding_strategy, precision, fsdp_no_sync, optimizer", [
    ("fsdp", "FULL_SHARD", "32-true", False, "adamw"), ("fsdp", "FULL_SHARD", "32-true", True, "adamw"),
    ("fsdp2", "FULL_SHARD", "32-true", True, "adamw"), ("fsdp", "NO_SHARD", "bf16-true", False, "adamw"),
    ("fsdp2", "FULL_SHARD", "32-true", True, "muon")])
def test_estimate_matches_the_parameters_gradients_and_optimizer_state_of_a_run(tiny, tmp_path, strategy,
                                                                               sharding_strategy, precision,
                                                                               fsdp_no_sync, optimizer) -> None:
    """A real 2-process FSDP run with 2 micro-batches per step measures the storage of its tensors during the first
    step (summary.json): gradients between the micro-batches are a shard, the whole gradient with --fsdp_no_sync
    (fsdp2's on tensors of its own, which the run's report missed: it said the shard); Muon's one momentum of the
    layers' matrices. Under FULL_SHARD the whole plan is compared with the ranks' peak RSS, all processes started
    afresh (a process forked from the tests' fork server has not yet touched the libraries' pages)."""
    whole = sharding_strategy == "FULL_SHARD" and not fsdp_no_sync
    result = run_train(train_args(tiny, tmp_path, max_step=4, eval_iters=1, sharding_strategy=sharding_strategy,
                                  precision=precision, save_step_interval=100, initial_validation=False,
                                  fsdp_no_sync=fsdp_no_sync, strategy=strategy, optimizer=optimizer), fresh=whole)
    assert result.returncode == 0, result.stderr[-3000:]
    config = AutoConfig.from_pretrained(tiny.model_config)
    setup = replace(EIGHT_GPUS, strategy=strategy, sharding_strategy=sharding_strategy, precision=precision,
                    world_size=2, devices_per_node=2, micro_batch_size=4, block_size=32, gradient_checkpointing=False,
                    unsharded_accumulation=fsdp_no_sync, optimizer=optimizer)
    estimate = estimate_memory(ModelShape.of(config, resolve_wrap_classes(config, None)), setup)
    ranks = json.loads((tmp_path / "summary.json").read_text())["ranks"]
    assert len(ranks) == 2
    for measured in ranks:
        for name in ("parameters", "gradients", "optimizer"):
            assert measured[f"{name}_gb"] * GB == pytest.approx(getattr(estimate, name), rel=0.10), name
    if whole:
        planned = run_train(train_args(tiny, tmp_path / "plan", max_step=4, sharding_strategy=sharding_strategy,
                                       precision=precision, estimate_memory=True), fresh=True)
        assert planned.returncode == 0, planned.stderr[-3000:]
        total = float(re.search(r"^\s+total\s+([\d.]+) GB$", planned.stdout, re.MULTILINE).group(1))
        peak = max(measured["peak_rss_gb"] for measured in ranks)
        assert total == pytest.approx(peak, rel=0.10), "on CPU the plan is the ranks' peak RSS within 10%"


def test_fsdp2_accumulates_the_unsharded_gradient_in_the_reduce_dtype(llama_3_8b) -> None:
    """Under --fsdp_no_sync FSDP keeps the whole gradient between micro-batches: FSDP1 in the compute dtype, FSDP2
    upcast to the reduce dtype (`unsharded_accumulated_grad`): for Llama-3-8B under bf16-mixed, 30 GB, not 15."""
    accumulating = replace(EIGHT_GPUS, unsharded_accumulation=True, reduce_dtype=torch.float32)
    fsdp = estimate_memory(llama_3_8b, accumulating).gradients
    fsdp2 = estimate_memory(llama_3_8b, replace(accumulating, strategy="fsdp2")).gradients
    assert (fsdp, fsdp2) == (llama_3_8b.parameters * 2, llama_3_8b.parameters * 4)


def test_estimate_memory_prints_the_plan_and_trains_nothing(tiny, tmp_path, capfd) -> None:
    """train.py's own path (`app.training.run.run`), in this process: planning starts no rank."""
    out_dir = tmp_path / "run"
    run(parse_config(train_args(tiny, out_dir, estimate_memory=True, device_memory_gb=80)))
    printed = capfd.readouterr().out
    lines = printed.splitlines()
    assert lines[0].startswith("memory per device: 0.1M parameters, FULL_SHARD over 2 device(s), 32-true")
    for row in ("parameters", "gradients", "optimizer state", "working memory", "activations (4 x 32 tokens)",
                "total"):
        assert any(line.strip().startswith(row) for line in lines), row
    assert "device: 80.0 GB (--device_memory_gb); fits with 10% kept free" in printed
    assert "largest micro batch that fits:" in printed
    assert not out_dir.exists(), "planning writes nothing"

    with pytest.raises(SystemExit) as exit_info:
        run(parse_config(train_args(tiny, out_dir, estimate_memory=True, device_memory_gb=0.5)))
    small = capfd.readouterr().out
    assert "does NOT fit" in small and "no micro batch fits: shard more" in small
    assert exit_info.value.code == EXIT_BAD_INPUT, "a script planning runs reads the answer from the exit code"


def test_peak_rss_is_the_processs_own_not_that_of_the_large_process_that_started_it() -> None:
    """A rank started by a process holding a lot (a notebook, the benchmark, Lightning's launching rank) reports its
    own peak: getrusage's ru_maxrss would carry the parent's over execve."""
    started_by_a_large_process = (
        "import subprocess, sys\n"
        "held = bytearray(1_500_000_000)\n"
        "held[::4096] = b'x' * len(held[::4096])\n"
        "report = 'import json, torch; from app.metrics.observe import peak_memory_gb; '\n"
        "report += 'print(json.dumps(peak_memory_gb(torch.device(\"cpu\"))))'\n"
        "print(subprocess.run([sys.executable, '-c', report], capture_output=True, text=True, check=True).stdout)\n")
    printed = subprocess.run([sys.executable, "-c", started_by_a_large_process], cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=120).stdout
    peak = json.loads(printed)["peak_rss_gb"]
    assert 0.05 < peak < 1.0, f"the child reported {peak:.2f} GB; its parent held 1.5 GB"


def test_plans_without_a_data_folder_from_block_size(tmp_path, capfd) -> None:
    """A user planning Llama-3-8B before preparing any data: its config and --block_size 8192 are enough; a
    training run still needs the data folder."""
    LLAMA_3_8B.save_pretrained(tmp_path / "llama-3-8b")
    args = ["--model_config", str(tmp_path / "llama-3-8b"), "--devices", "8", "--precision", "bf16-mixed",
            "--gradient_checkpointing", "true", "--micro_batch_size", "1", "--estimate_memory", "true",
            "--block_size", "8192", "--device_memory_gb", "80"]
    run(parse_config(args))
    printed = capfd.readouterr().out
    assert "FULL_SHARD over 8 device(s), bf16-mixed, activation checkpointing on, chunked loss" in printed
    assert "activations (1 x 8192 tokens)" in printed and "fits with 10% kept free" in printed
    with pytest.raises(SystemExit):
        parse_config(args[:-6] + ["--block_size", "8192"])
    assert "--block_size 8192: only for --estimate_memory true" in capfd.readouterr().err


def test_a_config_naming_data_not_prepared_yet_plans_from_block_size(tiny, tmp_path, capfd) -> None:
    """configs/demo.yaml before `make demo`: its train_data_dir does not exist yet, and --block_size says all the
    plan needs of data. It was refused: "--train_data_dir demo/data: no such folder". A run still needs the folder."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model_config: {tiny.model_config}\ntrain_data_dir: {tmp_path / 'not-yet'}\n"
                      f"out_dir: {tmp_path / 'run'}\naccelerator: cpu\ndevices: 1\nstrategy: single_device\n"
                      "wandb_mode: disabled\n")
    run(parse_config(["--config", str(config), "--estimate_memory", "true", "--block_size", "64",
                      "--device_memory_gb", "80"]))
    captured = capfd.readouterr()
    assert "activations (1 x 64 tokens)" in captured.out and "error" not in captured.err, captured
    assert f"without --train_data_dir ({tmp_path / 'not-yet'}: not prepared yet)" in captured.out
    with pytest.raises(SystemExit) as exit_info:
        run(parse_config(["--config", str(config)]))
    assert exit_info.value.code == EXIT_BAD_INPUT
    assert f"--train_data_dir {tmp_path / 'not-yet'}: no such folder" in capfd.readouterr().err


def test_the_shipped_config_plans_without_data_a_gpu_or_a_wandb_login(tmp_path, capfd, monkeypatch) -> None:
    """The README's planning line with configs/llama3-8b-continual.yaml: its warmup, W&B online mode and GPU
    accelerator concern the run, not its plan (the warmup was compared with the one step the stand-in data holds);
    so does a launcher for other nodes (a 2-node HYBRID_SHARD plan was refused on the laptop planning it)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    LLAMA_3_8B.save_pretrained(tmp_path / "llama-3-8b")  # a config without weights, in place of the Hub's
    run(parse_config(["--config", str(ROOT / "configs" / "llama3-8b-continual.yaml"), "--model_name",
                      str(tmp_path / "llama-3-8b"), "--estimate_memory", "true", "--block_size", "8192",
                      "--device_memory_gb", "80"]))
    captured = capfd.readouterr()
    assert "FULL_SHARD over 4 device(s), bf16-mixed" in captured.out and "error" not in captured.err, captured
    run(parse_config(["--config", str(ROOT / "configs" / "llama3-8b-continual.yaml"), "--model_name",
                      str(tmp_path / "llama-3-8b"), "--estimate_memory", "true", "--block_size", "8192",
                      "--device_memory_gb", "80", "--sharding_strategy", "HYBRID_SHARD", "--num_nodes", "2"]))
    captured = capfd.readouterr()
    assert "HYBRID_SHARD over 8 device(s)" in captured.out and "error" not in captured.err, captured


def test_a_model_whose_forward_reads_values_is_refused_in_one_line(tmp_path, capfd) -> None:
    """JetMoE's experts read their token counts with `.tolist()`, which a weightless model cannot: --estimate_memory
    ended in a traceback (NotImplementedError: Cannot copy out of meta tensor), though such a model trains."""
    from transformers import JetMoeConfig

    JetMoeConfig(vocab_size=400, hidden_size=64, num_hidden_layers=2, num_key_value_heads=4, kv_channels=16,
                 intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                 max_position_embeddings=512).save_pretrained(tmp_path / "jetmoe")
    with pytest.raises(SystemExit) as refused:
        run(parse_config(["--model_config", str(tmp_path / "jetmoe"), "--accelerator", "cpu", "--devices", "1",
                          "--precision", "32-true", "--estimate_memory", "true", "--block_size", "64"]))
    assert refused.value.code == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "error: --estimate_memory: a jetmoe model's activations cannot be measured on the planner's weightless "
        "(meta) copy, whose tensors have no values (Cannot copy out of meta tensor")
