"""An import that stops when its lock is lost, and a store that refuses a stale writer."""

import asyncio
import logging
import os
import uuid

import redis.asyncio
from taskiq import InMemoryBroker, TaskiqDepends

from taskiq_deduplication import RedisDeduplicationMiddleware, TaskLock

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
PREFIX = f"fence-{uuid.uuid4().hex[:8]}"
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=PREFIX),
)


# --8<-- [start:store]
class FencedStore:
    """A store that keeps the highest fence it has seen and refuses lower ones."""

    def __init__(self) -> None:
        self.highest = 0
        self.rows: list[str] = []

    async def write(self, row: str, *, fence: int) -> None:
        if fence < self.highest:
            msg = f"stale writer: fence {fence} < {self.highest}"
            raise PermissionError(msg)
        self.highest = fence
        self.rows.append(row)


# --8<-- [end:store]


class DemoStore(FencedStore):
    """The store, where the first import stalls just before it writes "a2"."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()

    async def write(self, row: str, *, fence: int) -> None:
        if row == "a2":  # held() said yes a moment ago; then the worker stalls
            self.paused.set()
            await self.resume.wait()
        await super().write(row, fence=fence)


store = DemoStore()


# --8<-- [start:import]
@broker.task(deduplication_key="nightly-import", deduplication_ttl=60)
async def nightly_import(batches: list[str], lock: TaskLock = TaskiqDepends()) -> None:
    for batch in batches:
        if not await lock.held():
            print(f"fence {lock.fence}: lock lost, stopping before {batch}")
            return  # expired or taken over: stop before writing
        await store.write(batch, fence=lock.fence)
        print(f"fence {lock.fence}: wrote {batch}")


# --8<-- [end:import]


async def main() -> None:
    # taskiq logs every failed task with its traceback; this failure is the point.
    logging.getLogger("taskiq.receiver").setLevel(logging.CRITICAL)
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    await broker.startup()
    first = await nightly_import.kiq(batches=["a1", "a2", "a3"])
    await store.paused.wait()  # the first import is between two batches
    # As if the first import's lock had expired: a second import takes the key.
    await client.delete(f"{PREFIX}:nightly-import")
    second = await nightly_import.kiq(batches=["b1", "b2"])
    await second.wait_result(timeout=5)
    store.resume.set()
    # The stalled import's write comes after the takeover: the store refuses it.
    print(f"first import: {(await first.wait_result(timeout=5)).error!r}")
    await broker.shutdown()
    await client.delete(f"{PREFIX}#fence")
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
