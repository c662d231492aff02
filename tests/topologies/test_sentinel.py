"""The middleware on a Sentinel-managed primary, through ``Sentinel.master_for``.

The failover tests kill the primary (SIGKILL) and check that the middleware goes
on without a restart once the sentinels have promoted the replica; they also
measure how many locks taken just before the kill were lost with it, since the
replica is fed asynchronously.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware
from tests._brokers import HoldingBroker
from tests._cli import dedup, holding
from tests._teardown import owned
from tests._topologies import primary_client, start_or_skip
from tests.topologies._servers import Sentinels

# In the one worker that runs the core tests on the Sentinel set too (tests/_topologies.py).
pytestmark = pytest.mark.xdist_group("sentinel")

logger = logging.getLogger(__name__)

_FAILOVER_TIMEOUT = 30.0


@pytest.fixture
def prefix() -> str:
    return f"sentinel:{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fresh_sentinels() -> Iterator[Sentinels]:
    """A topology of its own, for a test that kills its primary."""
    yield from owned(start_or_skip(Sentinels().start, "Sentinel set"), Sentinels.stop)


async def started(watched: Sentinels, prefix: str) -> tuple[Redis, HoldingBroker, Any]:
    """The application: a client of the sentinels' primary, its broker and a task ``job(n)``."""
    client = primary_client(watched)
    broker = HoldingBroker().with_middlewares(
        RedisDeduplicationMiddleware(client=client, key_prefix=prefix)
    )
    await broker.startup()

    async def job(n: int) -> None: ...

    return client, broker, broker.register_task(job)


async def sent(kiq: Any) -> bool:
    """Whether a send went through; errors of a primary that is gone mean no."""
    try:
        await kiq
    except DuplicateTaskError:
        raise
    except Exception:  # noqa: BLE001 (the old primary's errors, until the switch)
        return False
    return True


async def wait_for_failover(watched: Sentinels, old_port: int) -> None:
    deadline = time.monotonic() + _FAILOVER_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if watched.current_primary_port() != old_port:
                return
        except Exception:  # noqa: BLE001, S110 (a sentinel may be busy electing)
            pass
        await asyncio.sleep(0.1)
    msg = f"no failover within {_FAILOVER_TIMEOUT}s"
    raise AssertionError(msg)


async def test_failover_without_restarting_the_application(
    fresh_sentinels: Sentinels, prefix: str
) -> None:
    client, broker, job = await started(fresh_sentinels, prefix)

    before = await job.kiq(n=0)
    await asyncio.sleep(0.2)  # replicated long before the kill
    old_port = fresh_sentinels.primary.port
    killed_at = time.monotonic()
    fresh_sentinels.primary.process.kill()  # type: ignore[union-attr]
    await wait_for_failover(fresh_sentinels, old_port)
    recovered_after = None
    while time.monotonic() - killed_at < _FAILOVER_TIMEOUT:
        if await sent(job.kiq(n=1)):
            recovered_after = time.monotonic() - killed_at
            break
        await asyncio.sleep(0.1)
    assert recovered_after is not None
    logger.warning("sends accepted again %.2fs after the primary was killed", recovered_after)
    with pytest.raises(DuplicateTaskError) as caught:  # the lock replicated before survived
        await job.kiq(n=0)
    assert caught.value.holder_task_id == before.task_id
    await broker.shutdown()
    await client.aclose()


async def test_locks_taken_just_before_a_failover_can_be_lost(
    fresh_sentinels: Sentinels, prefix: str
) -> None:
    client, broker, job = await started(fresh_sentinels, prefix)

    taken: list[object] = []
    stop_at = time.monotonic() + 0.5
    while time.monotonic() < stop_at:  # back-to-back sends right up to the kill
        taken.append(await job.kiq(n=len(taken)))
    old_port = fresh_sentinels.primary.port
    fresh_sentinels.primary.process.kill()  # type: ignore[union-attr]
    await wait_for_failover(fresh_sentinels, old_port)
    survivors = 0
    deadline = time.monotonic() + _FAILOVER_TIMEOUT
    while True:
        try:
            survivors = len(await client.keys(f"{prefix}:*"))
            break
        except Exception:  # until the client has found the new primary
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    lost = len(taken) - survivors
    logger.warning(
        "failover lost %d of %d locks taken in the last 0.5s before the kill", lost, len(taken)
    )
    assert 0 <= lost <= len(taken)
    assert survivors > 0  # nearly all of them were replicated in time
    await broker.shutdown()
    await client.aclose()


async def test_the_dedup_command_lists_through_sentinel(sentinels: Sentinels) -> None:
    prefix = f"cli:{uuid.uuid4().hex[:8]}"
    client = primary_client(sentinels)
    try:
        middleware = RedisDeduplicationMiddleware(client=client, key_prefix=prefix)
        async with holding(middleware, 3) as ids:
            hosts = ",".join(f"{host}:{port}" for host, port in sentinels.addresses)
            url = f"redis+sentinel://{hosts}/{sentinels.service}"
            listed = await dedup("list", "--url", url, "--prefix", prefix, "--json")
            assert listed.status == 0, listed.stderr
            assert sorted(lock["holder_task_id"] for lock in listed.json()) == sorted(ids)
    finally:
        await client.aclose()
