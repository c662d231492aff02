"""The application that the worker benchmark runs in real ``taskiq worker`` processes.

``taskiq worker tests.benchmarks.worker_app:broker`` builds its broker from the
environment (``BENCH_*``, set by :mod:`tests.benchmarks.workers`); the
benchmark's own process builds the sending side with :func:`build`.

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


def build(
    url: str,
    queue: str,
    *,
    prefix: str | None,
    key: str,
    traffic: bool = False,
    ttl: int = 300,
    heartbeat: bool = True,
) -> AsyncBroker:
    """The broker on ``queue``; with the middleware if ``prefix`` is given."""
    middlewares: list[TaskiqMiddleware] = []
    if prefix is not None:
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
    )


broker = _from_environment()
