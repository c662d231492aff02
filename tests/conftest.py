"""The suite's pytest hooks and fixtures: a real Redis for the session, isolation per test.

Only what pytest must find here: the helpers that tests import are in the
``tests/_*.py`` modules beside it (``_brokers``, ``_locks``, ``_middlewares``,
``_topologies``, ...), which these hooks and fixtures use as well.

``REDIS_URL`` points the suite at an existing server; without it the session
starts its own throwaway server (see ``tests/_server.py``): with pytest-xdist
(``pytest -n auto``), each worker process is a session of its own, with a server
of its own. Every test gets a key prefix of its own and its keys are deleted
afterwards: the suite's tests are built on the shipped pytest plugin's helper
(``taskiq_deduplication.testing.Deduplication``), as an application's would be.

A core behaviour test decorated with ``@all_topologies()`` (``tests/_topologies.py``)
runs three times: on that single server, on a 3-primary Redis Cluster and on a
Sentinel-managed primary; the Cluster and the Sentinel set are started once per
session, when a test first needs them, and a test skips, saying why, where they
cannot start.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from taskiq import InMemoryBroker, SimpleRetryMiddleware, TaskiqMiddleware

from taskiq_deduplication import RedisDeduplicationMiddleware
from taskiq_deduplication.testing import Deduplication
from tests import _recoveries, _xdist
from tests._brokers import BrokerFactory, HoldingBroker, retry_middleware
from tests._middlewares import MiddlewareFactory
from tests._server import Server
from tests._teardown import closed_after, owned
from tests._topologies import (
    TOPOLOGIES_ENV,
    Topology,
    cluster_client,
    primary_client,
    start_or_skip,
)
from tests._wires import BOTH_WIRES, use_wire
from tests.topologies._servers import Cluster, Sentinels

# Running the suite in parallel (pytest-xdist, `pytest -n auto`)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: three workers per core, since most tests wait (on leases, TTLs, workers).

    On a 2-core machine 6 workers finish the whole suite (end-to-end included)
    in 4 min 50 s, 4 workers in 7 min 05 s (2026-12-06): a test that waits for
    a lock to expire, or for a worker process, leaves its core to the others. With
    ``REDIS_URL`` set every worker would share that server, and the tests that
    count its commands (``INFO commandstats``) would count the others' too: one
    worker then.
    """
    if os.environ.get("REDIS_URL"):
        return 1
    return 3 * len(os.sched_getaffinity(0))


def pytest_configure(config: pytest.Config) -> None:
    """With ``-n``: where the workers tell the controller the groups (``tests/_xdist.py``)."""
    _xdist.configure(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove what ``pytest_configure`` made."""
    _xdist.unconfigure(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tell each pytest-xdist worker where to write the groups."""
    _xdist.configure_node(node)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker: the tests marked ``slow`` first, and the groups written."""
    _xdist.reorder_and_record(config, items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Keep each ``xdist_group`` in one worker, and spread every other test (``-n`` alone).

    The default distribution (``load``) ignores the groups, and ``loadgroup``
    no longer finds them with pytest 9.2 (``tests/_xdist.py``); ``--dist``
    given as anything else is left as it is.
    """
    return _xdist.make_scheduler(config, log)


# The fault tests' recovery times (tests/_recoveries.py)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the recovery times the fault tests measured, from each test's report.

    Under pytest-xdist this runs in the controller with the reports the workers
    send, so the summary has the measurements of every worker.
    """
    _recoveries.collect(report)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the recovery times that the fault tests measured."""
    _recoveries.print_summary(terminalreporter)


# The two ways through redis-py (tests/_wires.py)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run the tests of ``BOTH_WIRES`` on the lean way and on the public way."""
    module = metafunc.definition.path.relative_to(metafunc.config.rootpath).as_posix()
    if module in BOTH_WIRES:
        metafunc.parametrize("redis_wire", ["lean", "public"], indirect=True)


@pytest.fixture(autouse=True)
def redis_wire(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The way lock calls go through redis-py, for the tests of ``BOTH_WIRES``.

    ``"lean"`` or ``"public"`` (see ``use_wire``); every other test runs on the
    way the environment gives (``None``).
    """
    wire: str | None = getattr(request, "param", None)
    if wire is not None:
        use_wire(wire, monkeypatch)
    return wire


# The session's Redis, and a prefix of each test's own


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of the Redis the tests use: ``REDIS_URL``, or a throwaway server."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    server = Server().start()
    try:
        yield server.url
    finally:
        server.cleanup()


@pytest.fixture
def server() -> Iterator[Server]:
    """A throwaway server of this test's own, to stop, pause or restart."""
    yield from owned(Server().start(), Server.cleanup)


@pytest.fixture(scope="session")
def dedup_redis_url(redis_url: str) -> str:
    """The plugin's name for the session's Redis: the suite's own server."""
    return redis_url


@pytest.fixture
def dedup(dedup_redis_url: str) -> Iterator[Deduplication]:
    """The plugin's helper, under a ``test:`` prefix of this test's own.

    The plugin's own ``dedup`` fixture would do, but for its prefix: tests read
    the prefix (``test:...``) in what the middleware reports.
    """
    helper = Deduplication(dedup_redis_url, f"test:{uuid.uuid4().hex[:12]}")
    # The plugin fixture's own teardown: every key of the prefix.
    yield from owned(helper, Deduplication._finish)


# Topologies: one test over a single server, a Cluster and a Sentinel set (tests/_topologies.py)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """A 3-primary Redis Cluster, started once for the session when a test needs it."""
    yield from owned(start_or_skip(Cluster(primaries=3).start, "Redis Cluster"), Cluster.stop)


@pytest.fixture(scope="session")
def sentinels() -> Iterator[Sentinels]:
    """A primary, a replica and three sentinels, started once for the session."""
    yield from owned(start_or_skip(Sentinels().start, "Sentinel set"), Sentinels.stop)


@pytest.fixture
def topology(request: pytest.FixtureRequest, dedup: Deduplication) -> Topology:
    """The single server, unless the test is decorated with ``all_topologies()``."""
    kind = str(getattr(request, "param", "single"))
    if kind == "single":
        return Topology("single", dedup.key_prefix)
    name = kind.removesuffix("{}")
    chosen = os.environ.get(TOPOLOGIES_ENV)
    if chosen is not None and name not in chosen.split(","):
        pytest.skip(f"{TOPOLOGIES_ENV}={chosen}: not on the {name} topology")
    prefix = f"{{{dedup.key_prefix}}}" if kind.endswith("{}") else dedup.key_prefix
    # A cluster client takes the commands the tests use with the same arguments.
    client: redis.asyncio.Redis = request.getfixturevalue(f"{name}_redis")
    return Topology(name, prefix, client)


@pytest.fixture
async def cluster_redis(cluster: Cluster, dedup: Deduplication) -> AsyncIterator[RedisCluster]:
    """A cluster client for this test's event loop; deletes the test's keys at the end."""
    async for client in closed_after(cluster_client(cluster), dedup.key_prefix):
        yield client


@pytest.fixture
async def sentinel_redis(
    sentinels: Sentinels, dedup: Deduplication
) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of the sentinels' primary for this test's event loop; cleans up as above."""
    async for client in closed_after(primary_client(sentinels), dedup.key_prefix):
        yield client


@pytest.fixture
def prefix(topology: Topology) -> str:
    """A key prefix no other test uses."""
    return topology.prefix


@pytest.fixture
async def redis_client(redis_url: str, topology: Topology) -> AsyncIterator[redis.asyncio.Redis]:
    """A plain client to look at the keys (the topology's, off the single server)."""
    if topology.client is not None:
        yield topology.client
        return
    async for client in closed_after(
        redis.asyncio.Redis.from_url(redis_url, decode_responses=True), topology.prefix
    ):
        yield client


# The middlewares and brokers a test builds (their types: tests/_middlewares.py, _brokers.py)


@pytest.fixture
def make_middleware(dedup: Deduplication, topology: Topology) -> MiddlewareFactory:
    """Build a middleware on the test Redis (its topology's) with this test's prefix."""

    def make(**options: Any) -> RedisDeduplicationMiddleware:
        options.setdefault("key_prefix", topology.prefix)
        if topology.client is not None and "redis_url" not in options:
            options.setdefault("client", topology.client)
        return dedup.middleware(**options)

    return make


@pytest.fixture
def retry_and_dedup(
    make_middleware: MiddlewareFactory, retry_class: type[TaskiqMiddleware], retry_first: bool
) -> list[TaskiqMiddleware]:
    """A retry middleware and a deduplication one, in the order of an ``each_retry_order`` case.

    The retry middleware resends at once (``tests/_brokers.py``'s ``retry_middleware``);
    ``dedup_middleware(broker)`` finds the deduplication one again.
    """
    retry, dedup = retry_middleware(retry_class), make_middleware()
    return [retry, dedup] if retry_first else [dedup, retry]


@pytest.fixture
async def make_broker(
    make_middleware: MiddlewareFactory,
) -> AsyncIterator[BrokerFactory]:
    """Build started in-memory brokers; each is shut down at the end of the test.

    ``make_broker(**options)`` puts one deduplication middleware built with
    ``options`` on the broker; ``retries=n`` puts taskiq's ``SimpleRetryMiddleware``
    after it, ``n`` attempts in all (``dedup_middleware(broker)`` finds the
    deduplication one again); ``middlewares=[...]`` gives the whole list instead
    (use ``make_middleware`` for the deduplication one); ``broker_class`` picks
    one of the brokers in ``tests/_brokers.py``.
    """
    brokers: list[InMemoryBroker] = []

    async def make(
        *,
        middlewares: list[TaskiqMiddleware] | None = None,
        broker_class: type[InMemoryBroker] = InMemoryBroker,
        await_inplace: bool = False,
        retries: int | None = None,
        **options: Any,
    ) -> InMemoryBroker:
        if middlewares is None:
            middlewares = [make_middleware(**options)]
            if retries is not None:
                middlewares.append(SimpleRetryMiddleware(default_retry_count=retries))
        broker = broker_class(await_inplace=await_inplace)
        broker.with_middlewares(*middlewares)
        brokers.append(broker)
        await broker.startup()
        return broker

    yield make  # type: ignore[misc]  # one implementation serves both overloads
    for broker in brokers:
        await broker.wait_all()
        await broker.shutdown()


@pytest.fixture
async def broker(make_broker: BrokerFactory) -> HoldingBroker:
    """A started ``HoldingBroker`` (a queue the test delivers) with one deduplication middleware.

    A test that needs options of its own, or a second broker, asks for ``make_broker``.
    """
    return await make_broker(broker_class=HoldingBroker)
