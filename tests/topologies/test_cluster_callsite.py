"""Merged calls and fences on a 3-primary Redis Cluster: one slot per prefix, by hash tag."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio.cluster import RedisCluster
from taskiq import TaskiqDepends

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware, TaskLock
from tests._brokers import HoldingBroker
from tests.topologies._servers import Cluster


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[RedisCluster]:
    connected = RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        yield connected
    finally:
        await connected.aclose()


async def started(client: RedisCluster, prefix: str) -> HoldingBroker:
    broker = HoldingBroker().with_middlewares(
        RedisDeduplicationMiddleware(client=client, key_prefix=prefix)
    )
    await broker.startup()
    return broker


async def test_merges_and_fences_work_under_a_hash_tagged_prefix(client: RedisCluster) -> None:
    prefix = f"{{cs-{uuid.uuid4().hex[:8]}}}"
    broker = await started(client, prefix)
    ran: list[tuple[int, int]] = []

    @broker.task(deduplication_key="sync", deduplication_merge="latest")
    async def sync(version: int, lock: TaskLock = TaskiqDepends()) -> None:
        ran.append((version, lock.fence))

    for round_ in range(2):
        await sync.kiq(version=10 * round_)
        for version in range(1, 4):
            with pytest.raises(DuplicateTaskError) as caught:
                await sync.kiq(version=10 * round_ + version)
            assert caught.value.merged
        await broker.deliver()
    assert [version for version, _ in ran] == [3, 13]
    assert ran[0][1] < ran[1][1]
    await broker.shutdown()
    await client.delete(f"{prefix}#fence")


async def test_without_a_hash_tag_a_merging_task_is_refused_clearly(
    client: RedisCluster,
) -> None:
    broker = await started(client, f"cs-{uuid.uuid4().hex[:8]}")

    @broker.task(deduplication_key="sync", deduplication_merge="latest")
    async def sync(version: int) -> None: ...

    @broker.task(deduplication_key="plain")
    async def plain() -> None: ...

    with pytest.raises(ValueError, match="hash tag"):
        await sync.kiq(version=1)
    await plain.kiq()  # tasks without a merge or a fence are not affected
    await broker.deliver()
    await broker.shutdown()
