"""The `redis_url` and `client` options; the Redis client an event loop builds from the URL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import pydantic
import pydantic_core
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from taskiq_deduplication.exceptions import InvalidSettingError

if TYPE_CHECKING:
    from pydantic import RedisDsn

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


# A RedisDsn, as every pydantic 2 spells it: from 2.10 on a subclass of AnyUrl;
# before, an Annotated alias of pydantic_core.Url, which isinstance() refuses.
_PYDANTIC_URLS: Final = (pydantic.AnyUrl, pydantic_core.Url, pydantic_core.MultiHostUrl)


def check_connection(redis_url: str | RedisDsn | None, client: object) -> str | None:
    """The URL to build clients from, or ``None`` with a ready ``client``; one of the two."""
    if (redis_url is None) == (client is None):
        msg = "pass exactly one of redis_url and client"
        raise InvalidSettingError(msg)
    if client is not None:
        if not isinstance(client, (Redis, RedisCluster)):
            msg = (
                f"client must be a redis.asyncio Redis or RedisCluster client, "
                f"not {type(client).__name__}"
            )
            raise InvalidSettingError(msg)
        return None
    url = str(redis_url) if isinstance(redis_url, _PYDANTIC_URLS) else redis_url
    if not isinstance(url, str) or not url:
        msg = f"redis_url must be a non-empty string or RedisDsn, not {redis_url!r}"
        raise InvalidSettingError(msg)
    try:
        parse_url(url)
    except ValueError as exc:
        msg = f"redis_url {url!r} is not a Redis URL: {exc}"
        raise InvalidSettingError(msg) from None
    return url
