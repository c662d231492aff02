"""Runs of a busy worker share round trips; a run alone never waits for company.

The re-assert at a run's start and the release at its end may linger (a
millisecond, by default) for other runs' calls when other runs go on and such
calls come close together. These tests stretch the linger to far longer than
the test itself takes, so that a call that lingers is seen waiting and one that
must not linger is seen going at once: what they check is the mechanism, not
its speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from taskiq_deduplication.run import runs as run_module
from taskiq_deduplication.store.lock_store import Lock, LockStore
from tests._brokers import BrokerFactory, HoldingBroker
from tests._locks import answered, lock_keys, ready

pytestmark = pytest.mark.timeout(60)

#: Far longer than any test here waits: a call that lingers stays unsent.
LONG = 30.0
#: What a test allows a call that must not linger (it takes a round trip).
AT_ONCE = 10.0


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[tuple[LockStore, list[float]]]:
    """A lock store on the test Redis, and the round trips it made."""
    client = redis.asyncio.Redis.from_url(redis_url)
    trips: list[float] = []
    locks = LockStore(client, round_trip=trips.append)
    await ready(locks)
    try:
        yield locks, trips
    finally:
        await locks.close()
        await client.aclose()


async def _taken(locks: LockStore, prefix: str, name: str) -> Lock:
    lock = Lock(f"{prefix}:{name}", f"token-{name}", f"task-{name}", 30_000)
    assert answered(await locks.acquire(lock, 30_000)).holder is None
    return lock


async def test_a_lingering_call_waits_for_the_next_batch_and_keeps_its_place(
    store: tuple[LockStore, list[float]],
    redis_client: redis.asyncio.Redis,
    prefix: str,
) -> None:
    locks, trips = store
    first, second, third = [await _taken(locks, prefix, name) for name in "abc"]
    before = len(trips)
    # The first call that may linger has no other close before it: it goes at once.
    assert await asyncio.wait_for(locks.release(first, linger=LONG), AT_ONCE)
    assert len(trips) == before + 1
    # The next ones follow it closely: they wait, unsent.
    waiting = [
        asyncio.ensure_future(locks.release(second, linger=LONG)),
        asyncio.ensure_future(locks.release(third, linger=LONG)),
    ]
    await asyncio.sleep(0.2)
    assert not any(call.done() for call in waiting)
    assert await lock_keys(redis_client, prefix) == [second.key, third.key]
    # A call that does not linger takes them with it, in order: the release of
    # `second` goes before the acquire of its key by another owner.
    other = Lock(second.key, "token-other", "task-other", 30_000)
    assert answered(await asyncio.wait_for(locks.acquire(other, 30_000), AT_ONCE)).holder is None
    assert await asyncio.gather(*waiting) == [True, True]
    assert len(trips) == before + 2
    assert await redis_client.get(second.key) == other.value
    assert await redis_client.exists(third.key) == 0


async def test_a_batch_that_takes_every_lingering_call_ends_their_timer(
    store: tuple[LockStore, list[float]], redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    # A timer left behind would wake the event loop for nothing, and send the
    # next lingering call out early, before others could join it.
    locks, trips = store

    def waiting_on_a_timer() -> bool:
        return locks._pipeline._flush is not None

    first, second, third = [await _taken(locks, prefix, name) for name in "abc"]
    await locks.release(first, linger=LONG)
    lingering = asyncio.ensure_future(locks.release(second, linger=LONG))
    await asyncio.sleep(0)
    assert waiting_on_a_timer()  # it waits for company, until its timer
    other = Lock(second.key, "token-other", "task-other", 30_000)
    assert answered(await asyncio.wait_for(locks.acquire(other, 30_000), AT_ONCE)).holder is None
    assert await lingering
    assert not waiting_on_a_timer()  # nothing waits for company any more
    before = len(trips)
    later = asyncio.ensure_future(locks.release(third, linger=LONG))
    await asyncio.sleep(0.2)
    assert not later.done()  # it waits on a timer of its own
    assert waiting_on_a_timer()
    assert len(trips) == before
    assert await asyncio.wait_for(locks.held(other), AT_ONCE)  # takes it along
    assert await later
    assert await lock_keys(redis_client, prefix) == [other.key]


async def test_a_lingering_call_without_company_goes_once_its_linger_is_up(
    store: tuple[LockStore, list[float]], redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    locks, trips = store
    first, second = [await _taken(locks, prefix, name) for name in "ab"]
    await locks.release(first, linger=LONG)
    before = len(trips)
    assert await asyncio.wait_for(locks.release(second, linger=0.05), AT_ONCE)
    assert len(trips) == before + 1
    assert await lock_keys(redis_client, prefix) == []


async def test_a_run_alone_goes_at_once_and_runs_beside_others_share_a_round_trip(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(run_module, "_RUN_LINGER", LONG)
    broker = await make_broker(broker_class=HoldingBroker)
    release_long = asyncio.Event()

    @broker.task
    async def long() -> None:
        await release_long.wait()

    @broker.task
    async def short(n: int) -> int:
        return n

    # Alone in the loop, a run's start and end never wait for company.
    await short.kiq(n=0)
    await asyncio.wait_for(broker.deliver(), AT_ONCE)
    assert await lock_keys(redis_client, prefix) == []

    await long.kiq()
    first = await short.kiq(n=1)
    running = asyncio.ensure_future(broker.deliver_one())  # `long`, which runs on
    await asyncio.sleep(0.1)
    # Beside `long`, the run of `first` starts at once (no call that may linger
    # came before it), and its release, close behind, waits for company.
    ending = asyncio.ensure_future(broker.deliver_one())
    await asyncio.sleep(0.2)
    assert not ending.done()
    assert first.task_id in await _holders(redis_client, prefix)
    # A kiq goes at once, and takes the release along in its round trip.
    later = await short.kiq(n=2)
    await asyncio.wait_for(ending, AT_ONCE)
    assert first.task_id not in await _holders(redis_client, prefix)
    # Alone again, `long` ends at once.
    release_long.set()
    await asyncio.wait_for(running, AT_ONCE)
    assert await _holders(redis_client, prefix) == [later.task_id]  # queued, never run


async def _holders(client: redis.asyncio.Redis, prefix: str) -> list[str]:
    """The task ids that hold the locks under ``prefix``."""
    return [
        str(await client.get(key)).rpartition(" ")[2] for key in await lock_keys(client, prefix)
    ]


async def test_a_send_in_a_loop_takes_the_last_sends_extension_along_in_its_own_write(
    store: tuple[LockStore, list[float]],
    redis_client: redis.asyncio.Redis,
    prefix: str,
    redis_wire: str,
) -> None:
    """The extension after a send goes with the next call of the same turn: one write, not two.

    Redis counts a read event per write it finds on a connection: a caller that
    sends in a loop costs one per send (and one for the last extension), not
    two. (redis-py's public API yields on every write: there each goes alone.)
    """
    locks, _ = store
    await _taken(locks, prefix, "warm")  # the connection is open
    sends = 50
    before = (await redis_client.info("stats"))["total_reads_processed"]
    for n in range(sends):
        lock = await _taken(locks, prefix, f"send{n}")
        await locks.extend_detached(lock)  # what post_send does
    await locks.held(lock)  # reads the last extension's reply
    reads = (await redis_client.info("stats"))["total_reads_processed"] - before
    # This test's own INFO counts one read, and the last look one more.
    assert reads <= (sends if redis_wire == "lean" else 2 * sends) + 3
    for n in range(sends):
        assert await redis_client.pttl(f"{prefix}:send{n}") > 0  # every extension ran
