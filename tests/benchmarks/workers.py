"""The worker benchmark: real ``taskiq worker`` processes on ``ListQueueBroker``.

Two regimes, each with and without the middleware on the same Redis:

- **drain**: ``taskiq worker --workers 2 --max-async-tasks 100`` empties a queue
  of short tasks (1 ms of ``asyncio.sleep``). Three worker pairs (without the
  middleware, with it, and with `worker_app.Floor`, the least any lock
  middleware can cost) run the whole time, each on a queue of its own; a
  round fills a staging list with the sender of one variant, then ``RENAME``s
  it onto that variant's queue at once (Redis wakes the blocked ``BRPOP``) and
  times until the workers have counted every task done. The variants take
  turns, the order reversed every round.
- **held**: one worker process runs many tasks at once that sleep through the
  whole window (TTL 3 s, so the heartbeat's interval is 1 s), heartbeat on and
  off; the worker counts its own round trips (see ``worker_app``), and its CPU
  is read from ``/proc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.benchmarks import worker_app
from tests.benchmarks.harness import median, new_prefix, rates_over

if TYPE_CHECKING:
    from tests.benchmarks.scenarios import Bench

Results = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
_TICKS = os.sysconf("SC_CLK_TCK")
#: The TTL of the held tasks' locks: a heartbeat interval of 1 second.
HELD_TTL = 3
FILL_CALLERS = 64


@dataclass
class _Workers:
    """One ``taskiq worker`` command and the keys it counts into."""

    url: str
    label: str
    processes: int
    max_async: int
    dedup: bool
    floor: bool = False
    ttl: int = 300
    traffic: bool = False
    heartbeat: bool = True
    queue: str = field(init=False)
    key: str = field(init=False)
    prefix: str = field(init=False)
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        """Names unique to this run."""
        self.queue = new_prefix(f"W{self.label}")
        self.key = new_prefix(f"K{self.label}")
        self.prefix = new_prefix(f"X{self.label}")

    def start(self) -> None:
        """Start the worker processes (the command's own process forks them)."""
        env = dict(os.environ)
        env.update(
            BENCH_REDIS_URL=self.url,
            BENCH_QUEUE=self.queue,
            BENCH_KEY=self.key,
            BENCH_PREFIX=self.prefix if self.dedup or self.floor else "",
            BENCH_FLOOR="1" if self.floor else "",
            BENCH_TTL=str(self.ttl),
            BENCH_TRAFFIC="1" if self.traffic else "",
            BENCH_HEARTBEAT="1" if self.heartbeat else "",
            PYTHONPATH=str(ROOT),
        )
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "taskiq",
                "worker",
                "tests.benchmarks.worker_app:broker",
                "--workers",
                str(self.processes),
                "--max-async-tasks",
                str(self.max_async),
                "--log-level",
                "WARNING",
                "--shutdown-timeout",
                "5",
                "--wait-tasks-timeout",
                "2",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        """Stop the command's process by its pid (it stops its workers)."""
        if self.process is None or self.process.poll() is not None:
            return
        children = self.children()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
            for pid in children:  # the ones it started, by pid
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def children(self) -> list[int]:
        """The pids of the worker processes."""
        assert self.process is not None
        pids: list[int] = []
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(pid) for pid in (task / "children").read_text().split()]
        return pids

    def cpu(self) -> float:
        """CPU seconds the worker processes have used (user + system)."""
        total = 0.0
        for pid in self.children():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                total += (int(fields[11]) + int(fields[12])) / _TICKS
        return total

    def sender(self, staging: str) -> Any:
        """The sending side of this variant, onto the list ``staging``."""
        return worker_app.build(
            self.url,
            staging,
            prefix=self.prefix if self.dedup else None,
            key=self.key,
            ttl=self.ttl,
        )


async def _wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            msg = f"the worker benchmark waited {timeout:g}s for {what}"
            raise TimeoutError(msg)
        await asyncio.sleep(0.005)


def _count(bench: Bench, key: str) -> int:
    return int(bench.probe.client.get(key) or 0)


async def _fill(bench: Bench, workers: _Workers, tasks: int, seconds: float) -> tuple[str, float]:
    """Send ``tasks`` tasks onto a new staging list; return its name and the kiq rate."""
    staging = bench.prefix("S")
    broker = workers.sender(staging)
    await broker.startup()
    kiq = broker.find_task("bench_sleep").kiq
    numbers: Iterator[int] = iter(range(tasks))
    started = time.perf_counter()

    async def caller() -> None:
        for n in numbers:
            await kiq(n, seconds)

    try:
        await asyncio.gather(*(caller() for _ in range(FILL_CALLERS)))
    finally:
        await broker.shutdown()
    return staging, tasks / (time.perf_counter() - started)


async def drain(bench: Bench) -> Results:
    """Tasks/s of two worker processes draining a queue of 1 ms tasks: without, with, floor."""
    settings = bench.settings
    tasks = settings.worker_tasks
    variants = {
        name: _Workers(
            bench.url, name[0].upper(), 2, 100, dedup=name == "dedup", floor=name == "floor"
        )
        for name in ("none", "dedup", "floor")
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    kiq_rates: dict[str, list[float]] = {name: [] for name in variants}
    locks_left: list[int] = []
    for workers in variants.values():
        bench.prefixes += [workers.queue, workers.key, workers.prefix]
        workers.start()
    try:
        for name, workers in variants.items():
            await _wait_for(
                lambda w=workers: _count(bench, f"{w.key}:ready") >= w.processes,
                60,
                f"the {name} workers to start",
            )
        order = list(variants)
        for index in range(settings.worker_rounds):
            for name in order if index % 2 == 0 else order[::-1]:
                workers = variants[name]
                staging, kiq_rate = await _fill(bench, workers, tasks, 0.001)
                kiq_rates[name].append(kiq_rate)
                done = f"{workers.key}:done"
                target = _count(bench, done) + tasks
                cpu_before = workers.cpu()
                started = time.perf_counter()
                bench.probe.client.rename(staging, workers.queue)
                await _wait_for(lambda d=done, t=target: _count(bench, d) >= t, 120, "the drain")
                elapsed = time.perf_counter() - started
                rates[name].append(tasks / elapsed)
                cpu[name].append((workers.cpu() - cpu_before) / tasks * 1e6)
                if workers.dedup or workers.floor:
                    await asyncio.sleep(0.05)  # the last releases
                    locks_left.append(bench.probe.count(workers.prefix))
    finally:
        for workers in variants.values():
            workers.stop()
    ratios = [a / b for a, b in zip(rates["dedup"], rates["none"], strict=True)]
    floor = [a / b for a, b in zip(rates["floor"], rates["none"], strict=True)]
    of_floor = [a / b for a, b in zip(rates["dedup"], rates["floor"], strict=True)]
    return {
        "tasks": tasks,
        "processes": 2,
        "max_async_tasks": 100,
        "none_per_s": median(rates["none"]),
        "dedup_per_s": median(rates["dedup"]),
        "ratio": median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "worker_cpu_us_per_task_none": median(cpu["none"]),
        "worker_cpu_us_per_task_dedup": median(cpu["dedup"]),
        "floor_per_s": median(rates["floor"]),
        "floor_ratio": median(floor),
        "floor_ratio_min": min(floor),
        "floor_ratio_max": max(floor),
        "dedup_of_floor": median(of_floor),
        "worker_cpu_us_per_task_floor": median(cpu["floor"]),
        "fill_kiq_per_s_none": median(kiq_rates["none"]),
        "fill_kiq_per_s_dedup": median(kiq_rates["dedup"]),
        "locks_left": max(locks_left) if locks_left else 0,
    }


def _traffic(bench: Bench, workers: _Workers) -> tuple[float, float, float, float]:
    """Summed (round trips, writes, commands, CPU seconds) the workers last published."""
    totals = [0.0, 0.0, 0.0, 0.0]
    for key in bench.probe.client.scan_iter(match=f"{workers.key}:traffic:*"):
        stats = bench.probe.client.hgetall(key)
        for index, name in enumerate(("round_trips", "writes", "commands", "cpu")):
            totals[index] += float(stats.get(name, 0))
    return totals[0], totals[1], totals[2], totals[3]


async def _held_window(bench: Bench, tasks: int, *, beating: bool) -> Results:
    settings = bench.settings
    # Longer than the worker needs to take them all (one BRPOP each) and the
    # window: the worker is stopped after the window, its tasks still running.
    hold = 120.0
    workers = _Workers(
        bench.url, "H", 1, tasks + 100, dedup=True, ttl=HELD_TTL, traffic=True, heartbeat=beating
    )
    bench.prefixes += [workers.queue, workers.key, workers.prefix]
    workers.start()
    try:
        await _wait_for(lambda: _count(bench, f"{workers.key}:ready") >= 1, 60, "the worker")
        staging, _ = await _fill(bench, workers, tasks, hold)
        bench.probe.client.rename(staging, workers.queue)
        await _wait_for(
            lambda: not bench.probe.client.llen(workers.queue), 180, "the tasks to start"
        )
        await asyncio.sleep(settings.heartbeat_settle)
        probe = bench.probe

        def sample() -> tuple[float, ...]:
            return (*_traffic(bench, workers), probe.server_cpu(), probe.script_calls())

        names = ("round_trips", "writes", "commands", "cpu_s", "server_cpu_s", "script_calls")
        figures = await rates_over(settings.heartbeat_window, names, sample)
        locks = probe.count(workers.prefix)
    finally:
        workers.stop()
    return {**figures, "locks_held": locks}


async def held(bench: Bench) -> Results:
    """One worker process running N tasks at once: heartbeat round trips and CPU, on - off."""
    tasks = bench.settings.worker_held_tasks
    off = await _held_window(bench, tasks, beating=False)
    on = await _held_window(bench, tasks, beating=True)
    interval = 1.0
    return {
        "tasks": tasks,
        "on": on,
        "off": off,
        "round_trips_per_interval": (on["round_trips_per_s"] - off["round_trips_per_s"]) * interval,
        "script_calls_per_interval": (on["script_calls_per_s"] - off["script_calls_per_s"])
        * interval,
        "cpu_share_of_core": on["cpu_s_per_s"] - off["cpu_s_per_s"],
        "server_cpu_share_of_core": on["server_cpu_s_per_s"] - off["server_cpu_s_per_s"],
    }


async def workers(bench: Bench) -> Results:
    """Both regimes (a quick run only drains)."""
    figures: Results = {"drain": await drain(bench)}
    if bench.settings.worker_held_tasks:
        figures["held"] = await held(bench)
    return figures
