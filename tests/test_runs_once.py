"""A call runs once by default: copies of a call that succeeded, and what the rest of the app sees.

Issue 30. A broker delivers a message again after its run succeeded (a lost
acknowledgement, a Streams reclaim, NATS ``ack_wait``): with no option set, the
copy does not run its body, is acknowledged, looks to every other middleware
like a run that returned, and answers its caller with the call's result, or
with a `ResultLostError` where the worker died before storing it. A worker that
dies mid-task frees its calls within the running lease (30 s) by default.
The end-to-end versions, with real workers on four brokers, are in
``tests/e2e/test_runs_once.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio
from taskiq import AckableMessage, BrokerMessage, TaskiqMessage, TaskiqMiddleware, TaskiqResult
from taskiq.abc.result_backend import AsyncResultBackend

from taskiq_deduplication import DuplicateTaskError, LockEventKind, ResultLostError
from tests._brokers import BrokerFactory, HoldingBroker
from tests._middlewares import MiddlewareFactory, dedup_middleware
from tests._topologies import all_topologies


class Observer(TaskiqMiddleware):
    """A middleware after ours, as a logger or an error tracker is: what it reads and counts."""

    def __init__(self) -> None:
        super().__init__()
        self.arguments: list[list[Any]] = []
        self.errors: list[BaseException] = []
        self.ended: list[bool] = []

    def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        self.arguments.append([*message.args, *message.kwargs.values()])
        return message

    def on_error(
        self, message: TaskiqMessage, result: TaskiqResult[Any], exception: BaseException
    ) -> None:
        self.errors.append(exception)

    def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        self.ended.append(result.is_err)


async def deliver(broker: HoldingBroker, message: BrokerMessage, acks: list[str]) -> None:
    """Deliver ``message`` as a broker that wants an acknowledgement does."""

    async def ack() -> None:
        acks.append(message.task_id)

    await broker.receiver.callback(message=AckableMessage(data=message.message, ack=ack))


@all_topologies()
async def test_a_copy_of_a_call_that_succeeded_does_not_run_again_with_default_settings(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker)
    events: list[Any] = []
    dedup_middleware(broker).subscribe(events.append)
    bodies: list[int] = []

    @broker.task
    async def charge(order: int) -> str:
        bodies.append(order)
        return f"charged {order}"

    sent = await charge.kiq(order=7)
    (message,) = broker.queued
    acks: list[str] = []
    await broker.deliver()  # the run succeeds; the broker never hears of it
    await deliver(broker, message, acks)  # the lost ack: the same message again
    await deliver(broker, message, acks)  # and again
    assert bodies == [7]
    assert acks == [message.task_id, message.task_id]  # acknowledged, not back for ever
    assert (await sent.wait_result(timeout=5)).return_value == "charged 7"
    assert [e.kind for e in events].count(LockEventKind.SKIPPED) == 2
    # Not a success TTL: a new call with the same arguments is accepted at once.
    await charge.kiq(order=7)
    await broker.deliver()
    assert bodies == [7, 7]
    # What is left is the memory of each call, for the redelivery window (an hour).
    done = [key async for key in redis_client.scan_iter(match=f"{prefix}#done:*")]
    assert len(done) == 2
    for key in done:
        assert 3590_000 < await redis_client.pttl(key) <= 3600_000


async def test_a_skipped_copy_is_a_run_that_returned_for_every_other_middleware(
    make_broker: BrokerFactory, make_middleware: MiddlewareFactory
) -> None:
    observer = Observer()
    broker = await make_broker(
        broker_class=HoldingBroker, middlewares=[make_middleware(), observer]
    )
    bodies: list[int] = []

    @broker.task(deduplication_success_ttl=3600)
    async def charge(order: int) -> int:
        bodies.append(order)
        return order

    await charge.kiq(7)
    (message,) = broker.queued
    acks: list[str] = []
    await deliver(broker, message, acks)
    await deliver(broker, message, acks)  # remembered by the success TTL too
    await deliver(broker, message, acks)
    assert bodies == [7]
    assert observer.arguments == [[7], [7], [7]]  # it read the arguments every time
    assert observer.errors == []  # no error for an error tracker to count
    assert observer.ended == [False, False, False]
    assert len(acks) == 3


class LosingBackend(AsyncResultBackend[Any]):
    """A result backend whose first write never happens: the worker dies during it."""

    def __init__(self) -> None:
        self.results: dict[str, TaskiqResult[Any]] = {}
        self.lost_once = False

    async def set_result(self, task_id: str, result: TaskiqResult[Any]) -> None:
        if not self.lost_once:
            self.lost_once = True
            raise asyncio.CancelledError  # the worker stops mid-write
        self.results[task_id] = result

    async def is_result_ready(self, task_id: str) -> bool:
        return task_id in self.results

    async def get_result(self, task_id: str, with_logs: bool = False) -> TaskiqResult[Any]:
        return self.results[task_id]


async def test_a_copy_of_a_call_whose_result_was_lost_answers_with_result_lost_error(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(broker_class=HoldingBroker)
    backend = LosingBackend()
    broker.with_result_backend(backend)
    bodies: list[int] = []

    @broker.task
    async def charge(order: int) -> int:
        bodies.append(order)
        return order

    sent = await charge.kiq(7)
    (message,) = broker.queued
    with pytest.raises(asyncio.CancelledError):  # the success was recorded; the save was not
        await broker.deliver()
    acks: list[str] = []
    await deliver(broker, message, acks)  # the broker delivers it again
    assert bodies == [7]
    assert acks == [message.task_id]
    result = await sent.wait_result(timeout=5)
    assert result.is_err
    assert isinstance(result.error, ResultLostError)
    assert message.task_id in str(result.error)
    await deliver(broker, message, acks)  # a later copy keeps that answer
    assert bodies == [7]
    assert isinstance((await sent.wait_result(timeout=5)).error, ResultLostError)


async def test_a_send_that_reuses_the_task_id_of_a_call_that_succeeded_runs(
    broker: HoldingBroker,
) -> None:
    """Only a copy of the same send is skipped: ``with_task_id`` makes a new call."""
    bodies: list[int] = []

    @broker.task
    async def nightly(n: int) -> None:
        bodies.append(n)

    await nightly.kicker().with_task_id("fixed").kiq(1)
    await broker.deliver()
    await nightly.kicker().with_task_id("fixed").kiq(1)
    await broker.deliver()
    assert bodies == [1, 1]


async def test_a_copy_of_a_failed_attempt_is_not_run_once_its_retry_succeeded(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, retries=3)
    bodies: list[str] = []

    @broker.task(retry_on_error=True)
    async def flaky() -> str:
        bodies.append("ran")
        if len(bodies) == 1:
            msg = "the first attempt fails"
            raise RuntimeError(msg)
        return "done"

    sent = await flaky.kiq()
    (attempt,) = broker.queued
    await broker.deliver()  # the attempt fails; its retry runs and succeeds
    assert bodies == ["ran", "ran"]
    acks: list[str] = []
    await deliver(broker, attempt, acks)  # the failed attempt, delivered again later
    assert bodies == ["ran", "ran"]
    assert acks == [attempt.task_id]
    assert (await sent.wait_result(timeout=5)).return_value == "done"


async def test_redelivery_window_zero_remembers_nothing(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, redelivery_window=0)
    bodies: list[int] = []

    @broker.task
    async def charge(order: int) -> None:
        bodies.append(order)

    await charge.kiq(7)
    (message,) = broker.queued
    await broker.deliver()
    await deliver(broker, message, [])
    assert bodies == [7, 7]  # as documented: nothing tells the copy
    assert [key async for key in redis_client.scan_iter(match=f"{prefix}#*")] == []


@pytest.mark.parametrize(
    ("options", "running_ttl_s"),
    [
        ({}, 30),  # the default lease
        ({"heartbeat_interval": 20}, 60),  # three intervals, the interval kept
        ({"running_ttl": 0}, 300),  # none: the full TTL while running
        ({"heartbeat": False}, 300),  # nothing to keep a lease alive
    ],
)
async def test_a_running_task_keeps_its_lock_on_a_30_second_lease_by_default(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    options: dict[str, Any],
    running_ttl_s: int,
) -> None:
    broker: HoldingBroker = await make_broker(
        broker_class=HoldingBroker, default_ttl=300, **options
    )
    started, release = asyncio.Event(), asyncio.Event()

    @broker.task
    async def report() -> None:
        started.set()
        await release.wait()

    await report.kiq()
    await asyncio.sleep(0.05)  # the extension to the full TTL is written ahead
    (key,) = [key async for key in redis_client.scan_iter(match=f"{prefix}:*")]
    assert 295_000 < await redis_client.pttl(key) <= 300_000  # queued: the full TTL
    running = asyncio.create_task(broker.deliver())
    await asyncio.wait_for(started.wait(), 5)
    assert (running_ttl_s - 5) * 1000 < await redis_client.pttl(key) <= running_ttl_s * 1000
    with pytest.raises(DuplicateTaskError):
        await report.kiq()
    release.set()
    await running
