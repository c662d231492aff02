"""Keyed flow control (``limit_*`` labels) with real workers, checked from a ledger in PostgreSQL.

Every run of a limited task writes its start and its end to the test's ledger
(``tests/e2e/ledger.py``) from inside its body, so a body's interval lies
within the time its run held its slot: the bodies of one limit that overlap in
the ledger are never more than the slots it had. The tests count them:

- never over the limit: 160 short calls on several keys of one
  limit, half of them deduplicated, half not;
- a worker killed with ``kill -9`` while it holds slots: they lapse within the
  running lease, and the rest of the limit's calls run;
- a limit with a long backlog does not starve the worker's unlimited tasks: its
  runs beyond ``limit_waiting`` go back to the broker;
- two tasks that share a rate start no faster together than it allows;
- retries (both retry middlewares, both orders) and copies that a broker
  delivers again, of runs that go on or that wait for their limit, stay within
  the limit and all run; a retry holds no slot while it waits for its attempt.

After each, no live holder or waiter is left in the limit's keys in Redis.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Any, cast

import pytest
from taskiq import AsyncTaskiqDecoratedTask

from taskiq_deduplication.model.limits import limit_keys, limit_name, limit_pattern
from tests.e2e import ledger
from tests.e2e.app import KEYED_LIMIT, SHARED_BURST, SHARED_RATE_PER_S
from tests.e2e.conftest import WAIT, App, Launch, is_alive
from tests.e2e.ledger import Run, Stall
from tests.e2e.test_redelivery import REDELIVERING, _redelivering, redelivered

#: The running lease of the kill test: a dead worker's slot lapses within it.
LEASE = 3
#: Longest a test waits for all its calls to have run.
DRAIN = 60.0
#: How much shorter than the rate's period a window of starts may look in the
#: ledger. A start is stamped as its body begins, after its worker woke up at
#: the start Redis gave it: a timer and one turn of its event loop later (a few
#: ms), or, on a busy machine, after a stall of its event loop, which each
#: worker notes in the ledger (from ledger.STALL up). A start stamped late makes
#: the window it begins look shorter by as much: this much for the timer and
#: the turn, and a noted stall of the process of one of the window's starts for
#: more.
CLOCK_TOLERANCE = ledger.STALL


# Reading the ledger and Redis


def task(app: App, name: str) -> AsyncTaskiqDecoratedTask[..., Any]:
    """The limited task ``name`` of the test's client broker."""
    found = app.broker.find_task(name)
    assert found is not None, name
    return found


def where(app: App) -> tuple[str, str]:
    """The DSN and the schema of the test's ledger."""
    return app.config.pg_dsn, app.config.ledger


async def runs_of(app: App) -> list[Run]:
    """Every run in the test's ledger, in the order they started."""
    return await ledger.runs(*where(app))


async def wait_runs(
    app: App, done: Callable[[list[Run]], bool], what: str, timeout: float = DRAIN
) -> list[Run]:
    """Wait until the ledger's runs satisfy ``done``; return them."""

    async def look() -> list[Run]:
        runs = await runs_of(app)
        return runs if done(runs) else []

    try:
        return await app.wait_until(look, what, timeout=timeout)
    except AssertionError as exc:
        runs = await runs_of(app)
        unended = [run for run in runs if run.ended is None]
        seen = (
            f"ledger: {len(runs)} runs, {len(succeeded(runs))} calls succeeded, "
            f"{len(unended)} runs without an end {unended[:5]}; "
            f"limits in Redis (live holders, live waiters): {await live_places(app)}; "
            f"deliveries: {await deliveries(app)}"
        )
        raise AssertionError(f"{seen}\n{exc}") from None


def succeeded(runs: Iterable[Run]) -> set[int]:
    """The calls (their ``n``) that have a run that succeeded."""
    return {run.n for run in runs if run.outcome == "ok"}


def all_succeeded(calls: Iterable[int]) -> Callable[[list[Run]], bool]:
    """A condition for `wait_runs`: every call of ``calls`` has succeeded."""
    wanted = set(calls)
    return lambda runs: wanted <= succeeded(runs)


def most_at_once(runs: Iterable[Run], *, died_at: float | None = None) -> int:
    """The most bodies of ``runs`` that ran at the same moment.

    A run without an end ran until ``died_at`` (its worker was killed then),
    or is still running.
    """
    edges: list[tuple[float, int]] = []
    for run in runs:
        end = run.ended if run.ended is not None else died_at
        edges.append((run.started, 1))
        edges.append((float("inf") if end is None else end, -1))
    most = running = 0
    for _, step in sorted(edges):  # at one instant an end (-1) sorts before a start
        running += step
        most = max(most, running)
    return most


def most_at_once_by_limit(runs: Iterable[Run]) -> dict[str, int]:
    """`most_at_once` of the runs of each limit."""
    by_limit: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_limit[run.limit_name].append(run)
    return {name: most_at_once(group) for name, group in by_limit.items()}


def most_starts_within(starts: Iterable[float], seconds: float) -> int:
    """The most of ``starts`` that fall in one window ``[t, t + seconds)``."""
    ordered = sorted(starts)
    most, first = 0, 0
    for last, at in enumerate(ordered):
        while at - ordered[first] >= seconds:
            first += 1
        most = max(most, last - first + 1)
    return most


def rate_breaches(
    runs: Iterable[Run], stalls: list[Stall], allowed: int, period: float
) -> tuple[list[str], int]:
    """The windows of ``allowed + 1`` starts shorter than ``period``, and how many a stall excused.

    A window is as much shorter than its period as the run in it whose place
    in the rate came first was stamped late (starts are only ever stamped
    late): a stall of that long in the process of one of its runs, as they
    started, excuses it. Beyond `CLOCK_TOLERANCE` and those, a window is a breach.
    """
    ordered = sorted(runs, key=lambda run: run.started)
    breaches, excused = [], 0
    for i in range(len(ordered) - allowed):
        window = ordered[i : i + allowed + 1]
        first, last = window[0].started, window[-1].started
        short = period - (last - first)
        if short <= CLOCK_TOLERANCE:
            continue
        pids = {run.pid for run in window}
        if any(
            stall.pid in pids
            and first - CLOCK_TOLERANCE <= stall.ended <= last + CLOCK_TOLERANCE
            and stall.lag >= short - CLOCK_TOLERANCE
            for stall in stalls
        ):
            excused += 1
        else:
            breaches.append(f"{allowed + 1} starts in {last - first:.3f}s from {first:.3f}")
    return breaches, excused


async def live_places(app: App) -> dict[str, tuple[int, int]]:
    """For each limit of the test in Redis: its live holders and its live waiters.

    A holder (or a waiter) whose lease has lapsed is dead, whether or not a
    script has purged it yet; live ones have a lease beyond Redis's ``TIME``.
    """
    prefix = app.config.lock_prefix
    seconds, micros = await app.redis.time()
    now = f"({seconds * 1_000_000 + micros}"
    found = {}
    async for meta in app.redis.scan_iter(match=limit_pattern(prefix)):
        name = limit_name(prefix, meta)
        assert name is not None, meta
        keys = limit_keys(prefix, name)
        found[name] = (
            int(await app.redis.zcount(keys.holders, now, "+inf")),
            int(await app.redis.zcount(keys.leases, now, "+inf")),
        )
    return found


async def lease_ends(app: App) -> list[float]:
    """When the leases of the holders of the test's one limit run out, in seconds."""
    prefix = app.config.lock_prefix
    [meta] = [key async for key in app.redis.scan_iter(match=limit_pattern(prefix))]
    name = limit_name(prefix, meta)
    assert name is not None, meta
    holders = limit_keys(prefix, name).holders
    # With scores: (member, score) pairs, which redis-py's types do not say.
    deadlines = cast(
        "list[tuple[str, float]]", await app.redis.zrange(holders, 0, -1, withscores=True)
    )
    return [deadline / 1e6 for _, deadline in deadlines]


async def wait_no_live_places(app: App) -> None:
    """Wait until no limit of the test has a live holder or waiter (frees are not awaited)."""

    async def none_live() -> bool:
        places = await live_places(app)
        assert places, "no limit of the test was found in Redis"
        return all(places == (0, 0) for places in places.values())

    await app.wait_until(none_live, "every slot of every limit to be freed")


async def deliveries(app: App) -> dict[str, int]:
    """How often each limited task was delivered (its runs, and those sent back)."""
    counted = await app.redis.hgetall(app.config.key("deliveries"))
    # The client decodes replies; redis-py's types do not know it.
    return {
        name.decode() if isinstance(name, bytes) else name: int(count)
        for name, count in counted.items()
    }


def runs_by_call(runs: Iterable[Run]) -> Counter[int]:
    """How many times each call's body ran."""
    return Counter(run.n for run in runs)


# Never over the limit

#: Calls of the first test, spread over this many keys of the keyed limit.
CALLS, KEYS = 160, 4


@pytest.mark.slow
async def test_the_runs_of_a_limit_never_exceed_it(launch: Launch, broker_kind: str) -> None:
    app = await launch(broker=broker_kind, ledger=True)
    keyed, keyed_open = task(app, "e2e.limit.keyed"), task(app, "e2e.limit.keyed_open")
    rng = random.Random(34)
    # Even calls are deduplicated, odd ones not; both share each key's limit.
    for n in range(CALLS):
        sent = keyed if n % 2 == 0 else keyed_open
        await sent.kiq(n=n, key=f"k{(n // 2) % KEYS}", ms=rng.randint(5, 60))
    app.start_worker()
    runs = await wait_runs(app, all_succeeded(range(CALLS)), f"the {CALLS} calls to run")

    most = most_at_once_by_limit(runs)
    assert set(most) == {f"keyed:k{key}" for key in range(KEYS)}
    assert all(count <= KEYED_LIMIT for count in most.values()), f"over the limit: {most}"
    assert max(most.values()) == KEYED_LIMIT, f"the limit was never reached: {most}"
    # Nothing was killed and no broker delivered a message again: a deduplicated
    # call ran exactly once. One that is not ran at least once (nothing but the
    # broker's own delivery keeps it from running twice).
    times = runs_by_call(runs)
    assert all(times[n] == 1 for n in range(0, CALLS, 2)), times
    assert all(times[n] >= 1 for n in range(1, CALLS, 2)), times
    assert sum(times.values()) == len(runs)
    await wait_no_live_places(app)
    assert sum((await deliveries(app)).values()) >= len(runs)


# Slots freed after kill -9


@pytest.mark.slow
async def test_the_slots_of_a_killed_worker_lapse_and_the_rest_of_its_limit_runs(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind, ledger=True, running_ttl=LEASE)
    keyed_open = task(app, "e2e.limit.keyed_open")
    for n in range(KEYED_LIMIT):
        await keyed_open.kiq(n=n, key="kill", gate="kill")
    app.start_worker()
    holding = await wait_runs(app, lambda runs: len(runs) >= KEYED_LIMIT, "both slots to be taken")
    assert len(holding) == KEYED_LIMIT

    for pid in {run.pid for run in holding}:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    for pid in {run.pid for run in holding}:

        async def dead(pid: int = pid) -> bool:
            return not is_alive(pid)

        await app.wait_until(dead, f"worker process {pid} to die")
    # Dead, its runs still hold both slots, until their leases run out: nothing
    # refreshes them any more, nothing freed them.
    [(holders, _)] = (await live_places(app)).values()
    assert holders == KEYED_LIMIT
    lapse = await lease_ends(app)
    assert len(lapse) == KEYED_LIMIT
    assert max(lapse) <= killed_at + LEASE + CLOCK_TOLERANCE, (lapse, killed_at)

    await app.open_gate("kill", runs=10)  # for copies that a broker delivers again
    rest = range(KEYED_LIMIT, KEYED_LIMIT + 6)
    for n in rest:
        await keyed_open.kiq(n=n, key="kill", ms=50)
    runs = await wait_runs(app, all_succeeded(rest), "the rest of the limit's calls to run")

    later = [run for run in runs if run.n in rest]
    # Nothing of the limit ran before the first dead slot lapsed (Redis's clock
    # and the ledger's are the machine's one clock).
    first = min(run.started for run in later)
    assert first >= min(lapse), f"ran {min(lapse) - first:.3f}s before a dead slot lapsed"
    assert first <= killed_at + LEASE + WAIT
    assert most_at_once(runs, died_at=killed_at) <= KEYED_LIMIT
    await wait_no_live_places(app)


# No starvation behind a long backlog

#: The backlog: calls of a limit of one, each this long.
BACKLOG, BACKLOG_MS = 30, 150
#: Unlimited calls sent after the backlog.
UNLIMITED = 20
#: The unlimited calls all end before this many of the backlog have started.
STARTED_BEFORE = BACKLOG // 4
#: Runs at once in each worker process: far fewer than the backlog, so that
#: its runs would fill them all if they waited there.
ASYNC_TASKS = 8


@pytest.mark.slow
async def test_a_limit_with_a_long_backlog_does_not_starve_unlimited_tasks(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind, ledger=True)
    one, unlimited = task(app, "e2e.limit.one"), task(app, "e2e.limit.unlimited")
    for n in range(BACKLOG):
        await one.kiq(n=n, ms=BACKLOG_MS)
    extra = range(BACKLOG, BACKLOG + UNLIMITED)
    for n in extra:
        await unlimited.kiq(n=n)
    app.start_worker("--max-async-tasks", str(ASYNC_TASKS))
    runs = await wait_runs(app, all_succeeded(extra), "the unlimited calls to run")
    last_end = max(run.ended or 0.0 for run in runs if run.n in extra)
    runs = await wait_runs(app, all_succeeded(range(BACKLOG)), "the backlog to run")

    backlog = sorted(run.started for run in runs if run.limit_name == "one")
    assert last_end < backlog[STARTED_BEFORE], (
        f"the unlimited calls ended {last_end - backlog[0]:.2f}s after the backlog's first "
        f"start, after {sum(1 for at in backlog if at < last_end)} of its {BACKLOG} runs"
    )
    assert most_at_once(run for run in runs if run.limit_name == "one") == 1
    assert all(times == 1 for times in runs_by_call(runs).values())
    # The backlog's runs beyond those that may wait went back to the broker.
    assert (await deliveries(app))["e2e.limit.one"] > BACKLOG
    await wait_no_live_places(app)


# A rate shared by two tasks

#: Calls of each of the two tasks.
RATED = 10


@pytest.mark.slow
async def test_two_tasks_that_share_a_rate_start_no_faster_together_than_it_allows(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind, ledger=True)
    rate_a, rate_b = task(app, "e2e.limit.rate_a"), task(app, "e2e.limit.rate_b")
    for n in range(RATED):
        await rate_a.kiq(n=2 * n)  # deduplicated
        await rate_b.kiq(n=2 * n + 1)  # not
    app.start_worker()
    runs = await wait_runs(app, all_succeeded(range(2 * RATED)), "the rated calls to run")

    assert {run.task for run in runs} == {"e2e.limit.rate_a", "e2e.limit.rate_b"}
    # In any period, at most N + burst - 1 starts of the two tasks together.
    allowed = SHARED_RATE_PER_S + SHARED_BURST - 1
    breaches, excused = rate_breaches(runs, await ledger.stalls(*where(app)), allowed, 1.0)
    gaps = [round(b.started - a.started, 3) for a, b in itertools.pairwise(runs)]
    assert breaches == [], f"{breaches} ({excused} windows excused by stalls); gaps {gaps}"
    # And the two reached the rate together: it is theirs, not each one's.
    starts = [run.started for run in runs]
    assert most_starts_within(starts, 1.0 + CLOCK_TOLERANCE) >= SHARED_RATE_PER_S, gaps
    assert all(times == 1 for times in runs_by_call(runs).values())
    await wait_no_live_places(app)


# Retries and copies delivered again

#: Calls of the retry test, over this many keys; call n fails its first n % 3 attempts.
RETRIED, RETRIED_KEYS = 24, 3


#: Each retry setup (of test_retries.py) on one broker: both middlewares, both orders.
RETRY_SETUPS = {
    "redis-list": "smart-first",
    "redis-stream": "simple-last",
    "rabbitmq": "smart-last",
    "nats": "simple-first",
}


@pytest.mark.slow
async def test_retries_stay_within_the_limit(launch: Launch, broker_kind: str) -> None:
    app = await launch(broker=broker_kind, ledger=True, retry=RETRY_SETUPS[broker_kind])
    keyed, keyed_open = task(app, "e2e.limit.keyed"), task(app, "e2e.limit.keyed_open")
    rng = random.Random(35)
    for n in range(RETRIED):
        sent = keyed if n % 2 == 0 else keyed_open
        key = f"r{(n // 2) % RETRIED_KEYS}"
        await sent.kiq(n=n, key=key, ms=rng.randint(20, 80), failures=n % 3)
    app.start_worker()
    runs = await wait_runs(app, all_succeeded(range(RETRIED)), "every call to succeed")

    most = most_at_once_by_limit(runs)
    assert all(count <= KEYED_LIMIT for count in most.values()), f"over the limit: {most}"
    attempts: dict[int, list[int]] = defaultdict(list)
    for run in runs:
        attempts[run.n].append(run.attempt)
    for n in range(RETRIED):
        if n % 2 == 0:  # deduplicated: each attempt ran once
            assert sorted(attempts[n]) == list(range(n % 3 + 1)), (n, attempts[n])
        else:
            assert set(attempts[n]) == set(range(n % 3 + 1)), (n, attempts[n])
    await wait_no_live_places(app)


async def test_a_retry_holds_no_slot_while_it_waits_for_its_attempt(launch: Launch) -> None:
    # SmartRetryMiddleware with a schedule source: the retry waits there for a
    # second, then `taskiq scheduler` sends it. Meanwhile its limit is free.
    app = await launch(broker="redis-list", ledger=True, retry="smart-source-first")
    keyed = task(app, "e2e.limit.keyed")
    await app.open_gate("x", runs=2)
    await keyed.kiq(n=0, key="solo", gate="x", failures=1)
    app.start_worker()
    app.start_scheduler("--update-interval", "1")
    await wait_runs(app, lambda runs: any(run.outcome == "failed" for run in runs), "a failure")

    # Its retry waits in the schedule source: both slots are free for others.
    for n in (1, 2):
        await keyed.kiq(n=n, key="solo", gate="others")
    runs = await wait_runs(app, lambda runs: {1, 2} <= {run.n for run in runs}, "both to start")
    assert [run.n for run in runs if run.n == 0] == [0], "the retry ran before the others"
    # Due now, the retry waits for a slot: it does not start beside the two.
    await asyncio.sleep(2.5)
    runs = await runs_of(app)
    assert [run.n for run in runs if run.n == 0] == [0], "the retry ran beside both others"
    await app.open_gate("others", runs=2)
    runs = await wait_runs(app, all_succeeded(range(3)), "the retry to run after them")
    assert most_at_once(runs) <= KEYED_LIMIT
    [_, retry] = [run for run in runs if run.n == 0]
    assert retry.started > min(run.ended or 0.0 for run in runs if run.n != 0)
    await wait_no_live_places(app)


#: Calls of the copy test, each running past the broker's redelivery timeout.
COPIED, COPIED_MS = 4, 2500


@pytest.mark.slow
@pytest.mark.parametrize("broker", REDELIVERING)
async def test_copies_delivered_again_stay_within_the_limit(launch: Launch, broker: str) -> None:
    app = await launch(**_redelivering(broker), ledger=True)
    keyed, keyed_open = task(app, "e2e.limit.keyed"), task(app, "e2e.limit.keyed_open")
    for n in range(COPIED):
        sent = keyed if n % 2 == 0 else keyed_open
        await sent.kiq(n=n, key="copied", ms=COPIED_MS)
    app.start_worker()
    pokes = 0
    copied = False

    async def all_done() -> list[Run]:
        nonlocal pokes, copied
        if broker == "redis-stream":  # a stream's worker claims idle messages after a read
            pokes += 1
            await app.tasks.count.kiq(n=pokes)
        copied = copied or await redelivered(app)
        await asyncio.sleep(0.2)
        runs = await runs_of(app)
        return runs if all_succeeded(range(COPIED))(runs) and copied else []

    runs = await app.wait_until(all_done, "every call to run, its copies delivered", DRAIN)
    assert most_at_once(runs) <= KEYED_LIMIT
    by_task: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_task[run.task_id].append(run)
    # A copy waits for its own run to end, limit or lock.
    assert all(most_at_once(group) == 1 for group in by_task.values())
    times = runs_by_call(runs)
    assert all(times[n] == 1 for n in range(0, COPIED, 2)), times
    await wait_no_live_places(app)


#: Keys of the test of copies of waiting runs, and calls waiting on each.
WAITING_KEYS, WAITING_CALLS = 3, 6


@pytest.mark.slow
@pytest.mark.parametrize("broker", REDELIVERING)
async def test_copies_delivered_while_their_run_waits_for_the_limit_all_run(
    launch: Launch, broker: str
) -> None:
    # Every slot of each key is held (gated) while the calls of the key wait for
    # one, longer than the broker takes to deliver a waiting message again: the
    # copies meet their own runs in the limit's line and at the call's lock.
    app = await launch(**_redelivering(broker), ledger=True)
    keyed = task(app, "e2e.limit.keyed")
    keys = [f"w{k}" for k in range(WAITING_KEYS)]
    held = [1000 + 10 * k + n for k in range(WAITING_KEYS) for n in range(KEYED_LIMIT)]
    for n in held:
        await keyed.kiq(n=n, key=keys[(n - 1000) // 10], gate="held")
    app.start_worker()
    await wait_runs(app, lambda runs: len(runs) >= len(held), "every slot to be held")
    calls = range(WAITING_KEYS * WAITING_CALLS)
    for n in calls:
        await keyed.kiq(n=n, key=keys[n % WAITING_KEYS], ms=200)
    for poke in range(30):  # 6 s: a stream's worker claims idle messages after a read
        await asyncio.sleep(0.2)
        if broker == "redis-stream":
            await app.tasks.count.kiq(n=poke)
    await app.open_gate("held", runs=len(held))
    runs = await wait_runs(app, all_succeeded([*held, *calls]), "every call to run", WAIT)

    most = most_at_once_by_limit(runs)
    assert all(count <= KEYED_LIMIT for count in most.values()), f"over the limit: {most}"
    assert all(times == 1 for times in runs_by_call(runs).values()), runs_by_call(runs)
    await wait_no_live_places(app)
