"""The errors of the library: one base, and the duplicate that callers catch."""

from __future__ import annotations

from typing import Final

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
            or a debounce): the call will run, as the holder.
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


class StartupError(DeduplicationError, ConnectionError):
    """The middleware could not reach Redis when the broker started."""


class NoLockError(DeduplicationError, LookupError):
    """A task asked its `TaskLock` for a lock it does not have.

    It runs without one: deduplication is off for it, it was sent fail-open or
    by a sender without this middleware, or the fence it asks for was not drawn
    (its sender did not know the task takes a ``TaskLock``).
    """
