"""The lock key of a call, asked from outside a send (the test helpers, the CLI).

The key is made by the middleware's own code, exactly as ``pre_send`` makes it
(its ``_send_key``, which the CLI asks too). Nothing
is sent and nothing talks to Redis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from taskiq import TaskiqMessage

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from taskiq_deduplication.middleware import RedisDeduplicationMiddleware


def call_key(
    middleware: RedisDeduplicationMiddleware,
    task_name: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    labels: Mapping[str, Any] | None = None,
) -> str | None:
    """The key of the lock a send of this call would take with ``middleware``.

    Args:
        middleware: The middleware the call is sent through.
        task_name: The task's name.
        args: The call's positional arguments.
        kwargs: The call's keyword arguments.
        labels: The labels of the send (the task's and the call's), as Python
            values or as the strings taskiq turns them into.

    Returns:
        The key, or ``None`` when deduplication is off for this call.

    Raises:
        ValueError: A deduplication label has an invalid value, as ``kiq`` would.
    """
    message = TaskiqMessage(
        task_id="",
        task_name=task_name,
        labels=dict(labels or {}),
        args=list(args),
        kwargs=dict(kwargs or {}),
    )
    return middleware._send_key(message)  # noqa: SLF001 (the middleware's own key)
