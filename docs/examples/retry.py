"""A retry takes the lock over from the attempt that failed."""

import asyncio
import logging
import os
import uuid

import redis.asyncio
from taskiq import InMemoryBroker, SimpleRetryMiddleware

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
PREFIX = f"retry-{uuid.uuid4().hex[:8]}"

# --8<-- [start:broker]
broker = InMemoryBroker().with_middlewares(
    SimpleRetryMiddleware(default_retry_count=3),
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=PREFIX),
)
attempts: list[str] = []  # one entry per run of fetch_rates


@broker.task(retry_on_error=True)
async def fetch_rates(currency: str) -> str:
    attempts.append(currency)
    await asyncio.sleep(0.4)
    if len(attempts) == 1:
        raise ConnectionError("the rates service hung up")  # so the task is retried
    return f"{currency} rates fetched on attempt {len(attempts)}"


# --8<-- [end:broker]


async def look(client: redis.asyncio.Redis) -> None:
    """Show who holds the lock, and try to send the same call once more."""
    keys = [key async for key in client.scan_iter(match=f"{PREFIX}:*")]
    token, task_id = str(await client.get(keys[0])).split(" ")
    try:
        await fetch_rates.kiq(currency="EUR")
    except DuplicateTaskError:
        print(f"attempt {len(attempts)}: token {token} of task {task_id} holds the lock")


async def main() -> None:
    # taskiq logs the failed attempt with its traceback; not needed here.
    logging.getLogger("taskiq.receiver").setLevel(logging.CRITICAL)
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    await broker.startup()
    task = await fetch_rates.kiq(currency="EUR")
    print(f"sent task {task.task_id}")
    await asyncio.sleep(0.2)
    await look(client)  # the first attempt runs
    await asyncio.sleep(0.4)
    await look(client)  # the retry runs: same task_id, a new owner token
    print((await task.wait_result(timeout=5)).return_value)
    await broker.wait_all()
    await broker.shutdown()
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
