"""The `prepare_data.py` command line: PrepareArgs from flags or --config YAML; bad input is one line and exit 2."""

from __future__ import annotations

import sys
from dataclasses import fields

import jsonargparse

from app.prepare.args import PrepareArgs, UsageError

USAGE_EXIT_CODE = 2


def build_parser() -> jsonargparse.ArgumentParser:
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = jsonargparse.ArgumentParser(prog="prepare_data.py", exit_on_error=False, description=PrepareArgs.__doc__)
    parser.add_argument("--config", action="config", help="YAML file with any of the options below.")
    parser.add_class_arguments(PrepareArgs, nested_key=None, as_group=True)
    _make_shell_friendly(parser)
    return parser


def _make_shell_friendly(parser: jsonargparse.ArgumentParser) -> None:
    """`--input a.jsonl b.jsonl` (also shell globs) and bare `--overwrite`, instead of jsonargparse's
    `--input '[a.jsonl, b.jsonl]'` and `--overwrite true` (both spellings still work)."""
    flags = {f.name for f in fields(PrepareArgs) if f.type in (bool, "bool")}
    for action in parser._actions:
        if action.dest == "input":
            action.nargs, action.metavar, action._typehint = "+", "PATH", str
        elif action.dest in flags:
            action.nargs, action.const = "?", True


def parse_args(argv: list[str] | None = None) -> PrepareArgs:
    parser = build_parser()
    try:
        namespace = parser.parse_args(argv)
    except jsonargparse.ArgumentError as error:
        raise UsageError(" ".join(str(error).split())) from error
    values = namespace.as_dict()
    values.pop("config", None)
    return PrepareArgs(**values)


def main(argv: list[str] | None = None) -> dict:
    """Run prepare() from the command line; usage errors exit with status 2 and one line on stderr."""
    from app.prepare.pipeline import prepare

    try:
        stats = prepare(parse_args(argv))
    except UsageError as error:
        print(f"prepare_data.py: error: {error}", file=sys.stderr)
        raise SystemExit(USAGE_EXIT_CODE) from None
    return stats
