"""The `prepare_data.py` command line: PrepareArgs from flags or --config YAML; bad input is one line and exit 2.

`run_command` gives any options dataclass of app/prepare (such as the stdlib task builder's) the same command line
(app/cli.py: bare boolean flags, plain lists, the command line over --config, one-line refusals).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from app import cli, stopping
from app.prepare.args import PrepareArgs

Options = TypeVar("Options")


def parse_args(argv: list[str] | None = None, options: type[Options] = PrepareArgs, prog: str = "prepare_data.py"):
    """The options dataclass from the command line (and --config); a bad flag or value is a UsageError."""
    values = cli.parse(cli.command_parser(prog, options.__doc__ or "", [options]), argv).as_dict()
    values.pop("config", None)
    return options(**values)


def run_command(
    options: type[Options], run: Callable[[Options], dict], prog: str, argv: list[str] | None = None
) -> dict:
    """Parse the options and run; usage errors exit with status 2 and one line on stderr, without a traceback."""
    return cli.run_command(prog, lambda: run(parse_args(argv, options, prog)))


def main(argv: list[str] | None = None) -> dict:
    """Run prepare() from the command line, and say what it wrote. The command line is parsed before the pipeline
    (datasets, transformers, torch: 3 s) is imported: a mistyped flag is refused at once."""
    args = cli.run_command("prepare_data.py", lambda: parse_args(argv))
    from app.prepare.pipeline import prepare, summary

    from app.prepare.workspace import abandon

    nothing_written = "nothing was written (the output appears whole, or not at all)"
    with stopping.stopped_in_one_line("prepare_data.py", nothing_written, abandon, fewer_workers="--num_proc",
                                      writes_to=f"the work folder beside --output_dir {args.output_dir}"):
        stats = cli.run_command("prepare_data.py", lambda: prepare(args))
    print(summary(stats, args.output_dir), flush=True)
    return stats
