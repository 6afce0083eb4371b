"""A supervised task every machine has: summarise a standard-library function from its code.

For each function or method of the running interpreter's standard library that has a docstring, `code` is its
source (signature and body, decorators left out, dedented) with the docstring removed, and `summary` is the first
sentence of the docstring. Nothing is downloaded: the pairs are read with `ast` from the `.py` files of
`STDLIB_TASK_PACKAGES` (or the packages given), in file order then source order, so the same interpreter always
gives the same pairs.

Filters, so that every pair is a real, learnable summary of a moderate piece of code:
- the docstring stands on lines of its own, and something other than `pass`, `...` or
  `raise NotImplementedError` remains once it is removed;
- the code has at most `MAX_CODE_LINES` lines and `MAX_CODE_CHARS` characters;
- the summary is prose: it starts with a letter, is neither a signature (`name(args) -> result`, `od[i] <==> ...`)
  nor a grammar rule (`name = ...`, as in `email`'s parser), does not end with a colon, and has `MIN_SUMMARY_WORDS` to
  `MAX_SUMMARY_WORDS` words;
- a function whose code is the same as an earlier one's is skipped.

Use it as supervised data (`--prompt_field code --response_field summary`) or as source→target data
(`--source_field code --target_field summary`): `python -m app.prepare.stdlib_tasks --output pairs.jsonl`.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from app.folders import replace_file
from app.prepare.args import UsageError
from app.prepare.corpus import STDLIB_CORPUS, stdlib_corpus_paths

STDLIB_TASK_PACKAGES = (
    *STDLIB_CORPUS,
    *("asyncio", "importlib", "multiprocessing", "unittest", "xmlrpc", "ctypes", "re", "zoneinfo", "tomllib"),
)
"""The corpus packages plus more that every CPython 3.11+ ships: the corpus alone gives about 800 pairs."""
MAX_CODE_LINES = 40
MAX_CODE_CHARS = 1500
MIN_SUMMARY_WORDS = 3
MAX_SUMMARY_WORDS = 30
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.")
"""Where a period does not end the first sentence."""
TRIVIAL_BODIES = ("pass", "...", "raise NotImplementedError", "raise NotImplementedError()")


@dataclass
class StdlibTaskArgs:
    """Write the standard library's code→summary pairs as JSON lines with the fields `code` and `summary`."""

    output: str = ""
    """The .jsonl file to write (replaced if it exists)."""
    packages: list[str] = field(default_factory=lambda: list(STDLIB_TASK_PACKAGES))
    """Standard-library packages to read (folders of the running interpreter's standard library)."""


def code_summary_pairs(packages: tuple[str, ...] = STDLIB_TASK_PACKAGES) -> list[dict[str, str]]:
    """Every pair the filters keep, from the packages' .py files in sorted order, functions in source order. Files
    that are not Python 3 source (lib2to3's and test suites' data: Python 2, a byte-order mark) are passed over."""
    pairs, seen = [], set()
    for file in _python_files(packages):
        try:
            source_pairs = file_pairs(file.read_text(encoding="utf-8"))
        except (SyntaxError, ValueError):  # ValueError: UnicodeDecodeError, or a null byte in the source
            continue
        for pair in source_pairs:
            if pair["code"] not in seen:
                seen.add(pair["code"])
                pairs.append(pair)
    return pairs


def _python_files(packages: tuple[str, ...]) -> Iterator[Path]:
    for folder in stdlib_corpus_paths(packages):
        yield from sorted(f for f in Path(folder).rglob("*.py") if "__pycache__" not in f.parts)


def file_pairs(source: str) -> list[dict[str, str]]:
    """The pairs of one module's source: each documented function that passes the filters, in source order."""
    lines = source.splitlines()
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    pairs = []
    for function in sorted(functions, key=lambda n: n.lineno):
        pair = function_pair(function, lines)
        if pair is not None:
            pairs.append(pair)
    return pairs


def function_pair(function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> dict[str, str] | None:
    """`{"code", "summary"}` for one function, or None when it has no docstring or a filter rejects it."""
    docstring = ast.get_docstring(function)
    if not docstring or len(function.body) < 2 or not _stands_alone(function.body[0], lines):
        return None
    if all(ast.unparse(statement) in TRIVIAL_BODIES for statement in function.body[1:]):
        return None
    code = code_without_docstring(function, lines)
    summary = first_sentence(docstring)
    if not _code_fits(code) or not _is_prose(summary, function.name):
        return None
    return {"code": code, "summary": summary}


def _stands_alone(statement: ast.stmt, lines: list[str]) -> bool:
    """The docstring has its lines to itself, so removing them removes nothing else."""
    before = lines[statement.lineno - 1].encode()[: statement.col_offset]
    after = lines[statement.end_lineno - 1].encode()[statement.end_col_offset :]
    return not before.strip() and not after.strip()


def code_without_docstring(function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> str:
    """The function's lines from `def` to its end, without the docstring and the blank lines right after it."""
    docstring = function.body[0]
    head = lines[function.lineno - 1 : docstring.lineno - 1]
    rest = lines[docstring.end_lineno : function.end_lineno]
    while rest and not rest[0].strip():
        rest = rest[1:]
    return textwrap.dedent("\n".join(head + rest))


def first_sentence(docstring: str) -> str:
    """The docstring's first paragraph, on one line, up to the first `.`, `!` or `?` that ends a sentence."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    for match in re.finditer(r"[.!?](?=\s|$)", paragraph):
        sentence = paragraph[: match.end()]
        if not sentence.endswith(ABBREVIATIONS):
            return sentence
    return paragraph


def _code_fits(code: str) -> bool:
    return len(code) <= MAX_CODE_CHARS and code.count("\n") < MAX_CODE_LINES


def _is_prose(summary: str, name: str) -> bool:
    words = len(summary.split())
    if summary.startswith(f"{name}(") or re.match(r"[\w-]+ = ", summary) or re.search("->|<==>", summary):
        return False
    return summary[:1].isalpha() and not summary.endswith(":") and MIN_SUMMARY_WORDS <= words <= MAX_SUMMARY_WORDS


def write_pairs(pairs: list[dict[str, str]], output: Path) -> None:
    """JSON lines, written beside the target and renamed into place (folders.replace_file: never through a link left
    at the temporary name), so a reader never sees half a file."""
    replace_file(output, (json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs))


def run(args: StdlibTaskArgs) -> dict:
    """Build the pairs of `args.packages` and write them to `args.output`; returns what was written."""
    if not args.output:
        raise UsageError("--output is required: the .jsonl file to write the pairs to")
    output = Path(args.output)
    if output.is_dir():
        raise UsageError(f"--output {output} is a folder; give the .jsonl file to write")
    missing = [name for name in args.packages if not stdlib_corpus_paths((name,))]
    if missing:
        raise UsageError(f"--packages: not a standard-library package here: {', '.join(missing)}")
    pairs = code_summary_pairs(tuple(args.packages))
    if not pairs:
        raise UsageError(f"--packages {' '.join(args.packages)}: no function passes the filters; add packages")
    output.parent.mkdir(parents=True, exist_ok=True)
    write_pairs(pairs, output)
    return {"output": str(output), "pairs": len(pairs), "packages": list(args.packages)}


if __name__ == "__main__":
    from app.prepare.cli import run_command

    print(json.dumps(run_command(StdlibTaskArgs, run, prog="python -m app.prepare.stdlib_tasks")))
