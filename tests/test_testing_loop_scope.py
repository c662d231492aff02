"""docs/testing.md's pytest setting silences pytest-asyncio's loop-scope warning.

A project that opts in to the plugin and runs async tests gets pytest-asyncio's
``PytestDeprecationWarning`` about ``asyncio_default_fixture_loop_scope`` unless
its pytest configuration sets that option; the page shows what to set. Each run
is a project of its own, with the plugin and an async test, in a new process.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

DOCS = Path(__file__).resolve().parent.parent / "docs"
PROJECT = DOCS / "examples" / "testing"
WARNING = '"asyncio_default_fixture_loop_scope" is unset'

_ASYNC_TEST = """
import pytest


@pytest.mark.asyncio
async def test_an_async_test_with_the_plugin(dedup) -> None:
    assert not await dedup.locks()
"""


def _documented_setting() -> str:
    """The ``pyproject.toml`` block of docs/testing.md that sets the loop scope."""
    page = (DOCS / "testing.md").read_text("utf-8")
    blocks: list[str] = re.findall(r"```toml\n(.*?)```", page, flags=re.DOTALL)
    settings = [block for block in blocks if "asyncio_default_fixture_loop_scope" in block]
    assert settings, "docs/testing.md shows no asyncio_default_fixture_loop_scope setting"
    return settings[0]


def _run(pytester: pytest.Pytester) -> pytest.RunResult:
    shutil.copy(PROJECT / "conftest.py", pytester.path / "conftest.py")
    pytester.makepyfile(test_async=_ASYNC_TEST)
    options = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-q", "-W", "default")
    return pytester.runpytest_subprocess(*options, timeout=60)


@pytest.mark.timeout(120)
def test_the_documented_setting_silences_the_loop_scope_warning(
    pytester: pytest.Pytester, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    # Without a setting, pytest-asyncio warns (the warning the page is about).
    (pytester.path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n", "utf-8")
    unset = _run(pytester)
    unset.assert_outcomes(passed=1)
    assert WARNING in unset.stdout.str() + unset.stderr.str()
    # With the page's setting, it does not.
    (pytester.path / "pyproject.toml").write_text(_documented_setting(), "utf-8")
    documented = _run(pytester)
    documented.assert_outcomes(passed=1)
    assert WARNING not in documented.stdout.str() + documented.stderr.str()
