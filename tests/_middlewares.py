"""The deduplication middleware in a test: built, found on a broker, looked into, retried.

``MiddlewareFactory`` is the type of the ``make_middleware`` fixture
(``tests/conftest.py``); ``each_retry_order`` runs a test with each of taskiq's
retry middlewares on either side of it (the ``retry_and_dedup`` fixture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import pytest
import redis.asyncio
from taskiq import InMemoryBroker, SimpleRetryMiddleware, SmartRetryMiddleware

from taskiq_deduplication import RedisDeduplicationMiddleware
from taskiq_deduplication.middleware import loop_states
from taskiq_deduplication.run.heartbeat import Beat

#: The type of the ``make_middleware`` fixture: ``make_middleware(**options)``.
MiddlewareFactory = Callable[..., RedisDeduplicationMiddleware]


def dedup_middleware(broker: InMemoryBroker) -> RedisDeduplicationMiddleware:
    """The deduplication middleware registered on ``broker``."""
    for middleware in broker.middlewares:
        if isinstance(middleware, RedisDeduplicationMiddleware):
            return middleware
    msg = "no RedisDeduplicationMiddleware on this broker"
    raise LookupError(msg)


def running_beats(middleware: RedisDeduplicationMiddleware) -> list[Beat]:
    """The locks that ``middleware``'s heartbeat keeps alive in this event loop."""
    state = loop_states(middleware).get()
    return [] if state is None else list(state.heartbeat._beats)


def client_of(middleware: RedisDeduplicationMiddleware) -> redis.asyncio.Redis:
    """The Redis client ``middleware`` uses in this event loop (after its startup)."""
    state = loop_states(middleware).get()
    assert state is not None, "the middleware has not started in this event loop"
    assert isinstance(state.client, redis.asyncio.Redis)
    return state.client


TestT = TypeVar("TestT", bound=Callable[..., Any])


def each_retry_order(test: TestT) -> TestT:
    """Run ``test`` with each of taskiq's retry middlewares, before and after deduplication.

    The test asks for ``retry_and_dedup``, the two middlewares in the order of its case.
    """
    each_class = pytest.mark.parametrize(
        "retry_class", [SimpleRetryMiddleware, SmartRetryMiddleware]
    )
    each_side = pytest.mark.parametrize(
        "retry_first", [True, False], ids=["retry-first", "dedup-first"]
    )
    # A mark decorator returns what it decorates; pytest types that as Any.
    return cast("TestT", each_side(each_class(test)))
