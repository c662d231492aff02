"""At startup, the labels of every registered task are checked as their sends will be."""

from __future__ import annotations

import pytest
import redis.asyncio
from taskiq import AsyncBroker, InMemoryBroker

from taskiq_deduplication import DeduplicationError
from tests._locks import lock_keys
from tests._middlewares import MiddlewareFactory


async def test_startup_lists_every_bad_label_task_by_task(
    make_middleware: MiddlewareFactory,
) -> None:
    middleware = make_middleware(heartbeat=False)
    broker = InMemoryBroker().with_middlewares(middleware)

    @broker.task(deduplication_key_fields="order_id")  # a string, not a list
    async def charge(order_id: str) -> None: ...

    @broker.task(deduplication_tll=60, deduplication_until="later")
    async def digest(user_id: int) -> None: ...

    @broker.task(deduplication_running_ttl=5)  # needs the heartbeat, which is off
    async def crawl() -> None: ...

    @broker.task(deduplication_ttl=60, deduplication_until="expired")
    async def fine() -> None: ...

    with pytest.raises(ValueError, match="4 bad deduplication labels") as caught:
        await middleware.startup()
    assert isinstance(caught.value, DeduplicationError)
    lines = str(caught.value).splitlines()[1:]
    assert len(lines) == 4
    assert lines[0].startswith(f"  {charge.task_name}: ")
    assert "'deduplication_key_fields'" in lines[0]
    assert "unknown label 'deduplication_tll' (did you mean 'deduplication_ttl'?)" in lines[1]
    assert "'deduplication_until'" in lines[2]
    assert lines[2].startswith(f"  {digest.task_name}: ")
    assert "heartbeat" in lines[3]
    assert lines[3].startswith(f"  {crawl.task_name}: ")
    assert fine.task_name not in str(caught.value)


async def test_startup_with_good_labels_connects(
    make_middleware: MiddlewareFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    middleware = make_middleware()
    broker = InMemoryBroker().with_middlewares(middleware)

    @broker.task(
        deduplication_ttl="120",
        deduplication_success_ttl=86_400,
        deduplication_key_fields=["order_id"],
        deduplication=True,
    )
    async def charge(order_id: str) -> None: ...

    @broker.task(deduplication_until="started", other_label="not ours")
    async def refresh(shard: int) -> None: ...

    await middleware.startup()
    try:
        await charge.kiq(order_id="A-1")
        assert len(await lock_keys(redis_client, prefix)) == 1
    finally:
        await broker.wait_all()
        await middleware.shutdown()


async def test_a_worker_checks_the_labels_too(make_middleware: MiddlewareFactory) -> None:
    middleware = make_middleware()
    broker = InMemoryBroker().with_middlewares(middleware)
    broker.is_worker_process = True

    @broker.task(deduplication_success_ttl=60, deduplication_until="started")
    async def refresh() -> None: ...

    with pytest.raises(ValueError, match="1 bad deduplication label:"):
        await middleware.startup()


async def test_a_real_broker_fails_to_start(
    make_middleware: MiddlewareFactory, redis_url: str, prefix: str
) -> None:
    taskiq_redis = pytest.importorskip("taskiq_redis", reason="taskiq-redis is not installed")
    broker: AsyncBroker = taskiq_redis.ListQueueBroker(redis_url, queue_name=f"{prefix}:queue")
    broker.with_middlewares(make_middleware())

    @broker.task(deduplication_key_fields="order_id")
    async def charge(order_id: str) -> None: ...

    with pytest.raises(ValueError, match="deduplication_key_fields"):
        await broker.startup()
    await broker.shutdown()
