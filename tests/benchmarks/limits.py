"""Keyed flow control (issue 34): limited runs beside the same runs unlimited.

``python -m tests.benchmarks --only limits``. Four parts, each comparing the
same task with and without ``limit_concurrency=2, limit_key_fields=["key"]``
(one limit per value of ``key``), under the middleware's default policy:

- **drain**: two ``taskiq worker --workers 2 --max-async-tasks 100`` commands
  on ``ListQueueBroker`` (this module's `broker`), one for the unlimited task
  and one for the limited task, run the whole time, each on its own queue. A
  round fills a staging list with 20,000 tasks (key from 100 and sleep of 1 to
  5 ms drawn from the round's seed, the same for every variant),
  ``RENAME``s it onto the queue and times the drain. The variants (unlimited,
  limited, and limited with the keys folded onto 10) take turns, the order
  flipped every round. Tasks/s, worker CPU per task (``/proc``), Redis CPU,
  commands and read events per task (``INFO``, every client), runs sent back
  to the broker, and, from the start and end each run's body records, the
  time from one release to the next start: for each run that waited for its
  slot (the middleware's ``WAITED`` event, subscribed to in both variants
  alike), from the latest end of a run of the same key before its start.
- **round_trips**: each task alone on ``InMemoryBroker``, its send and run
  counted by the benchmark's ``Traffic`` (client round trips, writes,
  commands) and ``INFO commandstats`` (scripts and Redis's time in them).
- **overhead**: a sequential life cycle (``InMemoryBroker(await_inplace=True)``),
  limited and not, the time the limit adds in units of one bare ``EVALSHA``,
  with this process on redis-server's core and on the other.
- **memory**: ``limit.lua`` called as the middleware calls it, on thousands of
  limits: ``used_memory`` per limit with its two slots held, per run that
  waits in line, and once every run freed its slot; ``MEMORY USAGE`` of each
  of a limit's keys in each state.

The worker processes import this module (``taskiq worker
tests.benchmarks.limits:broker``) and build `broker` from ``BENCH_LIMITS_*``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import redis
from redis.asyncio import Redis
from taskiq import AsyncBroker, InMemoryBroker, TaskiqMessage, TaskiqMiddleware, TaskiqResult
from taskiq_redis import ListQueueBroker

from taskiq_deduplication import LockEvent, LockEventKind, RedisDeduplicationMiddleware
from taskiq_deduplication.model.formats import new_token
from taskiq_deduplication.model.limits import limit_keys, read_limit
from taskiq_deduplication.run.limits import DEFAULT_LEASE
from tests.benchmarks.harness import median, percentile
from tests.benchmarks.workers import ROOT, _wait_for, _Workers

if TYPE_CHECKING:
    from tests.benchmarks.scenarios import Bench

Results = dict[str, Any]

#: The shape the issue asks for: 100 keys, at most 2 runs of each at once.
KEYS = 100
CONCURRENCY = 2
LIMIT_LABELS: dict[str, Any] = {"limit_concurrency": CONCURRENCY, "limit_key_fields": ["key"]}
#: Each task sleeps from 1 to 5 ms.
SLEEP_S = (0.001, 0.005)
PROCESSES = 2
MAX_ASYNC = 100
FILL_CALLERS = 64
#: Seconds between two flushes of a worker's records.
FLUSH_INTERVAL = 0.01
TASK_NAMES = {"unlimited": "bench_limits_free", "limited": "bench_limits_limited"}
#: The drain's variants: which task (and worker pair), over how many keys. The
#: third crowds the same tasks onto 10 keys, so that most runs wait for a slot
#: and the release to the next start has samples enough.
HOT_KEYS = 10
VARIANTS = {
    "unlimited": ("unlimited", KEYS),
    "limited": ("limited", KEYS),
    "limited_10_keys": ("limited", HOT_KEYS),
}
#: What the drain reads of ``INFO commandstats``, per task: the commands a
#: worker sends (BRPOP, EVALSHA, LPUSH of a run sent back, the wake-ups'
#: SUBSCRIBE and UNSUBSCRIBE) and the ones ``limit.lua`` runs inside (PUBLISH).
DRAIN_COMMANDS = ("brpop", "evalsha", "lpush", "subscribe", "unsubscribe", "publish")


# The worker side: this module is the application of `taskiq worker`.

#: The start and end (``time.monotonic_ns``, one clock for every process) of
#: each body that ran, by its call number, until ``post_execute`` takes them.
_SPANS: dict[int, tuple[int, int]] = {}


async def _sleep(n: int, seconds: float) -> None:
    started = time.monotonic_ns()
    await asyncio.sleep(seconds)
    _SPANS[n] = (started, time.monotonic_ns())


class Recorder(TaskiqMiddleware):
    """Each run that ran its body: its key, start, end, and how long it waited for its slot.

    Flushed with one pipeline every 10 ms into ``<key>:records`` (JSON lists)
    and ``<key>:done``, over a synchronous client; runs sent back to the
    broker are counted into ``<key>:requeued``. ``<key>:ready`` says a worker
    process started.
    """

    def __init__(self, url: str, key: str) -> None:
        """Record into the keys under ``key`` on the Redis at ``url``."""
        super().__init__()
        self._url, self._key = url, key
        self._records: list[tuple[int, int, int, int]] = []
        self._waited: dict[str, float] = {}
        self._requeued = 0
        self._flusher: asyncio.Task[None] | None = None

    def on_event(self, event: LockEvent) -> None:
        """Note a run that waited for its limit, or went back to the broker."""
        if event.kind is LockEventKind.WAITED:
            self._waited[event.task_id] = event.waited or 0.0
        elif event.kind is LockEventKind.LIMITED and event.requeued:
            self._requeued += 1

    async def startup(self) -> None:
        """In a worker process: start flushing, then say the process is ready."""
        if self.broker.is_worker_process:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def shutdown(self) -> None:
        """Stop flushing."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher

    def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """Record the run, if its body ran (a run sent back to the broker ran none)."""
        span = _SPANS.pop(message.kwargs["n"], None)
        waited = self._waited.pop(message.task_id, None)
        if span is not None:
            waited_us = -1 if waited is None else round(waited * 1e6)
            self._records.append((message.kwargs["key"], span[0], span[1], waited_us))

    async def _flush(self) -> None:
        client = redis.Redis.from_url(self._url)  # synchronous: outside the event loop's I/O
        client.incr(f"{self._key}:ready")
        try:
            while True:
                await asyncio.sleep(FLUSH_INTERVAL)
                if not self._records and not self._requeued:
                    continue
                records, self._records = self._records, []
                requeued, self._requeued = self._requeued, 0
                pipe = client.pipeline(transaction=False)
                if records:
                    pipe.rpush(f"{self._key}:records", json.dumps(records))
                    pipe.incrby(f"{self._key}:done", len(records))
                if requeued:
                    pipe.incrby(f"{self._key}:requeued", requeued)
                pipe.execute()
        finally:
            client.close()


def build(url: str, queue: str, *, prefix: str, key: str) -> AsyncBroker:
    """The broker on ``queue`` with the middleware under ``prefix``, and both tasks."""
    middleware = RedisDeduplicationMiddleware(url, key_prefix=prefix, default_ttl=300)
    recorder = Recorder(url, key)
    middleware.subscribe(recorder.on_event)
    # No socket timeout: see worker_app.build (taskiq-redis issue 127).
    broker = ListQueueBroker(url, queue_name=queue, socket_timeout=None).with_middlewares(
        middleware, recorder
    )

    @broker.task(task_name=TASK_NAMES["unlimited"])
    async def unlimited(n: int, key: int, seconds: float) -> None:
        await _sleep(n, seconds)

    @broker.task(task_name=TASK_NAMES["limited"], **LIMIT_LABELS)
    async def limited(n: int, key: int, seconds: float) -> None:
        await _sleep(n, seconds)

    return broker


def _from_environment() -> AsyncBroker | None:
    if "BENCH_LIMITS_QUEUE" not in os.environ:
        return None
    return build(
        os.environ["BENCH_LIMITS_URL"],
        os.environ["BENCH_LIMITS_QUEUE"],
        prefix=os.environ["BENCH_LIMITS_PREFIX"],
        key=os.environ["BENCH_LIMITS_KEY"],
    )


broker = _from_environment()


# The benchmark's side.


@dataclass
class _Pair(_Workers):
    """The worker processes of one task (unlimited or limited), running this module's `broker`."""

    def start(self) -> None:
        """Start ``taskiq worker`` (its own process forks the workers)."""
        env = dict(os.environ)
        env.update(
            BENCH_LIMITS_URL=self.url,
            BENCH_LIMITS_QUEUE=self.queue,
            BENCH_LIMITS_KEY=self.key,
            BENCH_LIMITS_PREFIX=self.prefix,
            # The tree of this module first; a PYTHONPATH given (another checkout's
            # src/, to measure it) after it, so the workers import what this process does.
            PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        )
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "taskiq",
                "worker",
                "tests.benchmarks.limits:broker",
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


def _plan(seed: int, tasks: int) -> list[tuple[int, float]]:
    """The key and the sleep of each task of a round, the same for every variant."""
    draw = random.Random(seed)
    return [(draw.randrange(KEYS), draw.uniform(*SLEEP_S)) for _ in range(tasks)]


async def _fill(
    bench: Bench, pair: _Pair, name: str, first: int, plan: list[tuple[int, float]]
) -> tuple[str, float]:
    """Send the round's tasks onto a new staging list; its name and the kiq rate."""
    staging = bench.prefix("S")
    sender = build(bench.url, staging, prefix=pair.prefix, key=pair.key)
    await sender.startup()
    task = sender.find_task(TASK_NAMES[name])
    assert task is not None
    kiq = task.kiq
    calls: Iterator[int] = iter(range(len(plan)))
    started = time.perf_counter()

    async def caller() -> None:
        for i in calls:
            key, seconds = plan[i]
            await kiq(n=first + i, key=key, seconds=seconds)

    try:
        await asyncio.gather(*(caller() for _ in range(FILL_CALLERS)))
    finally:
        await sender.shutdown()
    return staging, len(plan) / (time.perf_counter() - started)


def _number(client: redis.Redis, key: str) -> int:
    return int(client.get(key) or 0)


def _commands(bench: Bench) -> dict[str, tuple[int, int]]:
    """``INFO commandstats``: (calls, usec) of each command, every client's."""
    stats = bench.probe.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(row.get("calls", 0)), int(row.get("usec", 0)))
        for name, row in stats.items()
    }


def _delta(before: Results, after: Results, name: str) -> int:
    return int(after.get(name, 0)) - int(before.get(name, 0))


def _records(client: redis.Redis, key: str) -> list[tuple[int, int, int, int]]:
    chunks = client.lrange(f"{key}:records", 0, -1)
    client.delete(f"{key}:records")
    return [tuple(record) for chunk in chunks for record in json.loads(chunk)]


def _handovers(records: list[tuple[int, int, int, int]]) -> Results:
    """Release to next start, waits, and the most runs of one key at once, from the records."""
    by_key: dict[int, list[tuple[int, int, int, int]]] = {}
    for record in records:
        by_key.setdefault(record[0], []).append(record)
    gaps: list[float] = []
    waits: list[float] = []
    peak = 0
    for runs in by_key.values():
        ends = sorted(end for _, _, end, _ in runs)
        for _, start, _, waited_us in runs:
            if waited_us < 0:
                continue
            waits.append(waited_us)
            before = bisect.bisect_right(ends, start)
            if before:
                gaps.append((start - ends[before - 1]) / 1e3)
        # At equal times an end comes before a start (-1 sorts first).
        moments = sorted([(s, 1) for _, s, _, _ in runs] + [(e, -1) for _, _, e, _ in runs])
        running = 0
        for _, step in moments:
            running += step
            peak = max(peak, running)
    return {
        "waited_share": len(waits) / len(records) if records else 0.0,
        "release_to_start_p50_us": percentile(gaps, 0.5),
        "release_to_start_p99_us": percentile(gaps, 0.99),
        "release_to_start_max_us": max(gaps) if gaps else float("nan"),
        "waited_p50_us": percentile(waits, 0.5),
        "waited_p99_us": percentile(waits, 0.99),
        "waited_max_us": max(waits) if waits else float("nan"),
        # A handover is one publish and one wake-up away: a wait past a second
        # is one whose wake-up was lost, found by the lease refresh (a third of the lease).
        "waits_over_1s": sum(1 for wait in waits if wait > 1e6),
        "peak_runs_of_a_key": peak,
    }


async def _drain_round(
    bench: Bench, pair: _Pair, name: str, first: int, plan: list[tuple[int, float]]
) -> Results:
    client = bench.probe.client
    staging, kiq_rate = await _fill(bench, pair, name, first, plan)
    tasks = len(plan)
    target = _number(client, f"{pair.key}:done") + tasks
    requeued_before = _number(client, f"{pair.key}:requeued")
    commands_before, server_before = _commands(bench), bench.probe.server_cpu()
    stats_before = bench.probe.info("stats")
    cpu_before = pair.cpu()
    started = time.perf_counter()
    client.rename(staging, pair.queue)
    await _wait_for(lambda: _number(client, f"{pair.key}:done") >= target, 300, f"the {name} drain")
    elapsed = time.perf_counter() - started
    cpu = pair.cpu() - cpu_before
    server = bench.probe.server_cpu() - server_before
    commands_after = _commands(bench)
    stats_after = bench.probe.info("stats")
    records = _records(client, pair.key)
    per_task = {
        command: (commands_after.get(command, (0, 0))[0] - commands_before.get(command, (0, 0))[0])
        / tasks
        for command in DRAIN_COMMANDS
    }
    in_redis = {
        command: (calls - commands_before.get(command, (0, 0))[0]) / tasks
        for command, (calls, _) in commands_after.items()
        if calls > commands_before.get(command, (0, 0))[0]
    }
    evalsha_us = (
        commands_after.get("evalsha", (0, 0))[1] - commands_before.get("evalsha", (0, 0))[1]
    )
    return {
        "per_s": tasks / elapsed,
        "worker_cpu_us_per_task": cpu / tasks * 1e6,
        "redis_cpu_us_per_task": server / tasks * 1e6,
        "evalsha_us_per_task": evalsha_us / tasks,
        # Each a read event in Redis: a client's write (a batch, a BRPOP, a poll).
        "redis_read_events_per_task": _delta(stats_before, stats_after, "total_reads_processed")
        / tasks,
        "redis_input_bytes_per_task": _delta(stats_before, stats_after, "total_net_input_bytes")
        / tasks,
        "commands_per_task": per_task,
        # Every client's, the probe's and the records' included; scripts' own commands too.
        "all_commands_per_task": in_redis,
        "requeued_per_task": (_number(client, f"{pair.key}:requeued") - requeued_before) / tasks,
        "records": len(records),
        "fill_kiq_per_s": kiq_rate,
        **_handovers(records),
    }


async def drain(bench: Bench) -> Results:
    """Two worker processes draining short tasks over 100 keys: limited and unlimited."""
    settings = bench.settings
    tasks, rounds = settings.worker_tasks, settings.worker_rounds
    pairs = {
        name: _Pair(bench.url, name[0].upper(), PROCESSES, MAX_ASYNC, dedup=True)
        for name in TASK_NAMES
    }
    found: dict[str, list[Results]] = {name: [] for name in VARIANTS}
    for pair in pairs.values():
        bench.prefixes += [pair.queue, pair.key, pair.prefix]
        pair.start()
    try:
        for name, pair in pairs.items():
            await _wait_for(
                lambda p=pair: _number(bench.probe.client, f"{p.key}:ready") >= p.processes,
                60,
                f"the {name} workers to start",
            )
        names = list(VARIANTS)
        for index in range(rounds):
            plan = _plan(index, tasks)
            for number, name in enumerate(names):
                if index % 2:
                    name = names[-1 - number]  # noqa: PLW2901 (the order flipped)
                task, keys = VARIANTS[name]
                first = (index * len(names) + names.index(name)) * tasks
                found[name].append(
                    await _drain_round(
                        bench, pairs[task], task, first, [(k % keys, s) for k, s in plan]
                    )
                )
    finally:
        for pair in pairs.values():
            pair.stop()
    figures: Results = {
        "tasks": tasks,
        "keys": KEYS,
        "hot_keys": HOT_KEYS,
        "concurrency": CONCURRENCY,
        "processes": PROCESSES,
        "max_async_tasks": MAX_ASYNC,
        "rounds": rounds,
    }
    for name, rows in found.items():
        figures[name] = _medians(rows)
    figures["each_round"] = found  # a list: kept in the JSON, left out of the summary
    ratios = [
        limited["per_s"] / unlimited["per_s"]
        for limited, unlimited in zip(found["limited"], found["unlimited"], strict=True)
    ]
    cpu = [
        limited["worker_cpu_us_per_task"] - unlimited["worker_cpu_us_per_task"]
        for limited, unlimited in zip(found["limited"], found["unlimited"], strict=True)
    ]
    figures["ratio"] = median(ratios)
    figures["ratio_min"] = min(ratios)
    figures["ratio_max"] = max(ratios)
    figures["worker_cpu_us_added"] = median(cpu)
    hot = [
        crowded["per_s"] / unlimited["per_s"]
        for crowded, unlimited in zip(found["limited_10_keys"], found["unlimited"], strict=True)
    ]
    figures["ratio_10_keys"] = median(hot)
    figures["ratio_10_keys_min"] = min(hot)
    figures["ratio_10_keys_max"] = max(hot)
    return figures


def _medians(rows: list[Results]) -> Results:
    """The median of each figure over the rounds (nested dicts alike; missing counts as 0)."""
    keys = dict.fromkeys(key for row in rows for key in row)
    out: Results = {}
    for key in keys:
        if any(isinstance(row.get(key), dict) for row in rows):
            out[key] = _medians([row.get(key, {}) for row in rows])
        else:
            out[key] = median([float(row.get(key, 0)) for row in rows])
    return out


# Round trips and commands per task, each task alone.


async def round_trips(bench: Bench) -> Results:
    """Client round trips and commands, scripts and their Redis time, per task alone."""
    from tests.benchmarks.scenarios import _Count, _count, _wait_idle  # noqa: PLC0415 (not in the worker processes)

    broker = InMemoryBroker().with_middlewares(bench.dedup(bench.prefix("RT")))

    async def noop(n: int, key: int) -> int:
        return n

    tasks = {
        "unlimited": broker.task(task_name="bench_rt_unlimited")(noop),
        "limited": broker.task(task_name="bench_rt_limited", **LIMIT_LABELS)(noop),
        "limited_no_dedup": broker.task(
            task_name="bench_rt_limited_nodedup", deduplication=False, **LIMIT_LABELS
        )(noop),
        "unlimited_no_dedup": broker.task(task_name="bench_rt_free", deduplication=False)(noop),
    }
    await broker.startup()
    counts = {name: _Count() for name in tasks}
    evalsha_us: dict[str, list[float]] = {name: [] for name in tasks}
    numbers = iter(range(10**9))

    async def finish() -> None:
        await _wait_idle(broker)

    traffic = bench.traffic
    traffic.install()
    try:
        for task in tasks.values():  # warm up each path once
            n = next(numbers)
            await task.kiq(n=n, key=n % KEYS)
        await finish()
        for _ in range(max(bench.settings.round_trip_repeats * 5, 10)):
            for name, task in tasks.items():
                n = next(numbers)
                await traffic.settle()
                before = _commands(bench).get("evalsha", (0, 0))[1]
                send = functools.partial(task.kiq, n=n, key=n % KEYS)
                await _count(bench, counts[name], send, finish)
                evalsha_us[name].append(_commands(bench).get("evalsha", (0, 0))[1] - before)
    finally:
        traffic.uninstall()
        await broker.shutdown()
    return {
        name: {**count.figures(), "evalsha_us": median(evalsha_us[name])}
        for name, count in counts.items()
    }


# The time a limit adds to a sequential life cycle.


async def overhead(bench: Bench) -> Results:  # noqa: C901 (variants, pinnings, rounds)
    """A sequential life cycle, limited and not: the time added, in bare EVALSHAs."""
    from tests.benchmarks.scenarios import _limit, _pinnings  # noqa: PLC0415 (not in the worker processes)

    settings = bench.settings
    broker = InMemoryBroker(await_inplace=True).with_middlewares(bench.dedup(bench.prefix("LO")))

    async def noop(n: int, key: int) -> int:
        return n

    unlimited = broker.task(task_name="bench_life_unlimited")(noop).kiq
    limited = broker.task(task_name="bench_life_limited", **LIMIT_LABELS)(noop).kiq
    await broker.startup()
    numbers = iter(range(10**9))

    async def life_unlimited(n: int) -> object:
        return await unlimited(n=n, key=n % KEYS)

    async def life_limited(n: int) -> object:
        return await limited(n=n, key=n % KEYS)

    pinnings = _pinnings(bench)
    times: dict[str, dict[str, list[float]]] = {pin: {} for pin in pinnings}
    original = os.sched_getaffinity(0)
    async with _limit(bench) as bare:
        kicks = {"evalsha": bare, "unlimited": life_unlimited, "limited": life_limited}
        names = list(kicks)
        try:
            for index in range(settings.overhead_rounds):
                for pin, cores in pinnings.items():
                    os.sched_setaffinity(0, cores)
                    for name in names if index % 2 == 0 else names[::-1]:
                        kick = kicks[name]
                        if index == 0:
                            for _ in range(20):
                                await kick(next(numbers))
                        started = time.perf_counter()
                        for _ in range(settings.overhead_calls):
                            await kick(next(numbers))
                        elapsed = time.perf_counter() - started
                        times[pin].setdefault(name, []).append(
                            elapsed / settings.overhead_calls * 1e6
                        )
        finally:
            os.sched_setaffinity(0, original)
            await broker.shutdown()
    figures: Results = {}
    for pin, by_name in times.items():
        added = [
            (lim - unl) / unit
            for lim, unl, unit in zip(
                by_name["limited"], by_name["unlimited"], by_name["evalsha"], strict=True
            )
        ]
        figures[pin] = {
            "evalsha_us": median(by_name["evalsha"]),
            "unlimited_us": median(by_name["unlimited"]),
            "limited_us": median(by_name["limited"]),
            "added_us": median(by_name["limited"]) - median(by_name["unlimited"]),
            "added_evalshas": median(added),
        }
    return figures


# Redis memory per limit.

_LIMIT_LUA = (
    resources.files("taskiq_deduplication").joinpath("store").joinpath("lua").joinpath("limit.lua")
)


async def memory(bench: Bench) -> Results:
    """``used_memory`` and ``MEMORY USAGE`` per limit: busy, per waiter, and after."""
    count = max(bench.settings.memory_locks // 10, 100)
    prefix = bench.prefix("LM")
    rule = read_limit(LIMIT_LABELS)
    assert rule is not None
    lease_ms = DEFAULT_LEASE * 1000
    client = Redis.from_url(bench.url)
    script = client.register_script(_LIMIT_LUA.read_text("utf-8"))
    limits = []
    for key in range(count):
        message = TaskiqMessage(
            task_id="", task_name=TASK_NAMES["limited"], labels={}, args=[], kwargs={"key": key}
        )
        limits.append(limit_keys(prefix, rule.name_of(message)))
    runs = [[(uuid.uuid4().hex, new_token()) for _ in range(CONCURRENCY + 2)] for _ in limits]

    async def call(op: str, which: range) -> list[Any]:
        replies: list[Any] = []
        for start in range(0, count, 500):
            async with client.pipeline(transaction=False) as pipe:
                for keys, run in zip(
                    limits[start : start + 500], runs[start : start + 500], strict=True
                ):
                    for index in which:
                        task_id, token = run[index]
                        args: list[Any] = [op, task_id, token]
                        if op == "take":
                            args += [CONCURRENCY, lease_ms, 0, 0, ""]
                        await script(keys=keys.all, args=args, client=pipe)
                replies += await pipe.execute()
        return replies

    def usage(keys: Any) -> dict[str, int]:
        names = ("holders", "tokens", "waiting", "leases", "meta")
        return {
            name: int(bench.probe.client.memory_usage(key) or 0)
            for name, key in zip(names, keys.all, strict=True)
        }

    probe = bench.probe

    def used() -> int:
        # Without the clients' buffers: a pipeline's query buffer outlives it for a while.
        info = probe.info("memory")
        return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))

    try:
        await script(keys=limits[0].all, args=["keep", lease_ms])  # loaded, and Lua warm
        before = used()
        taken = await call("take", range(CONCURRENCY))
        assert all(int(reply[0]) == 1 for reply in taken), "a take of a free limit waited"
        busy = used()
        busy_usage = usage(limits[0])
        waited = await call("take", range(CONCURRENCY, CONCURRENCY + 2))
        assert all(int(reply[0]) == 2 for reply in waited), "a take over the limit did not wait"
        queued = used()
        queued_usage = usage(limits[0])
        # In order: each holder's free hands its slot to a waiter, whose free follows.
        await call("free", range(CONCURRENCY + 2))
        after = used()
        after_usage = usage(limits[0])
        left = sum(1 for keys in limits[:100] for key in keys.all if probe.client.exists(key))
        ttl_ms = int(probe.client.pttl(limits[0].meta))
    finally:
        await client.aclose()
    return {
        "limits": count,
        "bytes_per_busy_limit": (busy - before) / count,
        "bytes_per_waiter": (queued - busy) / count / 2,
        "bytes_per_idle_limit": (after - before) / count,
        "memory_usage_busy": busy_usage,
        "memory_usage_with_2_waiting": queued_usage,
        "memory_usage_idle": after_usage,
        "keys_left_per_idle_limit": left / min(count, 100),
        "idle_ttl_s": ttl_ms / 1000,
    }


async def limits(bench: Bench) -> Results:
    """Every part (memory first, on a keyspace the drains have not filled)."""
    return {
        "memory": await memory(bench),
        "round_trips": await round_trips(bench),
        "overhead": await overhead(bench),
        "drain": await drain(bench),
    }
