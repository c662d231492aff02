"""Lock events, as a subscriber sees them, against a real Redis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio
from taskiq import SimpleRetryMiddleware

from taskiq_deduplication import (
    DuplicateTaskError,
    LockEvent,
    LockEventKind,
    RedisDeduplicationMiddleware,
    kiq_or_join,
)
from tests._brokers import BrokerFactory, HoldingBroker
from tests._locks import lock_keys
from tests._middlewares import MiddlewareFactory, dedup_middleware

LOCKED, DUPLICATE, OFF = LockEventKind.LOCKED, LockEventKind.DUPLICATE, LockEventKind.OFF
RELEASED, TAKEN_BACK, LOST = LockEventKind.RELEASED, LockEventKind.TAKEN_BACK, LockEventKind.LOST


def record(middleware: RedisDeduplicationMiddleware) -> list[LockEvent]:
    events: list[LockEvent] = []
    middleware.subscribe(events.append)
    return events


async def recorded(
    make_broker: BrokerFactory, **options: Any
) -> tuple[HoldingBroker, list[LockEvent]]:
    """A started ``HoldingBroker`` with a middleware built with ``options``, and its events.

    The events are those its deduplication middleware tells from now on.
    """
    broker = await make_broker(broker_class=HoldingBroker, **options)
    return broker, record(dedup_middleware(broker))


async def test_a_task_s_life_is_told_as_locked_then_released(make_broker: BrokerFactory) -> None:
    broker, events = await recorded(make_broker)
    middleware = dedup_middleware(broker)

    @broker.task
    async def job(n: int) -> None: ...

    sent = await job.kiq(1)
    refused = job.kicker().with_task_id("second")
    with pytest.raises(DuplicateTaskError):
        await refused.kiq(1)
    await broker.deliver()
    (key,) = {event.key for event in events}
    assert events == [
        LockEvent(LOCKED, job.task_name, sent.task_id, key, sent.task_id),
        LockEvent(DUPLICATE, job.task_name, "second", key, sent.task_id, holder_sent=True),
        LockEvent(RELEASED, job.task_name, sent.task_id, key, None),
    ]
    assert key is not None
    assert key.startswith(middleware.key_prefix)


async def test_a_send_without_deduplication_is_off(
    make_middleware: MiddlewareFactory, make_broker: BrokerFactory
) -> None:
    middleware = make_middleware()
    events = record(middleware)
    broker = await make_broker(middlewares=[middleware])

    @broker.task(deduplication=False)
    async def job() -> None: ...

    sent = await job.kiq()
    await broker.wait_all()
    assert events == [LockEvent(OFF, job.task_name, sent.task_id, None, None)]


@pytest.mark.parametrize("merging", [False, True], ids=["plain", "merging"])
async def test_fail_open_tells_the_redis_error(merging: bool) -> None:
    dead = "redis://127.0.0.1:1/0?socket_connect_timeout=0.5"
    middleware = RedisDeduplicationMiddleware(redis_url=dead, fail_open=True)
    events = record(middleware)
    broker = HoldingBroker().with_middlewares(middleware)
    # A task that merges its calls takes its lock with a script of its own.
    labels = {"deduplication_merge": "latest"} if merging else {}

    @broker.task(task_name=None, **labels)
    async def job() -> None: ...

    sent = await job.kiq()
    (event,) = events
    assert (event.kind, event.task_id, event.holder_task_id) == (
        LockEventKind.FAIL_OPEN,
        sent.task_id,
        None,
    )
    assert isinstance(event.error, OSError | redis.exceptions.RedisError)
    assert event.key is not None


async def test_a_run_that_finds_its_lock_gone_takes_it_back(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker, events = await recorded(make_broker)

    @broker.task
    async def job() -> None: ...

    sent = await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    await redis_client.delete(key)  # as if it expired in the queue
    await broker.deliver()
    assert [(e.kind, e.holder_task_id) for e in events] == [
        (LOCKED, sent.task_id),
        (TAKEN_BACK, sent.task_id),
        (RELEASED, None),
    ]


async def test_a_run_whose_lock_another_task_holds_tells_it_lost(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker, events = await recorded(make_broker, default_exclusive=False)

    @broker.task
    async def job() -> None: ...

    await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    await redis_client.set(key, "othertoken other-task", px=30_000)
    await broker.deliver()
    # Lost at the start, and the end leaves the other task's lock alone: no release.
    assert [(e.kind, e.key, e.holder_task_id) for e in events][1:] == [(LOST, key, "other-task")]


async def test_the_heartbeat_tells_what_it_finds(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker, events = await recorded(make_broker, default_ttl=2, heartbeat_interval=0.2)

    @broker.task
    async def slow() -> None:
        (key,) = await lock_keys(redis_client, prefix)
        await redis_client.delete(key)
        await _until(lambda: TAKEN_BACK in kinds(events))
        await redis_client.set(key, "othertoken other-task", px=10_000)
        await _until(lambda: LOST in kinds(events))

    sent = await slow.kiq()
    await broker.deliver()
    assert kinds(events) == [LOCKED, TAKEN_BACK, LOST]
    assert events[1].holder_task_id == sent.task_id
    assert events[2].holder_task_id == "other-task"


async def test_a_retry_that_takes_the_lock_over_is_locked_again(
    make_middleware: MiddlewareFactory, make_broker: BrokerFactory
) -> None:
    middleware = make_middleware()
    events = record(middleware)
    broker = await make_broker(
        middlewares=[SimpleRetryMiddleware(default_retry_count=3), middleware]
    )
    attempts: list[int] = []

    @broker.task(retry_on_error=True)
    async def flaky() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError

    sent = await flaky.kiq()
    await _until(lambda: RELEASED in kinds(events))
    await broker.wait_all()
    assert kinds(events) == [LOCKED, LOCKED, RELEASED]
    assert {e.task_id for e in events} == {sent.task_id}


async def test_a_subscriber_that_raises_breaks_neither_send_nor_run(
    make_middleware: MiddlewareFactory,
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    middleware = make_middleware()

    def broken(event: LockEvent) -> None:
        raise ZeroDivisionError(event.kind.value)

    middleware.subscribe(broken)
    events = record(middleware)  # a later subscriber still gets every event
    broker = await make_broker(middlewares=[middleware], broker_class=HoldingBroker)
    ran: list[str] = []

    @broker.task
    async def job() -> str:
        ran.append("ran")
        return "done"

    caplog.set_level(logging.ERROR, logger="taskiq_deduplication")
    handle = await job.kiq()
    with pytest.raises(DuplicateTaskError):
        await job.kiq()
    await broker.deliver()
    assert ran == ["ran"]
    assert (await handle.wait_result(timeout=5)).return_value == "done"
    assert kinds(events) == [LOCKED, DUPLICATE, RELEASED]
    failures = [r for r in caplog.records if "subscriber" in r.getMessage()]
    assert len(failures) == 3
    assert all(r.exc_info is not None for r in failures)
    assert await lock_keys(redis_client, prefix) == []


async def test_unsubscribing_stops_the_events(
    make_middleware: MiddlewareFactory, make_broker: BrokerFactory
) -> None:
    middleware = make_middleware()
    events: list[LockEvent] = []
    unsubscribe = middleware.subscribe(events.append)
    broker = await make_broker(middlewares=[middleware])

    @broker.task
    async def job(n: int) -> None: ...

    await job.kiq(1)
    unsubscribe()
    unsubscribe()  # twice is harmless
    await job.kiq(2)
    await broker.wait_all()
    assert kinds(events) == [LOCKED]


def test_a_subscriber_must_be_callable(make_middleware: MiddlewareFactory) -> None:
    with pytest.raises(TypeError, match="callable"):
        make_middleware().subscribe("print")  # type: ignore[arg-type]


def test_every_kind_is_its_own_string() -> None:
    assert [kind.value for kind in LockEventKind] == [
        "locked",
        "duplicate",
        "merged",
        "joined",
        "fail_open",
        "off",
        "released",
        "taken_back",
        "lost",
        "waiting",
        "skipped",
        "limited",
        "waited",
    ]
    assert str.__eq__(LockEventKind.TAKEN_BACK, "taken_back")


def kinds(events: list[LockEvent]) -> list[LockEventKind]:
    return [event.kind for event in events]


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_merged_call_is_told_as_merged_with_the_queued_holder(
    make_broker: BrokerFactory,
) -> None:
    broker, events = await recorded(make_broker)

    @broker.task(deduplication_key_fields=["user_id"], deduplication_merge="latest")
    async def sync_profile(user_id: int, fields: list[str]) -> None: ...

    sent = await sync_profile.kiq(user_id=1, fields=["name"])
    # No refusal: kiq() hands back the holder, which runs with the call's arguments.
    handle = await sync_profile.kicker().with_task_id("later").kiq(user_id=1, fields=["email"])
    assert handle.task_id == sent.task_id
    assert kinds(events) == [LOCKED, LockEventKind.MERGED]
    assert events[1].task_id == "later"
    assert events[1].holder_task_id == sent.task_id
    await broker.deliver()


async def test_a_join_is_told_as_joined_and_a_refusal_as_duplicate(
    make_broker: BrokerFactory,
) -> None:
    broker, events = await recorded(make_broker)

    @broker.task(deduplication_key_fields=["user_id"])
    async def build_report(user_id: int, tag: str) -> None: ...

    sent = await build_report.kiq(user_id=1, tag="a")
    handle = await kiq_or_join(build_report.kicker().with_task_id("joiner"), user_id=1, tag="b")
    assert handle.joined
    with pytest.raises(DuplicateTaskError):
        await build_report.kicker().with_task_id("refused").kiq(user_id=1, tag="c")
    assert kinds(events) == [LOCKED, LockEventKind.JOINED, DUPLICATE]
    assert [(e.task_id, e.holder_task_id) for e in events[1:]] == [
        ("joiner", sent.task_id),
        ("refused", sent.task_id),
    ]
    await broker.deliver()
