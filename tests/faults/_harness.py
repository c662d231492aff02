"""What the fault tests share: a broker that shows what it was sent, log capture, polling."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
from taskiq import InMemoryBroker
from taskiq.message import BrokerMessage

from taskiq_deduplication import RedisDeduplicationMiddleware

LOGGER_NAME = "taskiq_deduplication"
LOCK_KEY_LABEL = "_deduplication_lock_key"
GRACE_TTL_MS = 10_000


class RecordingBroker(InMemoryBroker):
    """An in-memory broker that records every message it accepts.

    ``hold=True`` keeps accepted messages as a queue would, until
    :meth:`deliver_held` hands them to the worker side. ``kick_error`` makes every
    send fail, as an unreachable broker does. ``on_kick`` runs once the message is
    accepted, before ``kiq`` goes on to the middlewares' ``post_send``.
    """

    def __init__(
        self,
        *,
        hold: bool = False,
        kick_error: Exception | None = None,
        on_kick: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Create the broker; it runs each accepted task at once unless ``hold``."""
        super().__init__()
        self.sent: list[BrokerMessage] = []
        self.held: list[BrokerMessage] = []
        self.hold = hold
        self.kick_error = kick_error
        self.on_kick = on_kick

    async def kick(self, message: BrokerMessage) -> None:
        """Accept ``message`` (or fail), then run, hold or hand it to ``on_kick``."""
        if self.kick_error is not None:
            raise self.kick_error
        self.sent.append(message)
        if self.hold:
            self.held.append(message)
        else:
            await super().kick(message)
        if self.on_kick is not None:
            await self.on_kick()

    def deliver_held(self, task_id: str | None = None) -> None:
        """Run held messages (all, or the one of ``task_id``) as a worker picking them up."""
        chosen = [m for m in self.held if task_id is None or m.task_id == task_id]
        self.held = [m for m in self.held if m not in chosen]
        for message in chosen:
            task = asyncio.create_task(self.receiver.callback(message=message.message))
            self._running_tasks.add(task)
            task.add_done_callback(self._running_tasks.discard)


def dedup_of(broker: InMemoryBroker) -> RedisDeduplicationMiddleware:
    """The deduplication middleware on ``broker``."""
    (middleware,) = (m for m in broker.middlewares if isinstance(m, RedisDeduplicationMiddleware))
    return middleware


class LogRecords(logging.Handler):
    """Collects every record of the library's loggers, down to DEBUG."""

    def __init__(self) -> None:
        """Create an empty collection; :meth:`attach` starts collecting."""
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._logger = logging.getLogger(LOGGER_NAME)
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        """Keep ``record``."""
        self.records.append(record)

    def attach(self) -> LogRecords:
        """Start collecting."""
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def detach(self) -> None:
        """Stop collecting."""
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        """The formatted messages at ``level`` or above."""
        return [r.getMessage() for r in self.records if r.levelno >= level]

    def warnings(self, containing: str) -> list[str]:
        """The warnings whose message contains ``containing``."""
        return [m for m in self.messages(logging.WARNING) if containing in m]

    def text(self) -> str:
        """Everything logged, formatted with tracebacks, as one string."""
        formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
        return "\n".join(formatter.format(r) for r in self.records)


async def wait_until(
    condition: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.02
) -> float:
    """Poll ``condition`` until true; return how long it took. Fail after ``timeout``."""
    start = time.monotonic()
    while not await condition():
        if time.monotonic() - start > timeout:
            msg = f"condition not met within {timeout}s"
            raise AssertionError(msg)
        await asyncio.sleep(interval)
    return time.monotonic() - start


def admin(port: int, **options: Any) -> redis.Redis:
    """A plain synchronous client straight to the server (not through the proxy)."""
    return redis.Redis(port=port, decode_responses=True, socket_timeout=2, **options)


def lock_keys(client: redis.Redis, prefix: str) -> list[str]:
    """The lock keys under ``prefix``."""
    return sorted(str(k) for k in client.scan_iter(match=f"{prefix}:*"))
