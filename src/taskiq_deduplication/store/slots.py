"""The slots of limits in Redis: take one (or a place in line), free it, keep it alive.

One script, ``lua/limit.lua``, does all three on the keys of one limit (one
hash slot on a cluster), through the lock store's pipeline: a run's take goes
in the same batch as its claim, its free rides with its finish. As every
operation of the store, each answers with a named outcome or `RedisFailed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from taskiq_deduplication.store.call import REDIS_FAILURES, RedisFailed

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Sequence

    from redis.commands.core import AsyncScript

    from taskiq_deduplication.model.limits import LimitKeys, Rate
    from taskiq_deduplication.store.pipeline import Pipeline

#: Most holders and waiters of one limit refreshed by one call.
_MAX_PER_KEEP: Final = 200


@dataclass(frozen=True, slots=True)
class Slot:
    """One run's place in a limit: as a holder of a slot, or in its waiting line."""

    keys: LimitKeys
    task_id: str
    token: str
    """The run's own token: a copy of its message (same task_id) has another."""
    lease_ms: int
    """How long the place outlives its worker unrefreshed."""

    @property
    def member(self) -> str:
        """The run in the waiting line, and in what a freed slot's channel says."""
        return f"{self.token} {self.task_id}"


@dataclass(frozen=True, slots=True)
class Taken:
    """The run holds its slot, or its start in the rate: it may start in ``delay`` seconds."""

    delay: float


@dataclass(frozen=True, slots=True)
class Waits:
    """The run waits in line for a slot, behind ``ahead`` others."""

    ahead: int


@dataclass(frozen=True, slots=True)
class Kept:
    """What a refresh found of one place: held (``delay`` to its start), waiting, or lost."""

    held: bool
    waiting: bool
    delay: float = 0.0


class SlotStore:
    """The limit operations, on the pipeline of a `LockStore`."""

    def __init__(self, pipeline: Pipeline, script: AsyncScript) -> None:
        """Call ``script`` (``limit.lua``) through ``pipeline``."""
        self._pipeline = pipeline
        self._script = script

    def take_soon(self, slot: Slot, concurrency: int | None, rate: Rate | None) -> Taking:
        """Take a slot for ``slot``'s run, in the batch of the next call made in this turn.

        The reply is awaited with `Taking.outcome`; a claim made right after
        this carries it in its own round trip.
        """
        args: list[str | int] = [
            "take",
            slot.task_id,
            slot.token,
            concurrency or 0,
            slot.lease_ms,
            0 if rate is None else rate.interval_us,
            0 if rate is None else rate.tolerance_us,
            "" if rate is None else str(rate),
        ]
        try:
            future = self._pipeline.call_soon(self._script, slot.keys.all, args)
        except REDIS_FAILURES as exc:
            return Taking(None, RedisFailed(exc))
        return Taking(future, None)

    async def take(
        self, slot: Slot, concurrency: int | None, rate: Rate | None
    ) -> Taken | Waits | RedisFailed:
        """Take a slot for ``slot``'s run now: one round trip."""
        return await self.take_soon(slot, concurrency, rate).outcome()

    def free(self, slot: Slot) -> None:
        """Free ``slot``'s slot, or its place in line, soon; the reply is not awaited.

        Owner-checked by the run's token: a copy of the message frees nothing
        of its run's. The slot goes to the first waiter in the same script.
        """
        self._pipeline.queue(
            self._script,
            slot.keys.all,
            ["free", slot.task_id, slot.token],
            f"free the slot of task {slot.task_id} in {slot.keys.holders!r}",
        )

    async def keep(self, slots: Sequence[Slot]) -> list[Kept] | RedisFailed:
        """Refresh the leases of ``slots`` (held or waiting), all in one round trip."""
        groups: dict[tuple[str, int], list[int]] = {}
        for index, slot in enumerate(slots):
            groups.setdefault((slot.keys.holders, slot.lease_ms), []).append(index)
        calls: list[tuple[AsyncScript, list[str], list[str | int]]] = []
        order: list[int] = []
        for (_, lease_ms), indices in groups.items():
            for start in range(0, len(indices), _MAX_PER_KEEP):
                chunk = indices[start : start + _MAX_PER_KEEP]
                args: list[str | int] = ["keep", lease_ms]
                for i in chunk:
                    args += [slots[i].task_id, slots[i].token]
                calls.append((self._script, slots[chunk[0]].keys.all, args))
                order += chunk
        try:
            replies = await self._pipeline.call_many(calls)
        except REDIS_FAILURES as exc:
            return RedisFailed(exc)
        kept: list[Kept] = [Kept(held=False, waiting=False)] * len(slots)
        flat = (reply for chunk_replies in replies for reply in chunk_replies)
        for index, (state, delay_us) in zip(order, flat, strict=True):
            kept[index] = Kept(held=state == 1, waiting=state == 2, delay=int(delay_us) / 1e6)  # noqa: PLR2004 (the script's "waits")
        return kept


@dataclass(frozen=True, slots=True)
class Taking:
    """A take on its way: its reply, or the failure that stopped it before it went."""

    future: asyncio.Future[Any] | None
    failed: RedisFailed | None

    async def outcome(self) -> Taken | Waits | RedisFailed:
        """What the take found: the slot, a place in line, or why Redis gave no answer."""
        if self.failed is not None:
            return self.failed
        assert self.future is not None  # noqa: S101 (one of the two is set)
        try:
            state, number = await self.future
        except REDIS_FAILURES as exc:
            return RedisFailed(exc)
        if state == 1:
            return Taken(int(number) / 1e6)
        return Waits(int(number))

    def drop(self) -> None:
        """Nobody will read the reply (the run ended before it came): retrieve its error."""
        if self.future is not None:
            self.future.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
