"""The middleware on a 3-primary Redis Cluster, through a ``RedisCluster`` client."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from redis.asyncio.cluster import RedisCluster
from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware
from tests._brokers import HoldingBroker
from tests._cli import dedup, holding
from tests._server import flushing_scripts
from tests._tasks import all_running
from tests._teardown import closed_after
from tests._topologies import cluster_client, start_or_skip
from tests.topologies._servers import Cluster

# In the one worker that runs the core tests on the Cluster too (tests/_topologies.py).
pytestmark = pytest.mark.xdist_group("cluster")


@pytest.fixture
def prefix() -> str:
    return f"cluster:{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def client(cluster: Cluster, prefix: str) -> AsyncIterator[RedisCluster]:
    """A cluster client found from one node's URL; deletes the test's keys at the end."""
    async for connected in closed_after(cluster_client(cluster), prefix):
        yield connected


async def keys_under(client: RedisCluster, prefix: str) -> list[str]:
    keys = await client.keys(f"{prefix}:*", target_nodes=RedisCluster.PRIMARIES)
    return sorted(str(key) for key in keys)


async def started(
    client: RedisCluster,
    prefix: str,
    broker_class: type[InMemoryBroker] = InMemoryBroker,
    **options: Any,
) -> InMemoryBroker:
    dedup = RedisDeduplicationMiddleware(client=client, key_prefix=prefix, **options)
    broker = broker_class().with_middlewares(dedup)
    await broker.startup()
    return broker


async def test_heartbeat_keeps_locks_on_every_node_alive(
    cluster: Cluster, client: RedisCluster, prefix: str
) -> None:
    broker = await started(client, prefix, default_ttl=2)
    job, finish = await all_running(broker, 300)
    keys = await keys_under(client, prefix)
    nodes = {getattr(client.get_node_from_key(key), "port", None) for key in keys}
    assert nodes == {node.port for node in cluster.nodes}  # spread over all slots' owners
    await asyncio.sleep(3)  # one and a half TTLs: only the heartbeat keeps them
    assert len(await keys_under(client, prefix)) == 300
    with pytest.raises(DuplicateTaskError):
        await job.kiq(n=123)
    finish.set()
    await broker.wait_all()
    assert await keys_under(client, prefix) == []
    await broker.shutdown()


async def test_fail_open_when_the_whole_cluster_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = start_or_skip(Cluster(primaries=3).start, "Redis Cluster")
    client = RedisCluster.from_url(down.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    strict = RedisDeduplicationMiddleware(client=client, key_prefix="strict")
    lenient = RedisDeduplicationMiddleware(client=client, key_prefix="lenient", fail_open=True)
    strict_broker = HoldingBroker().with_middlewares(strict)
    lenient_broker = HoldingBroker().with_middlewares(lenient)

    @strict_broker.task
    async def job() -> None: ...

    lenient_job = lenient_broker.register_task(job.original_func, task_name=job.task_name)
    await strict_broker.startup()
    await lenient_broker.startup()
    await job.kiq()  # while the cluster is up
    down.stop()
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    with pytest.raises(Exception) as caught:  # noqa: PT011 (whatever the cluster client raises)
        await job.kiq()
    assert not isinstance(caught.value, DuplicateTaskError)
    assert len(strict_broker.queued) == 1
    await lenient_job.kiq()
    assert len(lenient_broker.queued) == 1
    assert "fail_open" in caplog.text
    await strict_broker.shutdown()
    await lenient_broker.shutdown()
    await client.aclose()


async def test_script_caches_lost_during_a_burst_fail_no_kiq(
    cluster: Cluster, client: RedisCluster, prefix: str
) -> None:
    broker = await started(client, prefix, HoldingBroker)  # the locks stay: no run ends them

    @broker.task
    async def job(n: int) -> None: ...

    # Every primary loses its scripts again and again, whatever our loop does.
    with flushing_scripts([node.port for node in cluster.nodes], pause=0.001):
        results = await asyncio.gather(*(job.kiq(n=n) for n in range(1000)), return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert len(await keys_under(client, prefix)) == 1000
    await broker.shutdown()


async def test_the_dedup_command_lists_shows_and_releases_on_every_primary(
    cluster: Cluster, client: RedisCluster, prefix: str
) -> None:
    middleware = RedisDeduplicationMiddleware(client=client, key_prefix=prefix)
    async with holding(middleware, 40) as ids:
        listed = await dedup("list", "--url", cluster.url, "--prefix", prefix, "--json")
        assert listed.status == 0, listed.stderr
        locks = listed.json()
        assert sorted(lock["holder_task_id"] for lock in locks) == sorted(ids)
        nodes = {client.get_node_from_key(lock["key"]) for lock in locks}
        assert len({node.name for node in nodes if node is not None}) == 3
        first = locks[0]
        shown = await dedup(
            "show", first["key"], "--url", cluster.url, "--prefix", prefix, "--json"
        )
        released = await dedup(
            "release", "--match", "*", "--url", cluster.url, "--prefix", prefix, "--yes"
        )
        assert shown.json()["holder_task_id"] == first["holder_task_id"]
        assert released.status == 0, released.stderr
        assert len(released.stdout.splitlines()) == 40
        assert await keys_under(client, prefix) == []


async def test_the_dedup_command_releases_merged_arguments_in_the_locks_slot(
    cluster: Cluster, client: RedisCluster
) -> None:
    prefix = f"{{cluster-{uuid.uuid4().hex[:8]}}}"  # a hash tag: merging needs one slot
    middleware = RedisDeduplicationMiddleware(client=client, key_prefix=prefix)
    broker = HoldingBroker().with_middlewares(middleware)
    await broker.startup()
    try:

        @broker.task(
            task_name="cluster.merged", deduplication_key="doc", deduplication_merge="latest"
        )
        async def save(text: str) -> None: ...

        first = await save.kiq("a")
        assert (await save.kiq("b")).task_id == first.task_id  # merged into it
        assert await client.exists(f"{prefix}#merge:doc") == 1
        released = await dedup("release", f"{prefix}:doc", "--url", cluster.url, "--yes")
        assert released.status == 0, released.stderr
        assert await client.exists(f"{prefix}:doc", f"{prefix}#merge:doc") == 0
    finally:
        broker.queued.clear()
        await broker.shutdown()


async def test_without_a_hash_tag_a_merging_task_is_refused_clearly(
    client: RedisCluster, prefix: str
) -> None:
    broker = cast("HoldingBroker", await started(client, prefix, HoldingBroker))

    @broker.task(deduplication_key="sync", deduplication_merge="latest")
    async def sync(version: int) -> None: ...

    @broker.task(deduplication_key="plain")
    async def plain() -> None: ...

    with pytest.raises(ValueError, match="hash tag"):
        await sync.kiq(version=1)
    await plain.kiq()  # tasks without a merge or a fence are not affected
    await broker.deliver()
    await broker.shutdown()
