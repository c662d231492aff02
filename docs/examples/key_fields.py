"""Choosing what makes two calls the same: key fields, or an explicit key."""

import asyncio
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"myapp-{uuid.uuid4().hex[:8]}"),
)


# --8<-- [start:fields]
@broker.task(deduplication_key_fields=["order_id"])
async def sync_order(order_id: int, requested_by: str) -> None:
    # One sync per order at a time, whoever asks: requested_by is not in the key.
    print(f"syncing order {order_id} (asked by {requested_by})")
    await asyncio.sleep(0.2)


# --8<-- [end:fields]


# --8<-- [start:key]
@broker.task(deduplication_key="rebuild-search-index")
async def rebuild_search_index(mode: str = "incremental") -> None:
    # One rebuild at a time, whatever the mode.
    print(f"rebuilding the search index ({mode})")
    await asyncio.sleep(0.2)


# --8<-- [end:key]


async def main() -> None:
    await broker.startup()

    await sync_order.kiq(order_id=1, requested_by="alice")
    try:
        await sync_order.kiq(order_id=1, requested_by="bob")
    except DuplicateTaskError:
        print("order 1 is already being synced")
    await sync_order.kiq(order_id=2, requested_by="bob")  # another order: sent

    await rebuild_search_index.kiq(mode="full")
    try:
        await rebuild_search_index.kiq()
    except DuplicateTaskError:
        print("the search index is already being rebuilt")

    # --8<-- [start:call-site]
    # The same labels work for one call only.
    nightly = sync_order.kicker().with_labels(deduplication_key="nightly-sync")
    await nightly.kiq(order_id=3, requested_by="cron")
    # --8<-- [end:call-site]

    await broker.wait_all()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
