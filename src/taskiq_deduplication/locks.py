"""The locks in Redis, for tools: read, listed and released from outside the workers.

What ``taskiq dedup`` and the pytest plugin use, and what any tool of yours may:
the lock at a key, the locks under a prefix, an owner-checked release, the key
a call would take, and the limits of runs (``limit_concurrency``,
``limit_rate``) with their use::

    async with Locks.from_url("redis://localhost:6379/0") as locks:
        async for lock in locks.scan("report-*"):
            print(lock.key, lock.holder_task_id, lock.ttl)
        lock = await locks.get("nightly-export")
        if lock is not None:
            await locks.release(lock)  # only if the same send still holds it
        for limit in await locks.limits():
            print(limit.name, limit.in_use, limit.concurrency, limit.waiting)

Locks are found with ``SCAN`` (never ``KEYS``), on every primary of a cluster,
a batch at a time, and each batch is read in one pipelined round trip (``GET``
and ``PTTL`` per key); the mechanics are in `store/scan.py`. A release is
owner-checked, as the middleware's own is, so it deletes only the lock that was
read, never one a new send took meanwhile; what belongs to the lock (the
arguments merged into its queued task) goes in the same step.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError
from taskiq.kicker import AsyncKicker

from taskiq_deduplication.exceptions import InvalidArgumentError
from taskiq_deduplication.model.formats import (
    KEY_SEPARATOR,
    RUN_MARK,
    SUCCEEDED_MARK,
    key_pattern,
    lock_key,
    lock_name,
    namespace_patterns,
    read_lock_value,
)
from taskiq_deduplication.model.limits import limit_pattern
from taskiq_deduplication.model.settings import check_prefix
from taskiq_deduplication.store import scan as inspect
from taskiq_deduplication.store.client import connect

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from types import TracebackType

    from taskiq import TaskiqMessage
    from taskiq.abc.broker import AsyncBroker

    RedisClient = Redis | RedisCluster

__all__ = ["DEFAULT_PREFIX", "SCAN_COUNT", "LimitInfo", "LockInfo", "Locks"]

#: The middleware's ``key_prefix`` unless it is given one.
DEFAULT_PREFIX: Final = "taskiq:deduplication"
#: Keys asked of each ``SCAN`` call by default: enough to cross a large keyspace
#: in few round trips, few enough that no single call holds the server up.
SCAN_COUNT: Final = 1000


@dataclass(frozen=True, slots=True)
class LockInfo:
    """One lock as Redis holds it when it was read.

    A lock records when it was taken, its policy, whether a broker accepted its
    send and, where the middleware records it (``record_task_name``), its
    task's name; never its arguments (they travel on the message). A lock taken
    by an older version records none of these: they are ``None``.
    """

    key: str
    """The lock's full Redis key, ``<key_prefix>:<name>``."""
    name: str | None
    """The key without the prefix: the call's fingerprint or the task's
    ``deduplication_key``; ``None`` for a key that is not under the prefix."""
    holder_task_id: str | None
    """The ``task_id`` of the task that holds it (what
    ``DuplicateTaskError.holder_task_id`` names); ``None`` if its value is not
    a lock of this library."""
    owner: str | None
    """The owner token: new for every send, it is what a release checks. While
    the holder of a ``"finished"`` lock runs, the token of its run."""
    ttl: float | None
    """Seconds until it expires; ``None`` if it never does, or if the Redis user
    may not run ``PTTL`` (then ``ttl_readable`` is ``False``)."""
    ttl_readable: bool
    """Whether the Redis user may run ``PTTL``, so that ``ttl`` could be read."""
    running: bool
    """Whether the holder's run goes on and holds the lock as its run slot (a
    ``"finished"`` lock of an exclusive task)."""
    succeeded: bool
    """Whether the lock is a remembered success: the run it names succeeded,
    and the lock stays for ``deduplication_success_ttl``."""
    value: str
    """The raw value, ``"<owner token> <task_id>"`` for a lock of this library
    (a token under an explicit key has a digest of the call's arguments, then
    the lock's record; a run slot that a copy of its task waits on ends with
    ``" +"``, a lock whose send is not accepted yet with ``"!"``)."""
    policy: str | None = None
    """The lock's policy: ``"finished"``, ``"started"`` or ``"expired"``."""
    taken_at: float | None = None
    """When the lock was taken, in seconds since the epoch, by the sending machine's clock."""
    age: float | None = None
    """Seconds since the lock was taken when it was read (the server's clock
    where it could be asked, else this machine's, less `taken_at`; never
    below 0 when the clocks disagree)."""
    sent: bool | None = None
    """Whether a broker has accepted the holder's send. ``False`` while its
    ``kiq`` is between taking the lock and the broker's answer, or if its
    process died there (the lock then goes with the grace TTL, 10 seconds)."""
    task_name: str | None = None
    """The holder's task name, where the middleware records it (``record_task_name``)."""


@dataclass(frozen=True, slots=True)
class LimitInfo:
    """One limit of runs (``limit_concurrency``, ``limit_rate``) as Redis holds it when it was read.

    A limit is named by its ``limit_key`` (by default its task's name); with
    ``limit_key_fields`` there is one per value of those arguments, named
    ``<limit_key>:<digest>``, never the values themselves. Redis keeps a limit
    while it is used and for two leases after (a minute by default), or as
    long as its rate remembers a start. A run whose worker died holds its
    slot, or its place in line, until its lease lapses: it is not counted here
    from then on.
    """

    name: str
    """The limit's name: its ``limit_key``, or the task's name, with the digest
    of its ``limit_key_fields``' values after a ``:``."""
    key: str
    """The Redis key of the limit's holders (``<key_prefix>#limit:{<name>}``);
    the limit's other keys are named after it."""
    concurrency: int | None
    """Its ``limit_concurrency``: at most this many runs at once; ``None`` for none."""
    rate: str | None
    """Its ``limit_rate`` as the label spells it (``"10/s"``, ``"2/5s"``); ``None`` for none."""
    in_use: int
    """The runs that hold a slot now (always 0 without ``concurrency``: a
    rate alone counts starts, not runs)."""
    waiting: int
    """The runs that wait in line for a slot now."""
    holders: tuple[str, ...]
    """The ``task_id`` of each run that holds a slot now."""


class _Task(Protocol):
    """A task (``send_invoice``) or its kicker with labels (``send_invoice.kicker()...``)."""

    task_name: str
    broker: AsyncBroker
    labels: dict[str, Any]


class Locks:
    """The locks under one key prefix, in one Redis.

    Make one on a client (``Locks(client)``), on a URL
    ([from_url][taskiq_deduplication.Locks.from_url]), or take the middleware's
    ([RedisDeduplicationMiddleware.locks][taskiq_deduplication.RedisDeduplicationMiddleware.locks]),
    which also computes the key a call would take.
    """

    def __init__(
        self,
        client: RedisClient | Callable[[], Awaitable[RedisClient]],
        *,
        prefix: str | None = None,
        key_of: Callable[[TaskiqMessage], str | None] | None = None,
    ) -> None:
        """Bind to a client and a key prefix; nothing is sent.

        Args:
            client: A ``redis.asyncio`` client (``Redis`` or ``RedisCluster``),
                which is not closed here; or an async function that returns
                the client to use, called for each operation (a middleware's
                client belongs to the running event loop).
            prefix: The middleware's ``key_prefix``; by default
                ``"taskiq:deduplication"``, the middleware's default. Left out,
                a key given to [get][taskiq_deduplication.Locks.get] may also be
                a full key under another prefix.
            key_of: What computes the key a send of a message takes: the
                middleware's own, given by its ``locks``. Without it,
                [key_for][taskiq_deduplication.Locks.key_for] cannot be used.

        Raises:
            InvalidSettingError: ``prefix`` cannot be a key prefix (a ``ValueError``).
        """
        self._prefix = DEFAULT_PREFIX if prefix is None else check_prefix(prefix)
        self._prefix_given = prefix is not None
        self._source = client
        self._key_of = key_of

    @classmethod
    def from_url(cls, url: str, *, prefix: str | None = None) -> Locks:
        """The locks in the Redis at ``url``, with a client of their own.

        It connects on first use (or on ``async with``) and is closed by
        [aclose][taskiq_deduplication.Locks.aclose] (or at the end of the
        ``async with``). The URL names the topology: ``redis://`` (or
        ``rediss://``, ``unix://``) for one server, found to be a cluster node
        if it answers ``CLUSTER SLOTS``, and
        ``redis+sentinel://[user:password@]host[:port][,host[:port]...]/service[/db]``
        for the primary that the sentinels name.

        Args:
            url: The Redis URL.
            prefix: The middleware's ``key_prefix``, as for ``Locks()``.

        Raises:
            InvalidSettingError: ``prefix`` cannot be a key prefix (a ``ValueError``).
        """
        return cls(_Connection(url), prefix=prefix)

    @property
    def prefix(self) -> str:
        """The key prefix of the locks."""
        return self._prefix

    async def __aenter__(self) -> Locks:  # noqa: PYI034 (not meant to be subclassed)
        """Connect, if the locks were made with ``from_url``.

        Raises:
            ValueError: The URL is not one this understands.
            redis.exceptions.RedisError: Redis cannot be reached.
        """
        await self._client()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close the client made by ``from_url``."""
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client made by ``from_url``; a client given is left open."""
        if isinstance(self._source, _Connection):
            await self._source.aclose()

    # Reading

    def lookup_keys(self, key: str) -> tuple[str, ...]:
        """The full keys that ``key`` may name, in the order ``get`` reads them.

        A key under the prefix, or without a ``:`` (no lock key lacks one), is a
        full key or a name under the prefix, as it reads. When no prefix was
        given, any other key may be a full key under another application's
        prefix (``DuplicateTaskError.key`` from an app with a ``key_prefix`` of
        its own) or a name that holds a ``:`` under the default prefix: both
        are read, the full key first.
        """
        head = self._prefix + KEY_SEPARATOR
        prefixed = key if key.startswith(head) else lock_key(self._prefix, key)
        either = not self._prefix_given and key != prefixed and KEY_SEPARATOR in key
        return (key, prefixed) if either else (prefixed,)

    async def get(self, key: str) -> LockInfo | None:
        """The lock at ``key`` now, or ``None`` if there is none.

        Args:
            key: A full key, as the library prints it anywhere
                (``DuplicateTaskError.key``, ``scan``, the logs), or a lock's
                name under the prefix (see
                [lookup_keys][taskiq_deduplication.Locks.lookup_keys]). Of two
                keys it may name, the one that holds a lock of this library.

        Raises:
            redis.exceptions.RedisError: Redis failed, or the Redis user may not read the key.
        """
        client = await self._client()
        first, *other = self.lookup_keys(key)
        found = [self._info(read) for read in await inspect.read_locks(client, [first])]
        if other and not any(lock.holder_task_id is not None for lock in found):
            # A key outside what the Redis user may read holds no lock of theirs.
            with contextlib.suppress(NoPermissionError):
                found += [self._info(read) for read in await inspect.read_locks(client, other)]
        ours = (lock for lock in found if lock.holder_task_id is not None)
        return next(ours, found[0] if found else None)

    async def scan(
        self, match: str = "*", *, holder_task_id: str | None = None, count: int = SCAN_COUNT
    ) -> AsyncIterator[LockInfo]:
        """Every lock under the prefix whose name matches ``match``, in no order.

        On a cluster the primaries are scanned at once; a lock may be missed or
        seen twice only if the cluster reshards meanwhile, as ``SCAN`` promises.

        Args:
            match: A glob over the lock's name (the key without the prefix), in
                Redis' glob syntax.
            holder_task_id: Only the lock this task holds.
            count: The ``COUNT`` hint of each ``SCAN`` call.

        Yields:
            The locks, each as it was read.

        Raises:
            redis.exceptions.RedisError: Redis failed, or the user may not run ``SCAN`` or ``GET``.
        """
        client = await self._client()
        pattern = key_pattern(self._prefix, match)
        async for batch in inspect.batches(client, pattern, count, inspect.read_locks):
            for read in batch:
                lock = self._info(read)
                if holder_task_id is None or lock.holder_task_id == holder_task_id:
                    yield lock

    async def page(
        self,
        match: str = "*",
        *,
        cursor: str | None = None,
        limit: int = 50,
        task_name: str | None = None,
        max_scans: int = 100,
    ) -> tuple[list[LockInfo], str | None]:
        """A page of the locks whose name matches ``match``, and the cursor of the next.

        The pages cross the keyspace as ``SCAN`` does (on a cluster, one primary
        after the other), so a large one is read a page at a time: pass the
        cursor a page returned to read the next. A page ends with the ``SCAN``
        call that brings it to ``limit`` locks, so it may hold a few more; it
        holds fewer if ``max_scans`` calls found fewer (a rare ``task_name`` in
        a large keyspace), and then the next page goes on from there.

        Args:
            match: A glob over the lock's name, as for ``scan``.
            cursor: Where to go on, as a page returned it; ``None``: from the start.
            limit: The locks a page should hold.
            task_name: Only the locks whose recorded task name is this
                (``record_task_name``); a glob in Python's ``fnmatch`` syntax.
            max_scans: The most ``SCAN`` calls a page makes.

        Returns:
            The page's locks, in no order, and the cursor of the next page
            (``None``: this was the last).

        Raises:
            InvalidArgumentError: ``cursor`` is not one a page returned, or
                ``limit`` or ``max_scans`` is below 1.
            redis.exceptions.RedisError: Redis failed, or the user may not run ``SCAN`` or ``GET``.
        """
        if limit < 1 or max_scans < 1:
            msg = f"limit={limit!r}, max_scans={max_scans!r}: both must be 1 or more"
            raise InvalidArgumentError(msg)
        client = await self._client()
        pattern = key_pattern(self._prefix, match)
        found: list[LockInfo] = []
        for _ in range(max_scans):
            keys, cursor = await inspect.scan_step(client, pattern, cursor, max(limit, 100))
            for read in await inspect.read_locks(client, keys):
                lock = self._info(read)
                if task_name is None or fnmatch.fnmatchcase(lock.task_name or "", task_name):
                    found.append(lock)
            if cursor is None or len(found) >= limit:
                break
        return found, cursor

    async def limits(self, match: str = "*", *, count: int = SCAN_COUNT) -> list[LimitInfo]:
        """Every limit of runs under the prefix whose name matches ``match``, sorted by name.

        Limits are found by their records with ``SCAN`` (on a cluster, on every
        primary), and read with plain commands (``HMGET``, ``ZRANGEBYSCORE``,
        ``ZCOUNT``), a batch in one round trip after asking the server's
        ``TIME``: a run whose lease lapsed is counted neither as a holder nor
        as waiting. Nothing is written.

        Args:
            match: A glob over the limits' names, in Python's ``fnmatch``
                syntax (``"send_email:*"``: every limit of a task keyed by its
                arguments).
            count: The ``COUNT`` hint of each ``SCAN`` call.

        Returns:
            The limits, each as it was read.

        Raises:
            redis.exceptions.RedisError: Redis failed, or the user may not run
                ``SCAN`` or read a limit's keys.
        """
        client = await self._client()
        read = functools.partial(inspect.read_limits, prefix=self._prefix, match=match)
        found = [
            LimitInfo(
                name=limit.name,
                key=limit.keys.holders,
                concurrency=limit.concurrency or None,
                rate=limit.rate or None,
                in_use=len(limit.holders),
                waiting=limit.waiting,
                holders=tuple(limit.holders),
            )
            async for batch in inspect.batches(client, limit_pattern(self._prefix), count, read)
            for limit in batch
        ]
        # On a cluster a limit seen on two primaries (a resharding) is one limit.
        return sorted({limit.name: limit for limit in found}.values(), key=lambda limit: limit.name)

    # Releasing

    async def release(self, lock: LockInfo | str, *, owner: str | None = None) -> bool:
        """Release a lock if its owner is still ``owner``, and what belongs to it.

        The owner check and the deletion are one script, as the middleware's own
        release: a lock whose task ended meanwhile, and which a new send took,
        is left to that send. The arguments merged into a queued task
        (``deduplication_merge``, ``deduplication_debounce``) go with the lock;
        the task still runs, with the arguments of its own send.

        Args:
            lock: A lock as read (``get``, ``scan``), or a key as for ``get``
                (read first).
            owner: The owner token it must still have; by default the one it
                had when it was read.

        Returns:
            Whether it was released (``False``: gone, held by another send, or
            its value is not a lock of this library).

        Raises:
            redis.exceptions.RedisError: Redis failed, or the Redis user may not run the script.
        """
        if isinstance(lock, str):
            found = await self.get(lock)
            if found is None:
                return False
            lock = found
        owner = lock.owner if owner is None else owner
        if owner is None:
            return False
        (released,) = await inspect.release(await self._client(), [(lock.key, owner)])
        return released

    async def purge(self) -> int:
        """Delete every key the library wrote under the prefix; return how many.

        The locks, the keys beside them (merged arguments, run slots, tick
        locks) and the fence counter, without owner checks: for tearing down a
        prefix that nothing uses any more (a test's, a retired application's).
        On a prefix in use it frees running tasks' locks and restarts fences.

        Raises:
            redis.exceptions.RedisError: Redis failed, or the user may not run ``SCAN`` or ``DEL``.
        """
        client = await self._client()
        primaries = client.get_primaries() if isinstance(client, RedisCluster) else [None]
        deleted = 0
        for pattern in namespace_patterns(self._prefix):
            for node in primaries:
                async for keys in inspect.scan(client, pattern, SCAN_COUNT, node):
                    # One DEL per key: on a cluster the keys of a batch span slots.
                    pipe: Any = client.pipeline(transaction=False)
                    for key in keys:
                        pipe.delete(inspect.raw(key))
                    deleted += sum(await pipe.execute())
        return deleted

    # Keys

    def key_for(self, task: _Task, /, *args: object, **kwargs: object) -> str | None:
        """The key a first ``kiq(*args, **kwargs)`` of ``task`` takes, or ``None`` for none.

        The middleware computes it, from the message exactly as ``kiq`` builds
        it, so the two cannot disagree. What ``taskiq dedup key`` prints.

        Args:
            task: The task (``send_invoice``), or a kicker with the call's labels
                (``send_invoice.kicker().with_labels(deduplication_key="k")``).
            *args: The call's positional arguments.
            **kwargs: The call's keyword arguments.

        Raises:
            InvalidArgumentError: These locks are not a middleware's (``locks``
                of the middleware computes keys).
            UnfingerprintableError: The arguments cannot be fingerprinted, as
                ``kiq`` would say.
            InvalidSettingError: A deduplication label is invalid, as ``kiq``
                would say (a ``ValueError``).
        """
        if self._key_of is None:
            msg = "key_for needs the locks of a middleware: RedisDeduplicationMiddleware.locks"
            raise InvalidArgumentError(msg)
        # The message exactly as kiq() builds it: the task's labels and the
        # call's as strings, pydantic models and dataclasses as dicts.
        kicker: AsyncKicker[..., Any] = AsyncKicker(task.task_name, task.broker, dict(task.labels))
        return self._key_of(kicker._prepare_message(*args, **kwargs))  # noqa: SLF001 (taskiq's own way to build the message kiq sends)

    def _info(self, read: inspect.Read) -> LockInfo:
        key, value, ttl, now_ms = read
        record = read_lock_value(value)
        owner = record.owner_token if record is not None else None
        taken_ms = record.taken_ms if record is not None else None
        return LockInfo(
            key=key,
            name=lock_name(self._prefix, key),
            holder_task_id=record.holder_task_id if record is not None else None,
            owner=owner,
            ttl=ttl / 1000 if ttl is not None and ttl >= 0 else None,
            ttl_readable=ttl is not None,
            running=owner is not None and owner.startswith(RUN_MARK),
            succeeded=owner is not None and owner.startswith(SUCCEEDED_MARK),
            value=value,
            policy=record.policy if record is not None else None,
            taken_at=taken_ms / 1000 if taken_ms is not None else None,
            age=max(now_ms - taken_ms, 0) / 1000 if taken_ms is not None else None,
            sent=record.sent if record is not None else None,
            task_name=record.task_name if record is not None else None,
        )

    async def _client(self) -> RedisClient:
        if isinstance(self._source, (Redis, RedisCluster)):
            return self._source
        return await self._source()


class _Connection:
    """The client of locks made from a URL: connected on first use, once."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._client: RedisClient | None = None
        self._connecting = asyncio.Lock()

    async def __call__(self) -> RedisClient:
        async with self._connecting:
            if self._client is None:
                self._client = await connect(self._url)
            return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
