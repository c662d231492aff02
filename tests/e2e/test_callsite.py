"""Join, merge, debounce and fences with real workers, on every broker, under retries.

Each broker runs its tests under one retry setup, so that across the four both
retry middlewares run in both orders: a task called with ``fail_first=True``
fails its first run and is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from taskiq import AsyncTaskiqDecoratedTask

from taskiq_deduplication import DuplicateTaskError, kiq_or_join
from tests.e2e.app import DEBOUNCE_MAX
from tests.e2e.conftest import App, Launch

RETRY_OF: dict[str, str] = {
    "redis-list": "smart-first",
    "redis-stream": "simple-last",
    "rabbitmq": "smart-last",
    "nats": "simple-first",
}


def task(app: App, name: str) -> AsyncTaskiqDecoratedTask[..., Any]:
    found = app.broker.find_task(name)
    assert found is not None, name
    return found


async def test_join_returns_the_winners_result(launch: Launch, broker_kind: str) -> None:
    app = await launch(broker=broker_kind, retry=RETRY_OF[broker_kind])
    report = task(app, "e2e.cs.report")
    first = await kiq_or_join(report, user_id=1, tag="a", fail_first=True)
    assert not first.joined
    app.start_worker()
    await app.wait_started("a")
    # Other arguments under the same key fields: the running winner is joined.
    joined = await kiq_or_join(report, user_id=1, tag="b")
    assert joined.joined
    assert joined.task_id == first.task_id
    assert joined.duplicate is not None
    assert joined.duplicate.same_arguments is False
    await app.open_gate("a")  # the first run fails; its retry holds the lock on
    await app.wait_started("a", 2)
    again = await kiq_or_join(report, user_id=1, tag="a", fail_first=True)
    assert again.joined
    assert again.task_id == first.task_id
    assert again.duplicate is not None
    assert again.duplicate.same_arguments is True
    await app.open_gate("a")
    expected = {"user_id": 1, "tag": "a", "run": 2}
    for handle in (first, joined, again):
        assert (await handle.wait_result(timeout=20)).return_value == expected
    assert await app.runs("b") == 0
    await app.wait_no_locks()


async def test_twenty_merges_run_once_with_the_last_arguments(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind, retry=RETRY_OF[broker_kind])
    sync = task(app, "e2e.cs.sync")
    first = await kiq_or_join(sync, user_id=5, version=0, fail_first=True)
    for version in range(1, 20):
        handle = await kiq_or_join(sync, user_id=5, version=version, fail_first=True)
        assert handle.joined
        assert handle.duplicate is not None
        assert handle.duplicate.merged
        assert handle.task_id == first.task_id
    app.start_worker()
    assert (await first.wait_result(timeout=20)).return_value == 19
    # One task ran: its first run failed, its retry ran the same latest call.
    started = await app.started("user-5")
    assert {run["task_id"] for run in started} == {first.task_id}
    assert len(started) == 2
    assert await app.report("versions", 5) == ["19", "19"]
    await app.wait_no_locks()


async def test_a_burst_runs_once_after_the_quiet_period_a_stream_by_the_maximum_wait(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind, retry=RETRY_OF[broker_kind])
    reindex = task(app, "e2e.cs.reindex")
    app.start_worker()

    handles: list[str] = []

    async def burst() -> float:
        for revision in range(5):
            # A merged call is no refusal: kiq() hands back the queued holder.
            sent = await reindex.kiq(doc_id="burst", revision=revision, fail_first=True)
            handles.append(sent.task_id)
            await asyncio.sleep(0.1)
        return time.time()

    async def stream() -> tuple[int, float]:
        # A call every 0.25 s for three times the maximum wait: never quiet.
        revision = 0
        deadline = time.monotonic() + 3 * DEBOUNCE_MAX
        while time.monotonic() < deadline:
            revision += 1
            with contextlib.suppress(DuplicateTaskError):
                await reindex.kiq(doc_id="stream", revision=revision)
            await asyncio.sleep(0.25)
        return revision, time.time()

    last_of_burst, (last_revision, stream_ended) = await asyncio.gather(burst(), stream())
    assert handles == handles[:1] * 5  # every call after the first merged into it
    await app.wait_started("burst", 2)
    burst_runs = await app.started("burst")
    assert burst_runs[0]["at"] > last_of_burst  # after the last call of the burst
    assert await app.report("revisions", "burst") == ["4", "4"]  # the run and its retry
    streamed = await app.started("stream")
    assert streamed[0]["at"] < stream_ended  # the maximum wait ran it during the stream
    assert 0 < int((await app.report("revisions", "stream"))[0]) < last_revision
    await app.wait_no_locks()


async def test_held_turns_false_after_a_takeover_and_fences_increase(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind, retry=RETRY_OF[broker_kind])
    fenced = task(app, "e2e.cs.fenced")

    async def seen(tag: str, runs: int) -> list[dict[str, Any]]:
        async def all_finished() -> list[str]:
            found = await app.report("fences", tag)
            return found if len(found) >= runs else []

        found = await app.wait_until(all_finished, f"{runs} runs of {tag!r} to finish")
        return sorted((json.loads(item) for item in found), key=lambda item: item["run"])

    # Expiry: the first send's lock expires while it is queued; a second send
    # takes the lock, and the first run finds it is not its own.
    await fenced.kicker().with_labels(deduplication_ttl=1).kiq(tag="x")
    await app.wait_no_locks("the queued send's lock to expire")
    await fenced.kiq(tag="x")
    app.start_worker()
    await app.wait_started("x", 2)
    await app.open_gate("x", 2)
    expired, holder = await seen("x", 2)
    by_fence = sorted([expired, holder], key=lambda item: item["fence"])
    assert [(item["before"], item["after"]) for item in by_fence] == [(False, False), (True, True)]

    # Takeover: the lock of a running task is taken by another send.
    await fenced.kiq(tag="y")
    (first,) = await app.wait_started("y")
    key = await app.lock_of(first["task_id"])
    assert key is not None
    await app.redis.delete(key)  # as an expiry would
    await fenced.kiq(tag="y", fail_first=True)  # accepted: it takes the lock
    await app.wait_started("y", 2)
    await app.open_gate("y", 2)  # the second run fails; its retry takes its lock over
    await app.wait_started("y", 3)
    await app.open_gate("y")
    runs = await seen("y", 3)
    assert [(item["before"], item["after"]) for item in runs] == [
        (True, False),  # taken over while it ran
        (True, True),
        (True, True),  # the retry
    ]
    fences = [item["fence"] for item in runs]
    assert by_fence[1]["fence"] < fences[0] < fences[1] < fences[2]
    await app.wait_no_locks()
