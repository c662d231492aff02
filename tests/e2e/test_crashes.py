"""Workers that die mid-task: SIGKILL (a crash) and SIGTERM (a stop).

A crashed worker cannot release its lock: the lock stays held at first, nothing
refreshes it any more, and it expires on its TTL, after which the task can be
sent again. A broker that redelivers the crashed worker's message (RabbitMQ)
runs it again under the same lock. A stopped worker lets a running task finish
and release its lock, or, past ``--wait-tasks-timeout``, leaves the lock to
expire on its TTL; either way nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import pytest
from taskiq import AsyncTaskiqTask

from tests.e2e.conftest import App, Launch, is_alive

TTL = 3
HEARTBEAT = 1.0

Run = dict[str, Any]
"""A run of ``hold`` as the application reports it: its ``pid`` and ``task_id``, among others."""


async def _one_running(app: App) -> tuple[AsyncTaskiqTask[Any], Run, str]:
    """Send ``hold(tag="k")``, start a worker and return once it runs.

    Returns:
        The call's handle, its run and its lock key.
    """
    handle = await app.tasks.hold.kiq(tag="k")
    app.start_worker()
    [run] = await app.wait_started("k")
    key = await app.lock_of(handle.task_id)
    assert key is not None
    return handle, run, key


async def _crash(app: App, pid: int) -> None:
    """SIGKILL the worker process ``pid``, as a crash does, and wait until it is gone."""
    os.kill(pid, signal.SIGKILL)

    async def dead() -> bool:
        return not is_alive(pid)

    await app.wait_until(dead, "the worker process to die")


async def _runs_again_under_its_lock(
    app: App, handle: AsyncTaskiqTask[Any], first: Run, key: str, ttl: float
) -> None:
    """Check that the message of a killed ``first`` run runs again, in another process.

    The second run keeps the lock at ``key`` alive (``ttl``), and it still refuses
    a duplicate of ``handle``.
    """
    second = (await app.wait_started("k", runs=2))[1]
    assert second["task_id"] == handle.task_id
    assert second["pid"] != first["pid"]
    await app.wait_refreshed(key, ttl)
    assert (await app.holders()).get(key) == handle.task_id
    await app.assert_duplicate(app.tasks.hold, handle.task_id, tag="k")


async def _expires_then_runs_again(app: App, key: str, ttl: float) -> None:
    """Watch the lock at ``key`` expire within ``ttl``; then a new call runs, a second run."""
    await app.watch_expire(key, ttl)
    again = await app.tasks.hold.kiq(tag="k")
    await _ends_as_a_second_run(app, again)


async def _ends_as_a_second_run(app: App, handle: AsyncTaskiqTask[Any]) -> None:
    """Let the runs of ``k`` end: ``handle``'s result is a second run, and no lock is left."""
    await app.open_gate("k")
    assert (await handle.wait_result(timeout=20)).return_value["run"] == 2
    assert await app.locks() == {}


@pytest.mark.parametrize("broker", ["redis-list", "redis-stream", "nats"])
async def test_killed_worker_leaves_a_lock_that_expires_on_its_ttl(
    launch: Launch, broker: str
) -> None:
    app = await launch(broker=broker, default_ttl=TTL, heartbeat_interval=HEARTBEAT)
    handle, run, key = await _one_running(app)

    await _crash(app, run["pid"])
    assert (await app.holders()).get(key) == handle.task_id
    await app.assert_duplicate(app.tasks.hold, handle.task_id, tag="k")
    # Its last heartbeat gave it at most TTL seconds (so it is gone within TTL +
    # one interval of the kill), and nothing refreshes it any more.
    await _expires_then_runs_again(app, key, TTL)


async def test_killed_worker_on_rabbitmq_is_redelivered_under_the_same_lock(
    launch: Launch,
) -> None:
    app = await launch(broker="rabbitmq", default_ttl=TTL, heartbeat_interval=HEARTBEAT)
    handle, first, key = await _one_running(app)

    os.kill(first["pid"], signal.SIGKILL)
    # Another worker process runs it again, and keeps the lock alive.
    await _runs_again_under_its_lock(app, handle, first, key, TTL)

    await _ends_as_a_second_run(app, handle)


# A running lease: the queued task keeps the full TTL, the running one a short lease.

LONG_TTL = 300  # the spec's default: a crash without a lease blocks calls this long
LEASE = 2


@pytest.mark.parametrize("broker", ["redis-list", "redis-stream"])
async def test_killed_worker_with_a_running_lease_frees_the_lock_within_the_lease(
    launch: Launch, broker: str
) -> None:
    app = await launch(
        broker=broker, default_ttl=LONG_TTL, heartbeat_interval=0.5, running_ttl=LEASE
    )
    handle = await app.tasks.hold.kiq(tag="k")
    key = await app.lock_of(handle.task_id)
    assert key is not None

    async def full_ttl() -> bool:  # queued: the extension after the send gives it all
        return await app.redis.pttl(key) > (LONG_TTL - 10) * 1000

    await app.wait_until(full_ttl, "the queued task's lock to get its full TTL")
    app.start_worker()
    [run] = await app.wait_started("k")
    assert 0 < await app.redis.pttl(key) <= LEASE * 1000  # running: the lease
    await app.wait_refreshed(key, LEASE)  # kept alive past the lease while it runs
    await app.assert_duplicate(app.tasks.hold, handle.task_id, tag="k")

    await _crash(app, run["pid"])
    # Freed within the lease of the kill, not the 300 s TTL.
    await _expires_then_runs_again(app, key, LEASE)


async def test_killed_worker_on_rabbitmq_with_a_running_lease_is_redelivered_once(
    launch: Launch,
) -> None:
    app = await launch(
        broker="rabbitmq", default_ttl=LONG_TTL, heartbeat_interval=0.5, running_ttl=LEASE
    )
    handle, first, key = await _one_running(app)

    os.kill(first["pid"], signal.SIGKILL)
    # RabbitMQ hands the unacknowledged message to the other worker process at
    # once: it runs under the same lock (re-asserted on the lease, or taken back
    # if the lease had lapsed), is not refused, and runs exactly once more.
    await _runs_again_under_its_lock(app, handle, first, key, LEASE)

    await _ends_as_a_second_run(app, handle)


@pytest.mark.parametrize("broker", ["redis-list", "rabbitmq", "nats"])
async def test_stopped_worker_finishes_the_running_task_then_releases_its_lock(
    launch: Launch, broker: str
) -> None:
    app = await launch(broker=broker, default_ttl=TTL, heartbeat_interval=HEARTBEAT)
    handle = await app.tasks.hold.kiq(tag="t")
    worker = app.start_worker()
    await app.wait_started("t")
    key = await app.lock_of(handle.task_id)
    assert key is not None

    os.kill(worker.pid, signal.SIGTERM)

    async def told_to_stop() -> bool:
        return worker.log().count("Stopped process worker-") == 2

    await app.wait_until(told_to_stop, "the worker processes to be told to stop")
    # Shutting down, the worker still runs the task and keeps its lock alive.
    await app.wait_refreshed(key, TTL)
    await app.assert_duplicate(app.tasks.hold, handle.task_id, tag="t")

    await app.open_gate("t")
    try:
        status = worker.wait(timeout=30)
    except subprocess.TimeoutExpired:  # CI saw a NATS worker not stop once: keep its log
        pytest.fail(f"the worker did not stop within 30 s; its log:\n{worker.log()}")
    assert status == 0, worker.log()
    assert worker.children() == []
    assert not (await handle.wait_result(timeout=5)).is_err
    assert await app.locks() == {}
    assert "Traceback" not in worker.log()


async def test_stopped_worker_that_gives_up_on_a_task_leaves_its_lock_to_expire(
    launch: Launch,
) -> None:
    ttl = TTL + 1  # time to see the lock once the worker process is gone
    app = await launch(broker="redis-list", default_ttl=ttl, heartbeat_interval=HEARTBEAT)
    handle = await app.tasks.hold.kiq(tag="t")
    worker = app.start_worker("--wait-tasks-timeout", "0.5")
    [run] = await app.wait_started("t")
    key = await app.lock_of(handle.task_id)
    assert key is not None

    os.kill(worker.pid, signal.SIGTERM)

    async def gone() -> bool:
        return not is_alive(run["pid"])

    await app.wait_until(gone, "the worker process that ran the task to exit")
    # The task never ended, so its lock was not released; but nothing keeps it
    # alive any more, and it expires on its TTL.
    assert (await app.holders()).get(key) == handle.task_id
    await app.watch_expire(key, ttl)
    assert worker.wait(timeout=30) == 0, worker.log()
    assert worker.children() == []

    app.start_worker()
    again = await app.tasks.hold.kiq(tag="t")
    await app.open_gate("t")
    assert (await again.wait_result(timeout=20)).return_value["run"] == 2
    assert await app.locks() == {}
