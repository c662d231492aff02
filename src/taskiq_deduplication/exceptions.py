"""The error a caller sees when its task is a duplicate."""

from __future__ import annotations


class DuplicateTaskError(Exception):
    """A task was not sent because an identical one is already queued or running.

    Raised from ``kiq()`` (before anything reaches the broker) when the lock for
    the task's fingerprint is held by another send.

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
        return (
            f"task {self.task_name!r} is already queued or running: "
            f"lock {self.key!r} is held by {holder}"
        )
