"""Faults at send time: Redis down (2), Redis hung (3), broker down (7)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.exceptions
from redis.asyncio import Redis
from taskiq.exceptions import SendTaskError
from taskiq_redis import ListQueueBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware
from tests._brokers import holds_no_lock
from tests._server import Server, free_port
from tests._tasks import echo_task, held_task, warmed_echo
from tests.faults._harness import GRACE_TTL_MS, LogRecords, admin, lock_keys
from tests.faults.conftest import FAST, BrokerMaker, Recovery

pytestmark = pytest.mark.timeout(30)


# 2. Redis down at send


async def test_redis_down_at_send_fails_the_kiq_and_sends_nothing(
    make_recording_broker: BrokerMaker, server: Server, prefix: str, recovery: Recovery
) -> None:
    broker = await make_recording_broker(f"{server.url}?{FAST}")
    ran: list[int] = []

    @broker.task
    async def work(x: int) -> int:
        ran.append(x)
        return x

    server.stop()
    started = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        await work.kiq(x=1)
    assert time.monotonic() - started < 3.0
    assert broker.sent == []
    await broker.wait_all()
    assert ran == []

    await asyncio.to_thread(server.start)  # same port, empty
    up_at = time.monotonic()
    handle = await work.kiq(x=1)  # no restart of the application
    recovery("Redis down at send: server back -> kiq succeeds", time.monotonic() - up_at)
    assert (await handle.wait_result(timeout=5)).return_value == 1
    with admin(server.port) as client:
        assert lock_keys(client, prefix) == []


async def test_redis_down_at_send_with_fail_open_sends_without_a_lock(
    make_recording_broker: BrokerMaker, server: Server, logs: LogRecords
) -> None:
    broker = await make_recording_broker(f"{server.url}?{FAST}", fail_open=True)

    work = echo_task(broker)

    server.stop()
    first = await work.kiq(x=1)
    second = await work.kiq(x=1)  # while Redis is down, duplicates get through
    assert [m.task_id for m in broker.sent] == [first.task_id, second.task_id]
    assert all(holds_no_lock(m.labels) for m in broker.sent)
    assert (await first.wait_result(timeout=5)).return_value == 1
    assert (await second.wait_result(timeout=5)).return_value == 1
    fail_open_warnings = logs.warnings("fail_open")
    assert len(fail_open_warnings) == 2
    assert all("work" in m for m in fail_open_warnings)


async def test_a_duplicate_seen_while_redis_is_up_raises_even_with_fail_open(
    make_recording_broker: BrokerMaker, server: Server
) -> None:
    broker = await make_recording_broker(f"{server.url}?{FAST}", fail_open=True)
    work, gate = held_task(broker)
    release = gate.finish

    first = await work.kiq(x=1)
    with pytest.raises(DuplicateTaskError) as caught:
        await work.kiq(x=1)
    assert caught.value.holder_task_id == first.task_id
    assert len(broker.sent) == 1
    release.set()
    assert (await first.wait_result(timeout=5)).return_value == 1


# 3. Redis hung (SIGSTOP)


def test_url_query_overrides_the_default_timeouts(server: Server) -> None:
    default = RedisDeduplicationMiddleware(redis_url=server.url)
    tuned = RedisDeduplicationMiddleware(
        redis_url=f"{server.url}?socket_timeout=0.5&socket_connect_timeout=0.5"
    )
    assert _connection_option(default, "socket_timeout") == 5.0
    assert _connection_option(default, "socket_connect_timeout") == 5.0
    assert _connection_option(tuned, "socket_timeout") == 0.5
    assert _connection_option(tuned, "socket_connect_timeout") == 0.5


async def test_redis_hung_at_send_fails_within_the_configured_timeout(
    make_recording_broker: BrokerMaker, server: Server, recovery: Recovery
) -> None:
    broker = await make_recording_broker(
        f"{server.url}?socket_timeout=0.5&socket_connect_timeout=0.5"
    )

    work = await warmed_echo(broker)  # a warm connection
    server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            await work.kiq(x=1)
        elapsed = time.monotonic() - started
        assert 0.4 <= elapsed < 3.0, elapsed
        assert len(broker.sent) == 1  # only the warm-up
    finally:
        server.resume()
    resumed_at = time.monotonic()
    handle = await work.kiq(x=2)
    recovery("Redis hung at send: resumed -> kiq succeeds", time.monotonic() - resumed_at)
    assert (await handle.wait_result(timeout=5)).return_value == 2


async def test_a_failed_send_to_a_hung_redis_leaves_at_most_a_grace_lock(
    make_recording_broker: BrokerMaker, server: Server, prefix: str, recovery: Recovery
) -> None:
    # The acquire was written to the socket before the timeout; the server may
    # still run it once it wakes. Whatever it leaves must be a grace-TTL lock.
    broker = await make_recording_broker(f"{server.url}?{FAST}")

    work = await warmed_echo(broker)  # a warm connection
    server.pause()
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            await work.kiq(x=1)
    finally:
        server.resume()
    await asyncio.sleep(0.2)  # let the woken server run what it had received
    with admin(server.port) as client:
        for key in lock_keys(client, prefix):
            pttl = client.pttl(key)
            assert 0 < pttl <= GRACE_TTL_MS
            recovery("hung send that raised: the lock it left frees itself in", pttl / 1000)


async def test_redis_hung_at_send_with_fail_open_sends_within_the_timeout(
    make_recording_broker: BrokerMaker, server: Server, logs: LogRecords
) -> None:
    broker = await make_recording_broker(f"{server.url}?{FAST}", fail_open=True)

    work = await warmed_echo(broker)  # a warm connection
    server.pause()
    try:
        started = time.monotonic()
        handle = await work.kiq(x=1)
        assert time.monotonic() - started < 3.0
        (message,) = [m for m in broker.sent if m.task_id == handle.task_id]
        assert holds_no_lock(message.labels)
        assert logs.warnings("fail_open")
    finally:
        server.resume()
    assert (await handle.wait_result(timeout=5)).return_value == 1


async def test_concurrent_sends_to_a_hung_redis_all_fail_within_one_timeout(
    make_recording_broker: BrokerMaker, server: Server
) -> None:
    broker = await make_recording_broker(f"{server.url}?{FAST}")

    work = await warmed_echo(broker)  # a warm connection
    server.pause()
    try:
        started = time.monotonic()
        outcomes = await asyncio.gather(
            *(work.kiq(x=i) for i in range(1, 21)), return_exceptions=True
        )
        elapsed = time.monotonic() - started
    finally:
        server.resume()
    assert all(isinstance(o, redis.exceptions.TimeoutError) for o in outcomes), outcomes
    assert elapsed < 3.0, elapsed  # batched: one timeout, not one per send
    assert len(broker.sent) == 1


@pytest.mark.timeout(40)
async def test_the_default_timeout_bounds_a_send_to_a_hung_redis(
    make_recording_broker: BrokerMaker, server: Server
) -> None:
    broker = await make_recording_broker(server.url)  # no query: the 5 s defaults

    work = await warmed_echo(broker)  # a warm connection
    server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            await asyncio.wait_for(work.kiq(x=1), timeout=20)
        assert 4.0 <= time.monotonic() - started < 10.0
    finally:
        server.resume()


# 7. Broker down at send


@pytest.mark.parametrize("ttl", [None, 3])
async def test_a_send_the_broker_refuses_releases_its_lock_at_once(
    make_recording_broker: BrokerMaker, server: Server, prefix: str, ttl: int | None
) -> None:
    broker = await make_recording_broker(
        f"{server.url}?{FAST}", kick_error=ConnectionError("broker unreachable"), default_ttl=300
    )

    work = echo_task(broker)

    kicker = work.kicker() if ttl is None else work.kicker().with_labels(deduplication_ttl=ttl)
    with pytest.raises(SendTaskError):
        await kicker.kiq(x=1)
    # The caller's own retry is not refused by a lock naming a task never queued.
    broker.kick_error = None
    sent = await kicker.kiq(x=1)
    assert [m.task_id for m in broker.sent] == [sent.task_id]


async def test_a_send_cut_short_mid_kick_leaves_at_most_a_grace_lock(
    make_recording_broker: BrokerMaker, server: Server, prefix: str
) -> None:
    # Nothing tells the middleware how a cancelled send ended (as with a process
    # that dies mid-send): the grace TTL is the bound.
    started = asyncio.Event()

    async def hang() -> None:
        started.set()
        await asyncio.Event().wait()

    broker = await make_recording_broker(
        f"{server.url}?{FAST}", hold=True, on_kick=hang, default_ttl=300
    )

    work = echo_task(broker)

    send = asyncio.create_task(work.kiq(x=1))
    await started.wait()
    send.cancel()
    with pytest.raises(asyncio.CancelledError):
        await send
    with admin(server.port) as client:
        (key,) = lock_keys(client, prefix)
        assert 0 < client.pttl(key) <= GRACE_TTL_MS


async def test_a_list_queue_broker_on_a_dead_port_releases_the_lock_at_once(
    server: Server, prefix: str
) -> None:
    broker = ListQueueBroker(f"redis://127.0.0.1:{free_port()}/0?{FAST}")
    middleware = RedisDeduplicationMiddleware(
        redis_url=f"{server.url}?{FAST}", key_prefix=prefix, default_ttl=600
    )
    broker.with_middlewares(middleware)
    await middleware.startup()  # the broker itself is down: start only the middleware
    try:
        work = echo_task(broker)

        for _ in range(2):  # the second send is no duplicate of the first: it failed too
            with pytest.raises(SendTaskError):
                await work.kiq(x=1)
        await middleware.shutdown()  # sends what is queued: the releases
        with admin(server.port) as client:
            assert lock_keys(client, prefix) == []
    finally:
        await middleware.shutdown()
        await broker.connection_pool.disconnect()


def _connection_option(middleware: RedisDeduplicationMiddleware, name: str) -> object:
    client, _ = middleware._new_client()
    assert isinstance(client, Redis)
    return client.connection_pool.connection_kwargs[name]
