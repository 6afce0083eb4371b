"""The standard library's code→summary task: real pairs, deterministic, first-sentence summaries, and its CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app.prepare.cli import run_command
from app.prepare.stdlib_tasks import StdlibTaskArgs, code_summary_pairs, file_pairs, first_sentence
from app.prepare.stdlib_tasks import run as write_stdlib_task
from tests.conftest import ROOT

PROG = "python -m app.prepare.stdlib_tasks"


def test_pairs_are_deterministic_with_first_sentence_summaries(tmp_path):
    pairs = code_summary_pairs(("json", "http"))
    assert pairs == code_summary_pairs(("json", "http")) and len(pairs) > 100
    assert all(pair["summary"].strip() and pair["code"].startswith(("def ", "async def ")) for pair in pairs)
    source = (
        "class A:\n    @property\n    def size(self):\n        '''Return the size, e.g. in bytes.  More text.\n\n"
        "        Details.\n        '''\n\n        return self._size\n\n    def empty(self):\n        '''Nothing.'''\n"
        "        pass\n\ndef f(): '''Same line.'''; return 1\n"
    )
    assert file_pairs(source) == [
        {"code": "def size(self):\n    return self._size", "summary": "Return the size, e.g. in bytes."}
    ]
    assert first_sentence("Parse a header.\nIt may span lines.") == "Parse a header."
    assert first_sentence("Build the\n  request object") == "Build the request object"
    written = write_stdlib_task(StdlibTaskArgs(output=str(tmp_path / "task.jsonl"), packages=["json"]))
    lines = (tmp_path / "task.jsonl").read_text().splitlines()
    assert written["pairs"] == len(lines) > 5 and all(json.loads(line).keys() == {"code", "summary"} for line in lines)


def test_cli_writes_json_lines_and_refuses_an_unknown_package_in_one_line(tmp_path, capsys):
    output = tmp_path / "new" / "pairs.jsonl"
    command = [sys.executable, "-m", "app.prepare.stdlib_tasks", "--output", str(output), "--packages", "json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["pairs"] == len(output.read_text().splitlines()) > 5
    (tmp_path / "precious").write_text("PRECIOUS")  # a link left at the temporary name was written through
    (output.parent / f".{output.name}.partial").symlink_to(tmp_path / "precious")
    assert subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False).returncode == 0
    assert (tmp_path / "precious").read_text() == "PRECIOUS" and not output.is_symlink()
    with pytest.raises(SystemExit) as exit_info:
        run_command(StdlibTaskArgs, write_stdlib_task, PROG, ["--output", str(output), "--packages", "json", "nope"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{PROG}: error: --packages: not a standard-library package here: nope; see {PROG} --help"
    ]


def test_files_that_are_not_python_3_source_are_passed_over(tmp_path, monkeypatch):
    """lib2to3's test data (Python 2, a byte-order mark) ended the command in a SyntaxError traceback."""
    import app.prepare.stdlib_tasks as stdlib_tasks

    files = {"bom.py": "\ufeff# coding: utf-8\n", "py2.py": "print 'x'\n", "latin1.py": b"# \xe9\n",
             "good.py": "def size(self):\n    '''Return the size in bytes.'''\n    return self._size\n"}
    for name, text in files.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setattr(stdlib_tasks, "_python_files", lambda packages: sorted(tmp_path.glob("*.py")))
    assert code_summary_pairs(("any",)) == [{"code": "def size(self):\n    return self._size",
                                             "summary": "Return the size in bytes."}]
