"""Where the time goes: py-spy samples the send path and a heartbeat tick.

py-spy samples this process from outside (``--nonblocking``, 2,000 times a second,
idle samples included), so the profile costs the measured code almost nothing
and time spent waiting in ``epoll`` for Redis's reply shows as such. Each sample
is charged to one category: to the wait or the event loop when the innermost
frame is there, otherwise to the innermost frame that belongs to a known package
(a ``json.dumps`` called by the fingerprint is fingerprint time; one called by
taskiq is taskiq's). py-spy sees Python frames only: time in a C function counts
for the Python function that called it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.benchmarks import scenarios
from tests.benchmarks.harness import NullBroker, drive, numbers_from

Results = dict[str, Any]

_RATE = 2000  # samples per second
_WAIT = "waiting in epoll (for Redis's reply, or idle)"
_LOOP = "asyncio: event loop, streams, socket writes, futures"
#: (path fragment, category), tried on the innermost frame first.
_OWNERS = (
    ("taskiq_deduplication/model/fingerprint.py", "dedup: fingerprint"),
    ("taskiq_deduplication/model/settings.py", "dedup: labels"),
    ("taskiq_deduplication/model/formats.py", "dedup: labels"),
    ("taskiq_deduplication/store/lock_store.py", "dedup: lock pipeline"),
    ("taskiq_deduplication/store/pipeline.py", "dedup: lock pipeline"),
    ("taskiq_deduplication/store/wire/connection.py", "dedup: lock pipeline"),
    ("taskiq_deduplication/run/heartbeat.py", "dedup: heartbeat loop"),
    ("taskiq_deduplication/middleware.py", "dedup: middleware hooks"),
    ("taskiq_deduplication/send/sends.py", "dedup: middleware hooks"),
    ("taskiq_deduplication/run/runs.py", "dedup: middleware hooks"),
    ("taskiq_deduplication/", "dedup: middleware hooks"),
    ("redis/", "redis-py: pack commands, parse replies, connection"),
    ("taskiq_redis/", "taskiq-redis"),
    ("taskiq/", "taskiq: kicker, message, formatter"),
    ("taskiq_dependencies/", "taskiq: kicker, message, formatter"),
    ("pydantic", "pydantic (taskiq's message models)"),
    ("benchmarks/", "benchmark loop"),
)
_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?)(?::(?P<line>\d+))?\)$")


def _parse(frame: str) -> tuple[str, str, str]:
    match = _FRAME.match(frame)
    if match is None:
        return frame, "", ""
    return match["function"], match["path"], match["line"] or ""


def _category(stack: list[tuple[str, str, str]]) -> str:
    function, path, _ = stack[-1]
    if path.endswith("selectors.py") and function.endswith("select"):
        return _WAIT
    if path.startswith("asyncio/") or "/asyncio/" in path or path.endswith("socket.py"):
        return _LOOP
    for _, frame_path, _ in reversed(stack):
        for fragment, category in _OWNERS:
            if fragment in frame_path:
                return category
    return "other (stdlib)"


def _py_spy() -> str:
    path = Path(sys.executable).with_name("py-spy")
    found = str(path) if path.exists() else shutil.which("py-spy")
    if found is None:
        msg = "--profile needs py-spy: pip install py-spy"
        raise RuntimeError(msg)
    return found


async def _sampled(
    seconds: int, output: Path, work: Callable[[asyncio.Event], Awaitable[None]]
) -> float:
    """Run ``work(stop)`` while py-spy samples this process; return the seconds it ran."""
    output.parent.mkdir(parents=True, exist_ok=True)
    spy = await asyncio.create_subprocess_exec(
        _py_spy(),
        "record",
        "--pid",
        str(os.getpid()),
        "--rate",
        str(_RATE),
        "--duration",
        str(seconds),
        "--format",
        "raw",
        "--output",
        str(output),
        "--idle",
        "--nonblocking",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    stop = asyncio.Event()

    async def watch() -> bytes:
        _, error = await spy.communicate()
        stop.set()
        return error

    started = time.perf_counter()
    error, _ = await asyncio.gather(watch(), work(stop))
    if spy.returncode != 0:
        msg = f"py-spy failed ({spy.returncode}): {error.decode(errors='replace').strip()}"
        raise RuntimeError(msg)
    return time.perf_counter() - started


def _breakdown(raw: Path, operations: int, seconds: float) -> Results:
    by_category: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if not frames or not count.isdigit():
            continue
        stack = [_parse(frame) for frame in frames.split(";")]
        if stack[0][0].endswith("_bootstrap"):
            continue  # another thread (asyncio's child watcher, an executor): not the loop
        by_category[_category(stack)] += int(count)
        function, path, _ = stack[-1]
        by_function[f"{function} ({path})"] += int(count)
    samples = sum(by_category.values()) or 1
    per_operation = seconds / max(operations, 1) * 1e6  # wall clock per operation

    def shares(counter: Counter[str], top: int | None = None) -> Results:
        return {
            name: {"share": count / samples, "us_per_operation": count / samples * per_operation}
            for name, count in counter.most_common(top)
        }

    return {
        "seconds": seconds,
        "samples": samples,
        "operations": operations,
        "us_per_operation": per_operation,
        "categories": shares(by_category),
        "top_functions": shares(by_function, 15),
        "raw": str(raw),
    }


async def _profile_kiq(bench: scenarios.Bench, *, dedup: bool, seconds: int, raw: Path) -> Results:
    broker = NullBroker()
    if dedup:
        broker = broker.with_middlewares(bench.dedup(bench.prefix("F")))
    kick = await scenarios._started(broker)
    numbers = numbers_from()
    await drive(kick, numbers, 1, 0.2)
    count = 0

    async def work(stop: asyncio.Event) -> None:
        nonlocal count
        while not stop.is_set():
            for _ in range(100):
                await kick(next(numbers))
            count += 100
            await asyncio.sleep(0)  # a kiq on the null broker never yields by itself

    elapsed = await _sampled(seconds, raw, work)
    await broker.shutdown()
    return _breakdown(raw, count, elapsed)


async def _profile_heartbeat(bench: scenarios.Bench, tasks: int, raw: Path) -> Results:
    async def idle(stop: asyncio.Event) -> None:
        await stop.wait()

    middleware = bench.dedup(bench.prefix("G"), default_ttl=scenarios.HEARTBEAT_TTL)
    async with scenarios.held_tasks(middleware, tasks):
        await asyncio.sleep(1.5)
        cpu = time.process_time()
        elapsed = await _sampled(3, raw, idle)
        cpu = time.process_time() - cpu
    ticks = round(elapsed / scenarios.HEARTBEAT_INTERVAL)
    figures = _breakdown(raw, ticks, elapsed)
    figures["cpu_s_per_tick"] = cpu / max(ticks, 1)
    figures["tasks"] = tasks
    return figures


async def send_path(bench: scenarios.Bench, out_dir: Path) -> Results:
    """Profile sequential kiq (with and without the middleware) and a heartbeat tick."""
    return {
        "kiq_with_middleware": await _profile_kiq(
            bench, dedup=True, seconds=3, raw=out_dir / "profile-kiq-dedup.txt"
        ),
        "kiq_without_middleware": await _profile_kiq(
            bench, dedup=False, seconds=2, raw=out_dir / "profile-kiq-none.txt"
        ),
        "heartbeat_10000_tasks_per_tick": await _profile_heartbeat(
            bench, 10_000, out_dir / "profile-heartbeat.txt"
        ),
    }


def describe(profile: Results) -> str:
    """The profiles as text: categories, then the functions with the most self time."""
    lines = [""]
    for name, figures in profile.items():
        if not figures:
            continue
        unit = "tick" if "tick" in name else "kiq"
        lines.append(
            f"## profile: {name} ({figures['operations']:,} {unit}s, "
            f"{figures['samples']:,} samples, {figures['us_per_operation']:.1f} us per {unit})"
        )
        for category, share in figures["categories"].items():
            lines.append(
                f"  {share['share']:6.1%}  {share['us_per_operation']:9.1f} us  {category}"
            )
        lines.append("  top self time:")
        for function, share in list(figures["top_functions"].items())[:10]:
            lines.append(
                f"  {share['share']:6.1%}  {share['us_per_operation']:9.1f} us  {function}"
            )
        lines.append(f"  (stacks: {figures['raw']}, py-spy raw format)")
    return "\n".join(lines) + "\n"
