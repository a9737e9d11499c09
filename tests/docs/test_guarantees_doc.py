"""docs/guarantees.md names the tests that check each guarantee: every one must exist.

The page refers to tests as `` `tests/<path>.py::test_name` ``; in a table cell, later names of
the same file may be shortened to `` `::test_name` `` after a full reference. A bare
`` `tests/<path>.py` `` names a whole file. Each file must exist and define each named test
function (at module level or in a ``Test*`` class), so the page cannot name a test that was
renamed or removed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guarantees.md"

# `tests/x/y.py::test_a` or `tests/x/y.py`, then `::test_b` shorthands for the same file
FULL = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+)(?:\[[^\]`]*\])?)?`")
SHORT = re.compile(r"`::(\w+)(?:\[[^\]`]*\])?`")
TOKEN = re.compile(f"{FULL.pattern}|{SHORT.pattern}")


def references(text: str) -> list[tuple[int, str, str | None]]:
    """Every test reference of the page as (line, file, test name or None for a whole file).

    A `::name` shorthand belongs to the last full reference on the same line; one without such
    a reference before it is reported as a reference to the file "?"."""
    found: list[tuple[int, str, str | None]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        current: str | None = None
        for match in TOKEN.finditer(line):
            path, name, short = match.group(1), match.group(2), match.group(3)
            if path is not None:
                current = path
                found.append((number, path, name))
            else:
                found.append((number, current or "?", short))
    return found


def defined_tests(path: Path) -> set[str]:
    """Names of the test functions a pytest file defines (module level and Test* classes)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        bodies = [node]
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            bodies = list(node.body)
        for item in bodies:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name.startswith(
                "test"
            ):
                names.add(item.name)
    return names


def problems(text: str, root: Path) -> list[str]:
    """What the page names that does not exist under ``root``."""
    found: list[str] = []
    cache: dict[str, set[str]] = {}
    for line, file, name in references(text):
        path = root / file
        if file == "?" or not path.is_file():
            found.append(f"line {line}: no file {file}")
            continue
        if name is None:
            continue
        if file not in cache:
            cache[file] = defined_tests(path)
        if name not in cache[file]:
            found.append(f"line {line}: {file} has no test {name}")
    return found


def test_every_test_the_page_names_exists() -> None:
    text = PAGE.read_text()
    refs = references(text)
    named = {(file, name) for _, file, name in refs if name is not None}
    assert len(named) >= 100, f"only {len(named)} test references found: the parser broke?"
    assert problems(text, ROOT) == []


def test_every_guarantee_section_names_tests() -> None:
    sections = re.split(r"^## ", PAGE.read_text(), flags=re.MULTILINE)
    numbered = [s for s in sections if re.match(r"\d+\. ", s)]
    assert len(numbered) >= 8
    for section in numbered:
        title = section.splitlines()[0]
        assert any(name for _, _, name in references(section)), f"{title}: names no test"


def test_a_missing_test_or_file_is_reported() -> None:
    # the check itself must be able to fail
    page = (
        "| `tests/faults/test_kill.py::test_kill_9_during_writes_loses_nothing_acknowledged`, "
        "`::test_no_such_test` |\n"
        "`tests/faults/test_no_such_file.py::test_x` and `::orphan_on_its_own_line`\n"
        "`::test_without_a_file`\n"
        "`tests/faults/test_kill.py::test_checker_catches_a_lost_and_a_reordered_event[x]`\n"
    )
    assert problems(page, ROOT) == [
        "line 1: tests/faults/test_kill.py has no test test_no_such_test",
        "line 2: no file tests/faults/test_no_such_file.py",
        "line 2: no file tests/faults/test_no_such_file.py",
        "line 3: no file ?",
    ]
