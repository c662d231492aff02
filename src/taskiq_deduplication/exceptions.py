"""The errors of the library: one base, the duplicate that callers catch, and the rest.

Every error the library raises of its own derives from
[DeduplicationError][taskiq_deduplication.DeduplicationError], and from the
standard type that says what went wrong. The errors of Redis itself (redis-py's)
reach callers as they are; [REDIS_ERRORS][taskiq_deduplication.exceptions.REDIS_ERRORS]
lists what they can be.
"""

from __future__ import annotations

import asyncio
from typing import Final

from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: The errors that mean "Redis could not be reached or did not answer", or
#: refused a command. A cluster client that reaches no node raises
#: ``RedisClusterException``, which is no ``RedisError``.
REDIS_ERRORS: Final = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)
#: How a refusal, its log and its event name a holder whose send a broker has
#: not accepted (yet: or never, if its process died mid-send; then the lock
#: lasts the grace TTL).
UNSENT_HOLDER: Final = "whose send the broker has not accepted yet"


class DeduplicationError(Exception):
    """The base of every error this library raises of its own.

    Each one also derives from the standard type that says what went wrong, so
    code written against those keeps working: an invalid option or label is a
    ``ValueError``, a failed startup a ``ConnectionError``, a lock call that
    could not be made in time a ``redis.exceptions.RedisError``.
    """


class DuplicateTaskError(DeduplicationError):
    """A task was not sent because an identical one holds its lock.

    Raised from ``kiq()`` (before anything reaches the broker) when the lock for
    the task's fingerprint is held by another send: one queued or running, or
    one that the task's policy still counts (``deduplication_until="expired"``
    until its TTL, ``deduplication_success_ttl`` after a success).

    Attributes:
        task_name (str): Name of the task that was rejected.
        key (str): Redis key of the lock whose holder caused the rejection.
        holder_task_id (str | None): ``task_id`` of the task holding the lock, or
            ``None`` if the lock's value was not written by this library and
            names no task.
        merged (bool): Whether the call's arguments replaced those of the
            holder, which was still queued (``deduplication_merge="latest"``
            or a debounce): the call will run, as the holder. Such a call is
            not refused: ``kiq()`` returns the holder's handle, and this error
            is only what a [JoinedTask][taskiq_deduplication.JoinedTask]
            keeps as its ``duplicate``.
        same_arguments (bool | None): Whether the call's full arguments equal
            those the holder was sent with. Always ``True`` for a lock keyed
            on the call's fingerprint; for a lock under an explicit key or key
            fields, ``None`` when it cannot be told (a holder sent by an older
            version, or arguments that cannot be fingerprinted).
        holder_sent (bool | None): Whether a broker has accepted the holder's
            send. ``False`` while it has not: the holder's ``kiq`` is still
            between taking the lock and the broker's answer, or its process
            died there, and then the lock lasts only the grace TTL (10
            seconds); its task may never run. ``None`` when the lock does not
            say (taken by an older version).
    """

    task_name: str
    key: str
    holder_task_id: str | None
    merged: bool
    same_arguments: bool | None
    holder_sent: bool | None

    def __init__(  # noqa: PLR0913 (what a refusal tells, each named)
        self,
        task_name: str,
        key: str,
        holder_task_id: str | None,
        *,
        merged: bool = False,
        same_arguments: bool | None = None,
        holder_sent: bool | None = None,
    ) -> None:
        """Record which task was rejected and who holds its lock.

        Args:
            task_name: Name of the task that was rejected.
            key: Redis key of the lock.
            holder_task_id: ``task_id`` of the current holder, if known.
            merged: Whether the call was merged into the queued holder.
            same_arguments: Whether the call's arguments equal the holder's, if known.
            holder_sent: Whether a broker has accepted the holder's send, if known.
        """
        super().__init__(task_name, key, holder_task_id)
        self.task_name = task_name
        self.key = key
        self.holder_task_id = holder_task_id
        self.merged = merged
        self.same_arguments = same_arguments
        self.holder_sent = holder_sent

    def __str__(self) -> str:
        """Say which task was rejected, and why."""
        holder = "an unknown task" if self.holder_task_id is None else repr(self.holder_task_id)
        if self.merged:
            return (
                f"task {self.task_name!r} was merged into {holder}, which is queued with "
                f"lock {self.key!r} and will run with this call's arguments"
            )
        unsent = f", {UNSENT_HOLDER}" if self.holder_sent is False else ""
        return (
            f"task {self.task_name!r} is a duplicate: its lock {self.key!r} is held "
            f"by {holder}{unsent}"
        )


class InvalidSettingError(DeduplicationError, ValueError):
    """An option or label has a value that is not valid; the message names it."""


class InvalidArgumentError(DeduplicationError, TypeError):
    """A function of the library was given a value of the wrong kind; the message says which.

    A subscriber that is not callable, ``Locks.key_for`` on locks that are not
    a middleware's, a module attribute that is not a taskiq broker.
    """


class UnfingerprintableError(InvalidArgumentError):
    """A call's arguments cannot be fingerprinted, so ``kiq()`` cannot name its lock.

    Raised from ``kiq()`` for a value that neither JSON nor pydantic can encode,
    or nesting too deep to be anything but a circular reference. Pass values
    that taskiq can serialise, or choose the lock key with the
    ``deduplication_key`` label. A ``TypeError``.
    """


class MissingMiddlewareError(DeduplicationError, LookupError):
    """A broker was expected to carry a ``RedisDeduplicationMiddleware`` and does not."""


class StartupError(DeduplicationError, ConnectionError):
    """The middleware could not reach Redis when the broker started."""


class WorkerStartError(DeduplicationError, RuntimeError):
    """A ``taskiq worker`` that the pytest plugin started did not begin listening.

    The message ends with the last lines of the worker's output.
    """


class NoLockError(DeduplicationError, LookupError):
    """A task asked its `TaskLock` for a lock it does not have.

    It runs without one: deduplication is off for it, it was sent fail-open or
    by a sender without this middleware, or the fence it asks for was not drawn
    (its sender did not know the task takes a ``TaskLock``).
    """


# The errors of a lock call on its way to Redis: ``kiq()`` raises them (unless
# ``fail_open`` sends the task without a lock), as do a worker's lock calls.


class CallTimeoutError(DeduplicationError, RedisTimeoutError):
    """A lock call got no reply by its deadline (the client's ``socket_timeout``).

    A ``redis.exceptions.TimeoutError``: code that catches redis-py's timeouts
    catches it too.

    Attributes:
        sent: Whether the call was ever written to Redis. One that was not
            cannot have run there, so it needs no undoing.
    """

    def __init__(self, message: str, *, sent: bool) -> None:
        """Describe the timeout; ``sent`` says whether the call went out."""
        super().__init__(message)
        self.sent = sent


class BacklogFullError(DeduplicationError, RedisError):
    """So many lock calls wait for Redis already that a new one fails at once.

    At most 10,000 lock calls wait in a process (Redis is down or hangs);
    a ``redis.exceptions.RedisError``.
    """


class PipelineClosedError(DeduplicationError, RedisError):
    """The lock pipeline was closed (the middleware shut down) before the call ended.

    A ``redis.exceptions.RedisError``.
    """


class UnencodableCallError(DeduplicationError, ValueError):
    """A lock call carries text that the Redis client cannot encode (a lone surrogate).

    A ``ValueError``: a task name, key or label value that is not valid text.
    """


class ResultLostError(DeduplicationError, RuntimeError):
    """The call ran and succeeded, but its result was lost before it was stored.

    A worker records a run's success before taskiq stores its result; a worker
    that dies in between (killed, out of memory) leaves the call succeeded and
    its result nowhere. The copy of its message that the broker then delivers
    again is not run a second time: it stores this error as the call's result
    instead, so that ``wait_result()`` answers rather than waiting for ever.
    Its message names the task and the ``task_id``.
    """
