"""The locks as a tool finds them in Redis: scanned, read and released a batch at a time.

The mechanics under [Locks][taskiq_deduplication.Locks]. Keys are found with
``SCAN`` (never ``KEYS``), on every primary of a cluster, and each batch is read
in one pipelined round trip (``GET`` and ``PTTL`` per key). A release is
owner-checked, as the middleware's own is; what belongs to the lock (the
arguments merged into its queued task) goes in the same step. The limits
(``limit_concurrency``, ``limit_rate``) are found and read the same way, by
their records, with plain reads only: nothing here runs ``limit.lua``.

And a tool's user names a task as they know it: by the name taskiq gave it
(``module:function``), or by its function's name alone.
"""

from __future__ import annotations

import asyncio
import fnmatch
import re
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoPermissionError

from taskiq_deduplication.exceptions import InvalidArgumentError, InvalidSettingError
from taskiq_deduplication.model.formats import belonging_keys
from taskiq_deduplication.model.limits import LimitKeys, limit_keys, limit_name

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

    from redis.asyncio import Redis
    from taskiq import AsyncBroker, AsyncTaskiqDecoratedTask

    RedisClient = Redis | RedisCluster

# Keys whose locks are read (and released) in one pipelined round trip.
_BATCH: Final = 1000
# What PTTL answers for a key that does not exist.
_NO_SUCH_KEY: Final = -2


class Read(NamedTuple):
    """A key that holds a string, as it was read."""

    key: str
    value: str
    pttl: int | None
    """What ``PTTL`` answered (-1: no expiry), ``None`` if the Redis user may not run it."""
    now_ms: int
    """The time it was read, in milliseconds since the epoch: the server's (the
    clock that the lock's record was written by) where a plain pipeline can ask
    it, else this machine's (a cluster, or a Redis user without ``TIME``)."""


ReadT = TypeVar("ReadT")


class LimitRead(NamedTuple):
    """A limit as it was read by its record: who holds its slots, and how many wait, now."""

    name: str
    keys: LimitKeys
    concurrency: int
    """Its ``limit_concurrency``; 0 for none."""
    rate: str
    """Its ``limit_rate`` as the label spelt it; ``""`` for none."""
    holders: list[str]
    """The task ids of the runs that hold a slot and whose lease has not lapsed."""
    waiting: int
    """The runs that wait in line for a slot and whose lease has not lapsed."""


async def batches(
    client: RedisClient,
    pattern: str,
    count: int,
    read: Callable[[RedisClient, Sequence[str]], Awaitable[list[ReadT]]],
) -> AsyncIterator[list[ReadT]]:
    """What ``read`` makes of the keys that match ``pattern``, a batch at a time.

    ``read`` is `read_locks` or `read_limits`, given each batch of keys that one
    ``SCAN`` call found. On a cluster every primary is scanned, all at once; a
    key may be missed or seen twice only if the cluster reshards meanwhile, as
    ``SCAN`` promises.
    """
    if not isinstance(client, RedisCluster):
        async for keys in scan(client, pattern, count):
            yield await read(client, keys)
        return
    queue: asyncio.Queue[list[ReadT] | BaseException | None] = asyncio.Queue(maxsize=4)

    async def scan_node(node: ClusterNode) -> None:
        async for keys in scan(client, pattern, count, node):
            await queue.put(await read(client, keys))

    async def scan_all() -> None:
        try:
            await asyncio.gather(*(scan_node(node) for node in client.get_primaries()))
        except Exception as exc:  # noqa: BLE001 (handed to the reader, raised there)
            await queue.put(exc)
        else:
            await queue.put(None)

    scanning = asyncio.ensure_future(scan_all())
    try:
        while (batch := await queue.get()) is not None:
            if isinstance(batch, BaseException):
                raise batch
            yield batch
    finally:
        scanning.cancel()
        await asyncio.gather(scanning, return_exceptions=True)


async def scan(
    client: RedisClient, pattern: str, count: int, node: ClusterNode | None = None
) -> AsyncIterator[list[str]]:
    """The keys that match ``pattern`` on one server (or cluster ``node``), a ``SCAN`` at a time."""
    cursor = 0
    while True:
        if node is None:
            reply: Any = await client.scan(cursor, match=pattern, count=count)
            cursor, keys = reply
        else:
            reply = await client.scan(cursor, match=pattern, count=count, target_nodes=node)
            cursors, keys = reply
            cursor = cursors[node.name]
        if keys:
            yield [text(key) for key in keys]
        if int(cursor) == 0:
            return


async def scan_step(
    client: RedisClient, pattern: str, position: str | None, count: int
) -> tuple[list[str], str | None]:
    """One ``SCAN`` call from ``position``: the keys it found and the position after it.

    A position is the server's cursor, or on a cluster ``"<primary>@<cursor>"``,
    the primaries scanned one after the other in the order of their names;
    ``None`` is the start, and the position after the last call is ``None`` too.

    Raises:
        InvalidArgumentError: ``position`` is not one a scan step returned, or
            names a node that is no longer a primary of the cluster.
    """
    if not isinstance(client, RedisCluster):
        start = _cursor(position or "0", position)
        cursor, keys = await client.scan(start, match=pattern, count=count)
        return [text(key) for key in keys], (str(cursor) if int(cursor) else None)
    nodes = sorted(client.get_primaries(), key=lambda node: node.name)
    names = [node.name for node in nodes]
    name, at, cursor_text = (position or f"{names[0]}@0").rpartition("@")
    if not at or name not in names:
        msg = f"cursor {position!r}: names no primary of the cluster now (start again)"
        raise InvalidArgumentError(msg)
    index = names.index(name)
    node = nodes[index]
    reply: Any = await client.scan(
        _cursor(cursor_text, position), match=pattern, count=count, target_nodes=node
    )
    cursors, keys = reply
    cursor = int(cursors[node.name])
    if cursor == 0:
        index, cursor = index + 1, 0
    after = f"{names[index]}@{cursor}" if index < len(names) else None
    return [text(key) for key in keys], after


def _cursor(digits: str, position: str | None) -> int:
    # A SCAN cursor is an unsigned 64-bit number: at most 20 digits.
    if not digits.isdigit() or not digits.isascii() or len(digits) > 20:  # noqa: PLR2004
        msg = f"cursor {position!r}: not one that a page of locks returned"
        raise InvalidArgumentError(msg)
    return int(digits)


async def read_locks(client: RedisClient, keys: Sequence[str]) -> list[Read]:
    """Read the locks at ``keys`` in one round trip per batch; keys that hold none are left out.

    Raises:
        redis.exceptions.NoPermissionError: The Redis user may not read a key.
    """
    found: list[Read] = []
    for start in range(0, len(keys), _BATCH):
        batch = keys[start : start + _BATCH]
        pipe: Any = client.pipeline(transaction=False)
        for key in batch:
            pipe.get(raw(key))
            pipe.pttl(raw(key))
        cluster = isinstance(client, RedisCluster)  # its pipelines route by key
        if not cluster:
            pipe.time()
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        now = None if cluster else replies.pop()
        now_ms = (
            now[0] * 1000 + now[1] // 1000 if isinstance(now, tuple) else int(time.time() * 1000)
        )
        for index, key in enumerate(batch):
            value, ttl = replies[2 * index], replies[2 * index + 1]
            if isinstance(value, NoPermissionError):
                raise value
            if value is None or isinstance(value, BaseException):
                continue  # gone since the scan, or not a string: no lock of ours
            readable = not isinstance(ttl, NoPermissionError)
            found.append(Read(key, text(value), ttl if readable else None, now_ms))
    return found


async def read_limits(
    client: RedisClient, records: Sequence[str], prefix: str, match: str = "*"
) -> list[LimitRead]:
    """Read the limits whose records are ``records``, if their names match ``match``.

    One round trip for the server's time (the clock the leases are set by) and
    one for the limits, per batch. A holder or a waiter whose lease lapsed (its
    worker died; the limit's script deletes it at its next call) is not
    counted. A key that is no limit's record, and a limit gone since the scan,
    are left out.

    Args:
        client: The Redis client.
        records: Keys found with ``limit_pattern(prefix)``.
        prefix: The key prefix they are under.
        match: A glob over the limits' names, in Python's ``fnmatch`` syntax.

    Raises:
        redis.exceptions.NoPermissionError: The Redis user may not read a limit's keys.
    """
    named = [
        (name, limit_keys(prefix, name))
        for record in records
        if (name := limit_name(prefix, record)) is not None and fnmatch.fnmatchcase(name, match)
    ]
    found: list[LimitRead] = []
    for start in range(0, len(named), _BATCH):
        batch = named[start : start + _BATCH]
        after = f"({await _now_us(client, batch[0][1].holders)}"  # a lease that ends now lapsed
        pipe: Any = client.pipeline(transaction=False)
        for _, keys in batch:
            pipe.hmget(raw(keys.meta), ["n", "rate"])
            pipe.zrangebyscore(raw(keys.holders), after, "+inf")
            pipe.zcount(raw(keys.leases), after, "+inf")
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        for index, (name, keys) in enumerate(batch):
            answers = replies[3 * index : 3 * index + 3]
            for answer in answers:
                if isinstance(answer, NoPermissionError):
                    raise answer
            record, holders, waiting = answers
            if any(isinstance(answer, BaseException) for answer in answers) or record[0] is None:
                continue  # gone since the scan, or not a limit's keys
            concurrency, rate = (text(value or b"") for value in record)
            found.append(
                LimitRead(
                    name,
                    keys,
                    int(concurrency) if concurrency.isdigit() else 0,
                    rate,
                    [text(holder) for holder in holders],
                    int(waiting),
                )
            )
    return found


async def _now_us(client: RedisClient, key: str) -> int:
    """The time of the server that holds ``key``, in microseconds; else this machine's.

    The leases of a limit are set by its server's clock (``TIME`` in its
    script). This machine's stands in where the Redis user may not run ``TIME``.
    """
    try:
        if isinstance(client, RedisCluster):
            reply: Any = await client.time(target_nodes=client.get_node_from_key(key))
        else:
            reply = await client.time()
    except NoPermissionError:
        return time.time_ns() // 1000
    seconds, micros = reply
    return int(seconds) * 1_000_000 + int(micros)


async def release(client: RedisClient, locks: Sequence[tuple[str, str]]) -> list[bool]:
    """Release each lock ``(key, owner)`` if its owner is still ``owner``.

    What belongs to a lock (its merged arguments) is deleted with it, in the
    same owner-checked step. Those keys are found first, one round trip per
    batch, and only those found are named to the script: a key that a Redis
    user may not touch would fail the whole script. Nothing can add one to a
    lock whose owner is unchanged (a send takes its lock and merge key at once),
    so what was found is what belongs to the lock when it is released.
    """
    # Only here: the lock store (and its pipeline) is not needed to read locks.
    from taskiq_deduplication.store.lock_store import load_script  # noqa: PLC0415

    script = load_script(client, "release_with")
    released: list[bool] = []
    for start in range(0, len(locks), _BATCH):
        batch = locks[start : start + _BATCH]
        belonging = await _belonging(client, [key for key, _ in batch])
        # One call at a time through the script object keeps its EVALSHA-then-load
        # fallback; gathered, they share the client's connections.
        replies = await asyncio.gather(
            *(
                script(keys=[raw(key), *keys], args=[owner])
                for (key, owner), keys in zip(batch, belonging, strict=True)
            )
        )
        released += [int(reply) == 1 for reply in replies]
    return released


async def _belonging(client: RedisClient, locks: Sequence[str]) -> list[list[bytes]]:
    """For each lock key, the keys that belong to it and exist now: one round trip.

    Each is asked with ``PTTL`` (-2: no such key), which the operator's Redis
    user may run already; one it may not read is left out. On a cluster only
    those in the lock's slot can exist: a lock and its merge key are taken by
    one script.
    """
    cluster = isinstance(client, RedisCluster)
    candidates: list[list[bytes]] = []
    for lock in locks:
        keys = [raw(key) for key in belonging_keys(lock)]
        if cluster:
            slot = key_slot(raw(lock))
            keys = [key for key in keys if key_slot(key) == slot]
        candidates.append(keys)
    if not any(candidates):
        return candidates
    pipe: Any = client.pipeline(transaction=False)
    for keys in candidates:
        for key in keys:
            pipe.pttl(key)
    replies = iter(await pipe.execute(raise_on_error=False))
    found: list[list[bytes]] = []
    for keys in candidates:
        ttls = [next(replies) for _ in keys]
        found.append(
            [
                key
                for key, ttl in zip(keys, ttls, strict=True)
                if isinstance(ttl, int) and ttl != _NO_SUCH_KEY
            ]
        )
    return found


def text(value: bytes | str) -> str:
    """A reply as text: a key that is not UTF-8 keeps its bytes, escaped."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def raw(key: str) -> bytes:
    """The bytes of ``key`` as Redis has them (what `text` decoded)."""
    return key.encode("utf-8", "surrogateescape")


def find_task(broker: AsyncBroker, name: str) -> AsyncTaskiqDecoratedTask[Any, Any] | None:
    """The task of ``broker`` that ``name`` names, ``None`` if it names none.

    ``name`` is a task's full name, or the part of one after its last ``:`` or
    ``.``: the function's name, of a task that taskiq named ``module:function``.

    Raises:
        InvalidSettingError: ``name`` is the function's name of several tasks
            (the message lists their full names).
    """
    task = broker.find_task(name)
    if task is not None or not name:
        return task
    tasks = broker.get_all_tasks()
    named = sorted(full for full in tasks if re.split("[:.]", full)[-1] == name)
    if len(named) > 1:
        msg = f"{name!r} names {len(named)} tasks: {', '.join(named)}; give the full name"
        raise InvalidSettingError(msg)
    return tasks[named[0]] if named else None
