"""The locks in Redis: acquire, extend, re-assert and release, owner-checked in Lua.

The key and value formats are those of `_formats.py`: the owner token in the
value is new for every send, so a lock can only be extended or released by the
send that took it.

Every script call goes through one `Pipeline` (in `pipeline.py`),
which keeps them in order and sends those issued in the same instant together.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Final

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from taskiq_deduplication._formats import lock_value
from taskiq_deduplication._pipeline import (
    MAX_QUEUED,
    CallTimeoutError,
    Pipeline,
    ScriptCall,
    text,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

    RedisClient = Redis | RedisCluster

#: The errors that mean "Redis could not be reached or did not answer". A cluster
#: client that reaches no node raises RedisClusterException, which is no RedisError.
REDIS_ERRORS: Final = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)

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
    """The lock's value in Redis: ``"<owner token> <task_id>"``."""

    def __post_init__(self) -> None:
        """Compute the value once: a heartbeat tick sends it for every running task."""
        object.__setattr__(self, "value", lock_value(self.token, self.task_id))


class Reasserted:
    """Outcomes of a re-assert, besides the holder's value when someone else has it."""

    REFRESHED: Final = 1
    TAKEN_BACK: Final = 2


def _load_script(client: RedisClient, name: str) -> AsyncScript:
    source = resources.files(__package__).joinpath(f"lua/{name}.lua").read_text("utf-8")
    return client.register_script(source)


class LockStore:
    """The lock operations, each one owner-checked Lua script, sent in batches."""

    def __init__(self, client: RedisClient) -> None:
        """Register the scripts on ``client``; nothing is sent yet.

        Every call waits for its reply at most the client's ``socket_timeout``
        (5 seconds if it has none), counted from the moment it is made.
        """
        self._acquire = _load_script(client, "acquire")
        self._extend = _load_script(client, "extend")
        self._release = _load_script(client, "release")
        self._reassert = _load_script(client, "reassert")
        self._pipeline = Pipeline(
            client,
            (self._acquire, self._extend, self._release, self._reassert),
            timeout=call_timeout(client),
            detached_timeout=_DETACHED_TIMEOUT,
        )
        # Owner tokens of acquires that timed out before they were sent: they
        # never ran, so the release that would undo one has nothing to undo.
        self._never_sent: dict[str, None] = {}
        # A multi-key script must stay in one hash slot on a cluster.
        self._keys_per_reassert = 1 if isinstance(client, RedisCluster) else _MAX_KEYS_PER_REASSERT

    async def load_scripts(self) -> None:
        """Load the scripts into the server, so the first calls need no fallback."""
        await self._pipeline.load_scripts()

    async def acquire(self, lock: Lock, ttl_ms: int, replaces: str = "") -> str | None:
        """Take ``lock`` for ``ttl_ms`` milliseconds.

        Args:
            lock: The lock to take.
            ttl_ms: Its TTL for now (the grace TTL of a send in flight).
            replaces: The value of a lock this one may take over (the lock of the
                attempt a retry re-sends), or ``""``.

        Returns:
            ``None`` when the lock is taken, else the value of the current holder.
        """
        try:
            reply = await self._pipeline.call(
                self._acquire, [lock.key], [lock.token, lock.task_id, ttl_ms, replaces]
            )
        except CallTimeoutError as exc:
            if not exc.sent:
                if len(self._never_sent) >= MAX_QUEUED:  # nobody undid the oldest
                    del self._never_sent[next(iter(self._never_sent))]
                self._never_sent[lock.token] = None
            raise
        return None if reply is None else text(reply)

    async def extend_detached(self, lock: Lock) -> None:
        """Give ``lock`` its full TTL if still owned, without waiting for the reply.

        The command is on its way to Redis when this returns (when the pipeline
        is idle), so it is not lost if the process ends right after a ``kiq``.
        """
        await self._pipeline.send_ahead(
            self._extend, [lock.key], [lock.token, lock.ttl_ms], f"extend lock {lock.key!r}"
        )

    def release_detached(self, lock: Lock) -> None:
        """Release ``lock`` if still owned, soon, without waiting for the reply.

        Nothing is sent when it would undo an acquire that never left this
        process (one that timed out in the queue during an outage): after an
        outage, Redis gets only the releases that can matter.
        """
        if lock.token in self._never_sent:
            del self._never_sent[lock.token]
            return
        self._pipeline.queue(self._release, [lock.key], [lock.token], f"release lock {lock.key!r}")

    async def extend(self, lock: Lock, ttl_ms: int) -> bool:
        """Give ``lock`` a TTL of ``ttl_ms`` if still owned; return whether it was."""
        return bool(await self._pipeline.call(self._extend, [lock.key], [lock.token, ttl_ms]))

    async def release(self, lock: Lock) -> bool:
        """Release ``lock`` if still owned; return whether it was."""
        return bool(await self._pipeline.call(self._release, [lock.key], [lock.token]))

    async def reassert(self, locks: Sequence[Lock]) -> list[int | str]:
        """Refresh each lock still owned, take back each that vanished.

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
        if len(calls) == 1:  # a run that begins: no futures to gather
            replies = [await self._pipeline.call(*calls[0])]
        else:
            replies = await self._pipeline.call_many(calls)
        outcomes: list[int | str] = [0] * len(locks)
        flat = (reply for chunk_replies in replies for reply in chunk_replies)
        for index, reply in zip(order, flat, strict=True):
            outcomes[index] = reply if isinstance(reply, int) else text(reply)
        return outcomes

    @property
    def backlog(self) -> int:
        """The number of lock calls waiting to be sent to Redis."""
        return self._pipeline.queued

    async def close(self) -> None:
        """Send what is queued and give the connection back; the client stays open."""
        await self._pipeline.close()


def call_timeout(client: RedisClient) -> float:
    """How long a lock call waits for its reply: the client's ``socket_timeout``."""
    if isinstance(client, RedisCluster):
        kwargs = client.nodes_manager.connection_kwargs
    else:
        kwargs = client.connection_pool.connection_kwargs
    timeout = kwargs.get("socket_timeout")
    return float(timeout) if timeout else _DEFAULT_TIMEOUT
