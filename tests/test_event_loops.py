"""One middleware, several event loops and threads, and the broker it belongs to.

A sync task that enqueues with ``asyncio.run``, a script that calls
``asyncio.run`` per request, threads with loops of their own: each loop gets a
state of its own, whose heartbeat ends with its tasks and whose connections
close with the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import warnings
import weakref
from typing import Any

import pytest
import redis
import redis.asyncio
from taskiq import BrokerMessage, InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware
from taskiq_deduplication.middleware import loop_states
from tests._brokers import BrokerFactory, HoldingBroker
from tests._locks import lock_keys, wait_until
from tests._middlewares import MiddlewareFactory
from tests._server import Server


class _RunsAllButOther(InMemoryBroker):
    """Runs every task but ``other``, whose messages stay queued (nobody consumes them)."""

    def __init__(self, await_inplace: bool = False) -> None:
        super().__init__(await_inplace=await_inplace)
        self.queued: list[BrokerMessage] = []

    async def kick(self, message: BrokerMessage) -> None:
        if message.task_name.endswith(":other"):
            self.queued.append(message)
            return
        await super().kick(message)


async def test_a_sync_task_that_enqueues_with_asyncio_run_leaves_no_lock_refreshed(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    # The main loop's heartbeat keeps long_job's lock while a second loop, made
    # by asyncio.run in taskiq's thread pool, sends a task of its own.
    broker = await make_broker(broker_class=_RunsAllButOther, default_ttl=2)

    @broker.task(task_name="loops:long_job")
    async def long_job() -> None:
        await asyncio.sleep(1.3)  # past its first refresh at 1 s

    @broker.task(task_name="loops:other")
    async def other(x: int) -> None: ...

    @broker.task(task_name="loops:sync_job")
    def sync_job() -> None:
        asyncio.run(other.kiq(x=1))

    await long_job.kiq()
    await asyncio.sleep(0.3)
    await sync_job.kiq()
    await broker.wait_all()
    assert len(broker.queued) == 1
    # other's lock is held (its message waits in the queue), long_job's is gone;
    # once the queued lock has expired nothing may bring either back.
    await asyncio.sleep(2.5)
    assert await lock_keys(redis_client, prefix) == []
    await long_job.kiq()  # accepted: the run that held its lock ended long ago
    await other.kiq(x=1)  # accepted: the queued copy's lock expired on its TTL


def test_successive_asyncio_run_calls_leave_no_connection_open(server: Server) -> None:
    middleware = RedisDeduplicationMiddleware(redis_url=server.url, key_prefix="seq")
    broker = HoldingBroker().with_middlewares(middleware)

    @broker.task
    async def job(n: int) -> None: ...

    admin = redis.Redis.from_url(server.url)
    try:
        asyncio.run(broker.startup())
        before = len(admin.client_list())
        for n in range(20):
            asyncio.run(job.kiq(n=n))
        assert len(admin.client_list()) == before
        assert len(admin.keys("seq:*")) == 20  # each call took its lock
    finally:
        asyncio.run(broker.shutdown())
        admin.close()


def test_threads_with_loops_of_their_own_each_lock_and_close_cleanly(server: Server) -> None:
    middleware = RedisDeduplicationMiddleware(redis_url=server.url, key_prefix="threads")
    broker = HoldingBroker().with_middlewares(middleware)

    @broker.task
    async def job(n: int) -> None: ...

    async def send_twice(n: int) -> str:
        await job.kiq(n=n)
        try:
            await job.kiq(n=n)
        except DuplicateTaskError as error:
            return f"refused, held by {error.holder_task_id is not None}"
        return "accepted twice"

    admin = redis.Redis.from_url(server.url)
    try:
        before = len(admin.client_list())
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            outcomes = list(pool.map(lambda n: asyncio.run(send_twice(n)), range(8)))
        assert outcomes == ["refused, held by True"] * 8
        assert len(admin.keys("threads:*")) == 8
        assert len(admin.client_list()) == before
        assert len(loop_states(middleware)) == 0  # every loop's state closed with its loop
    finally:
        admin.close()


async def test_a_loop_closed_without_shutting_down_its_generators_is_dropped(
    make_middleware: MiddlewareFactory, prefix: str, redis_client: redis.asyncio.Redis
) -> None:
    middleware = make_middleware()
    broker = HoldingBroker().with_middlewares(middleware)

    @broker.task
    async def job(n: int) -> None: ...

    def in_a_bare_loop() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(job.kiq(n=1))
        finally:
            loop.close()  # no shutdown_asyncgens(): its state stays behind, unusable

    await asyncio.get_running_loop().run_in_executor(None, in_a_bare_loop)
    assert len(loop_states(middleware)) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        await middleware.startup()  # a state for this loop; the closed loop's goes
        assert len(loop_states(middleware)) == 1
        # The sender task that loop made in its last turn never ran; dropped with
        # its state, it is not "never awaited" whenever the collector finds it.
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    await job.kiq(n=2)
    assert len(await lock_keys(redis_client, prefix)) == 2
    await middleware.shutdown()
    assert len(loop_states(middleware)) == 0


# One middleware, one broker


def test_a_middleware_on_a_second_broker_is_refused(
    make_middleware: MiddlewareFactory,
) -> None:
    middleware = make_middleware()
    first = InMemoryBroker().with_middlewares(middleware)
    with pytest.raises(ValueError, match="registered on InMemoryBroker already"):
        InMemoryBroker().with_middlewares(middleware)
    first.add_middlewares(middleware)  # the same broker again is harmless


async def test_two_brokers_with_middlewares_of_their_own_share_locks_and_stop_apart(
    make_middleware: MiddlewareFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    first = InMemoryBroker().with_middlewares(make_middleware(default_ttl=2))
    second = InMemoryBroker().with_middlewares(make_middleware(default_ttl=2))
    gate = asyncio.Event()

    @second.task(task_name="brokers:long_job")
    async def long_job() -> None:
        await gate.wait()

    @first.task(task_name="brokers:long_job")
    async def same_job() -> None: ...

    await first.startup()
    await second.startup()
    try:
        await long_job.kiq()
        await wait_until(lambda: _has_locks(redis_client, prefix))
        await first.shutdown()  # must not touch the other broker's running task
        await asyncio.sleep(2.5)  # past the TTL: only the heartbeat keeps the lock
        with pytest.raises(DuplicateTaskError):
            await long_job.kiq()
        await first.startup()
        with pytest.raises(DuplicateTaskError):  # the brokers share the lock
            await same_job.kiq()
    finally:
        gate.set()
        await second.wait_all()
        await second.shutdown()
        await first.shutdown()
    assert await lock_keys(redis_client, prefix) == []


async def _has_locks(client: redis.asyncio.Redis, prefix: str) -> Any:
    return bool(await lock_keys(client, prefix))


def test_a_middleware_and_its_broker_that_nobody_uses_any_more_are_freed(
    redis_url: str,
) -> None:
    # The package finds a middleware's runs (TaskLock) and loop states (the
    # scheduler) through registries of its own: they must not keep either alive.
    middleware = RedisDeduplicationMiddleware(redis_url, metrics=False)
    broker = InMemoryBroker().with_middlewares(middleware)

    @broker.task
    async def job() -> None: ...

    asyncio.run(job.kiq())
    gone = (weakref.ref(middleware), weakref.ref(broker))
    del middleware, broker, job
    gc.collect()
    assert [ref() for ref in gone] == [None, None]
