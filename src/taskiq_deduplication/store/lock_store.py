"""The locks in Redis: acquire, extend, re-assert and release, owner-checked in Lua.

The key and value formats are those of `model/formats.py`: the owner token in the
value is new for every send, so a lock can only be extended or released by the
send that took it.

Every script call goes through one `Pipeline` (in `store/pipeline.py`),
which keeps them in order and sends those issued in the same instant together.

This is the boundary between the library and Redis: each operation answers
with what it found, in named outcomes (`Acquired`, `Claimed`, `Reasserted`),
or with `RedisFailed` when Redis did not answer it (unreachable, timed out,
refused the command). No caller catches a Redis error: each decides from the
outcome what a failure means for it (a send fails, or goes out fail-open; a run
logs and lets the lock expire; the heartbeat tries again). A cancelled caller
is cancelled, not an outcome.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, Final

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import TimeoutError as RedisTimeoutError

from taskiq_deduplication.exceptions import CallTimeoutError
from taskiq_deduplication.model.formats import (
    lock_value,
    new_run_token,
    recorded_token,
    unsent_value,
)
from taskiq_deduplication.store.call import REDIS_FAILURES, RedisFailed
from taskiq_deduplication.store.pipeline import (
    Pipeline,
    ScriptCall,
    text,
)
from taskiq_deduplication.store.slots import SlotStore

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

    RedisClient = Redis | RedisCluster


# Most locks in one re-assert call.
_MAX_KEYS_PER_REASSERT: Final = 500
# How long a lock call may wait for its reply when the client sets no socket timeout.
_DEFAULT_TIMEOUT: Final = 5.0
# A lock extension or the undo of an acquire that goes out later than the grace
# TTL after it was made finds its lock expired already: it is not sent then.
_DETACHED_TIMEOUT: Final = 10.0


@dataclass(frozen=True, slots=True)
class Lock:
    """One lock as its owner knows it."""

    key: str
    token: str
    task_id: str
    ttl_ms: int
    value: str = field(init=False, repr=False, compare=False)
    """The lock's value: ``"<owner token> <task_id>"``, as the message's owner
    label carries it (in Redis, ``"!"`` follows it until the send is accepted)."""

    def __post_init__(self) -> None:
        """Compute the value once: a heartbeat tick sends it for every running task."""
        object.__setattr__(self, "value", lock_value(self.token, self.task_id))


class Reasserted(enum.IntEnum):
    """What a re-assert found of a lock of this process, besides another holder's value."""

    REFRESHED = 1
    """Still this send's: its TTL set again."""
    TAKEN_BACK = 2
    """Vanished (expired, a Redis restart): taken back for this send."""


class _Claim(enum.IntEnum):
    """The first element of a claim script's reply, where it is not a `Reasserted` outcome."""

    DEBOUNCE = 0
    """A debounce's quiet period goes on: claim again after the reply's wait."""
    WAIT_FOR_RUN = 3
    """Another run of the key goes on: claim again after at most its slot's TTL."""
    SKIP = 4
    """This delivery must not run: its call succeeded, or a retry carries it on."""
    COPY_OF_SUCCESS = 5
    """A copy of a call whose run succeeded, remembered under its done key."""


class _Acquire(enum.IntEnum):
    """The status of ``acquire_with.lua``'s reply."""

    HELD = 0
    """Another send holds the lock: the reply's value is the holder's."""
    TAKEN = 1
    """The lock is this send's: the reply's value is its fence (0 for none)."""
    MERGED = 2
    """Held by a queued message of the same task, which now carries these arguments."""
    PENDING = 3
    """Held by a message that merges calls, not accepted by a broker yet."""


@dataclass(frozen=True, slots=True)
class Acquired:
    """What `LockStore.acquire` found."""

    holder: str | None
    """``None`` when the lock is now this send's, else the holder's value."""
    token: str | None = None
    """When the lock is now this send's: its owner token as Redis has it, the
    lock's record included."""
    fence: int | None = None
    """The fence drawn for this send, if it asked for one and took the lock."""
    merged: bool = False
    """Whether the call's arguments replaced those of the queued holder."""
    pending: bool = False
    """Whether the holder merges calls but its message is not accepted yet."""
    run_token: str | None = None
    """When the lock was taken for a run that begins at once (``for_run``):
    the run's token, which Redis has in the lock's value."""


@dataclass(frozen=True, slots=True)
class Claimed:
    """What `LockStore.claim` found at the start of a run."""

    wait_ms: int = 0
    """Above 0: the run may not begin yet; claim again after at most this many ms."""
    waiting_for: str | None = None
    """The value of the run slot of another run of the key, which goes on: the
    reason to wait (``None`` while a debounce waits)."""
    skipped_for: str | None = None
    """The value of the run slot that says this delivery must not run: its run
    succeeded, or a retry took its lock over."""
    copy_of_success: bool = False
    """Whether this delivery must not run because it is a copy of a call whose
    run succeeded, remembered for the redelivery window (its done key)."""
    outcome: Reasserted | str = Reasserted.REFRESHED
    """What the run's step at the start found of the lock, as a re-assert says
    it: `Reasserted.REFRESHED`, `Reasserted.TAKEN_BACK`, or another holder's value."""
    fence: int | None = None
    """A new fence, drawn when the lock was taken back."""
    arguments: bytes | None = None
    """The latest merged arguments, serialised, if there were any to claim."""


#: What most claims find: the run begins, its lock this send's; nothing else.
_BEGUN: Final = Claimed()

#: What a claim finds for a copy of a call that succeeded.
_NOT_AGAIN: Final = Claimed(copy_of_success=True)


@dataclass(frozen=True, slots=True)
class Done:
    """Where a run's call is remembered once it succeeded, and for how long."""

    key: str
    """The call's done key (`done_key`)."""
    call: str
    """The token of the call's first send: what a copy of its message carries."""
    ttl_ms: int
    """The redelivery window."""


def load_script(client: RedisClient, name: str) -> AsyncScript:
    """Register the script ``lua/<name>.lua`` on ``client`` (sent on its first call)."""
    source = resources.files(__package__).joinpath(f"lua/{name}.lua").read_text("utf-8")
    return client.register_script(source)


class LockStore:
    """The lock operations, each one owner-checked Lua script, sent in batches."""

    def __init__(
        self, client: RedisClient, *, round_trip: Callable[[float], None] | None = None
    ) -> None:
        """Register the scripts on ``client``; nothing is sent yet.

        Every call waits for its reply at most the client's ``socket_timeout``
        (5 seconds if it has none), counted from the moment it is made. The
        seconds of each round trip go to ``round_trip``, if given.
        """
        self._client = client
        self._acquire = load_script(client, "acquire")
        self._extend = load_script(client, "extend")
        self._release = load_script(client, "release")
        self._reassert = load_script(client, "reassert")
        # For the tasks that merge calls or take a fence, and TaskLock.held().
        self._acquire_with = load_script(client, "acquire_with")
        self._claim_with = load_script(client, "claim_with")
        self._held = load_script(client, "held")
        # For exclusive runs.
        self._claim = load_script(client, "claim")
        self._finish = load_script(client, "finish")
        # After the broker accepted a merging task's message, or refused a send.
        self._sent = load_script(client, "sent")
        self._unsent = load_script(client, "unsent")
        self._reopen = load_script(client, "reopen")
        # For the limits: their slots ride in the same batches as the locks.
        self._limit = load_script(client, "limit")
        self._pipeline = Pipeline(
            client,
            (
                self._acquire,
                self._extend,
                self._release,
                self._reassert,
                self._acquire_with,
                self._claim_with,
                self._held,
                self._claim,
                self._finish,
                self._sent,
                self._unsent,
                self._reopen,
                self._limit,
            ),
            timeout=call_timeout(client),
            detached_timeout=_DETACHED_TIMEOUT,
            round_trip=round_trip,
        )
        self.slots = SlotStore(self._pipeline, self._limit)
        """The slots of limits, sent through the same pipeline."""
        # A multi-key script must stay in one hash slot on a cluster.
        self._keys_per_reassert = 1 if isinstance(client, RedisCluster) else _MAX_KEYS_PER_REASSERT

    async def check(self) -> RedisFailed | None:
        """Ping Redis and load the scripts into it, so the first calls need no fallback."""
        try:
            await self._client.ping()
            await self._pipeline.load_scripts()
        except REDIS_FAILURES as exc:
            return RedisFailed(exc)
        return None

    async def acquire(  # noqa: PLR0913 (the script's arguments, each named)
        self,
        lock: Lock,
        ttl_ms: int,
        *,
        replaces: str = "",
        merge_key: str | None = None,
        arguments: bytes = b"",
        fence_key: str | None = None,
        task_name: str = "",
        record: str = "",
        undo_late: bool = True,
        for_run: bool = False,
    ) -> Acquired | RedisFailed:
        """Take ``lock`` for ``ttl_ms`` milliseconds; one script, one round trip.

        An acquire that may still land in Redis after its caller gave up (a
        timeout, a cancelled caller) is undone: its release is queued, unless
        the call never left this process or ``undo_late`` is off.

        Args:
            lock: The lock to take.
            ttl_ms: Its TTL for now (the grace TTL of a send in flight).
            replaces: The value of a lock this one may take over (the lock of the
                attempt a retry re-sends), or ``""``.
            merge_key: Where the latest arguments are kept, for a task that merges.
            arguments: The call's serialised arguments, for a task that merges.
            fence_key: The counter to draw a fence from, for a task that takes one.
            task_name: The task's name, for a task that merges: calls merge only
                into a message of the same task.
            record: The lock's record after the time (`record_tail`), or
                ``""`` for a lock without one; see `Acquired.token`.
            undo_late: Whether to undo an acquire that may land late (off for
                a tick sent without its lock: a late lock only holds back the
                other replicas).
            for_run: Take the lock for the run of this send that begins at
                once, in this process (an in-process broker runs the task
                inside ``kiq()``): its value is the run's, as a claim writes it
                (`Acquired.run_token`), with the ``"!"`` of a send in flight
                and its TTL ``ttl_ms``; the run sets its lease as it begins.
                Only a plain lock (no merged arguments, no fence) is taken so.
        """
        token = lock.token
        value = lock.value
        run_token = None
        if record:
            # The record's time is the sender's clock (what the locks page shows
            # as the lock's age): asking the server for it cost every acquire a
            # TIME and the string work around it.
            token = recorded_token(token, time.time_ns() // 1_000_000, record)
            value = unsent_value(token, lock.task_id)
        if for_run:
            run_token = new_run_token(token)
            value = unsent_value(run_token, lock.task_id)
        try:
            if merge_key is None and fence_key is None:
                reply = await self._pipeline.call(
                    self._acquire, [lock.key], [value, ttl_ms, replaces]
                )
                if reply == 1:
                    return Acquired(None, token=token, run_token=run_token)
                return Acquired(text(reply))
            keys = _keys_of(lock, merge_key, fence_key)
            args: list[str | int] = [
                value,
                ttl_ms,
                replaces,
                arguments.decode() if merge_key is not None else "",
                int(fence_key is not None),
                lock.ttl_ms,
                int(bool(replaces)),
                task_name,
            ]
            status, value = await self._pipeline.call(self._acquire_with, keys, args)
        except (RedisTimeoutError, asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if undo_late and not (isinstance(exc, CallTimeoutError) and not exc.sent):
                undone = lock if run_token is None else Lock(lock.key, run_token, lock.task_id, 0)
                self.release_detached(undone)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return RedisFailed(exc)
        except REDIS_FAILURES as exc:
            return RedisFailed(exc)
        if status == _Acquire.TAKEN:
            return Acquired(None, token=token, fence=int(value) or None)
        return Acquired(
            text(value), merged=status == _Acquire.MERGED, pending=status == _Acquire.PENDING
        )

    async def claim(  # noqa: PLR0913 (the script's arguments, each named)
        self,
        lock: Lock,
        *,
        step: str,
        merge_key: str | None = None,
        debounce: tuple[int, int] = (0, 0),
        fence_key: str | None = None,
        run: Lock | None = None,
        done: Done | None = None,
        linger: float = 0.0,
    ) -> Claimed | RedisFailed:
        """Begin the run of ``lock``'s task: wait for another run, wait out a debounce, claim.

        Args:
            lock: The lock, with the TTL it keeps while its task runs.
            step: ``"reassert"``, ``"release"`` or ``"nothing"``: what the
                policy does at the start, once the run may begin.
            merge_key: Where the latest arguments are, for a task that merges.
            debounce: The quiet period and the maximum wait, in milliseconds.
            fence_key: The fence counter, for a lock that has a fence.
            run: For an exclusive run, its run slot: the key (the lock's own
                for the ``"finished"`` policy) and the run token.
            done: Where the run's call is remembered once it succeeded: a
                copy of a call found there does not run.
            linger: Seconds the call may wait to share a round trip.
        """
        if (
            run is not None
            and run.key == lock.key
            and step == "reassert"
            and merge_key is None
            and fence_key is None
        ):
            # Most exclusive runs: a "finished" lock that is its own run slot,
            # nothing beside it. A script that reads and writes only the lock.
            keys = [lock.key, done.key if done is not None else lock.key]
            args: list[str | int] = [
                lock.value,
                lock.ttl_ms,
                run.token,
                done.call if done is not None else "",
            ]
            script = self._claim
        else:
            keys = [
                lock.key,
                merge_key or lock.key,
                fence_key or lock.key,
                run.key if run is not None else lock.key,
                done.key if done is not None else lock.key,
            ]
            args = [
                lock.value,
                lock.ttl_ms,
                *debounce,
                step,
                int(merge_key is not None),
                int(fence_key is not None),
                run.token if run is not None else "",
                run.ttl_ms if run is not None else 0,
                done.call if done is not None else "",
            ]
            script = self._claim_with
        try:
            reply = await self._pipeline.call(script, keys, args, linger=linger)
        except REDIS_FAILURES as exc:
            return RedisFailed(exc)
        if reply == Reasserted.REFRESHED:  # the run begins, its lock refreshed (most runs)
            return _BEGUN
        return _claimed(reply)

    async def finish(  # noqa: PLR0913 (the script's arguments, each named)
        self,
        run: Lock,
        how: str,
        ms: int = 0,
        *,
        waited_ms: int = 0,
        done: Done | None = None,
        linger: float = 0.0,
    ) -> bool | RedisFailed:
        """End the exclusive run that holds the run slot ``run``; return whether it still did.

        Args:
            run: The run slot: its key and the run token.
            how: ``"succeeded"`` (remember the success ``ms`` milliseconds; 0:
                free the slot, unless copies of the run wait for it: then keep the
                success ``waited_ms`` for them) or ``"failed"`` (free the slot).
                A success to remember is written even where the slot vanished
                under the run (a Redis restart), unless another run holds it.
            ms: See ``how``.
            waited_ms: See ``how``.
            done: Where a success is remembered for copies of the run's call
                (whatever became of the slot), for its redelivery window.
            linger: Seconds the call may wait to share a round trip.
        """
        keys, args = _finish_call(run, how, ms, waited_ms, done)
        return await self._answer(self._finish, keys, args, linger)

    async def finish_detached(  # noqa: PLR0913 (the script's arguments, each named)
        self,
        run: Lock,
        how: str,
        ms: int = 0,
        *,
        waited_ms: int = 0,
        done: Done | None = None,
        what: str,
    ) -> None:
        """`finish`, without waiting for the reply; a failure is logged as ``what``.

        For a run slot beside its lock, whose end nobody waits for: the run's
        result does not depend on it, and the pipeline keeps its order, so a
        later call of this process (a next run's claim) comes after it. It is
        on its way when this returns (when the pipeline is idle).
        """
        keys, args = _finish_call(run, how, ms, waited_ms, done)
        await self._pipeline.send_ahead(self._finish, keys, args, what)

    async def hand_over(self, run: Lock, to: Lock, *, linger: float = 0.0) -> bool | RedisFailed:
        """Hand the run slot ``run`` to the send ``to`` (a requeued message, a retry).

        The slot then holds ``to``'s value for ``to``'s TTL: that send's run
        takes it as its own, and a copy of the run that ends here finds its
        task carried on. Returns whether the slot was still this run's.
        """
        args: list[str | int] = [run.token, "handed", to.value, to.ttl_ms]
        return await self._answer(self._finish, [run.key], args, linger)

    async def held(self, lock: Lock) -> bool | RedisFailed:
        """Whether ``lock`` is still held by its owner: one round trip."""
        return await self._answer(self._held, [lock.key], [lock.value])

    async def extend_detached(self, lock: Lock, *, ttl_ms: int | None = None) -> None:
        """Give ``lock`` its full TTL if still owned, without waiting for the reply.

        It also marks the lock's send accepted by a broker (a lock with a
        record). ``ttl_ms`` 0 leaves its TTL as it is and only marks it.

        The command is on its way to Redis when this returns (when the pipeline
        is idle), so it is not lost if the process ends right after a ``kiq``.
        """
        ttl = lock.ttl_ms if ttl_ms is None else ttl_ms
        await self._pipeline.send_ahead(
            self._extend, [lock.key], [lock.token, ttl], f"extend lock {lock.key!r}"
        )

    async def accepted_detached(self, lock: Lock, merge_key: str, ttl_ms: int) -> None:
        """Let calls merge into ``lock``'s message, which a broker accepted; give it ``ttl_ms``.

        As `extend_detached`: owner-checked, on its way when this returns,
        its reply not awaited. ``ttl_ms`` 0 leaves the lock's TTL as it is.
        """
        await self._pipeline.send_ahead(
            self._sent, [lock.key, merge_key], [lock.token, ttl_ms], f"extend lock {lock.key!r}"
        )

    async def reopen_merge(
        self, lock: Lock, merge_key: str, arguments: bytes, task_name: str
    ) -> bool | RedisFailed:
        """Keep a kept retry's ``arguments`` for later calls to merge into: one round trip.

        Returns whether ``lock`` was still the retry's (else nothing is written).
        """
        args: list[str | int] = [lock.value, arguments.decode(), task_name]
        return await self._answer(self._reopen, [lock.key, merge_key], args)

    def release_unsent(self, lock: Lock, merge_key: str | None) -> None:
        """Release ``lock`` of a send the broker refused, and its merged arguments, soon.

        Owner-checked, not awaited; queued in order, so a send made after this
        in the same event loop finds the lock gone.
        """
        keys = _keys_of(lock, merge_key, None)
        self._pipeline.queue(self._unsent, keys, [lock.token], f"release lock {lock.key!r}")

    def release_detached(self, lock: Lock) -> None:
        """Release ``lock`` if still owned, soon, without waiting for the reply."""
        self._pipeline.queue(self._release, [lock.key], [lock.token], f"release lock {lock.key!r}")

    async def extend(self, lock: Lock, ttl_ms: int, *, linger: float = 0.0) -> bool | RedisFailed:
        """Give ``lock`` a TTL of ``ttl_ms`` if still owned; return whether it was.

        ``linger``: seconds the call may wait to share a round trip (see `Pipeline.call`).
        """
        return await self._answer(self._extend, [lock.key], [lock.token, ttl_ms], linger)

    async def release(self, lock: Lock, *, linger: float = 0.0) -> bool | RedisFailed:
        """Release ``lock`` if still owned; return whether it was.

        ``linger``: seconds the call may wait to share a round trip (see `Pipeline.call`).
        """
        return await self._answer(self._release, [lock.key], [lock.token], linger)

    async def reassert(
        self, locks: Sequence[Lock], *, linger: float = 0.0
    ) -> list[Reasserted | str] | RedisFailed:
        """Refresh each lock still owned, take back each that vanished.

        ``linger``: seconds a call for one lock may wait to share a round trip
        (see `Pipeline.call`); the calls for many locks go at once.

        Returns:
            Per lock: `Reasserted.REFRESHED`, `Reasserted.TAKEN_BACK`,
            or the value of the lock another send holds now.
        """
        # One call per TTL (the locks of a task share theirs) and per chunk of keys.
        by_ttl: dict[int, list[int]] = {}
        for index, lock in enumerate(locks):
            by_ttl.setdefault(lock.ttl_ms, []).append(index)
        calls: list[ScriptCall] = []
        order: list[int] = []
        step = self._keys_per_reassert
        for ttl_ms, indices in by_ttl.items():
            for start in range(0, len(indices), step):
                chunk = indices[start : start + step]
                keys = [locks[i].key for i in chunk]
                calls.append((self._reassert, keys, [ttl_ms, *(locks[i].value for i in chunk)]))
                order += chunk
        # All of them go in one batch: a heartbeat tick is one round trip.
        try:
            if len(calls) == 1:  # a run that begins: no futures to gather
                replies = [await self._pipeline.call(*calls[0], linger=linger)]
            else:
                replies = await self._pipeline.call_many(calls)
        except REDIS_FAILURES as exc:
            return RedisFailed(exc)
        outcomes: list[Reasserted | str] = [Reasserted.REFRESHED] * len(locks)
        flat = (reply for chunk_replies in replies for reply in chunk_replies)
        for index, reply in zip(order, flat, strict=True):
            outcomes[index] = _reasserted(reply)
        return outcomes

    async def _answer(
        self, script: AsyncScript, keys: list[str], args: list[str | int], linger: float = 0.0
    ) -> bool | RedisFailed:
        """The yes or no of a script that answers 1 or 0, or why Redis gave none."""
        try:
            return bool(await self._pipeline.call(script, keys, args, linger=linger))
        except REDIS_FAILURES as exc:
            return RedisFailed(exc)

    @property
    def backlog(self) -> int:
        """The number of lock calls waiting to be sent to Redis."""
        return self._pipeline.queued

    async def close(self) -> None:
        """Send what is queued and give the connection back; the client stays open."""
        await self._pipeline.close()

    def abandon(self) -> None:
        """Give up what is queued: the event loop of the store closed before the store did."""
        self._pipeline.abandon()


def _claimed(reply: Any) -> Claimed:  # noqa: ANN401 (a script's reply)
    """What a claim script's reply other than 1 says (`_Claim`, or the step's outcome)."""
    first = reply[0]
    if first == _Claim.COPY_OF_SUCCESS:
        return _NOT_AGAIN
    if first == _Claim.DEBOUNCE:
        return Claimed(wait_ms=max(int(reply[1]), 1))
    if first == _Claim.WAIT_FOR_RUN:
        return Claimed(wait_ms=max(int(reply[1]), 1), waiting_for=text(reply[2]))
    if first == _Claim.SKIP:
        return Claimed(skipped_for=text(reply[2]))
    outcome, fence, arguments = reply
    return Claimed(
        outcome=_reasserted(outcome),
        fence=int(fence) or None,
        arguments=(arguments.encode() if isinstance(arguments, str) else arguments) or None,
    )


#: The re-assert outcomes by their number: a look-up, not an enum call, per lock
#: of a heartbeat's tick.
_REASSERTED: Final = {outcome.value: outcome for outcome in Reasserted}


def _reasserted(reply: Any) -> Reasserted | str:  # noqa: ANN401 (a script's reply)
    """A re-assert's outcome for one lock: 1, 2, or the value another send holds it with."""
    return _REASSERTED[reply] if isinstance(reply, int) else text(reply)


def _finish_call(
    run: Lock, how: str, ms: int, waited_ms: int, done: Done | None
) -> tuple[list[str], list[str | int]]:
    """The keys and arguments of ``finish.lua`` that end the run holding ``run`` (see `finish`)."""
    if done is None or how != "succeeded":
        return [run.key], [run.token, how, ms, waited_ms, run.task_id]
    return [run.key, done.key], [run.token, how, ms, waited_ms, run.task_id, done.call, done.ttl_ms]


def _keys_of(lock: Lock, merge_key: str | None, fence_key: str | None) -> list[str]:
    """The keys of a script that may touch, besides the lock, its merged arguments and fence."""
    return [lock.key, *(key for key in (merge_key, fence_key) if key is not None)]


def call_timeout(client: RedisClient) -> float:
    """How long a lock call waits for its reply: the client's ``socket_timeout``."""
    if isinstance(client, RedisCluster):
        kwargs = client.nodes_manager.connection_kwargs
    else:
        kwargs = client.connection_pool.connection_kwargs
    timeout = kwargs.get("socket_timeout")
    return float(timeout) if timeout else _DEFAULT_TIMEOUT
