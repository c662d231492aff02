"""The errors of the library: one base, and the duplicate that callers catch."""

from __future__ import annotations


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
    """

    task_name: str
    key: str
    holder_task_id: str | None

    def __init__(self, task_name: str, key: str, holder_task_id: str | None) -> None:
        """Record which task was rejected and who holds its lock.

        Args:
            task_name: Name of the task that was rejected.
            key: Redis key of the lock.
            holder_task_id: ``task_id`` of the current holder, if known.
        """
        super().__init__(task_name, key, holder_task_id)
        self.task_name = task_name
        self.key = key
        self.holder_task_id = holder_task_id

    def __str__(self) -> str:
        """Say which task was rejected, and why."""
        holder = "an unknown task" if self.holder_task_id is None else repr(self.holder_task_id)
        return f"task {self.task_name!r} is a duplicate: its lock {self.key!r} is held by {holder}"


class InvalidSettingError(DeduplicationError, ValueError):
    """An option or label has a value that is not valid; the message names it."""


class StartupError(DeduplicationError, ConnectionError):
    """The middleware could not reach Redis when the broker started."""
