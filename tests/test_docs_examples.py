"""The code in the docs: every example runs, and every Python block comes from one.

Each file under ``docs/examples/`` is run as a script, the way a reader would run
it, against the session's Redis (``REDIS_URL``). The scripts are started all at
once, a few at a time, and each test waits for its own, so the whole module
costs about as long as its slowest examples rather than their sum.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = sorted((DOCS / "examples").glob("*.py"))
PAGES = sorted(DOCS.glob("*.md"))

# Each example finishes in a few seconds; a hung one fails instead of stalling.
_TIMEOUT = 30
_PARALLEL = 4

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<info>[^\n]*)$", re.MULTILINE)
_SNIPPET = re.compile(r"""--8<--\s+["'](?P<path>[^"':]+)(?::[^"']+)?["']""")


def _run(example: Path, redis_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(example)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
        check=False,
    )


Runs = dict[Path, "Future[subprocess.CompletedProcess[str]]"]


@pytest.fixture(scope="module")
def example_runs(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Runs]:
    """Start the selected examples in the background; each test waits for its own."""
    selected: list[Path] = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "example" in params:
            selected.append(params["example"])
    with ThreadPoolExecutor(max_workers=_PARALLEL) as pool:
        yield {example: pool.submit(_run, example, redis_url) for example in selected}


def test_there_are_examples() -> None:
    assert EXAMPLES, "no docs/examples/*.py found"


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_runs(example: Path, example_runs: Runs) -> None:
    run = example_runs[example].result(timeout=_TIMEOUT + 5)
    assert run.returncode == 0, (
        f"{example.name} exited with {run.returncode}\n"
        f"--- stdout ---\n{run.stdout}\n--- stderr ---\n{run.stderr}"
    )


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of a Markdown page, as ``(info string, body)``."""
    blocks = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence = opening["fence"]
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index])
            index += 1
        blocks.append((opening["info"].strip(), "\n".join(body)))
        index += 1
    return blocks


def _is_python(info: str) -> bool:
    language = re.match(r"[{.\s]*(\w*)", info)
    return language is not None and language[1].lower() in {"python", "py", "python3", "pycon"}


@pytest.mark.parametrize("page", PAGES, ids=[path.name for path in PAGES])
def test_python_blocks_of_a_page_are_included_from_examples(page: Path) -> None:
    for info, body in _code_blocks(page.read_text("utf-8")):
        if not _is_python(info):
            continue
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        assert lines, f"{page.name}: an empty Python block"
        for line in lines:
            match = _SNIPPET.fullmatch(line)
            assert match is not None, (
                f"{page.name}: a Python block with inline code ({line!r}); "
                "put the code in docs/examples/ and include it with --8<--"
            )
            assert (ROOT / match["path"]).is_file(), f"{page.name}: {match['path']} is missing"


def test_every_example_appears_in_the_docs() -> None:
    included = {
        (ROOT / match["path"]).resolve()
        for page in PAGES
        for match in _SNIPPET.finditer(page.read_text("utf-8"))
    }
    orphans = [example.name for example in EXAMPLES if example.resolve() not in included]
    assert not orphans, f"examples that no page includes: {orphans}"
