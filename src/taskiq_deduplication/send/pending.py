"""The sends of this process between their ``pre_send`` and ``post_send``.

``pre_send`` takes (or keeps) a lock and leaves a record of it here, under the
lock's value, which the message carries in its owner label; ``post_send`` (the
broker accepted the message) and the broker's refusal (it did not) each take
the record back. A run in this process may end the lock in between (an
in-memory broker runs the task inside ``kiq``): it marks the record, and
``post_send`` then leaves the lock alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from taskiq_deduplication.model.formats import LOCK_OWNER_LABEL

if TYPE_CHECKING:
    from collections.abc import Mapping

    from taskiq_deduplication.store.lock_store import Lock

#: Most sends remembered between their pre_send and post_send (one whose
#: broker failed never gets a post_send; the oldest is forgotten first, and its
#: post_send then reads its lock from the message's labels).
MAX_SENDS_IN_FLIGHT: Final = 4096


@dataclass(slots=True)
class PendingSend:
    """What a send did to its lock, for its ``post_send`` and its refusal."""

    lock: Lock
    """The lock, with the TTL the send asked for."""
    merged_key: str | None
    """Where calls merge into its message once a broker accepts it, if they do."""
    extends: bool
    """Whether ``post_send`` gives the lock its full TTL (not a retry that keeps
    its lock as it is, nor a TTL within the grace TTL)."""
    taken: bool
    """Whether this send took the lock (else it carries on its run's, as it is):
    only a lock a send took is released when its broker refuses it."""
    ended: bool = False
    """Whether a run in this process ended the lock already: nothing to extend.
    Only this send's own run can have put its token in Redis since, so the
    extension, owner-checked, would be a no-op or would undo the end (a success
    TTL stretched back to the full TTL)."""
    outer: PendingSend | None = None
    """A send of the same lock value still in flight around this one (a retry
    sent from inside a run that an in-memory broker runs inside ``kiq``)."""
    run: Lock | None = None
    """The run slot (on the run's lease) its acquire took for the run an
    in-process broker begins inside ``kiq()``: Redis has the run's value in
    the lock already (marked in flight, on the grace TTL), so the run begins
    without waiting for a claim."""
    run_until: float = 0.0
    """Until when (``time.monotonic()``) that lock surely holds: half the grace
    TTL, counted from before the acquire was sent."""


class PendingSends:
    """The pending sends of one middleware, in every event loop and thread."""

    def __init__(self) -> None:
        """Start with none."""
        self._by_value: dict[str, PendingSend] = {}

    def add(self, send: PendingSend) -> None:
        """Remember ``send`` until its ``post_send`` or its refusal."""
        value = send.lock.value
        send.outer = self._by_value.pop(value, None)
        if len(self._by_value) >= MAX_SENDS_IN_FLIGHT:
            self._by_value.pop(next(iter(self._by_value), ""), None)
        self._by_value[value] = send

    def take(self, labels: Mapping[str, object], task_id: str) -> PendingSend | None:
        """The send of the message ``task_id`` with these ``labels``, forgotten from now on.

        Labels copied onto another message (a middleware that reuses a
        parent's) name another task's lock, and find nothing.
        """
        value = labels.get(LOCK_OWNER_LABEL)
        if not isinstance(value, str) or not value.endswith(f" {task_id}"):
            return None
        send = self._by_value.pop(value, None)
        if send is not None and send.outer is not None:
            self._by_value[value] = send.outer
        return send

    def run_taken(self, lock: Lock) -> tuple[Lock, bool] | None:
        """The run slot the send of ``lock`` took for its run, and whether it surely holds still.

        Asked once, by the run that begins inside the send's ``kiq()``; a
        slot that may have lapsed (the run began late) is claimed as any other.
        """
        send = self._by_value.get(lock.value)
        if send is None or send.run is None:
            return None
        fresh = time.monotonic() < send.run_until
        send.run_until = 0.0
        return send.run, fresh

    def end(self, lock: Lock) -> bool:
        """Note that a run ends ``lock``; whether a send of it is still in flight."""
        send = self._by_value.get(lock.value)
        if send is None or not send.taken:
            return False
        send.ended = True
        return True

    def end_failed(self, lock: Lock) -> None:
        """The end of ``lock`` failed: its send's ``post_send`` extends it after all."""
        send = self._by_value.get(lock.value)
        if send is not None and send.taken:
            send.ended = False
