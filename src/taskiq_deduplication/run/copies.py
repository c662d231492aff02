"""Deliveries that must not run their task's body, and what they answer instead.

A copy of a message whose call succeeded already (the broker delivered it
again), or of an attempt that a retry carries on, must not run. taskiq gives a
middleware no way to end a delivery early but an exception, which every other
middleware would see (`on_error`, error metrics, retries) or which would stop
the delivery outside taskiq's guard, unacknowledged. So the delivery runs as
any other, calling a function of ours instead of the task's: it answers with
the call's stored result, and where that was lost (the worker that succeeded
died before taskiq stored it), it stores a `ResultLostError`, so that the
caller is always answered.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import logging
from typing import TYPE_CHECKING, Any, Final

from taskiq import TaskiqResult
from taskiq.exceptions import NoResultError

from taskiq_deduplication.exceptions import ResultLostError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from taskiq import AsyncTaskiqDecoratedTask, TaskiqMessage
    from taskiq.abc.broker import AsyncBroker
    from taskiq.abc.result_backend import AsyncResultBackend

    from taskiq_deduplication.run.execution import Execution

logger = logging.getLogger(__name__)

#: Seconds a copy of a call that succeeded waits for the call's result to be
#: stored, before it takes it for lost: the run that succeeded stores it right
#: after its hooks, unless its worker died in between.
_RESULT_GRACE: Final = 2.0

# The task that taskiq's receiver looked up for the delivery an asyncio task
# runs: a copy of the registered task, this delivery's own (`watch_deliveries`).
_DELIVERED: contextvars.ContextVar[tuple[asyncio.Task[Any], Any] | None] = contextvars.ContextVar(
    "taskiq_deduplication_delivered", default=None
)


def watch_deliveries(broker: AsyncBroker) -> None:
    """Let a run that must not run its body leave it out, and nothing else.

    taskiq's receiver looks up a delivery's task with ``broker.find_task``
    before the ``pre_execute`` hooks, and reads the function to call from what
    it found after them (`tests/test_taskiq_contract.py` pins both). This
    wrapper of the broker's own ``find_task`` (on the instance, as taskiq calls
    it) hands each asyncio task a copy of the registered task; a run that must
    not run (`leave_out_body`) gives its copy a function of its own instead of
    the task's. The rest of the delivery is what taskiq makes of any run that
    returns: every middleware's ``pre_execute`` and ``post_execute`` see it, no
    ``on_error``, no retry, and the broker gets its acknowledgement.
    """
    find = broker.find_task

    def find_task(task_name: str) -> AsyncTaskiqDecoratedTask[Any, Any] | None:
        task = find(task_name)
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no event loop: no delivery either
            current = None
        if task is None or current is None:
            return task
        delivered = _copy(task)
        _DELIVERED.set((current, delivered))
        return delivered

    broker.find_task = find_task  # type: ignore[method-assign]


def _copy(task: AsyncTaskiqDecoratedTask[Any, Any]) -> AsyncTaskiqDecoratedTask[Any, Any]:
    """A shallow copy of a registered task, made for every delivery.

    A taskiq task is a plain object with a ``__dict__``: a new one with the same
    dict costs under 1 us, where ``copy.copy`` (which asks the class how to copy
    itself) costs 2. A task class with slots or a copy of its own is copied
    the general way.
    """
    cls = type(task)
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = _PLAIN[cls] = (
            getattr(cls, "__copy__", None) is None
            and hasattr(task, "__dict__")
            and not any(_slots(kind) for kind in cls.__mro__)
        )
    if not plain:
        return copy.copy(task)
    delivered = cls.__new__(cls)
    delivered.__dict__.update(task.__dict__)
    return delivered


#: Whether each task class met so far is copied through its ``__dict__`` alone.
_PLAIN: dict[type, bool] = {}


def _slots(kind: type) -> set[str]:
    """The slots ``kind`` declares that hold values (``typing.Generic`` declares none)."""
    slots = vars(kind).get("__slots__", ())
    names = {slots} if isinstance(slots, str) else set(slots)
    return names - {"__dict__", "__weakref__"}


def leave_out_body(
    message: TaskiqMessage, instead: Callable[..., Coroutine[Any, Any, Any]]
) -> Callable[[], None]:
    """Make the delivery of ``message`` call ``instead`` rather than its task's body.

    Its copy of the task (`watch_deliveries`) gets ``instead`` as its function.
    A delivery that did not look its task up through the broker in this
    asyncio task (a receiver of its own) has no copy: its positional
    arguments then refuse to be unpacked (`NotRun`), which taskiq reports as a
    run without a result.

    Returns what puts the body back, for a delivery that must run it after all.
    """
    delivered = _DELIVERED.get()
    if (
        delivered is not None
        and delivered[0] is asyncio.current_task()
        and getattr(delivered[1], "task_name", None) == message.task_name
    ):
        task, body = delivered[1], delivered[1].original_func
        task.original_func = instead

        def put_back() -> None:
            task.original_func = body

        return put_back
    args = message.args
    message.args = NotRun(args)

    def put_args_back() -> None:
        message.args = args

    return put_args_back


class NotRun(list[Any]):
    """The positional arguments of a run that must not run its body, where nothing else can stop it.

    taskiq unpacks a task's positional arguments inside the guard that turns a
    ``NoResultError`` into a run that sets no result and that the retry
    middlewares leave alone; unpacking these raises it, before the body is
    called. Reading them by index, as taskiq's parameter parsing does, works
    as on the original list.
    """

    def __iter__(self) -> Any:  # noqa: ANN401 (never returns)
        """Refuse to be unpacked: the body must not run."""
        raise NoResultError


def answer_of_copy(
    execution: Execution, message: TaskiqMessage, broker: AsyncBroker
) -> Callable[..., Coroutine[Any, Any, Any]]:
    """What a delivery that must not run its body runs instead.

    A copy of a call that succeeded answers with the call's result: the
    one stored (taskiq stores it again, as any run's), or, once the result
    is still missing after `_RESULT_GRACE`, the call's worker died between
    the success and the save: it stores a `ResultLostError` instead, so
    that the caller is answered. A copy of an attempt that a retry carries
    on answers nothing: the retry will.
    """

    async def instead(*_args: object, **_kwargs: object) -> Any:  # noqa: ANN401 (the task's own result)
        if execution.keeps_stored_result:
            return None
        return await _result_of_call(execution, message, broker)

    return instead


async def _result_of_call(execution: Execution, message: TaskiqMessage, broker: AsyncBroker) -> Any:  # noqa: ANN401 (the task's own result)
    """The stored result of a call that succeeded, or a `ResultLostError` stored for it."""
    backend: AsyncResultBackend[Any] = broker.result_backend
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _RESULT_GRACE
    delay = 0.05
    while True:
        try:
            if await backend.is_result_ready(message.task_id):
                stored = await backend.get_result(message.task_id)
                if not stored.is_err:
                    return stored.return_value
                execution.keeps_stored_result = True  # an error stored: keep it
                return None
        except Exception as exc:  # noqa: BLE001 (any backend's error: say it, then answer)
            logger.warning(
                "Could not read the result of task %s (%s) for a copy of it: %s: %s",
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
            )
            break
        if loop.time() >= deadline:
            break
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)
    lost = ResultLostError(
        f"task {message.task_name!r} ({message.task_id}) succeeded, but its result was "
        "lost before it was stored (its worker stopped in between); the call was not "
        "run again"
    )
    execution.keeps_stored_result = True
    try:
        await backend.set_result(
            message.task_id,
            TaskiqResult(
                is_err=True,
                return_value=None,
                execution_time=0.0,
                error=lost,
                labels=message.labels,
            ),
        )
    except Exception as exc:  # noqa: BLE001 (any backend's error: say it)
        logger.warning(
            "Could not store that the result of task %s (%s) was lost: %s: %s",
            message.task_name,
            message.task_id,
            type(exc).__name__,
            exc,
        )
        return None
    logger.warning(
        "Task %s (%s) succeeded, but its result was never stored (its worker stopped "
        "in between): a copy of it stored ResultLostError as its result",
        message.task_name,
        message.task_id,
    )
    return None
