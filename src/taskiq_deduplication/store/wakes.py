"""Wake-ups: the channel on which a limit hands a freed slot to the run that waits for it.

``limit.lua`` hands a freed slot to the first run in line and publishes
``"<run token> <task_id> <delay>"`` on the limit's channel (the key of its
holders). Each event loop with runs that wait subscribes, over one connection
of its own, to the channels of their limits only, and wakes the one run named.
A message can be lost (a reconnection); the runs' lease refreshes find a slot
handed over all the same, within one refresh interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any, Final

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from taskiq_deduplication.store.call import REDIS_FAILURES

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from redis.asyncio.client import PubSub

    RedisClient = Redis | RedisCluster

logger = logging.getLogger(__name__)

#: What a cluster client's connections take that a client of one node takes too
#: (credentials, TLS, timeouts), not how the cluster client builds them.
_CLIENT_OPTIONS: Final = frozenset(inspect.signature(Redis.__init__).parameters) - {
    "self",
    "host",
    "port",
    "connection_pool",
    "single_connection_client",
}
#: Seconds a hand-over heard for a run not watched yet is kept for it, and how
#: many are kept at most (those of other processes' runs are heard too).
_EARLY_KEPT: Final = 5.0
_EARLY_MOST: Final = 1024
#: Seconds a waiter waits for its channel's subscription to be confirmed.
_CONFIRM_TIMEOUT: Final = 5.0
#: Seconds before the listener tries again after its connection failed.
_RETRY_AFTER: Final = 0.5


class Wakes:
    """The runs of one event loop that wait for a slot, each woken by its limit's channel."""

    def __init__(self, client: RedisClient) -> None:
        """Listen through ``client`` (a connection of its own, opened on first use)."""
        self._client = client
        self._pubsub: PubSub | None = None
        self._own: Redis | None = None
        self._waiters: dict[str, dict[str, asyncio.Future[float]]] = {}
        # Hand-overs heard for runs not watched yet: a run learns from its take's
        # reply that it waits, and the slot may be handed to it before it comes
        # to watch (a channel this loop listens to already). Kept briefly.
        self._early: dict[tuple[str, str], tuple[float, float]] = {}
        self._confirmed: dict[str, asyncio.Future[float]] = {}
        self._reader: asyncio.Task[None] | None = None
        # One (un)subscription at a time: redis-py's PubSub connects on the
        # first, and two at once would each open a connection of their own.
        self._subscribing = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()

    async def watch(
        self, channel: str, member: str, since: float
    ) -> tuple[asyncio.Future[float], bool]:
        """Wake ``member`` when ``channel`` names it: its future gets the delay to its start.

        ``since`` is the event loop's time when the run's take was made.
        Returns the future, and whether to look once more: the channel's
        subscription was not confirmed before ``since`` (a take made earlier
        may have been answered, and its slot handed over, before Redis had the
        subscription), or it failed (the refreshes wake the run all the same).
        Never raises: a failure to subscribe is logged.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[float] = loop.create_future()
        self._waiters.setdefault(channel, {})[member] = future
        early = self._early.pop((channel, member), None)
        if early is not None:
            future.set_result(early[0])
        confirmed = self._confirmed.get(channel)
        if confirmed is None:
            confirmed = self._confirmed[channel] = loop.create_future()
            self._spawn(self._subscribe(channel, confirmed))
        # Not wait_for: the confirmation is shared, and a waiter that gives up
        # must not cancel it for the others.
        await asyncio.wait([confirmed], timeout=_CONFIRM_TIMEOUT)
        if not confirmed.done() or confirmed.cancelled() or confirmed.exception() is not None:
            return future, True
        return future, confirmed.result() > since

    async def _subscribe(self, channel: str, confirmed: asyncio.Future[float]) -> None:
        """Subscribe to ``channel``; ``confirmed`` gets the loop's time of Redis's confirmation."""
        try:
            async with self._subscribing:
                await self._listener().subscribe(channel)
            self._read()
        except Exception as exc:  # noqa: BLE001 (any error: the refreshes wake the waiters)
            logger.warning(
                "Could not listen for the freed slots of %r (%s: %s); its waiting runs are "
                "woken by their refreshes instead",
                channel,
                type(exc).__name__,
                exc,
            )
            if self._confirmed.get(channel) is confirmed:
                del self._confirmed[channel]
            if not confirmed.done():
                confirmed.set_exception(exc)
                confirmed.exception()  # retrieved: each waiter looks again

    def forget(self, channel: str, member: str) -> None:
        """Stop waking ``member``; the last one of a channel unsubscribes from it."""
        members = self._waiters.get(channel)
        if members is None:
            return
        members.pop(member, None)
        if not members:
            del self._waiters[channel]
            confirmed = self._confirmed.pop(channel, None)
            if confirmed is not None and not confirmed.done():
                confirmed.cancel()
            if self._pubsub is not None:
                with contextlib.suppress(*REDIS_FAILURES, RuntimeError):
                    # Sent in the background: a waiter that got its slot does not wait for it.
                    self._spawn(self._unsubscribe(channel))

    def wake(self, channel: str, member: str, delay: float, *, heard: bool = False) -> None:
        """Wake ``member`` of ``channel`` (a refresh found it holds its slot, or it was ``heard``).

        A hand-over heard for a run not watched yet is kept for `_EARLY_KEPT`
        seconds: the run may be on its way to watch.
        """
        future = self._waiters.get(channel, {}).get(member)
        if future is not None:
            if not future.done():
                future.set_result(delay)
            return
        if heard:
            now = time.monotonic()
            if len(self._early) >= _EARLY_MOST:
                self._early = {k: v for k, v in self._early.items() if v[1] > now}
            if len(self._early) < _EARLY_MOST:
                self._early[channel, member] = (delay, now + _EARLY_KEPT)

    async def close(self) -> None:
        """Stop listening and close the connection."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(*REDIS_FAILURES):
                await pubsub.aclose()
        own, self._own = self._own, None
        if own is not None:
            with contextlib.suppress(*REDIS_FAILURES):
                await own.aclose()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background, kept until it is done."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _listener(self) -> PubSub:
        if self._pubsub is None:
            client = self._client
            if isinstance(client, RedisCluster):
                # A channel of PUBLISH reaches every node of a cluster: listen on one.
                node = client.get_default_node()
                kwargs: dict[str, Any] = {
                    name: value
                    for name, value in client.nodes_manager.connection_kwargs.items()
                    if name in _CLIENT_OPTIONS
                }
                self._own = Redis(host=node.host, port=int(node.port), **kwargs)
                client = self._own
            self._pubsub = client.pubsub()
        return self._pubsub

    async def _unsubscribe(self, channel: str) -> None:
        if channel in self._waiters or self._pubsub is None:
            return  # a run waits on it again
        async with self._subscribing:
            with contextlib.suppress(*REDIS_FAILURES):
                await self._pubsub.unsubscribe(channel)

    def _read(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        pubsub = self._pubsub
        if pubsub is None:  # closed meanwhile
            return
        while self._waiters or self._confirmed:
            try:
                message = await pubsub.get_message(timeout=1.0)
            except REDIS_FAILURES as exc:
                logger.debug("Listening for freed slots failed (%s); again", exc)
                await asyncio.sleep(_RETRY_AFTER)
                continue
            if message is None:
                continue
            kind = _text(message["type"])
            channel = _text(message["channel"]) if message["channel"] is not None else ""
            if kind == "subscribe":
                confirmed = self._confirmed.get(channel)
                if confirmed is not None and not confirmed.done():
                    confirmed.set_result(asyncio.get_running_loop().time())
            elif kind == "message":
                # "<run token> <task_id> <delay>": a task_id may hold spaces.
                member, _, delay = _text(message["data"]).rpartition(" ")
                if member and delay.lstrip("-").isdigit():  # else not ours: ignored
                    self.wake(channel, member, int(delay) / 1e6, heard=True)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
