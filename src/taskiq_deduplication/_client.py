"""Building the Redis client of an event loop from the ``redis_url`` option."""

from __future__ import annotations

from typing import Final

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

#: Bounds on every Redis call of a client built from ``redis_url`` (seconds);
#: a URL query such as ``?socket_timeout=1`` overrides them.
DEFAULT_TIMEOUTS: Final = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0, "timeout": 5.0}


def client_from_url(url: str) -> Redis:
    """A client for ``url`` whose every call is bounded in time.

    Its pool blocks (up to ``timeout``) for a free connection instead of
    failing at once when all are busy.
    """
    pool = BlockingConnectionPool.from_url(
        url,
        **DEFAULT_TIMEOUTS,
        # One quick retry reconnects after a dropped connection; a hung
        # server is not retried, so a call never outlasts socket_timeout.
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return Redis.from_pool(pool)
