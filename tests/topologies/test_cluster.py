"""The middleware on a 3-primary Redis Cluster, through a ``RedisCluster`` client."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from taskiq import InMemoryBroker, SimpleRetryMiddleware, TaskiqMiddleware

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware
from tests._brokers import HoldingBroker
from tests._cli import dedup, holding
from tests.topologies._servers import Cluster


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[RedisCluster]:
    """A cluster client found from one node's URL, as the docs say to build it."""
    connected = RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        yield connected
    finally:
        await connected.aclose()


@pytest.fixture
def prefix() -> str:
    return f"cluster:{uuid.uuid4().hex[:8]}"


async def keys_under(client: RedisCluster, prefix: str) -> list[str]:
    keys = await client.keys(f"{prefix}:*", target_nodes=RedisCluster.PRIMARIES)
    return sorted(str(key) for key in keys)


async def started(
    client: RedisCluster, prefix: str, *, more: list[TaskiqMiddleware] | None = None, **options: Any
) -> InMemoryBroker:
    dedup = RedisDeduplicationMiddleware(client=client, key_prefix=prefix, **options)
    broker = InMemoryBroker().with_middlewares(dedup, *(more or []))
    await broker.startup()
    return broker


async def test_duplicate_rejected_with_the_right_holder(client: RedisCluster, prefix: str) -> None:
    broker = await started(client, prefix)
    finish = asyncio.Event()

    @broker.task
    async def job(n: int) -> None:
        await finish.wait()

    sent = await asyncio.gather(*(job.kiq(n=i) for i in range(30)))
    for n in (0, 17, 29):
        with pytest.raises(DuplicateTaskError) as caught:
            await job.kiq(n=n)
        assert caught.value.holder_task_id == sent[n].task_id
    finish.set()
    await broker.wait_all()
    await broker.shutdown()


async def test_released_after_success_and_after_failure(client: RedisCluster, prefix: str) -> None:
    broker = await started(client, prefix)

    @broker.task
    async def ok(n: int) -> int:
        return n

    @broker.task
    async def boom(n: int) -> None:
        msg = "failed"
        raise RuntimeError(msg)

    handles = [await ok.kiq(n=i) for i in range(10)] + [await boom.kiq(n=i) for i in range(10)]
    for handle in handles:
        await handle.wait_result(timeout=5)
    await broker.wait_all()
    assert await keys_under(client, prefix) == []
    await ok.kiq(n=1)
    await broker.wait_all()
    await broker.shutdown()


async def test_heartbeat_keeps_locks_on_every_node_alive(
    cluster: Cluster, client: RedisCluster, prefix: str
) -> None:
    broker = await started(client, prefix, default_ttl=2)
    running = 0
    all_running = asyncio.Event()
    finish = asyncio.Event()

    @broker.task
    async def job(n: int) -> None:
        nonlocal running
        running += 1
        if running == 300:
            all_running.set()
        await finish.wait()

    await asyncio.gather(*(job.kiq(n=i) for i in range(300)))
    await all_running.wait()
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


async def test_a_retry_takes_its_lock_over(client: RedisCluster, prefix: str) -> None:
    broker = await started(client, prefix, more=[SimpleRetryMiddleware(default_retry_count=3)])
    attempts = 0
    rejected: list[str | None] = []

    @broker.task(retry_on_error=True)
    async def flaky(n: int) -> str:
        nonlocal attempts
        attempts += 1
        try:
            await flaky.kiq(n=n)
        except DuplicateTaskError as err:
            rejected.append(err.holder_task_id)
        if attempts < 3:
            msg = "not yet"
            raise RuntimeError(msg)
        return "done"

    first = await flaky.kiq(n=1)
    for _ in range(50):
        await broker.wait_all()
        if not broker._running_tasks:
            break
    assert attempts == 3
    assert rejected == [first.task_id] * 3
    assert await keys_under(client, prefix) == []
    await broker.shutdown()


async def test_fail_open_when_the_whole_cluster_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = Cluster(primaries=3).start()
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
    broker = await started(client, prefix)

    @broker.task
    async def job(n: int) -> None: ...

    # Every primary loses its scripts again and again, whatever our loop does.
    stop = threading.Event()

    def flush() -> None:
        nodes = [redis.Redis(port=node.port, socket_timeout=2) for node in cluster.nodes]
        while not stop.is_set():
            for node in nodes:
                node.script_flush()
            time.sleep(0.001)
        for node in nodes:
            node.close()

    flusher = threading.Thread(target=flush)
    flusher.start()
    try:
        results = await asyncio.gather(*(job.kiq(n=n) for n in range(1000)), return_exceptions=True)
    finally:
        stop.set()
        flusher.join()
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

        await save.kiq("a")
        with pytest.raises(DuplicateTaskError):
            await save.kiq("b")
        assert await client.exists(f"{prefix}#merge:doc") == 1
        released = await dedup("release", f"{prefix}:doc", "--url", cluster.url, "--yes")
        assert released.status == 0, released.stderr
        assert await client.exists(f"{prefix}:doc", f"{prefix}#merge:doc") == 0
    finally:
        broker.queued.clear()
        await broker.shutdown()
