"""Running ``taskiq dedup`` as a user does: a process of its own, its output, its exit status."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent
_TIMEOUT = 30


@dataclass(frozen=True)
class Run:
    """What one run of the command printed, and its exit status."""

    status: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


async def start_dedup(*args: str, **env: str) -> asyncio.subprocess.Process:
    """Start ``python -m taskiq dedup ARGS`` from the project root, ``env`` added to a clean one.

    Its stdin, stdout and stderr are pipes.
    """
    return await _start(ROOT, args, env)


async def dedup(*args: str, stdin: str = "", **env: str) -> Run:
    """Run ``taskiq dedup ARGS`` to its end, as ``start_dedup`` starts it, ``stdin`` as its input.

    The event loop goes on meanwhile, so the test's own running tasks keep their
    locks alive.
    """
    return await _finished(await start_dedup(*args, **env), stdin)


async def dedup_in(directory: Path, *args: str, **env: str) -> Run:
    """Run ``taskiq dedup ARGS`` as ``dedup`` does, but from ``directory``."""
    return await _finished(await _start(directory, args, env), "")


async def _start(
    directory: Path, args: Sequence[str], env: Mapping[str, str]
) -> asyncio.subprocess.Process:
    environment = {name: value for name, value in os.environ.items() if name != "REDIS_URL"}
    # Coverage of a run elsewhere is written beside the suite's, which combines it.
    environment.setdefault("COVERAGE_FILE", str(ROOT / ".coverage"))
    return await asyncio.create_subprocess_exec(
        *_python(),
        "-m",
        "taskiq",
        "dedup",
        *args,
        cwd=directory,
        env={**environment, **env},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _finished(process: asyncio.subprocess.Process, stdin: str) -> Run:
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin.encode()), _TIMEOUT)
    except BaseException:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return Run(process.returncode, out.decode(), err.decode())


def _python() -> list[str]:
    """The interpreter, measured by coverage like the test process when the suite runs with it.

    Each run writes its data file beside the suite's, which pytest-cov combines.
    """
    coverage = sys.modules.get("coverage")  # not installed on the dependency floors
    if coverage is None or coverage.Coverage.current() is None:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "coverage",
        "run",
        "--parallel-mode",
        f"--rcfile={ROOT / 'pyproject.toml'}",
    ]


def one_line_error(run: Run) -> str:
    """The error ``run`` printed, checked to be one line without a traceback."""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stdout == ""
    return lines[0]


@contextlib.asynccontextmanager
async def holding(middleware: RedisDeduplicationMiddleware, count: int) -> AsyncIterator[list[str]]:
    """Send ``count`` tasks that run (holding their locks) until the block ends; their ids."""
    broker = InMemoryBroker().with_middlewares(middleware)
    finish = asyncio.Event()

    @broker.task(task_name="cli.held")
    async def job(n: int) -> None:
        await finish.wait()

    await broker.startup()
    try:
        yield [(await job.kiq(n)).task_id for n in range(count)]
    finally:
        finish.set()
        await broker.wait_all()
        await broker.shutdown()
