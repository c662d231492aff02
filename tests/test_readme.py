"""The README's front door (issue 31): two commands set a machine up, and what they say is true.

One command installs the project and runs the demo, one runs the whole suite
(the end-to-end suite included); the number of tests the README gives is the
number the second command collects. CI (`.ci/run`) runs both commands.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text("utf-8")


def quick_start_commands() -> list[str]:
    """The commands of the README's Quick start, one per line of its code block."""
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    return [line for line in block.splitlines() if line.strip()]


def test_the_quick_start_is_two_commands_the_demo_and_the_whole_suite() -> None:
    demo, tests = quick_start_commands()  # exactly two
    assert "pip install -e" in demo
    assert demo.rstrip().endswith("docs/examples/quickstart.py")
    words = shlex.split(tests)
    assert words[0].endswith("pytest")
    assert "-n" in words
    # No path: it runs what pyproject's testpaths name, which is every test.
    assert [w for w in words[1:] if not w.startswith("-") and w != "auto"] == []
    ci = (REPO / ".ci" / "run").read_text("utf-8")
    assert demo.split("&&")[-1].strip().removeprefix(".venv/bin/python ") in ci
    assert " ".join(words) in ci, "CI runs the README's test command as it is"


def test_the_suites_command_runs_every_directory_of_tests() -> None:
    pyproject = (REPO / "pyproject.toml").read_text("utf-8")  # tomllib is 3.11+
    (listed,) = re.findall(r"^testpaths = \[(.*)\]$", pyproject, flags=re.MULTILINE)
    testpaths = re.findall(r'"([^"]+)"', listed)
    covered = {REPO / path for pattern in testpaths for path in REPO.glob(pattern)}
    for path in (REPO / "tests").rglob("test_*.py"):
        assert path in covered or any(parent in covered for parent in path.parents), (
            f"{path.relative_to(REPO)} is not run by the README's test command"
        )


@pytest.mark.slow
def test_the_readme_says_how_many_tests_the_command_runs() -> None:
    said = re.search(r"runs the whole\s+test suite \(([\d,]+) tests\)", README)
    assert said is not None, "the README no longer says how many tests run"
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    counted = re.search(r"^(\d+) tests? collected", collected.stdout, flags=re.MULTILINE)
    assert counted is not None, collected.stdout[-2000:] + collected.stderr[-2000:]
    assert int(said.group(1).replace(",", "")) == int(counted.group(1))
