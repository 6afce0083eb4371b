"""What every command line of the project does alike: train.py, prepare_data.py, convert_to_hf.py, prefetch.py,
plot_metrics.py, generate.py and show_samples.py.

- Options come from dataclasses whose attribute docstrings are the help (jsonargparse), and a YAML `--config`
  (where the command takes one) sets any subset of them. The command line wins over the file whatever the order:
  `--devices 8 --config run.yaml` trains on 8 devices, as `--config run.yaml --devices 8` does (jsonargparse applies
  a file where it stands, so a flag before it was silently overridden).
- Shell forms: a bare boolean flag means true (`--resume` as `--resume true`), lists take their items plainly
  (`--input a.jsonl b.jsonl`, `--auto_wrap_policy LlamaDecoderLayer`); the YAML/bracket forms still work; a list
  option given twice is refused (only its last values would count).
- A bad command line is one line on stderr ending with "see <prog> --help", exit status 2: no usage dump, no
  traceback, nothing written.
- Progress bars of the libraries only on a terminal (`bars_only_on_a_terminal`): in a log they are noise.

jsonargparse does the typed parsing; this module only shapes how it meets a shell and what a refusal looks like.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import jsonargparse
import yaml
from jsonargparse import ActionConfigFile, ArgumentParser

from app.tasks import exit_refused

CONFIG_FLAG = "--config"


class UsageError(Exception):
    """A problem with the user's arguments or inputs: reported as one line, exit status 2, no traceback."""


def command_parser(prog: str, description: str, groups: Iterable[type], *, config: bool = True,
                   skip: Iterable[str] = ()) -> ArgumentParser:
    """The parser of one command: a --config file (unless `config` is False) and each dataclass as a help group."""
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False, default_env=False,
                            print_config=None, allow_abbrev=False)  # `--conf F` would escape config_files_first
    if config:
        parser.add_argument(CONFIG_FLAG, action=ActionConfigFile,
                            help="YAML file with any subset of the options below; the command line wins over it.")
    for group in groups:
        parser.add_class_arguments(group, nested_key=None, as_group=True, skip=set(skip) or None)
    shell_friendly(parser)
    return parser


def shell_friendly(parser: ArgumentParser) -> None:
    """Bare boolean flags and plain lists (see the module docstring)."""
    for action in parser._actions:
        hint = getattr(action, "_typehint", None)
        if hint is None:
            continue
        if _is_list_of_str(hint):
            action.nargs, action.metavar, action._typehint = "+", action.dest.upper(), str
            action.bracketed_too, action.nullable = True, type(None) in _members(hint)
        elif bool in _members(hint):
            action.nargs, action.const = "?", True


def _members(hint: Any) -> tuple:
    """The types a hint admits: `Optional[int]` and `int | None` alike."""
    return get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)


def _is_list_of_str(hint: Any) -> bool:
    return any(get_origin(member) is list and get_args(member) == (str,) for member in _members(hint))


def config_files_first(argv: list[str]) -> list[str]:
    """argv with every `--config FILE` (or `--config=FILE`) moved to the front, in its order: flags then win."""
    files, rest = [], []
    arguments = iter(argv)
    for argument in arguments:
        if argument == CONFIG_FLAG:
            named = next(arguments, "")
            if not named or named.startswith("--"):  # jsonargparse said "Unexpected config:"
                raise UsageError(f"{CONFIG_FLAG} needs a file: {CONFIG_FLAG} FILE")
            files += [argument, named]
        elif argument.startswith(CONFIG_FLAG + "="):
            if argument == CONFIG_FLAG + "=":
                raise UsageError(f"{CONFIG_FLAG} needs a file: {CONFIG_FLAG} FILE")
            files.append(argument)
        else:
            rest.append(argument)
    return files + rest


def check_config_files(parser: ArgumentParser, argv: list[str]) -> None:
    """What jsonargparse reports without naming the file, or not at all: an empty config file or one that is not
    `option: value` lines ("Unexpected config"), an option the command has not (with several files, which one?), an
    option left without a value (`lr:`: None reached the checks, a TypeError traceback), and a list option written
    as a plain string ("'str' object does not support item assignment"); in the files given and the files they
    name in turn (`config: base.yaml`)."""
    for flag, path in zip(argv, argv[1:]):
        if flag == CONFIG_FLAG and os.path.isfile(path):  # YAML text too (pathlib raises on a long one)
            check_config_file(parser, path)


def check_config_file(parser: ArgumentParser, path: str, naming: tuple[str, ...] = ()) -> None:
    """One config file, then those it names in turn; `naming` the files that led to it (a file that names itself,
    or a cycle, ended in a RecursionError traceback)."""
    if os.path.realpath(path) in map(os.path.realpath, naming):
        chain = " -> ".join((*naming, path))
        raise UsageError(f"{CONFIG_FLAG} {naming[0]}: its `config:` lines name files in a circle ({chain}); "
                         "remove the line that leads back")
    try:
        values = yaml.load(Path(path).read_text(), Loader=UniqueKeysLoader)
    except UnicodeDecodeError:
        raise UsageError(f"{CONFIG_FLAG} {path}: not UTF-8 text; save it as UTF-8") from None
    except OSError as error:
        raise UsageError(f"{CONFIG_FLAG} {path}: cannot be read ({first_line(error)})") from None
    except MisreadLine as line:
        raise UsageError(f"{CONFIG_FLAG} {path}: {line}") from None
    except yaml.YAMLError as error:
        raise UsageError(f"{CONFIG_FLAG} {path}: not valid YAML ({yaml_problem(error)})") from None
    if values is None:
        raise UsageError(f"{CONFIG_FLAG} {path}: the file sets no option; add options to it or drop it")
    if not isinstance(values, dict):
        raise UsageError(f"{CONFIG_FLAG} {path}: expected lines of `option: value`, got a {type(values).__name__}")
    if isinstance(values.get("config"), list):  # jsonargparse applies only a file's name: the list was ignored
        raise UsageError(f"{CONFIG_FLAG} {path}: `config:` names a list, which is not read; name one file a line "
                         "(`config: base.yaml`), or give several --config FILE")
    problems = [problem for name, value in values.items() if (problem := config_value_problem(parser, str(name), value))]
    if problems:
        raise UsageError(f"{CONFIG_FLAG} {path}: {'; '.join(problems)}")
    for nested in nested_config_files(path, values):
        if os.path.isfile(nested):
            check_config_file(parser, nested, (*naming, path))


def yaml_problem(error: yaml.YAMLError) -> str:
    """What YAML could not read and where: its first line said only "while scanning for the next token" (a tab)."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if not problem or mark is None:
        return str(error).splitlines()[0]
    tab = "; YAML takes spaces there, not tabs" if "\\t" in problem else ""
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}{tab}"


class MisreadLine(Exception):
    """A line of a config file that would not be read as meant: an option written twice in one file, a number YAML
    reads otherwise than the command line."""


class UniqueKeysLoader(yaml.SafeLoader):
    """YAML's safe loader, but an option set twice in one file is refused: the last line won without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: {seed: 5}`: flatten_mapping merges it, as jsonargparse
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):  # the loader itself refuses a key it cannot hash
                continue
            if key in seen:
                line = key_node.start_mark.line + 1
                raise MisreadLine(f"{key} is set twice (lines {seen[key]} and {line}); keep one")
            seen[key] = key_node.start_mark.line + 1
            unlike_the_command_line(key, value_node, self.construct_object(value_node))
        return super().construct_mapping(node, deep)


YAML_OCTAL = re.compile(r"-?0[0-7]+")
"""YAML 1.1's octal integers, which the same text on the command line is not: `010` is 8 in a file, 10 as a flag
(`+010`, `0_10` and base 60's `1:30` are read alike in both)."""


def unlike_the_command_line(key: object, node: yaml.Node, value: object) -> None:
    """Refuse an integer a config file writes as YAML reads it otherwise than the command line (`seed: 010` was
    seed 8, `--seed 010` is 10; prepare_data.py's `block_size: 0100` wrote blocks of 64)."""
    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int" and not node.style \
            and YAML_OCTAL.fullmatch(node.value):
        raise MisreadLine(f"{key}: {node.value} is {value} in YAML (octal), unlike on the command line; write the "
                          "number without leading zeros, or quote it")


def config_file_lines(path: str, naming: tuple[str, ...] = ()) -> Iterator[tuple[str, object, str]]:
    """(option, value, file) for each option config file `path` (or YAML text) sets, in the order they apply: those
    of a file it names (`config: base.yaml`) where that line stands; `naming` the files that led to it (a circle,
    which check_config_file refuses, is read once)."""
    values = yaml.safe_load(Path(path).read_text() if os.path.isfile(path) else path) or {}
    for key, value in values.items() if isinstance(values, dict) else ():
        if key == "config":
            for nested in nested_config_files(path, values):
                if os.path.realpath(nested) not in map(os.path.realpath, (*naming, path)):
                    yield from config_file_lines(nested, (*naming, path))
        else:
            yield str(key), value, path


def nested_config_files(path: str, values: dict) -> list[str]:
    """The config file that config file `path` names itself (`config: base.yaml`), read where the line stands, from
    the folder of `path` when relative, as jsonargparse reads it (a list is refused: check_config_file)."""
    named = values.get("config")
    return [str(Path(path).parent / named)] if isinstance(named, str) else []


OTHER_NAMES = {
    "learning_rate": "--lr", "batch_size": "--micro_batch_size", "batch_size_per_device": "--micro_batch_size",
    "per_device_train_batch_size": "--micro_batch_size", "train_micro_batch_size_per_gpu": "--micro_batch_size",
    "per_device_eval_batch_size": "--eval_batch_size", "train_batch_size": "--global_batch_size",
    "num_train_epochs": "--number_epochs", "num_epochs": "--number_epochs", "epochs": "--number_epochs",
    "max_steps": "--max_step", "save_steps": "--save_step_interval", "eval_steps": "--eval_step_interval",
    "logging_steps": "--log_interval", "num_warmup_steps": "--warmup_steps", "max_grad_norm": "--grad_clip",
    "gradient_clipping": "--grad_clip", "output_dir": "--out_dir", "model_name_or_path": "--model_name",
    "activation_checkpointing": "--gradient_checkpointing", "bf16": "--precision bf16-mixed",
    "fp16": "--precision 16-mixed", "no_cuda": "--accelerator cpu", "use_cpu": "--accelerator cpu",
    "no_fsdp": "--strategy ddp", "resume_from_checkpoint": "--resume true",
    "wandb_project": "--project", "wandb_entity": "--entity", "report_to": "--wandb_mode",
    "save_total_limit": "--keep_last_n", "model": "--model_name", "max_epochs": "--number_epochs",
    "lr_scheduler_type": "--lr_decay_type", "lr_scheduler": "--lr_decay_type", "decay_type": "--lr_decay_type",
    "decay_ratio": "--lr_decay_ratio", "warmup_ratio": "--warmup_steps", "lr_warmup_steps": "--warmup_steps",
    "initial_load_path": "--init_from", "initial_checkpoint_dir": "--init_from", "adam_epsilon": "--eps",
    "adam_eps": "--eps", "adam_beta1": "--beta1", "adam_beta2": "--beta2", "config_overrides": "--model_overrides",
    "overrides_of_model_config": "--model_overrides", "rope_scaling": "--model_overrides",
    "save_strategy": "--save_step_interval", "eval_strategy": "--eval_step_interval",
    "evaluation_strategy": "--eval_step_interval", "eval_on_start": "--initial_validation",
    "torch_dtype": "--precision", "do_eval": "--eval_only true", "log_every": "--log_interval",
    **dict.fromkeys(("steps", "total_steps", "num_train_steps", "train_steps"), "--max_step"),
    **dict.fromkeys(("lr_min", "min_learning_rate"), "--min_lr"),
    **dict.fromkeys(("train_tokens", "total_tokens", "num_tokens", "token_budget", "training_tokens"), "--max_tokens"),
    **dict.fromkeys(("max_seq_length", "max_seq_len", "max_length", "seq_length", "seq_len", "sequence_len",
                     "context_length"), "--block_size"),
}
"""Options of the Hugging Face Trainer, accelerate, DeepSpeed and the PyTorch FSDP tutorial's script, as users bring
them, and what this project calls them: difflib's closest name was another option (`--learning_rate` suggested
--sharding_strategy, `--batch_size` --eval_batch_size)."""
NOT_NEEDED = {
    "track_memory": ("--estimate_memory", "every log row has the peak memory; --estimate_memory plans a run's memory "
                                          "and exits"),
    "save_model": ("--save_step_interval", "checkpoints are saved every --save_step_interval steps and at the end"),
    "run_validation": ("--eval_step_interval", "validation runs every --eval_step_interval steps, and "
                                               "--eval_step_interval 0 turns it off"),
    **dict.fromkeys(("max_seq_length", "max_seq_len", "max_length", "seq_length", "seq_len", "sequence_len",
                     "context_length"), ("--train_data_dir", "a run trains on the blocks of --train_data_dir, as long "
                                                             "as prepare_data.py's --block_size made them")),
    **dict.fromkeys(("optim", "optimizer", "optimizer_type", "optimizer_name"), (
        "--weight_decay", "train.py trains with AdamW (fused on GPUs; --beta1, --beta2, --eps and --weight_decay set "
                          "it, and --stochastic_rounding true keeps its small steps under bf16-true)")),
    "max_time": ("--resume", "stop a run after a time with `timeout -s TERM 10h python train.py ...` (or Slurm's "
                             "--time): it saves and exits, and --resume true continues it"),
    "load_best_model_at_end": ("--eval_step_interval", "checkpoints/best.json names the checkpoint of the lowest "
                                                       "val_loss; convert that one with convert_to_hf.py"),
    "save_only_model": ("--save_step_interval", "a checkpoint holds the model and the optimizer, to resume; "
                                                "convert_to_hf.py writes the model alone"),
    **dict.fromkeys(("push_to_hub", "hub_model_id"), ("--save_step_interval", "convert_to_hf.py --push_to_hub REPO "
                                                                              "converts a checkpoint and pushes it")),
}
"""Options of those scripts for what train.py always does or leaves to another script (difflib sent
`--track_memory` to --estimate_memory, which plans and exits without training, and `--max_seq_length` to --max_step),
with an option of train.py that each answer names or implies: said where that option is one (prepare_data.py's
`--max_seq_length` is its --block_size)."""


def meant_instead(name: str, options: list[str]) -> str:
    """What a user who wrote the unknown option `name` meant: a flag (`--learning_rate`, `--batch-size`) or a config
    file's key, answered in the same form (`(did you mean --lr?)`, `(did you mean lr?)`); "" when nothing is close."""
    flag = name.startswith("-")
    bare = name.lstrip("-").replace("-", "_").lower()
    named, answer = NOT_NEEDED.get(bare, ("", ""))
    if named and (named if flag else named.removeprefix("--")) in options:
        return f" (no such option here: {answer})"
    option, _, value = OTHER_NAMES.get(bare, "").partition(" ")
    written = option if flag else option.removeprefix("--")
    if option and written in options:
        return f" (did you mean {written}{((' ' if flag else ': ') + value) if value else ''}?)"
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.7)  # 0.6 sent --init_from to --min_lr
    return f" (did you mean {close[0]}?)" if close else ""


def config_value_problem(parser: ArgumentParser, name: str, value: object) -> Optional[str]:
    action = next((action for action in parser._actions if action.dest == name and action.option_strings), None)
    if action is None:
        options = [action.dest for action in parser._actions if action.option_strings]
        return f"{name} is not an option of {parser.prog}{meant_instead(name, options)}"
    hint = getattr(action, "_typehint", None)
    if value is None and action.default is not None and hint is not None and type(None) not in get_args(hint):
        return f"{name} has no value; give it one, or drop the line for its default ({action.default})"
    if getattr(action, "bracketed_too", False) and isinstance(value, str):
        return f"{name} is a list; write it as [{value}]"
    if isinstance(value, (bool, int, float)) and takes_only_text(hint) and not getattr(action, "bracketed_too", False):
        # `spike_guard: off` is false in YAML
        read = str(value).lower() if isinstance(value, bool) else value
        return f"{name} takes text, but YAML reads the value as {read}: quote it"
    if takes_integers(action) and (isinstance(value, float) or isinstance(value, str) and E_NOTATION.fullmatch(value)):
        number = float(value)  # `max_step: 1e5` is text in YAML; 1.0e+5 and 100000.0 are floats
        if number.is_integer():
            return f"{name} takes an integer: write {int(number)}" + (
                " (e notation is read as an integer on the command line only)" if "e" in str(value).lower() else "")
    return None


def takes_only_text(hint: Any) -> bool:
    """A hint whose values are all text: str, or words to choose from (a Literal of strings), maybe None."""
    members = [member for member in _members(hint) if member is not type(None)]
    return bool(members) and all(member is str or get_origin(member) is Literal
                                 and all(isinstance(word, str) for word in get_args(member)) for member in members)


def takes_integers(action: Any) -> bool:
    """An option whose type admits integers and not other numbers."""
    members = _members(getattr(action, "_typehint", None))
    return int in members and float not in members


def parse(parser: ArgumentParser, argv: list[str] | None) -> jsonargparse.Namespace:
    """The parsed command line; a bad one raises UsageError with a one-line message."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    if any(CONFIG_FLAG in action.option_strings for action in parser._actions):  # generate.py takes no config file
        arguments = config_files_first(arguments)
        check_config_files(parser, [part for word in arguments
                                    for part in (word.split("=", 1) if word.startswith(CONFIG_FLAG + "=") else [word])])
    check_lists_given_once(parser, arguments)
    arguments = integers_as_written(parser, arguments)
    try:
        # no environment: JSONARGPARSE_DEFAULT_ENV=true would make every TRAIN_<OPTION> set an option, unseen
        namespace = parser.parse_args(arguments, env={})
    except jsonargparse.ArgumentError as error:
        raise UsageError(one_line(parser, str(error))) from None
    for action in parser._actions:
        value = namespace.get(action.dest) if getattr(action, "bracketed_too", False) else None
        if isinstance(value, list) and len(value) == 1 and value[0].strip().startswith("["):
            namespace[action.dest] = bracketed_list(value[0])
        elif value == ["null"] and action.nullable:  # a flag resets a config file's list to the default
            namespace[action.dest] = None
    for dest, text in texts_as_written(parser, arguments).items():
        if namespace.get(dest) is None and text != "null":
            namespace[dest] = text
    check_none_empty(parser, namespace)
    return namespace


def bracketed_list(text: str) -> list[str]:
    """`--input '[a, b]'` as its items; text that only starts with a bracket (a file named `[draft].txt`, a pattern
    `[0-9]+`) as itself: YAML's error ended every script in a traceback."""
    try:
        items = yaml.safe_load(text)
    except yaml.YAMLError:
        return [text]
    return [str(item) for item in items or []] if isinstance(items, list) else [text]


EMPTY_ALLOWED = {"prompt"}
"""Options for which empty text means something: generate.py's --prompt "" generates from nothing."""


def check_none_empty(parser: ArgumentParser, namespace: jsonargparse.Namespace) -> None:
    """An option given as empty text (`--out_dir ""`, a list item, a config file's `tokenizer: ''`) is refused: a
    path of "" is the current folder (a run wrote its checkpoints into the repository, prepare_data.py read the
    whole folder it ran in), and elsewhere it read as not given, or ended in a traceback."""
    for action in parser._actions:
        value = namespace.get(action.dest)
        if action.dest in EMPTY_ALLOWED or value == action.default:
            continue
        if any(isinstance(item, str) and not item.strip() for item in (value if isinstance(value, list) else [value])):
            raise UsageError(f"{written_name(parser, action.dest)} is empty: give it a value, or leave it out")


def texts_as_written(parser: ArgumentParser, arguments: list[str]) -> dict[str, str]:
    """The last text given to each optional text option (`Optional[str]`), as typed on the command line or quoted in
    a config file, in the order they apply (`arguments` with the config files first). jsonargparse reads such a value
    as YAML again, where `# sort a list` is a comment and `~` is null: `generate.py --prompt '# sort a list'`
    generated from the default prompt, `--run_name '#3 baseline'` (or `run_name: "#3 baseline"` in a file) named no
    run. Only `null` (or a file's bare `~`) is None."""
    texts = {flag: action.dest for action in parser._actions for flag in action.option_strings
             if str in _members(getattr(action, "_typehint", None)) and type(None) in _members(action._typehint)}
    given, previous = {}, ""
    for word in arguments:
        flag, equals, value = word.partition("=") if word.startswith("--") else (previous, "", word)
        if flag == CONFIG_FLAG and (equals or not word.startswith("--")):
            given |= {texts[f"--{key}"]: "null" if text is None else text for key, text, _ in config_file_lines(value)
                      if f"--{key}" in texts and (text is None or isinstance(text, str))}
        elif flag in texts and (equals or not word.startswith("--")):
            given[texts[flag]] = value
        previous = word if word.startswith("--") and "=" not in word else ""
    return given


E_NOTATION = re.compile(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+")


def integers_as_written(parser: ArgumentParser, arguments: list[str]) -> list[str]:
    """`--max_step 1e5` as `--max_step 100000`: a whole number in e notation, as people write step and token counts,
    was refused as "expected an integer, got '100000.0'" (jsonargparse reads it as a float first). A fraction
    (`1.5e0`) is still refused."""
    integral = {flag for action in parser._actions if takes_integers(action) for flag in action.option_strings}
    rewritten, previous = [], ""
    for word in arguments:
        flag, equals, value = word.partition("=") if word.startswith("--") else (previous, "", word)
        if flag in integral and E_NOTATION.fullmatch(value) and float(value).is_integer():
            word = f"{flag}={int(float(value))}" if equals else str(int(float(value)))
        rewritten.append(word)
        previous = word if word.startswith("--") and "=" not in word else ""
    return rewritten


def check_lists_given_once(parser: ArgumentParser, arguments: list[str]) -> None:
    """A list option given twice (`--input a.jsonl --input b.jsonl`, `--run A --run B`) kept only its last values:
    one input prepared, one run plotted, without a word."""
    flags = [word.split("=", 1)[0] for word in arguments if word.startswith("--")]
    for action in parser._actions:
        if getattr(action, "bracketed_too", False):
            given = [flag for flag in flags if flag in action.option_strings]
            if len(given) > 1:
                raise UsageError(f"{given[0]} is given {len(given)} times, and only the last would count; give all "
                                 f"its values after one {given[0]} ({given[0]} A B)")


def naming_config_files(problem: str, sources: dict[str, str]) -> str:
    """A problem naming options (`--lr must be positive`) with the config file each came from appended: an option
    set in a file that no flag gives was named as the flag, which the user never typed."""
    named = dict.fromkeys(re.findall(r"--(\w+)", problem))
    origins = [f"{name}: from {sources[name].removeprefix('config ')}" for name in named
               if sources.get(name, "").startswith("config ")]
    return problem + (f" ({'; '.join(origins)})" if origins else "")


def one_line(parser: ArgumentParser, message: str) -> str:
    """jsonargparse's message, often several lines ('Parser key "lr":' then the reasons), as one line naming the flag
    and what it takes: `--lr: expected a number, got 'fast'`."""
    key = re.match(r'Parser key "(\w+)":', message)
    required = re.match(r"the following arguments are required: (.*)", message.strip())
    if required:  # named as they are written: `--checkpoint, --output_dir`, `MODEL` (it said `checkpoint, model`)
        names = [written_name(parser, name.strip()) for name in required.group(1).split(",")]
        return f"the following arguments are required: {', '.join(names)}"
    unknown = re.match(r"unrecognized arguments: (.*)", message.strip(), re.S)
    if unknown:  # a mistyped flag: as a mistyped line of a config file, the option meant
        options = [option for action in parser._actions for option in action.option_strings]
        meant = [f"{flag}{said}" for word in unknown.group(1).split() if word.startswith("--")
                 for flag in [word.split("=", 1)[0]] if (said := meant_instead(flag, options))]
        if meant:
            return f"unrecognized arguments: {' '.join(unknown.group(1).split())}; {', '.join(meant)}"
    if not key:
        return " ".join(message.split())
    action = next((a for a in parser._actions if a.dest == key.group(1)), None)
    name = (action.option_strings[0] if action.option_strings else action.metavar) if action else f"--{key.group(1)}"
    given = re.search(r"(?:Got value|Given value): (.*)", message)
    expected = describe_type(getattr(action, "_typehint", None) or getattr(action, "type", None))
    if given and expected:
        return f"{name}: expected {expected}, got {given.group(1).strip()!r}"
    return f"{name}: " + " ".join(message[key.end():].split())


def written_name(parser: ArgumentParser, dest: str) -> str:
    """An argument as the command line writes it: its flag, or a positional argument's metavar."""
    action = next((a for a in parser._actions if a.dest == dest), None)
    if action is None:
        return dest
    return action.option_strings[0] if action.option_strings else (action.metavar or dest)


def describe_type(hint: Any) -> str:
    """What a type hint accepts, in words: `a number`, `one of bf16-true, 32-true`, `an integer or auto`."""
    words = {int: "an integer", float: "a number", str: "text", bool: "true or false", type(None): "null"}
    parts = []
    members = _members(hint)
    for member in [m for m in members if m is not type(None)] or members:  # null: leaving the option out
        if member in words:
            parts.append(words[member])
        elif get_origin(member) is Literal:
            parts.append(("one of " if len(get_args(member)) > 1 else "") + ", ".join(map(str, get_args(member))))
        elif get_origin(member) is list:
            parts.append("a list")
        elif get_origin(member) is dict:
            parts.append('a JSON object ({"name": value, ...})')
        else:
            return ""
    return " or ".join(parts)


def first_line(error: BaseException) -> str:
    """An exception's reason in one line, for a message of ours: its first line, or its type when it says nothing
    (`str(error).splitlines()[0]` raised IndexError on an empty message). A URL in it loses its user and password
    (huggingface_hub names a mirror's `HF_ENDPOINT=http://user:token@host` in full)."""
    return without_credentials((str(error).strip().splitlines() or [type(error).__name__])[0])


URL_CREDENTIALS = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^/?#\s'\"]*@", re.IGNORECASE)
"""A URL's scheme, then its user and password up to the authority's last @ (a password may hold an @)."""


def without_credentials(text: str) -> str:
    """`text` (a URL, or a message naming some) without the user and password a URL may carry
    (`https://user:token@mirror`): to print it, or to ask the URL for an answer (urllib took `user:token@host` for
    the host's name)."""
    return URL_CREDENTIALS.sub(r"\1", text)


def counted(count: int, noun: str) -> str:
    """`1 file`, `2 files`: a count and its noun, as a user reads them."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def refuse(prog: str, message: str) -> typing.NoReturn:
    """Print the one line of a bad command line and exit with status 2 (said once under srun or torchrun: tasks.py)."""
    exit_refused([f"{prog}: error: {message}; see {prog} --help"])


def any_text_printable() -> None:
    """Standard output that writes what its encoding cannot hold as escapes (`\\u0e2a`), as Python's standard error
    does: under a GBK or Latin-1 locale a Thai sample, an emoji, or the U+FFFD of a byte-level token cut at the
    limit ended show_samples.py and generate.py in a UnicodeEncodeError traceback (UTF-8 locales, LANG=C and pipes
    are UTF-8 already)."""
    if hasattr(sys.stdout, "reconfigure") and sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="backslashreplace")


def run_command(prog: str, work: Callable[[], Any]) -> Any:
    """Run `work`; a UsageError it raises becomes the command's one-line refusal."""
    try:
        return work()
    except UsageError as error:
        refuse(prog, str(error))


@contextmanager
def bars_only_on_a_terminal() -> Iterator[None]:
    """transformers' and huggingface_hub's progress bars ("Loading weights", "Writing model shards") off when stderr
    is no terminal: in a log (Slurm, CI, `2> file`) their carriage returns make unreadable lines. Imported here, not
    at the top: a command's --help and refusals need no transformers."""
    if sys.stderr.isatty():
        yield
        return
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()
