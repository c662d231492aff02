"""Retries by taskiq's retry middlewares, before and after the deduplication one.

A retry re-sends the same task_id from inside the worker. It is never refused
as a duplicate of itself and never lost, and it does to the lock what its
policy says: "finished" (with or without a success TTL) takes the lock over, so
every other send of the same call is refused at any moment between the first
attempt and the last; "started" takes the lock while the retry waits in the
queue (no attempt holds it while it runs); "expired" leaves the window's lock
exactly as the first send took it. When the last attempt ends the lock is gone,
except a success TTL after a success and an "expired" window, which nothing
refreshes. The same holds when ``taskiq scheduler`` sends the retry later, from
a schedule source.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from taskiq import AsyncTaskiqTask

from tests.e2e.app import EXPIRED_TTL, MAX_ATTEMPTS, SUCCESS_TTL
from tests.e2e.conftest import App, Launch

RETRY_SETUPS = ["smart-first", "smart-last", "simple-first", "simple-last"]


#: What the flaky tasks of each retry test do: fail twice then succeed, or always fail.
FAILURES = {"twice": MAX_ATTEMPTS - 1, "always": 99}


def _call(policy: str, outcome: str) -> dict[str, Any]:
    return {"tag": f"{policy}-{outcome}", "failures": FAILURES[outcome]}


async def _drive(
    app: App, policy: str, handle: AsyncTaskiqTask[Any], key: str, outcome: str
) -> None:
    """Let each attempt run to its end, checking the lock all along as ``policy`` says.

    "finished" and "remembered": a retry takes the lock over, and every other
    send is refused, while an attempt runs and between two of them. "started":
    no attempt holds the lock while it runs. "expired": the lock stays exactly
    as the first send took it (same owner, never refreshed) and refuses every
    other send.
    """
    flaky = app.tasks.flaky_by_policy[policy]
    call = _call(policy, outcome)
    tag = call["tag"]
    value = (await app.locks()).get(key)
    pttl = await app.redis.pttl(key)

    async def check() -> None:
        nonlocal pttl
        if policy == "started":
            return
        await app.assert_duplicate(flaky, handle.task_id, **call)
        if policy == "expired":
            assert (await app.locks()).get(key) == value, "a retry touched the window's lock"
            now = await app.redis.pttl(key)
            assert now <= pttl, f"the window's lock was refreshed: PTTL {pttl} -> {now}"
            pttl = now

    for attempt in range(1, MAX_ATTEMPTS + 1):
        await app.wait_started(tag, attempt)
        await check()  # while the attempt runs
        if policy == "started":
            assert key not in await app.locks(), "a running attempt holds its lock"
        await app.open_gate(tag)
        if attempt == MAX_ATTEMPTS:
            break

        async def next_attempt_started(attempt: int = attempt) -> bool:
            # Between two attempts: the failed one ends, the retry is queued,
            # then taken by a worker.
            await check()
            return len(await app.started(tag)) > attempt

        await app.wait_until(next_attempt_started, f"attempt {attempt + 1} of {tag!r}")


@pytest.mark.parametrize("retry", RETRY_SETUPS)
async def test_retried_task_holds_its_lock_as_its_policy_says_until_the_last_attempt(
    launch: Launch, broker_kind: str, retry: str
) -> None:
    app = await launch(broker=broker_kind, retry=retry)
    flaky = app.tasks.flaky_by_policy
    handles = {}
    keys = {}

    async def send(policy: str, outcome: str) -> None:
        handle = await flaky[policy].kiq(**_call(policy, outcome))
        key = await app.lock_of(handle.task_id)
        assert key is not None
        handles[policy, outcome], keys[policy, outcome] = handle, key

    for policy in ("finished", "remembered", "started"):
        for outcome in FAILURES:
            await send(policy, outcome)
            handle = handles[policy, outcome]
            await app.assert_duplicate(flaky[policy], handle.task_id, **_call(policy, outcome))

    app.start_worker()
    await app.wait_started("finished-twice")
    # The window of "expired" begins with its send: sent once a worker runs.
    for outcome in FAILURES:
        await send("expired", outcome)
    await asyncio.gather(
        *(
            _drive(app, policy, handle, keys[policy, outcome], outcome)
            for (policy, outcome), handle in handles.items()
        )
    )

    for (policy, outcome), handle in handles.items():
        result = await handle.wait_result(timeout=20)
        tag = f"{policy}-{outcome}"
        if outcome == "twice":
            assert result.return_value == f"{tag} succeeded on run {MAX_ATTEMPTS}"
        else:
            assert result.is_err
        assert await app.runs(tag) == MAX_ATTEMPTS
        assert {run["task_id"] for run in await app.started(tag)} == {handle.task_id}

    # The locks left are the success TTL of "remembered" after its success and
    # the windows of "expired"; no heartbeat of an earlier attempt brings one
    # back or refreshes one.
    left = {key: await app.redis.pttl(key) for key in await app.locks()}
    holders = await app.holders()
    assert sorted(holders[key] for key in left) == sorted(
        handles[policy, outcome].task_id
        for policy, outcome in [
            ("remembered", "twice"),
            ("expired", "twice"),
            ("expired", "always"),
        ]
    ), "a lock was left that its policy does not keep"
    assert all(0 < pttl <= max(SUCCESS_TTL, EXPIRED_TTL) * 1000 for pttl in left.values()), left
    assert app.config.heartbeat_interval is not None
    deadline = time.monotonic() + 2 * app.config.heartbeat_interval
    while time.monotonic() < deadline:
        for key, pttl in (await _pttls(app)).items():
            assert key in left, f"lock {key} came back"
            assert pttl <= left[key], f"lock {key} was refreshed"
            left[key] = pttl
        await asyncio.sleep(0.05)

    # Failed for good, a lock of "finished" or "remembered" is gone at once.
    for policy in ("finished", "remembered"):
        again = await flaky[policy].kiq(tag=f"{policy}-always", failures=0)
        await app.open_gate(f"{policy}-always")
        assert not (await again.wait_result(timeout=20)).is_err


async def _pttls(app: App) -> dict[str, int]:
    return {key: await app.redis.pttl(key) for key in await app.locks()}


async def test_retry_sent_later_by_the_scheduler_keeps_the_lock_as_its_policy_says(
    launch: Launch,
) -> None:
    # SmartRetryMiddleware(schedule_source=...) is how retries get a real delay on
    # brokers that ignore the "delay" label (the Redis ones, NATS): the worker puts
    # the retry in the schedule source, and `taskiq scheduler` sends it when due.
    app = await launch(broker="redis-list", retry="smart-source-first")
    flaky = app.tasks.flaky_by_policy
    held = await flaky["finished"].kiq(tag="finished", failures=1)
    started = await flaky["started"].kiq(tag="started", failures=1)
    app.start_worker()
    app.start_scheduler("--update-interval", "1")
    await app.wait_started("finished")
    window = await flaky["expired"].kiq(tag="expired", failures=1)  # once a worker runs
    key = await app.lock_of(window.task_id)
    assert key is not None
    value = (await app.locks())[key]
    await app.wait_started("started")
    await app.wait_started("expired")
    assert await app.lock_of(started.task_id) is None  # "started": released at the start
    for tag in ("finished", "started", "expired"):
        await app.open_gate(tag)  # the first attempts fail; their retries are due in 1 s

    async def retry_started(policy: str, handle: AsyncTaskiqTask[Any]) -> bool:
        await app.assert_duplicate(flaky[policy], handle.task_id, tag=policy, failures=1)
        return len(await app.started(policy)) >= 2

    # "started": the run that left its retry to the source took the lock back
    # for it, and holds it until the retry starts.
    async def started_lock_taken_back() -> bool:
        return (
            await app.lock_of(started.task_id) is not None or len(await app.started("started")) >= 2
        )

    await app.wait_until(started_lock_taken_back, "the lock to be taken for the retry")
    assert len(await app.started("started")) == 1, "the retry started before it was checked"
    await app.assert_duplicate(flaky["started"], started.task_id, tag="started", failures=1)

    await app.wait_until(lambda: retry_started("finished", held), "the retry to start")
    await app.wait_until(lambda: retry_started("expired", window), "the retry to start")
    assert (await app.locks()).get(key) == value  # "expired": the window's lock as it was
    await app.wait_started("started", runs=2)
    assert await app.lock_of(started.task_id) is None
    for tag in ("finished", "started", "expired"):
        await app.open_gate(tag)
    for tag, handle in (("finished", held), ("started", started), ("expired", window)):
        assert (await handle.wait_result(timeout=20)).return_value == f"{tag} succeeded on run 2"
    assert set(await app.locks()) <= {key}
