"""What a test reads of its locks in Redis, and ``wait_until``, to wait for them to change.

(``wait_until`` polls any condition: a lock taken or gone, a run begun, a log line.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import redis.asyncio

from taskiq_deduplication.store.call import RedisFailed
from taskiq_deduplication.store.lock_store import LockStore

_Key = TypeVar("_Key", bound=str | bytes)
_Outcome = TypeVar("_Outcome")


def answered(outcome: _Outcome | RedisFailed) -> _Outcome:
    """A lock operation's outcome, asserting that Redis answered it (not `RedisFailed`)."""
    assert not isinstance(outcome, RedisFailed), f"Redis did not answer: {outcome.error!r}"
    return outcome


async def ready(store: LockStore) -> LockStore:
    """``store``, its scripts loaded into Redis (asserting that Redis answered)."""
    failed = await store.check()
    assert failed is None, f"Redis did not answer: {failed.error!r}"
    return store


async def lock_keys(client: redis.asyncio.Redis, prefix: str) -> list[str]:
    """The lock keys under ``prefix``, sorted."""
    return sorted([key async for key in client.scan_iter(match=f"{prefix}:*")])


async def scripts_run(client: redis.asyncio.Redis) -> int:
    """Lock scripts Redis ran since the last ``CONFIG RESETSTAT``, by SHA or by body."""
    stats = await client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


async def lock_value(client: redis.asyncio.Redis, key: str) -> str:
    """The value of a lock, ``"<owner token> <task_id>"``; fails if there is none."""
    value = await client.get(key)
    assert isinstance(value, str), f"no lock at {key!r}"
    return value


def without_done(keys: Iterable[_Key]) -> list[_Key]:
    """``keys`` less the calls remembered for copies of their messages (``<prefix>#done:*``).

    A run that succeeds leaves one, which expires with the redelivery window:
    the one thing a run leaves behind on purpose (`test_runs_once.py` checks it).
    """
    mark = "#done:"
    return [key for key in keys if mark not in (key.decode() if isinstance(key, bytes) else key)]


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        if loop.time() > deadline:
            msg = f"condition not met within {timeout}s"
            raise AssertionError(msg)
        await asyncio.sleep(0.02)
