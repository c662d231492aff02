"""Testing an application that uses the middleware, with pytest and a real Redis.

Run it with ``python docs/examples/testing_app.py`` (or ``pytest`` on the file).
"""

import asyncio
import os
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio
from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

# --8<-- [start:app]
# The application. In production the broker is a ListQueueBroker or the like;
# tests use InMemoryBroker, which runs the tasks in the test's own process.
REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
KEY_PREFIX = f"test-{uuid.uuid4().hex[:8]}:dedup"  # this test run's locks only

broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(redis_url=REDIS_URL, key_prefix=KEY_PREFIX),
)


@broker.task
async def send_invoice(invoice_id: int) -> str:
    await asyncio.sleep(0.2)
    return f"invoice {invoice_id} sent"


# --8<-- [end:app]


# --8<-- [start:fixture]
@pytest_asyncio.fixture
async def started_broker() -> AsyncIterator[InMemoryBroker]:
    await broker.startup()
    yield broker
    await broker.wait_all()  # every task ends, so every lock is released
    await broker.shutdown()
    # A test that failed half-way may leave a lock behind: remove it, so that
    # the next test does not see a duplicate that is not there.
    async with redis.asyncio.Redis.from_url(REDIS_URL) as client:
        leftovers = [k async for k in client.scan_iter(match=f"{KEY_PREFIX}:*")]
        if leftovers:
            await client.delete(*leftovers)


# --8<-- [end:fixture]


# --8<-- [start:tests]
@pytest.mark.asyncio
@pytest.mark.usefixtures("started_broker")
async def test_a_second_invoice_send_is_refused_while_the_first_runs() -> None:
    first = await send_invoice.kiq(invoice_id=7)
    with pytest.raises(DuplicateTaskError) as refused:
        await send_invoice.kiq(invoice_id=7)
    assert refused.value.holder_task_id == first.task_id

    result = await first.wait_result(timeout=5)
    assert result.return_value == "invoice 7 sent"


@pytest.mark.asyncio
async def test_the_invoice_can_be_sent_again_once_the_first_send_ended(
    started_broker: InMemoryBroker,
) -> None:
    await send_invoice.kiq(invoice_id=8)
    await started_broker.wait_all()  # the task ran and released its lock

    again = await send_invoice.kiq(invoice_id=8)
    assert (await again.wait_result(timeout=5)).return_value == "invoice 8 sent"


# --8<-- [end:tests]


if __name__ == "__main__":
    # This script imported pytest-asyncio and anyio before pytest started, so
    # pytest cannot rewrite their asserts; it says so, and that is fine here.
    options = ["-q", "-p", "no:cacheprovider"]
    options += ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    raise SystemExit(pytest.main([__file__, *options]))
