"""Shared fixtures: a real Redis for the whole session, and isolation per test.

``REDIS_URL`` points the suite at an existing server; without it the session
starts its own throwaway server (see ``tests/_server.py``): with pytest-xdist
(``pytest -n auto``), each worker process is a session of its own, with a server
of its own. Every test gets a key prefix of its own and its keys are deleted
afterwards: the suite's tests are built on the shipped pytest plugin's helper
(``taskiq_deduplication.testing.Deduplication``), as an application's would be.

A core behaviour test decorated with ``@all_topologies()`` runs three times: on
that single server, on a 3-primary Redis Cluster and on a Sentinel-managed
primary (as ``limits``' ``all_storage`` runs its storage tests); the Cluster and
the Sentinel set are started once per session, when a test first needs them,
and a test skips, saying why, where they cannot start.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, overload

import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from taskiq import InMemoryBroker, SimpleRetryMiddleware, SmartRetryMiddleware, TaskiqMiddleware

from taskiq_deduplication import RedisDeduplicationMiddleware
from taskiq_deduplication._heartbeat import Beat
from taskiq_deduplication._wire_probe import WIRE_ENV, lean_fits, misfit_of
from taskiq_deduplication.testing import Deduplication
from tests import _xdist
from tests._brokers import HoldingBroker, retry_middleware
from tests._server import Server
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


#: The name of the user property under which a fault test reports a recovery time
#: (``tests/faults/conftest.py``), printed in the terminal summary.
RECOVERY_PROPERTY = "dedup_recovery"

_RECOVERIES: list[tuple[str, str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the recovery times the fault tests measured, from each test's report.

    Under pytest-xdist this runs in the controller with the reports the workers
    send, so the summary has the measurements of every worker.
    """
    if report.when != "call":
        return
    for name, value in report.user_properties:
        if name == RECOVERY_PROPERTY:
            what, seconds = cast("tuple[str, float]", value)
            _RECOVERIES.append((report.nodeid.rsplit("::", 1)[-1], str(what), float(seconds)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the recovery times that the fault tests measured."""
    if not _RECOVERIES:
        return
    terminalreporter.section("fault recovery times")
    for test, what, seconds in _RECOVERIES:
        terminalreporter.write_line(f"{seconds * 1000:9.0f} ms  {what}  [{test}]")


# The two ways through redis-py (src/taskiq_deduplication/_redis_wire.py)

#: The modules whose tests run on both ways: the pipeline's mechanics (a hung
#: server, a lost script cache, a shutdown cut short), its recovery from a
#: restart or a failover, and the round trips that runs share.
BOTH_WIRES = frozenset(
    {"tests/faults/test_pipeline.py", "tests/test_redis_trouble.py", "tests/test_sharing.py"}
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run the tests of ``BOTH_WIRES`` on the lean way and on the public way."""
    module = metafunc.definition.path.relative_to(metafunc.config.rootpath).as_posix()
    if module in BOTH_WIRES:
        metafunc.parametrize("redis_wire", ["lean", "public"], indirect=True)


@pytest.fixture(autouse=True)
def redis_wire(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The way lock calls go through redis-py, for the tests of ``BOTH_WIRES``.

    ``"public"`` forces the fallback on redis-py's public API (and fails the test
    unless the probe then picks it); ``"lean"`` is the default way, and skips
    a test where the probe finds that this redis-py does not allow it. Every
    other test runs on the way the environment gives (``None``).
    """
    wire: str | None = getattr(request, "param", None)
    if wire is None:
        return None
    if wire == "public":
        monkeypatch.setenv(WIRE_ENV, "public")
    else:
        monkeypatch.delenv(WIRE_ENV, raising=False)
    probed = redis.asyncio.Redis().connection_pool.make_connection()  # type: ignore[no-untyped-call]
    lean = lean_fits(probed)
    if wire == "public":
        assert not lean, f"{WIRE_ENV}=public did not make the probe pick the public way"
    elif not lean:
        pytest.skip(f"the lean way does not fit this redis-py: {misfit_of(probed)}")
    return wire


ThingT = TypeVar("ThingT")


def owned(thing: ThingT, end: Callable[[ThingT], object]) -> Iterator[ThingT]:
    """Yield ``thing`` to a fixture's test, and ``end`` it afterwards whatever happened.

    A fixture that starts something writes ``yield from owned(started, stop)``.
    """
    try:
        yield thing
    finally:
        end(thing)


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


# Topologies: one test over a single server, a Cluster and a Sentinel set


TopologyT = TypeVar("TopologyT")


def start_or_skip(start: Callable[[], TopologyT], what: str) -> TopologyT:
    """Start a topology of servers, or skip the test where this machine cannot."""
    try:
        return start()
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"no {what} could be started here: {exc}")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """A 3-primary Redis Cluster, started once for the session when a test needs it."""
    yield from owned(start_or_skip(Cluster(primaries=3).start, "Redis Cluster"), Cluster.stop)


@pytest.fixture(scope="session")
def sentinels() -> Iterator[Sentinels]:
    """A primary, a replica and three sentinels, started once for the session."""
    yield from owned(start_or_skip(Sentinels().start, "Sentinel set"), Sentinels.stop)


def cluster_client(nodes: Cluster) -> RedisCluster:
    """A cluster client found from one node's URL, as the docs say to build it."""
    return RedisCluster.from_url(nodes.url, decode_responses=True)


def primary_client(watched: Sentinels, *, socket_timeout: float = 0.5) -> redis.asyncio.Redis:
    """The client the docs recommend: the sentinels' current primary, short timeouts.

    ``socket_timeout`` is also the middleware's budget for a lock call, from
    the moment it is made (see ``docs/reliability.md``).
    """
    sentinel = Sentinel(watched.addresses, socket_timeout=0.5)  # type: ignore[no-untyped-call,unused-ignore]
    client: redis.asyncio.Redis = sentinel.master_for(
        watched.service,
        socket_timeout=socket_timeout,
        socket_connect_timeout=0.5,
        decode_responses=True,
    )
    return client


#: The topologies a test decorated with ``all_topologies()`` runs on.
TOPOLOGIES = ("single", "cluster", "sentinel")
#: Set to a comma-separated subset of ``TOPOLOGIES`` to skip the others (``single``).
TOPOLOGIES_ENV = "DEDUP_TEST_TOPOLOGIES"


def all_topologies(*, hash_tag: bool = False) -> pytest.MarkDecorator:
    """Run the test on each topology (``limits``' ``all_storage``, for this middleware).

    Args:
        hash_tag: On the Cluster, put the test's prefix in a hash tag
            (``{test:...}``): a task that merges its calls, takes a fence or
            keeps a run slot needs its lock and the keys beside it in one slot.
            Without it the test's locks spread over every primary.
    """
    # Under pytest-xdist, one worker runs every test of a topology: one Cluster
    # and one Sentinel set for the whole run, not one per worker.
    return pytest.mark.parametrize(
        "topology",
        [
            pytest.param("single", id="single"),
            pytest.param(
                "cluster{}" if hash_tag else "cluster",
                id="cluster",
                marks=pytest.mark.xdist_group("cluster"),
            ),
            pytest.param("sentinel", id="sentinel", marks=pytest.mark.xdist_group("sentinel")),
        ],
        indirect=True,
    )


@dataclass
class Topology:
    """Where a test's locks live: the key prefix, and the client the middlewares share."""

    name: str
    prefix: str
    client: redis.asyncio.Redis | None = None
    """``None`` on the single server: each middleware builds its own from the URL."""


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


MiddlewareFactory = Callable[..., RedisDeduplicationMiddleware]


@pytest.fixture
def make_middleware(dedup: Deduplication, topology: Topology) -> MiddlewareFactory:
    """Build a middleware on the test Redis (its topology's) with this test's prefix."""

    def make(**options: Any) -> RedisDeduplicationMiddleware:
        options.setdefault("key_prefix", topology.prefix)
        if topology.client is not None and "redis_url" not in options:
            options.setdefault("client", topology.client)
        return dedup.middleware(**options)

    return make


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


BrokerT = TypeVar("BrokerT", bound=InMemoryBroker)
_Key = TypeVar("_Key", bound=str | bytes)


class BrokerFactory(Protocol):
    """The type of the ``make_broker`` fixture."""

    @overload
    async def __call__(
        self,
        *,
        broker_class: type[BrokerT],
        middlewares: list[TaskiqMiddleware] | None = None,
        await_inplace: bool = False,
        retries: int | None = None,
        **options: Any,
    ) -> BrokerT: ...

    @overload
    async def __call__(
        self,
        *,
        middlewares: list[TaskiqMiddleware] | None = None,
        await_inplace: bool = False,
        retries: int | None = None,
        **options: Any,
    ) -> InMemoryBroker: ...


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


async def queued_job(make_broker: BrokerFactory) -> tuple[HoldingBroker, Any]:
    """A started ``HoldingBroker`` (a queue the test delivers) and a task ``job()``, a no-op."""
    broker = await make_broker(broker_class=HoldingBroker)

    async def job() -> None: ...

    return broker, broker.register_task(job)


def without_done(keys: Iterable[_Key]) -> list[_Key]:
    """``keys`` less the calls remembered for copies of their messages (``<prefix>#done:*``).

    A run that succeeds leaves one, which expires with the redelivery window:
    the one thing a run leaves behind on purpose (`test_runs_once.py` checks it).
    """
    mark = "#done:"
    return [key for key in keys if mark not in (key.decode() if isinstance(key, bytes) else key)]


async def merged_into(call: Callable[[], Awaitable[Any]]) -> str:
    """Make a ``kiq`` that merges into its queued holder; the holder's task_id it hands back.

    A merged call is no refusal (issue 31): ``kiq`` raises nothing and returns
    the handle of the holder, which will run with the call's arguments. A
    call that is refused instead fails the test with its ``DuplicateTaskError``.
    """
    handle = await call()
    task_id: str = handle.task_id
    return task_id


async def lock_keys(client: redis.asyncio.Redis, prefix: str) -> list[str]:
    """The lock keys under ``prefix``, sorted."""
    return sorted([key async for key in client.scan_iter(match=f"{prefix}:*")])


async def lock_value(client: redis.asyncio.Redis, key: str) -> str:
    """The value of a lock, ``"<owner token> <task_id>"``; fails if there is none."""
    value = await client.get(key)
    assert isinstance(value, str), f"no lock at {key!r}"
    return value


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        if loop.time() > deadline:
            msg = f"condition not met within {timeout}s"
            raise AssertionError(msg)
        await asyncio.sleep(0.02)


def running_beats(middleware: RedisDeduplicationMiddleware) -> list[Beat]:
    """The locks that ``middleware``'s heartbeat keeps alive in this event loop."""
    state = middleware._states.get()
    return [] if state is None else list(state.heartbeat._beats)


def client_of(middleware: RedisDeduplicationMiddleware) -> redis.asyncio.Redis:
    """The Redis client ``middleware`` uses in this event loop (after its startup)."""
    state = middleware._states.get()
    assert state is not None, "the middleware has not started in this event loop"
    assert isinstance(state.client, redis.asyncio.Redis)
    return state.client


def dedup_middleware(broker: InMemoryBroker) -> RedisDeduplicationMiddleware:
    """The deduplication middleware registered on ``broker``."""
    for middleware in broker.middlewares:
        if isinstance(middleware, RedisDeduplicationMiddleware):
            return middleware
    msg = "no RedisDeduplicationMiddleware on this broker"
    raise LookupError(msg)
