"""The command line: types, YAML configs, validation, help text, and the option list of docs/options.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.training.run import run
from arguments import (OPTIONS_BEGIN, OPTIONS_END, Config, build_parser, option_sources, options_markdown,
                       parse_config, read_config, validate_config, with_options, write_options_doc)
from app.cli import UsageError
from tests.conftest import ROOT, run_entry

REQUIRED = ["--train_data_dir", "data", "--model_config", "cfg"]


def test_types_of_the_original_script_are_fixed() -> None:
    cfg = parse_config(REQUIRED + ["--lr", "3e-4", "--min_lr", "1e-5", "--weight_decay", "0.1", "--beta2", "0.99",
                                   "--grad_clip", "0.5", "--resume", "false", "--limit_all_gathers", "false",
                                   "--devices", "4", "--auto_wrap_policy", "[LlamaDecoderLayer]"])
    assert (cfg.lr, cfg.min_lr, cfg.weight_decay, cfg.beta2, cfg.grad_clip) == (3e-4, 1e-5, 0.1, 0.99, 0.5)
    assert cfg.resume is False and cfg.limit_all_gathers is False
    assert cfg.devices == 4 and cfg.auto_wrap_policy == ["LlamaDecoderLayer"]


def test_a_constant_learning_rate_below_the_default_min_lr_is_accepted() -> None:
    """--lr 1e-6 --lr_decay false was refused for the unread default --min_lr (2e-6), and --min_lr given lower was
    refused as unread: no command line trained at a constant rate below 2e-6."""
    cfg = parse_config(REQUIRED + ["--lr", "1e-6", "--lr_decay", "false"])
    assert (cfg.lr, cfg.lr_decay) == (1e-6, False)


def test_yaml_config_sets_any_subset_and_the_command_line_wins_before_or_after_it(tmp_path) -> None:
    """`python train.py --devices 8 --config X.yaml` (the README's resume line, and slurm/train.sbatch's
    `--devices "$GPUS_PER_NODE" "$@"`) used to train on the file's device count."""
    config = tmp_path / "run.yaml"
    config.write_text("lr: 0.001\nmicro_batch_size: 8\nprecision: bf16-mixed\ndevices: 4\n")
    after = parse_config(REQUIRED + ["--config", str(config), "--micro_batch_size", "2", "--devices", "8"])
    before = parse_config(["--micro_batch_size", "2", "--devices", "8", *REQUIRED, f"--config={config}"])
    for cfg in (after, before):
        assert (cfg.lr, cfg.micro_batch_size, cfg.precision, cfg.devices) == (0.001, 2, "bf16-mixed", 8)
        assert cfg.warmup_steps == Config.warmup_steps
    assert option_sources(["--devices", "8", "--config", str(config)]) == {
        "devices": "flag", "lr": f"config {config}", "micro_batch_size": f"config {config}",
        "precision": f"config {config}"}
    with pytest.raises(SystemExit) as refused:  # an abbreviation escaped the reordering: the file won over the flag
        parse_config(["--micro_batch_size", "2", *REQUIRED, "--conf", str(config)])
    assert refused.value.code == 2
    for text, message in (("# nothing\n", "the file sets no option; add options to it or drop it"),
                          ("auto_wrap_policy: LlamaDecoderLayer\n", "auto_wrap_policy is a list; write it as "
                                                                     "[LlamaDecoderLayer]"),
                          ("lr: [1\n", "not valid YAML"),
                          ("seed:\t2\n", "not valid YAML (found character '\\t' that cannot start any token at line 1, "
                                          "column 6; YAML takes spaces there, not tabs)"),  # "while scanning for ..."
                          ("lr:\nmicro_batch_szie: 4\n",  # a TypeError traceback; which file said what, unsaid
                           "lr has no value; give it one, or drop the line for its default (2e-05); micro_batch_szie "
                           "is not an option of train.py (did you mean micro_batch_size?)"),
                          ("learning_rate: 1\nfp16: true\n", "learning_rate is not an option of train.py (did you "
                           "mean lr?); fp16 is not an option of train.py (did you mean precision: 16-mixed?)"),
                          ("- lr: 1\n", "expected lines of `option: value`, got a list"),
                          ("lr: 0.1\nmicro_batch_size: 2\nlr: 0.5\n",  # the last line won without a word
                           "lr is set twice (lines 1 and 3); keep one"),
                          ("spike_guard: off\nproject: 2024\n",  # "expected one of off, ..., got 'False'", no file
                           "spike_guard takes text, but YAML reads the value as false: quote it; project takes text, "
                           "but YAML reads the value as 2024: quote it"),
                          ("seed: 010\n",  # YAML's octal: seed 8 without a word, where --seed 010 is 10
                           "seed: 010 is 8 in YAML (octal), unlike on the command line; write the number without "
                           "leading zeros, or quote it")):
        config.write_text(text)  # jsonargparse said "Unexpected config" and "'str' object does not support item ..."
        result = subprocess.run([sys.executable, "train.py", *REQUIRED, f"--config={config}"], cwd=ROOT,
                                capture_output=True, text=True)
        assert result.returncode == 2 and result.stderr.startswith(f"train.py: error: --config {config}: {message}"), \
            result.stderr
    config.write_text("lr: 0.1\n<<: {seed: 5}\n")  # a merge key, which jsonargparse reads: refused as not valid YAML
    assert parse_config(REQUIRED + ["--config", str(config)]).seed == 5
    for argv in (["--seed", "1", "--config"], ["--config", "--seed", "1"], ["--config="]):  # "Unexpected config:"
        with pytest.raises(UsageError, match="^--config needs a file: --config FILE$"):
            read_config(REQUIRED + argv)
    inline = parse_config(REQUIRED + ["--config", "{micro_batch_size: 3}"])  # jsonargparse takes YAML itself too
    assert inline.micro_batch_size == 3
    assert option_sources(["--config", "{micro_batch_size: 3}"]) == {"micro_batch_size": "config {micro_batch_size: 3}"}


def test_config_files_that_name_each_other_in_a_circle_are_refused_in_one_line(tmp_path) -> None:
    """A file naming itself (`config: self.yaml`), or two naming each other, ended in a RecursionError traceback."""
    (tmp_path / "self.yaml").write_text("config: self.yaml\nlr: 0.01\n")
    (tmp_path / "a.yaml").write_text("config: b.yaml\n")
    (tmp_path / "b.yaml").write_text("config: a.yaml\n")
    for first, chain in (("self.yaml", "self.yaml -> self.yaml"), ("a.yaml", "a.yaml -> b.yaml -> a.yaml")):
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), *REQUIRED, "--config", first], cwd=tmp_path,
                                capture_output=True, text=True)
        assert (result.returncode, result.stderr) == (
            2, f"train.py: error: --config {first}: its `config:` lines name files in a circle ({chain}); remove the "
               "line that leads back; see train.py --help\n")


def test_a_config_file_that_names_another_is_read_checked_and_labelled_where_its_lines_stand(tmp_path) -> None:
    """`config: base.yaml` inside a file: jsonargparse reads it from the file's folder where the line stands. Its
    values were labelled as defaults in --print_config, and its bad lines were "Unexpected config" naming no file."""
    (tmp_path / "base").mkdir()
    base = tmp_path / "base" / "base.yaml"
    base.write_text("lr: 0.5\nmicro_batch_size: 3\n")
    run = tmp_path / "run.yaml"
    run.write_text("config: base/base.yaml\nlr: 0.1\n")
    cfg = parse_config(REQUIRED + ["--config", str(run)])
    assert (cfg.lr, cfg.micro_batch_size) == (0.1, 3)
    assert option_sources(["--config", str(run)]) == {"micro_batch_size": f"config {base}", "lr": f"config {run}"}
    run.write_text("lr: 0.1\nconfig: base/base.yaml\n")  # the named file comes after: its lr wins
    assert parse_config(REQUIRED + ["--config", str(run)]).lr == 0.5
    assert option_sources(["--config", str(run)])["lr"] == f"config {base}"
    base.write_text("micro_batch_size:\n")
    result = subprocess.run([sys.executable, "train.py", *REQUIRED, "--config", str(run)], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith(
        f"train.py: error: --config {base}: micro_batch_size has no value; give it one"), result.stderr
    base.write_text("lr: 0.5\n")
    run.write_text("config: [base/base.yaml]\nseed: 7\n")  # jsonargparse stored the list and applied nothing
    with pytest.raises(UsageError, match=r"`config:` names a list, which is not read; name one file a line"):
        read_config(REQUIRED + ["--config", str(run)])


def test_bare_boolean_flags_and_plain_lists_as_in_prepare_data() -> None:
    cfg = parse_config(REQUIRED + ["--resume", "--auto_wrap_policy", "LlamaDecoderLayer", "LlamaMLP", "--log_model"])
    assert cfg.resume is True and cfg.auto_wrap_policy == ["LlamaDecoderLayer", "LlamaMLP"] and cfg.log_model is True
    cfg = parse_config(REQUIRED + ["--resume", "false", "--auto_wrap_policy", "[LlamaDecoderLayer]", "--log_model",
                                   "all"])
    assert cfg.resume is False and cfg.auto_wrap_policy == ["LlamaDecoderLayer"] and cfg.log_model == "all"
    assert parse_config(REQUIRED + ["--auto_wrap_policy", "null"]).auto_wrap_policy is None, "was ['null']"
    assert parse_config(REQUIRED + ["--freeze", "[0-9]+"]).freeze == ["[0-9]+"], "YAML's error was a traceback"
    assert parse_config(REQUIRED + ["--auto_wrap_policy", "[a"]).auto_wrap_policy == ["[a"]


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys) -> None:
    """Its UnicodeDecodeError was every script's traceback."""
    (tmp_path / "latin1.yaml").write_bytes("lr: 0.01  # réglé\n".encode("latin-1"))
    with pytest.raises(SystemExit) as exit_info:
        parse_config(REQUIRED + ["--config", str(tmp_path / "latin1.yaml")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"train.py: error: --config {tmp_path / 'latin1.yaml'}: not UTF-8 text; save it "
                                       "as UTF-8; see train.py --help\n")


def test_an_optional_text_keeps_what_was_typed_and_only_null_is_none() -> None:
    """jsonargparse reads an optional text as YAML: `--run_name '#3 baseline'` (a YAML comment) named no run,
    `generate.py --prompt '# sort a list'` generated from the default prompt, `--project '~'` was null."""
    from app.huggingface.generate_cli import parse_args

    cfg = parse_config(REQUIRED + ["--run_name", "#3 baseline", "--project=~", "--entity", "2024"])
    assert (cfg.run_name, cfg.project, cfg.entity) == ("#3 baseline", "~", "2024")
    assert parse_config(REQUIRED + ["--run_name", "null"]).run_name is None
    assert parse_args(["model", "--prompt", "# sort a list"]).prompt == "# sort a list"
    assert parse_args(["model", "--prompt", "null"]).prompt is None


def test_an_optional_text_quoted_in_a_config_file_is_that_text_also_in_config_yaml(tmp_path) -> None:
    """A file's `run_name: "#3 baseline"` was read as null (jsonargparse reads the text as YAML again), and so was
    the flag's in the config.yaml a resume reads back; a bare `~` is still null, and a later flag still wins."""
    (tmp_path / "run.yaml").write_text('run_name: "#3 baseline"\nproject: "~"\nentity: ~\ntokenizer: "null"\n')
    config = ["--config", str(tmp_path / "run.yaml")]
    cfg = parse_config(REQUIRED + config)
    assert (cfg.run_name, cfg.project, cfg.entity, cfg.tokenizer) == ("#3 baseline", "~", None, None)
    assert parse_config(REQUIRED + config + ["--run_name", "null"]).run_name is None
    assert parse_config(["--run_name", "x"] + REQUIRED + config).run_name == "x", "a flag wins over a file"
    (tmp_path / "written.yaml").write_text(parse_config(REQUIRED + ["--run_name", "#3 baseline"]).to_yaml())
    assert parse_config(["--config", str(tmp_path / "written.yaml")]).run_name == "#3 baseline"


def test_jsonargparse_reads_no_option_from_the_environment(monkeypatch) -> None:
    """JSONARGPARSE_DEFAULT_ENV=true made every TRAIN_<OPTION> variable set an option, shown as a default."""
    monkeypatch.setenv("JSONARGPARSE_DEFAULT_ENV", "true")
    monkeypatch.setenv("TRAIN_MAX_STEP", "7")
    build_parser.cache_clear()
    try:
        assert read_config(REQUIRED).max_step is None
    finally:
        build_parser.cache_clear()


def test_a_list_option_given_twice_is_refused_rather_than_keeping_its_last_values() -> None:
    """`prepare_data.py --input a.jsonl --input b.jsonl` prepared b alone, `plot_metrics.py --run A --run B` plotted B
    alone, without a word."""
    for command, flag in (("prepare_data.py", "--input"), ("plot_metrics.py", "--run"), ("train.py",
                                                                                         "--auto_wrap_policy")):
        result = subprocess.run([sys.executable, command, flag, "a", flag, "b"], cwd=ROOT, capture_output=True,
                                text=True)
        assert result.returncode == 2 and result.stderr.startswith(
            f"{command}: error: {flag} is given 2 times, and only the last would count; give all its values after "
            f"one {flag} ({flag} A B)"), result.stderr


@pytest.mark.parametrize("argv, message", [
    (["--lr", "0"], "--lr must be positive"),
    (["--min_lr", "1", "--lr", "0.1"], "--min_lr must be between 0 and --lr"),
    (["--lr", "1e-6"], "--min_lr must be between 0 and --lr (1e-06), got 2e-06 (its default): give a lower --min_lr"),
    (["--beta1", "1.0"], "--beta1 must be in [0, 1)"),
    (["--micro_batch_size", "0"], "--micro_batch_size must be at least 1"),
    (["--warmup_steps", "10", "--max_step", "5"], "--warmup_steps (10) exceeds --max_step (5)"),
    (["--checkpoint", "x.ckpt"], "--checkpoint is only read when resuming"),
    (["--reference_batch_size", "64"], "--reference_batch_size is only read with --lr_scaling linear or sqrt"),
    (["--device_memory_gb", "80"], "--device_memory_gb is only read by --estimate_memory true"),
    (["--eval_max_new_tokens", "16"], "--eval_max_new_tokens is only read with --eval_samples N"),
    (["--lr_decay", "false", "--min_lr", "1e-6"], "--min_lr: only read by the decay, which --lr_decay false"),
    (["--lr_decay", "false", "--lr_decay_ratio", "0.2", "--lr_decay_type", "sqrt"],
     "--lr_decay_type, --lr_decay_ratio: only read by the decay, which --lr_decay false turns off"),
    (["--eval_only", "true", "--resume", "true"], "--eval_only true evaluates a model and trains no run to continue: "
                                                  "drop --resume, and give the checkpoint to evaluate as --init_from"),
    (["--eval_only", "true", "--eval_step_interval", "0"], "--eval_only true with --eval_step_interval 0 would "
                                                           "evaluate nothing"),
    (["--eps", "0"], "--eps must be positive, got 0.0"),
    (["--early_stopping_patience", "0"], "--early_stopping_patience must be at least 1, got 0"),
    (["--early_stopping_threshold", "0.01"], "--early_stopping_threshold is only read with --early_stopping_patience"),
    (["--lr_decay_ratio", "0"], "--lr_decay_ratio must be above 0 and at most 1 (the whole run), got 0.0"),
    (["--warmup_steps", "2.5"], "--warmup_steps must be a whole number of steps, or a share of the run's steps "
                                "between 0 and 1, got 2.5"),
    (["--number_epochs", "2", "--max_step", "8"], "--number_epochs 2 is not read when --max_step is given"),
    (["--number_epochs", "2", "--max_tokens", "1e6"], "--number_epochs 2 is not read when --max_tokens is given"),
    (["--max_tokens", "1e6", "--max_step", "8"], "--max_step 8 and --max_tokens 1000000 both set the run's length: "
                                                 "give one (--max_step null or --max_tokens null drops a config "
                                                 "file's)"),
    (["--max_tokens", "0"], "--max_tokens must be at least 1, got 0"),
    (["--profile_steps", "5-7"], "--profile_steps 5-7: give the optimizer steps to trace as FIRST:LAST (10:12) or one "
                                 "step"),
    (["--profile_steps", "7:5"], "--profile_steps 7:5: the first step must be 1 or more, and the last at least the "
                                 "first"),
    (["--eval_step_interval", "0", "--eval_iters", "5", "--eval_samples", "2"],
     "--eval_iters, --eval_samples: not read with --eval_step_interval 0, which turns validation off"),
    (["--eval_step_interval", "-1"], "--eval_step_interval must be a whole number of steps, or a share of the run's "
                                     "steps between 0 and 1, or 0 for no validation, got -1"),
    (["--log_interval", "0"], "--log_interval must be a whole number of steps, or a share of the run's steps between "
                              "0 and 1, got 0"),
    (["--save_step_interval", "2.5"], "--save_step_interval must be a whole number of steps, or a share of the "
                                      "run's steps between 0 and 1, or 0 for no checkpoints, got 2.5"),
    (["--accelerator", "tpu", "--strategy", "ddp"], "--strategy ddp: TPUs train with Lightning's XLA FSDP only"),
    (["--tpu", "--sharding_strategy", "NO_SHARD", "--cpu_offload", "true"],
     "--sharding_strategy, --cpu_offload: not read by Lightning's XLA FSDP"),
    (["--tpu", "--gradient_checkpointing", "true", "--gradient_checkpointing_every", "2"],
     "--gradient_checkpointing_every: not read by Lightning's XLA FSDP"),
    (["--gradient_checkpointing_every", "2"], "--gradient_checkpointing_every is only read with "
                                              "--gradient_checkpointing true"),
    (["--gradient_checkpointing", "true", "--gradient_checkpointing_every", "0"],
     "--gradient_checkpointing_every must be at least 1, got 0"),
    (["--spike_guard", "off", "--spike_z", "3", "--spike_window", "20"],
     "--spike_z, --spike_window: only read by the spike guard, which --spike_guard off turns off"),
    (["--model_name", "m"], "give exactly one of --model_name"),
    (["--strategy", "ddp", "--sharding_strategy", "NO_SHARD"],
     "--sharding_strategy applies only to --strategy fsdp or fsdp2, not ddp"),
    (["--strategy", "single_device", "--devices", "2"], "--strategy single_device runs one process"),
    (["--tpu", "true", "--accelerator", "cpu"], "--tpu true contradicts --accelerator cpu"),
    (["--reduce_dtype", "float16", "--precision", "bf16-mixed"], "--reduce_dtype float16 only with --precision 16-mixed"),
    (["--stall_timeout_min", "-1"], "--stall_timeout_min must be 0 (off) or positive"),
    (["--rendezvous_timeout_min", "0"], "--rendezvous_timeout_min must be positive"),
    (["--process_group_timeout_min", "0"], "--process_group_timeout_min must be positive"),
    (["--process_group_timeout_min", "0.0001", "--stall_timeout_min", "0"],  # 41 lines of C++ frames in a rank
     "--process_group_timeout_min must be at least 1 (a minute): it also bounds the ranks' first connection"),
    (["--process_group_timeout_min", "10"], "--stall_timeout_min (20) must be below --process_group_timeout_min (10)"),
    (["--save_step_interval", "-1"], "--save_step_interval must be a whole number of steps"),
    (["--save_step_interval", "0", "--spike_guard", "rollback"], "--save_step_interval 0 writes no checkpoint"),
    (["--save_step_interval", "0", "--log_model"], "--save_step_interval 0 writes no checkpoint"),
    (["--save_step_interval", "0", "--keep_last_n", "2"], "--keep_last_n is only read when checkpoints are saved"),
    (["--spike_guard", "skip", "--spike_rewarm_steps", "5"],
     "--spike_rewarm_steps: only read by --spike_guard rollback"),
    (["--spike_guard", "detect", "--spike_incident", "1"], "--spike_incident: not read by --spike_guard detect"),
    (["--process_group_timeout_min", "1e15", "--stall_timeout_min", "0"],  # an OverflowError in every rank
     "--process_group_timeout_min must be positive and at most a year (525600)"),
    (["--seed", "-1"], "--seed must be between 0 and 4294967295"),  # every rank's traceback from numpy's seeding
    (["--neftune_noise_alpha", "-5"], "--neftune_noise_alpha must be 0 (off) or more"),
    (["--label_smoothing", "1"], "--label_smoothing must be at least 0 and below 1, got 1.0"),
    (["--z_loss=-1e-4"], "--z_loss must be 0 (off) or more, got -0.0001"),
    (["--seed", "4294967296"], "--seed must be between 0 and 4294967295"),
])
def test_invalid_values_are_named(argv, message) -> None:
    cfg = read_config(REQUIRED + argv)
    assert any(message in problem for problem in validate_config(cfg)), validate_config(cfg)


def test_an_unread_option_with_a_bad_value_is_one_line_saying_to_drop_it() -> None:
    """`--device_memory_gb 0` without --estimate_memory was two true lines: that it must be positive, and that it is
    not read. Dropping it is the fix for both."""
    for argv, message in ((["--device_memory_gb", "0"], "--device_memory_gb is only read by --estimate_memory true"),
                          (["--eval_step_interval", "0", "--eval_iters", "0"], "--eval_iters: not read with "
                                                                             "--eval_step_interval 0")):
        problems = validate_config(read_config(REQUIRED + argv))
        assert len(problems) == 1 and problems[0].startswith(message), problems
    assert validate_config(read_config(REQUIRED + ["--device_memory_gb", "0", "--estimate_memory", "true"])) == [
        "--device_memory_gb must be positive, got 0.0"]


def test_model_overrides_that_are_no_json_object_say_what_they_take(capsys) -> None:
    """jsonargparse's own words were "Does not validate against any of the Union subtypes Subtypes: [dict[str,
    typing.Any], <class 'NoneType'>] Errors: ..."."""
    for given in ("{bad", "[1]"):
        with pytest.raises(SystemExit):
            parse_config(REQUIRED + ["--model_overrides", given])
        assert capsys.readouterr().err == (f"train.py: error: --model_overrides: expected a JSON object "
                                           f"({{\"name\": value, ...}}), got {given!r}; see train.py --help\n")


def test_a_negative_lr_is_said_once_without_advice_to_lower_min_lr_below_it() -> None:
    assert validate_config(read_config(REQUIRED + ["--lr", "-1"])) == ["--lr must be positive, got -1.0"]


def test_an_infinite_value_from_a_config_file_is_refused_as_on_the_command_line(tmp_path) -> None:
    """`--lr inf` is refused by the parser; a YAML `lr: .inf` passed every check, and the run logged `lr inf` until
    its loss went non-finite at step 2 (exit 3)."""
    (tmp_path / "run.yaml").write_text("lr: .inf\nmin_lr: 0\ngrad_clip: -.inf\n")
    assert sorted(validate_config(read_config(REQUIRED + ["--config", str(tmp_path / "run.yaml")]))) == [
        "--grad_clip must be a finite number, got -inf", "--lr must be a finite number, got inf"]


def test_a_max_step_below_one_is_said_once() -> None:
    """It also printed "--warmup_steps (0) exceeds --max_step (-1)", which is false."""
    assert validate_config(read_config(REQUIRED + ["--max_step", "-1"])) == ["--max_step must be at least 1, got -1"]


def test_a_whole_number_in_e_notation_is_an_integer_and_a_fraction_is_refused(tmp_path) -> None:
    """`--max_step 1e5` was refused as "expected an integer, got '100000.0'"; --lr keeps its float. In a config file
    (YAML reads 1e5 as text, 1.0e+5 as a float) the file and the integer to write are named."""
    cfg = read_config(REQUIRED + ["--max_step", "1e5", "--save_step_interval=2.5e3", "--lr", "3e-4"])
    assert (cfg.max_step, cfg.save_step_interval, cfg.lr) == (100000, 2500, 3e-4)
    with pytest.raises(UsageError, match="--max_step: expected an integer, got"):
        read_config(REQUIRED + ["--max_step", "1.5e0"])
    (tmp_path / "run.yaml").write_text("max_step: 1e5\neval_iters: 2.0e+3\nlr: 3e-4\n")
    with pytest.raises(UsageError, match=f"--config {tmp_path / 'run.yaml'}: max_step takes an integer: write 100000 "
                                         r"\(e notation .*\); eval_iters takes an integer: write 2000"):
        read_config(REQUIRED + ["--config", str(tmp_path / "run.yaml")])


def test_cli_reports_every_problem_in_one_go_without_traceback() -> None:
    result = subprocess.run([sys.executable, "train.py", "--lr", "-1", "--beta2", "2", "--micro_batch_size", "0"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) >= 4, result.stderr  # three bad values and the missing --train_data_dir


def test_a_flag_may_turn_off_what_a_config_file_sets_and_the_run_says_so(tmp_path, capsys) -> None:
    """`--eval_samples 0` over a config that sets eval_max_new_tokens was refused with "drop --eval_max_new_tokens",
    a line of the file the command line cannot drop (the command line wins over config files). Both in the file, or
    both flags: still refused."""
    (tmp_path / "run.yaml").write_text("eval_samples: 4\neval_max_new_tokens: 32\nspike_z: 3\nnumber_epochs: 2\n")
    config = ["--config", str(tmp_path / "run.yaml")]
    cfg = parse_config(REQUIRED + config + ["--eval_samples", "0", "--spike_guard", "off", "--max_step", "5"])
    assert (cfg.eval_samples, cfg.spike_guard) == (0, "off")
    assert capsys.readouterr().err.splitlines() == [
        f"note: --eval_max_new_tokens ({tmp_path / 'run.yaml'}) not read: --eval_samples on the command line turns it "
        "off", f"note: --number_epochs ({tmp_path / 'run.yaml'}) not read: --max_step on the command line turns it off",
        f"note: --spike_z ({tmp_path / 'run.yaml'}) not read: --spike_guard on the command line turns it off"]
    from app.training.print_config import source_of  # --print_config said "derived from 32 by the preflight"

    sources = option_sources(REQUIRED + config + ["--eval_samples", "0", "--spike_guard", "off"])
    assert source_of("eval_max_new_tokens", cfg, cfg.readable_back(), sources) == (
        f"default: 32 (config {tmp_path / 'run.yaml'}) is not read")
    (tmp_path / "written.yaml").write_text(cfg.to_yaml())  # config.yaml, as a resume reads it back: it was refused
    again = parse_config(REQUIRED + ["--config", str(tmp_path / "written.yaml")])
    assert (again.eval_samples, again.eval_max_new_tokens, again.spike_z) == (0, 128, 6.0), "nothing read them"
    (tmp_path / "both.yaml").write_text("eval_samples: 0\neval_max_new_tokens: 32\n")
    assert validate_config(read_config(REQUIRED + ["--config", str(tmp_path / "both.yaml")]),
                           option_sources(["--config", str(tmp_path / "both.yaml")])) == [
        "--eval_max_new_tokens is only read with --eval_samples N: add it, or drop --eval_max_new_tokens"]


def test_eval_only_refuses_training_options_as_flags_and_notes_a_config_files(tmp_path, capsys) -> None:
    """--eval_only true trains nothing: `--lr 0.5 --max_step 5` beside it were taken without a word (and written to
    config.yaml). A config file's training lines are the usual note, as with every option a flag turns off."""
    argv = REQUIRED + ["--eval_only", "true", "--lr", "0.5", "--max_step", "5", "--seed", "3"]
    assert validate_config(read_config(argv), option_sources(argv)) == [
        "--max_step, --lr: only read by training, which --eval_only true leaves out: drop them"]
    (tmp_path / "train.yaml").write_text("lr: 0.5\nsave_step_interval: 10\nmicro_batch_size: 4\n")
    cfg = parse_config(REQUIRED + ["--config", str(tmp_path / "train.yaml"), "--eval_only", "true"])
    assert capsys.readouterr().err.splitlines() == [f"note: --lr, --save_step_interval ({tmp_path / 'train.yaml'}) "
                                                    "not read: --eval_only on the command line turns it off"]
    assert (cfg.readable_back().lr, cfg.readable_back().micro_batch_size) == (Config.lr, 4), "the evaluation's batch"


def test_estimate_memory_and_print_config_together_are_refused() -> None:
    """--print_config printed the YAML and skipped the plan, exit 0; the YAML then planned instead of training."""
    argv = REQUIRED + ["--estimate_memory", "true", "--print_config", "true"]
    assert [p for p in validate_config(read_config(argv), option_sources(argv)) if "print_config" in p] == [
        "--estimate_memory true and --print_config true each print a report and exit without training (the printed "
        "config would plan, not train): give one of them"]


def test_a_value_of_the_wrong_type_in_a_config_file_names_the_file(tmp_path, capsys) -> None:
    """`precision: bf16` in one of several files was said as `--precision: expected one of ...`, a flag never typed."""
    (tmp_path / "a.yaml").write_text("lr: 0.1\n")
    (tmp_path / "b.yaml").write_text("precision: bf16\n")
    with pytest.raises(SystemExit) as refused:
        parse_config(REQUIRED + ["--config", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "b.yaml")])
    assert refused.value.code == 2
    assert f"got 'bf16' (precision: from {tmp_path / 'b.yaml'})" in capsys.readouterr().err


def test_a_problem_with_an_option_from_a_config_file_names_the_file(tmp_path) -> None:
    """`--lr must be positive` for a `lr:` line the user wrote in a file sent them looking for a flag they never
    typed; the file is named, by the value checks and by the preflight alike."""
    (tmp_path / "values.yaml").write_text("lr: -1\n")
    (tmp_path / "data.yaml").write_text(f"train_data_dir: {tmp_path / 'none'}\n")
    said = {}
    for config, extra in (("values.yaml", ["--beta2", "2"]), ("data.yaml", ["--model_config", str(tmp_path)])):
        result = run_entry(["train.py", "--config", str(tmp_path / config), "--accelerator", "cpu", *extra], 120)
        assert result.returncode == 2, result.stderr
        said |= {line.split()[1]: line for line in result.stderr.splitlines() if line.startswith("error: --")}
    assert said["--lr"].endswith(f"(lr: from {tmp_path / 'values.yaml'})"), said
    assert said["--train_data_dir"].endswith(f"(train_data_dir: from {tmp_path / 'data.yaml'})"), said
    assert "from" not in said["--beta2"], said


REFUSED_COMMANDS = {
    "train.py wrong type": (["train.py", "--lr", "fast"], "train.py: error: --lr: expected a number, got 'fast'"),
    "train.py unknown option": (["train.py", "--learning_rate", "1"],  # difflib's --sharding_strategy
                                "train.py: error: unrecognized arguments: --learning_rate 1; --learning_rate (did you "
                                "mean --lr?)"),
    "train.py option of another tool": (["train.py", "--batch-size", "4", "--bf16", "--track_memory"],
                                        "train.py: error: unrecognized arguments: --batch-size 4 --bf16 "
                                        "--track_memory; "
                                        "--batch-size (did you mean --micro_batch_size?), --bf16 (did you mean "
                                        "--precision bf16-mixed?), --track_memory (no such option here: every log row "
                                        "has the peak memory; --estimate_memory plans a run's memory and exits)"),
    "train.py mistyped option": (["train.py", "--micro_batch_szie", "4"],  # a config file's line said it, not a flag
                                 "train.py: error: unrecognized arguments: --micro_batch_szie 4; --micro_batch_szie "
                                 "(did you mean --micro_batch_size?)"),
    "train.py missing config": (["train.py", "--config", "/nonexistent.yaml"],
                                "train.py: error: --config: File does not exist: '/nonexistent.yaml'"),
    "train.py wrong choice": (["train.py", "--precision", "bf17"], "train.py: error: --precision: expected one of"),
    "prepare_data.py": (["prepare_data.py", "--block_size", "big"], "prepare_data.py: error: --block_size: expected "
                                                                      "an integer, got 'big'"),
    "convert_to_hf.py": (["convert_to_hf.py", "--dtype", "float8"], "convert_to_hf.py: error: --dtype: expected one of"),
    # named as written (they said "checkpoint, output_dir" and "model"; the flags are --checkpoint, --model)
    "convert_to_hf.py required": (["convert_to_hf.py"], "convert_to_hf.py: error: the following arguments are "
                                                         "required: --checkpoint, --output_dir"),
    "prefetch.py required": (["prefetch.py"], "prefetch.py: error: the following arguments are required: --model"),
    "generate.py required": (["generate.py"], "generate.py: error: the following arguments are required: MODEL"),
    "prefetch.py": (["prefetch.py", "--unknown"], "prefetch.py: error: unrecognized arguments: --unknown"),
    "plot_metrics.py": (["plot_metrics.py", "/nonexistent/run"], "plot_metrics.py: error: --run /nonexistent/run: no "
                                                                  "such file or folder"),
    "generate.py": (["generate.py", "/nonexistent/model"], "generate.py: error: MODEL /nonexistent/model: no such "
                                                          "folder"),
    "show_samples.py": (["show_samples.py", "/nonexistent/run"], "show_samples.py: error: RUN /nonexistent/run: no "
                                                                "such folder"),
    "show_samples.py count": (["show_samples.py", "run", "four"], "show_samples.py: error: N: expected an integer, "
                                                                 "got 'four'"),
}


def test_options_of_other_trainers_are_answered_with_what_they_mean_here() -> None:
    """difflib sent the Trainer's --max_seq_length to --max_step (a user who followed it trained 2048 steps),
    --lr_scheduler to --lr_scaling and --hub_model_id to --model_config."""
    from app.cli import command_parser, meant_instead
    from app.prepare.args import PrepareArgs

    def options(parser) -> list[str]:
        return [option for action in parser._actions for option in action.option_strings]

    train, prepare = options(build_parser()), options(command_parser("prepare_data.py", "", [PrepareArgs]))
    assert meant_instead("--max_seq_length", train) == (" (no such option here: a run trains on the blocks of "
                                                        "--train_data_dir, as long as prepare_data.py's --block_size "
                                                        "made them)")
    assert meant_instead("--max_seq_length", prepare) == meant_instead("--max-length", prepare) == \
        " (did you mean --block_size?)"
    assert "timeout -s TERM" in meant_instead("--max_time", train)
    assert meant_instead("--optim", train).startswith(" (no such option here: train.py trains with AdamW")
    assert meant_instead("--train_tokens", train) == " (did you mean --max_tokens?)"
    assert meant_instead("--save_total_limit", train) == " (did you mean --keep_last_n?)"
    assert meant_instead("--hub_model_id", train) == meant_instead("--push_to_hub", train) == (
        " (no such option here: convert_to_hf.py --push_to_hub REPO converts a checkpoint and pushes it)")
    assert meant_instead("--lr_scheduler_type", train) == " (did you mean --lr_decay_type?)"  # not --reduce_dtype
    assert meant_instead("--save_strategy", train) == " (did you mean --save_step_interval?)"  # not --strategy
    assert meant_instead("--steps", train) == " (did you mean --max_step?)"  # not --eps
    assert meant_instead("--do_eval", train) == " (did you mean --eval_only true?)"
    assert meant_instead("--optim_type", train) == ""  # nothing close enough (difflib said --state_dict_type)
    assert meant_instead("--precison", train) == " (did you mean --precision?)"


@pytest.mark.parametrize("case", REFUSED_COMMANDS)
def test_every_entry_point_refuses_a_bad_command_line_in_one_line(case) -> None:
    """One line on stderr, saying what is wrong and ending with where the help is; exit 2; no usage dump, no
    traceback (train.py's wrong types printed about 45 lines of usage first)."""
    argv, expected = REFUSED_COMMANDS[case]
    prog = argv[0]
    result = run_entry(argv)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(expected) and line.endswith(f"; see {prog} --help"), line


def test_an_option_given_as_empty_text_is_refused_rather_than_read_as_the_current_folder() -> None:
    """`--out_dir ""` wrote a run into the folder train.py ran in; prepare_data.py's `--input ""` read all of it."""
    from app.cli import command_parser, parse
    from app.prepare.args import PrepareArgs

    for argv, flag in ((["--out_dir", ""], "--out_dir"), (["--tokenizer", " "], "--tokenizer")):
        with pytest.raises(UsageError, match=f"^{flag} is empty: give it a value, or leave it out$"):
            parse(build_parser(), argv)
    with pytest.raises(UsageError, match="^--input is empty"):
        parse(command_parser("prepare_data.py", "", [PrepareArgs]), ["--input", "docs", "", "--output_dir", "out"])
    assert parse(build_parser(), ["--out_dir", "runs/a"]).out_dir == "runs/a"


@pytest.mark.parametrize("variable", ["LOCAL_RANK=abc", "MASTER_PORT=29500x", "MALLOC_TRIM_THRESHOLD_=-1"])
def test_a_launcher_variable_that_is_no_whole_number_is_one_line(variable: str) -> None:
    """They ended in a ValueError traceback, in train.py's code or in Lightning's (rank_zero, main_port)."""
    import os

    name, value = variable.split("=")
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                            env=os.environ | {name: value}, timeout=120)
    assert result.returncode == 2 and result.stderr == (f"error: {name}={value!r} is set, and is not a whole number "
                                                        "of 0 or more; unset it, or give it one\n"), result.stderr


def test_every_option_has_help_text() -> None:
    for action in build_parser()._actions:
        if action.dest != "help":
            assert action.help and action.help.strip(), action.dest


def test_print_config_shows_the_resolved_run_with_where_each_value_came_from(tiny, tmp_path, capfd,
                                                                               monkeypatch) -> None:
    """After the preflight (which refuses --devices 0 and missing data): every option with its source, the values
    the run derives, and YAML that --config reads back."""
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (tmp_path / "run.yaml").write_text("micro_batch_size: 2\nlr: 0.004\ndevices: 4\n")
    argv = ["--devices", "2", "--config", str(tmp_path / "run.yaml"), "--accelerator", "cpu", "--precision",
            "32-true", "--model_config", str(tiny.model_config), "--train_data_dir", str(tiny.data), "--out_dir",
            str(tmp_path / "out"), "--lr_scaling", "sqrt", "--reference_batch_size", "8", "--print_config"]
    run(parse_config(argv), option_sources(argv))
    printed = capfd.readouterr().out
    for line in ("devices: 2", "micro_batch_size: 2", "lr: 0.00282842", "project: \"from-the-environment\"",
                 "wandb_mode: \"disabled\"", f"warmup_steps: {Config.warmup_steps}"):
        assert any(row.startswith(line) for row in printed.splitlines()), line
    sources = {row.split(":")[0]: row.split("# ")[-1] for row in printed.splitlines() if not row.startswith("#")}
    assert sources["devices"] == "flag" and sources["micro_batch_size"] == f"config {tmp_path / 'run.yaml'}"
    assert sources["lr"] == f"derived from 0.004 (config {tmp_path / 'run.yaml'}) by the preflight"
    assert sources["project"] == "environment WANDB_PROJECT" and sources["warmup_steps"] == "default"
    assert "#   global batch: 4 sequences per step (2 micro batch x 1 accumulation x 2 ranks)" in printed
    assert "#   optimizer steps: 161 (--number_epochs 1; 161 steps per epoch of 647 rows)" in printed
    assert not (tmp_path / "out").exists(), "printing the configuration writes nothing"
    (tmp_path / "printed.yaml").write_text(printed)
    again = parse_config(["--config", str(tmp_path / "printed.yaml")])
    assert (again.devices, again.micro_batch_size, again.lr, again.lr_scaling, again.print_config) == (
        2, 2, pytest.approx(0.004 * (4 / 8) ** 0.5), "none", False), "lr scaled by sqrt(global batch 4 / 8)"
    result = subprocess.run([sys.executable, "train.py", *argv, "--devices", "0"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 2 and result.stdout == "" and "--devices must be at least 1, got 0" in result.stderr


@pytest.mark.parametrize("script", ["train.py", "convert_to_hf.py", "generate.py", "prepare_data.py"])
def test_a_mistyped_flag_is_refused_before_torch_is_imported(script: str) -> None:
    """A typo costs the parse, not the 5-8 s that importing torch and transformers took convert_to_hf.py, generate.py
    and prepare_data.py before they parsed their command lines."""
    probe = ("import atexit, runpy, sys; "
             "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr)); "
             f"sys.argv = [{script!r}, '--no_such_flag']; runpy.run_path({script!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr == f"{script}: error: unrecognized arguments: --no_such_flag; see {script} --help\n" \
                            "torch imported: False\n"


def test_docs_list_every_option_as_the_parser_defines_it() -> None:
    document = (ROOT / "docs" / "options.md").read_text()
    assert OPTIONS_BEGIN in document and OPTIONS_END in document
    assert with_options(document) == document, "docs/options.md is stale: run `python arguments.py`"
    assert all(f"| `--{action.dest}` |" in document for action in build_parser()._actions  # print_shtab: jsonargparse
               if action.dest not in ("help", "config", "print_shtab"))  # adds it at the (cached) parser's first parse


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


def test_an_exceptions_reason_is_one_line_even_when_it_says_nothing() -> None:
    """`str(error).splitlines()[0]`, written inline in nine messages, raised IndexError on an exception without text."""
    from app.cli import first_line

    assert (first_line(OSError()), first_line(ValueError("bad\nmore")), first_line(KeyError("  "))) == (
        "OSError", "bad", "'  '")


def test_an_exceptions_reason_never_shows_the_password_of_a_url_it_names() -> None:
    """huggingface_hub names a mirror's HF_ENDPOINT in full ("We couldn't connect to 'http://alice:SECRET@host'"):
    train.py, prepare_data.py, convert_to_hf.py and generate.py printed it, and Slurm kept it in the job's log."""
    from app.cli import first_line
    from app.hub import load_problem

    error = OSError("We couldn't connect to 'http://alice:SECRET@127.0.0.1:18765' to load the files of org/tok.\n...")
    assert first_line(error) == load_problem(error) == ("We couldn't connect to 'http://127.0.0.1:18765' to load the "
                                                        "files of org/tok.")
    assert first_line(ValueError("see https://huggingface.co/docs, user@example.com")) == (
        "see https://huggingface.co/docs, user@example.com"), "only a URL's user and password"
    assert first_line(OSError("https://user:p@ss@mirror.local/x and https://mirror.local?u=a@b")) == (
        "https://mirror.local/x and https://mirror.local?u=a@b"), "a password holding @; an @ after the host"
