"""Building Redis clients from a URL: the middleware's per event loop, and a tool's of any topology.

The middleware builds one client per event loop from its ``redis_url``
(`client_from_url`). A tool that finds the locks from outside the workers
(`taskiq dedup`, [Locks][taskiq_deduplication.Locks]) names the topology in its
URL (`connect`): ``redis://`` (or ``rediss://``, ``unix://``) for one server,
found to be a cluster node if it answers ``CLUSTER SLOTS``, and
``redis+sentinel://`` for the primary that sentinels name. The middleware's
``redis_url`` and ``client`` options are checked here too (`check_connection`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final
from urllib.parse import unquote, urlsplit

import pydantic
import pydantic_core
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, ResponseError

from taskiq_deduplication.exceptions import InvalidSettingError

if TYPE_CHECKING:
    from pydantic import RedisDsn

    RedisClient = Redis | RedisCluster

#: Bounds on every Redis call of a client built from ``redis_url`` (seconds);
#: a URL query such as ``?socket_timeout=1`` overrides them.
DEFAULT_TIMEOUTS: Final = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0, "timeout": 5.0}
#: The URL scheme of a primary found through Sentinel.
SENTINEL_SCHEME: Final = "redis+sentinel"
_SENTINEL_PORT: Final = 26379
_TIMEOUT: Final = DEFAULT_TIMEOUTS["socket_timeout"]
_CLIENT_TIMEOUTS: Final = {
    name: seconds for name, seconds in DEFAULT_TIMEOUTS.items() if name != "timeout"
}


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
        raise InvalidSettingError(msg)
    addresses = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":") if ":" in address else (address, "", "")
        if port and not port.isdigit():
            msg = f"bad port in sentinel address {address!r}"
            raise InvalidSettingError(msg)
        addresses.append((host, int(port) if port else _SENTINEL_PORT))
    user, _, password = credentials.partition(":")
    sentinels = Sentinel(addresses, socket_timeout=_TIMEOUT)  # type: ignore[no-untyped-call,unused-ignore]
    primary: Redis = sentinels.master_for(
        unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,  # noqa: PLR2004
        username=unquote(user) or None,
        password=unquote(password) or None,
        socket_timeout=_TIMEOUT,
        socket_connect_timeout=_TIMEOUT,
    )
    return primary


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
