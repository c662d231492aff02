"""Exclusive runs: a message the broker delivers again never runs its body twice."""

import asyncio
import logging
import os
import sys
import uuid

from taskiq import BrokerMessage, InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
PREFIX = f"myapp-{uuid.uuid4().hex[:8]}"


class RedeliveringBroker(InMemoryBroker):
    """Keeps each message, so that it can be delivered twice, as real brokers may."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[BrokerMessage] = []

    async def kick(self, message: BrokerMessage) -> None:
        self.kept.append(message)

    async def deliver(self, message: BrokerMessage) -> None:
        await self.receiver.callback(message=message.message)


broker = RedeliveringBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=PREFIX, default_ttl=6),
)


# --8<-- [start:exclusive]
@broker.task(deduplication_success_ttl=3600)  # an idempotency key for an hour
async def charge(order_id: int) -> None:  # a redelivered copy never charges twice
    print(f"charging order {order_id}")
    await asyncio.sleep(1)


@broker.task(deduplication_exclusive=False)  # runs of this task may overlap
async def warm_cache(key: str) -> None:
    print(f"warming {key}")


# --8<-- [end:exclusive]


# --8<-- [start:latest]
@broker.task(
    deduplication_until="started",
    deduplication_key_fields=["account_id"],
    deduplication_merge="latest",
)
async def sync_account(account_id: int, revision: int) -> None:
    print(f"syncing account {account_id} at revision {revision}")
    await asyncio.sleep(1)


# --8<-- [end:latest]


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
    logging.getLogger("taskiq").setLevel(logging.ERROR)
    await broker.startup()

    await charge.kiq(order_id=42)
    (message,) = broker.kept
    # The broker delivers the message again while its first run goes on: the
    # copy waits, and does not run once the first run succeeded.
    await asyncio.gather(broker.deliver(message), broker.deliver(message))

    broker.kept.clear()
    await sync_account.kiq(account_id=7, revision=1)
    first = asyncio.create_task(broker.deliver(broker.kept[0]))
    await asyncio.sleep(0.3)  # revision 1 runs
    await sync_account.kiq(account_id=7, revision=2)  # queued while it runs
    second = asyncio.create_task(broker.deliver(broker.kept[1]))
    await asyncio.sleep(0.3)
    merged = await sync_account.kiq(account_id=7, revision=3)
    queued = broker.kept[1].task_id
    print(f"revision 3 merged into the queued copy: {merged.task_id == queued}")
    await asyncio.gather(first, second)
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
