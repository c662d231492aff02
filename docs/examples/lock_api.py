"""A tool of your own: list the locks, find the one a call would take, and release it."""

import asyncio
import math
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import Locks, RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
PREFIX = f"shop-{uuid.uuid4().hex[:8]}"
middleware = RedisDeduplicationMiddleware(REDIS_URL, key_prefix=PREFIX)
broker = InMemoryBroker().with_middlewares(middleware)


# Locks that outlive their runs: nothing keeps them alive, an operator may release them.
@broker.task(deduplication_until="expired", deduplication_ttl=600)
async def monthly_report(month: str) -> None:
    print(f"building the report of {month}")


@broker.task(deduplication_key="nightly-export", deduplication_until="expired")
async def nightly_export() -> None:
    print("exporting")


# --8<-- [start:tool]
async def tool() -> None:
    async with Locks.from_url(REDIS_URL, prefix=PREFIX) as locks:
        held = sorted([lock async for lock in locks.scan()], key=lambda lock: lock.key)
        for lock in held:
            left = math.ceil(lock.ttl) if lock.ttl is not None else "no"
            print(f"{lock.key}: held by {lock.holder_task_id}, {left} s left")
        export = await locks.get("nightly-export")  # a name, or the full key
        if export is not None and await locks.release(export):  # unless it changed hands
            print(f"released {export.key}")


# --8<-- [end:tool]


async def main() -> None:
    await broker.startup()
    for month in ("2026-10", "2026-11"):
        await (await monthly_report.kiq(month)).wait_result()
    await (await nightly_export.kiq()).wait_result()
    await tool()
    # --8<-- [start:key]
    key = middleware.locks.key_for(monthly_report, "2026-11")
    print(f"the report of 2026-11 takes {key}")
    # --8<-- [end:key]
    await (await nightly_export.kiq()).wait_result()  # its lock was released: it runs
    async with Locks.from_url(REDIS_URL, prefix=PREFIX) as locks:
        await locks.purge()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
