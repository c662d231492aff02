"""What callers and tasks use: join the task that holds a lock, and see one's own lock.

[kiq_or_join][taskiq_deduplication.kiq_or_join] sends a task, or hands back the
task that holds its lock, so that ``wait_result()`` gives the winner's result.
[TaskLock][taskiq_deduplication.TaskLock] is a taskiq dependency: a task that
takes one can check that its lock is still its own and pass on its fence.
"""

from __future__ import annotations

import contextvars
import inspect
import typing
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from taskiq import AsyncTaskiqTask, Context, TaskiqDepends
from taskiq.kicker import AsyncKicker

from taskiq_deduplication.exceptions import DuplicateTaskError, NoLockError
from taskiq_deduplication.run.execution import run_of
from taskiq_deduplication.run.limits import Limits, limited_run_of
from taskiq_deduplication.store.call import RedisFailed

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from taskiq import AsyncTaskiqDecoratedTask
    from taskiq.abc.result_backend import AsyncResultBackend
    from typing_extensions import ParamSpec

    from taskiq_deduplication.run.execution import Execution

    P = ParamSpec("P")
else:
    P = TypeVar("P")

__all__ = ["JoinedTask", "TaskLock", "kiq_or_join"]

R = TypeVar("R")
T = TypeVar("T")

#: While kiq_or_join sends: a list that the refusal it will join marks, so that
#: it is logged as no warning. Spent once the send is over, so that a task the
#: send started in this process (InMemoryBroker), which inherits the context,
#: does not count as joining.
joining: contextvars.ContextVar[list[object] | None] = contextvars.ContextVar(
    "taskiq_deduplication_joining", default=None
)


class JoinedTask(AsyncTaskiqTask[R], Generic[R]):
    """The handle [kiq_or_join][taskiq_deduplication.kiq_or_join] returns.

    An ``AsyncTaskiqTask`` (``wait_result()``, ``is_ready()``, ``task_id``) that
    also says which task it is a handle of.

    Attributes:
        joined (bool): ``True`` when the call was not sent and this is the
            handle of the task that holds its lock; ``False`` for a new send.
        duplicate (DuplicateTaskError | None): The refusal that was joined
            (its ``merged`` and ``same_arguments`` say more), or ``None``.
    """

    def __init__(
        self,
        task_id: str,
        result_backend: AsyncResultBackend[R],
        *,
        duplicate: DuplicateTaskError | None = None,
    ) -> None:
        """A handle of task ``task_id``; ``duplicate`` is the refusal it joined, if any."""
        super().__init__(task_id, result_backend)
        self.duplicate = duplicate
        self.joined = duplicate is not None


@overload
async def kiq_or_join(
    task: AsyncTaskiqDecoratedTask[P, Coroutine[Any, Any, T]]
    | AsyncKicker[P, Coroutine[Any, Any, T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> JoinedTask[T]: ...


@overload
async def kiq_or_join(
    task: AsyncTaskiqDecoratedTask[P, R] | AsyncKicker[P, R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> JoinedTask[R]: ...


async def kiq_or_join(task: Any, *args: Any, **kwargs: Any) -> JoinedTask[Any]:
    """Send a task, or join the task that holds its lock.

    A new send behaves as ``kiq()``. When the call is a duplicate, this costs
    no more than the refused ``kiq()`` (the acquire's reply names the holder)
    and returns a handle of the holder instead of raising: with a shared result
    backend, ``await handle.wait_result()`` gives the winner's result. A call
    merged into a queued holder (``deduplication_merge="latest"``, a debounce)
    is joined too (``kiq()`` itself returns the holder's handle then): its
    ``duplicate.merged`` says so.

    Example:
        ```python
        handle = await kiq_or_join(build_report, user_id=42)
        report = await handle.wait_result(timeout=30)
        ```

    Args:
        task: The task, or a kicker of it (``task.kicker().with_labels(...)``).
        *args: The task's positional arguments.
        **kwargs: The task's keyword arguments.

    Returns:
        A handle whose ``joined`` says whether it is the holder's.

    Raises:
        DuplicateTaskError: The lock is held by a value this library did not
            write, so no task can be joined.
    """
    kicker: AsyncKicker[Any, Any] = task if isinstance(task, AsyncKicker) else task.kicker()
    backend = kicker.broker.result_backend
    marker: list[object] = []
    token = joining.set(marker)
    try:
        sent = await kicker.kiq(*args, **kwargs)
    except DuplicateTaskError as duplicate:
        if duplicate.holder_task_id is None:
            raise
        return JoinedTask(duplicate.holder_task_id, backend, duplicate=duplicate)
    finally:
        marker.append(True)
        joining.reset(token)
    # A call merged into its queued holder returns the holder's handle from kiq().
    merged = next((m for m in marker if isinstance(m, DuplicateTaskError)), None)
    return JoinedTask(sent.task_id, backend, duplicate=merged)


class TaskLock:
    """The lock of the running task, as a taskiq dependency.

    Declare it as a parameter; taskiq passes it in when the task runs, and the
    sender, which sees the parameter, draws a fence for every send of the task.

    ```python
    @broker.task(deduplication_key="nightly-import")
    async def nightly_import(lock: TaskLock = TaskiqDepends()) -> None:
        if await lock.held():
            await store.write(batch, fence=lock.fence)
    ```

    Attributes:
        locked (bool): Whether the run has a lock at all. A task without one
            (deduplication off, sent fail-open) can still take a ``TaskLock``:
            ``held()`` is then ``False`` and ``key`` and ``fence`` raise
            [NoLockError][taskiq_deduplication.exceptions.NoLockError].
    """

    def __init__(self, context: Context = TaskiqDepends()) -> None:
        """Find the lock of the run ``context`` belongs to; taskiq calls this."""
        self._task_name = context.message.task_name
        self._execution = _execution_of(context)
        self._limited = limited_run_of(context.broker, context.message.task_id)
        self.locked = self._execution is not None and self._execution.has_lock

    @property
    def key(self) -> str:
        """The Redis key of the lock.

        Raises:
            NoLockError: The run has no lock.
        """
        return self._run().lock.key

    @property
    def fence(self) -> int:
        """The fence: strictly greater for every new holder of this lock on one Redis.

        Drawn when the lock was taken (at the send, or anew when the run took
        back a lock that had expired while it was queued), from one counter
        per key prefix that never expires. Pass it to a store that keeps the
        highest fence it has seen and refuses writes with a lower one: a run
        that lost its lock (expired, taken over) is then refused there even
        if it does not notice.

        Raises:
            NoLockError: The run has no lock, or no fence was drawn for it (its
                sender did not know the task takes a ``TaskLock``).
        """
        fence = self._run().fence
        if fence is None:
            msg = (
                f"task {self._task_name!r} has no fence: its sender did not know that it "
                "takes a TaskLock (send it from a process where the task is registered)"
            )
            raise NoLockError(msg)
        return fence

    async def held(self) -> bool:
        """Whether the lock is still this run's, and its limit's slot: a round trip to Redis each.

        ``False`` when the lock expired, was taken over, was released (as
        ``deduplication_until="started"`` does at the start), or the run has no
        lock; and for a run with a ``limit_concurrency`` when its slot lapsed
        (its worker was cut off from Redis past the slot's lease: another run
        may hold the slot now) or it runs without one. A task with a limit
        and no lock (``deduplication=False``) asks its slot alone.
        """
        execution, limited = self._execution, self._limited
        if execution is None and (limited is None or not limited.rule.concurrency):
            return False
        if execution is not None:
            held = await execution.state.locks.held(execution.holds)
            if isinstance(held, RedisFailed):
                held.raise_error()
            if not held:
                return False
        if limited is not None and limited.rule.concurrency:
            slot = await Limits.held(limited)
            if isinstance(slot, RedisFailed):
                slot.raise_error()
            return slot
        return True

    def _run(self) -> Execution:
        if self._execution is None:
            msg = (
                f"task {self._task_name!r} runs without a deduplication lock (its "
                "deduplication label is off, it was sent fail-open, or by a sender "
                "without the middleware)"
            )
            raise NoLockError(msg)
        return self._execution


def _execution_of(context: Context) -> Execution | None:
    return run_of(context.broker, context.message.task_id)


def takes_task_lock(function: Callable[..., Any]) -> bool:
    """Whether ``function`` has a parameter that taskiq fills with a `TaskLock`."""
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 (a hint that cannot be resolved: read them as written)
        hints = {}
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    for name, parameter in parameters.items():
        annotation = hints.get(name, parameter.annotation)
        dependency = getattr(parameter.default, "dependency", None)
        for candidate in (annotation, dependency):
            if isinstance(candidate, type) and issubclass(candidate, TaskLock):
                return True
            if isinstance(candidate, str) and candidate.rsplit(".", 1)[-1] == "TaskLock":
                return True
    return False
