"""Tests of the invoices on InMemoryBroker, with deduplication on."""

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from invoices import broker, send_invoice
from taskiq import AsyncBroker

from taskiq_deduplication import DuplicateTaskError
from taskiq_deduplication.testing import Deduplication


# --8<-- [start:fixture]
@pytest_asyncio.fixture
async def started_broker(dedup: Deduplication) -> AsyncIterator[AsyncBroker]:
    dedup.install(broker)  # the app's middleware, on the tests' Redis and prefix
    await broker.startup()
    yield broker
    await broker.wait_all()  # type: ignore[attr-defined]  # InMemoryBroker's
    await broker.shutdown()


# --8<-- [end:fixture]


# --8<-- [start:tests]
@pytest.mark.asyncio
@pytest.mark.usefixtures("started_broker")
async def test_a_second_send_is_refused_while_the_first_runs(dedup: Deduplication) -> None:
    first = await send_invoice.kiq(invoice_id=7)
    assert await dedup.holder(send_invoice, invoice_id=7) == first.task_id

    with pytest.raises(DuplicateTaskError) as refused:
        await send_invoice.kiq(invoice_id=7)
    assert refused.value.holder_task_id == first.task_id
    assert refused.value.key == dedup.key(send_invoice, invoice_id=7)

    assert (await first.wait_result(timeout=5)).return_value == "invoice 7 sent"
    assert not await dedup.is_locked(send_invoice, invoice_id=7)


@pytest.mark.asyncio
@pytest.mark.usefixtures("started_broker")
async def test_a_lock_left_behind_can_be_released(dedup: Deduplication) -> None:
    await send_invoice.kiq(invoice_id=8)
    assert await dedup.locks()  # the run holds its lock

    await dedup.release_all()  # as if the run had ended
    again = await send_invoice.kiq(invoice_id=8)
    assert (await again.wait_result(timeout=5)).return_value == "invoice 8 sent"


# --8<-- [end:tests]
