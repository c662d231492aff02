"""A run of a locked task, from ``pre_execute`` to ``post_execute``.

At its start a run does what its policy's row says (`model/policies.py`): re-assert
the lock and keep it alive, release it, or leave it to its TTL; an exclusive
run first claims its run slot (waiting while another run of its key goes on),
a merging one takes the latest arguments, a debounced one waits out its quiet
period, a fenced one draws its fence. At its end it does the step of its
outcome: success, failure, or passed on to a later delivery.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from redis.asyncio.cluster import RedisCluster
from taskiq.exceptions import NoResultError

from taskiq_deduplication.model import settings
from taskiq_deduplication.model.formats import (
    NO_OWNER,
    SUCCEEDED_MARK,
    RecordedLock,
    done_key,
    fence_key,
    merge_key,
    new_run_token,
    read_lock_labels,
    run_key,
)
from taskiq_deduplication.model.policies import FINISHED, POLICIES, Step
from taskiq_deduplication.observe.events import LockEventKind
from taskiq_deduplication.run import log as say
from taskiq_deduplication.run.copies import answer_of_copy, leave_out_body
from taskiq_deduplication.run.execution import Execution, Executions, Resent
from taskiq_deduplication.run.heartbeat import Beat
from taskiq_deduplication.store.call import RedisFailed
from taskiq_deduplication.store.lock_store import Claimed, Done, Lock, Reasserted

if TYPE_CHECKING:
    from taskiq import TaskiqMessage, TaskiqResult

    from taskiq_deduplication.model.settings import Options
    from taskiq_deduplication.observe.events import EventSink
    from taskiq_deduplication.run.limits import LimitedRun, Limits
    from taskiq_deduplication.run.loops import LoopState, LoopStates

logger = logging.getLogger(__name__)

#: What the claim of a run that begins with its lock its own finds (as most do).
_BEGUN: Final = Claimed()
_VERBS: Final = {Step.REASSERT: "re-assert", Step.REMEMBER: "release", Step.RELEASE: "release"}
# What a claim script does at the start of a run, for each policy's step.
_CLAIM_STEPS: Final = {Step.REASSERT: "reassert", Step.RELEASE: "release"}
#: Seconds the re-assert at a run's start and the step at its end may wait to
#: share a round trip with other runs' (only while other runs go on and their
#: calls come this often). Measured on a worker draining 1 ms tasks: 0.5 ms
#: shares too few round trips, 2 ms no more than 1 ms.
_RUN_LINGER: Final = 0.001
#: Seconds a run slot beside the lock ("started", "expired") lives unrefreshed,
#: unless ``running_ttl`` says: how long a crashed run holds up the next one.
_SLOT_LEASE: Final = 10
#: Longest wait, in seconds, between two looks of a run that waits for another
#: run of its key (a quarter of the heartbeat interval when that is shorter).
_MAX_POLL: Final = 5.0
#: More than two looks' time that a run's success is kept for the copies that
#: waited for it, when the task does not remember its success.
_WAITED_MARGIN_MS: Final = 1000


class SendsInFlight(Protocol):
    """What a run tells the sends of this process still between ``pre_send`` and ``post_send``.

    An in-process broker runs a task inside its ``kiq()``: the run may end the
    lock before its send's ``post_send`` extends it (`send/pending.py` keeps them).
    """

    def end(self, lock: Lock) -> bool:
        """Note that a run ends ``lock``; whether a send of it is still in flight."""

    def end_failed(self, lock: Lock) -> None:
        """The end of ``lock`` failed: its send's ``post_send`` extends it after all."""

    def run_taken(self, lock: Lock) -> tuple[Lock, bool] | None:
        """The run slot the send of ``lock`` took for its run, and whether it surely holds still."""


class Runs:
    """The runs of one middleware's locked tasks: their starts and their ends."""

    def __init__(  # noqa: PLR0913, PLR0917 (the middleware's parts, each its own)
        self,
        options: Options,
        states: LoopStates,
        events: EventSink,
        executions: Executions,
        pending: SendsInFlight,
        limits: Limits,
    ) -> None:
        """Follow runs with the middleware's options, loop states, events, sends and limits."""
        self._options = options
        self._limits = limits
        self._states = states
        self._events = events
        self._executions = executions
        self._pending = pending
        # Tasks whose runs cannot be exclusive here (said once each).
        self._not_exclusive: set[str] = set()

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        """Begin the run of a locked or limited task (the ``pre_execute`` hook)."""
        recorded = read_lock_labels(message.labels, message.task_id)
        rule = self._limits.rule_of(message)
        if recorded is None and rule is None:
            return message
        state = self._states.get() or await self._states.current()
        limited = None if rule is None else await self._limits.begin(rule, message, state)
        if limited is not None and not await self._limit_before_lock(
            limited, message, locked=recorded is not None
        ):
            return message
        if recorded is None:
            return message
        execution = self._execution(message, recorded, state)
        self._executions.begin(execution)
        if limited is not None and not await self._limit_first(execution, limited, message):
            return message
        await self._start(execution, recorded, message)
        if execution.skipped:
            if limited is not None:
                self._limits.abandon(limited)
            leave_out_body(message, answer_of_copy(execution, message, self._options.broker))
            return message
        policy = execution.policy
        if self._options.heartbeat and (
            execution.run is not None or (policy.heartbeat and execution.owned)
        ):
            lease = execution.run or execution.lease
            execution.beat = Beat(lease, message.task_name, self._interval(execution, lease))
            state.heartbeat.add(execution.beat)
        if limited is not None and not limited.entered:
            # The heartbeat keeps the lock while the run waits for its limit.
            await self._limits.enter(limited, message, self._options.broker)
            if limited.requeued:
                execution.sent_back = True
                execution.stop_heartbeat()
        return message

    async def _limit_before_lock(
        self, limited: LimitedRun, message: TaskiqMessage, *, locked: bool
    ) -> bool:
        """What a limited run does before its lock; whether the lock's start follows.

        A run marked to go back goes to the broker before it touches its lock
        or its limit (one the broker refuses goes on as any other, and waits
        here); a run without a lock takes its slot now.
        """
        if limited.requeued:
            await self._limits.send_back(limited, message, self._options.broker)
            if limited.requeued:
                return False
        if not locked:
            await self._limits.enter(limited, message, self._options.broker)
            return False
        return True

    async def _limit_first(
        self, execution: Execution, limited: LimitedRun, message: TaskiqMessage
    ) -> bool:
        """Take the run's slot before its claim, or with it; whether the run goes on.

        Under ``"started"`` a run that waits for its limit is still queued: it
        keeps its lock until it holds its slot, so it takes the slot first.
        Otherwise the take rides in the claim's round trip.
        """
        if limited.entered:  # it waited already: its message could not go back
            return True
        if execution.policy.at_start is Step.RELEASE:
            await self._limits.enter(limited, message, self._options.broker)
            execution.sent_back = limited.requeued
            return not limited.requeued
        self._limits.take_soon(limited)
        return True

    def _execution(
        self, message: TaskiqMessage, recorded: RecordedLock, state: LoopState
    ) -> Execution:
        """The run of ``message`` with the lock its labels record, as it begins."""
        # A policy this version does not know (a newer sender) holds the lock
        # the longest way: until the task finishes.
        policy = POLICIES.get(recorded.until, FINISHED)
        lock = Lock(recorded.key, recorded.token, message.task_id, recorded.ttl * 1000)
        execution = Execution(
            lock,
            self.lease_of(message, lock) if policy.heartbeat else lock,
            policy,
            recorded.success_ttl if policy.remembers_success else 0,
            message.task_name,
            state,
            *Executions.counts(message),
        )
        execution.fence = recorded.fence
        # Sent without a lock: it owns none, unless its run takes it as its run slot.
        execution.owned = recorded.token != NO_OWNER
        return execution

    async def _start(
        self, execution: Execution, recorded: RecordedLock, message: TaskiqMessage
    ) -> None:
        """Do the policy's step at the start: a claim, a re-assert, or the step alone."""
        # A "finished" lock is its own run slot: its send may have taken it for
        # this run, moments ago, inside kiq() (an in-process broker).
        taken = (
            self._pending.run_taken(execution.lock)
            if recorded.exclusive and execution.policy.at_start is Step.REASSERT
            else None
        )
        run: Lock | None = None
        holds = False
        if taken is not None:
            run, holds = taken
        elif recorded.exclusive:
            run = self._run_slot(execution, recorded, execution.state)
        if run is not None:
            execution.done = self._done(execution, recorded, execution.state)
        if run is not None and holds:
            # While that lock surely holds, the run begins and sets its lease
            # on the way (the mark of a send in flight goes with it); later, its
            # claim finds the run's own value there.
            await execution.state.locks.extend_detached(run)
            self._begun(execution, recorded, message, run, _BEGUN)
            return
        if run is not None or recorded.merge is not None or recorded.fence is not None:
            await self._claim(execution, recorded, message, run)
        elif execution.policy.at_start is Step.REASSERT:
            await self._reassert(execution, message)
        else:
            await self._apply(execution.policy.at_start, execution, message)

    def on_error(self, message: TaskiqMessage) -> None:
        """Stop the heartbeat: the task itself is over. The lock goes in ``post_execute``."""
        execution = self._executions.current(message.task_id)
        if execution is not None:
            execution.stop_heartbeat()

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        """End the run of a locked task (the ``post_execute`` hook)."""
        self._limits.end(message, result)
        execution = self._executions.current(message.task_id)
        if execution is None:
            return
        self._executions.end(execution)
        if execution.skipped:
            if execution.keeps_stored_result and not result.is_err:
                result.error = NoResultError()  # taskiq then stores nothing over it
            return
        if execution.resent is Resent.WITH_THE_LOCK:
            return
        policy = execution.policy
        passed_on = execution.passed_on(message, result)
        succeeded = not passed_on and execution.resent is None and not result.is_err
        run = execution.run
        if run is not None and run.key == execution.lock.key:
            await self._finish(execution, message, passed_on=passed_on, succeeded=succeeded)
            return
        if execution.owned:
            if passed_on:
                step = policy.passed_on
            elif succeeded:
                step = policy.on_success
            else:
                step = policy.on_failure
            await self._apply(step, execution, message)
        if run is not None:
            await self._finish(execution, message, passed_on=passed_on, succeeded=succeeded)

    async def _apply(self, step: Step, execution: Execution, message: TaskiqMessage) -> None:
        """Do ``step`` to the run's lock in Redis; errors are logged, never raised."""
        lock = execution.lock
        locks = execution.state.locks
        if step is Step.NOTHING:
            return
        if step is Step.EXTEND:
            await locks.extend_detached(lock)
            return
        # The send's own post_send may still be to come (a worker in the sending
        # process): from the moment the end is on its way, it must not extend
        # the lock, or a success TTL would be stretched back to the full TTL.
        ending = step is not Step.REASSERT and self._pending.end(lock)
        linger = _linger(execution)
        if step is Step.REASSERT:
            done: object = await locks.reassert([lock], linger=linger)
        elif step is Step.REMEMBER and execution.success_ttl:
            done = await locks.extend(lock, execution.success_ttl * 1000, linger=linger)
        else:
            done = await locks.release(lock, linger=linger)
            if done is True:
                self._events.emit(
                    LockEventKind.RELEASED, message.task_name, message.task_id, lock.key, None
                )
        if isinstance(done, RedisFailed):
            if ending:  # the end failed: its post_send extends the lock after all
                self._pending.end_failed(lock)
            logger.warning(
                "Could not %s lock %r of task %s (%s): %s: %s; it expires in %ds",
                "keep" if step is Step.REMEMBER and execution.success_ttl else _VERBS[step],
                lock.key,
                message.task_name,
                message.task_id,
                type(done.error).__name__,
                done.error,
                execution.lease.ttl_ms // 1000,
            )

    async def _reassert(self, execution: Execution, message: TaskiqMessage) -> None:
        """Re-assert the lock of a run that begins, on its lease; say what was found."""
        lock = execution.lock
        replies = await execution.state.locks.reassert([execution.lease], linger=_linger(execution))
        if isinstance(replies, RedisFailed):
            logger.warning(
                "Could not re-assert lock %r of task %s (%s): %s: %s",
                lock.key,
                message.task_name,
                message.task_id,
                type(replies.error).__name__,
                replies.error,
            )
            return
        _started(self._events, execution, message, replies[0])

    async def _claim(
        self,
        execution: Execution,
        recorded: RecordedLock,
        message: TaskiqMessage,
        run: Lock | None,
    ) -> None:
        """Begin a run that is exclusive, merges calls or has a fence, in one script.

        An exclusive run first waits, polling, while another run of its key
        goes on; a debounce waits out its quiet period. The claim replaces the
        policy's step at the start (one round trip, as that step is); each
        wait adds one per look.
        """
        lease = execution.lease
        step = _CLAIM_STEPS.get(execution.policy.at_start, "nothing")
        merging = recorded.merge is not None
        keys = {
            "merge_key": merge_key(self._options.key_prefix, lease.key) if merging else None,
            "fence_key": fence_key(self._options.key_prefix)
            if recorded.fence is not None
            else None,
        }
        locks = execution.state.locks
        waited = False
        failing: _Failing | None = None
        while True:
            claimed = await locks.claim(
                lease,
                step=step,
                debounce=recorded.merge or (0, 0),
                run=run,
                done=execution.done,
                linger=_linger(execution),
                **keys,
            )
            if isinstance(claimed, RedisFailed):
                if failing is None:
                    failing = self._failing(execution, recorded, message, run, claimed.error)
                delay = failing.delay(self._poll(execution, run))
                if delay is None:
                    if failing.waited:
                        say.gave_up_waiting(execution, message)
                    return
                await asyncio.sleep(delay)
                continue
            # Redis answered: a later outage is measured from its own start, or a
            # copy that waited through one short outage would run at the next.
            failing = None
            if self._skips(execution, message, claimed):
                return
            if not claimed.wait_ms:
                break
            # A run that waits (a copy for its run, a debounce) holds no slot.
            self._limits.put_back(self._limits.current(execution.lock.task_id))
            if claimed.waiting_for is None:  # a debounce: the lock was kept for one lease
                await asyncio.sleep(min(claimed.wait_ms, lease.ttl_ms // 3) / 1000)
                continue
            if not waited:
                waited = True
                say.waits(self._events, execution, message, claimed.waiting_for)
            await asyncio.sleep(min(self._poll(execution, run), claimed.wait_ms / 1000))
        self._begun(execution, recorded, message, run, claimed)

    def _skips(self, execution: Execution, message: TaskiqMessage, claimed: Claimed) -> bool:
        """Whether the claim says this delivery must not run its body; if so, say it."""
        if claimed.copy_of_success:
            execution.skipped = True
            say.copy_of_success(self._events, execution, message, self._options)
        elif claimed.skipped_for is not None:
            execution.skipped = True
            # A copy of an attempt that a retry carries on: the retry stores the result.
            execution.keeps_stored_result = not claimed.skipped_for.startswith(SUCCEEDED_MARK)
            say.skipped(self._events, execution, message, claimed.skipped_for)
        return execution.skipped

    def _failing(
        self,
        execution: Execution,
        recorded: RecordedLock,
        message: TaskiqMessage,
        run: Lock | None,
        error: Exception,
    ) -> _Failing:
        """A claim that failed on a Redis error: how long the run tries again, said once.

        An exclusive run waits for Redis, for at most its run slot's lease:
        another run of its key may go on, and past that lease it would have
        lapsed in the same outage (unless that run still reaches Redis: a
        worker cut off from it, the one case a fence tells). With
        ``fail_open``, and a run that is not exclusive, it runs at once.
        """
        waits = 0.0 if run is None or self._options.fail_open else run.ttl_ms / 1000
        say.claim_failed(execution, recorded, message, error, waits=waits)
        return _Failing(asyncio.get_running_loop().time() + waits, waited=bool(waits))

    def _begun(
        self,
        execution: Execution,
        recorded: RecordedLock,
        message: TaskiqMessage,
        run: Lock | None,
        claimed: Claimed,
    ) -> None:
        """Take in what the claim found as the run begins: its slot, fence, lock, arguments."""
        lease = execution.lease
        execution.run = run
        if (run is not None and run.key == lease.key) or execution.policy.at_start is Step.RELEASE:
            # The claim put its run token in place of the send's, or released the
            # lock: the send's extension, still to come when an in-process broker
            # runs the task inside kiq(), would find another owner. It is not sent.
            self._pending.end(execution.lock)
        if claimed.fence is not None:
            execution.fence = claimed.fence
        if recorded.token == NO_OWNER:
            # Sent without a lock: it owns none (unless the run slot is its lock).
            execution.owned = run is not None and run.key == lease.key
        elif run is not None and run.key == lease.key and isinstance(claimed.outcome, str):
            say.took_over(self._events, execution, message, claimed.outcome)
        else:
            _started(self._events, execution, message, claimed.outcome)
        if claimed.arguments is not None:
            latest = self._options.broker.formatter.loads(base64.b64decode(claimed.arguments))
            message.args, message.kwargs = latest.args, latest.kwargs

    def _run_slot(
        self, execution: Execution, recorded: RecordedLock, state: LoopState
    ) -> Lock | None:
        """The run slot an exclusive run is to hold, under a new run token.

        A ``"finished"`` lock is its own run slot; the other policies keep one
        beside the lock (on a cluster that needs the prefix's hash tag: without
        one, their runs are not exclusive, which is said once per task).
        """
        lease = execution.lease
        token = new_run_token(recorded.token)
        if execution.policy.at_start is Step.REASSERT:
            return Lock(lease.key, token, lease.task_id, lease.ttl_ms)
        key = run_key(self._options.key_prefix, lease.key)
        if key is None or (
            isinstance(state.client, RedisCluster) and "{" not in self._options.key_prefix
        ):
            if execution.task_name not in self._not_exclusive:
                self._not_exclusive.add(execution.task_name)
                logger.warning(
                    "Runs of task %s are not exclusive: under deduplication_until=%r its "
                    "run slot lives beside its lock, which on Redis Cluster needs a "
                    "key_prefix with a hash tag, such as '{dedup}'",
                    execution.task_name,
                    execution.policy.name,
                )
            return None
        # The slot outlives no crashed run by more than a short lease, which the
        # heartbeat keeps (without the heartbeat it must last the whole run).
        # The lease is the run's, not the call's: a short TTL ("expired" windows
        # of a few seconds) would leave the heartbeat too little room to ride
        # out a Redis outage of a second or two, and let another run in.
        ttl_ms = lease.ttl_ms
        if self._options.heartbeat:
            ttl_ms = (self._options.running_ttl or _SLOT_LEASE) * 1000
        return Lock(key, token, lease.task_id, ttl_ms)

    def _done(self, execution: Execution, recorded: RecordedLock, state: LoopState) -> Done | None:
        """Where an exclusive run's call is remembered once it succeeds (`done_key`)."""
        window = self._options.redelivery_window
        if not window:
            return None
        key = done_key(
            self._options.key_prefix,
            execution.lock.key,
            execution.lock.task_id,
            cluster=isinstance(state.client, RedisCluster),
        )
        return None if key is None else Done(key, recorded.call, window * 1000)

    def _poll(self, execution: Execution, run: Lock | None) -> float:
        """Seconds between two looks of a run that waits for another run of its key."""
        return min(self._interval(execution, run) / 4, _MAX_POLL)

    async def _finish(
        self, execution: Execution, message: TaskiqMessage, *, passed_on: bool, succeeded: bool
    ) -> None:
        """End an exclusive run's hold on its run slot; errors are logged, never raised."""
        run = execution.run
        assert run is not None  # noqa: S101 (the callers check)
        locks = execution.state.locks
        # Only a success remembered (success TTL) keeps the lock; a failure
        # and a success without one release it (a "finished" lock is its slot).
        remembered = execution.success_ttl * 1000 if succeeded else 0
        waited = int(2 * self._poll(execution, run) * 1000) + _WAITED_MARGIN_MS
        how = "succeeded" if succeeded else "failed"
        if run.key != execution.lock.key:
            # A slot beside the lock: what the run's result means for later
            # calls is the lock's, so its end goes without a round trip of its
            # own. A copy waiting for the slot looks again until it is freed.
            await locks.finish_detached(
                run,
                how,
                remembered,
                waited_ms=waited,
                done=execution.done,
                what=f"free the run slot {run.key!r} of task {message.task_name} "
                f"({message.task_id}), which expires in {run.ttl_ms // 1000}s",
            )
            return
        linger = _linger(execution)
        if passed_on:
            # The requeued message finds its own lock, for its full TTL.
            ended = await locks.hand_over(run, execution.lock, linger=linger)
        else:
            ended = await locks.finish(
                run, how, remembered, waited_ms=waited, done=execution.done, linger=linger
            )
            if ended is True and not remembered:
                self._events.emit(
                    LockEventKind.RELEASED, message.task_name, message.task_id, run.key, None
                )
        if isinstance(ended, RedisFailed):
            if passed_on:
                what = "hand on"
            else:
                what = "keep" if succeeded and execution.success_ttl else "release"
            logger.warning(
                "Could not %s lock %r of task %s (%s): %s: %s; it expires in %ds",
                what,
                run.key,
                message.task_name,
                message.task_id,
                type(ended.error).__name__,
                ended.error,
                run.ttl_ms // 1000,
            )

    async def hand_over(self, running: Execution, to: Lock, message: TaskiqMessage) -> None:
        """Hand the run to the retry that carries it on with the lock ``to``.

        The run's heartbeat stops (the retry's run keeps the lock alive), its
        end leaves the lock to the retry, and a run slot beside the lock goes
        to the retry too. (A ``"finished"`` lock is its own run slot: the
        retry's send took it over.)
        """
        running.resent = Resent.WITH_THE_LOCK
        running.stop_heartbeat()
        run = running.run
        if run is None or run.key == running.lock.key:
            return
        handed = Lock(run.key, to.token, to.task_id, to.ttl_ms)
        running.handed_to = handed
        handed_over = await running.state.locks.hand_over(run, handed)
        if isinstance(handed_over, RedisFailed):
            logger.warning(
                "Could not hand the run of task %s (%s) in %r to its retry: %s: %s; "
                "the retry may wait for it until it expires in %ds",
                message.task_name,
                message.task_id,
                run.key,
                type(handed_over.error).__name__,
                handed_over.error,
                run.ttl_ms // 1000,
            )
        running.run = None

    def lease_of(self, message: TaskiqMessage, lock: Lock) -> Lock:
        """The lock as its running task keeps it: on the running lease, if there is one."""
        seconds = settings.read_running_ttl(message.labels, default=self._options.running_lease)
        if seconds is None or seconds * 1000 >= lock.ttl_ms or not self._options.heartbeat:
            return lock
        return Lock(lock.key, lock.token, lock.task_id, seconds * 1000)

    def _interval(self, execution: Execution, lease: Lock | None = None) -> float:
        """Seconds between two refreshes of ``lease`` (by default the run's lease)."""
        ttl = (lease or execution.lease).ttl_ms / 1000
        interval = self._options.heartbeat_interval or max(ttl / 3, 1.0)
        # A refresh less often than half the TTL would let the lock lapse.
        return min(interval, ttl / 2)


def _started(
    events: EventSink, execution: Execution, message: TaskiqMessage, outcome: Reasserted | str
) -> None:
    """Take in what a run found of its lock as it began, and say it: lost, it owns none."""
    say.started(events, execution, message, outcome)
    if isinstance(outcome, str):
        execution.owned = False


@dataclass(slots=True)
class _Failing:
    """A run whose claim failed on a Redis error: until when it tries again."""

    until: float
    """The event loop's time when it gives up and runs without its claim."""
    waited: bool
    """Whether it waits for Redis at all (an exclusive run without fail_open)."""

    def delay(self, poll: float) -> float | None:
        """Seconds to wait before the next try, or ``None`` to run without the claim."""
        left = self.until - asyncio.get_running_loop().time()
        return None if left <= 0 else min(poll, left)


def _linger(execution: Execution) -> float:
    """How long a call of ``execution``'s may wait to share a round trip with other runs'.

    A run alone in its event loop (a worker's only task, a sequential in-place
    run) has no one to wait for. Other runs are those the loop's heartbeat
    keeps alive; this run's own beat is not among them at its start (not added
    yet) nor at its end (stopped first).
    """
    return _RUN_LINGER if len(execution.state.heartbeat) else 0.0
