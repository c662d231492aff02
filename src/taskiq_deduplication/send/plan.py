"""A send's plan: what its lock is, read and computed once from its labels.

``pre_send`` reads the task's labels and the lock a message already carries
(a retry's), computes the key, the merged arguments' key and the fence once,
and hands the plan to each step of the send: acquire, keep, refuse, record.
Nothing here talks to Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from taskiq_deduplication.model import keys
from taskiq_deduplication.model.formats import merge_key, read_lock_labels
from taskiq_deduplication.model.policies import RetrySend
from taskiq_deduplication.store.lock_store import Lock

if TYPE_CHECKING:
    from taskiq import TaskiqMessage

    from taskiq_deduplication.model.formats import RecordedLock
    from taskiq_deduplication.model.settings import SendOptions
    from taskiq_deduplication.run.execution import Execution


@dataclass(slots=True)
class SendPlan:
    """One send of a locked task, as ``pre_send`` plans it.

    Not frozen: one is built on every send, and a frozen dataclass pays a
    call per field to build. Nothing changes it once planned.
    """

    message: TaskiqMessage
    options: SendOptions
    """The task's deduplication labels, read."""
    running: Execution | None
    """The run this send is a retry from, when it is sent from inside that run."""
    attempt: RecordedLock | None
    """The lock the message carries already: the attempt a retry continues."""
    earlier: Lock | None
    """That attempt's lock, as its run holds it (or as the message records it)."""
    key: str
    """The lock's key: the attempt's, or the call's own."""
    digest: str | None
    """The digest of the call's full arguments, where its key is not their fingerprint."""
    merge_key: str | None
    """Where calls merge into this one's message, for a task that merges (and can)."""
    fenced: bool
    """Whether its runs draw a fence (the task takes a `TaskLock`)."""

    @property
    def keeps(self) -> bool:
        """Whether it is a retry that keeps its attempt's lock as it is (no acquire)."""
        return self.earlier is not None and self.options.policy.retry is RetrySend.KEEP


def plan_send(
    message: TaskiqMessage,
    options: SendOptions,
    *,
    prefix: str,
    running: Execution | None,
    fenced: bool,
) -> SendPlan:
    """Plan the send of ``message`` under ``options`` and the middleware's ``prefix``.

    Raises:
        TypeError: The arguments cannot be fingerprinted (a send that needs its key).
    """
    attempt = read_lock_labels(message.labels, message.task_id)
    if running is not None:
        earlier: Lock | None = running.holds
    elif attempt is not None:
        earlier = Lock(attempt.key, attempt.token, message.task_id, attempt.ttl * 1000)
    else:
        earlier = None
    keeps = earlier is not None and options.policy.retry is RetrySend.KEEP
    key = earlier.key if earlier is not None else keys.lock_key_of(prefix, message, options)
    return SendPlan(
        message,
        options,
        running,
        attempt,
        earlier,
        key,
        digest=None if keeps else keys.arguments_digest_of(message, options),
        merge_key=merge_key(prefix, key) if options.merge is not None else None,
        fenced=fenced,
    )
