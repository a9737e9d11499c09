"""Docs that run: every ```python and ```bash block of README.md and docs/*.md that a user would
paste runs here against a real broker, so the documentation cannot drift from the code.

Blocks are found by their fence. An HTML comment on the line before a block says how to run
it, when it is not self-contained:

``<!-- snippet: skip: <reason> -->``
    not run, for the reason given (it installs something, or starts the project itself)
``<!-- snippet: spark -->``
    needs Spark (a JVM, 10-20 s to start): skipped here, with that reason; the Spark tests
    cover the connector (tests/spark)
``<!-- snippet: continues -->``
    runs appended to the previous ```python block of the same file (the README goes on inside
    the ``with`` block of the one before)
``<!-- snippet: fragment -->``
    runs with ``import slipstream`` and ``client = slipstream.connect(...)`` before it, after
    creating the streams it names (``"scope/name"`` literals): a piece of a program

A python block runs in a fresh interpreter, twice in a row on the same broker: a user runs
an example again. A bash block runs line by line; every line must be a ``slipstream`` command
(possibly fed by ``echo ... |``), else the block needs a marker. A command that runs until
interrupted (``--follow``, ``slipstream demo``) gets Ctrl-C after a few seconds and must stop
cleanly. The broker address 127.0.0.1:7070 in a block becomes the test broker's, and
``SLIPSTREAM_BROKER`` points the CLI at it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BrokerProcess

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCUMENTED_ADDRESS = "127.0.0.1:7070"
MARKER = re.compile(r"^<!--\s*snippet:\s*(skip|spark|continues|fragment)\s*(?::\s*(.*?))?\s*-->$")
STREAM_LITERAL = re.compile(r"""["']([a-z0-9._-]+/[a-z0-9._-]+)["']""")
CLI_LINE = re.compile(r"^(?:echo .+\|\s*)?slipstream\s")
RUNS_UNTIL_INTERRUPTED = re.compile(r"--follow\b|^slipstream\s+demo\b")
SPARK_REASON = "needs Spark (a JVM, 10-20 s to start); tests/spark covers the connector"


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract(path: Path) -> list[Snippet]:
    """The ```python and ```bash blocks of a Markdown file, each with the marker before it."""
    snippets: list[Snippet] = []
    lines = path.read_text().splitlines()
    previous = ""
    index = 0
    while index < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[index])
        if fence is None:
            if lines[index].strip():
                previous = lines[index].strip()
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        language = fence.group(1)
        if language in ("python", "bash"):
            marked = MARKER.match(previous)
            snippets.append(
                Snippet(
                    path,
                    index + 1,
                    language,
                    "\n".join(lines[index + 1 : end]) + "\n",
                    marked.group(1) if marked else None,
                    (marked.group(2) or "") if marked else "",
                )
            )
        previous = ""
        index = end + 1
    return snippets


SNIPPETS = [snippet for document in DOCUMENTS for snippet in extract(document)]


def _program(snippet: Snippet) -> str:
    """The Python text to run for a block: with what it continues, or a fragment's prelude."""
    if snippet.marker == "continues":
        earlier = [s for s in SNIPPETS if s.path == snippet.path and s.language == "python"]
        before = earlier[earlier.index(snippet) - 1]
        return _program(before) + snippet.code
    if snippet.marker == "fragment":
        streams = sorted(set(STREAM_LITERAL.findall(snippet.code)))
        prelude = (
            "import slipstream\n"
            f"client = slipstream.connect({DOCUMENTED_ADDRESS!r})\n"
            + "".join(f"client.create_stream({name!r}, exist_ok=True)\n" for name in streams)
        )
        return prelude + textwrap.dedent(snippet.code)
    return snippet.code


def _environment(broker: BrokerProcess) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "SLIPSTREAM_BROKER": broker.address,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
    }


def _run_python(snippet: Snippet, broker: BrokerProcess, cwd: Path) -> None:
    program = _program(snippet).replace(DOCUMENTED_ADDRESS, broker.address)
    for attempt in ("first", "second"):
        done = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=cwd,
            env=_environment(broker),
            check=False,
        )
        assert done.returncode == 0, (
            f"{snippet.id} failed on its {attempt} run:\n{done.stderr}\n--- program:\n{program}"
        )


def _cli_lines(snippet: Snippet) -> list[str]:
    commands = []
    for raw in snippet.code.splitlines():
        line = re.sub(r"\s+#\s.*$", "", raw).strip()
        if not line or line.startswith("#"):
            continue
        assert CLI_LINE.match(line), (
            f"{snippet.id}: {line!r} is not a slipstream command; mark the block "
            "'<!-- snippet: skip: <reason> -->' if it is not meant to run here"
        )
        commands.append(line.replace(DOCUMENTED_ADDRESS, "$SLIPSTREAM_BROKER"))
    return commands


def _run_bash(snippet: Snippet, broker: BrokerProcess, cwd: Path) -> None:
    for command in _cli_lines(snippet):
        if RUNS_UNTIL_INTERRUPTED.search(command):
            process = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=cwd,
                env=_environment(broker),
            )
            try:
                process.wait(timeout=4)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGINT)  # the user's Ctrl-C
            _, err = process.communicate(timeout=60)
            assert process.returncode in (0, 130), f"{snippet.id}: {command!r} ->\n{err}"
            assert "Traceback" not in err, f"{snippet.id}: {command!r} ->\n{err}"
            continue
        done = subprocess.run(
            ["bash", "-c", command],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=cwd,
            env=_environment(broker),
            check=False,
        )
        assert done.returncode == 0, f"{snippet.id}: {command!r} ->\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda snippet: snippet.id)
def test_snippet_runs(snippet: Snippet, broker: BrokerProcess, tmp_path: Path) -> None:
    if snippet.marker == "skip":
        assert snippet.reason, f"{snippet.id}: a skipped block says why: 'skip: <reason>'"
        pytest.skip(f"marked skip: {snippet.reason}")
    if snippet.marker == "spark":
        pytest.skip(SPARK_REASON)
    if snippet.language == "python":
        _run_python(snippet, broker, tmp_path)
    else:
        _run_bash(snippet, broker, tmp_path)


def test_the_documents_have_runnable_blocks() -> None:
    """The extraction itself: a broken fence or marker would silently test nothing."""
    readme = [s for s in SNIPPETS if s.path.name == "README.md"]
    assert sum(s.language == "python" and s.marker is None for s in readme) >= 2
    assert any(s.marker == "continues" for s in readme)
    assert any(s.language == "bash" and s.marker is None for s in readme)
    assert any("connect_async" in s.code for s in readme)
