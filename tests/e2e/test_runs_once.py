"""A call whose run succeeded runs once, whatever the broker delivers again.

A broker delivers a message again when it did not hear of its ack: RabbitMQ
when the worker died before acking, a Redis stream's reclaim of a message left
pending, NATS after ``ack_wait``. Here the worker of an ``e2e.once`` task dies
once, on purpose (:class:`tests.e2e.app.CopyMaker`: ``os._exit(1)``), after the
run succeeded: after its result was saved (``post_save``), or between the
success and the save (after every middleware's ``post_execute``). The broker
then hands the very same message (same task_id) to another worker process;
``ListQueueBroker`` never does, so the test pushes the raw message again.

With no option set, such a copy does not run the task body again, is
acknowledged, and leaves the caller a result: the first run's, or a
``ResultLostError`` when the run's result was never saved. A new call with the
same arguments is still accepted at once (no success TTL). A middleware after
deduplication (a logger) sees a copy's arguments as they are and no error.

And a worker killed mid-task with the default settings (``default_ttl=300``, no
``running_ttl``) holds its call's lock for no more than about 30 s.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import time
from typing import Any

import pytest
from taskiq import AsyncTaskiqDecoratedTask, AsyncTaskiqTask, TaskiqResult
from taskiq.exceptions import TaskiqResultTimeoutError

from taskiq_deduplication import DeduplicationError, DuplicateTaskError
from tests.e2e.app import BROKERS, ONCE_REMEMBERED_TASK, ONCE_TASK
from tests.e2e.conftest import App, Launch, Process, is_alive, require_broker_server
from tests.e2e.test_redelivery import queue_is_empty, stop

#: ``idle_timeout`` of the stream broker (ms) and ``ack_wait`` of NATS (s): how
#: soon they deliver an unacknowledged message again.
IDLE_TIMEOUT_MS = 1500
ACK_WAIT = 2.0
#: How long the caller waits for a result that must come.
RESULT_WAIT = 20
#: The name of the error a copy stores when the run's result was lost.
RESULT_LOST = "ResultLostError"
#: The tasks of the later-middleware test: the defaults, and a success remembered.
KINDS = {"defaults": ONCE_TASK, "success-ttl": ONCE_REMEMBERED_TASK}
#: After a kill -9 with the default settings, a new identical call is accepted
#: within this many seconds (the lock lasts at most about 30 s once nothing
#: keeps it alive; the rest is slack).
KILLED_LOCK_BOUND = 35.0

Report = dict[str, Any]


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest) -> str:
    """Each broker of the suite, RabbitMQ and NATS where they answer."""
    kind = str(request.param)
    require_broker_server(kind)
    return kind


def _options(broker: str, **config: Any) -> dict[str, Any]:
    """The ``launch`` options of ``broker`` that deliver an unacknowledged message soon."""
    if broker == "redis-stream":
        return {"broker": broker, "idle_timeout": IDLE_TIMEOUT_MS, **config}
    if broker == "nats":
        return {"broker": broker, "ack_wait": ACK_WAIT, **config}
    return {"broker": broker, **config}


def _task(app: App, name: str) -> AsyncTaskiqDecoratedTask[..., Any]:
    task = app.broker.find_task(name)
    assert task is not None, name
    return task


def _list_queue(app: App) -> str:
    return f"{app.config.prefix}:queue"


async def _raw_message(app: App) -> str | None:
    """For ``ListQueueBroker``: the one message queued, as sent (``None`` on the others).

    Read before a worker starts, to push it again as the copy that this broker
    never delivers of its own.
    """
    if app.config.broker != "redis-list":
        return None
    queued = await app.redis.lrange(_list_queue(app), 0, -1)
    assert len(queued) == 1, queued
    return _text(queued[0])


def _text(value: bytes | str) -> str:
    # The client decodes responses; redis-py's types do not know it.
    return value.decode() if isinstance(value, bytes) else value


async def _reports(app: App, name: str, tag: str) -> list[Report]:
    return [json.loads(item) for item in await app.report(name, tag)]


async def _wait_crashed(app: App, tag: str) -> Report:
    """Wait until the worker process that ran ``tag`` has died on purpose; return who it was."""

    async def crashed() -> str:
        value = await app.redis.get(app.config.key("crashed", tag))
        return "" if value is None else _text(value)

    crash: Report = json.loads(await app.wait_until(crashed, f"the worker of {tag!r} to crash"))

    async def dead() -> bool:
        return not is_alive(crash["pid"])

    await app.wait_until(dead, "the crashed worker process to be gone")
    return crash


async def _deliver_copy(app: App, tag: str, task_id: str, raw: str | None) -> None:
    """Wait until the broker delivers the message of ``task_id`` (of ``tag``) a second time.

    ``ListQueueBroker`` never does: the raw message is pushed again. A Redis
    stream's worker reclaims an idle message only after a read that found new
    ones: small tasks are sent all along, as a busy queue would.
    """
    if app.config.broker == "redis-list":
        assert raw is not None
        await app.redis.lpush(_list_queue(app), raw)
    pokes = 0

    async def delivered_again() -> bool:
        nonlocal pokes
        if app.config.broker == "redis-stream":
            pokes += 1
            await app.tasks.count.kiq(n=1_000_000 + pokes)
            await asyncio.sleep(0.2)
        delivered = await _reports(app, "delivered", tag)
        return [d["task_id"] for d in delivered].count(task_id) >= 2

    await app.wait_until(delivered_again, f"the broker to deliver {tag!r} again")


async def _wait_copy_ended(app: App, tag: str, task_id: str) -> list[Report]:
    """Wait until the copy of ``task_id`` has passed every ``post_execute``; return both ends."""

    async def both_ended() -> list[Report]:
        ended = [e for e in await _reports(app, "ended", tag) if e["task_id"] == task_id]
        return ended if len(ended) >= 2 else []

    return await app.wait_until(both_ended, f"the copy of {tag!r} to end")


async def _assert_acknowledged(app: App, worker: Process) -> None:
    """Check that no message of the test is left unacknowledged.

    RabbitMQ counts a message delivered and not acked as no message: ``worker``
    is stopped first (RabbitMQ only), which puts such a copy back in the queue,
    where it is counted. The other brokers are asked while the worker runs.
    """
    broker = app.config.broker
    if broker == "rabbitmq":
        await stop(app, worker)
        assert await queue_is_empty(app), "the copy was not acknowledged: RabbitMQ holds it"
    elif broker == "redis-list":  # no acks: the copy was taken, nothing is left
        assert await app.redis.llen(_list_queue(app)) == 0
    else:

        async def acknowledged() -> bool:
            return await queue_is_empty(app)

        await app.wait_until(acknowledged, "the copy to be acknowledged", timeout=10)


async def _result(handle: AsyncTaskiqTask[Any], what: str) -> TaskiqResult[Any]:
    try:
        return await handle.wait_result(timeout=RESULT_WAIT)
    except TaskiqResultTimeoutError:
        pytest.fail(f"{what}: the caller got no result within {RESULT_WAIT}s")


async def _assert_first_result(
    app: App, result: TaskiqResult[Any], original: Report, tag: str
) -> None:
    """Check that the caller reads the first run's value (a copy that ran overwrites it)."""
    if result.is_err or result.return_value != original:
        pytest.fail(
            f"the caller got {result.error or result.return_value!r}, not the first run's "
            f"{original}: a copy overwrote it? the runs: {await app.started(tag)}"
        )


def _result_lost_error() -> type[BaseException]:
    """``taskiq_deduplication.ResultLostError``, looked up when a test needs it."""
    name = RESULT_LOST
    error: type[BaseException] = getattr(importlib.import_module("taskiq_deduplication"), name)
    return error


async def _first_run(
    app: App, task: AsyncTaskiqDecoratedTask[..., Any], order: int
) -> tuple[AsyncTaskiqTask[Any], Report, str | None, Process]:
    """Send ``task(order=order)``, start a worker, and return once its run has started.

    Returns:
        The call's handle, its run, its raw message (``ListQueueBroker`` only),
        and the worker.
    """
    handle = await task.kiq(order=order)
    raw = await _raw_message(app)
    worker = app.start_worker()
    # On RabbitMQ the copy of a run that died may have started already.
    first = (await app.wait_started(f"once-{order}"))[0]
    assert first["task_id"] == handle.task_id
    return handle, first, raw, worker


# 1. The ack of a success is lost: the copy does not run again.


@pytest.mark.timeout(120)
async def test_copy_of_a_succeeded_run_does_not_run_again_with_no_option_set(
    launch: Launch, broker: str
) -> None:
    app = await launch(**_options(broker, crash_at="post_save"))
    pay = _task(app, ONCE_TASK)
    tag = "once-1"
    handle, first, raw, worker = await _first_run(app, pay, 1)

    result = await _result(handle, "the first run")
    original = {"order": 1, "run": 1, "pid": first["pid"]}
    await _assert_first_result(app, result, original, tag)
    # The worker died after saving the result, before the broker heard of it.
    await _wait_crashed(app, tag)

    # The run has ended: a new call with the same arguments is accepted (no success TTL).
    try:
        again = await pay.kiq(order=1)
    except DuplicateTaskError as exc:
        pytest.fail(f"a new call after the run succeeded was refused: {exc}")
    assert again.task_id != handle.task_id

    await _deliver_copy(app, tag, handle.task_id, raw)
    await _wait_copy_ended(app, tag, handle.task_id)
    second = await _result(again, "the new call")
    assert not second.is_err, second.error

    started = await app.started(tag)
    runs_of_first = [s for s in started if s["task_id"] == handle.task_id]
    assert len(runs_of_first) == 1, (
        f"the copy of a run that succeeded ran the task body again: {started}"
    )
    assert [s["task_id"] for s in started if s["task_id"] == again.task_id] == [again.task_id], (
        f"the new call did not run exactly once: {started}"
    )
    assert await app.runs(tag) == 2
    await _assert_acknowledged(app, worker)
    result = await _result(handle, "the first run, read again")
    await _assert_first_result(app, result, original, tag)
    delivered = await _reports(app, "delivered", tag)
    assert [d["task_id"] for d in delivered].count(handle.task_id) == 2


# 2. The worker dies between the success and the save: the copy tells the caller.


@pytest.mark.timeout(120)
async def test_copy_of_a_run_whose_result_was_lost_answers_the_caller(
    launch: Launch, broker: str
) -> None:
    app = await launch(**_options(broker, crash_at="post_execute"))
    pay = _task(app, ONCE_TASK)
    tag = "once-2"
    handle, first, raw, worker = await _first_run(app, pay, 2)

    # The run succeeded; its worker died after every post_execute, before the save.
    await _wait_crashed(app, tag)
    [ended] = await _reports(app, "ended", tag)
    assert ended["is_err"] is False, ended
    assert not await handle.is_ready(), "the result was saved before the worker died"

    await _deliver_copy(app, tag, handle.task_id, raw)
    result = await _result(handle, "the copy of a run whose result was lost")
    await _wait_copy_ended(app, tag, handle.task_id)

    started = await app.started(tag)
    assert len(started) == 1, f"the copy of a run that succeeded ran the task body again: {started}"
    assert await app.runs(tag) == 1
    original = {"order": 2, "run": 1, "pid": first["pid"]}
    if result.is_err:
        assert type(result.error).__name__ == RESULT_LOST, (
            f"expected {RESULT_LOST} or the original value, got the error {result.error!r}"
        )
        lost = _result_lost_error()
        assert isinstance(result.error, lost)
        assert issubclass(lost, DeduplicationError)
    else:
        assert result.return_value == original, (
            f"expected {RESULT_LOST} or the original value {original}, got {result.return_value}"
        )
    await _assert_acknowledged(app, worker)


# 3. A middleware after deduplication: the copy is no error to it.


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(KINDS))
async def test_later_middleware_sees_a_copy_of_a_succeeded_run_as_no_error(
    launch: Launch, broker: str, kind: str
) -> None:
    app = await launch(**_options(broker, crash_at="post_save", later_middleware=True))
    task = _task(app, KINDS[kind])
    tag = "once-3"
    handle, first, raw, worker = await _first_run(app, task, 3)
    result = await _result(handle, "the first run")
    original = {"order": 3, "run": 1, "pid": first["pid"]}
    await _assert_first_result(app, result, original, tag)
    await _wait_crashed(app, tag)

    await _deliver_copy(app, tag, handle.task_id, raw)

    async def copy_passed_the_later_middleware() -> bool:
        seen = await _reports(app, "later-seen", tag)
        errors = await app.report("later-errors", tag)
        return bool(errors) or [s["task_id"] for s in seen].count(handle.task_id) >= 2

    await app.wait_until(copy_passed_the_later_middleware, "the copy to reach the later middleware")
    errors = await _reports(app, "later-errors", tag)
    assert errors == [], f"the later middleware's pre_execute raised on the copy: {errors}"
    seen = [s for s in await _reports(app, "later-seen", tag) if s["task_id"] == handle.task_id]
    assert seen[-1]["kwargs"] == {"order": 3}, seen

    await _wait_copy_ended(app, tag, handle.task_id)
    on_error = await app.redis.hget(app.config.key("on-error", tag), handle.task_id)
    calls = await app.report("on-error-calls", tag)
    assert int(on_error or 0) == 0, f"the later middleware's on_error was called: {calls}"
    assert await app.runs(tag) == 1, (
        f"the copy of a run that succeeded ran the task body again: {await app.started(tag)}"
    )
    await _assert_acknowledged(app, worker)
    result = await _result(handle, "the first run, read again")
    await _assert_first_result(app, result, original, tag)


# 4. kill -9 mid-task with the default settings: the lock lasts about 30 s, not 300.


async def _crash(app: App, pid: int) -> None:
    os.kill(pid, signal.SIGKILL)

    async def dead() -> bool:
        return not is_alive(pid)

    await app.wait_until(dead, "the worker process to die")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("broker", ["redis-list", "redis-stream"])
async def test_killed_worker_with_default_settings_frees_its_call_within_30s(
    launch: Launch, broker: str
) -> None:
    # The middleware's defaults: default_ttl=300, no running_ttl, its own
    # heartbeat interval. Neither broker delivers the killed run's message again
    # within the test (the stream's idle_timeout is 600 s).
    app = await launch(broker=broker, default_ttl=300, heartbeat_interval=None)
    handle = await app.tasks.hold.kiq(tag="k")
    app.start_worker()
    [run] = await app.wait_started("k")

    await _crash(app, run["pid"])
    killed = time.monotonic()
    # Right after the kill the call is still held: refused.
    await app.assert_duplicate(app.tasks.hold, handle.task_id, tag="k")

    again: AsyncTaskiqTask[Any] | None = None
    refusal: DuplicateTaskError | None = None
    while again is None:
        elapsed = time.monotonic() - killed
        if elapsed > KILLED_LOCK_BOUND:
            pytest.fail(
                f"an identical call is still refused {elapsed:.1f}s after the worker "
                f"was killed (bound {KILLED_LOCK_BOUND}s): {refusal}; "
                f"lock PTTLs: {await _pttls(app)}"
            )
        try:
            again = await app.tasks.hold.kiq(tag="k")
        except DuplicateTaskError as exc:
            refusal = exc
            await asyncio.sleep(0.25)
    accepted_after = time.monotonic() - killed
    assert accepted_after <= KILLED_LOCK_BOUND, accepted_after

    await app.open_gate("k")
    result = await _result(again, "the call accepted after the kill")
    assert result.return_value["run"] == 2, result.return_value


async def _pttls(app: App) -> dict[str, int]:
    """The PTTL of each lock of the test, for a failure message."""
    return {key: await app.redis.pttl(key) for key in await app.locks()}
