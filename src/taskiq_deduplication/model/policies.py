"""The lock policies, one row each: what counts as a duplicate, and for how long.

Every policy sends the same way: the lock is taken for the grace TTL before the
message goes to the broker and given its full TTL once the broker accepted it.
The rows say what happens after that, step by step of the task's life; the
middleware's hooks read the row of the message's policy and do what it says.

| policy       | retry's send  | at start | heartbeat | success  | failure | passed on |
|--------------|---------------|----------|-----------|----------|---------|-----------|
| ``finished`` | take over     | reassert | yes       | remember | release | extend    |
| ``started``  | take if free  | release  | no        | nothing  | nothing | reassert  |
| ``expired``  | keep          | nothing  | no        | nothing  | nothing | nothing   |

"Passed on" is a run that handed itself to a later delivery without a send
through this middleware: ``Context.requeue``, or a retry left to a schedule
source. "Remember" keeps the lock ``deduplication_success_ttl`` seconds more
(or releases it when that is 0).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class Step(enum.Enum):
    """One thing done to a lock in Redis, or nothing."""

    NOTHING = enum.auto()
    RELEASE = enum.auto()
    """Delete the lock if this send still owns it."""
    REASSERT = enum.auto()
    """Refresh the lock if still owned, take it back if it vanished."""
    EXTEND = enum.auto()
    """Give the lock its full TTL if still owned; never create it."""
    REMEMBER = enum.auto()
    """Keep the lock for the success TTL if still owned (release it if that is 0)."""


class RetrySend(enum.Enum):
    """What the send of a retry does with the lock of the attempt it continues."""

    TAKE_OVER = enum.auto()
    """Take the attempt's lock over (a new owner token); refused if another send holds it."""
    TAKE_IF_FREE = enum.auto()
    """Take the lock if it is free or still the attempt's; else go out without one."""
    KEEP = enum.auto()
    """Go out with the attempt's lock as it is: no Redis call, its TTL untouched."""


@dataclass(frozen=True, slots=True)
class Policy:
    """What happens to a lock at each step of its task's life."""

    name: str
    retry: RetrySend
    at_start: Step
    heartbeat: bool
    """Whether the heartbeat keeps the lock alive while the task runs."""
    on_success: Step
    on_failure: Step
    passed_on: Step
    remembers_success: bool
    """Whether ``deduplication_success_ttl`` means anything to this policy."""


FINISHED: Final = Policy(
    "finished",
    retry=RetrySend.TAKE_OVER,
    at_start=Step.REASSERT,
    heartbeat=True,
    on_success=Step.REMEMBER,
    on_failure=Step.RELEASE,
    passed_on=Step.EXTEND,
    remembers_success=True,
)
STARTED: Final = Policy(
    "started",
    retry=RetrySend.TAKE_IF_FREE,
    at_start=Step.RELEASE,
    heartbeat=False,
    on_success=Step.NOTHING,
    on_failure=Step.NOTHING,
    passed_on=Step.REASSERT,
    remembers_success=False,
)
EXPIRED: Final = Policy(
    "expired",
    retry=RetrySend.KEEP,
    at_start=Step.NOTHING,
    heartbeat=False,
    on_success=Step.NOTHING,
    on_failure=Step.NOTHING,
    passed_on=Step.NOTHING,
    remembers_success=False,
)

#: Every policy by its name, the value of the ``deduplication_until`` label.
POLICIES: Final = {policy.name: policy for policy in (FINISHED, STARTED, EXPIRED)}
