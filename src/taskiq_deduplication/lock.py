"""The locks in Redis: acquire, extend, re-assert and release, owner-checked in Lua.

A lock is one string key, ``<key_prefix>:<fingerprint or explicit key>``, whose
value is ``"<owner token> <task_id>"``: the token is new for every send, so a
lock can only be extended or released by the send that took it, and the
task_id names the holder in a [DuplicateTaskError][taskiq_deduplication.DuplicateTaskError].

Every script call goes through one `Pipeline` (in `pipeline.py`),
which keeps them in order and sends those issued in the same instant together.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Final

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from taskiq_deduplication.pipeline import Pipeline, ScriptCall, text

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


def new_token() -> str:
    """Make an owner token: unique per send, short, without spaces.

    64 random bits in 11 characters. With a 32-character task_id the lock's value
    is then 44 bytes, the most Redis stores inside the key's own allocation.
    """
    return secrets.token_urlsafe(8)


def holder_task_id(value: str) -> str | None:
    """The ``task_id`` in a lock's value, or ``None`` if the value is not ours."""
    token, separator, task_id = value.partition(" ")
    return task_id if separator and token else None


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
        object.__setattr__(self, "value", f"{self.token} {self.task_id}")


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
        """Register the scripts on ``client``; nothing is sent yet."""
        self._acquire = _load_script(client, "acquire")
        self._extend = _load_script(client, "extend")
        self._release = _load_script(client, "release")
        self._reassert = _load_script(client, "reassert")
        self._pipeline = Pipeline(
            client, (self._acquire, self._extend, self._release, self._reassert)
        )
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
        reply = await self._pipeline.call(
            self._acquire, [lock.key], [lock.token, lock.task_id, ttl_ms, replaces]
        )
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
        """Release ``lock`` if still owned, soon, without waiting for the reply."""
        self._pipeline.queue(self._release, [lock.key], [lock.token], f"release lock {lock.key!r}")

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
        replies = await self._pipeline.call_many(calls)
        outcomes: list[int | str] = [0] * len(locks)
        flat = (reply for chunk_replies in replies for reply in chunk_replies)
        for index, reply in zip(order, flat, strict=True):
            outcomes[index] = reply if isinstance(reply, int) else text(reply)
        return outcomes

    async def close(self) -> None:
        """Send what is queued and give the connection back; the client stays open."""
        await self._pipeline.close()
