"""The Prometheus metrics, scraped from a real ``/metrics`` next to taskiq's own."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio
from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError, kiq_or_join
from tests._brokers import BrokerFactory, HoldingBroker
from tests._locks import wait_until
from tests._middlewares import MiddlewareFactory
from tests._server import free_port

# The metrics extra; .ci/floors runs the suite without it.
pytest.importorskip("prometheus_client")

import prometheus_client  # after the skip above
from prometheus_client.parser import text_string_to_metric_families
from taskiq.middlewares.prometheus_middleware import PrometheusMiddleware

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def metrics_url() -> Iterator[str]:
    """A ``/metrics`` endpoint of prometheus_client's default registry, on a free port."""
    port = free_port()
    server, thread = prometheus_client.start_http_server(port, addr="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")
def taskiq_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusMiddleware]:
    """taskiq's own PrometheusMiddleware (its metrics can be made once per process)."""
    with pytest.MonkeyPatch.context() as patch:
        # It points PROMETHEUS_MULTIPROC_DIR at its directory; put it back afterwards.
        patch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path_factory.mktemp("prometheus")))
        yield PrometheusMiddleware(metrics_path=Path(tmp_path_factory.mktemp("taskiq")))


async def scrape(url: str) -> Samples:
    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (our own endpoint)
            body: bytes = response.read()
            return body.decode()

    text = await asyncio.to_thread(get)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sends(samples: Samples, task_name: str, outcome: str) -> float:
    labels = (("outcome", outcome), ("task_name", task_name))
    return samples.get(("taskiq_deduplication_sends_total", labels), 0.0)


def lock_events(samples: Samples, task_name: str, event: str) -> float:
    labels = (("event", event), ("task_name", task_name))
    return samples.get(("taskiq_deduplication_lock_events_total", labels), 0.0)


@pytest.fixture
async def observed_broker(
    make_middleware: MiddlewareFactory, taskiq_prometheus: PrometheusMiddleware
) -> AsyncIterator[HoldingBroker]:
    broker = HoldingBroker().with_middlewares(taskiq_prometheus, make_middleware())
    await broker.startup()
    yield broker
    await broker.shutdown()


async def test_the_metrics_show_next_to_taskiq_s_own(
    metrics_url: str, observed_broker: HoldingBroker
) -> None:
    broker = observed_broker
    held: list[float] = []

    @broker.task(task_name="metrics.job")
    async def job(n: int) -> None:
        held.append((await scrape(metrics_url))[("taskiq_deduplication_held_locks", ())])

    @broker.task(task_name="metrics.free", deduplication=False)
    async def free() -> None: ...

    before = await scrape(metrics_url)
    await job.kiq(1)
    await job.kiq(2)
    with pytest.raises(DuplicateTaskError):
        await job.kiq(1)
    assert (await kiq_or_join(job, 2)).joined
    await free.kiq()
    await broker.deliver()
    after = await scrape(metrics_url)

    assert sends(after, "metrics.job", "locked") == 2
    assert sends(after, "metrics.job", "duplicate") == 1
    assert sends(after, "metrics.job", "joined") == 1
    assert sends(after, "metrics.free", "off") == 1
    assert lock_events(after, "metrics.job", "released") == 2
    # Each run's lock was kept alive by the heartbeat while it ran, and only then.
    gauge = ("taskiq_deduplication_held_locks", ())
    assert held == [before[gauge] + 1, before[gauge] + 1]
    assert after[gauge] == before[gauge]
    # Three acquires and at least the run's re-asserts and releases: round trips timed.
    count = ("taskiq_deduplication_redis_seconds_count", ())
    assert after[count] >= before.get(count, 0) + 4
    # taskiq's own metrics, on the same endpoint.
    assert after[("received_tasks_total", (("task_name", "metrics.job"),))] == 2


async def test_lock_events_of_running_tasks_are_counted(
    metrics_url: str, broker: HoldingBroker, redis_url: str, prefix: str
) -> None:
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)

    @broker.task(task_name="metrics.gone")
    async def gone() -> None: ...

    @broker.task(task_name="metrics.taken", deduplication_exclusive=False)
    async def taken() -> None: ...

    await gone.kiq()
    await taken.kiq()
    gone_key, taken_key = [m.labels["_deduplication_lock_key"] for m in broker.queued]
    await client.delete(gone_key)
    await client.set(taken_key, "othertoken other-task", px=30_000)
    await broker.deliver()
    await client.delete(taken_key)
    await client.aclose()
    samples = await scrape(metrics_url)
    assert lock_events(samples, "metrics.gone", "taken_back") == 1
    assert lock_events(samples, "metrics.gone", "released") == 1
    assert lock_events(samples, "metrics.taken", "lost") == 1
    assert lock_events(samples, "metrics.taken", "released") == 0


async def test_metrics_false_records_nothing_and_several_middlewares_share_them(
    metrics_url: str, make_middleware: MiddlewareFactory, make_broker: BrokerFactory
) -> None:
    brokers = [
        await make_broker(middlewares=[make_middleware(metrics=metrics)])
        for metrics in (True, True, False)
    ]
    for index, broker in enumerate(brokers):

        @broker.task(task_name=f"metrics.shared{index}")
        async def job() -> None: ...

        await job.kiq()
        await broker.wait_all()
    samples = await scrape(metrics_url)
    assert [sends(samples, f"metrics.shared{i}", "locked") for i in range(3)] == [1, 1, 0]


async def test_the_metric_names_are_exactly_these(observed_broker: HoldingBroker) -> None:
    names = {
        metric.name
        for metric in prometheus_client.REGISTRY.collect()
        if metric.name.startswith("taskiq_deduplication")
    }
    assert names == {
        "taskiq_deduplication_sends",
        "taskiq_deduplication_lock_events",
        "taskiq_deduplication_held_locks",
        "taskiq_deduplication_redis_seconds",
        "taskiq_deduplication_limit_slots",
        "taskiq_deduplication_limit_waiting",
        "taskiq_deduplication_limit_wait_seconds",
    }


async def test_limits_show_their_slots_waiting_runs_and_waits(
    metrics_url: str, make_middleware: MiddlewareFactory, taskiq_prometheus: PrometheusMiddleware
) -> None:
    broker = InMemoryBroker().with_middlewares(taskiq_prometheus, make_middleware())
    await broker.startup()
    release = asyncio.Event()

    @broker.task(task_name="metrics.limited", limit_concurrency=2, deduplication=False)
    async def limited() -> None:
        await release.wait()

    slots, waiting = (
        ("taskiq_deduplication_limit_slots", ()),
        (
            "taskiq_deduplication_limit_waiting",
            (),
        ),
    )
    waits = ("taskiq_deduplication_limit_wait_seconds_count", ())
    before = await scrape(metrics_url)
    handles = [await limited.kiq() for _ in range(3)]

    async def two_hold_one_waits() -> bool:
        now = await scrape(metrics_url)
        return now[slots] == before[slots] + 2 and now[waiting] == before[waiting] + 1

    await wait_until(two_hold_one_waits)
    release.set()
    for handle in handles:
        assert not (await handle.wait_result(timeout=10)).is_err
    after = await scrape(metrics_url)
    assert after[slots] == before[slots]
    assert after[waiting] == before[waiting]
    assert after[waits] == before.get(waits, 0) + 1
    assert lock_events(after, "metrics.limited", "limited") == 1
    assert lock_events(after, "metrics.limited", "waited") == 1
    await broker.shutdown()
