"""The send span of taskiq's OpenTelemetry instrumentation carries the outcome."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from taskiq_deduplication import DuplicateTaskError, kiq_or_join
from tests._brokers import HoldingBroker
from tests._middlewares import MiddlewareFactory

# The opentelemetry extra and the SDK; .ci/floors runs the suite without them.
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import get_current_span
from taskiq.instrumentation import TaskiqInstrumentor


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


@dataclass
class Traced:
    broker: HoldingBroker
    exporter: InMemorySpanExporter

    def sends(self) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name.startswith("send/")]


@pytest.fixture
async def traced(
    make_middleware: MiddlewareFactory, exporter: InMemorySpanExporter
) -> AsyncIterator[Traced]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    broker = HoldingBroker().with_middlewares(make_middleware())
    # What TaskiqInstrumentor().instrument() does to every new broker, for this one only.
    instrumentor = TaskiqInstrumentor()
    instrumentor.instrument_broker(broker, tracer_provider=provider)
    await broker.startup()
    yield Traced(broker, exporter)
    await broker.shutdown()
    instrumentor.uninstrument_broker(broker)
    provider.shutdown()


async def test_the_send_span_carries_outcome_and_holder(traced: Traced) -> None:
    @traced.broker.task(task_name="traced.job")
    async def job(secret: str) -> None: ...

    sent = await job.kiq("hunter2")
    (span,) = traced.sends()
    attributes = dict(span.attributes or {})
    assert attributes["taskiq_deduplication.outcome"] == "locked"
    assert attributes["taskiq_deduplication.holder_task_id"] == sent.task_id
    assert str(attributes["taskiq_deduplication.key"]).startswith("test:")
    assert not span.events
    assert "hunter2" not in repr(attributes)


async def test_a_refused_duplicate_adds_an_event_and_ends_its_span(traced: Traced) -> None:
    @traced.broker.task(task_name="traced.dup")
    async def job(secret: str) -> None: ...

    sent = await job.kiq("hunter2")
    with pytest.raises(DuplicateTaskError):
        await job.kiq("hunter2")
    # taskiq never runs post_send for a refused send: the span is ended for it,
    # so it is exported and no longer the current span.
    assert not get_current_span().is_recording()
    first, refused = traced.sends()
    assert refused.attributes is not None
    assert refused.attributes["taskiq_deduplication.outcome"] == "duplicate"
    assert refused.attributes["taskiq_deduplication.holder_task_id"] == sent.task_id
    (event,) = refused.events
    assert event.name == "taskiq_deduplication.duplicate"
    assert event.attributes is not None
    assert event.attributes["taskiq_deduplication.holder_task_id"] == sent.task_id
    assert "hunter2" not in repr(refused.attributes) + repr(event.attributes)
    assert first.attributes is not None
    assert first.attributes["taskiq_deduplication.outcome"] == "locked"


async def test_without_instrumentation_no_span_is_looked_for(
    make_middleware: MiddlewareFactory,
) -> None:
    middleware = make_middleware(metrics=False)
    broker = HoldingBroker().with_middlewares(middleware)
    await broker.startup()
    try:
        assert not middleware._events.active  # no subscriber, no metrics, no span to annotate
    finally:
        await broker.shutdown()


@pytest.mark.parametrize("outcome", ["joined", "merged"])
async def test_a_join_or_a_merge_ends_its_span_too(traced: Traced, outcome: str) -> None:
    labels = {"deduplication_merge": "latest"} if outcome == "merged" else {}

    @traced.broker.task(task_name="traced.other", deduplication_key_fields=["n"], **labels)
    async def job(n: int, note: str) -> None: ...

    sent = await job.kiq(n=1, note="a")
    handle = await kiq_or_join(job, n=1, note="hunter2")
    assert handle.task_id == sent.task_id
    assert not get_current_span().is_recording()  # ended, no longer the caller's span
    _, other = traced.sends()
    assert other.attributes is not None
    assert other.attributes["taskiq_deduplication.outcome"] == outcome
    assert "hunter2" not in repr(other.attributes)
