"""Building the client for each topology: one server, a Redis Cluster, Sentinel.

Only the single-server client is used here (against ``REDIS_URL``); the cluster
and Sentinel ones are built the same way and tried for real by the suite's
topology tests (``tests/topologies``). Building a client does not connect yet.
"""

import asyncio
import os
import uuid

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")


def single_server() -> RedisDeduplicationMiddleware:
    # --8<-- [start:single]
    return RedisDeduplicationMiddleware(redis_url=REDIS_URL)
    # --8<-- [end:single]


def cluster() -> RedisDeduplicationMiddleware:
    # --8<-- [start:cluster]
    # Any one node's URL: the client learns the others and who owns which slot.
    client = RedisCluster.from_url(
        "redis://cache-node-1:6379", socket_timeout=5, socket_connect_timeout=5
    )
    return RedisDeduplicationMiddleware(client=client)
    # --8<-- [end:cluster]


def sentinel() -> RedisDeduplicationMiddleware:
    # --8<-- [start:sentinel]
    sentinels = Sentinel(
        [("sentinel-1", 26379), ("sentinel-2", 26379), ("sentinel-3", 26379)],
        socket_timeout=1,
    )
    # A client of whichever server the sentinels name as primary right now.
    client = sentinels.master_for("mymaster", socket_timeout=5, socket_connect_timeout=5)
    return RedisDeduplicationMiddleware(client=client)
    # --8<-- [end:sentinel]


async def main() -> None:
    for build in (cluster, sentinel):
        print(f"{build.__name__}: {type(build()).__name__} built")
    middleware = single_server()
    middleware.key_prefix = f"deploy-{uuid.uuid4().hex}"
    broker = InMemoryBroker().with_middlewares(middleware)

    @broker.task
    async def ping() -> str:
        return "pong"

    await broker.startup()
    print((await (await ping.kiq()).wait_result(timeout=5)).return_value)
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
