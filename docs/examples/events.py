"""Subscribing to lock events: what the middleware did, as typed objects."""

import asyncio
import contextlib
import os
import uuid
from collections import Counter

from taskiq import InMemoryBroker

from taskiq_deduplication import (
    DuplicateTaskError,
    LockEvent,
    LockEventKind,
    RedisDeduplicationMiddleware,
)

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
deduplication = RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"myapp-{uuid.uuid4().hex[:8]}")
broker = InMemoryBroker().with_middlewares(deduplication)


@broker.task
async def rebuild_report(report_id: int) -> str:
    await asyncio.sleep(0.1)
    return f"report {report_id} rebuilt"


# --8<-- [start:subscribe]
refused: Counter[str] = Counter()


def on_lock_event(event: LockEvent) -> None:
    # Called inside the hook that made the event: keep it quick.
    print(f"{event.kind.value:>9} {event.task_name} held by {event.holder_task_id}")
    if event.kind is LockEventKind.DUPLICATE:
        refused[event.task_name] += 1


unsubscribe = deduplication.subscribe(on_lock_event)
# --8<-- [end:subscribe]


async def main() -> None:
    await broker.startup()
    await rebuild_report.kiq(7)
    with contextlib.suppress(DuplicateTaskError):  # refused: counted by the subscriber
        await rebuild_report.kiq(7)
    await broker.wait_all()
    unsubscribe()
    print("refused:", dict(refused))
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
