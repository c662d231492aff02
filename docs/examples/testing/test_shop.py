"""Tests of the shop with a real ``taskiq worker``, the app's broker unchanged."""

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from shop import broker, ship_order
from taskiq import AsyncBroker

from taskiq_deduplication import DuplicateTaskError
from taskiq_deduplication.testing import Deduplication, Worker


# --8<-- [start:worker]
@pytest_asyncio.fixture
async def shop_broker(dedup: Deduplication) -> AsyncIterator[AsyncBroker]:
    dedup.install(broker)  # this process sends with the test's locks...
    await broker.startup()
    yield broker
    await broker.shutdown()


@pytest.fixture
def worker(dedup: Deduplication) -> Worker:
    return dedup.start_worker("shop:broker")  # ...and so does the worker


@pytest.mark.asyncio
@pytest.mark.usefixtures("shop_broker")
async def test_an_order_is_shipped_once(dedup: Deduplication, worker: Worker) -> None:
    first = await ship_order.kiq(order_id=1)
    with pytest.raises(DuplicateTaskError):
        await ship_order.kiq(order_id=1)

    result = await first.wait_result(timeout=10)
    assert result.return_value == "order 1 shipped"
    assert not await dedup.is_locked(ship_order, order_id=1)  # the worker released it
    assert "Traceback" not in worker.log()


# --8<-- [end:worker]
