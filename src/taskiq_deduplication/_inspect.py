"""The locks as an operator sees them: found, read and released from outside the workers.

What the ``taskiq dedup`` command does in Redis. Locks are found with ``SCAN``
(never ``KEYS``), on every primary of a cluster, a batch at a time, and each
batch is read in one pipelined round trip (``GET`` and ``PTTL`` per key). A
release is owner-checked, as the middleware's own is, so it deletes only the
lock that was shown, never one a new send took meanwhile; what belongs to the
lock (the arguments merged into its queued task) goes in the same step.

A URL names the topology: ``redis://`` (or ``rediss://``, ``unix://``) for one
server, found to be a cluster node if it answers ``CLUSTER SLOTS``, and
``redis+sentinel://`` for the primary that sentinels name.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.crc import key_slot
from redis.exceptions import NoPermissionError, ResponseError

from taskiq_deduplication._client import DEFAULT_TIMEOUTS, client_from_url
from taskiq_deduplication._formats import belonging_keys, lock_name, read_lock_value

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from redis.asyncio import Redis

    RedisClient = Redis | RedisCluster

#: The URL scheme of a primary found through Sentinel.
SENTINEL_SCHEME: Final = "redis+sentinel"
_SENTINEL_PORT: Final = 26379
#: Keys asked of each ``SCAN`` call: enough to cross a large keyspace in few round
#: trips, few enough that no single call holds the server up.
SCAN_COUNT: Final = 1000
# Keys whose locks are read (and released) in one pipelined round trip.
_BATCH: Final = 1000
_TIMEOUT: Final = DEFAULT_TIMEOUTS["socket_timeout"]
# What PTTL answers for a key that does not exist.
_NO_SUCH_KEY: Final = -2
_CLIENT_TIMEOUTS: Final = {
    name: seconds for name, seconds in DEFAULT_TIMEOUTS.items() if name != "timeout"
}


@dataclass(frozen=True, slots=True)
class HeldLock:
    """One lock as Redis holds it now."""

    key: str
    """The lock's Redis key."""
    name: str | None
    """The key without the prefix: the call's fingerprint or the task's explicit key."""
    holder_task_id: str | None
    """The ``task_id`` of the task that holds it, ``None`` if its value is not a lock's."""
    owner_token: str | None
    """The token of the send that took it."""
    ttl_ms: int | None
    """Milliseconds until it expires; ``None`` if it has no TTL or the user may not ask."""
    value: str
    """The raw value, ``"<owner token> <task_id>"`` for a lock of this library."""
    task_name: str | None = None
    """The holder's task name, where the lock records it."""
    policy: str | None = None
    """The lock's policy, where the lock records it (not a lock of an older version)."""
    age_ms: int | None = None
    """Milliseconds since the lock was taken (server time), where it records that."""
    sent: bool | None = None
    """Whether a broker accepted the holder's send; ``None``: the lock does not say."""

    def as_dict(self) -> dict[str, Any]:
        """The lock as the JSON output shows it (a record's fields only where it has one)."""
        shown: dict[str, Any] = {
            "key": self.key,
            "name": self.name,
            "holder_task_id": self.holder_task_id,
            "owner_token": self.owner_token,
            "ttl_ms": self.ttl_ms,
        }
        if self.policy is not None:
            shown |= {
                "task_name": self.task_name,
                "policy": self.policy,
                "age_ms": self.age_ms,
                "sent": self.sent,
            }
        return shown


@dataclass
class Reading:
    """What reading locks found besides the locks: what the Redis user may not see."""

    ttl_denied: bool = False


def redacted(url: str) -> str:
    """``url`` with its password replaced, fit to print."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


async def connect(url: str) -> RedisClient:
    """A client for the topology ``url`` names, connected and checked with one call.

    Raises:
        ValueError: ``url`` is not a URL this command understands.
        redis.exceptions.RedisError: Redis cannot be reached.
    """
    if urlsplit(url).scheme == SENTINEL_SCHEME:
        client: RedisClient = _sentinel_client(url)
        await client.ping()
        return client
    single = client_from_url(url)
    untyped: Any = single  # redis-py leaves execute_command unannotated
    try:
        await untyped.execute_command("CLUSTER", "SLOTS")
    except NoPermissionError:
        # A user without cluster commands cannot use a cluster client either.
        return single
    except ResponseError:  # "cluster support disabled": one server
        return single
    except BaseException:
        await single.aclose()
        raise
    await single.aclose()
    cluster = RedisCluster.from_url(url, **_CLIENT_TIMEOUTS)
    await cluster.initialize()
    return cluster


def _sentinel_client(url: str) -> Redis:
    """``redis+sentinel://[user:password@]host[:port][,host[:port]...]/service[/db]``."""
    parts = urlsplit(url)
    credentials, _, hosts = parts.netloc.rpartition("@")
    path = [segment for segment in parts.path.split("/") if segment]
    if not hosts or not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):  # noqa: PLR2004 (service and db)
        msg = f"expected {SENTINEL_SCHEME}://host:port[,host:port...]/service[/db]"
        raise ValueError(msg)
    addresses = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":") if ":" in address else (address, "", "")
        if port and not port.isdigit():
            msg = f"bad port in sentinel address {address!r}"
            raise ValueError(msg)
        addresses.append((host, int(port) if port else _SENTINEL_PORT))
    user, _, password = credentials.partition(":")
    sentinels = Sentinel(addresses, socket_timeout=_TIMEOUT)  # type: ignore[no-untyped-call]
    primary: Redis = sentinels.master_for(
        unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,  # noqa: PLR2004
        username=unquote(user) or None,
        password=unquote(password) or None,
        socket_timeout=_TIMEOUT,
        socket_connect_timeout=_TIMEOUT,
    )
    return primary


async def lock_batches(
    client: RedisClient, pattern: str, prefix: str, reading: Reading
) -> AsyncIterator[list[HeldLock]]:
    """The locks whose keys match ``pattern``, a batch at a time, from every primary.

    On a cluster the primaries are scanned at once; a key may be missed or
    seen twice only if the cluster reshards meanwhile, as ``SCAN`` promises.
    """
    if not isinstance(client, RedisCluster):
        async for keys in _scan(client, pattern):
            yield await read_locks(client, keys, prefix, reading)
        return
    queue: asyncio.Queue[list[HeldLock] | BaseException | None] = asyncio.Queue(maxsize=4)

    async def scan_node(node: ClusterNode) -> None:
        async for keys in _scan(client, pattern, node):
            await queue.put(await read_locks(client, keys, prefix, reading))

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


async def _scan(
    client: RedisClient, pattern: str, node: ClusterNode | None = None
) -> AsyncIterator[list[str]]:
    cursor = 0
    while True:
        if node is None:
            reply: Any = await client.scan(cursor, match=pattern, count=SCAN_COUNT)
            cursor, keys = reply
        else:
            reply = await client.scan(cursor, match=pattern, count=SCAN_COUNT, target_nodes=node)
            cursors, keys = reply
            cursor = cursors[node.name]
        if keys:
            yield [_text(key) for key in keys]
        if int(cursor) == 0:
            return


async def read_locks(
    client: RedisClient, keys: Sequence[str], prefix: str, reading: Reading
) -> list[HeldLock]:
    """Read the locks at ``keys`` in one round trip per batch; keys that hold none are left out."""
    found: list[HeldLock] = []
    for start in range(0, len(keys), _BATCH):
        batch = keys[start : start + _BATCH]
        pipe: Any = client.pipeline(transaction=False)
        for key in batch:
            pipe.get(_raw(key))
            pipe.pttl(_raw(key))
        # The clock the locks' records were written by, for their age (on a
        # cluster, whose pipelines route by key, and for a user without TIME:
        # this machine's).
        cluster = isinstance(client, RedisCluster)
        if not cluster:
            pipe.time()
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        now = None if cluster else replies.pop()
        now_ms = (
            now[0] * 1000 + now[1] // 1000 if isinstance(now, tuple) else int(time.time() * 1000)
        )
        for index, key in enumerate(batch):
            value, ttl = replies[2 * index], replies[2 * index + 1]
            if isinstance(value, NoPermissionError) or isinstance(ttl, NoPermissionError):
                if isinstance(value, NoPermissionError):
                    raise value
                reading.ttl_denied = True
                ttl = None
            if value is None or isinstance(value, BaseException):
                continue  # gone since the scan, or not a string: no lock of ours
            found.append(_held(key, _text(value), ttl, prefix, now_ms))
    return found


def _held(key: str, value: str, ttl: int | None, prefix: str, now_ms: int) -> HeldLock:
    record = read_lock_value(value)
    taken = record.taken_ms if record is not None else None
    return HeldLock(
        key=key,
        name=lock_name(prefix, key),
        holder_task_id=record.holder_task_id if record is not None else None,
        owner_token=record.owner_token if record is not None else None,
        ttl_ms=ttl if ttl is not None and ttl >= 0 else None,
        value=value,
        task_name=record.task_name if record is not None else None,
        policy=record.policy if record is not None else None,
        age_ms=max(now_ms - taken, 0) if taken is not None else None,
        sent=record.sent if record is not None else None,
    )


async def release(client: RedisClient, locks: Sequence[HeldLock]) -> list[bool]:
    """Release each of ``locks`` if the send that held it when it was read still does.

    What belongs to a lock (its merged arguments) is deleted with it, in the
    same owner-checked step. Those keys are found first, one round trip per
    batch, and only those found are named to the script: a key that a Redis
    user may not touch would fail the whole script. Nothing can add one to a
    lock whose owner is unchanged (a send takes its lock and merge key at once),
    so what was found is what belongs to the lock when it is released.

    Returns:
        For each lock, whether it was released (``False``: gone, or taken by
        another send since it was read).
    """
    # Only here: the lock store (and its pipeline) is not needed to read locks.
    from taskiq_deduplication._store import load_script  # noqa: PLC0415

    script = load_script(client, "release_with")
    released: list[bool] = []
    for start in range(0, len(locks), _BATCH):
        batch = locks[start : start + _BATCH]
        belonging = await _belonging(client, batch)
        # One call at a time through the script object keeps its EVALSHA-then-load
        # fallback; gathered, they share the client's connections.
        replies = await asyncio.gather(
            *(
                script(keys=[_raw(lock.key), *keys], args=[lock.owner_token or ""])
                for lock, keys in zip(batch, belonging, strict=True)
            )
        )
        released += [int(reply) == 1 for reply in replies]
    return released


async def _belonging(client: RedisClient, locks: Sequence[HeldLock]) -> list[list[bytes]]:
    """For each lock, the keys that belong to it and exist now: one round trip.

    Each is asked with ``PTTL`` (-2: no such key), which the operator's Redis
    user may run already; one it may not read is left out. On a cluster only
    those in the lock's slot can exist: a lock and its merge key are taken by
    one script.
    """
    cluster = isinstance(client, RedisCluster)
    candidates: list[list[bytes]] = []
    for lock in locks:
        keys = [_raw(key) for key in belonging_keys(lock.key)]
        if cluster:
            slot = key_slot(_raw(lock.key))
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


def _text(value: bytes | str) -> str:
    """A reply as text: a key that is not UTF-8 keeps its bytes, escaped."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def _raw(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")
