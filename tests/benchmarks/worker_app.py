"""The application that the worker benchmark runs in real ``taskiq worker`` processes.

``taskiq worker tests.benchmarks.worker_app:broker`` builds its broker from the
environment (``BENCH_*``, set by :mod:`tests.benchmarks.workers`); the
benchmark's own process builds the sending side with :func:`build`.

With ``BENCH_FLOOR`` set, the workers run `Floor` instead of the middleware:
the least any lock middleware can cost a worker, the reference the drain's
figures are read against.

Every worker process counts the tasks it finished and adds the count to a Redis
key every 10 ms, so the benchmark sees when a queue is drained without one
Redis command per task. With ``BENCH_TRAFFIC`` set, a worker also counts its
own round trips to Redis (the benchmark's ``Traffic`` counter) and publishes
them with the same flush, over a synchronous client that is never counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from taskiq import AsyncBroker, TaskiqMessage, TaskiqMiddleware, TaskiqResult
from taskiq_redis import ListQueueBroker

from taskiq_deduplication import RedisDeduplicationMiddleware
from tests.benchmarks.harness import Traffic

#: Seconds between two flushes of a worker's counts.
FLUSH_INTERVAL = 0.01


class Finished(TaskiqMiddleware):
    """Counts finished tasks into ``<key>:done`` and says ``<key>:ready`` at startup."""

    def __init__(self, url: str, key: str, *, traffic: bool) -> None:
        """Count into the keys under ``key`` on the Redis at ``url``."""
        super().__init__()
        self._url, self._key, self._count_traffic = url, key, traffic
        self._finished = 0
        self._flusher: asyncio.Task[None] | None = None
        self._traffic = Traffic()

    async def startup(self) -> None:
        """In a worker process: start flushing, then say the process is ready."""
        if not self.broker.is_worker_process:
            return
        if self._count_traffic:
            self._traffic.install()
        self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def shutdown(self) -> None:
        """Stop flushing."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher

    def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """Count one finished task."""
        self._finished += 1

    async def _flush(self) -> None:
        client = redis.Redis.from_url(self._url)  # synchronous: never counted as traffic
        pid = str(os.getpid())
        client.incr(f"{self._key}:ready")
        try:
            while True:
                await asyncio.sleep(FLUSH_INTERVAL)
                if self._finished:
                    finished, self._finished = self._finished, 0
                    client.incrby(f"{self._key}:done", finished)
                if self._count_traffic:
                    trips, writes, commands = self._traffic.snapshot()
                    client.hset(
                        f"{self._key}:traffic:{pid}",
                        mapping={
                            "round_trips": trips,
                            "writes": writes,
                            "commands": commands,
                            "cpu": time.process_time(),
                            "at": time.time(),
                        },
                    )
        finally:
            client.close()


# The floor's two scripts: as much work in Redis as a run's claim and finish
# (a read and a write of the lock at each end), nothing more.
_FLOOR_START = (
    "local v = redis.call('GET', KEYS[1]) if v and v ~= ARGV[1] then return 0 end "
    "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1"
)
_FLOOR_END = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


class Floor(TaskiqMiddleware):
    """The least a lock middleware can cost a worker: one awaited script at each end of a run.

    No fingerprint, labels, policies, heartbeat, timeouts or metrics: the
    run's task_id is its key. Its calls go over one raw asyncio connection,
    packed by hand, and those made while a batch is on the wire go together
    in the next one. Any lock middleware that waits for Redis before and
    after each run pays at least this; the drain's ratio for it bounds what
    the real middleware's ratio can reach on the same machine.
    """

    def __init__(self, url: str, prefix: str) -> None:
        """Lock under ``prefix`` on the Redis at ``url``."""
        super().__init__()
        self._url, self._prefix = url, prefix
        self._queue: list[tuple[bytes, asyncio.Future[int]]] = []
        self._sending = False
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._sha: dict[str, bytes] = {}

    async def startup(self) -> None:
        """In a worker process: connect and load the two scripts."""
        if not self.broker.is_worker_process:
            return
        parts = urlsplit(self._url)
        self._reader, self._writer = await asyncio.open_connection(
            parts.hostname or "127.0.0.1", parts.port or 6379
        )
        if parts.password:
            user = [unquote(parts.username)] if parts.username else []
            await self._command("AUTH", *user, unquote(parts.password))
        database = parts.path.strip("/")
        if database and database != "0":
            await self._command("SELECT", database)
        for name, body in (("start", _FLOOR_START), ("end", _FLOOR_END)):
            self._sha[name] = await self._command("SCRIPT", "LOAD", body)

    async def shutdown(self) -> None:
        """Close the connection."""
        if self._writer is not None:
            self._writer.close()

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Take the run's lock."""
        await self._call("start", message.task_id, b"%d" % 300_000)
        return message

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """Free it."""
        await self._call("end", message.task_id)

    async def _command(self, *args: str) -> bytes:
        """One command alone, at startup; its reply's line (a bulk reply's data)."""
        assert self._reader is not None
        assert self._writer is not None
        self._writer.write(_pack([arg.encode() for arg in args]))
        line = await self._reader.readline()
        if line.startswith(b"-"):
            raise RuntimeError(line.decode().strip())
        if line.startswith(b"$"):
            line = await self._reader.readline()
        return line.strip()

    async def _call(self, script: str, task_id: str, *args: bytes) -> int:
        key, value = f"{self._prefix}{task_id}".encode(), task_id.encode()
        packed = _pack([b"EVALSHA", self._sha[script], b"1", key, value, *args])
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._queue.append((packed, future))
        if not self._sending:
            self._sending = True
            asyncio.get_running_loop().create_task(self._send())
        return await future

    async def _send(self) -> None:
        assert self._reader is not None
        assert self._writer is not None
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                self._writer.write(b"".join(packed for packed, _ in batch))
                for _, future in batch:
                    line = await self._reader.readline()
                    if line.startswith(b":"):
                        future.set_result(int(line[1:]))
                    else:
                        future.set_exception(RuntimeError(line.decode().strip()))
        finally:
            self._sending = False


def _pack(parts: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def build(
    url: str,
    queue: str,
    *,
    prefix: str | None,
    key: str,
    traffic: bool = False,
    ttl: int = 300,
    heartbeat: bool = True,
    floor: bool = False,
) -> AsyncBroker:
    """The broker on ``queue``: with `Floor` if ``floor``, else the middleware if ``prefix``."""
    middlewares: list[TaskiqMiddleware] = []
    if floor:
        middlewares.append(Floor(url, prefix or "floor:"))
    elif prefix is not None:
        middlewares.append(
            RedisDeduplicationMiddleware(
                url, key_prefix=prefix, default_ttl=ttl, heartbeat=heartbeat
            )
        )
    middlewares.append(Finished(url, key, traffic=traffic))
    # No socket timeout: with redis-py 8's default (5 s) a worker's BRPOP on an
    # empty queue times out and the worker process dies, taking the tasks it
    # prefetched with it (taskiq-redis issue 127); the drain then never ends.
    broker = ListQueueBroker(url, queue_name=queue, socket_timeout=None).with_middlewares(
        *middlewares
    )

    @broker.task(task_name="bench_sleep")
    async def sleep(n: int, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return n

    return broker


def _from_environment() -> AsyncBroker | None:
    if "BENCH_QUEUE" not in os.environ:
        return None
    return build(
        os.environ["BENCH_REDIS_URL"],
        os.environ["BENCH_QUEUE"],
        prefix=os.environ.get("BENCH_PREFIX") or None,
        key=os.environ["BENCH_KEY"],
        traffic=bool(os.environ.get("BENCH_TRAFFIC")),
        ttl=int(os.environ.get("BENCH_TTL", "300")),
        heartbeat=bool(os.environ.get("BENCH_HEARTBEAT")),
        floor=bool(os.environ.get("BENCH_FLOOR")),
    )


broker = _from_environment()
