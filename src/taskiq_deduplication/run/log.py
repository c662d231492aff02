"""What a run says as it begins: the log lines and lock events of its claim.

A run that begins may find its lock taken back or lost, wait for another run
of its key, not run at all (a copy of a run that succeeded), or fail to reach
Redis; `run/runs.py` decides, this module says it, under the middleware's logger.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

from taskiq_deduplication.model.formats import SUCCEEDED_MARK, holder_task_id
from taskiq_deduplication.model.policies import Step
from taskiq_deduplication.observe.events import LockEventKind
from taskiq_deduplication.store.lock_store import Reasserted

if TYPE_CHECKING:
    from taskiq import TaskiqMessage

    from taskiq_deduplication.model.formats import RecordedLock
    from taskiq_deduplication.model.settings import Options
    from taskiq_deduplication.observe.events import EventSink
    from taskiq_deduplication.run.execution import Execution

logger = logging.getLogger(__name__)

# What a run that could not claim its lock at its start does.
_NOT_BEGUN: Final = (
    "it runs with the arguments it was sent with, not knowing whether another run of its "
    "key goes on"
)

_GAVE_UP: Final = (
    "Task %s (%s) runs without its lock %r: Redis did not answer for a lease; " + _NOT_BEGUN
)


def started(
    events: EventSink, execution: Execution, message: TaskiqMessage, reply: Reasserted | str
) -> None:
    """Say what a run found of its lock as it began: taken back, or held by another."""
    key = execution.lock.key
    if reply == Reasserted.TAKEN_BACK:
        logger.warning(
            "Lock %r of task %s (%s) had expired while the task was queued; taken back",
            key,
            message.task_name,
            message.task_id,
        )
        events.emit(
            LockEventKind.TAKEN_BACK, message.task_name, message.task_id, key, message.task_id
        )
    elif isinstance(reply, str):
        holder = holder_task_id(reply)
        logger.warning(
            "Task %s (%s) runs although task %s now holds its lock %r",
            message.task_name,
            message.task_id,
            holder,
            key,
        )
        events.emit(LockEventKind.LOST, message.task_name, message.task_id, key, holder)


def waits(events: EventSink, execution: Execution, message: TaskiqMessage, slot: str) -> None:
    """Say that a run waits for another run of its key (once per run)."""
    holder = holder_task_id(slot)
    logger.info(
        "Task %s (%s) waits to run: %s goes on under its lock %r",
        message.task_name,
        message.task_id,
        "another run of this task" if holder == message.task_id else f"task {holder}",
        execution.lock.key,
    )
    events.emit(
        LockEventKind.WAITING, message.task_name, message.task_id, execution.lock.key, holder
    )


def skipped(events: EventSink, execution: Execution, message: TaskiqMessage, slot: str) -> None:
    """Say that a delivery does not run: its run succeeded, or a retry carries it on."""
    succeeded = slot.startswith(SUCCEEDED_MARK)
    why = "its run succeeded" if succeeded else "a retry of it took its lock over"
    _not_run(events, execution, message, why, holder_task_id(slot))


def copy_of_success(
    events: EventSink, execution: Execution, message: TaskiqMessage, options: Options
) -> None:
    """Say that a delivery does not run: a run of its call succeeded already."""
    why = f"its call succeeded (remembered for {options.redelivery_window}s, the redelivery window)"
    _not_run(events, execution, message, why, message.task_id)


def _not_run(
    events: EventSink, execution: Execution, message: TaskiqMessage, why: str, holder: str | None
) -> None:
    logger.info(
        "Task %s (%s) not run: the broker delivered it again, and %s (lock %r)",
        message.task_name,
        message.task_id,
        why,
        execution.lock.key,
    )
    events.emit(
        LockEventKind.SKIPPED, message.task_name, message.task_id, execution.lock.key, holder
    )


def took_over(events: EventSink, execution: Execution, message: TaskiqMessage, holder: str) -> None:
    """Say that an exclusive run took its lock from a send that was queued meanwhile."""
    logger.warning(
        "Lock %r of task %s (%s) had expired while the task was queued and task %s "
        "took it; this run takes it back, and that task's run will wait for it",
        execution.lock.key,
        message.task_name,
        message.task_id,
        holder_task_id(holder),
    )
    events.emit(
        LockEventKind.TAKEN_BACK,
        message.task_name,
        message.task_id,
        execution.lock.key,
        message.task_id,
    )


def claim_failed(
    execution: Execution,
    recorded: RecordedLock,
    message: TaskiqMessage,
    exc: BaseException,
    *,
    waits: float,
) -> None:
    """Say that a run could not claim its lock as it begins, because Redis failed.

    It then waits ``waits`` seconds at most for Redis (an exclusive run), or
    runs at once.
    """
    if (
        recorded.merge is None
        and recorded.fence is None
        and (execution.policy.at_start is Step.REASSERT)
    ):
        text = "Could not re-assert lock %r of task %s (%s)"
        args: tuple[object, ...] = (execution.lock.key, message.task_name, message.task_id)
    else:
        text = "Could not begin the run of task %s (%s) with lock %r"
        args = (message.task_name, message.task_id, execution.lock.key)
    if waits:
        text += ": %s: %s; it waits for Redis, at most %ds, before it runs"
        logger.warning(text, *args, type(exc).__name__, exc, waits)
    else:
        text += ": %s: %s; " + _NOT_BEGUN
        logger.warning(text, *args, type(exc).__name__, exc)


def gave_up_waiting(execution: Execution, message: TaskiqMessage) -> None:
    """Say that a run goes on without its claim, after waiting a lease for Redis."""
    logger.warning(_GAVE_UP, message.task_name, message.task_id, execution.lock.key)
