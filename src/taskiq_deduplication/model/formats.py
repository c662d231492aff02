"""The formats of a lock, built and parsed here and nowhere else.

In Redis, a lock is one string key, ``<key_prefix>:<name>``, where the name is
the call's fingerprint or the task's explicit key. Its value is
``"<owner token> <task_id>"``: the token is new for every send, so a lock can
only be extended or released by the send that took it, and the task_id names
the holder in a [DuplicateTaskError][taskiq_deduplication.DuplicateTaskError].

The token carries the lock's record after its random part: a lock tells what it
is for. ``"<owner>/<taken ms>/<policy>[/<task name>]"``: the sender's time in
milliseconds when it took the lock, the policy's first letter, and
the task's name where the middleware records it (``record_task_name``; its
whitespace and ``%`` percent-escaped). Until a broker accepts the send, ``"!"``
follows the task_id (`UNSENT_MARK`); the send's ``post_send`` removes it. The
message's owner label carries the value as it is once accepted, so a worker
of a version before the record (which compares whole values) finds its lock
as it always did. A value without a record (``"<owner token> <task_id>"``) was
written by an older version, or is a tick lock: it is read as before, and
whether its send was accepted is not known. `read_lock_value` reads either.

On the message, the sender records the lock it took in labels of its own
(``_deduplication_lock_*``), which travel as strings like taskiq's ``_retries``;
the worker reads them back to re-assert, refresh and release that very lock.

Tasks that merge their calls (``deduplication_merge``, ``deduplication_debounce``)
keep the latest arguments in a hash beside the lock, ``<key_prefix>#merge:<name>``;
tasks that take a fence draw it from one counter per prefix,
``<key_prefix>#fence``. An exclusive run of a ``"started"`` or ``"expired"``
task holds a run slot, ``<key_prefix>#run:<name>``, while it goes on (a
``"finished"`` lock is its own run slot: its value names the run while the task
runs). These live outside the locks' namespace (``<key_prefix>:``), so no lock
name can collide with them, and with a hash tag in the prefix they share the
locks' slot on a cluster.

A run slot holds ``"<run token> <task_id>"`` while its run goes on: a run token
starts with ``~`` and replaces the send's owner token (same length), so a copy of
the same message that the broker delivers again can tell a live run of its own
task from its own queued lock. ``" +"`` follows once such a copy waits; a run
that succeeded leaves ``"=<...> <task_id>"`` for as long as its success is
remembered (or briefly, for the copies that waited).

A call whose run succeeded is remembered under ``<key_prefix>#done:<task_id>``
(`done_key`) for the redelivery window, so that a copy of its message that the
broker delivers again does not run.

A scheduler marks each tick of a schedule it sends with a tick lock,
``<key_prefix>#tick:<identity>``, valued like a lock: ``"<owner token>
<replica>"``, where the replica is ``<host>/<pid>`` of the scheduler that took
it (see `scheduler/ticks.py`). It belongs to no lock and expires by itself.

Every key beside the locks lives under ``<key_prefix>#``: the two namespaces
hold every key the library writes (`namespace_patterns`); the merged arguments
belong to their lock and go when it is released (`belonging_keys`).

The middleware, the heartbeat, the CLI and the test helpers all read and write
these formats through this module.
"""

from __future__ import annotations

import base64
import os
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import unquote

from redis.crc import key_slot

from taskiq_deduplication.model.policies import FINISHED

if TYPE_CHECKING:
    from collections.abc import Mapping

#: Between the key prefix and the lock's name.
#: The prefix of every key when the ``key_prefix`` option says nothing.
DEFAULT_PREFIX: Final = "taskiq:deduplication"
KEY_SEPARATOR: Final = ":"

# Labels the sender writes on each message it locked.
LOCK_KEY_LABEL: Final = "_deduplication_lock_key"
LOCK_OWNER_LABEL: Final = "_deduplication_lock_owner"
LOCK_TTL_LABEL: Final = "_deduplication_lock_ttl"
# Written only when they differ from the default ("finished", 0 seconds), so a
# message of the default policy is no bigger than before policies existed.
LOCK_UNTIL_LABEL: Final = "_deduplication_lock_until"
LOCK_SUCCESS_TTL_LABEL: Final = "_deduplication_lock_success_ttl"
# Written only for the locks that have them: a fence, and merged calls
# ("<quiet ms> <maximum wait ms>", both 0 for a plain merge).
LOCK_FENCE_LABEL: Final = "_deduplication_lock_fence"
LOCK_MERGE_LABEL: Final = "_deduplication_lock_merge"
# Written only for a lock whose runs may overlap ("0"): runs are exclusive by default.
LOCK_EXCLUSIVE_LABEL: Final = "_deduplication_lock_exclusive"
# Written only on a retry: the owner token of the call's first send, which every
# attempt of the call, and every copy of each, shares (see `done_key`).
LOCK_FIRST_LABEL: Final = "_deduplication_lock_first"
LOCK_LABELS: Final = (
    LOCK_KEY_LABEL,
    LOCK_OWNER_LABEL,
    LOCK_TTL_LABEL,
    LOCK_UNTIL_LABEL,
    LOCK_SUCCESS_TTL_LABEL,
    LOCK_FENCE_LABEL,
    LOCK_MERGE_LABEL,
    LOCK_EXCLUSIVE_LABEL,
    LOCK_FIRST_LABEL,
)
#: On a call merged into its queued holder: the holder's task_id. Such a message
#: is handed back to ``kiq`` as the holder's and never reaches the broker.
MERGED_INTO_LABEL: Final = "_deduplication_merged_into"
#: Between the key prefix and the name of a key beside the locks (merge, fence).
SIDE_SEPARATOR: Final = "#"
# The kinds of key beside a lock that belong to it: released with it.
_MERGE: Final = "merge"
_BELONGING: Final = (_MERGE,)
# Between the random part of an owner token and the digest of its call's arguments.
_DIGEST_MARK: Final = "."
# The first character of a run token (a run goes on) and of a succeeded run's
# token in a run slot; an owner token of a send never starts with either.
RUN_MARK: Final = "~"
SUCCEEDED_MARK: Final = "="
#: The owner token recorded on an exclusive task's message that went out without
#: a lock (fail-open, a retry whose lock another send took): no lock's value
#: ever has it, so every owner check fails, while its run takes the run slot.
NO_OWNER: Final = "-"
# After a running slot's value while a copy of its task waits for the run.
WAITED_MARK: Final = " +"
DEFAULT_UNTIL: Final = FINISHED.name
#: Between an owner token's random part and the lock's record, and between the
#: record's fields. Never in a random part (base64url, with ``.`` before a digest).
RECORD_MARK: Final = "/"
#: After a lock's value (new format only) until a broker accepts its send. Not a
#: space: a worker of a version before the record reads the second word of a
#: value as its task_id, and must not take a lock in flight for its own.
UNSENT_MARK: Final = "!"
# The record's letter for each policy, and back.
_POLICY_LETTERS: Final = {"finished": "f", "started": "s", "expired": "e"}
_LETTER_POLICIES: Final = {letter: name for name, letter in _POLICY_LETTERS.items()}
# What a recorded task name escapes: what would end a word of the value.
_NAME_ESCAPES: Final = re.compile(r"[\t\n\v\f\r %]")


def lock_key(prefix: str, name: str) -> str:
    """The Redis key of the lock called ``name`` (a fingerprint or an explicit key)."""
    return f"{prefix}{KEY_SEPARATOR}{name}"


def key_pattern(prefix: str, match: str = "*") -> str:
    """A ``SCAN MATCH`` pattern for the locks under ``prefix`` whose name matches ``match``.

    The prefix is matched literally (its glob characters escaped); ``match`` is
    a glob over the name.
    """
    return _literal(prefix) + KEY_SEPARATOR + match


def namespace_patterns(prefix: str) -> tuple[str, ...]:
    """``SCAN MATCH`` patterns that together match every key the library writes under ``prefix``.

    The locks (``<prefix>:*``) and every key beside them (``<prefix>#*``: merged
    arguments, the fence counter, and any kind added later), so that a cleanup
    that deletes what they match leaves nothing of the prefix behind.
    """
    return (key_pattern(prefix), _literal(prefix) + SIDE_SEPARATOR + "*")


def belonging_keys(lock: str) -> list[str]:
    """The keys that belong to the lock at key ``lock`` and go when it is released.

    Its merged arguments, ``<prefix>#merge:<name>``. The key alone does not say
    where its prefix ends (either may hold a ``:``), so this names the merge key
    of every way to read it as ``<prefix>:<name>``: each is the merge key of
    this very Redis key under some prefix, so each belongs to this lock.
    """
    keys = []
    start = lock.find(KEY_SEPARATOR, 1)
    while 0 < start < len(lock) - 1:
        prefix, name = lock[:start], lock[start + 1 :]
        keys += [f"{prefix}{SIDE_SEPARATOR}{kind}{KEY_SEPARATOR}{name}" for kind in _BELONGING]
        start = lock.find(KEY_SEPARATOR, start + 1)
    return keys


def _literal(prefix: str) -> str:
    """``prefix`` as a glob that matches it literally."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", prefix)


def lock_name(prefix: str, key: str) -> str | None:
    """The name in a lock key under ``prefix``, or ``None`` if the key is not under it."""
    head = prefix + KEY_SEPARATOR
    return key[len(head) :] if key.startswith(head) and len(key) > len(head) else None


def merge_key(prefix: str, lock: str) -> str | None:
    """The key of the merged arguments of lock ``lock``; ``None`` if not under ``prefix``."""
    name = lock_name(prefix, lock)
    return None if name is None else f"{prefix}{SIDE_SEPARATOR}{_MERGE}{KEY_SEPARATOR}{name}"


def fence_key(prefix: str) -> str:
    """The counter that every fence under ``prefix`` is drawn from."""
    return f"{prefix}{SIDE_SEPARATOR}fence"


def tick_key(prefix: str, identity: str) -> str:
    """The tick lock of one tick of a schedule, ``<prefix>#tick:<identity>``."""
    return f"{prefix}{SIDE_SEPARATOR}tick{KEY_SEPARATOR}{identity}"


def done_key(prefix: str, lock: str, task_id: str, *, cluster: bool) -> str | None:
    """Where a call's success is remembered for copies of its message: ``<prefix>#done:...``.

    A run that succeeds writes it (for ``redelivery_window`` seconds), holding
    the owner token of the call's first send; a run that begins and finds its
    own call's token there is a copy the broker delivered again, and does not
    run. Keyed by the task_id, not the lock: a new call with the same
    arguments has a task_id of its own and runs as soon as the lock is free.
    A send that merely reuses a task_id (``with_task_id``) has a token of its
    own, and runs too.

    On a cluster, the key must share the lock's slot (the scripts read both):
    under a prefix with a hash tag it does as it is; under one without, it
    carries the lock key as its hash tag, ``<prefix>#done:{<lock>}<task_id>``.
    ``None`` where neither shares the lock's slot (a lock key with a stray
    brace in it, under a prefix without a tag): copies of its runs are not told.
    """
    head = f"{prefix}{SIDE_SEPARATOR}done{KEY_SEPARATOR}"
    if not cluster:
        return head + task_id
    slot = key_slot(lock.encode())
    for key in (head + task_id, f"{head}{{{lock}}}{task_id}"):
        if key_slot(key.encode()) == slot:
            return key
    return None


def run_key(prefix: str, lock: str) -> str | None:
    """The run slot of lock ``lock`` for the policies whose lock is not their run slot.

    ``None`` if the lock is not under ``prefix``. (A ``"finished"`` lock is held
    while its task runs, so it is its own run slot.)
    """
    name = lock_name(prefix, lock)
    return None if name is None else f"{prefix}{SIDE_SEPARATOR}run{KEY_SEPARATOR}{name}"


# Owner and run tokens only have to differ from every other token of the same
# lock: nothing about them is secret (whoever can read Redis reads them there).
# A generator seeded from the OS once per process makes one without a system
# call: on a virtual machine a getrandom() per send and per run cost more than
# the rest of the token. A forked process (taskiq's worker processes) seeds its
# own, or parent and children would make the same tokens.
_tokens = random.Random()  # noqa: S311 (unique, not secret: see above)
if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_tokens.seed)


def _random_text(nbytes: int) -> str:
    """``nbytes`` random bytes as URL-safe base64 without padding (as ``secrets.token_urlsafe``)."""
    data = _tokens.getrandbits(nbytes * 8).to_bytes(nbytes, "little")
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def new_run_token(token: str) -> str:
    """Make the token of one run of the send ``token``: a run slot holds it while the run goes on.

    It is as long as the send's token and keeps its arguments' digest and its
    record, so a lock's value grows by nothing when its run begins, and still
    tells what it is for.
    """
    owner, separator, record = token.partition(RECORD_MARK)
    drawn, mark, digest = owner.partition(_DIGEST_MARK)
    if mark and drawn and digest:
        run = RUN_MARK + _random_text(6)[:5] + _DIGEST_MARK + digest
    else:
        run = RUN_MARK + _random_text(8)[:10]
    return run + separator + record


def new_token(digest: str | None = None) -> str:
    """Make an owner token: unique per send, short, without spaces.

    64 random bits in 11 characters. With a 32-character task_id the lock's value
    is then 44 bytes, the most Redis stores inside the key's own allocation.

    A lock under an explicit key or key fields carries ``digest``, a short
    digest of the call's full arguments (`arguments_digest`), in its token
    instead of 28 of the random bits: the token stays 11 characters (36 random
    bits), and a refused call can tell whether its arguments were the holder's.
    """
    if digest is None:
        return _random_text(8)
    return _random_text(6)[:6] + _DIGEST_MARK + digest


def arguments_digest(fingerprint: str) -> str:
    """The 4-character digest (24 bits) of a call's full fingerprint, for its token.

    The fingerprint is base64url already: its first 4 characters are 24 bits of it.
    """
    return fingerprint[:4]


def token_digest(value: str) -> str | None:
    """The arguments digest in the token of lock value ``value``, if it has one."""
    owner = value.partition(" ")[0].partition(RECORD_MARK)[0]
    random, mark, digest = owner.partition(_DIGEST_MARK)
    return digest if mark and random and digest else None


def lock_value(token: str, task_id: str) -> str:
    """The value of a lock taken by the send ``token`` of task ``task_id``."""
    return f"{token} {task_id}"


def holder_task_id(value: str) -> str | None:
    """The ``task_id`` in a lock's value, or ``None`` if the value is not ours.

    A run slot's value may carry a mark after the task_id (`WAITED_MARK`), and
    a lock whose send a broker has not accepted yet another (`UNSENT_MARK`).
    (A task_id of its own that ends with ``"!"`` reads as unsent, without it;
    taskiq's own task_ids are hexadecimal.)
    """
    token, separator, rest = value.partition(" ")
    task_id = rest.partition(" ")[0]
    if RECORD_MARK in token and task_id.endswith(UNSENT_MARK):
        task_id = task_id[: -len(UNSENT_MARK)]
    return task_id if separator and token and task_id else None


def recorded_token(owner: str, taken_ms: int, tail: str) -> str:
    """An owner token with the lock's record: ``"<owner>/<taken ms>/<tail>"`` (`record_tail`)."""
    return f"{owner}{RECORD_MARK}{taken_ms}{RECORD_MARK}{tail}"


def unsent_value(token: str, task_id: str) -> str:
    """The value of a lock with a record whose send no broker has accepted yet."""
    return lock_value(token, task_id) + UNSENT_MARK


def record_tail(policy: str, task_name: str | None) -> str:
    """What the acquire script writes after the owner and the time: policy, and the name.

    ``task_name`` ``None``: the name is not recorded (the default: it costs
    memory per lock, see ``record_task_name``).
    """
    letter = _POLICY_LETTERS.get(policy, "?")
    if task_name is None:
        return letter
    escaped = _NAME_ESCAPES.sub(lambda found: f"%{ord(found.group()):02X}", task_name)
    return f"{letter}{RECORD_MARK}{escaped}"


@dataclass(frozen=True, slots=True)
class LockRecord:
    """What a lock's value tells: who holds it, and, where it has a record, what for.

    A value of an older version (or a tick lock) has no record: its ``taken_ms``,
    ``policy``, ``task_name`` and ``sent`` are ``None``.
    """

    owner_token: str
    """The token of the send (or run) that holds the lock, its record included:
    what an owner-checked release compares."""
    holder_task_id: str
    """The ``task_id`` of the task that holds it."""
    taken_ms: int | None = None
    """The sender's time, in milliseconds since the epoch, when it took the lock."""
    policy: str | None = None
    """The name of the lock's policy: ``"finished"``, ``"started"`` or ``"expired"``."""
    task_name: str | None = None
    """The holder's task name, if the middleware records it (``record_task_name``)."""
    sent: bool | None = None
    """Whether a broker has accepted the holder's send; ``None`` when not known
    (a value without a record)."""
    running: bool = False
    """Whether the value is a run's (a run of the task goes on)."""
    succeeded: bool = False
    """Whether the value remembers a run that succeeded."""


def read_lock_value(value: str) -> LockRecord | None:
    """Read a lock's value, of either format; ``None`` if it is not a lock's value.

    Never raises: a record this version cannot read leaves its fields ``None``.
    """
    holder = holder_task_id(value)
    if holder is None:
        return None
    token = value.partition(" ")[0]
    owner, separator, record = token.partition(RECORD_MARK)
    running = owner.startswith(RUN_MARK)
    succeeded = owner.startswith(SUCCEEDED_MARK)
    if not separator:
        return LockRecord(token, holder, running=running, succeeded=succeeded)
    taken, _, rest = record.partition(RECORD_MARK)
    letter, named, name = rest.partition(RECORD_MARK)
    unsent = value.partition(" ")[2].partition(" ")[0].endswith(UNSENT_MARK)
    return LockRecord(
        token,
        holder,
        taken_ms=int(taken) if taken.isdigit() else None,
        policy=_LETTER_POLICIES.get(letter),
        task_name=unquote(name) if named else None,
        sent=not unsent,
        running=running,
        succeeded=succeeded,
    )


@dataclass(frozen=True, slots=True)
class RecordedLock:
    """The lock a sender took for a message, as the worker reads it back."""

    key: str
    token: str
    ttl: int
    """The lock's TTL once the broker accepted the message, in seconds."""
    until: str = DEFAULT_UNTIL
    """The name of the lock's policy."""
    success_ttl: int = 0
    """Seconds the lock stays after a successful run."""
    fence: int | None = None
    """The fence the lock was taken with, for a task that asks for one."""
    merge: tuple[int, int] | None = None
    """For a task that merges its calls: the quiet period and the maximum
    wait of its debounce, in milliseconds (0 and 0: a plain merge)."""
    exclusive: bool = True
    """Whether a run waits for another run of the same lock key to end."""
    first: str | None = None
    """The owner token of the call's first send, on a retry (whose own token differs)."""

    @property
    def call(self) -> str:
        """The token that names the call, across its retries and copies: the first send's."""
        return self.first or self.token


def read_lock_labels(labels: Mapping[str, Any], task_id: str) -> RecordedLock | None:
    """Read the lock a sender recorded on the message ``task_id``, never raising.

    Args:
        labels: The labels of a message.
        task_id: The message's ``task_id``. Labels copied onto another message
            (a middleware that reuses a parent's labels) name another owner and
            do not count.

    Returns:
        The lock, or ``None`` when the message carries no (well-formed) lock of
        its own: sent without deduplication, or by a sender without this
        middleware.
    """
    key = labels.get(LOCK_KEY_LABEL)
    owner = labels.get(LOCK_OWNER_LABEL)
    if not (isinstance(key, str) and isinstance(owner, str) and key):
        return None
    token, _, owner_task_id = owner.partition(" ")
    if not token or owner_task_id != task_id:
        return None
    ttl = _seconds(labels.get(LOCK_TTL_LABEL), minimum=1)
    if ttl is None:
        return None
    until = labels.get(LOCK_UNTIL_LABEL, DEFAULT_UNTIL)
    success_ttl = _seconds(labels.get(LOCK_SUCCESS_TTL_LABEL, 0), minimum=0)
    if not isinstance(until, str) or success_ttl is None:
        return None
    fence = _seconds(labels.get(LOCK_FENCE_LABEL), minimum=1)
    first = labels.get(LOCK_FIRST_LABEL)
    return RecordedLock(
        key,
        token,
        ttl,
        until,
        success_ttl,
        fence,
        _merge(labels.get(LOCK_MERGE_LABEL)),
        exclusive=labels.get(LOCK_EXCLUSIVE_LABEL) not in {"0", 0},
        first=first if isinstance(first, str) and first and " " not in first else None,
    )


def write_lock_labels(labels: dict[str, Any], lock: RecordedLock, task_id: str) -> None:
    """Record on the message of ``task_id`` the lock its sender took."""
    labels[LOCK_KEY_LABEL] = lock.key
    labels[LOCK_OWNER_LABEL] = lock_value(lock.token, task_id)
    labels[LOCK_TTL_LABEL] = str(lock.ttl)
    if lock.until != DEFAULT_UNTIL:
        labels[LOCK_UNTIL_LABEL] = lock.until
    else:
        labels.pop(LOCK_UNTIL_LABEL, None)
    if lock.success_ttl:
        labels[LOCK_SUCCESS_TTL_LABEL] = str(lock.success_ttl)
    else:
        labels.pop(LOCK_SUCCESS_TTL_LABEL, None)
    if lock.fence is not None:
        labels[LOCK_FENCE_LABEL] = str(lock.fence)
    else:
        labels.pop(LOCK_FENCE_LABEL, None)
    if lock.merge is not None:
        labels[LOCK_MERGE_LABEL] = f"{lock.merge[0]} {lock.merge[1]}"
    else:
        labels.pop(LOCK_MERGE_LABEL, None)
    if not lock.exclusive:
        labels[LOCK_EXCLUSIVE_LABEL] = "0"
    else:
        labels.pop(LOCK_EXCLUSIVE_LABEL, None)
    if lock.first is not None and lock.first != lock.token:
        labels[LOCK_FIRST_LABEL] = lock.first
    else:
        labels.pop(LOCK_FIRST_LABEL, None)


def drop_lock_labels(labels: dict[str, Any]) -> None:
    """Remove a lock record, e.g. one a retry copied from the attempt before."""
    for label in LOCK_LABELS:
        labels.pop(label, None)


def _seconds(value: object, *, minimum: int) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and value >= minimum else None


def _merge(value: object) -> tuple[int, int] | None:
    if not isinstance(value, str):
        return None
    quiet, _, longest = value.partition(" ")
    quiet_ms, longest_ms = _seconds(quiet, minimum=0), _seconds(longest, minimum=0)
    return None if quiet_ms is None or longest_ms is None else (quiet_ms, longest_ms)
