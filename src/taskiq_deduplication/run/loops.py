"""One Redis client, lock store and heartbeat per event loop, closed with its loop.

Connections, futures and tasks belong to the event loop that made them, and a
middleware can be used from several: the worker's loop, a sync task that
enqueues with ``asyncio.run``, threads that run loops of their own. Each loop
gets a `LoopState` of its own on first use, so a heartbeat is stopped by the
tasks of its own loop and no call crosses loops.

A state ends when ``shutdown()`` closes it, or with its loop: ``asyncio.run``
(and ``asyncio.Runner``) close every open async generator before they close
the loop (``loop.shutdown_asyncgens()``), so each state parks one generator
whose ``finally`` sends what is still queued and closes the connections while
the loop can still run them. A loop closed without that step leaves its state
behind; it is dropped the next time a state is made.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from taskiq_deduplication.run.heartbeat import Heartbeat
from taskiq_deduplication.store.lock_store import LockStore

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable

    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    from taskiq_deduplication.observe.events import EventSink
    from taskiq_deduplication.observe.metrics import Metrics

    RedisClient = Redis | RedisCluster

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class LoopState:
    """What the middleware uses in one event loop."""

    loop: asyncio.AbstractEventLoop
    client: RedisClient
    owns_client: bool
    """Whether the middleware made the client, and so closes it."""
    locks: LockStore
    heartbeat: Heartbeat
    closer: AsyncGenerator[None, None] | None = field(default=None, repr=False)
    """Parked at its ``yield`` until the state closes; its ``finally`` closes it."""
    on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list, repr=False)
    """What else the state's loop keeps (the limits' wake-ups), closed first."""

    async def close(self) -> None:
        """Stop the heartbeat, send what is queued, close what the middleware opened."""
        if self.closer is not None:
            await self.closer.aclose()


class LoopStates:
    """The `LoopState` of every event loop that uses one middleware."""

    def __init__(
        self,
        make_client: Callable[[], tuple[RedisClient, bool]],
        events: EventSink,
        metrics: Callable[[], Metrics | None],
    ) -> None:
        """Make states whose client comes from ``make_client``: ``(client, owned)``.

        Their heartbeats tell ``events`` what they find; when ``metrics`` gives
        metrics, the states made from then on record into them.
        """
        self._make_client = make_client
        self._events = events
        self._metrics = metrics
        self._states: dict[asyncio.AbstractEventLoop, LoopState] = {}

    def __len__(self) -> int:
        """The number of loops with a state."""
        return len(self._states)

    def get(self) -> LoopState | None:
        """The state of the running loop, if it has one."""
        return self._states.get(asyncio.get_running_loop())

    async def current(self) -> LoopState:
        """The state of the running loop, made on first use."""
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            state = await self._start(loop)
        return state

    async def close_current(self) -> None:
        """Close the running loop's state, if any; the next use makes a new one."""
        state = self._states.get(asyncio.get_running_loop())
        if state is not None:
            await state.close()

    async def _start(self, loop: asyncio.AbstractEventLoop) -> LoopState:
        for ended in [other for other in self._states if other.is_closed()]:
            # Closed without shutdown_asyncgens(): nothing can run there any more.
            logger.debug("Dropping the deduplication state of a closed event loop")
            self._states.pop(ended).locks.abandon()
        client, owned = self._make_client()
        metrics = self._metrics()
        locks = LockStore(client, round_trip=metrics.round_trip if metrics else None)
        heartbeat = Heartbeat(locks, self._events, held=metrics.held if metrics else None)
        state = LoopState(loop, client, owned, locks, heartbeat)
        state.closer = self._close_with_loop(state)
        # Advancing it to its yield registers it with the loop's shutdown_asyncgens().
        # It reaches the yield without suspending, so no other caller in this loop
        # can make a second state in between.
        await state.closer.__anext__()
        self._states[loop] = state
        return state

    async def _close_with_loop(self, state: LoopState) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            if self._states.get(state.loop) is state:
                del self._states[state.loop]
            try:
                for close in state.on_close:
                    await close()
                await state.heartbeat.stop()
                await state.locks.close()
            finally:
                if state.owns_client:
                    await state.client.aclose()
