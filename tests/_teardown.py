"""What a fixture hands its test and ends afterwards, whatever happened in the test.

``owned`` ends anything (a server, a Cluster, the plugin's helper); ``closed_after``
ends a Redis client, deleting the test's keys through it first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import redis.asyncio
from redis.asyncio.cluster import RedisCluster

ThingT = TypeVar("ThingT")


def owned(thing: ThingT, end: Callable[[ThingT], object]) -> Iterator[ThingT]:
    """Yield ``thing`` to a fixture's test, and ``end`` it afterwards whatever happened.

    A fixture that starts something writes ``yield from owned(started, stop)``.
    """
    try:
        yield thing
    finally:
        end(thing)


ClientT = TypeVar("ClientT", redis.asyncio.Redis, RedisCluster)


async def closed_after(client: ClientT, prefix: str) -> AsyncIterator[ClientT]:
    """Yield ``client``; then delete the keys under ``prefix`` through it and close it."""
    try:
        yield client
    finally:
        await delete_keys(client, prefix)
        await client.aclose()


async def delete_keys(client: redis.asyncio.Redis | RedisCluster, prefix: str) -> None:
    """Delete the locks under ``prefix`` (bare or hash-tagged) and the keys beside them.

    Beside them: merged arguments, run slots, the fence counter.
    """
    for under in (prefix, f"{{{prefix}}}"):
        keys = [key async for key in client.scan_iter(match=f"{under}[:#]*")]
        if keys:
            await client.delete(*keys)
