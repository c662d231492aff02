"""Lock events: what the middleware did, told to whoever subscribed.

Every point of a task's life where the middleware decides something about its
lock (the send took it, refused a duplicate, went out without one; the run
released it, took it back, found another task holding it) makes one
`LockEvent`. Subscribers get it at once, in the hook or heartbeat tick that made
it; the Prometheus metrics and the OpenTelemetry span attributes are built on
the same events, at the same points as the log lines.

Subscribe with
[RedisDeduplicationMiddleware.subscribe][taskiq_deduplication.RedisDeduplicationMiddleware.subscribe]:

```python
def on_event(event: LockEvent) -> None:
    if event.kind is LockEventKind.DUPLICATE:
        refused.labels(event.task_name).inc()


unsubscribe = middleware.subscribe(on_event)
```
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, cast

from taskiq_deduplication.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from taskiq import TaskiqMessage

__all__ = ["LockEvent", "LockEventKind", "Subscriber"]

#: The name the docs give it (docs/observability.md): a subscriber's failure is logged here.
logger = logging.getLogger("taskiq_deduplication.events")


class LockEventKind(str, enum.Enum):
    """What happened to a task's lock.

    The first six are the outcomes of a send (``kiq``), one per send that the
    middleware sees; the others happen to the lock of a task that runs.
    Each member is also its ``str`` value (``LockEventKind.LOCKED == "locked"``).
    """

    LOCKED = "locked"
    """The send took the lock (or a retry carried its attempt's lock on)."""
    DUPLICATE = "duplicate"
    """The send was refused: ``kiq`` raises ``DuplicateTaskError``. ``holder_task_id``
    names the task that holds the lock."""
    MERGED = "merged"
    """The send was not made: with ``deduplication_merge="latest"`` its arguments
    replaced those of the queued task that holds the lock, named by
    ``holder_task_id``; ``kiq`` returns a handle of that task, which runs with them."""
    JOINED = "joined"
    """The send was not made: ``kiq_or_join`` found the lock held and hands back
    a handle of the task that holds it, named by ``holder_task_id``."""
    FAIL_OPEN = "fail_open"
    """Redis failed while taking the lock and ``fail_open`` let the send go out
    without one; ``error`` is what Redis raised."""
    OFF = "off"
    """The send went out without a lock: deduplication is off for it (option or
    label), or it is a retry of a ``deduplication_until="started"`` task whose
    lock another task, queued meanwhile, holds (``holder_task_id`` names it)."""
    RELEASED = "released"
    """The run deleted its lock (at its end, or at its start for
    ``deduplication_until="started"``)."""
    TAKEN_BACK = "taken_back"
    """The run found its lock gone (expired while queued, a Redis restart, a manual
    release) and took it again, at its start or in a heartbeat."""
    LOST = "lost"
    """The run found its lock held by another task, at its start or in a
    heartbeat, and leaves it to that task; ``holder_task_id`` names it."""
    WAITING = "waiting"
    """The run waits before its body: another run of the same lock key goes on
    (``holder_task_id`` names its task). Told once per run that waits."""
    SKIPPED = "skipped"
    """The run ended without running its body: the broker delivered a copy of a
    message whose run succeeded (``holder_task_id`` is the task's own id), or of
    an attempt that a retry carries on."""
    LIMITED = "limited"
    """The run is over its limit (``limit_concurrency``, ``limit_rate``): it waits
    for a slot, or, with ``requeued``, went back to the broker because this
    worker lends the limit no more slots to wait in. ``key`` is the limit's
    key. Told once per run that waits."""
    WAITED = "waited"
    """The run that waited for its limit starts: ``waited`` is how long, in seconds."""


@dataclass(frozen=True, slots=True)
class LockEvent:
    """One thing the middleware did to one task's lock.

    It never carries the task's arguments: they may hold secrets.

    Attributes:
        kind: What happened.
        task_name: The task's name.
        task_id: The ``task_id`` of the message that was sent or runs.
        key: The lock's Redis key, or ``None`` when the send had none
            (`LockEventKind.OFF` without a holder).
        holder_task_id: The ``task_id`` that holds the lock once this happened:
            the task itself after `LockEventKind.LOCKED` and
            `LockEventKind.TAKEN_BACK`, the other task after
            `LockEventKind.DUPLICATE`, `LockEventKind.MERGED`,
            `LockEventKind.JOINED` and `LockEventKind.LOST` (``None`` if its
            lock value names no task), ``None`` after the rest.
        error: The Redis error of a `LockEventKind.FAIL_OPEN`, else ``None``.
        holder_sent: After `LockEventKind.DUPLICATE` and `LockEventKind.JOINED`:
            whether a broker has accepted the holder's send (``False``: not
            yet, or never if its process died mid-send, as
            ``DuplicateTaskError.holder_sent``); ``None`` when its lock does
            not say (an older version's), and after the rest.
        waited: After `LockEventKind.WAITED`: seconds the run waited for its
            limit; ``None`` after the rest.
        requeued: After `LockEventKind.LIMITED`: whether the run went back to
            the broker instead of waiting; ``None`` after the rest.
    """

    kind: LockEventKind
    task_name: str
    task_id: str
    key: str | None
    holder_task_id: str | None
    error: BaseException | None = None
    holder_sent: bool | None = None
    waited: float | None = None
    requeued: bool | None = None


Subscriber: TypeAlias = Callable[[LockEvent], object]
"""A callable that gets every `LockEvent`; what it returns is ignored.

It is called synchronously, inside the hook or heartbeat tick that made the
event, so it should be quick (count, append, hand off); a coroutine function is
not awaited. An exception it raises is logged and never reaches ``kiq`` or the
task.
"""


class _SendSpan(Protocol):
    def __call__(self, message: TaskiqMessage, event: LockEvent) -> None: ...


class EventSink:
    """Where the middleware, its runs and its heartbeat tell what happens.

    Internal: applications subscribe through the middleware. With nobody
    subscribed and no tracing, `emit` returns at once, before it makes an event.
    """

    __slots__ = ("_send_span", "_subscribers", "active")

    def __init__(self) -> None:
        """Start with no subscriber and no tracing."""
        self._subscribers: tuple[Subscriber, ...] = ()
        self._send_span: _SendSpan | None = None
        self.active = False
        """Whether anyone listens: the hot path checks this before it calls `emit`."""

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber`` with every event from now on; return what undoes it."""
        if not callable(cast("object", subscriber)):
            msg = f"a lock event subscriber must be callable, not {type(subscriber).__name__}"
            raise InvalidArgumentError(msg)
        self._subscribers = (*self._subscribers, subscriber)
        self._update()

        def unsubscribe() -> None:
            self._subscribers = tuple(s for s in self._subscribers if s is not subscriber)
            self._update()

        return unsubscribe

    @property
    def subscribers(self) -> tuple[Subscriber, ...]:
        """Who subscribed, in order."""
        return self._subscribers

    def trace_sends(self, send_span: _SendSpan | None) -> None:
        """Also hand the outcome of each send to ``send_span``, with its message."""
        self._send_span = send_span
        self._update()

    def _update(self) -> None:
        self.active = bool(self._subscribers) or self._send_span is not None

    def emit(  # noqa: PLR0913 (the fields of an event, and where it comes from)
        self,
        kind: LockEventKind,
        task_name: str,
        task_id: str,
        key: str | None,
        holder_task_id: str | None,
        *,
        error: BaseException | None = None,
        message: TaskiqMessage | None = None,
        holder_sent: bool | None = None,
        waited: float | None = None,
        requeued: bool | None = None,
    ) -> None:
        """Tell every subscriber that ``kind`` happened; ``message`` is a send's."""
        if not self.active:
            return
        event = LockEvent(
            kind, task_name, task_id, key, holder_task_id, error, holder_sent, waited, requeued
        )
        if message is not None and self._send_span is not None:
            _call(self._send_span, message, event)
        for subscriber in self._subscribers:
            _call(subscriber, event)


def _call(subscriber: Callable[..., object], *args: object) -> None:
    try:
        subscriber(*args)
    except Exception:
        # A subscriber's bug must not break a send or a run; say so loudly.
        event = args[-1]
        assert isinstance(event, LockEvent)  # noqa: S101 (the last argument always is)
        logger.exception(
            "Lock event subscriber %r failed on %s of task %s (%s)",
            subscriber,
            event.kind.value,
            event.task_name,
            event.task_id,
        )
