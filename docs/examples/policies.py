"""The three lock policies, and a lock remembered after a success."""

import asyncio
import logging
import os
import uuid

from taskiq import AsyncTaskiqTask, InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
PREFIX = f"myapp-{uuid.uuid4().hex[:8]}"
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=PREFIX),
)


# --8<-- [start:started]
@broker.task(deduplication_until="started", deduplication_key_fields=["shard"])
async def refresh_search_index(shard: int, *, again: bool = False) -> None:
    print(f"refreshing shard {shard}")
    if again:
        # The lock went when this run started: a new refresh may queue already.
        await refresh_search_index.kiq(shard=shard)
        print("  a new refresh queued while this one runs")


# --8<-- [end:started]


# --8<-- [start:expired]
@broker.task(deduplication_until="expired", deduplication_ttl=600)
async def send_digest(user_id: int) -> None:
    print(f"sending the digest of user {user_id}")


# --8<-- [end:expired]


# --8<-- [start:success]
@broker.task(deduplication_ttl=120, deduplication_success_ttl=86_400)
async def charge(order_id: str) -> str:
    if order_id == "A-2":
        msg = "card declined"
        raise RuntimeError(msg)
    return f"receipt for {order_id}"


async def charge_once(order_id: str) -> None:
    try:
        task = await charge.kiq(order_id=order_id)
    except DuplicateTaskError as err:
        if err.holder_task_id is None:  # a lock this library did not write
            raise
        # Charged already today: the lock names the task that did it.
        task = AsyncTaskiqTask(err.holder_task_id, broker.result_backend)
        print(f"{order_id}: charged already, by task {err.holder_task_id}")
    result = await task.wait_result(timeout=5)
    print(f"{order_id}: {result.error or result.return_value}")


# --8<-- [end:success]


async def main() -> None:
    # taskiq logs every failed task with its traceback; the card declined is expected.
    logging.getLogger("taskiq.receiver").setLevel(logging.CRITICAL)
    logging.getLogger("taskiq.task").setLevel(logging.ERROR)  # no return value to parse
    await broker.startup()
    await refresh_search_index.kiq(shard=1, again=True)
    await broker.wait_all()

    await send_digest.kiq(user_id=7)
    await broker.wait_all()
    try:
        await send_digest.kiq(user_id=7)  # finished, but within its 10 minutes
    except DuplicateTaskError:
        print("digest of user 7: sent already in the last 10 minutes")

    await charge_once("A-1")
    await charge_once("A-1")  # the same order: the first charge's receipt
    await charge_once("A-2")  # fails: the lock goes at once
    await charge_once("A-2")  # so a retry of the order goes through
    await broker.wait_all()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
