"""The soak's client: ``python -m tests.soak.client SECONDS RATE DUP_SHARE CHAIN_SHARE SEED``.

It starts every broker of :mod:`tests.soak.app` (each with its own middleware)
and sends ``work`` calls for SECONDS at about RATE calls a second, each in a
task of its own so that a slow ``kiq`` never holds the next one back. Each new
call picks a lock policy (:data:`POLICY_WEIGHTS`); a share :data:`LONG_SHARE`
of them run longer than the stream's ``idle_timeout`` and NATS' ``ack_wait``.
A share DUP_SHARE of the sends repeat a call sent in the last few seconds,
while the first may still be queued or running (a merging or debounced one
with another duration: its key is its ``fp``). A share CHAIN_SHARE of the list
broker's new calls are ``chain`` calls (a sync task that sends a ``work`` call
with ``asyncio.run``). Every send's outcome (accepted, duplicate, merged,
error) and latency go to the ledger's ``kiqs`` table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from taskiq_deduplication import DuplicateTaskError
from tests.soak.app import (
    ACK_WAIT,
    BROKERS,
    IDLE_TIMEOUT_MS,
    LOCK_TAKEN_AT,
    App,
    Ledger,
    SoakConfig,
    build,
    fingerprint,
)

#: No send may take longer than this: the client gives up on it (outcome ``error``).
HARD_CAP = 60.0
#: Sends in flight beyond which the client skips (and counts) new ones, to stay bounded.
MAX_IN_FLIGHT = 2000
#: How far back a duplicate picks the call it repeats (seconds).
RECENT = 3.0
#: How often the buffered outcomes are written to the ledger.
FLUSH_EVERY = 0.5
#: How often a new call picks each lock policy.
POLICY_WEIGHTS = {
    "finished": 40,
    "remembered": 15,
    "started": 15,
    "expired": 10,
    "merge": 10,
    "debounce": 10,
    "limited": 6,
}
#: Share of new calls that outlast the stream's idle_timeout and NATS' ack_wait.
LONG_SHARE = 0.1
#: How long those run, in ms.
LONG_MS = (int(max(IDLE_TIMEOUT_MS, ACK_WAIT * 1000)) + 500, int(ACK_WAIT * 1000) + 2500)


@dataclass(frozen=True)
class Call:
    """The arguments of one call: identical calls share their fingerprint."""

    fp: str
    ms: int
    fails: int
    policy: str = "finished"
    chain: bool = False
    """A ``chain`` call: a sync task that sends a ``work`` call from a second event loop."""


class Sender:
    """Sends calls and buffers their outcomes for the ledger."""

    def __init__(self, apps: dict[str, App], ledger: Ledger, rng: random.Random) -> None:
        """Send through ``apps``, write to ``ledger``, draw from ``rng``."""
        self.apps = apps
        self.ledger = ledger
        self.rng = rng
        self.rows: list[tuple[Any, ...]] = []
        self.recent: dict[str, deque[tuple[float, Call]]] = {kind: deque() for kind in apps}
        self.serial = 0
        self.skipped = 0
        self.in_flight: set[asyncio.Task[None]] = set()

    def next_call(self, kind: str, dup_share: float, chain_share: float) -> Call:
        """A new call, or with probability ``dup_share`` a recent one again."""
        now = time.monotonic()
        recent = self.recent[kind]
        while recent and recent[0][0] < now - RECENT:
            recent.popleft()
        if recent and self.rng.random() < dup_share:
            call = self.rng.choice(recent)[1]
            if call.policy in {"merge", "debounce"}:
                call = dataclasses.replace(call, ms=self.duration())
            return call
        self.serial += 1
        ms = self.duration()
        if kind == "redis-list" and self.rng.random() < chain_share:
            call = Call(fingerprint(kind, "chain", self.serial), ms, 0, chain=True)
        else:
            fails = self.rng.choices((0, 1, 2), weights=(80, 14, 6))[0]
            policy = self.rng.choices(list(POLICY_WEIGHTS), weights=list(POLICY_WEIGHTS.values()))
            call = Call(fingerprint(kind, policy[0], self.serial), ms, fails, policy[0])
        recent.append((now, call))
        return call

    def duration(self) -> int:
        """How long a new call runs, in ms: mostly short, sometimes past the brokers' timeouts."""
        if self.rng.random() < LONG_SHARE:
            return self.rng.randint(*LONG_MS)
        return self.rng.randint(20, 1500)

    async def send(self, kind: str, call: Call) -> None:
        """Send one call and buffer what came of it."""
        task_id = uuid.uuid4().hex
        taken: list[float] = []
        LOCK_TAKEN_AT.set(taken)
        wall, t0 = time.time(), time.monotonic()
        holder = error = None
        try:
            app = self.apps[kind]
            if call.chain:
                child = call.fp.replace(":chain:", ":child:")
                sending = (
                    app.chain.kicker()
                    .with_task_id(task_id)
                    .kiq(fp=call.fp, child=child, ms=call.ms)
                )
            else:
                sending = (
                    app.work[call.policy]
                    .kicker()
                    .with_task_id(task_id)
                    .kiq(fp=call.fp, ms=call.ms, fails=call.fails)
                )
            sent = await asyncio.wait_for(sending, HARD_CAP)
        except DuplicateTaskError as exc:
            outcome, holder = "duplicate", exc.holder_task_id
        except Exception as exc:  # noqa: BLE001 (every failure is an outcome to count)
            outcome, error = "error", f"{type(exc).__name__}: {exc}"[:300]
        else:
            # A call merged into its queued holder is handed the holder back.
            merged = sent.task_id != task_id
            outcome, holder = ("merged", sent.task_id) if merged else ("accepted", holder)
        done = time.monotonic()
        lock_s = (taken[0] if taken else done) - t0
        self.rows.append(
            (
                call.fp,
                task_id,
                kind,
                wall,
                wall + (done - t0),
                done - t0,
                lock_s,
                outcome,
                holder,
                error,
            )
        )

    async def flush(self) -> None:
        """Write the buffered outcomes."""
        rows, self.rows = self.rows, []
        await self.ledger.executemany(
            "INSERT INTO kiqs (fp, task_id, broker, started, ended, latency, lock_latency,"
            " outcome, holder, error) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            rows,
        )

    async def run(self, seconds: float, rate: float, dup_share: float, chain_share: float) -> None:
        """Send for ``seconds`` at about ``rate`` calls a second."""
        flusher = asyncio.create_task(self._flush_loop())
        deadline = time.monotonic() + seconds
        kinds = list(self.apps)
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(self.rng.expovariate(rate))
                if len(self.in_flight) >= MAX_IN_FLIGHT:
                    self.skipped += 1
                    continue
                kind = self.rng.choice(kinds)
                task = asyncio.create_task(
                    self.send(kind, self.next_call(kind, dup_share, chain_share))
                )
                self.in_flight.add(task)
                task.add_done_callback(self.in_flight.discard)
            if self.in_flight:
                await asyncio.wait(set(self.in_flight))
        finally:
            flusher.cancel()
            await self.flush()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            await self.flush()


async def main(
    seconds: float, rate: float, dup_share: float, chain_share: float, seed: int
) -> None:
    """Start every broker, send, stop them."""
    config = SoakConfig.from_env()
    apps = {kind: build(config, kind, client=True) for kind in BROKERS}
    ledger = Ledger(config)
    for app in apps.values():
        await app.broker.startup()
    sender = Sender(apps, ledger, random.Random(seed))
    try:
        await sender.run(seconds, rate, dup_share, chain_share)
    finally:
        await ledger.execute(
            "INSERT INTO notes (name, value) VALUES ('client_skipped', %s)", (str(sender.skipped),)
        )
        for app in apps.values():
            await app.broker.shutdown()
        await ledger.close()


if __name__ == "__main__":
    seconds_arg, rate_arg, share_arg, chain_arg, seed_arg = sys.argv[1:6]
    asyncio.run(
        main(float(seconds_arg), float(rate_arg), float(share_arg), float(chain_arg), int(seed_arg))
    )
