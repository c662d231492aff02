"""OpenTelemetry: the outcome of a send, on the send span of taskiq's instrumentation.

taskiq's ``OpenTelemetryMiddleware`` (put first on a broker by
``TaskiqInstrumentor``) opens a span in ``pre_send`` and closes it in
``post_send``. The outcome of our ``pre_send`` goes on that span as attributes;
a refused duplicate adds an event and closes the span, since taskiq never calls
``post_send`` for a send that a middleware refused and the span would stay open
(and current) for good.

Nothing here is imported unless taskiq's middleware already is: without the
``opentelemetry`` packages the middleware never looks for a span.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Final

from taskiq_deduplication.observe.events import LockEvent, LockEventKind

if TYPE_CHECKING:
    from taskiq import TaskiqMessage
    from taskiq.abc.broker import AsyncBroker

_TASKIQ_OTEL: Final = "taskiq.middlewares.opentelemetry_middleware"

OUTCOME: Final = "taskiq_deduplication.outcome"
HOLDER: Final = "taskiq_deduplication.holder_task_id"
KEY: Final = "taskiq_deduplication.key"
DUPLICATE_EVENT: Final = "taskiq_deduplication.duplicate"
# The outcomes of a send that kiq ends with a DuplicateTaskError (no post_send).
_REFUSED: Final = frozenset({LockEventKind.DUPLICATE, LockEventKind.JOINED, LockEventKind.MERGED})


def is_traced(broker: AsyncBroker | None) -> bool:
    """Whether taskiq's OpenTelemetry middleware is on ``broker``."""
    module = sys.modules.get(_TASKIQ_OTEL)
    if module is None or broker is None:
        return False
    middleware = module.OpenTelemetryMiddleware
    return any(isinstance(each, middleware) for each in broker.middlewares)


def annotate_send(message: TaskiqMessage, event: LockEvent) -> None:
    """Put ``event``, the outcome of ``message``'s send, on its send span, if it has one."""
    from taskiq.middlewares.opentelemetry_middleware import (  # noqa: PLC0415 (optional)
        detach_context,
        retrieve_context,
    )

    found = retrieve_context(message, is_publish=True)
    if found is None:  # taskiq's middleware runs after ours, or did not open one
        return
    span, activation, _ = found
    if span.is_recording():
        attributes = {OUTCOME: event.kind.value}
        if event.holder_task_id is not None:
            attributes[HOLDER] = event.holder_task_id
        if event.key is not None:
            attributes[KEY] = event.key
        span.set_attributes(attributes)
        if event.kind in _REFUSED:
            span.add_event(DUPLICATE_EVENT, {k: v for k, v in attributes.items() if k != OUTCOME})
    if event.kind in _REFUSED:
        activation.__exit__(None, None, None)
        detach_context(message, is_publish=True)
