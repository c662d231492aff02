"""The measurements of issue 5, one coroutine per section of the report.

Every section builds its brokers once, warms them up, then measures the
variants it compares in interleaved rounds (the order flips every round), so a
burst of load from elsewhere on the machine hits all variants alike. Ratios are
the median of the per-round ratios, each taken between runs made moments apart.

Variants:

- ``none``: taskiq without any middleware, on the same broker;
- ``dedup``: the same broker with :class:`RedisDeduplicationMiddleware`;
- ``limit``: the acquire script alone, called as ``script(keys=..., args=...)``
  through a plain ``redis.asyncio`` client: one EVALSHA per call, the floor that
  docs/design.md calls the limit of a sequential send.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from taskiq import AsyncBroker, InMemoryBroker, SimpleRetryMiddleware, TaskiqDepends
from taskiq_redis import ListQueueBroker

from taskiq_deduplication import (
    DuplicateTaskError,
    RedisDeduplicationMiddleware,
    TaskLock,
    kiq_or_join,
)
from tests._brokers import HoldingBroker
from tests.benchmarks.harness import (
    Kick,
    NullBroker,
    Probe,
    Run,
    Traffic,
    drive,
    median,
    new_prefix,
    numbers_from,
    percentile,
    rates_over,
)

#: The library's Lua scripts, as installed.
_LUA = resources.files("taskiq_deduplication").joinpath("store").joinpath("lua")

Results = dict[str, Any]

#: TTL of the locks of the throughput runs: above the 10 s grace TTL, so every
#: accepted send pays for its extension after the send, and short enough that
#: the keys of a long run expire instead of piling up.
SEND_TTL = 15
#: TTL of the heartbeat runs: the interval is a third of it, 1 second.
HEARTBEAT_TTL = 3
HEARTBEAT_INTERVAL = 1.0
#: How many callers start the tasks of a heartbeat run, and fill Redis with locks.
FILL_CALLERS = 64
#: The lock policies of issue 11, each as the labels of its task.
POLICIES: dict[str, dict[str, Any]] = {
    "finished": {},
    "finished+success_ttl": {"deduplication_success_ttl": 60},
    "started": {"deduplication_until": "started"},
    "expired": {"deduplication_until": "expired"},
}


@dataclass(frozen=True)
class Settings:
    """How long and how often to measure."""

    rounds: int
    duration: float
    concurrencies: tuple[int, ...]
    heartbeat_tasks: tuple[int, ...]
    heartbeat_settle: float
    heartbeat_window: float
    memory_locks: int
    round_trip_repeats: int
    lifecycle_duration: float
    overhead_rounds: int
    overhead_calls: int
    worker_tasks: int
    worker_rounds: int
    worker_held_tasks: int

    @classmethod
    def full(cls) -> Settings:
        """About three minutes on two cores."""
        return cls(
            rounds=5,
            duration=0.3,
            concurrencies=(1, 4, 16, 64, 256),
            heartbeat_tasks=(100, 1_000, 10_000),
            heartbeat_settle=1.5,
            heartbeat_window=4.0,
            memory_locks=100_000,
            round_trip_repeats=10,
            lifecycle_duration=0.4,
            overhead_rounds=15,
            overhead_calls=300,
            worker_tasks=20_000,
            worker_rounds=3,
            worker_held_tasks=10_000,
        )

    @classmethod
    def quick(cls) -> Settings:
        """A smoke run: every section, a few seconds."""
        return cls(
            rounds=2,
            duration=0.08,
            concurrencies=(1, 64),
            heartbeat_tasks=(100, 1_000),
            heartbeat_settle=0.3,
            heartbeat_window=1.2,
            memory_locks=5_000,
            round_trip_repeats=2,
            lifecycle_duration=0.1,
            overhead_rounds=2,
            overhead_calls=30,
            worker_tasks=500,
            worker_rounds=1,
            worker_held_tasks=0,  # two more worker starts: left to full runs
        )


@dataclass
class Bench:
    """What every section needs: the server, a probe of it, the counters, the settings."""

    url: str
    probe: Probe
    settings: Settings
    traffic: Traffic = field(default_factory=Traffic)
    prefixes: list[str] = field(default_factory=list)

    def prefix(self, label: str) -> str:
        """A new key prefix, deleted at the end of the run."""
        prefix = new_prefix(label)
        self.prefixes.append(prefix)
        return prefix

    def dedup(self, prefix: str, **options: Any) -> RedisDeduplicationMiddleware:
        """The middleware on the benchmark's Redis."""
        options.setdefault("default_ttl", SEND_TTL)
        return RedisDeduplicationMiddleware(redis_url=self.url, key_prefix=prefix, **options)


async def _noop(n: int) -> int:
    return n


async def _started(
    broker: AsyncBroker,
    name: str = "bench_noop",
    function: Callable[[int], Awaitable[int]] = _noop,
    **labels: Any,
) -> Kick:
    """Register ``function`` (the no-op task) on ``broker``, start it, return its ``kiq``."""
    task = broker.task(task_name=name, **labels)(function)
    await broker.startup()
    return task.kiq


@contextlib.asynccontextmanager
async def _limit(bench: Bench) -> AsyncIterator[Kick]:
    """The acquire script through a plain ``redis.asyncio`` client, one EVALSHA per call."""
    source = (_LUA / "acquire.lua").read_text("utf-8")
    client = Redis.from_pool(BlockingConnectionPool.from_url(bench.url, max_connections=100))
    script = client.register_script(source)
    prefix = bench.prefix("L")
    # As a send takes its lock: with its record ("f": the default policy), unsent.
    value = f"0123456789a/1796000000000/f {'0' * 32}!"

    async def kick(n: int) -> object:
        return await script(keys=[f"{prefix}:{n}"], args=[value, 10_000, ""])

    try:
        yield kick
    finally:
        await client.aclose()


@dataclass
class _Variant:
    name: str
    kick: Kick
    numbers: Iterator[int] = field(default_factory=numbers_from)
    after: Callable[[], object] | None = None
    rates: dict[int, list[float]] = field(default_factory=dict)
    latencies: dict[int, list[float]] = field(default_factory=dict)

    async def measure(self, callers: int, duration: float, *, keep_latencies: bool) -> Run:
        run = await drive(self.kick, self.numbers, callers, duration)
        self.rates.setdefault(callers, []).append(run.rate)
        if keep_latencies:
            self.latencies.setdefault(callers, []).extend(run.latencies)
        if self.after is not None:
            self.after()
        return run


async def _rounds(
    variants: list[_Variant],
    concurrencies: tuple[int, ...],
    settings: Settings,
    *,
    latency_at: tuple[int, ...] = (),
) -> None:
    """Measure every variant at every concurrency, ``settings.rounds`` times, interleaved."""
    for variant in variants:  # warm up: connections, script cache, first-call costs
        await drive(variant.kick, variant.numbers, 4, min(0.05, settings.duration))
    for index in range(settings.rounds):
        order = variants if index % 2 == 0 else variants[::-1]
        for callers in concurrencies:
            for variant in order:
                await variant.measure(
                    callers, settings.duration, keep_latencies=callers in latency_at
                )


def _paired_ratio(top: list[float], bottom: list[float]) -> float:
    return median([a / b for a, b in zip(top, bottom, strict=True) if b > 0])


# 1 and 7: the send path, and the latency it adds


async def send_path(bench: Bench) -> tuple[Results, Results]:
    """Kiq/s on the null broker and ``ListQueueBroker``, with and without the middleware.

    Returns:
        The send-path figures and the latency figures (p50, p99 per kiq).
    """
    settings = bench.settings
    brokers: list[AsyncBroker] = []
    null_none = NullBroker()
    null_dedup = NullBroker().with_middlewares(bench.dedup(bench.prefix("N")))
    queues = [bench.prefix("Q") for _ in range(2)]
    list_none = ListQueueBroker(bench.url, queue_name=queues[0])
    list_dedup = ListQueueBroker(bench.url, queue_name=queues[1]).with_middlewares(
        bench.dedup(bench.prefix("D"))
    )
    brokers += [null_none, null_dedup, list_none, list_dedup]

    def drop_queue(name: str) -> Callable[[], object]:
        return lambda: bench.probe.client.unlink(name)

    async with _limit(bench) as limit_kick:
        variants = {
            "null.none": _Variant("null.none", await _started(null_none)),
            "null.dedup": _Variant("null.dedup", await _started(null_dedup)),
            "limit": _Variant("limit", limit_kick),
            "list_queue.none": _Variant(
                "list_queue.none", await _started(list_none), after=drop_queue(queues[0])
            ),
            "list_queue.dedup": _Variant(
                "list_queue.dedup", await _started(list_dedup), after=drop_queue(queues[1])
            ),
        }
        try:
            await _rounds(
                list(variants.values()),
                settings.concurrencies,
                settings,
                latency_at=(1, 64),
            )
        finally:
            for broker in brokers:
                await broker.shutdown()
            for queue in queues:
                bench.probe.client.unlink(queue)

    send: Results = {"null": {}, "list_queue": {}}
    latency: Results = {"null": {}, "list_queue": {}}
    limit = variants["limit"]
    for callers in settings.concurrencies:
        limit_rates = limit.rates[callers]
        for broker_name in ("null", "list_queue"):
            none = variants[f"{broker_name}.none"]
            dedup = variants[f"{broker_name}.dedup"]
            # The best a middleware of one round trip could do: its cost added to the broker's.
            ideal = [
                1 / (1 / a + 1 / b) for a, b in zip(none.rates[callers], limit_rates, strict=True)
            ]
            send[broker_name][str(callers)] = {
                "none_per_s": median(none.rates[callers]),
                "dedup_per_s": median(dedup.rates[callers]),
                "limit_per_s": median(limit_rates),
                "ratio": _paired_ratio(dedup.rates[callers], none.rates[callers]),
                "ratio_to_limit": _paired_ratio(dedup.rates[callers], limit_rates),
                "ratio_to_ideal": _paired_ratio(dedup.rates[callers], ideal),
            }
            if callers in none.latencies:
                latency[broker_name][str(callers)] = _latency(
                    none.latencies[callers], dedup.latencies[callers]
                )
    if 1 in limit.latencies:
        latency["limit"] = {
            "p50_us": percentile(limit.latencies[1], 0.5) * 1e6,
            "p99_us": percentile(limit.latencies[1], 0.99) * 1e6,
        }
    return send, latency


def _latency(none: list[float], dedup: list[float]) -> Results:
    figures: Results = {}
    for name, fraction in (("p50", 0.5), ("p99", 0.99)):
        without, with_ = percentile(none, fraction) * 1e6, percentile(dedup, fraction) * 1e6
        figures[f"none_{name}_us"] = without
        figures[f"dedup_{name}_us"] = with_
        figures[f"added_{name}_us"] = with_ - without
    return figures


# 2: rejected duplicates


async def rejected(bench: Bench) -> Results:
    """Rejected duplicates per second, next to an accepted kiq without middleware."""
    settings = bench.settings
    null_none = NullBroker()
    null_dedup = NullBroker().with_middlewares(bench.dedup(bench.prefix("R"), default_ttl=300))
    outcome = {"rejected": 0, "accepted": 0}
    kiq = await _started(null_dedup)
    await kiq(-1)  # the holder: the null broker never runs it, so the lock stays

    async def duplicate(_: int) -> None:
        try:
            await kiq(-1)
        except DuplicateTaskError:
            outcome["rejected"] += 1
        else:
            outcome["accepted"] += 1

    concurrencies = tuple(c for c in (1, 64) if c in settings.concurrencies)
    async with _limit(bench) as limit_kick:
        variants = [
            _Variant("dedup", duplicate),
            _Variant("none", await _started(null_none)),
            _Variant("limit", limit_kick),
        ]
        try:
            await _rounds(variants, concurrencies, settings)
        finally:
            await null_dedup.shutdown()
            await null_none.shutdown()
    dedup, none, limit = variants
    figures: Results = {
        str(callers): {
            "rejected_per_s": median(dedup.rates[callers]),
            "none_kiq_per_s": median(none.rates[callers]),
            "limit_per_s": median(limit.rates[callers]),
            "ratio": _paired_ratio(dedup.rates[callers], none.rates[callers]),
            "ratio_to_limit": _paired_ratio(dedup.rates[callers], limit.rates[callers]),
        }
        for callers in concurrencies
    }
    figures["accepted_by_mistake"] = outcome["accepted"]
    return figures


# 3: the full life cycle on InMemoryBroker


async def lifecycle(bench: Bench) -> Results:
    """Tasks per second sent, run and released on ``InMemoryBroker``."""
    settings = bench.settings
    prefixes = {policy: bench.prefix("C") for policy in POLICIES}
    none = InMemoryBroker()
    concurrencies = tuple(c for c in (1, 64) if c in settings.concurrencies)
    variants = [(none, _Variant("none", await _started(none)))]
    for policy, labels in POLICIES.items():  # "finished", the default, first
        dedup = InMemoryBroker().with_middlewares(bench.dedup(prefixes[policy]))
        kick = await _started(dedup, f"bench_{policy}", **labels)
        variants.append((dedup, _Variant(policy, kick)))
    try:
        for broker, variant in variants:
            await drive(variant.kick, variant.numbers, 4, 0.05)
            await broker.wait_all()
        for index in range(settings.rounds):
            for callers in concurrencies:
                for broker, variant in variants if index % 2 == 0 else variants[::-1]:
                    start = time.perf_counter()
                    run = await drive(
                        variant.kick, variant.numbers, callers, settings.lifecycle_duration
                    )
                    await broker.wait_all()
                    rate = run.count / (time.perf_counter() - start)
                    variant.rates.setdefault(callers, []).append(rate)
    finally:
        for broker, _ in variants:
            await broker.shutdown()
    (_, without), (_, with_) = variants[:2]
    figures: Results = {}
    for callers in concurrencies:
        row: Results = {
            "none_per_s": median(without.rates[callers]),
            "dedup_per_s": median(with_.rates[callers]),
            "ratio": _paired_ratio(with_.rates[callers], without.rates[callers]),
        }
        for _, variant in variants[1:]:
            row[f"{variant.name}_per_s"] = median(variant.rates[callers])
            row[f"{variant.name}_ratio"] = _paired_ratio(
                variant.rates[callers], without.rates[callers]
            )
        figures[str(callers)] = row
    # The policies that end the lock with the run (or at its start) leave nothing behind.
    figures["locks_left"] = sum(bench.probe.count(prefixes[p]) for p in ("finished", "started"))
    return figures


# 5: round trips per task life cycle


@dataclass
class _Count:
    critical: list[int] = field(default_factory=list)
    critical_writes: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)
    commands: list[int] = field(default_factory=list)
    server_scripts: list[int] = field(default_factory=list)

    def figures(self) -> Results:
        return {
            "critical_path_round_trips": median([float(v) for v in self.critical]),
            "critical_path_writes": median([float(v) for v in self.critical_writes]),
            "round_trips": median([float(v) for v in self.total]),
            "writes": median([float(v) for v in self.writes]),
            "round_trips_max": float(max(self.total)),
            "commands": median([float(v) for v in self.commands]),
            "server_script_calls": median([float(v) for v in self.server_scripts]),
        }


async def _wait_idle(broker: InMemoryBroker) -> None:
    while broker._running_tasks:  # a retry adds a task while wait_all awaits the first
        await broker.wait_all()
        await asyncio.sleep(0)  # lets the done callbacks empty the set


async def round_trips(bench: Bench) -> Results:  # noqa: PLR0915 (every path, one section)
    """Client round trips per task life cycle, each task alone (nothing to batch with)."""
    traffic = bench.traffic
    attempts: dict[int, int] = {}
    gate = asyncio.Event()

    async def fail(n: int) -> None:
        msg = f"task {n} fails"
        raise RuntimeError(msg)

    async def flaky(n: int) -> int:
        attempts[n] = attempts.get(n, 0) + 1
        if attempts[n] == 1:
            msg = f"first attempt of task {n} fails"
            raise RuntimeError(msg)
        return n

    async def hold(n: int) -> int:
        await gate.wait()
        return n

    broker = InMemoryBroker().with_middlewares(
        bench.dedup(bench.prefix("T")), SimpleRetryMiddleware(default_retry_count=2)
    )
    kicks: dict[str, Kick] = {
        "succeeded": broker.task(task_name="bench_ok")(_noop).kiq,
        **{
            f"succeeded_{policy}": broker.task(task_name=f"bench_ok_{policy}", **labels)(_noop).kiq
            for policy, labels in POLICIES.items()
            if labels
        },
        # Runs that may overlap (issue 19): what exclusivity costs each policy.
        **{
            f"succeeded_{policy}_shared": broker.task(
                task_name=f"bench_ok_{policy}_shared", deduplication_exclusive=False, **labels
            )(_noop).kiq
            for policy, labels in POLICIES.items()
        },
        "failed": broker.task(task_name="bench_fail")(fail).kiq,
        "retried_once": broker.task(task_name="bench_flaky", retry_on_error=True, max_retries=2)(
            flaky
        ).kiq,
    }

    async def fenced(n: int, lock: TaskLock = TaskiqDepends()) -> int:
        assert lock.fence is not None
        return n

    kicks["succeeded_with_a_fence"] = broker.task(task_name="bench_fenced")(fenced).kiq
    holder_task = broker.task(task_name="bench_hold")(hold)
    holder = holder_task.kiq
    queue = HoldingBroker().with_middlewares(bench.dedup(bench.prefix("Q")))
    merging = queue.task(
        task_name="bench_merge", deduplication_key_fields=["n"], deduplication_merge="latest"
    )(_merge).kiq
    await broker.startup()
    await queue.startup()
    counts = {name: _Count() for name in (*kicks, "rejected", "joined", "merged")}
    numbers = numbers_from()

    async def finish() -> None:
        await _wait_idle(broker)

    traffic.install()
    try:
        for kick in kicks.values():  # warm up each path once
            await kick(next(numbers))
        await finish()
        for _ in range(bench.settings.round_trip_repeats):
            for name, kick in kicks.items():
                await _count(bench, counts[name], functools.partial(kick, next(numbers)), finish)
            n = next(numbers)
            gate.clear()
            await holder(n)
            await _count(bench, counts["rejected"], functools.partial(_refused, holder, n), None)
            await _count(bench, counts["joined"], functools.partial(_joined, holder_task, n), None)
            gate.set()
            await finish()
            n = next(numbers)
            await merging(n, 1)  # queued, not run
            await _count(bench, counts["merged"], functools.partial(_merged, merging, n), None)
            await queue.deliver()
        figures: Results = {name: count.figures() for name, count in counts.items()}
        figures["under_load_64_callers"] = await _round_trips_under_load(bench, broker)
    finally:
        traffic.uninstall()
        gate.set()
        await broker.shutdown()
        await queue.shutdown()
    return figures


async def _merge(n: int, version: int) -> int:
    return n + version


async def _joined(task: Any, n: int) -> None:
    if not (await kiq_or_join(task, n)).joined:
        msg = "the call was sent, not joined"
        raise AssertionError(msg)


async def _merged(kick: Any, n: int) -> None:
    try:
        await kick(n, 2)  # merged into the queued holder: no refusal
    except DuplicateTaskError as exc:
        msg = "the duplicate's arguments were not merged"
        raise AssertionError(msg) from exc


async def _refused(kick: Kick, n: int) -> None:
    try:
        await kick(n)
    except DuplicateTaskError:
        return
    msg = "the duplicate was accepted"
    raise AssertionError(msg)


async def _count(
    bench: Bench,
    count: _Count,
    send: Callable[[], Awaitable[object]],
    finish: Callable[[], Awaitable[None]] | None,
) -> None:
    """Count what one send and the run it starts cost, once nothing else is in flight."""
    traffic = bench.traffic
    await traffic.settle()
    scripts_before = bench.probe.script_calls()
    round_trips_before, writes_before, commands_before = traffic.snapshot()
    await send()
    count.critical.append(traffic.round_trips - round_trips_before)
    count.critical_writes.append(traffic.writes - writes_before)
    if finish is not None:
        await finish()
    await traffic.settle()
    count.total.append(traffic.round_trips - round_trips_before)
    count.writes.append(traffic.writes - writes_before)
    count.commands.append(traffic.commands - commands_before)
    count.server_scripts.append(bench.probe.script_calls() - scripts_before)


async def _round_trips_under_load(bench: Bench, broker: InMemoryBroker) -> Results:
    """Round trips per task when 64 callers send at once: what batching saves."""
    kick = broker.task(task_name="bench_load")(_noop).kiq
    traffic = bench.traffic
    await traffic.settle()
    scripts_before = bench.probe.script_calls()
    round_trips_before, writes_before, commands_before = traffic.snapshot()
    run = await drive(kick, numbers_from(), 64, bench.settings.lifecycle_duration)
    await _wait_idle(broker)
    await traffic.settle()
    tasks = max(run.count, 1)
    return {
        "tasks": run.count,
        "round_trips_per_task": (traffic.round_trips - round_trips_before) / tasks,
        "writes_per_task": (traffic.writes - writes_before) / tasks,
        "commands_per_task": (traffic.commands - commands_before) / tasks,
        "server_script_calls_per_task": (bench.probe.script_calls() - scripts_before) / tasks,
    }


# 4: the heartbeat


async def heartbeat(bench: Bench) -> Results:
    """Round trips and CPU per second while N tasks run, heartbeat on and off."""
    settings = bench.settings
    figures: Results = {}
    bench.traffic.install()
    try:
        for tasks in settings.heartbeat_tasks:
            off = await _heartbeat_window(bench, tasks, beating=False)
            on = await _heartbeat_window(bench, tasks, beating=True)
            figures[str(tasks)] = {
                "on": on,
                "off": off,
                "interval_s": HEARTBEAT_INTERVAL,
                "round_trips_per_interval": on["round_trips_per_s"] * HEARTBEAT_INTERVAL,
                "script_calls_per_interval": on["script_calls_per_s"] * HEARTBEAT_INTERVAL,
                "cpu_share_of_core": on["cpu_s_per_s"] - off["cpu_s_per_s"],
                "server_cpu_share_of_core": on["server_cpu_s_per_s"] - off["server_cpu_s_per_s"],
            }
    finally:
        bench.traffic.uninstall()
    return figures


@contextlib.asynccontextmanager
async def held_tasks(middleware: RedisDeduplicationMiddleware, tasks: int) -> AsyncIterator[None]:
    """Inside, ``tasks`` distinct calls of a task that waits all run behind ``middleware``.

    ``FILL_CALLERS`` callers send them on an ``InMemoryBroker``; on the way out the
    tasks end and the broker shuts down.
    """
    gate, all_running = asyncio.Event(), asyncio.Event()
    running = 0

    async def hold(n: int) -> int:
        nonlocal running
        running += 1
        if running == tasks:
            all_running.set()
        await gate.wait()
        return n

    broker = InMemoryBroker().with_middlewares(middleware)
    kiq = broker.task(task_name="bench_hold")(hold).kiq
    await broker.startup()
    numbers = iter(range(tasks))

    async def caller() -> None:
        for n in numbers:
            await kiq(n)

    try:
        await asyncio.gather(*(caller() for _ in range(FILL_CALLERS)))
        await all_running.wait()
        yield
    finally:
        gate.set()
        await broker.wait_all()
        await broker.shutdown()


async def _heartbeat_window(bench: Bench, tasks: int, *, beating: bool) -> Results:
    settings = bench.settings
    middleware = bench.dedup(bench.prefix("H"), default_ttl=HEARTBEAT_TTL, heartbeat=beating)
    async with held_tasks(middleware, tasks):
        await asyncio.sleep(settings.heartbeat_settle)
        probe, traffic = bench.probe, bench.traffic

        def sample() -> tuple[float, ...]:
            snapshot = traffic.snapshot()
            return (time.process_time(), *snapshot, probe.server_cpu(), probe.script_calls())

        names = ("cpu_s", "round_trips", "writes", "commands", "server_cpu_s", "script_calls")
        return await rates_over(settings.heartbeat_window, names, sample)


# 6: Redis memory per held lock


async def memory(bench: Bench) -> Results:
    """``used_memory`` delta over many held locks, made by real sends on the null broker."""
    locks = bench.settings.memory_locks
    prefix = bench.prefix("M")
    probe = bench.probe
    broker = NullBroker().with_middlewares(bench.dedup(prefix, default_ttl=300))
    kiq = await _started(broker)
    numbers = iter(range(locks))

    async def caller() -> None:
        for n in numbers:
            await kiq(n)

    before_keys = int(probe.client.dbsize())
    before = probe.used_memory()
    await asyncio.gather(*(caller() for _ in range(FILL_CALLERS)))
    await broker.shutdown()  # sends the last extensions to the full TTL
    after = probe.used_memory()
    held = int(probe.client.dbsize()) - before_keys
    sample = list(itertools.islice(probe.client.scan_iter(match=f"{prefix}*"), 20))
    usage = [int(probe.client.memory_usage(key, samples=0) or 0) for key in sample]
    key_length = len(sample[0]) if sample else 0
    value_length = len(probe.client.get(sample[0]) or "") if sample else 0
    probe.delete(prefix)
    released = probe.used_memory()
    return {
        "locks": locks,
        "locks_held": held,
        "used_memory_delta": after - before,
        "bytes_per_lock": (after - before) / max(held, 1),
        "memory_usage_command_bytes": median([float(u) for u in usage]),
        "key_bytes": key_length,
        "value_bytes": value_length,
        "bytes_freed_per_lock": (after - released) / max(held, 1),
    }


# The limit, in more shapes than the send path needs


async def limit(bench: Bench) -> Results:
    """One EVALSHA through ``redis.asyncio``: sequential, 64 callers, pipelines of 100."""
    settings = bench.settings
    client = Redis.from_url(bench.url)
    source = (_LUA / "acquire.lua").read_text("utf-8")
    script = client.register_script(source)
    prefix = bench.prefix("P")
    args: list[str | int] = [f"0123456789a/1796000000000/f {'0' * 32}!", 10_000, ""]

    async def pipeline(n: int) -> object:
        pipe = client.pipeline(transaction=False)
        for i in range(100):
            pipe.evalsha(script.sha, 1, f"{prefix}:{n}:{i}", *args)
        return await pipe.execute()

    try:
        await script(keys=[f"{prefix}:warm"], args=args)
        async with _limit(bench) as single:
            variants = [_Variant("evalsha", single), _Variant("pipeline", pipeline)]
            await _rounds(variants, (1,), settings)
    finally:
        await client.aclose()
    evalsha, pipelines = variants
    return {
        "evalsha_sequential_per_s": median(evalsha.rates[1]),
        "evalsha_sequential_us": 1e6 / median(evalsha.rates[1]),
        "pipeline_100_calls_per_s": median(pipelines.rates[1]) * 100,
    }


# 8: what a sequential kiq and a sequential life cycle add, in round trips


async def _fail(n: int) -> int:
    msg = f"task {n} fails"
    raise RuntimeError(msg)


def _pinnings(bench: Bench) -> dict[str, set[int]]:
    """The client's CPU sets: the server's core and another, when the server is pinned here.

    The benchmark's own server is pinned to the first core when it starts. A
    server elsewhere, or not pinned to one core, gets no pinning: the client
    runs as it is.
    """
    cores = os.sched_getaffinity(0)
    try:
        pid = int(bench.probe.info("server")["process_id"])
        server = os.sched_getaffinity(pid)
    except (OSError, KeyError, ValueError):
        return {"unpinned": cores}
    if len(server) != 1 or len(cores) < 2:
        return {"unpinned": cores}
    (core,) = server
    other = min(cores - server) if cores - server else core
    return {"same_core": {core}, "other_core": {other}}


async def overhead(bench: Bench) -> Results:  # noqa: C901 (variants, pinnings, rounds)
    """Sequential kiq and life cycle: the time the middleware adds, in bare EVALSHAs.

    Variants, each ``overhead_calls`` sequential calls per round, interleaved
    with the order flipping every round, and every round once per pinning of
    this process (on the server's core, on another core):

    - ``limit``: one bare EVALSHA of the acquire script through redis.asyncio;
    - ``null.none`` / ``null.dedup``: ``kiq`` on the null broker;
    - ``life.none`` / ``life.<policy>``: ``kiq`` on ``InMemoryBroker(await_inplace=True)``,
      which runs the task inside ``kiq``: send, run, end of the lock, in one call;
      ``life.failed`` is a task that raises, under the default policy.

    Each figure is the median over the rounds of ``(with - without) / limit``,
    per-call times taken moments apart in the same round.
    """
    settings = bench.settings
    kicks: dict[str, Kick] = {}
    brokers: list[AsyncBroker] = []

    async def add(name: str, broker: AsyncBroker, task: Callable[..., Any], **labels: Any) -> None:
        brokers.append(broker)
        kicks[name] = await _started(broker, f"bench_{name}", task, **labels)

    await add("null.none", NullBroker(), _noop)
    await add("null.dedup", NullBroker().with_middlewares(bench.dedup(bench.prefix("O"))), _noop)
    await add("life.none", InMemoryBroker(await_inplace=True), _noop)
    await add("life.none_failed", InMemoryBroker(await_inplace=True), _fail)
    for policy, labels in POLICIES.items():
        inplace = InMemoryBroker(await_inplace=True)
        await add(
            f"life.{policy}",
            inplace.with_middlewares(bench.dedup(bench.prefix("I"))),
            _noop,
            **labels,
        )
    inplace = InMemoryBroker(await_inplace=True)
    await add("life.failed", inplace.with_middlewares(bench.dedup(bench.prefix("J"))), _fail)
    pinnings = _pinnings(bench)
    times: dict[str, dict[str, list[float]]] = {pin: {} for pin in pinnings}
    original = os.sched_getaffinity(0)
    numbers = numbers_from()
    clock = time.perf_counter
    async with _limit(bench) as limit_kick:
        kicks["limit"] = limit_kick
        names = list(kicks)
        try:
            for index in range(settings.overhead_rounds):
                for pin, cores in pinnings.items():
                    os.sched_setaffinity(0, cores)
                    for name in names if index % 2 == 0 else names[::-1]:
                        kick = kicks[name]
                        if index == 0:  # warm up on this core
                            for _ in range(20):
                                await kick(next(numbers))
                        gc.collect()
                        started = clock()
                        for _ in range(settings.overhead_calls):
                            await kick(next(numbers))
                        elapsed = clock() - started
                        times[pin].setdefault(name, []).append(
                            elapsed / settings.overhead_calls * 1e6
                        )
        finally:
            os.sched_setaffinity(0, original)
            for broker in brokers:
                await broker.shutdown()
    figures: Results = {}
    for pin, by_name in times.items():
        limit_us = by_name["limit"]

        def added(
            name: str,
            base: str,
            by_name: dict[str, list[float]] = by_name,
            limit_us: list[float] = limit_us,
        ) -> float:
            pairs = zip(by_name[name], by_name[base], limit_us, strict=True)
            return median([(a - b) / c for a, b, c in pairs])

        row: Results = {
            "evalsha_us": median(limit_us),
            "null_none_us": median(by_name["null.none"]),
            "null_dedup_us": median(by_name["null.dedup"]),
            "kiq_added_round_trips": added("null.dedup", "null.none"),
            "life_none_us": median(by_name["life.none"]),
        }
        for policy in (*POLICIES, "failed"):
            base = "life.none_failed" if policy == "failed" else "life.none"
            row[f"life_{policy}_us"] = median(by_name[f"life.{policy}"])
            row[f"life_{policy}_per_s"] = 1e6 / median(by_name[f"life.{policy}"])
            row[f"life_{policy}_added_round_trips"] = added(f"life.{policy}", base)
        figures[pin] = row
    return figures


# 10: what each script costs Redis itself, and how many a task runs, by path

#: The paths the scripts section measures, each a task's labels (``None``: a
#: duplicate, refused), on an in-process broker that runs each task inside kiq().
SCRIPT_PATHS: dict[str, dict[str, Any] | None] = {
    "success": {},
    "failure": {},
    "duplicate": None,
    "not_exclusive": {"deduplication_exclusive": False},
    "started": {"deduplication_until": "started"},
    "expired": {"deduplication_until": "expired"},
    "merge": {"deduplication_merge": "latest", "deduplication_key_fields": ["n"]},
}


def _script_names() -> dict[str, str]:
    """Each of the library's scripts by the SHA1 Redis knows it by."""
    folder = _LUA
    return {
        hashlib.sha1(entry.read_bytes()).hexdigest(): entry.name.removesuffix(".lua")  # noqa: S324 (Redis' own digest)
        for entry in folder.iterdir()
        if entry.name.endswith(".lua")
    }


def _scripts_run(entries: list[dict[str, Any]], names: dict[str, str]) -> dict[str, int]:
    """How many times each script ran, from SLOWLOG entries."""
    counts: dict[str, int] = {}
    for entry in entries:
        words = entry["command"].split()
        if words and words[0].upper() == b"EVALSHA" and len(words) > 1:
            name = names.get(words[1].decode(), "other")
            counts[name] = counts.get(name, 0) + 1
    return counts


async def scripts(bench: Bench) -> Results:
    """Redis's own time in scripts per task and per call, and which scripts, path by path.

    The time is ``INFO commandstats``' for ``EVALSHA`` (the commands a script
    makes included); which scripts ran comes from a second pass with every
    command in the SLOWLOG (whose own cost would inflate the time). Each task
    runs alone, so nothing is batched; the paths run in turn, ``calls`` tasks each.
    """
    calls = max(bench.settings.round_trip_repeats * 20, 40)
    admin = Redis.from_url(bench.url)
    names = _script_names()
    config = await admin.config_get("slowlog-*")
    threshold, length = str(config["slowlog-log-slower-than"]), str(config["slowlog-max-len"])
    broker = InMemoryBroker(await_inplace=True).with_middlewares(bench.dedup(bench.prefix("S")))
    kicks: dict[str, Kick] = {}
    for path, labels in SCRIPT_PATHS.items():
        if labels is None:
            continue
        function = _fail if path == "failure" else _noop
        kicks[path] = broker.task(task_name=f"bench_script_{path}", **labels)(function).kiq
    holding = HoldingBroker().with_middlewares(bench.dedup(bench.prefix("SD")))
    holder = holding.task(task_name="bench_script_held")(_noop).kiq
    await broker.startup()
    await holding.startup()
    numbers = numbers_from()
    figures: Results = {}
    try:
        await holder(-1)  # held, never run: every later call of it is refused

        async def take(path: str, times: int) -> None:
            for _ in range(times):
                if path == "duplicate":
                    with contextlib.suppress(DuplicateTaskError):
                        await holder(-1)
                else:
                    await kicks[path](next(numbers))

        for path in SCRIPT_PATHS:
            await take(path, 20)  # warm: the scripts and the paths' code
            # The time: INFO commandstats, nothing else logged.
            await admin.config_resetstat()
            await take(path, calls)
            await asyncio.sleep(0.01)  # the last extension, written ahead, lands
            stats = (await admin.info("commandstats")).get("cmdstat_evalsha", {})
            # Which scripts: the SLOWLOG, every command logged (which slows them).
            await admin.config_set("slowlog-log-slower-than", 0)
            await admin.config_set("slowlog-max-len", 50 * calls + 1000)
            await admin.slowlog_reset()
            await take(path, calls)
            await asyncio.sleep(0.01)
            await admin.config_set("slowlog-log-slower-than", threshold)
            counts = _scripts_run(await admin.slowlog_get(50 * calls + 1000), names)
            figures[path] = {
                "scripts_per_task": stats.get("calls", 0) / calls,
                "us_per_task": stats.get("usec", 0) / calls,
                "us_per_call": stats.get("usec_per_call", 0.0),
                **{name: {"calls_per_task": n / calls} for name, n in sorted(counts.items())},
            }
    finally:
        await admin.config_set("slowlog-log-slower-than", threshold)
        await admin.config_set("slowlog-max-len", length)
        await admin.slowlog_reset()
        await admin.aclose()
        await broker.shutdown()
        await holding.shutdown()
    return figures
