"""Two small real brokers for tests where the queue itself matters.

Both are ``InMemoryBroker`` with one change to ``kick``: ``HoldingBroker`` keeps
the messages until the test delivers them (a queue the test controls, so a task
can wait "in the queue" while the test looks at its lock); ``RefusingBroker``
refuses every message, as a broker that is down does.
"""

from __future__ import annotations

from taskiq import BrokerMessage, InMemoryBroker


class HoldingBroker(InMemoryBroker):
    """Keeps sent messages until :meth:`deliver` runs them, in order."""

    def __init__(self, await_inplace: bool = False) -> None:
        super().__init__(await_inplace=await_inplace)
        self.queued: list[BrokerMessage] = []

    async def kick(self, message: BrokerMessage) -> None:
        self.queued.append(message)

    async def deliver(self) -> None:
        """Run every queued message through the worker side, one after the other."""
        while self.queued:
            message = self.queued.pop(0)
            await self.receiver.callback(message=message.message)


class BrokerDownError(ConnectionError):
    """What the refusing broker raises."""


class RefusingBroker(InMemoryBroker):
    """Fails every send, like a broker that cannot be reached."""

    async def kick(self, message: BrokerMessage) -> None:
        msg = f"broker unreachable, {message.task_name} not queued"
        raise BrokerDownError(msg)
