"""A send of a locked task, from ``pre_send`` to ``post_send`` or the broker's refusal.

Plan the send (its key, its owner token, the grace TTL), take the lock in one
script, and say what became of it: taken, refused as a duplicate (or merged
into the queued holder, or joined by `kiq_or_join`), carried on by a retry, or
sent without a lock (``fail_open``, or a retry that found the lock taken).
Once the broker has the message, the lock gets its full TTL; when the broker
refuses it, the lock goes at once.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import TYPE_CHECKING, Final

from redis.asyncio.cluster import RedisCluster
from taskiq import InMemoryBroker, TaskiqMessage

from taskiq_deduplication.calls import joining, takes_task_lock
from taskiq_deduplication.exceptions import (
    UNSENT_HOLDER,
    DuplicateTaskError,
    InvalidSettingError,
)
from taskiq_deduplication.model import keys, settings
from taskiq_deduplication.model.formats import (
    MERGED_INTO_LABEL,
    NO_OWNER,
    RecordedLock,
    drop_lock_labels,
    fence_key,
    holder_task_id,
    merge_key,
    new_token,
    read_lock_labels,
    read_lock_value,
    record_tail,
    write_lock_labels,
)
from taskiq_deduplication.model.limits import LIMIT_LABEL_START, read_limit
from taskiq_deduplication.model.policies import RetrySend, Step
from taskiq_deduplication.observe import refusals
from taskiq_deduplication.observe.events import LockEventKind
from taskiq_deduplication.run.execution import Executions, Resent
from taskiq_deduplication.send.pending import PendingSend
from taskiq_deduplication.send.plan import SendPlan, plan_send
from taskiq_deduplication.store.call import RedisFailed
from taskiq_deduplication.store.lock_store import Acquired, Lock

if TYPE_CHECKING:
    from taskiq import BrokerMessage

    from taskiq_deduplication.model.settings import Options
    from taskiq_deduplication.observe.events import EventSink
    from taskiq_deduplication.run.loops import LoopStates
    from taskiq_deduplication.run.runs import Runs
    from taskiq_deduplication.send.pending import PendingSends

logger = logging.getLogger(__name__)

#: How long the lock of a send in flight lives before the broker accepts it.
GRACE_TTL: Final = 10


class Sends:
    """The sends of one middleware: each takes its lock, or is refused."""

    def __init__(  # noqa: PLR0913 (the middleware's parts a send uses, each named)
        self,
        options: Options,
        *,
        defaults: settings.Defaults,
        states: LoopStates,
        events: EventSink,
        runs: Runs,
        executions: Executions,
        pending: PendingSends,
    ) -> None:
        """Send with the middleware's parts; a retry from inside a run hands it to ``runs``."""
        self._options = options
        self._defaults = defaults
        self._states = states
        self._events = events
        self._runs = runs
        self._executions = executions
        self._pending = pending
        # Whether each task (by name) takes a TaskLock, so that its sends draw a fence.
        self._fenced: dict[str, bool] = {}

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        """Take the task's lock before the message goes to the broker (see the hook)."""
        limited = any(label.startswith(LIMIT_LABEL_START) for label in message.labels)
        if limited:
            read_limit(message.labels)  # a bad limit fails the kiq, as a bad lock label does
        send = settings.read_send_options(message.labels, self._defaults)
        if send is None:
            drop_lock_labels(message.labels)
            self._outcome(LockEventKind.OFF, message, None, None)
            return message
        plan = plan_send(
            message,
            send,
            prefix=self._options.key_prefix,
            running=self._executions.current(message.task_id),
            fenced=self._wants_fence(message.task_name),
        )
        if plan.keeps:
            return await self._keep(plan)
        return await self._take(plan, limited=limited)

    async def _take(self, plan: SendPlan, *, limited: bool) -> TaskiqMessage:
        """Take the send's own lock (a first send, or a retry that takes one), or be refused.

        Raises:
            DuplicateTaskError: The call is refused.
        """
        message = plan.message
        lock = Lock(plan.key, new_token(plan.digest), message.task_id, plan.options.ttl * 1000)
        # A limited run takes its slot in its claim's round trip: it keeps its claim.
        lease_ms = 0 if limited else self._run_lease_at_send(plan, lock)
        sent_at = time.monotonic()
        acquired = await self._acquire(plan, lock, for_run=bool(lease_ms))
        if acquired is None:  # Redis failed, and fail_open lets the send go
            return self._without_lock(plan)
        if acquired.holder is not None:
            return self._held(plan, acquired)
        if acquired.token is not None:  # the token its record made
            # Built, not dataclasses.replace(): that costs a kiq 2 us of its own.
            lock = Lock(lock.key, acquired.token, lock.task_id, lock.ttl_ms)
        running = plan.running
        if plan.earlier is not None:
            logger.debug(
                "Retry of task %s (%s) took over lock %r",
                message.task_name,
                message.task_id,
                plan.key,
            )
        if running is not None:
            await self._runs.hand_over(running, lock, message)
        self._record(plan, lock.token, acquired.fence)
        if self._events.active:  # inline: the one point every accepted send passes
            self._outcome(LockEventKind.LOCKED, message, plan.key, message.task_id)
        pending = PendingSend(
            lock,
            plan.merge_key,
            extends=lock.ttl_ms > GRACE_TTL * 1000,  # else the grace TTL is its TTL
            taken=True,
        )
        if acquired.run_token is not None:
            pending.run = Lock(plan.key, acquired.run_token, message.task_id, lease_ms)
            # Half the grace TTL it was taken for, counted from before it was sent.
            pending.run_until = sent_at + _grace_ms(lock) / 2000
        self._pending.add(pending)
        return message

    async def post_send(self, message: TaskiqMessage) -> None:
        """Give the lock its full TTL, now that the broker accepted the message (see the hook)."""
        send = self._pending.take(message.labels, message.task_id) or self._forgotten(message)
        if send is None or send.ended:
            return  # sent without a lock, or its run ended the lock already
        if send.run is not None:
            # Taken for a run inside kiq() that never began (the broker dropped
            # the message): nothing waits in a queue, and the grace TTL frees it.
            return
        lock = send.lock
        # A lock this send took tells that a broker accepted it (the extension
        # says so), even one whose TTL the extension leaves as it is.
        if not send.extends and send.merged_key is None and not send.taken:
            return
        state = self._states.get() or await self._states.current()
        if send.merged_key is not None:
            # Calls merge into its message from now on: a broker accepted it.
            ttl_ms = lock.ttl_ms if send.extends else 0
            await state.locks.accepted_detached(lock, send.merged_key, ttl_ms)
        else:
            await state.locks.extend_detached(lock, ttl_ms=None if send.extends else 0)

    def refused(self, message: BrokerMessage, error: Exception) -> None:
        """Release at once the lock of a send of this process that the broker refused.

        taskiq calls no hook then (``kiq`` raises ``SendTaskError``); the
        broker's ``kick`` tells us instead. Only a send still between its
        pre_send and post_send counts (a requeue from inside a run carries
        its run's lock, not a send's). Owner-checked and queued in order, so
        the caller's own retry finds the lock free. A send that ends without
        telling (the process dies, the kiq is cancelled) leaves its lock to
        the grace TTL.
        """
        send = self._pending.take(message.labels, message.task_id)
        if send is None or not send.taken or send.ended:
            return
        state = self._states.get()
        if state is None:
            return
        running = self._executions.current(message.task_id)
        if running is not None and running.resent is Resent.WITH_THE_LOCK:
            # A retry of this run that never went out: the run hands nothing on,
            # or a copy of it would find its call carried on by no one.
            running.resent = Resent.WITHOUT_A_LOCK
            if running.handed_to is not None:
                state.locks.release_detached(running.handed_to)
                running.handed_to = None
        logger.info(
            "Lock %r of task %s (%s) released: the broker refused the send (%s)",
            send.lock.key,
            message.task_name,
            message.task_id,
            type(error).__name__,
        )
        state.locks.release_unsent(send.run or send.lock, send.merged_key)

    def _forgotten(self, message: TaskiqMessage) -> PendingSend | None:
        """The send of ``message`` as its labels record it, when its record was forgotten.

        More than `MAX_SENDS_IN_FLIGHT` sends between their pre_send and
        post_send at once (a bulk enqueue of thousands) forget the oldest
        records; their locks still get their full TTL.
        """
        recorded = read_lock_labels(message.labels, message.task_id)
        if recorded is None or recorded.token == NO_OWNER:
            return None
        lock = Lock(recorded.key, recorded.token, message.task_id, recorded.ttl * 1000)
        merges = recorded.merge is not None
        merged_key = merge_key(self._options.key_prefix, lock.key) if merges else None
        return PendingSend(lock, merged_key, extends=lock.ttl_ms > GRACE_TTL * 1000, taken=True)

    def key_of(self, message: TaskiqMessage) -> str | None:
        """The key a first send of ``message`` takes, or ``None`` if it is not deduplicated.

        What ``pre_send`` computes, for ``taskiq dedup key``; raises as it does
        on a bad label or arguments that cannot be fingerprinted.
        """
        send = settings.read_send_options(message.labels, self._defaults)
        if send is None:
            return None
        return keys.lock_key_of(self._options.key_prefix, message, send)

    def _run_lease_at_send(self, plan: SendPlan, lock: Lock) -> int:
        """The lease (ms) to take ``lock`` on for a run that begins inside this ``kiq()``, or 0.

        An in-process broker that awaits the run inside its ``kick``
        (``InMemoryBroker(await_inplace=True)``) begins the run of a first send
        moments after its acquire. Its lock is then taken under the run's value
        (still marked in flight, on the grace TTL), and the run begins without
        waiting for a claim: it sets its lease on the way. Only a first send (no
        attempt's lock to carry on, so no copy or success to look for) of a
        plain exclusive ``"finished"`` lock (the lock its own run slot; no
        merged arguments, no fence, no limit).
        """
        send = plan.options
        broker = getattr(self._options, "broker", None)
        if (
            plan.earlier is not None
            or not send.exclusive
            or send.policy.at_start is not Step.REASSERT
            or send.merge is not None
            or plan.fenced
            or not isinstance(broker, InMemoryBroker)
            or not broker.await_inplace
            or type(broker).kick is not InMemoryBroker.kick  # a kick of its own may not run it
        ):
            return 0
        return self._runs.lease_of(plan.message, lock).ttl_ms

    async def _acquire(
        self, plan: SendPlan, lock: Lock, *, for_run: bool = False
    ) -> Acquired | None:
        """Take ``lock`` for the grace TTL, with its merged arguments and fence if it has them.

        ``for_run``: take it under the value of the run inside this ``kiq()``
        (`_run_lease_at_send`).

        A Redis error raises, or with ``fail_open`` is logged and gives ``None``.

        Raises:
            InvalidSettingError: The task merges its calls or takes a fence on a
                Redis Cluster, under a key_prefix without a hash tag.
        """
        state = self._states.get() or await self._states.current()
        message, send, earlier = plan.message, plan.options, plan.earlier
        prefix = self._options.key_prefix
        merging = plan.merge_key is not None
        if (
            (send.merge is not None or plan.fenced)
            and isinstance(state.client, RedisCluster)
            and "{" not in prefix
        ):
            msg = (
                f"task {message.task_name!r} merges its calls or takes a fence: on Redis "
                "Cluster that needs a key_prefix with a hash tag, such as '{dedup}', so "
                "that its lock and the keys beside it share a slot"
            )
            raise InvalidSettingError(msg)
        acquired = await state.locks.acquire(
            lock,
            _grace_ms(lock),
            replaces=earlier.value if earlier is not None else "",
            merge_key=plan.merge_key,
            arguments=self._serialise_arguments(message) if merging else b"",
            fence_key=fence_key(prefix) if plan.fenced else None,
            task_name=message.task_name if merging else "",
            record=record_tail(
                send.policy.name,
                message.task_name if self._options.record_task_name else None,
            ),
            for_run=for_run,
        )
        if isinstance(acquired, RedisFailed):
            if not self._options.fail_open:
                acquired.raise_error()
            exc = acquired.error
            logger.warning(
                "Could not take deduplication lock %r for task %s (%s): %s: %s; "
                "sending it without a lock (fail_open)",
                lock.key,
                message.task_name,
                message.task_id,
                type(exc).__name__,
                exc,
            )
            self._outcome(LockEventKind.FAIL_OPEN, message, lock.key, None, error=exc)
            return None
        return acquired

    async def _keep(self, plan: SendPlan) -> TaskiqMessage:
        """Send a retry with the lock of the attempt it continues, as that lock is.

        No Redis call, unless the task merges its calls: then one, so that
        calls merge into the retry while it waits in the queue.
        """
        message, earlier, running = plan.message, plan.earlier, plan.running
        assert earlier is not None  # noqa: S101 (a plan that keeps has one)
        if plan.merge_key is not None:
            await self._reopen_merge(message, earlier, plan.merge_key)
        if running is not None:
            await self._runs.hand_over(running, earlier, message)
            fence = running.fence
        else:
            fence = plan.attempt.fence if plan.attempt is not None else None
        self._record(plan, earlier.token, fence)
        self._outcome(LockEventKind.LOCKED, message, earlier.key, message.task_id)
        # Its post_send leaves the TTL alone, and only lets calls merge into it.
        if earlier.token != NO_OWNER:
            self._pending.add(PendingSend(earlier, plan.merge_key, extends=False, taken=False))
        return message

    def _wants_fence(self, task_name: str) -> bool:
        """Whether the task takes a `TaskLock`, looked up once per task name."""
        wants = self._fenced.get(task_name)
        if wants is None:
            broker = getattr(self._options, "broker", None)
            task = broker.find_task(task_name) if broker is not None else None
            wants = task is not None and takes_task_lock(task.original_func)
            self._fenced[task_name] = wants
        return wants

    async def _reopen_merge(self, message: TaskiqMessage, lock: Lock, merged_key: str) -> None:
        """Let later calls merge into a retry that keeps its lock as it is ("expired").

        Its attempt's run claimed the merged arguments; a call that comes while
        the retry waits in the queue merges into it, as under the other policies.
        """
        state = self._states.get() or await self._states.current()
        arguments = self._serialise_arguments(message)
        reopened = await state.locks.reopen_merge(lock, merged_key, arguments, message.task_name)
        if isinstance(reopened, RedisFailed):
            logger.warning(
                "Retry of task %s (%s) sent without taking merges: %s: %s",
                message.task_name,
                message.task_id,
                type(reopened.error).__name__,
                reopened.error,
            )

    def _held(self, plan: SendPlan, acquired: Acquired) -> TaskiqMessage:
        """What a send whose lock another holds becomes: refused, merged, or (a retry) sent bare.

        Raises:
            DuplicateTaskError: The call is refused.
        """
        assert acquired.holder is not None  # noqa: S101 (the caller checks)
        message, key = plan.message, plan.key
        holder_id = holder_task_id(acquired.holder)
        if plan.earlier is not None and plan.options.policy.retry is RetrySend.TAKE_IF_FREE:
            logger.info(
                "Retry of task %s (%s) sent without a lock: task %s, queued "
                "meanwhile, holds lock %r",
                message.task_name,
                message.task_id,
                holder_id,
                key,
            )
            self._outcome(LockEventKind.OFF, message, key, holder_id)
            return self._without_lock(plan)
        refused = self._refusal(plan, acquired.holder, acquired)
        if refused.merged and refused.holder_task_id is not None:
            return _merged_into(message, refused)
        raise refused

    def _refusal(self, plan: SendPlan, holder: str, acquired: Acquired) -> DuplicateTaskError:
        """The error for a call refused (or merged) because ``holder`` holds its lock."""
        message, key = plan.message, plan.key
        holder_id = holder_task_id(holder)
        same = keys.same_arguments(holder, plan.digest, plan.options)
        merged = acquired.merged
        # The holder's record says whether a broker has accepted its send (a
        # holder that merges calls says it with its merged arguments too).
        record = read_lock_value(holder)
        sent = record.sent if record is not None else None
        if acquired.pending:
            sent = False
        state = f", {UNSENT_HOLDER}" if sent is False else ""
        if merged:
            refusals.merged(message.task_name, message.task_id, holder_id, key)
            self._outcome(LockEventKind.MERGED, message, key, holder_id)
        else:
            # A caller that joins the holder asked for this: a join is its own
            # outcome, whatever its other arguments (with key fields, that they
            # differ is the point).
            marker = joining.get()
            joined = holder_id is not None and marker == []
            if marker == []:
                marker.append(True)
            holder = f"{holder_id}{state}"
            if joined:
                why = " (its own arguments differ)" if same is False else ""
                refusals.joined(message.task_name, message.task_id, holder, key, why=why)
                self._outcome(LockEventKind.JOINED, message, key, holder_id, holder_sent=sent)
            else:
                why = " with other arguments" if same is False else ""
                refusals.refused(message.task_name, message.task_id, holder, key, why=why)
                self._outcome(LockEventKind.DUPLICATE, message, key, holder_id, holder_sent=sent)
        return DuplicateTaskError(
            message.task_name,
            key,
            holder_id,
            merged=merged,
            same_arguments=same,
            holder_sent=sent,
        )

    def _outcome(  # noqa: PLR0913 (the fields of an event, each named)
        self,
        kind: LockEventKind,
        message: TaskiqMessage,
        key: str | None,
        holder: str | None,
        error: BaseException | None = None,
        *,
        holder_sent: bool | None = None,
    ) -> None:
        """Tell subscribers (and the send span) what became of ``message``'s send."""
        if self._events.active:  # checked first: every send comes this way
            self._events.emit(
                kind,
                message.task_name,
                message.task_id,
                key,
                holder,
                error=error,
                message=message,
                holder_sent=holder_sent,
            )

    def _serialise_arguments(self, message: TaskiqMessage) -> bytes:
        """The call's arguments as the broker sends them (its formatter and serializer)."""
        call = TaskiqMessage(
            task_id="", task_name="", labels={}, args=message.args, kwargs=message.kwargs
        )
        # base64: any serializer's bytes survive a client that decodes replies.
        return base64.b64encode(self._options.broker.formatter.dumps(call).message)

    def _without_lock(self, plan: SendPlan) -> TaskiqMessage:
        """Let the message go out without a lock (fail-open, or a retry that found none).

        An exclusive task still records its key, under no owner token: its run
        takes the run slot of that key as any other run does.
        """
        if plan.running is not None:
            # The retry holds no lock, so the run ends its own as a failure does.
            plan.running.resent = Resent.WITHOUT_A_LOCK
        if plan.options.exclusive:
            self._record(plan, NO_OWNER)
        else:
            drop_lock_labels(plan.message.labels)
        return plan.message

    @staticmethod
    def _record(plan: SendPlan, token: str, fence: int | None = None) -> None:
        """Record on the message the lock it is sent with.

        A retry (a message that carries its attempt's lock already) keeps the
        token of the call's first send beside its own: a copy of any attempt
        then finds the call's success, whichever attempt succeeded.
        """
        send, message, attempt = plan.options, plan.message, plan.attempt
        recorded = RecordedLock(
            plan.key,
            token,
            send.ttl,
            send.policy.name,
            send.success_ttl,
            fence,
            send.merge if plan.merge_key is not None else None,
            exclusive=send.exclusive,
            first=attempt.call if attempt is not None else None,
        )
        write_lock_labels(message.labels, recorded, message.task_id)


def _grace_ms(lock: Lock) -> int:
    """The TTL of ``lock`` while its send is in flight: the grace TTL, or its own if shorter."""
    return min(GRACE_TTL * 1000, lock.ttl_ms)


def _merged_into(message: TaskiqMessage, merged: DuplicateTaskError) -> TaskiqMessage:
    """The message of a call merged into its queued holder: the holder's, not to be sent again.

    The call is not refused: it runs, as the holder, with its arguments. So
    ``kiq()`` returns as for any send, with a handle of the holder's task_id
    (its result is the call's), and the broker's ``kick`` sends nothing
    (`MERGED_INTO_LABEL`). `kiq_or_join` reads the merge from ``joining``.
    """
    assert merged.holder_task_id is not None  # noqa: S101 (the caller checks)
    drop_lock_labels(message.labels)
    message.labels[MERGED_INTO_LABEL] = merged.holder_task_id
    message.task_id = merged.holder_task_id
    marker = joining.get()
    if marker is not None:
        marker.append(merged)
    return message
