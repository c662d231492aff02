"""Why a ``taskiq worker`` on NATS may not stop after SIGTERM, and the setting that avoids it.

Stopping, taskiq's receiver cancels the read it has pending on the broker's
``listen()`` once, and waits for it without a timeout (taskiq 0.13,
``taskiq/receiver/receiver.py``, ``_close_prefetch_state``). taskiq-nats's pull
listener (0.7, ``taskiq_nats/broker.py``, ``PullBasedJetStreamBroker.listen``)
fetches in a loop and fetches again on every fetch timeout. With a
``pull_consume_timeout``, each idle fetch ends with a status reply from the
server; nats-py (2.16, ``nats/aio/subscription.py``, ``next_msg``) waits for it
with ``asyncio.wait_for``, which on Python 3.11 returns that reply and drops a
cancellation that comes in the same step. The listener then fetches on, and the
worker process waits for it until a message comes, or forever: about one stop
in a hundred of an idle worker process. Nothing of the middleware is involved.

Each test cancels the listener as the receiver does, in the very step the reply
reaches ``next_msg`` (the race made certain), or after a second when no reply
comes, and checks that the listener ends.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

import pytest

from tests.e2e.conftest import NATS_URL, require_broker_server

#: Longest the listener may take to end once cancelled.
STOP_WITHIN = 2.0
#: How long the test waits for a status reply to race with (ten 0.5 s fetches).
REPLY_WITHIN = 5.0


@pytest.mark.parametrize(
    "pull_consume_timeout",
    [
        None,  # taskiq-nats's default: no status replies, nothing to race with
        pytest.param(
            0.5,  # the e2e app's and soak's setting
            marks=pytest.mark.xfail(
                sys.version_info < (3, 12),
                reason="Python 3.11's asyncio.wait_for drops a cancellation that comes "
                "with the result; nats-py's next_msg() uses it (upstream, not ours)",
                strict=True,
            ),
        ),
    ],
    ids=["pull-timeout-unset", "pull-timeout-0.5"],
)
async def test_a_nats_pull_listener_ends_when_the_receiver_cancels_it(
    pull_consume_timeout: float | None,
) -> None:
    require_broker_server("nats")
    from taskiq_nats import PullBasedJetStreamBroker  # noqa: PLC0415 (only for NATS)

    name = f"stop-{uuid.uuid4().hex[:12]}"
    broker = PullBasedJetStreamBroker(
        NATS_URL,
        subject=name,
        stream_name=name,
        durable=name,
        pull_consume_timeout=pull_consume_timeout,
    )
    await broker.startup()
    try:
        listener = broker.listen()
        reading = asyncio.ensure_future(anext(listener))  # the receiver's pending read
        queue = broker.consumer._sub._pending_queue
        get = queue.get
        cancelled = asyncio.Event()

        async def get_then_cancel() -> Any:
            message = await get()
            queue.get = get  # type: ignore[method-assign]
            reading.cancel()  # the receiver stops, as the reply arrives
            cancelled.set()
            return message

        queue.get = get_then_cancel  # type: ignore[method-assign]
        # A reply reaches next_msg() by get() when it comes before nats-py's own
        # timeout of the fetch (else the next fetch takes it from the queue as
        # it starts): within a few fetches. Without a pull timeout none comes.
        fired = asyncio.ensure_future(cancelled.wait())
        wait = REPLY_WITHIN if pull_consume_timeout else 1.0
        await asyncio.wait({reading, fired}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        fired.cancel()
        if not cancelled.is_set():
            assert pull_consume_timeout is None, "no status reply reached next_msg()"
            reading.cancel()
        await asyncio.wait({reading}, timeout=STOP_WITHIN)
        stopped = reading.done()
        if not stopped:  # in a fetch of its own now, which a cancellation does end
            reading.cancel()
            await asyncio.wait({reading}, timeout=STOP_WITHIN)
        if reading.done():
            await listener.aclose()
        assert stopped, f"the listener went on fetching {STOP_WITHIN}s after it was cancelled"
        assert reading.cancelled(), "the listener read something from an empty stream"
    finally:
        await broker.js.delete_stream(name)
        await broker.shutdown()
