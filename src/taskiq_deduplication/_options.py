"""Checking the middleware's options: each one named in the error it raises."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final, Protocol

import pydantic
import pydantic_core
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url

from taskiq_deduplication._labels import MAX_TTL, check_text
from taskiq_deduplication._policies import POLICIES, Policy
from taskiq_deduplication.exceptions import InvalidSettingError

if TYPE_CHECKING:
    from pydantic import RedisDsn
    from taskiq.abc.broker import AsyncBroker


# A RedisDsn, as every pydantic 2 spells it: from 2.10 on a subclass of AnyUrl;
# before, an Annotated alias of pydantic_core.Url, which isinstance() refuses.
_PYDANTIC_URLS: Final = (pydantic.AnyUrl, pydantic_core.Url, pydantic_core.MultiHostUrl)


def check_connection(redis_url: str | RedisDsn | None, client: object) -> str | None:
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


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        msg = f"{name} must be True or False, not {value!r}"
        raise InvalidSettingError(msg)
    return value


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        msg = f"{name} must be a whole number of at least {minimum}, not {value!r}"
        raise InvalidSettingError(msg)
    if maximum is not None and value > maximum:
        msg = f"{name} must be at most {maximum}, not {value!r}"
        raise InvalidSettingError(msg)
    return value


def check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        msg = f"{name} must be a finite number of seconds of at least 0, not {value!r}"
        raise InvalidSettingError(msg)
    return float(value)


def check_prefix(value: object) -> str:
    if not isinstance(value, str) or not value:
        msg = f"key_prefix must be a non-empty string, not {value!r}"
        raise InvalidSettingError(msg)
    try:
        check_text(value)
    except ValueError as exc:
        msg = f"key_prefix {value!r} cannot be a Redis key: {exc}"
        raise InvalidSettingError(msg) from None
    return value


def check_running_ttl(value: object, heartbeat: bool, interval: float | None) -> int | None:  # noqa: FBT001 (checked options, passed on)
    if value is None:
        return None
    seconds = check_int("running_ttl", value, minimum=1, maximum=MAX_TTL)
    if not heartbeat:
        msg = "running_ttl needs the heartbeat: a lease nobody refreshes lapses mid-run"
        raise InvalidSettingError(msg)
    if interval is not None and interval >= seconds:
        msg = (
            f"heartbeat_interval ({interval}s) must be shorter than running_ttl "
            f"({seconds}s), or the lease expires between refreshes"
        )
        raise InvalidSettingError(msg)
    return seconds


def check_interval(value: object, default_ttl: int) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        msg = f"heartbeat_interval must be a positive number of seconds or None, not {value!r}"
        raise InvalidSettingError(msg)
    if value >= default_ttl:
        msg = (
            f"heartbeat_interval ({value}s) must be shorter than default_ttl "
            f"({default_ttl}s), or the lock expires between refreshes"
        )
        raise InvalidSettingError(msg)
    return float(value)


def check_until(value: object) -> Policy:
    """The policy named by the ``default_until`` option."""
    policy = POLICIES.get(value) if isinstance(value, str) else None
    if policy is None:
        msg = f"default_until must be one of {', '.join(map(repr, POLICIES))}, not {value!r}"
        raise InvalidSettingError(msg)
    return policy


def check_success_ttl(value: object) -> int:
    """The ``default_success_ttl`` option: whole seconds, 0 for none."""
    return check_int("default_success_ttl", value, minimum=0, maximum=MAX_TTL)


class Settings(Protocol):
    """The options that a send and a run read as the middleware has them now."""

    @property
    def key_prefix(self) -> str:
        """Prefix of every lock key (an application may set it after construction)."""

    @property
    def fail_open(self) -> bool:
        """Whether a Redis error lets a send or a run go on without its lock."""

    @property
    def heartbeat(self) -> bool:
        """Whether running tasks' locks are refreshed."""

    @property
    def heartbeat_interval(self) -> float | None:
        """Seconds between refreshes, if set."""

    @property
    def running_ttl(self) -> int | None:
        """The running lease in seconds, if set."""

    @property
    def broker(self) -> AsyncBroker:
        """The broker the middleware is registered on."""
