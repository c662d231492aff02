"""The lock pipeline under a hung Redis, a shutdown cut short and a lost script cache.

A hung server is a paused one (SIGSTOP): connections stay open, nothing answers.
The bounds asserted here are the behaviour itself (every ``kiq`` ends within its
timeout plus a margin), so they are wall-clock bounds with generous margins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio
import redis.exceptions
from taskiq import BrokerMessage, InMemoryBroker, TaskiqMessage, TaskiqMiddleware

from taskiq_deduplication import RedisDeduplicationMiddleware
from taskiq_deduplication.middleware import loop_states
from taskiq_deduplication.store.lock_store import Lock, LockStore
from tests._locks import answered, ready
from tests._server import Server, flushing_scripts
from tests.faults._harness import LogRecords, admin, lock_keys, wait_until

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 0.5
HUNG_URL = f"?socket_timeout={TIMEOUT}&socket_connect_timeout={TIMEOUT}"
# What a kiq may take beyond its timeout: the timer's turn in a busy event loop
# on a shared, noisy machine. Before the deadlines, the 3,000 calls took ~4 s.
MARGIN = 1.0
# An undo release or the grace TTL (10 s) removes the lock of a failed send.
GRACE = 10.0


class SinkBroker(InMemoryBroker):
    """Accepts every message and runs none: only the send path is exercised."""

    async def kick(self, message: BrokerMessage) -> None:
        pass


def backlog(middleware: RedisDeduplicationMiddleware) -> int:
    """How many lock calls wait to be sent to Redis."""
    state = loop_states(middleware).get()
    assert state is not None, "the middleware has not started in this event loop"
    return state.locks.backlog


@pytest.fixture
def debug_server() -> Iterator[Server]:
    """A server of this test's own that accepts DEBUG SLEEP from loopback."""
    own = Server(extra_args=("--enable-debug-command", "local")).start()
    try:
        yield own
    finally:
        own.cleanup()


# Defect 5: a hung Redis


async def test_every_kiq_against_a_hung_redis_ends_within_its_timeout(
    server: Server, prefix: str
) -> None:
    middleware = RedisDeduplicationMiddleware(server.url + HUNG_URL, key_prefix=prefix)
    broker = SinkBroker().with_middlewares(middleware)
    await broker.startup()

    @broker.task
    async def job(n: int) -> None: ...

    await job.kiq(n=-1)  # connected, scripts loaded
    spans: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    async def one(n: int) -> None:
        started = time.monotonic()
        try:
            await job.kiq(n=n)
        except redis.exceptions.TimeoutError as exc:
            errors.append(exc)
        spans.append((started, time.monotonic()))

    server.pause()
    try:
        await asyncio.gather(*(one(n) for n in range(3000)))
    finally:
        server.resume()
    assert len(errors) == 3000  # each one timed out, none was sent
    # No kiq ends later than its deadline, or than the moment the event loop is
    # done starting them all (on a loaded machine that can take longer than the
    # timeout), by more than the margin.
    last_start = max(start for start, _ in spans)
    overrun = max(end - max(start + TIMEOUT, last_start) for start, end in spans)
    latencies = [end - start for start, end in spans]
    assert overrun < MARGIN, f"{min(latencies):.2f}-{max(latencies):.2f}s"
    assert backlog(middleware) < 100  # the expired calls are gone

    # Works again once Redis does: once it has run what was written before the
    # pause and answered the undo releases queued ahead of this call, each of
    # which a loaded machine may take more than the timeout to get through.
    async def kiq_goes_through() -> bool:
        try:
            await job.kiq(n=3000)
        except redis.exceptions.TimeoutError:
            return False
        return True

    await wait_until(kiq_goes_through, timeout=10)
    with admin(server.port) as client:
        # The acquires that went out before the pause ran when Redis woke up;
        # their undo releases follow (or their grace TTL ends them).
        await wait_until(lambda: _only(client, prefix, 2), timeout=GRACE + 5)
    await broker.shutdown()


@pytest.mark.slow
async def test_a_stream_of_kiqs_during_an_outage_keeps_latency_and_backlog_bounded(
    server: Server, prefix: str
) -> None:
    middleware = RedisDeduplicationMiddleware(
        server.url + HUNG_URL, key_prefix=prefix, fail_open=True
    )
    broker = SinkBroker().with_middlewares(middleware)
    await broker.startup()

    @broker.task
    async def job(n: int) -> None: ...

    await job.kiq(n=-1)
    latencies: list[float] = []
    peak_backlog = 0

    async def one(n: int) -> None:
        started = time.monotonic()
        await job.kiq(n=n)  # fail_open: goes out without a lock, never raises
        latencies.append(time.monotonic() - started)

    rate, pause = 1000, 4.0  # kiqs per second, seconds of outage
    sending: list[asyncio.Task[None]] = []
    lag = 0.0  # the longest the event loop was too busy to notice a timer
    server.pause()
    try:
        for tick in range(int(pause * 10)):
            sending += [asyncio.create_task(one(tick * 100 + i)) for i in range(rate // 10)]
            slept = time.monotonic()
            await asyncio.sleep(0.1)
            lag = max(lag, time.monotonic() - slept - 0.1)
            peak_backlog = max(peak_backlog, backlog(middleware))
        await asyncio.gather(*sending)
    finally:
        server.resume()
    # The queue holds about one timeout's worth of calls; without deadlines it
    # grew by half the rate every second (~2,000 after 4 s).
    assert peak_backlog <= 2 * rate * TIMEOUT, peak_backlog
    worst = f"{min(latencies):.2f}-{max(latencies):.2f}s, loop lag up to {lag:.2f}s"
    assert max(latencies) < TIMEOUT + MARGIN + lag, worst

    await job.kiq(n=-2)  # works again
    with admin(server.port) as client:
        await wait_until(lambda: _only(client, prefix, 2), timeout=GRACE + 5)
    await broker.shutdown()


async def _only(client: redis.Redis, prefix: str, count: int) -> bool:
    """Whether just the ``count`` locks of the sends that succeeded are left."""
    return len(lock_keys(client, prefix)) == count


async def test_a_full_backlog_fails_a_kiq_at_once_with_a_redis_error(
    server: Server, prefix: str, logs: LogRecords
) -> None:
    # A timeout long enough that no queued send expires (and so frees its
    # place) while a busy machine gets the 10,050 sends through the event loop:
    # the timed send must find the backlog full, not a place freed by an expiry.
    middleware = RedisDeduplicationMiddleware(
        server.url + "?socket_timeout=30", key_prefix=prefix, fail_open=True
    )
    broker = SinkBroker().with_middlewares(middleware)
    await broker.startup()

    @broker.task
    async def job(n: int) -> None: ...

    await job.kiq(n=-1)
    server.pause()
    try:
        waiting = [asyncio.ensure_future(job.kiq(n=n)) for n in range(10_050)]

        async def all_queued() -> bool:
            # The sends run in order: once the last one is through (refused by the
            # full backlog, it is sent without a lock), every one before it waits.
            return waiting[-1].done()

        # All of them queued, none answered. On a busy machine (the suite's other
        # processes) getting 10,050 sends through the event loop takes longer than
        # on an idle one, and the timed send must not wait behind them.
        await wait_until(all_queued, timeout=5)
        started = time.monotonic()
        await job.kiq(n=-2)  # fails open at once instead of waiting 30 s
        assert time.monotonic() - started < 1.0
        assert logs.warnings("the Redis backlog is full")
    finally:
        server.resume()
    await asyncio.gather(*waiting)
    await broker.shutdown()


# Defect 6: a shutdown cut short


async def test_a_shutdown_cut_short_leaves_the_applications_client_working(
    debug_server: Server, prefix: str, logs: LogRecords
) -> None:
    own_client = redis.asyncio.Redis.from_url(debug_server.url, decode_responses=True)
    other = redis.asyncio.Redis.from_url(debug_server.url, decode_responses=True)
    await own_client.set("app:key", "app-value")
    middleware = RedisDeduplicationMiddleware(client=own_client, key_prefix=prefix)
    broker = SinkBroker().with_middlewares(middleware)
    await broker.startup()
    sleeping: list[asyncio.Task[object]] = []

    @broker.task
    async def job() -> None: ...

    async def busy_redis(message: BrokerMessage) -> None:
        # Redis is busy when post_send writes the extension: its reply is pending.
        command = other.execute_command("DEBUG", "SLEEP", "0.5")  # type: ignore[no-untyped-call]
        sleeping.append(asyncio.create_task(command))
        await asyncio.sleep(0.05)

    broker.kick = busy_redis  # type: ignore[method-assign]
    await job.kiq()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(middleware.shutdown(), 0.1)  # a worker's shutdown timeout

    # The application's own commands, on the client it lent to the middleware.
    replies = await asyncio.gather(*(own_client.get("app:key") for _ in range(3)))
    assert replies == ["app-value"] * 3
    await asyncio.gather(*sleeping)
    await asyncio.sleep(0.1)  # the cancelled read is over; nothing is released twice
    assert await own_client.get("app:key") == "app-value"
    assert [m for m in logs.messages(logging.WARNING) if "Could not" in m] == []
    await own_client.aclose()
    await other.aclose()


# Defect 7: the script cache lost while calls are on the way


async def test_a_release_that_overtook_a_failed_reassert_still_ends_the_lock(
    server: Server,
) -> None:
    client = redis.asyncio.Redis.from_url(server.url)
    store = LockStore(client)
    await ready(store)
    running = Lock("t:running", "tokL", "taskL", 60_000)  # a task that now ends
    sent = Lock("t:sent", "tokK", "taskK", 60_000)  # a task just sent
    other = Lock("t:other", "tokX", "taskX", 60_000)
    with admin(server.port) as admin_client:
        admin_client.set(running.key, running.value, px=60_000)
        # A heartbeat tick queues the re-assert while a batch is on the wire
        # (held busy here, so that what follows does not depend on timing)...
        await store.acquire(other, 10_000)
        pipeline = store._pipeline
        pipeline._busy = True
        tick = asyncio.ensure_future(store.reassert([running]))
        await asyncio.sleep(0)
        pipeline._busy = False
        # ...the server loses its scripts, and post_send writes the queue ahead
        # (at the end of the event loop's turn, over the lean wire).
        admin_client.script_flush()
        await store.extend_detached(sent)
        await asyncio.sleep(0)
        assert len(pipeline._written) == 2
        # Both reach Redis and fail with NOSCRIPT; nothing else may run meanwhile.
        time.sleep(0.05)  # noqa: ASYNC251
        for script in pipeline.scripts:  # another process reloads them
            admin_client.script_load(script.script)
        # The task ends: its release goes with the next batch, and runs.
        assert await store.release(running)
        assert await tick == [2]  # run again after the release, in order
        assert admin_client.get(running.key) is None
    await store.close()
    await client.aclose()


async def test_a_script_cache_lost_again_and_again_during_a_burst_fails_no_kiq(
    server: Server, prefix: str
) -> None:
    middleware = RedisDeduplicationMiddleware(server.url, key_prefix=prefix)
    broker = SinkBroker().with_middlewares(middleware)
    await broker.startup()

    @broker.task
    async def job(n: int) -> None: ...

    # Another thread flushes the scripts in a tight loop, whatever our event
    # loop does, so that some flushes land during a recovery from the last one.
    with flushing_scripts([server.port], pause=0.0005) as flushed:
        results = await asyncio.gather(*(job.kiq(n=n) for n in range(2000)), return_exceptions=True)
    flushes = flushed.count
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert flushes >= 2
    with admin(server.port) as client:
        assert len(lock_keys(client, prefix)) == 2000
    await broker.shutdown()


# Writing ahead to a Redis that does not read


@pytest.fixture
async def client(server: Server) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of this test's server; each call waits 5 s for its reply."""
    own = redis.asyncio.Redis.from_url(server.url + "?socket_timeout=5")
    try:
        yield own
    finally:
        await own.aclose()


@pytest.fixture
async def store(client: redis.asyncio.Redis) -> AsyncIterator[LockStore]:
    """A lock store on ``client``, its scripts loaded."""
    locks = LockStore(client)
    await ready(locks)
    try:
        yield locks
    finally:
        await locks.close()


async def test_extensions_written_ahead_to_a_redis_that_stopped_reading_all_land_in_order(
    server: Server, store: LockStore
) -> None:
    # Big keys fill the socket's buffers while Redis is paused (for less than
    # the socket timeout), so that the writes ahead stop going out at once and
    # queue behind a bounded write that waits for Redis to read again.
    locks = [Lock(f"t:{n:03}:" + "k" * 65_536, f"tok{n}", f"task{n}", 120_000) for n in range(300)]
    with admin(server.port) as admin_client:
        for lock in locks:
            admin_client.set(lock.key, lock.value, px=30_000)
        server.pause()
        try:
            for lock in locks:
                await store.extend_detached(lock)
            # The last task ends: its release must not be overtaken by its extension.
            store.release_detached(locks[-1])
            await asyncio.sleep(0.5)
        finally:
            server.resume()

        async def all_landed() -> bool:
            extended = all(admin_client.pttl(lock.key) > 30_000 for lock in locks[:-1])
            return extended and admin_client.get(locks[-1].key) is None

        await wait_until(all_landed, timeout=15, interval=0.2)
        assert store.backlog == 0
        admin_client.delete(*(lock.key for lock in locks[:-1]))


# The end of a run in the sending process, and that send's own extension


class _SlowPostSend(TaskiqMiddleware):
    """Holds ``post_send`` back until the run has ended and its lock's end is on its way."""

    def __init__(self, ended: asyncio.Event) -> None:
        super().__init__()
        self.ended = ended

    async def post_send(self, message: TaskiqMessage) -> None:
        await self.ended.wait()
        await asyncio.sleep(0.1)  # the keep is sent, Redis is still asleep


async def test_a_success_ttl_is_not_stretched_by_an_extension_sent_while_it_is_kept(
    debug_server: Server, prefix: str
) -> None:
    # A worker in the sending process (a retry's run, an in-memory broker) can
    # end the run before the send's post_send: the extension must not follow
    # the keep, or the lock would live the full TTL instead of the success TTL.
    ended = asyncio.Event()
    other = redis.asyncio.Redis.from_url(debug_server.url)
    middleware = RedisDeduplicationMiddleware(debug_server.url, key_prefix=prefix)
    broker = InMemoryBroker().with_middlewares(middleware, _SlowPostSend(ended))
    await broker.startup()
    sleeping: list[asyncio.Task[object]] = []

    @broker.task(deduplication_ttl=300, deduplication_success_ttl=5)
    async def charge(order_id: str) -> str:
        command = other.execute_command("DEBUG", "SLEEP", "0.3")  # type: ignore[no-untyped-call]
        sleeping.append(asyncio.create_task(command))
        await asyncio.sleep(0.05)  # Redis sleeps: the keep will wait for it
        asyncio.get_running_loop().call_later(0.05, ended.set)
        return f"receipt for {order_id}"

    await charge.kiq(order_id="A-1")
    await broker.wait_all()
    await asyncio.gather(*sleeping)
    await middleware.shutdown()  # sends whatever is still queued
    with admin(debug_server.port) as admin_client:
        (key,) = lock_keys(admin_client, prefix)
        assert 0 < admin_client.pttl(key) <= 5_000
    await other.aclose()


# Replies of calls written ahead, lost with a connection the client closed


async def test_replies_lost_with_a_connection_closed_under_the_pipeline_go_to_no_other_call(
    server: Server, client: redis.asyncio.Redis, store: LockStore
) -> None:
    pipeline = store._pipeline
    a, b, c = (Lock(f"lost:{name}", f"tok{name}", f"task-{name}", 30_000) for name in "abc")
    assert answered(await store.acquire(a, 30_000)).holder is None
    # A caller's acquire queued behind a batch in flight (held busy here, so
    # that what follows does not depend on timing) ...
    pipeline._busy = True
    acquiring_b = asyncio.ensure_future(store.acquire(b, 30_000))
    await asyncio.sleep(0)
    pipeline._busy = False
    # ... goes out with an extension written ahead, and its reply is read later.
    await store.extend_detached(a)
    await asyncio.sleep(0)  # written at the end of the event loop's turn
    assert pipeline._written
    # Before that read, the application closes the client's connections, the
    # pipeline's among them (the pipeline held busy again till then).
    pipeline._busy = True
    await client.connection_pool.disconnect()
    pipeline._busy = False
    acquired_c = answered(await asyncio.wait_for(store.acquire(c, 30_000), 10))
    acquired_b = answered(await asyncio.wait_for(acquiring_b, 10))
    # Each call gets its own reply: b's acquire was sent again, in order, before c's.
    assert acquired_b.holder is None
    assert acquired_c.holder is None
    assert (acquired_b.token or "").startswith("tokb")
    assert (acquired_c.token or "").startswith("tokc")
    with admin(server.port) as admin_client:
        assert admin_client.get(b.key).startswith("tokb")
        assert admin_client.get(c.key).startswith("tokc")


# A shutdown while a task still runs (issue 31, item 8.1)


async def test_a_shutdown_while_a_task_runs_says_once_that_its_lock_expires(
    server: Server, prefix: str, logs: LogRecords
) -> None:
    # An in-process broker shuts down with a task still running; asyncio.run
    # then cancels the task, and taskiq runs its post_execute all the same.
    middleware = RedisDeduplicationMiddleware(server.url, key_prefix=prefix)
    broker = InMemoryBroker().with_middlewares(middleware)
    started = asyncio.Event()

    @broker.task
    async def slow() -> None:
        started.set()
        await asyncio.sleep(60)

    await broker.startup()
    await slow.kiq()
    await started.wait()
    await broker.shutdown()
    running = list(broker._running_tasks)
    for task in running:
        task.cancel()  # what asyncio.run does with the tasks left at its end
    await asyncio.wait(running, timeout=5)
    assert all(task.done() for task in running)

    # No traceback of ours, and one line that says why and for how long.
    assert [r for r in logs.records if r.exc_info] == []
    (line,) = logs.messages(logging.WARNING)
    assert "shut down (broker.shutdown())" in line, line
    assert "it expires in 30s" in line, line  # the running lease
    with admin(server.port) as client:
        (key,) = lock_keys(client, prefix)
        assert 0 < client.pttl(key) <= 30_000
