"""Catching a duplicate at the call site, and what the error tells you."""

import asyncio
import logging
import os
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

logger = logging.getLogger("myapp")
REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"myapp-{uuid.uuid4().hex[:8]}"),
)


@broker.task
async def charge_invoice(invoice_id: int) -> str:
    await asyncio.sleep(0.3)
    return f"invoice {invoice_id} charged"


# --8<-- [start:handle]
async def charge(invoice_id: int) -> None:
    try:
        await charge_invoice.kiq(invoice_id=invoice_id)
    except DuplicateTaskError as err:
        # Nothing was sent: the task that holds the lock will do the work.
        logger.info(
            "skipped %s: lock %s is held by task %s",
            err.task_name,
            err.key,
            err.holder_task_id,
        )


# --8<-- [end:handle]


async def main() -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    await broker.startup()
    await charge(invoice_id=1001)
    await charge(invoice_id=1001)  # logged and skipped
    await broker.wait_all()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
