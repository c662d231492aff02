"""Faults once the task is queued: Redis lost (4) and Redis restarted (5)."""

from __future__ import annotations

import asyncio
import time

import pytest

from taskiq_deduplication import DuplicateTaskError
from tests._server import Server
from tests._tasks import echo_task, held_run, held_task
from tests.faults._harness import GRACE_TTL_MS, LogRecords, admin, lock_keys, wait_until
from tests.faults.conftest import BrokerMaker, Recovery

pytestmark = pytest.mark.timeout(30)


# 4. Redis lost after queueing


async def test_redis_lost_right_after_the_send_is_logged_and_the_result_delivered(
    make_fast_broker: BrokerMaker, server: Server, logs: LogRecords, recovery: Recovery
) -> None:
    async def redis_dies() -> None:  # the broker has the message; Redis goes away
        server.stop()

    # Not exclusive: an exclusive run would wait for Redis, at most a lease,
    # before it begins (tests/test_exclusive.py).
    broker = await make_fast_broker(
        on_kick=redis_dies,
        default_ttl=30,
        heartbeat_interval=0.3,
        default_exclusive=False,
    )

    @broker.task
    async def work(x: int) -> int:
        await asyncio.sleep(1.0)  # long enough for heartbeat refreshes to fail
        return x

    handle = await work.kiq(x=1)  # the extension after the send fails: not raised
    result = await handle.wait_result(timeout=10)
    assert not result.is_err
    assert result.return_value == 1
    await broker.wait_all()  # no exception escaped into the worker

    assert logs.warnings("Could not extend lock")
    assert logs.warnings("Could not re-assert lock")
    assert logs.warnings("Could not refresh")
    assert logs.warnings("Could not release lock")

    await asyncio.to_thread(server.start)
    up_at = time.monotonic()
    again = await work.kiq(x=1)
    recovery("Redis lost after queueing: server back -> kiq succeeds", time.monotonic() - up_at)
    assert (await again.wait_result(timeout=5)).return_value == 1


async def test_redis_lost_while_the_task_runs_is_logged_and_the_result_delivered(
    make_fast_broker: BrokerMaker, server: Server, logs: LogRecords
) -> None:
    broker = await make_fast_broker(default_ttl=3, heartbeat_interval=0.3)
    _, gate, handle = await held_run(broker)
    server.stop()
    await asyncio.sleep(0.8)  # heartbeat refreshes fail meanwhile
    gate.finish.set()
    result = await handle.wait_result(timeout=10)
    assert result.return_value == 1
    await broker.wait_all()
    assert logs.warnings("Could not refresh")
    assert logs.warnings("Could not release lock")


async def test_redis_hung_while_the_task_runs_lets_the_lock_expire_on_its_ttl(
    make_fast_broker: BrokerMaker, server: Server, prefix: str, logs: LogRecords
) -> None:
    # Paused, the server keeps its data: the lock is still there when it wakes,
    # and must go away by itself (released late, or expired on its 3 s TTL).
    broker = await make_fast_broker(default_ttl=3, heartbeat_interval=0.3)
    _, gate, handle = await held_run(broker)
    server.pause()
    try:
        await asyncio.sleep(0.7)  # a refresh times out
        gate.finish.set()
        result = await handle.wait_result(timeout=10)  # the release times out too
        assert result.return_value == 1
        await broker.wait_all()
    finally:
        server.resume()
    assert logs.warnings("Could not refresh")
    assert logs.warnings("Could not release lock")
    with admin(server.port) as client:
        for key in lock_keys(client, prefix):
            assert client.pttl(key) <= 3000
        gone_in = await wait_until(lambda: _no_locks(server, prefix), timeout=5)
    assert gone_in <= 3.5


# 5. Redis restarted while tasks run (data lost)


async def test_heartbeat_takes_the_lock_back_after_a_restart(
    make_fast_broker: BrokerMaker,
    server: Server,
    prefix: str,
    logs: LogRecords,
    recovery: Recovery,
) -> None:
    broker = await make_fast_broker(default_ttl=3)  # refresh every 1 s
    work, gate, handle = await held_run(broker)
    await asyncio.to_thread(server.restart)
    restarted_at = time.monotonic()
    with admin(server.port) as client:
        assert lock_keys(client, prefix) == []  # the data is gone
    await wait_until(lambda: _has_locks(server, prefix), timeout=5)
    recovery("Redis restarted: heartbeat takes the lock back", time.monotonic() - restarted_at)
    # The key is back in Redis as soon as the script ran; the warning follows
    # once this process has read the script's reply.
    await wait_until(lambda: _async(bool(logs.warnings("had vanished; taken back"))), timeout=5)
    with pytest.raises(DuplicateTaskError) as caught:
        await work.kiq(x=1)
    assert caught.value.holder_task_id == handle.task_id

    gate.finish.set()
    result = await handle.wait_result(timeout=5)
    assert result.return_value == 1
    await broker.wait_all()
    assert await wait_until(lambda: _no_locks(server, prefix), timeout=2) < 2


async def test_reassert_at_execution_takes_back_a_lock_lost_while_queued(
    make_fast_broker: BrokerMaker, server: Server, prefix: str, logs: LogRecords
) -> None:
    broker = await make_fast_broker(hold=True, default_ttl=30)
    work, gate = held_task(broker)
    running, finish = gate.started, gate.finish

    handle = await work.kiq(x=1)
    await asyncio.to_thread(server.restart)  # the queued task's lock is lost
    broker.deliver_held()
    await asyncio.wait_for(running.wait(), 5)
    assert logs.warnings("had expired while the task was queued; taken back")
    with admin(server.port) as client:
        (key,) = lock_keys(client, prefix)
        assert str(client.get(key)).endswith(f" {handle.task_id}")
        assert 0 < client.pttl(key) <= 30_000
    finish.set()
    assert (await handle.wait_result(timeout=5)).return_value == 1
    await broker.wait_all()
    assert await _no_locks(server, prefix)


async def test_a_task_whose_lock_another_send_took_while_queued_leaves_it_alone(
    make_fast_broker: BrokerMaker, server: Server, prefix: str, logs: LogRecords
) -> None:
    broker = await make_fast_broker(hold=True, default_ttl=30, default_exclusive=False)

    work = echo_task(broker)

    first = await work.kiq(x=1)
    await asyncio.to_thread(server.restart)
    second = await work.kiq(x=1)  # the lock is gone, so this send takes it
    broker.deliver_held(first.task_id)
    assert (await first.wait_result(timeout=5)).return_value == 1
    await broker.wait_all()
    assert logs.warnings("now holds its lock")
    with admin(server.port) as client:
        (key,) = lock_keys(client, prefix)
        assert str(client.get(key)).endswith(f" {second.task_id}")  # untouched
        assert client.pttl(key) > GRACE_TTL_MS  # still its full TTL
    broker.deliver_held(second.task_id)
    assert (await second.wait_result(timeout=5)).return_value == 1
    await broker.wait_all()
    assert await _no_locks(server, prefix)


async def test_heartbeat_gives_up_a_lock_another_send_took_after_a_restart(
    make_fast_broker: BrokerMaker, server: Server, prefix: str, logs: LogRecords
) -> None:
    broker = await make_fast_broker(default_ttl=6, heartbeat_interval=2)
    work, gate, first = await held_run(broker)
    await asyncio.to_thread(server.restart)  # well before the first refresh, at 2 s
    broker.hold = True
    second = await work.kiq(x=1)  # queued, not running
    await wait_until(
        lambda: _async(bool(logs.warnings("no longer refreshing it"))), timeout=5, interval=0.05
    )
    gate.finish.set()
    assert (await first.wait_result(timeout=5)).return_value == 1
    await broker.wait_all()
    with admin(server.port) as client:
        (key,) = lock_keys(client, prefix)
        assert str(client.get(key)).endswith(f" {second.task_id}")


async def _async(value: bool) -> bool:
    return value


async def _has_locks(server: Server, prefix: str) -> bool:
    with admin(server.port) as client:
        return bool(lock_keys(client, prefix))


async def _no_locks(server: Server, prefix: str) -> bool:
    return not await _has_locks(server, prefix)


@pytest.mark.parametrize("fault", ["pause", "stop"])
async def test_shutdown_with_redis_gone_returns_within_the_timeout(
    fault: str, make_fast_broker: BrokerMaker, server: Server
) -> None:
    async def redis_goes() -> None:  # with the extension after the send still to go
        if fault == "pause":
            server.pause()
        else:
            server.stop()

    broker = await make_fast_broker(on_kick=redis_goes, default_ttl=30)

    work = echo_task(broker)

    broker.hold = True  # nothing runs: only the send's own commands are left
    try:
        await work.kiq(x=1)
        started = time.monotonic()
        await asyncio.wait_for(broker.shutdown(), timeout=10)
        assert time.monotonic() - started < 3.0
    finally:
        if fault == "pause":
            server.resume()
