"""A run of a locked task in this process, from ``pre_execute`` to ``post_execute``.

A run belongs to the asyncio task it began in. Its hooks find it there, and so
does a retry that a retry middleware sends of it from inside the run; a task
started from inside a run (an in-memory broker delivering that retry) gets a
copy of the context, and with it a run that is not its own, so the asyncio
task is checked too.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from taskiq.exceptions import NoResultError

from taskiq_deduplication.model.formats import NO_OWNER

if TYPE_CHECKING:
    from collections.abc import Callable

    from taskiq import TaskiqMessage, TaskiqResult
    from taskiq.abc.broker import AsyncBroker

    from taskiq_deduplication.model.policies import Policy
    from taskiq_deduplication.run.heartbeat import Beat
    from taskiq_deduplication.run.loops import LoopState
    from taskiq_deduplication.store.lock_store import Done, Lock

PartT = TypeVar("PartT")
FoundT = TypeVar("FoundT")

# taskiq's own labels, counted up on the running message by Context.requeue()
# and by the retry middlewares when they send the next attempt.
_REQUEUE_LABEL: Final = "X-Taskiq-requeue"
_RETRIES_LABEL: Final = "_retries"


class Resent(enum.Enum):
    """What became of a retry that a run sent of itself, through the middleware."""

    WITH_THE_LOCK = enum.auto()
    """The retry carries the lock on: this run must not touch it any more."""
    WITHOUT_A_LOCK = enum.auto()
    """The retry went out without one: this run ends its lock as a failure does."""


@dataclass(eq=False, slots=True)
class Execution:
    """One run of a locked task in this process."""

    lock: Lock
    """The lock as the send took it, with the TTL of a queued task."""
    lease: Lock
    """The same lock with the TTL it keeps while the task runs."""
    policy: Policy
    success_ttl: int
    """Seconds the lock stays after a successful run."""
    task_name: str
    state: LoopState
    """The event loop's state the run began in: its heartbeat keeps the lease."""
    requeues: object
    """taskiq's requeue count when the run began."""
    retries: object
    """The retry middlewares' attempt count when the run began."""
    beat: Beat | None = None
    fence: int | None = None
    """The lock's fence, for a task that asked for one."""
    owned: bool = True
    """Whether the run holds its lock (no other send took it meanwhile)."""
    run: Lock | None = None
    """The run slot an exclusive run holds while it goes on: its key (the lock's
    own for the ``"finished"`` policy) and the run's token, on the lease's TTL."""
    skipped: bool = False
    """Whether the run was not to run: a copy of a run that succeeded, or of an
    attempt that a retry carries on."""
    done: Done | None = None
    """Where the run's call is remembered once it succeeds, for copies of its message."""
    keeps_stored_result: bool = False
    """Whether a run that did not run its body leaves the stored result as it is
    (the attempt's retry will store one, or the copy stored one itself)."""
    ended: bool = False
    resent: Resent | None = None
    sent_back: bool = False
    """Whether its limit sent the run's message back to the broker: a later
    delivery carries the run on, with its lock."""
    handed_to: Lock | None = None
    """The run slot beside the lock as this run handed it to its retry, until
    the broker took the retry (a refused retry gives it up)."""
    task: asyncio.Task[Any] | None = field(default=None, repr=False)
    """The asyncio task the run began in."""
    context: Any = field(default=None, repr=False)
    """The token that restores the execution context variable."""
    on_task_done: Any = field(default=None, repr=False)

    @property
    def has_lock(self) -> bool:
        """Whether the run has a lock: its send took one, or it took its key's as its run slot."""
        return self.lock.token != NO_OWNER or (
            self.run is not None and self.run.key == self.lock.key
        )

    @property
    def holds(self) -> Lock:
        """The lock as this run holds it in Redis: its run slot, if its lock is that."""
        if self.run is not None and self.run.key == self.lock.key:
            return self.run
        return self.lock

    def passed_on(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> bool:
        """Whether the run handed itself to a later delivery without a send through us.

        ``Context.requeue`` and a retry left to a schedule source both count up
        their label before they send, and the run then ends with
        ``NoResultError`` only once that send went through. A retry sent
        through the middleware is no such hand-over: it took care of the lock.
        """
        if self.sent_back:
            return True
        return (
            self.resent is None
            and isinstance(result.error, NoResultError)
            and (
                message.labels.get(_REQUEUE_LABEL) != self.requeues
                or message.labels.get(_RETRIES_LABEL) != self.retries
            )
        )

    def stop_heartbeat(self) -> None:
        """Stop keeping the lease alive; the run's lock is left as it is."""
        if self.beat is not None:
            self.state.heartbeat.discard(self.beat)
        self.beat = None


class Executions:
    """The runs of locked tasks that one middleware follows, one per asyncio task."""

    def __init__(self, name: str) -> None:
        """Follow runs under a context variable called ``name``."""
        self._current: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
            name, default=None
        )

    @staticmethod
    def counts(message: TaskiqMessage) -> tuple[object, object]:
        """The requeue and retry counts that taskiq keeps on ``message``."""
        return message.labels.get(_REQUEUE_LABEL), message.labels.get(_RETRIES_LABEL)

    def current(self, task_id: str) -> Execution | None:
        """The run of ``task_id`` that this asyncio task is in, if any."""
        execution = self._current.get()
        if (
            execution is not None
            and execution.lock.task_id == task_id
            and not execution.ended
            and execution.task is asyncio.current_task()
        ):
            return execution
        return None

    def of_run(self, task_id: str) -> Execution | None:
        """The run of ``task_id`` whose context this is, from any asyncio task in it.

        A task's dependencies (`TaskLock`) are resolved in the run's asyncio
        task, but its body may run in another (a ``timeout`` label on Python
        3.10), with a copy of the context.
        """
        execution = self._current.get()
        if execution is not None and execution.lock.task_id == task_id and not execution.ended:
            return execution
        return None

    def begin(self, execution: Execution) -> None:
        """Make ``execution`` the run of this asyncio task."""
        execution.context = self._current.set(execution)
        # If a later hook of another middleware raises, post_execute never runs;
        # the end of the asyncio task still ends the heartbeat.
        execution.on_task_done = lambda _: execution.stop_heartbeat()
        execution.task = _current_task()
        execution.task.add_done_callback(execution.on_task_done)

    def end(self, execution: Execution) -> None:
        """End ``execution``: no hook or retry finds it any more."""
        execution.ended = True
        execution.stop_heartbeat()
        if execution.task is not None:
            execution.task.remove_done_callback(execution.on_task_done)
        try:
            self._current.reset(execution.context)
        except ValueError:  # ended in another context than it began in
            self._current.set(None)


def _current_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    if task is None:  # pragma: no cover (taskiq runs every hook inside a task)
        msg = "taskiq hooks run inside an asyncio task"
        raise RuntimeError(msg)
    return task


class Followed(Generic[PartT]):
    """One part of each middleware (its runs, its limits), for a task's `TaskLock` to find.

    Weakly held: a middleware that goes takes its entry with it.
    """

    def __init__(self) -> None:
        """Follow no middleware yet."""
        self._parts: weakref.WeakKeyDictionary[object, PartT] = weakref.WeakKeyDictionary()

    def follow(self, middleware: object, part: PartT) -> None:
        """Let the tasks of ``middleware``'s broker find ``part``."""
        self._parts[middleware] = part

    def first(self, broker: AsyncBroker, find: Callable[[PartT], FoundT | None]) -> FoundT | None:
        """What ``find`` finds first in the parts of ``broker``'s middlewares, if anything."""
        for middleware in broker.middlewares:
            part = self._parts.get(middleware)
            found = find(part) if part is not None else None
            if found is not None:
                return found
        return None


#: The runs each middleware follows, for a task's `TaskLock` to find its own.
_FOLLOWED: Followed[Executions] = Followed()


def follow_runs(middleware: object, executions: Executions) -> None:
    """Let the tasks of ``middleware``'s broker find their runs in ``executions``."""
    _FOLLOWED.follow(middleware, executions)


def run_of(broker: AsyncBroker, task_id: str) -> Execution | None:
    """The run of ``task_id`` whose context this is, among those of ``broker``'s middlewares.

    A task's dependencies (`TaskLock`) are resolved in the run's asyncio task,
    but its body may run in another (a ``timeout`` label on Python 3.10), with
    a copy of the context.
    """
    return _FOLLOWED.first(broker, lambda executions: executions.of_run(task_id))
