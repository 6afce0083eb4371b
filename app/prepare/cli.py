"""The `prepare_data.py` command line: PrepareArgs from flags or --config YAML; bad input is one line and exit 2.

`run_command` gives any options dataclass of app/prepare (such as the stdlib task builder's) the same command line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import fields
from typing import TypeVar

import jsonargparse

from app.prepare.args import PrepareArgs, UsageError

USAGE_EXIT_CODE = 2
Options = TypeVar("Options")


def build_parser(options: type = PrepareArgs, prog: str = "prepare_data.py") -> jsonargparse.ArgumentParser:
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = jsonargparse.ArgumentParser(prog=prog, exit_on_error=False, description=options.__doc__)
    parser.add_argument("--config", action="config", help="YAML file with any of the options below.")
    parser.add_class_arguments(options, nested_key=None, as_group=True)
    _make_shell_friendly(parser, options)
    return parser


def _make_shell_friendly(parser: jsonargparse.ArgumentParser, options: type) -> None:
    """`--input a.jsonl b.jsonl` (also shell globs) and bare `--overwrite`, instead of jsonargparse's
    `--input '[a.jsonl, b.jsonl]'` and `--overwrite true` (both spellings still work)."""
    lists = {f.name for f in fields(options) if f.type in (list[str], "list[str]")}
    flags = {f.name for f in fields(options) if f.type in (bool, "bool")}
    for action in parser._actions:
        if action.dest in lists:
            action.nargs, action.metavar, action._typehint = "+", "PATH" if action.dest == "input" else "NAME", str
        elif action.dest in flags:
            action.nargs, action.const = "?", True


def parse_args(argv: list[str] | None = None, options: type[Options] = PrepareArgs, prog: str = "prepare_data.py"):
    """The options dataclass from the command line (and --config); a bad flag or value is a UsageError."""
    parser = build_parser(options, prog)
    try:
        namespace = parser.parse_args(argv)
    except jsonargparse.ArgumentError as error:
        raise UsageError(" ".join(str(error).split())) from error
    values = namespace.as_dict()
    values.pop("config", None)
    return options(**values)


def run_command(
    options: type[Options], run: Callable[[Options], dict], prog: str, argv: list[str] | None = None
) -> dict:
    """Parse the options and run; usage errors exit with status 2 and one line on stderr, without a traceback."""
    try:
        return run(parse_args(argv, options, prog))
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(USAGE_EXIT_CODE) from None


def main(argv: list[str] | None = None) -> dict:
    """Run prepare() from the command line, and say what it wrote."""
    from app.prepare.pipeline import prepare, summary

    stats = run_command(PrepareArgs, prepare, "prepare_data.py", argv)
    print(summary(stats), flush=True)
    return stats
