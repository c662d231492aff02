"""Keyed flow control (issue 34) at its edges: each test was a defect a review found.

Real runs on a real Redis (the session's, or a throwaway server of the test's
own where the test changes the server: an ACL user, a ``CLIENT PAUSE``). The
comments say what went wrong before the fix; ``tests/test_limits.py`` holds
the behaviour of limits as users meet it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio
from taskiq import BrokerMessage, Context, InMemoryBroker, TaskiqDepends

from taskiq_deduplication.middleware import loop_states
from taskiq_deduplication.model.limits import Rate, limit_keys
from taskiq_deduplication.run.limits import limited_run_of
from taskiq_deduplication.store.call import RedisFailed
from taskiq_deduplication.store.slots import Slot, Taken

if TYPE_CHECKING:
    from tests._brokers import BrokerFactory
    from tests._server import Server


class Ledger:
    """Who runs now, per limit, and the most that ever ran at once."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.done: list[Any] = []
        self.starts: dict[Any, float] = {}

    async def run(self, name: Any, seconds: float) -> None:
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.starts[name] = time.monotonic()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running -= 1
            self.done.append(name)


async def _until(condition: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _cancel_all(broker: InMemoryBroker) -> None:
    for task in list(broker._running_tasks):
        task.cancel()


# 1. Never over the limit


async def test_a_worker_with_a_short_lease_never_lets_a_long_lease_slot_expire(
    make_broker: BrokerFactory,
) -> None:
    # Two deployments share one limit_key with different running_ttl. The
    # short-lease worker's take/free sets the TTL of every key of the limit
    # to 2 x its own lease + 1 s; the long-lease holder refreshes only every
    # 20 s, so its slot vanishes with the holders key and others take it.
    ledger = Ledger()
    long_lease = await make_broker(running_ttl=60, limit_waiting=50)
    short_lease = await make_broker(running_ttl=1, limit_waiting=50)
    tasks = {}
    for broker in (long_lease, short_lease):

        @broker.task(
            task_name="shared", limit_key="vendor", limit_concurrency=2, deduplication=False
        )
        async def shared(name: str, seconds: float) -> None:
            await ledger.run(name, seconds)

        tasks[broker] = shared
    await tasks[long_lease].kiq("long", 7.0)
    await asyncio.sleep(0.2)
    await tasks[short_lease].kiq("short", 0.05)
    await asyncio.sleep(4.0)  # a quiet moment: no call on the limit for 4 s
    await tasks[short_lease].kiq("c", 2.0)
    await tasks[short_lease].kiq("d", 2.0)
    await _until(lambda: len(ledger.done) == 4, 15)
    assert ledger.peak <= 2, f"{ledger.peak} runs of a limit of 2 at once"


# 2. Slots that leak


async def test_a_cancelled_waiter_does_not_keep_the_next_slot(make_broker: BrokerFactory) -> None:
    # A run that waits in line is cancelled: its place stays in Redis, the
    # next freed slot is handed to it, and nobody holds that slot but a lease.
    ledger = Ledger()
    broker = await make_broker(running_ttl=10, limit_waiting=5)

    @broker.task(limit_concurrency=1, deduplication=False)
    async def job(i: int) -> None:
        await ledger.run(i, 0.5)

    await job.kiq(0)
    await asyncio.sleep(0.1)
    before = set(broker._running_tasks)
    await job.kiq(1)
    (waiting,) = set(broker._running_tasks) - before
    await asyncio.sleep(0.2)
    waiting.cancel()
    await asyncio.sleep(0.05)
    sent = time.monotonic()
    await job.kiq(2)
    assert await _until(lambda: 2 in ledger.starts, 12)
    # Run 0 ends ~0.3 s after run 2 is sent: run 2 should start then, not a lease later.
    assert ledger.starts[2] - sent < 2.0, f"started {ledger.starts[2] - sent:.1f}s after"


async def test_a_run_cancelled_while_its_take_is_in_flight_frees_the_slot(
    make_broker: BrokerFactory, server: Server
) -> None:
    ledger = Ledger()
    broker = await make_broker(redis_url=server.url, running_ttl=6, limit_waiting=5)

    @broker.task(limit_concurrency=1, deduplication=False)
    async def job(i: int) -> None:
        await ledger.run(i, 0)

    await (await job.kiq(-1)).wait_result(timeout=5)  # scripts loaded, connection open
    admin: Any = redis.asyncio.Redis.from_url(server.url)  # execute_command is unannotated
    try:
        await admin.execute_command("CLIENT", "PAUSE", "400", "WRITE")
        before = set(broker._running_tasks)
        await job.kiq(0)
        (taking,) = set(broker._running_tasks) - before
        await asyncio.sleep(0.1)  # its take is on the wire, held back by the pause
        taking.cancel()
        await asyncio.sleep(0.5)  # the pause ends: the take runs in Redis
        sent = time.monotonic()
        await job.kiq(1)
        assert await _until(lambda: 1 in ledger.starts, 10)
        assert ledger.starts[1] - sent < 2.0, f"started {ledger.starts[1] - sent:.1f}s after"
    finally:
        await admin.aclose()


async def test_a_retry_run_in_place_neither_deadlocks_nor_keeps_a_slot(
    make_broker: BrokerFactory,
) -> None:
    # InMemoryBroker(await_inplace=True): SimpleRetryMiddleware's retry runs
    # inside attempt 1's on_error (same task_id, same asyncio task), while
    # attempt 1 still holds its slot: it waits behind it forever.
    broker = await make_broker(await_inplace=True, retries=3, running_ttl=3)
    attempts: list[int] = []

    @broker.task(limit_concurrency=5, retry_on_error=True, deduplication=False)
    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")
        return "ok"

    try:
        handle = await asyncio.wait_for(flaky.kiq(), timeout=10)
    except asyncio.TimeoutError:
        pytest.fail(f"kiq still blocked after 10 s, {len(attempts)} attempt(s) ran")
    assert (await handle.wait_result(timeout=5)).return_value == "ok"


async def test_a_rate_only_run_is_not_said_to_have_lost_a_slot(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A rate holds no slot in Redis; the keeper refreshes the run anyway,
    # finds nothing and marks it lost (fenced), with a warning.
    broker = await make_broker(running_ttl=3)

    @broker.task(limit_rate="10/s", deduplication=False)
    async def paced(context: Context = TaskiqDepends()) -> bool:
        await asyncio.sleep(2.5)
        run = limited_run_of(context.broker, context.message.task_id)
        return run is not None and run.lost

    with caplog.at_level(logging.WARNING):
        lost = (await (await paced.kiq()).wait_result(timeout=10)).return_value
    assert not [r for r in caplog.records if "lost its slot" in r.getMessage()]
    assert lost is False


# 3. Waiters that hang


@pytest.fixture
async def no_subscribe_url(server: Server) -> Any:
    """A user of a throwaway server that may do anything but SUBSCRIBE (PUBLISH works)."""
    admin: Any = redis.asyncio.Redis.from_url(server.url)  # execute_command is unannotated
    await admin.execute_command(
        "ACL", "SETUSER", "nosub", "on", ">pw", "~*", "+@all", "-subscribe", "allchannels"
    )
    await admin.aclose()
    return f"redis://nosub:pw@127.0.0.1:{server.port}/0"


async def test_a_waiter_whose_subscription_failed_is_woken_by_its_refresh(
    make_broker: BrokerFactory, no_subscribe_url: str
) -> None:
    # _wait falls back to a future registered nowhere: the keeper finds the
    # slot handed over and calls wake(), which cannot find it. The run never
    # starts, and its slot is refreshed (held) for ever.
    ledger = Ledger()
    broker = await make_broker(redis_url=no_subscribe_url, running_ttl=3, limit_waiting=5)

    @broker.task(limit_concurrency=1, deduplication=False)
    async def job(i: int) -> None:
        await ledger.run(i, 0.5)

    await job.kiq(0)
    await job.kiq(1)
    try:
        # 5 s for the subscription to time out, then a refresh each second.
        assert await _until(lambda: 1 in ledger.done, 15), "the waiter never started"
    finally:
        _cancel_all(broker)


async def test_a_second_waiter_is_not_cancelled_when_the_first_subscription_fails(
    make_broker: BrokerFactory, no_subscribe_url: str
) -> None:
    # The second waiter awaits the first one's confirmation; when that
    # subscription fails, the confirmation is cancelled and the second
    # waiter's delivery dies with CancelledError (no result, no ack).
    broker = await make_broker(redis_url=no_subscribe_url, running_ttl=3, limit_waiting=5)
    died: list[str] = []
    callback = broker.receiver.callback

    async def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return await callback(*args, **kwargs)
        except BaseException as exc:
            died.append(type(exc).__name__)
            raise

    broker.receiver.callback = watched  # type: ignore[method-assign]

    @broker.task(limit_concurrency=1, deduplication=False)
    async def job(i: int) -> None:
        await asyncio.sleep(0.5)

    await job.kiq(0)
    await job.kiq(1)
    await asyncio.sleep(0.5)
    await job.kiq(2)
    await asyncio.sleep(6.0)  # past the first waiter's 5 s confirmation timeout
    _cancel_all(broker)
    assert died == [], f"deliveries died: {died}"


async def test_every_waiter_is_woken_by_the_channel_when_many_wait(
    make_broker: BrokerFactory,
) -> None:
    # A lease of 10 minutes: a wake-up lost costs 200 s. Waiters that join
    # while the channel's subscription is still unconfirmed are told it was
    # not "fresh" and do not look again; a slot handed to them before the
    # SUBSCRIBE reached Redis is never heard.
    ledger = Ledger()
    broker = await make_broker(running_ttl=600, limit_waiting=1000)

    @broker.task(limit_concurrency=2, deduplication=False)
    async def job(i: int) -> None:
        await ledger.run(i, 0.001)

    for i in range(300):
        await job.kiq(i)
    try:
        assert await _until(lambda: len(ledger.done) == 300, 20), (
            f"{len(ledger.done)}/300 done after 20 s"
        )
    finally:
        _cancel_all(broker)


async def test_a_task_id_with_a_space_does_not_wedge_its_limit(
    make_broker: BrokerFactory,
) -> None:
    # limit.lua parses a waiter as '^(%S+) (%S+)$': a task_id with a space
    # makes grant() fail, so every later free, keep and take of the limit
    # fails in Redis, and the waiters hang.
    ledger = Ledger()
    broker = await make_broker(limit_waiting=50)

    @broker.task(limit_concurrency=1, deduplication=False)
    async def job(i: int) -> None:
        await ledger.run(i, 0.2)

    await job.kiq(0)
    await job.kicker().with_task_id("report 2024").kiq(1)
    await job.kiq(2)
    try:
        assert await _until(lambda: len(ledger.done) == 3, 10), f"done: {ledger.done}"
    finally:
        _cancel_all(broker)


async def test_a_rate_only_task_on_a_shared_key_does_not_stop_the_hand_over(
    make_broker: BrokerFactory, prefix: str
) -> None:
    # A take without limit_concurrency writes n=0 into the limit's record:
    # grant() then hands nothing on, and a waiter of the concurrency task
    # waits until some later concurrency take writes n again (for ever if
    # none comes). (The docs ask shared keys to carry the same values; the
    # consequence of not doing so should not be a hang.)
    broker = await make_broker()
    state = await loop_states(broker.middlewares[0]).current()  # type: ignore[arg-type]
    slots = state.locks.slots
    keys = limit_keys(prefix, "vendor")
    first, second = Slot(keys, "a1", "t1", 30_000), Slot(keys, "a2", "t2", 30_000)
    assert isinstance(await slots.take(first, 1, None), Taken)
    await slots.take(second, 1, None)
    await slots.take(Slot(keys, "b", "t3", 30_000), None, Rate(100, 1))
    slots.free(first)
    await asyncio.sleep(0.1)
    kept = await slots.keep([second])
    assert not isinstance(kept, RedisFailed)
    assert kept[0].held, "the freed slot was handed to nobody"


# 5. Going back to the broker


class _RefusingLater(InMemoryBroker):
    """Accepts messages until ``refuse`` is set, then refuses each (a broker gone down)."""

    refuse = False
    refused = 0

    async def kick(self, message: BrokerMessage) -> None:
        if self.refuse:
            self.refused += 1
            raise ConnectionError("the broker is down")
        await super().kick(message)


async def test_a_run_the_broker_refuses_to_take_back_waits_instead_of_spinning(
    make_broker: BrokerFactory,
) -> None:
    # "A broker that refuses the message leaves the run to wait after all":
    # _in_line instead takes a place, frees it and kicks again, at once, in a
    # loop (thousands of takes, frees and warnings a second).
    broker = await make_broker(broker_class=_RefusingLater, limit_waiting=1)

    @broker.task(limit_concurrency=1, deduplication=False)
    async def job(i: int) -> None:
        await asyncio.sleep(2.0)

    for i in range(3):  # one runs, one waits, the third finds no place to wait
        await job.kiq(i)
    broker.refuse = True
    await asyncio.sleep(1.5)
    refused = broker.refused
    broker.refuse = False
    _cancel_all(broker)
    assert refused <= 3, f"{refused} sends back in 1.5 s"


# In-process brokers that run a message inside its kick, and rates on shared keys


async def test_a_run_sent_back_in_place_neither_runs_beside_its_limit_nor_loses_its_result(
    make_broker: BrokerFactory,
) -> None:
    # InMemoryBroker(await_inplace=True): the message a limit sends back is
    # delivered again inside the same asyncio task. begin() takes it for a
    # retry in place and gives it no limit: it runs beside the run that holds
    # the only slot. Its post_execute then ends the outer run's record (same
    # task_id, same asyncio task): the outer one was sent back, so the inner
    # run's real result is replaced by NoResultError, and the outer delivery
    # (its body left out) stores None as the call's result.
    broker = await make_broker(await_inplace=True, limit_waiting=1)
    running = 0
    peak = 0

    @broker.task(limit_concurrency=1, deduplication=False)
    async def job(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(0.3)
        finally:
            running -= 1
        return i

    handles = await asyncio.wait_for(asyncio.gather(*(job.kiq(i) for i in range(4))), 30)
    values = [(await handle.wait_result(timeout=5)).return_value for handle in handles]
    assert peak == 1, f"{peak} runs of a limit of 1 at once"
    assert values == [0, 1, 2, 3]


async def test_a_rate_only_task_waiting_in_a_shared_line_is_handed_its_slot(
    make_broker: BrokerFactory,
) -> None:
    # A take without limit_concurrency keeps the record's N; a
    # rate-only task on a limit_key shared with a concurrency task waits in
    # the line for a slot. Its run has no concurrency of its own, so it is
    # not kept by the room: its place is never refreshed, lapses after one
    # lease, and no refresh ever tells it so. It waits for ever.
    broker = await make_broker(running_ttl=2, limit_waiting=5)
    done: list[str] = []

    @broker.task(limit_key="vendor", limit_concurrency=1, deduplication=False)
    async def heavy() -> None:
        await asyncio.sleep(4.0)  # longer than the 2 s lease
        done.append("heavy")

    @broker.task(limit_key="vendor", limit_rate="100/s", deduplication=False)
    async def light() -> None:
        done.append("light")

    await heavy.kiq()
    await asyncio.sleep(0.2)
    await light.kiq()
    try:
        assert await _until(lambda: "light" in done, 12), f"done: {done}"
    finally:
        _cancel_all(broker)
