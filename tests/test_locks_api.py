"""The public lock API: what a tool of an operator sees and does with ``Locks``."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio

from taskiq_deduplication import DuplicateTaskError, InvalidArgumentError, LockInfo, Locks
from tests._brokers import BrokerFactory, HoldingBroker
from tests._locks import lock_keys
from tests._middlewares import dedup_middleware

_HOLDER = "0123456789abcdef0123456789abcdef"


async def test_a_lock_read_by_its_full_key_and_by_its_name(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task(deduplication_key="nightly-export")
    async def export() -> None: ...

    sent = await export.kiq()
    locks = dedup_middleware(broker).locks
    by_key, by_name = await asyncio.gather(
        locks.get(f"{prefix}:nightly-export"), locks.get("nightly-export")
    )
    # Read a few microseconds apart: the same lock, its TTL and age a tick apart.
    assert by_key is not None
    assert by_name is not None
    assert replace(by_key, ttl=None, age=None) == replace(by_name, ttl=None, age=None)
    assert isinstance(by_key, LockInfo)
    assert (by_key.key, by_key.name) == (f"{prefix}:nightly-export", "nightly-export")
    assert by_key.holder_task_id == sent.task_id
    assert by_key.value == f"{by_key.owner} {sent.task_id}"
    assert by_key.ttl is not None
    assert 0 < by_key.ttl <= 300
    assert by_key.ttl_readable
    assert not by_key.running
    assert not by_key.succeeded
    assert await locks.get("no-such-lock") is None


async def test_from_url_reads_a_full_key_under_another_prefix_without_being_told(
    broker: HoldingBroker, redis_url: str, prefix: str
) -> None:
    @broker.task
    async def job() -> None: ...

    sent = await job.kiq()
    with pytest.raises(DuplicateTaskError) as refused:
        await job.kiq()
    async with Locks.from_url(redis_url) as locks:  # the default prefix: not this test's
        assert locks.prefix == "taskiq:deduplication"
        assert locks.lookup_keys(refused.value.key) == (
            refused.value.key,
            f"taskiq:deduplication:{refused.value.key}",
        )
        lock = await locks.get(refused.value.key)
    assert lock is not None
    assert (lock.key, lock.name, lock.holder_task_id) == (refused.value.key, None, sent.task_id)


async def test_scan_pages_through_every_lock_and_filters_by_name_and_holder(
    redis_client: redis.asyncio.Redis, redis_url: str, prefix: str
) -> None:
    names = [f"report-{n}" for n in range(25)] + [f"export-{n}" for n in range(5)]
    holders = {name: uuid.uuid4().hex for name in names}
    pipe = redis_client.pipeline(transaction=False)
    for name in names:
        pipe.set(f"{prefix}:{name}", f"tok{name} {holders[name]}", px=60_000)
    await pipe.execute()
    async with Locks.from_url(redis_url, prefix=prefix) as locks:
        every = [lock async for lock in locks.scan(count=4)]
        reports = [lock async for lock in locks.scan("report-*", count=4)]
        held_by = [lock async for lock in locks.scan(holder_task_id=holders["export-3"], count=4)]
    assert sorted(lock.name or "" for lock in every) == sorted(names)
    assert sorted(lock.name or "" for lock in reports) == sorted(names[:25])
    assert [lock.key for lock in held_by] == [f"{prefix}:export-3"]
    assert all(lock.holder_task_id == holders[lock.name or ""] for lock in every)


async def test_release_checks_the_owner(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task(deduplication_key="k")
    async def job() -> None: ...

    await job.kiq()
    locks = dedup_middleware(broker).locks
    lock = await locks.get("k")
    assert lock is not None
    assert not await locks.release(lock, owner="not-the-owner")
    assert await lock_keys(redis_client, prefix) == [lock.key]
    assert await locks.release(lock)
    assert await lock_keys(redis_client, prefix) == []
    assert not await locks.release(lock)  # gone
    # A new send took the key since it was read: the lock read then is not it.
    await job.kiq()
    assert not await locks.release(lock)
    assert await lock_keys(redis_client, prefix) == [lock.key]
    assert await locks.release("k")  # by key: the owner it has now


async def test_release_takes_the_merged_arguments(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task(deduplication_key_fields=["user_id"], deduplication_merge="latest")
    async def sync_profile(user_id: int, fields: list[str]) -> None: ...

    await sync_profile.kiq(user_id=7, fields=["a"])
    await sync_profile.kiq(user_id=7, fields=["b"])  # merged into the first
    (key,) = await lock_keys(redis_client, prefix)
    written = [key async for key in redis_client.scan_iter(match=f"{prefix}[:#]*")]
    name = key.removeprefix(f"{prefix}:")
    assert sorted(written) == sorted([key, f"{prefix}#merge:{name}"])
    assert await dedup_middleware(broker).locks.release(key)
    assert [key async for key in redis_client.scan_iter(match=f"{prefix}[:#]*")] == []


async def test_key_for_is_the_key_kiq_took(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task
    async def send_email(user_id: int, *, template: str = "welcome") -> None: ...

    @broker.task(deduplication_key_fields=["user_id"])
    async def sync_user(user_id: int, reason: str = "") -> None: ...

    locks = dedup_middleware(broker).locks
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
        (send_email, (42,), {"template": "reset"}),
        (sync_user, (), {"user_id": 7, "reason": "signup"}),
        (send_email.kicker().with_labels(deduplication_key="once"), (1,), {}),
    ]
    for task, args, kwargs in calls:
        await task.kiq(*args, **kwargs)
        with pytest.raises(DuplicateTaskError) as refused:
            await task.kiq(*args, **kwargs)
        assert locks.key_for(task, *args, **kwargs) == refused.value.key
    off = send_email.kicker().with_labels(deduplication=False)
    assert locks.key_for(off, 1) is None


async def test_key_for_needs_the_locks_of_a_middleware(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis
) -> None:
    @broker.task
    async def job(n: int) -> None: ...

    with pytest.raises(TypeError, match=r"RedisDeduplicationMiddleware\.locks"):
        Locks(redis_client).key_for(job, 1)


async def test_what_the_value_of_a_lock_says(
    redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    values = {
        "queued": f"tok {_HOLDER}",
        "running": f"~run.abcd {_HOLDER} +",
        "succeeded": f"=run.abcd {_HOLDER}",
        "foreign": "not-a-lock",
        "forever": f"tok {_HOLDER}",
    }
    for name, value in values.items():
        await redis_client.set(f"{prefix}:{name}", value, px=None if name == "forever" else 60_000)
    locks = Locks(redis_client, prefix=prefix)
    read = {name: await locks.get(name) for name in values}
    assert {name: (lock.running, lock.succeeded) for name, lock in read.items() if lock} == {
        "queued": (False, False),
        "running": (True, False),
        "succeeded": (False, True),
        "foreign": (False, False),
        "forever": (False, False),
    }
    assert read["running"] is not None
    assert (read["running"].owner, read["running"].holder_task_id) == ("~run.abcd", _HOLDER)
    assert read["foreign"] is not None
    assert (read["foreign"].owner, read["foreign"].holder_task_id) == (None, None)
    assert not await locks.release(read["foreign"])
    assert read["forever"] is not None
    assert (read["forever"].ttl, read["forever"].ttl_readable) == (None, True)


async def test_purge_deletes_every_key_of_the_prefix_and_no_other(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, redis_url: str, prefix: str
) -> None:
    @broker.task(deduplication_key_fields=["user_id"], deduplication_merge="latest")
    async def sync_profile(user_id: int, fields: list[str]) -> None: ...

    await sync_profile.kiq(user_id=7, fields=["a"])
    await sync_profile.kiq(user_id=7, fields=["b"])  # merged into the first
    await redis_client.set(f"{prefix}#fence", 3)
    other = f"{prefix}-other:kept"
    await redis_client.set(other, "x", px=60_000)
    try:
        async with Locks.from_url(redis_url, prefix=prefix) as locks:
            assert await locks.purge() == 3
        assert [key async for key in redis_client.scan_iter(match=f"{prefix}[:#]*")] == []
        assert await redis_client.get(other) == "x"
    finally:
        await redis_client.delete(other)


async def test_a_page_of_locks_is_bounded_and_goes_on_where_it_stopped(
    broker: HoldingBroker,
) -> None:
    @broker.task
    async def job(n: int) -> None: ...

    await asyncio.gather(*(job.kiq(n) for n in range(25)))
    locks = dedup_middleware(broker).locks
    one_scan, cursor = await locks.page(limit=1, max_scans=1)
    assert 1 <= len(one_scan) <= 25
    rest: list[LockInfo] = []
    while cursor is not None:
        page, cursor = await locks.page(cursor=cursor, limit=5)
        rest += page
    assert len({lock.key for lock in [*one_scan, *rest]}) == 25
    with pytest.raises(InvalidArgumentError, match="limit=0, max_scans=1"):
        await locks.page(limit=0)
    with pytest.raises(InvalidArgumentError, match="cursor '12x'"):
        await locks.page(cursor="12x")
