"""The brokers of the tests: two small real ones, and the type of the fixture that builds them.

Both are ``InMemoryBroker`` with one change to ``kick``: ``HoldingBroker`` keeps
the messages until the test delivers them (a queue the test controls, so a task
can wait "in the queue" while the test looks at its lock); ``RefusingBroker``
refuses every message, as a broker that is down does. ``BrokerFactory`` is the
type of the ``make_broker`` fixture (``tests/conftest.py``), which builds any of
them with a deduplication middleware.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, overload

from taskiq import (
    BrokerMessage,
    InMemoryBroker,
    ScheduledTask,
    ScheduleSource,
    SmartRetryMiddleware,
    TaskiqMiddleware,
)


class HoldingBroker(InMemoryBroker):
    """Keeps sent messages until :meth:`deliver` runs them, in order."""

    def __init__(self, await_inplace: bool = False) -> None:
        super().__init__(await_inplace=await_inplace)
        self.queued: list[BrokerMessage] = []

    async def kick(self, message: BrokerMessage) -> None:
        self.queued.append(message)

    async def deliver(self) -> None:
        """Run every queued message through the worker side, one after the other."""
        while self.queued:
            await self.deliver_one()

    async def deliver_one(self) -> None:
        """Run the oldest queued message; what it sends stays queued."""
        await self.receiver.callback(message=self.queued.pop(0).message)


BrokerT = TypeVar("BrokerT", bound=InMemoryBroker)


class BrokerFactory(Protocol):
    """The type of the ``make_broker`` fixture."""

    @overload
    async def __call__(
        self,
        *,
        broker_class: type[BrokerT],
        middlewares: list[TaskiqMiddleware] | None = None,
        await_inplace: bool = False,
        retries: int | None = None,
        **options: Any,
    ) -> BrokerT: ...

    @overload
    async def __call__(
        self,
        *,
        middlewares: list[TaskiqMiddleware] | None = None,
        await_inplace: bool = False,
        retries: int | None = None,
        **options: Any,
    ) -> InMemoryBroker: ...


async def queued_job(make_broker: BrokerFactory) -> tuple[HoldingBroker, Any]:
    """A started ``HoldingBroker`` (a queue the test delivers) and a task ``job()``, a no-op."""
    broker = await make_broker(broker_class=HoldingBroker)

    async def job() -> None: ...

    return broker, broker.register_task(job)


async def merged_into(call: Callable[[], Awaitable[Any]]) -> str:
    """Make a ``kiq`` that merges into its queued holder; the holder's task_id it hands back.

    A merged call is no refusal (issue 31): ``kiq`` raises nothing and returns
    the handle of the holder, which will run with the call's arguments. A
    call that is refused instead fails the test with its ``DuplicateTaskError``.
    """
    handle = await call()
    task_id: str = handle.task_id
    return task_id


class BrokerDownError(ConnectionError):
    """What the refusing broker raises."""


class RefusingBroker(InMemoryBroker):
    """Fails every send, like a broker that cannot be reached."""

    async def kick(self, message: BrokerMessage) -> None:
        msg = f"broker unreachable, {message.task_name} not queued"
        raise BrokerDownError(msg)


class KeptSchedules(ScheduleSource):
    """A schedule source that keeps what is added, for the test to fire by hand."""

    def __init__(self) -> None:
        self.schedules: list[ScheduledTask] = []

    async def get_schedules(self) -> list[ScheduledTask]:
        return list(self.schedules)

    async def add_schedule(self, schedule: ScheduledTask) -> None:
        self.schedules.append(schedule)


def retry_middleware(retry_class: type[TaskiqMiddleware]) -> TaskiqMiddleware:
    """A retry middleware of ``retry_class`` that sends each retry at once, up to 5 attempts."""
    options: dict[str, Any] = {"default_retry_count": 5}
    if retry_class is SmartRetryMiddleware:
        options |= {"default_delay": 0, "use_jitter": False, "use_delay_exponent": False}
    return retry_class(**options)


def holds_no_lock(labels: dict[str, Any]) -> bool:
    """Whether a message went out without a lock: no lock recorded, or one with no owner.

    (An exclusive task's message records its key under no owner token, so that
    its run still takes its key's run slot.)
    """
    return str(labels.get("_deduplication_lock_owner", "- ")).startswith("- ")
