"""The map of app/ in its package docstring matches the tree, imports run one way through it, and the docs link to
what is there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import app
from tests.conftest import ROOT

APP = ROOT / "app"
SCRIPTS = {"train", "prepare_data", "convert_to_hf", "prefetch", "plot_metrics", "generate", "show_samples",
           "arguments"}
"""The top-level scripts: app/ imports none of them, except arguments.py's Config as a type name (TYPE_CHECKING)."""


def map_rows() -> dict[str, str]:
    """The map's rows: what the first column names (a file or a folder) -> the second column."""
    rows = re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", app.__doc__, re.MULTILINE)
    return {where: what for where, what in rows[2:]}


def test_the_map_names_every_part_of_app_and_every_module_of_the_parts_it_lists() -> None:
    named = {part.strip() for where in map_rows() for part in where.split(",")}
    tree = {p.name + "/" if p.is_dir() else p.name for p in APP.iterdir()
            if p.name not in ("__init__.py", "__pycache__")}
    assert named == tree
    for where, what in map_rows().items():
        listed = re.match(r"((?:\w+\.py, )*\w+\.py):", what)
        if where.endswith("/") and listed:
            modules = {p.name for p in (APP / where).glob("*.py") if p.name != "__init__.py"}
            assert set(listed.group(1).split(", ")) == modules, where
    assert [part for row in app.LAYERS for part in row] == [
        part.strip().removesuffix("/").removesuffix(".py") for where in map_rows() for part in where.split(",")]


def imported_parts(path: Path) -> set[str]:
    """The parts of app/ (first name after `app.`) and the top-level modules a file imports, anywhere in it; a
    top-level module only where a running program imports it (not under `if TYPE_CHECKING:`, for annotations)."""
    tree = ast.parse(path.read_text())
    for_types = {id(inner) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                 for statement in node.body for inner in ast.walk(statement)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in for_types and isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("app"):
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "app":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("app."):
                found.add(node.module.split(".")[1])
            else:
                found.add(":" + node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] if alias.name.startswith("app.") else ":" + alias.name.split(".")[0]
                      for alias in node.names}
    return found


def test_imports_run_one_way_through_the_map_and_never_into_a_script() -> None:
    layer = {part: index for index, row in enumerate(app.LAYERS) for part in row}
    wrong = []
    for path in APP.rglob("*.py"):
        relative = path.relative_to(APP)
        if relative.name == "__init__.py" and len(relative.parts) == 1:
            continue
        own = relative.parts[0].removesuffix(".py")
        for part in imported_parts(path):
            if part.startswith(":"):
                if part[1:] in SCRIPTS:
                    wrong.append(f"{relative} imports the script {part[1:]}.py")
            elif layer[part] > layer[own]:
                wrong.append(f"{relative} ({own}) imports {part}, which comes after it in the map")
    assert not wrong, wrong


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, spaces as '-', punctuation dropped, a repeated one
    numbered `-1`, `-2`) and its own (`<a id="...">`). Fenced code is no heading."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)
    anchors = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", prose))
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", prose, re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        numbered, count = anchor, 0
        while numbered in anchors:
            count += 1
            numbered = f"{anchor}-{count}"
        anchors.add(numbered)
    return anchors


def test_every_link_between_the_docs_reaches_a_file_and_its_heading() -> None:
    """README.md and docs/: a relative link names a file of the repository and, with `#`, one of its headings (a
    renamed heading once left a link pointing nowhere)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
