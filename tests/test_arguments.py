"""The command line: types, YAML configs, validation, help text, and the option list of docs/options.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from arguments import (OPTIONS_BEGIN, OPTIONS_END, Config, build_parser, options_markdown, parse_config,
                       read_config, validate_config, with_options, write_options_doc)
from tests.conftest import ROOT

REQUIRED = ["--train_data_dir", "data", "--model_config", "cfg"]


def test_types_of_the_original_script_are_fixed() -> None:
    cfg = parse_config(REQUIRED + ["--lr", "3e-4", "--min_lr", "1e-5", "--weight_decay", "0.1", "--beta2", "0.99",
                                   "--grad_clip", "0.5", "--resume", "false", "--limit_all_gathers", "false",
                                   "--devices", "4", "--auto_wrap_policy", "[LlamaDecoderLayer]"])
    assert (cfg.lr, cfg.min_lr, cfg.weight_decay, cfg.beta2, cfg.grad_clip) == (3e-4, 1e-5, 0.1, 0.99, 0.5)
    assert cfg.resume is False and cfg.limit_all_gathers is False
    assert cfg.devices == 4 and cfg.auto_wrap_policy == ["LlamaDecoderLayer"]


def test_yaml_config_sets_any_subset_and_the_command_line_wins(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("lr: 0.001\nmicro_batch_size: 8\nprecision: bf16-mixed\n")
    cfg = parse_config(REQUIRED + ["--config", str(config), "--micro_batch_size", "2"])
    assert (cfg.lr, cfg.micro_batch_size, cfg.precision) == (0.001, 2, "bf16-mixed")
    assert cfg.warmup_steps == Config.warmup_steps


@pytest.mark.parametrize("argv, message", [
    (["--lr", "0"], "--lr must be positive"),
    (["--min_lr", "1", "--lr", "0.1"], "--min_lr must be between 0 and --lr"),
    (["--beta1", "1.0"], "--beta1 must be in [0, 1)"),
    (["--micro_batch_size", "0"], "--micro_batch_size must be at least 1"),
    (["--warmup_steps", "10", "--max_step", "5"], "--warmup_steps (10) exceeds --max_step (5)"),
    (["--checkpoint", "x.ckpt"], "--checkpoint is only read when resuming"),
    (["--model_name", "m"], "give exactly one of --model_name"),
    (["--strategy", "ddp", "--sharding_strategy", "NO_SHARD"], "--sharding_strategy only apply to --strategy fsdp"),
    (["--strategy", "single_device", "--devices", "2"], "--strategy single_device runs one process"),
    (["--tpu", "true", "--accelerator", "cpu"], "--tpu true contradicts --accelerator cpu"),
    (["--stall_timeout_min", "-1"], "--stall_timeout_min must be 0 (off) or positive"),
    (["--rendezvous_timeout_min", "0"], "--rendezvous_timeout_min must be positive"),
    (["--process_group_timeout_min", "0"], "--process_group_timeout_min must be positive"),
])
def test_invalid_values_are_named(argv, message) -> None:
    cfg = read_config(REQUIRED + argv)
    assert any(message in problem for problem in validate_config(cfg)), validate_config(cfg)


def test_cli_reports_every_problem_in_one_go_without_traceback() -> None:
    result = subprocess.run([sys.executable, "train.py", "--lr", "-1", "--beta2", "2", "--micro_batch_size", "0"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) >= 4, result.stderr  # three bad values and the missing --train_data_dir


def test_wrong_type_is_one_line_not_a_traceback() -> None:
    result = subprocess.run([sys.executable, "train.py", "--lr", "fast"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr and "--lr" in result.stderr


def test_every_option_has_help_text() -> None:
    for action in build_parser()._actions:
        if action.dest not in ("help", "print_config"):
            assert action.help and action.help.strip(), action.dest


def test_print_config_round_trips(tmp_path) -> None:
    result = subprocess.run([sys.executable, "train.py", *REQUIRED, "--lr", "0.01", "--print_config"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (tmp_path / "printed.yaml").write_text(result.stdout)
    assert parse_config(["--config", str(tmp_path / "printed.yaml")]).lr == 0.01


def test_docs_list_every_option_as_the_parser_defines_it() -> None:
    document = (ROOT / "docs" / "options.md").read_text()
    assert OPTIONS_BEGIN in document and OPTIONS_END in document
    assert with_options(document) == document, "docs/options.md is stale: run `python arguments.py`"
    assert all(f"| `--{action.dest}` |" in document for action in build_parser()._actions
               if action.dest not in ("help", "config", "print_config"))


def test_python_arguments_py_rewrites_only_the_generated_part(tmp_path) -> None:
    stale = tmp_path / "options.md"
    stale.write_text(f"# Options\n\nintro\n\n{OPTIONS_BEGIN}\n\n| `--lr` | `1` | old |\n\n{OPTIONS_END}\n\nafter\n")
    assert write_options_doc(stale)
    text = stale.read_text()
    assert text.startswith("# Options\n\nintro\n\n") and text.endswith(f"{OPTIONS_END}\n\nafter\n")
    assert options_markdown() in text and "| old |" not in text
    assert not write_options_doc(stale), "a second run changes nothing"


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_parse_and_validate(config) -> None:
    cfg = read_config(["--config", str(config), "--train_data_dir", "data"])
    assert validate_config(cfg) == []
