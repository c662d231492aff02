"""The measuring tools the scenarios share: callers, counters, brokers, a Redis probe.

Nothing in here knows about a particular scenario. The pieces:

- :func:`drive` runs ``callers`` concurrent loops of one kick for a while and
  times every call;
- :class:`Traffic` counts the round trips and commands that redis-py's asyncio
  connections send, by wrapping ``send_packed_command`` and ``pack_command`` while
  it is installed (and only then, so that throughput runs pay nothing for it);
- :class:`Probe` is a *synchronous* client (a different connection class, so
  never counted) that reads ``INFO`` and deletes the benchmark's keys;
- :class:`NullBroker` is a broker whose ``kick`` does nothing.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import statistics
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.asyncio.connection import AbstractConnection
from taskiq import AsyncBroker, BrokerMessage

from taskiq_deduplication.store.wire import connection as _redis_wire

Kick = Callable[[int], Awaitable[object]]
"""Send call number ``n`` (distinct numbers make distinct fingerprints)."""


class NullBroker(AsyncBroker):
    """A broker whose ``kick`` drops the message: only the send path itself is left."""

    async def kick(self, message: BrokerMessage) -> None:
        """Drop the message."""

    def listen(self) -> AsyncGenerator[bytes, None]:
        """Nothing to listen to."""
        msg = "the null broker never delivers"
        raise RuntimeError(msg)


def quiet_logging() -> None:
    """Create log records as usual but write them nowhere.

    A rejected duplicate logs a warning and a failed task an error; without a
    handler Python would print each one to stderr. A ``NullHandler`` on the root
    logger keeps the cost of making the record and drops the I/O, which depends
    on the application's handlers, not on this library.
    """
    root = logging.getLogger()
    if not any(isinstance(handler, logging.NullHandler) for handler in root.handlers):
        root.addHandler(logging.NullHandler())


def new_prefix(label: str = "") -> str:
    """A key prefix of 20 characters, as long as the default ``taskiq:deduplication``.

    The key length decides the memory a lock takes, so the benchmark's keys are
    as long as a default deployment's, yet unique to this run.
    """
    head = f"bm{label}:"
    return head + uuid.uuid4().hex[: 20 - len(head)]


@dataclass
class Run:
    """What one timed stretch of calls did."""

    count: int
    elapsed: float
    latencies: list[float] = field(repr=False)

    @property
    def rate(self) -> float:
        """Calls per second."""
        return self.count / self.elapsed if self.elapsed > 0 else 0.0


async def drive(kick: Kick, numbers: Iterator[int], callers: int, duration: float) -> Run:
    """Run ``callers`` loops that each kick call after call for ``duration`` seconds.

    Every call's latency is recorded (``perf_counter`` around the ``await``). The
    elapsed time runs until the last call in flight at the deadline returns.
    """
    latencies: list[float] = []
    record = latencies.append
    clock = time.perf_counter
    # Collect first: a collection longer than a quick run's duration would
    # otherwise leave no time for a single call (a rate of 0).
    gc.collect()
    deadline = clock() + duration

    async def caller() -> None:
        while True:
            started = clock()
            if started >= deadline:
                return
            await kick(next(numbers))
            record(clock() - started)

    start = clock()
    if callers == 1:
        await caller()
    else:
        await asyncio.gather(*(caller() for _ in range(callers)))
    return Run(len(latencies), clock() - start, latencies)


def numbers_from(start: int = 0) -> Iterator[int]:
    """Call numbers, never repeated within a run."""
    return itertools.count(start)


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``values`` (nearest rank)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))
    return ordered[index]


def median(values: list[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else float("nan")


async def rates_over(
    seconds: float, names: tuple[str, ...], sample: Callable[[], tuple[float, ...]]
) -> dict[str, float]:
    """Take ``sample()``, the figures ``names``, before and after waiting ``seconds``.

    Returns:
        ``"seconds"``, the wall time between the two samples, and for each
        ``name``, ``"<name>_per_s"``: how fast that figure grew over it.
    """
    started, before = time.perf_counter(), sample()
    await asyncio.sleep(seconds)
    wall, after = time.perf_counter() - started, sample()
    rates = zip(names, after, before, strict=True)
    return {"seconds": wall} | {f"{name}_per_s": (a - b) / wall for name, a, b in rates}


class Traffic:
    """Counts what redis-py's asyncio connections send, while installed.

    - a *write* is one ``send_packed_command`` call, or one write the lock
      pipeline puts on the socket itself (``_redis_wire._write_at_once``): one or
      many commands put on the socket at once;
    - a *round trip* is a wait for the server: the first ``read_response`` on a
      connection after it wrote (or the lock pipeline's own read of a batch's
      replies, ``_Connection._read_lean``). A plain command, a redis-py pipeline and one batch
      of the middleware's lock pipeline are one round trip each; a command written
      ahead without waiting (its reply read with the next batch) is a write but
      adds no round trip;
    - a *command* is one ``pack_command`` call, or one command the lock pipeline
      packs itself (``_redis_wire._pack``): one EVALSHA, LPUSH, ... as the
      client sends it; what a Lua script runs inside Redis is not counted.
    """

    def __init__(self) -> None:
        """Start with zero counts, not installed."""
        self.round_trips = 0
        self.writes = 0
        self.commands = 0
        self._written: set[int] = set()  # connections that wrote since their last read
        self._saved: tuple[Any, ...] | None = None

    def install(self) -> None:  # noqa: C901 (one wrapper per counted method)
        """Wrap the connection class's methods (idempotent)."""
        if self._saved is not None:
            return
        send, pack = AbstractConnection.send_packed_command, AbstractConnection.pack_command
        read = AbstractConnection.read_response
        write_at_once, pipeline_pack = _redis_wire._write_at_once, _redis_wire._pack
        read_lean = _redis_wire._Connection._read_lean
        self._saved = (send, pack, read, write_at_once, pipeline_pack, read_lean)
        traffic = self

        def pipeline_write(connection: AbstractConnection, packed: list[bytes]) -> bool:
            written = write_at_once(connection, packed)
            if written:
                traffic.writes += 1
                traffic._written.add(id(connection))
            return written

        async def send_packed_command(
            connection: AbstractConnection, command: Any, check_health: bool = True
        ) -> None:
            traffic.writes += 1
            traffic._written.add(id(connection))
            await send(connection, command, check_health)

        async def read_response(connection: AbstractConnection, *args: Any, **kwargs: Any) -> Any:
            if id(connection) in traffic._written:
                traffic._written.discard(id(connection))
                traffic.round_trips += 1
            return await read(connection, *args, **kwargs)

        async def pipeline_read(
            self: _redis_wire._Connection, connection: AbstractConnection, replies: list[Any]
        ) -> None:
            if id(connection) in traffic._written:
                traffic._written.discard(id(connection))
                traffic.round_trips += 1
            await read_lean(self, connection, replies)

        def pack_lock_calls(connection: AbstractConnection, commands: list[Any]) -> list[bytes]:
            traffic.commands += len(commands)
            return pipeline_pack(connection, commands)

        def pack_command(connection: AbstractConnection, *args: Any) -> list[bytes]:
            traffic.commands += 1
            return pack(connection, *args)

        AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign,assignment]
        AbstractConnection.pack_command = pack_command  # type: ignore[method-assign,assignment]
        AbstractConnection.read_response = read_response  # type: ignore[method-assign,assignment]
        _redis_wire._write_at_once = pipeline_write
        _redis_wire._pack = pack_lock_calls
        _redis_wire._Connection._read_lean = pipeline_read  # type: ignore[method-assign]

    def uninstall(self) -> None:
        """Put redis-py's own methods back."""
        if self._saved is None:
            return
        send, pack, read, write_at_once, pipeline_pack, read_lean = self._saved
        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        AbstractConnection.pack_command = pack  # type: ignore[method-assign]
        AbstractConnection.read_response = read  # type: ignore[method-assign]
        _redis_wire._write_at_once = write_at_once
        _redis_wire._pack = pipeline_pack
        _redis_wire._Connection._read_lean = read_lean  # type: ignore[method-assign]
        self._saved = None

    def snapshot(self) -> tuple[int, int, int]:
        """The counts so far: (round trips, writes, commands)."""
        return self.round_trips, self.writes, self.commands

    async def settle(self, quiet: float = 0.05, timeout: float = 2.0) -> None:
        """Wait until nothing has been sent for ``quiet`` seconds (detached calls landed)."""
        deadline = time.monotonic() + timeout
        last = self.snapshot()
        while time.monotonic() < deadline:
            await asyncio.sleep(quiet)
            now = self.snapshot()
            if now == last:
                return
            last = now


class Probe:
    """A synchronous client for looking at the server; its traffic is never counted."""

    def __init__(self, url: str) -> None:
        """Connect lazily to ``url``."""
        self.client = redis.Redis.from_url(url, decode_responses=True)

    def close(self) -> None:
        """Close the connection."""
        self.client.close()

    def info(self, section: str) -> dict[str, Any]:
        """One section of ``INFO``."""
        return dict(self.client.info(section))

    def server_version(self) -> str:
        """``redis_version`` (and Valkey's own version, if it is Valkey)."""
        info = self.info("server")
        version = str(info.get("redis_version", "?"))
        if "valkey_version" in info:
            return f"valkey {info['valkey_version']} (redis_version {version})"
        return f"redis {version}"

    def used_memory(self) -> int:
        """``used_memory`` in bytes."""
        return int(self.info("memory")["used_memory"])

    def server_cpu(self) -> float:
        """CPU seconds the server process has used (user + system)."""
        info = self.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def script_calls(self) -> int:
        """EVALSHA and EVAL commands the server has run so far (every client)."""
        stats = self.info("commandstats")
        return sum(
            int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval")
        )

    def count(self, prefix: str) -> int:
        """How many keys start with ``prefix``."""
        return sum(1 for _ in self.client.scan_iter(match=f"{prefix}*", count=5000))

    def delete(self, prefix: str) -> int:
        """Delete every key that starts with ``prefix``; return how many."""
        deleted = 0
        batch: list[str] = []
        for key in self.client.scan_iter(match=f"{prefix}*", count=5000):
            batch.append(key)
            if len(batch) >= 5000:
                deleted += int(self.client.unlink(*batch))
                batch.clear()
        if batch:
            deleted += int(self.client.unlink(*batch))
        return deleted
