"""How the model is built on each rank: the meta-device route under FSDP must give exactly transformers' model."""

from __future__ import annotations

import pytest
import torch
from datasets import load_from_disk
from transformers import AutoConfig, AutoModelForCausalLM

from arguments import read_config
from app.model.build import deferred_init, load_pretrained_weights, tied_names_of
from tests.conftest import read_checkpoint, run_train, train_args

STILL = dict(max_step=1, lr=1e-30, min_lr=0.0, warmup_steps=0, eval_step_interval=1, save_step_interval=1)


def transformers_loss(model, data_dir) -> float:
    """The loss of transformers' own model on the rows one evaluation reads (2 ranks x 4 batches x 4 rows)."""
    rows = load_from_disk(str(data_dir))["validation"].with_format("torch")[list(range(32))]["input_ids"].long()
    with torch.no_grad():
        return model.eval()(input_ids=rows, labels=rows).loss.item()


def logged_val_loss(result) -> float:
    [line] = [line for line in result.stdout.splitlines() if line.startswith("step 1: val_loss")]
    return float(line.split("val_loss ")[1].split()[0])


def save_pretrained_model(tiny, folder, **config_overrides):
    """A 'pretrained' model folder as save_pretrained writes it (safetensors)."""
    config = AutoConfig.from_pretrained(tiny.model_config)
    for name, value in config_overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pretrained(tiny, tmp_path_factory):
    return save_pretrained_model(tiny, tmp_path_factory.mktemp("pretrained"))


@pytest.fixture(scope="module")
def pretrained_tied(tiny, tmp_path_factory):
    """The output layer tied to the embedding (Llama-3.2, Gemma, Qwen2.5's small models): save_pretrained writes the
    embedding alone."""
    return save_pretrained_model(tiny, tmp_path_factory.mktemp("pretrained-tied"), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def pretrained_wide_vocabulary(tiny, tmp_path_factory):
    """Its vocabulary padded to 2048 rows, as Llama-3's is: fsdp2 gives each embedding (more parameters than a layer)
    a unit of their own."""
    return save_pretrained_model(tiny, tmp_path_factory.mktemp("pretrained-wide"), vocab_size=2048)


@pytest.mark.parametrize("strategy, folder", [("fsdp", "pretrained"), ("fsdp", "pretrained_tied"),
                                              ("fsdp2", "pretrained_tied"), ("fsdp2", "pretrained_wide_vocabulary")])
def test_pretrained_model_is_loaded_shard_by_shard_with_its_exact_weights(tiny, tmp_path, strategy, folder,
                                                                          request) -> None:
    """With lr ~ 0 the step-1 checkpoint holds the pretrained weights and the evaluation matches transformers."""
    pretrained = request.getfixturevalue(folder)
    cfg = read_config(["--train_data_dir", str(tiny.data), "--model_name", str(pretrained), "--strategy", strategy])
    assert deferred_init(cfg, AutoConfig.from_pretrained(pretrained)) is not None, "the meta route, not the plain one"
    result = run_train(train_args(tiny, tmp_path, model_config=None, model_name=pretrained, strategy=strategy, **STILL))
    assert result.returncode == 0, result.stderr[-3000:]
    reference = AutoModelForCausalLM.from_pretrained(pretrained)
    saved = read_checkpoint(tmp_path / "checkpoints" / "step-00000001.ckpt")["model"]
    assert all(torch.equal(saved[name], tensor) for name, tensor in reference.state_dict().items())
    assert logged_val_loss(result) == pytest.approx(transformers_loss(reference, tiny.data), rel=1e-5)


def test_model_from_config_is_initialised_like_transformers_and_alike_on_one_device(tiny, tmp_path) -> None:
    """The same --seed gives the same initial weights under fsdp and on one device (both from the meta device, in
    FSDP's order; one device drew them otherwise until it did)."""
    result = run_train(train_args(tiny, tmp_path / "fsdp", **STILL))
    assert result.returncode == 0, result.stderr[-3000:]
    saved = read_checkpoint(tmp_path / "fsdp" / "checkpoints" / "step-00000001.ckpt")["model"]
    one = run_train(train_args(tiny, tmp_path / "one", devices=1, strategy="single_device", **STILL))
    assert one.returncode == 0, one.stderr[-3000:]
    on_one_device = read_checkpoint(tmp_path / "one" / "checkpoints" / "step-00000001.ckpt")["model"]
    assert saved.keys() == on_one_device.keys()
    assert all(torch.equal(saved[name], on_one_device[name]) for name in saved)
    assert torch.equal(saved["model.norm.weight"], torch.ones(64))
    assert saved["model.layers.1.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    reference.load_state_dict(saved)
    # The rotary inv_freq is in no state dict: equal losses show it was computed, not left as empty memory.
    assert logged_val_loss(result) == pytest.approx(transformers_loss(reference, tiny.data), rel=1e-5)


def route(tiny, *extra: str, config_changes: dict | None = None):
    cfg = read_config(["--train_data_dir", str(tiny.data), "--model_config", str(tiny.model_config), *extra])
    model_config = AutoConfig.from_pretrained(tiny.model_config, **(config_changes or {}))
    return deferred_init(cfg, model_config)


def test_meta_device_route_only_where_it_is_exact(tiny) -> None:
    assert route(tiny) is not None
    assert route(tiny, "--strategy", "ddp") is not None, "from a config: materialised at once, as FSDP would"
    assert route(tiny, "--strategy", "ddp", "--model_config", "null", "--model_name", str(tiny.model_config)) is None
    assert route(tiny, config_changes={"tie_word_embeddings": True}) is not None


def test_the_meta_route_keeps_tied_weights_one_tensor(tiny, pretrained_tied, tmp_path) -> None:
    """Tied embeddings take the meta route too: each rank holds its shard and one weight file, not the whole model
    (Gemma-2-27B in bf16: 54 GB per process). Materialised one holder at a time, the tie was lost (to_empty gives
    each holder a tensor of its own): the output layer trained apart from the embedding, and a pretrained model's
    output layer stayed random, as the weight files hold only the embedding."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from app.model.build import materialize_in_sharding_order, meta_model

    config = AutoConfig.from_pretrained(tiny.model_config, tie_word_embeddings=True)
    model, deferred = meta_model(config), route(tiny, config_changes={"tie_word_embeddings": True})
    materialize_in_sharding_order(model, deferred.wrap_classes, deferred.param_init_fn)
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta
    with safe_open(str(pretrained_tied / "model.safetensors"), framework="pt") as stored:
        assert "lm_head.weight" not in stored.keys()
    cfg = read_config(["--train_data_dir", str(tiny.data), "--model_name", str(pretrained_tied)])
    assert deferred_init(cfg, config).weight_files == [pretrained_tied / "model.safetensors"]
    weights = load_file(str(pretrained_tied / "model.safetensors"))
    both = tmp_path / "both"  # a folder that also stores the tied output layer (equal, else the preflight refuses)
    config.save_pretrained(both)
    both_names = weights | {"lm_head.weight": weights["model.embed_tokens.weight"].clone()}
    save_file(both_names, str(both / "model.safetensors"))
    cfg = read_config(["--train_data_dir", str(tiny.data), "--model_name", str(both)])
    assert deferred_init(cfg, config) is not None


def test_the_meta_route_initialises_like_transformers_or_is_not_taken(tiny) -> None:
    """FSDP materialises a unit's modules parent first: GPT-2's attention rescaled its c_proj before the Conv1D's own
    init undid it (residual projections 4.9 x too large at 12 layers). Apertus sets its activation's constants in
    its constructor, which no init repeats: on the meta route they were whatever memory held."""
    from transformers import GPT2Config

    from app.distributed.fsdp2 import wrap_units
    from app.model.build import materializes_like_from_config, materialize_module, meta_model, resolve_wrap_classes

    gpt2 = GPT2Config(vocab_size=300, n_embd=64, n_layer=12, n_head=4, tie_word_embeddings=False)
    model = meta_model(gpt2)
    for unit in [*wrap_units(model, resolve_wrap_classes(gpt2, None)), model]:  # FSDP's order: layers, then the root
        materialize_module(unit, init_weights=model._init_weights, accelerator="cpu")
    residual = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert residual == pytest.approx(0.02 / (2 * 12) ** 0.5, rel=0.15)
    assert materializes_like_from_config(gpt2, False, pretrained=False)
    apertus = AutoConfig.for_model("apertus", vocab_size=512, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=False)
    assert not materializes_like_from_config(apertus, False, pretrained=False)
    assert materializes_like_from_config(apertus, False, pretrained=True), "its weight files hold the constants"
    assert route(tiny) is not None


def test_pretrained_folder_whose_keys_differ_takes_the_plain_route(tiny, pretrained, tmp_path) -> None:
    folder = tmp_path / "renamed"
    folder.mkdir()
    from safetensors.torch import load_file, save_file

    weights = load_file(str(pretrained / "model.safetensors"))
    save_file({name.replace("model.", "transformer.", 1): t for name, t in weights.items()}, str(folder / "model.safetensors"))
    cfg = read_config(["--train_data_dir", str(tiny.data), "--model_name", str(folder)])
    assert deferred_init(cfg, AutoConfig.from_pretrained(tiny.model_config)) is None
    cfg = read_config(["--train_data_dir", str(tiny.data), "--model_name", str(pretrained)])
    assert deferred_init(cfg, AutoConfig.from_pretrained(tiny.model_config)).weight_files == [pretrained / "model.safetensors"]


def test_weight_loading_refuses_missing_and_unexpected_keys(pretrained, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model = AutoModelForCausalLM.from_pretrained(pretrained)
    expected = tied_names_of(model)
    weights = load_file(str(pretrained / "model.safetensors"))
    load_pretrained_weights(model, [pretrained / "model.safetensors"], torch.float32, expected)
    with pytest.raises(RuntimeError, match="0 missing .* 1 unexpected .*model.extra"):
        save_file(weights | {"model.extra": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
        load_pretrained_weights(model, [tmp_path / "model.safetensors"], torch.float32, expected)
    with pytest.raises(RuntimeError, match="1 missing .*lm_head.weight"):
        save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
        load_pretrained_weights(model, [tmp_path / "model.safetensors"], torch.float32, expected)
    with pytest.raises(RuntimeError, match=f"{len(expected)} missing"):
        load_pretrained_weights(torch.compile(model), [pretrained / "model.safetensors"], torch.float32, expected)


def test_plain_route_refuses_a_folder_whose_weights_do_not_fit(tiny, pretrained, tmp_path) -> None:
    from lightning_fabric import Fabric
    from safetensors.torch import load_file, save_file

    from app.model.build import build_model

    folder = tmp_path / "partial"
    AutoConfig.from_pretrained(pretrained).save_pretrained(folder)
    weights = load_file(str(pretrained / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if "layers.1." not in k}, str(folder / "model.safetensors"))
    cfg = read_config(["--train_data_dir", str(tiny.data), "--model_name", str(folder), "--strategy", "ddp",
                       "--precision", "32-true"])
    with pytest.raises(RuntimeError, match=r"missing \(model.layers.1"):
        build_model(Fabric(accelerator="cpu", devices=1), cfg, AutoConfig.from_pretrained(folder), None)


def test_a_pretrained_model_trains_with_its_dropout_from_the_first_step(tiny, pretrained) -> None:
    """from_pretrained returns a model in eval mode; dropout stayed off until the first evaluation called train()."""
    from lightning_fabric import Fabric

    from app.model.build import build_model

    cfg = read_config(["--train_data_dir", str(tiny.data), "--model_name", str(pretrained), "--strategy", "ddp",
                       "--precision", "32-true"])
    model = build_model(Fabric(accelerator="cpu", devices=1), cfg, AutoConfig.from_pretrained(pretrained), None)
    assert all(module.training for module in model.modules())
