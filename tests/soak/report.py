"""What the soak's ledger says: invariants checked from the outside, and figures.

Everything here reads the ledger's rows (plain dicts) and the locks found at
the end; nothing asks the system under test. Each anomaly is put in a class;
the classes in :data:`DOCUMENTED` are windows that the documentation admits
(a Redis restart loses every lock, an at-most-once broker loses the messages of
a killed worker, ...). Everything else is a breach, and the soak exits 1.

Two runs of one lock key (one fingerprint: the soak's fingerprints name their
broker and policy) never overlap, whatever the policy and whoever sent them,
redelivered copies included: only :data:`OVERLAP_WINDOWS` explain an overlap,
and a lease that lapsed under a worker cut off from Redis is counted on its own
line.

A copy of a message whose run succeeded never runs its body again, with or
without a success TTL, for as long as the library remembers the success for
copies (its ``redelivery_window``; without one, every copy counts): counted by
task id. Every call whose body succeeded has a result stored for its caller.
A copy that is left out is invisible to a middleware registered after
deduplication: it reads the arguments and hears of no error. A new send within
a success TTL is refused: counted, not checked.

The bodies of the "limited" task never run more than its limit at once, on all
four brokers together (``over the limit``): a run's body lies within the time
its run held its slot. Only a Redis restart (it forgets who holds a slot) and a
slot's lease lapsed in an outage explain more. And once everything has ended, no
slot of a limit (nor a place in its line) is still kept alive (``slots never
freed``): one whose worker is gone lapses within its lease, and is only counted.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import Any

from tests.soak.app import (
    AT_LEAST_ONCE,
    EXPIRED_TTL,
    LIMIT,
    MAX_ATTEMPTS,
    POLICIES,
    SUCCESS_TTL,
    policy_of,
)

REDIS_FAULTS = frozenset({"redis-restart", "redis-pause", "redis-cut"})
#: A lock is released by the worker after the task's end is stamped; allow this
#: long for the release to reach Redis before a refusal counts as stale.
RELEASE_MARGIN = 2.0
#: The lease of a run slot beside its lock, without ``running_ttl`` (the middleware's own).
SLOT_LEASE = 10.0
#: The lease of a slot of a limit: the middleware's running lease (the soak sets
#: no ``running_ttl``), refreshed every third of it while its run goes on.
LIMIT_LEASE = 30.0
#: The limited task's runs: the lock policy of their fingerprints.
LIMITED = "limited"

# Classes of anomalies the documentation admits.
LOST_IN_RESTART = "locks lost in a Redis restart"
LONG_PAUSE = "Redis paused longer than the TTL"
FAIL_OPEN = "sent without a lock (fail_open) during a Redis fault"
SIGKILL_REDELIVERED = "after a SIGKILL on a redelivering broker"
CUT_REDELIVERED = "redelivered after a broker connection cut"
QUEUED_TOO_LONG = "queued longer than the TTL"
KIQ_FAILED_BUT_SENT = "its kiq failed, but the message was queued"
LIST_LOST_KILL = "lost with a killed worker (at-most-once broker)"
LIST_LOST_BROKER = "lost in a broker fault (at-most-once broker)"
KILLED_NOT_REDELIVERED_LIST = "killed mid-run, not redelivered (at-most-once broker)"
WORKER_DIED_LIST = "its worker died on a broker error, not redelivered (at-most-once broker)"
RETRY_REFUSED_IN_FAULT = "retry not sent: Redis or broker fault"
RELEASE_LOST = "release lost in a Redis fault (lock lives out its TTL)"
HOLDER_KILLED = "holder was killed (lock lives out its TTL)"
HOLDER_LOST = "holder's message was lost"
LEASE_LAPSED = "lease lapsed under a worker cut off from Redis (fenced)"
SUCCESS_FORGOTTEN = "copy after the redelivery window (the success no longer remembered)"
REMEMBERED_RAN_AGAIN = "ran again after a success the lock remembered"
RAN_AGAIN = "ran again after a success, within the redelivery window"
COPIES_RUN = "its copies run by design (not exclusive, or not deduplicated)"
SUCCESS_KILLED = "its worker was killed before the success could reach Redis"
RESULT_LOST_AT_MOST_ONCE = "its worker died before storing it (at-most-once broker)"
RESULT_LOST_WORKER_DIED = "its worker died before storing it, and no copy stored one"
RESULT_NEVER_STORED = "no result stored"
ARGS_UNREADABLE = "pre_execute could not read the arguments"
ON_ERROR_CUT_SHORT = "on_error of a body cut short by a worker stop"
ON_ERROR_UNENDED = "on_error of a body that never ended"
ON_ERROR_AFTER_OK = "on_error after the body succeeded"
#: Where the on_error of a delivery whose body never ran is classed: this, then the error's type.
ON_ERROR_NO_BODY = "on_error, body not run"
SUCCESS_NOT_WRITTEN = "success not written: Redis unreachable as its run ended"
RETRY_SEND_FAILED = "its retry's send failed: lock released, message delivered again"
NEVER_RAN_AT_LEAST_ONCE = "never ran on an at-least-once broker"
SLOT_LAPSING = "its worker is gone (it lapses within its lease)"
SLOT_KEPT = "kept alive after every run had ended"
#: The only windows in which two runs of one lock key may overlap.
OVERLAP_WINDOWS = frozenset({LOST_IN_RESTART, LONG_PAUSE, LEASE_LAPSED, FAIL_OPEN})
#: Policies under which a second send is refused while the first is queued or running.
REFUSING_POLICIES = frozenset({"finished", "remembered"})
DOCUMENTED = frozenset(
    {
        LOST_IN_RESTART,
        LONG_PAUSE,
        FAIL_OPEN,
        SIGKILL_REDELIVERED,
        CUT_REDELIVERED,
        QUEUED_TOO_LONG,
        KIQ_FAILED_BUT_SENT,
        LIST_LOST_KILL,
        LIST_LOST_BROKER,
        KILLED_NOT_REDELIVERED_LIST,
        WORKER_DIED_LIST,
        RETRY_REFUSED_IN_FAULT,
        RELEASE_LOST,
        HOLDER_KILLED,
        HOLDER_LOST,
        LEASE_LAPSED,
        SUCCESS_FORGOTTEN,
        SUCCESS_NOT_WRITTEN,
        RETRY_SEND_FAILED,
        COPIES_RUN,
        SUCCESS_KILLED,
        RESULT_LOST_AT_MOST_ONCE,
        ON_ERROR_CUT_SHORT,
    }
)
#: The windows in which a copy of a success may run its body again.
RAN_AGAIN_WINDOWS = frozenset(
    {
        SUCCESS_FORGOTTEN,
        COPIES_RUN,
        LOST_IN_RESTART,
        SUCCESS_KILLED,
        SUCCESS_NOT_WRITTEN,
        LEASE_LAPSED,
    }
)
#: The documented windows of each invariant.
WINDOWS: dict[str, frozenset[str]] = {
    "overlaps": OVERLAP_WINDOWS,
    "ran_again": RAN_AGAIN_WINDOWS,
    "reruns_by_task": RAN_AGAIN_WINDOWS,
    "lost_results": frozenset({RESULT_LOST_AT_MOST_ONCE}),
    "errors_seen": frozenset({ON_ERROR_CUT_SHORT}),
    "let_through": DOCUMENTED,
    "never_ran": DOCUMENTED,
    "never_completed": DOCUMENTED,
    "stale_refusals": DOCUMENTED,
    "over_limit": frozenset({LOST_IN_RESTART, LEASE_LAPSED}),
    "slots_left": frozenset({SLOT_LAPSING}),
}
INF = float("inf")


class Ledger:
    """The ledger's rows, indexed for the checks."""

    def __init__(self, data: dict[str, list[dict[str, Any]]], options: dict[str, Any]) -> None:
        """Index ``data`` (table -> rows) for a run with ``options``."""
        self.options = options
        self.ttl: float = options["ttl"]
        self.timeout: float = options["socket_timeout"]
        self.runs = data["runs"]
        self.kiqs = data["kiqs"]
        self.faults = data["faults"]
        self.procs = data["procs"]
        self.rss = data["rss"]
        self.notes = {row["name"]: row["value"] for row in data["notes"]}
        self.send_failures: dict[str, list[float]] = defaultdict(list)
        for row in data.get("send_failures", []):
            self.send_failures[row["task_id"]].append(row["at"])
        window = options.get("redelivery_window")
        self.window: float = INF if window is None else float(window)
        """How long after a success a copy is told (the library's ``redelivery_window``)."""
        self.hooks = data.get("hooks", [])
        self.results_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in sorted(data.get("results", []), key=lambda r: r["at"]):
            self.results_of[row["task_id"]].append(row)
        self.end_of_run = max(
            [r["ended"] or r["started"] for r in self.runs] + [k["ended"] for k in self.kiqs] + [0]
        )
        self.seen = {p["pid"] for p in self.procs}
        """Every process the sampler saw alive at least once."""
        self.death: dict[int, tuple[str, float]] = {
            p["pid"]: (p["fate"], p["last_seen"]) for p in self.procs if p["fate"] != "alive"
        }
        # The latency checks are the client's: a worker's send (from the chain
        # task) is timed as a whole, broker included.
        self.client_kiqs = [k for k in self.kiqs if k["source"] == "client"]
        self.accepted = {k["task_id"]: k for k in self.kiqs if k["outcome"] == "accepted"}
        self.kiq_of = {k["task_id"]: k for k in self.kiqs}
        self.runs_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.runs_by_fp: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for run in self.runs:
            self.runs_of[run["task_id"]].append(run)
            self.runs_by_fp[run["fp"]].append(run)
        for runs in self.runs_of.values():
            runs.sort(key=lambda r: r["started"])
        self.run_in: dict[str, dict[str, Any]] = {
            run["delivery"]: run for run in self.runs if run.get("delivery")
        }
        """The run of each delivery that the observer middleware tagged."""
        self.fail_open: set[str] = set(options.get("fail_open", ("redis-list",)))

    def killed(self, run: dict[str, Any]) -> bool:
        """Whether the process of ``run`` was killed (SIGKILL, or SIGTERM cut short)."""
        fate = self.death.get(run["pid"], ("alive", 0.0))[0]
        return fate in {"sigkill", "sigterm+kill"}

    def end(self, run: dict[str, Any]) -> float:
        """When ``run`` ended: its stamp, else its process's death, else the end of the run."""
        if run["ended"] is not None:
            return float(run["ended"])
        if run["pid"] in self.death:
            return self.death[run["pid"]][1]
        return float(self.end_of_run)

    def faults_in(
        self, kinds: set[str] | frozenset[str], start: float, end: float
    ) -> list[dict[str, Any]]:
        """Faults of ``kinds`` that overlap ``[start, end]``."""
        return [
            f
            for f in self.faults
            if (f["kind"] in kinds or f"{f['kind']}:{f['target']}" in kinds)
            and f["started"] <= end
            and f["ended"] >= start
        ]

    def final_end(self, task_id: str) -> float | None:
        """When the last run of ``task_id`` ended, if it ran at all."""
        runs = self.runs_of.get(task_id)
        return max(self.end(r) for r in runs) if runs else None

    # Classification

    def why_two_at_once(
        self, first: str, second: str, second_broker: str, window_end: float
    ) -> str:
        """Why the lock of ``first`` did not stop ``second``; ``"unexplained"`` if nothing does."""
        ka, kb = self.kiq_of.get(first), self.kiq_of.get(second)
        runs_a = self.runs_of.get(first, [])
        start = ka["started"] if ka else (runs_a[0]["started"] if runs_a else window_end)
        if self.faults_in({"redis-restart"}, start, window_end):
            return LOST_IN_RESTART
        if any(
            f["ended"] - f["started"] > self.ttl
            for f in self.faults_in({"redis-pause"}, start, window_end)
        ):
            return LONG_PAUSE
        lease = float(self.options.get("running_ttl") or self.ttl)
        if any(
            f["ended"] - f["started"] >= lease - 1.0
            for f in self.faults_in({"redis-cut"}, start, window_end)
        ):
            return LEASE_LAPSED
        if (
            kb is None
            or kb["outcome"] != "accepted"
            or (ka is not None and ka["outcome"] != "accepted")
        ):
            return KIQ_FAILED_BUT_SENT
        if second_broker in self.fail_open and self.faults_in(
            REDIS_FAULTS, kb["started"] - self.timeout - 1.0, kb["ended"]
        ):
            return FAIL_OPEN
        if (
            ka is not None
            and ka["broker"] in self.fail_open
            and self.faults_in(REDIS_FAULTS, ka["started"] - self.timeout - 1.0, ka["ended"])
        ):
            return FAIL_OPEN
        if self.retried_without_lock(first) or self.retried_without_lock(second):
            return FAIL_OPEN
        if kb is not None and self.retry_send_failed(first, kb["started"]):
            return RETRY_SEND_FAILED
        if any(self.died(r) for r in runs_a) and runs_a[0]["broker"] == "rabbitmq":
            return SIGKILL_REDELIVERED
        if ka is not None:
            first_start = runs_a[0]["started"] if runs_a else INF
            # When the second send took its lock: after its kiq began, by the
            # lock part of its latency (a kiq that began a moment before the
            # first lock ran out may take it a moment after).
            taken = kb["started"] + (kb.get("lock_latency") or 0.0)
            if min(first_start, taken) - ka["ended"] > self.ttl:
                return QUEUED_TOO_LONG
        return "unexplained"

    def retried_without_lock(self, task_id: str) -> bool:
        """Whether a retry of ``task_id`` was sent, with ``fail_open``, during a Redis fault."""
        runs = self.runs_of.get(task_id, [])
        if not runs or runs[0]["broker"] not in self.fail_open:
            return False
        return any(
            earlier["ended"] is not None
            and self.faults_in(
                REDIS_FAULTS, earlier["ended"] - 0.5, earlier["ended"] + self.timeout + 0.5
            )
            for earlier, later in itertools.pairwise(runs)
            if later["attempt"] > earlier["attempt"]
        )

    def retry_send_failed(self, task_id: str, at: float) -> bool:
        """Whether a failed run of ``task_id`` ended before ``at`` with no retry sent.

        The worker wrote the failed send (a retry's) to the ledger, or Redis
        failed as the retry was sent (its ``kiq`` raised, and the middleware
        undid the acquire that may have landed), and the next run is a copy of
        the same attempt, delivered again: the error left the message
        unacknowledged.
        """
        runs = self.runs_of.get(task_id, [])
        return any(
            earlier["outcome"] == "failed"
            and later["attempt"] == earlier["attempt"]
            and earlier["ended"] is not None
            and earlier["ended"] <= at <= later["started"]
            and (
                any(earlier["ended"] - 0.5 <= t <= at for t in self.send_failures[task_id])
                or self.faults_in(
                    REDIS_FAULTS, earlier["ended"] - 0.5, earlier["ended"] + self.timeout + 0.5
                )
            )
            for earlier, later in itertools.pairwise(runs)
        )

    def died(self, run: dict[str, Any]) -> bool:
        """Whether the process of ``run`` ended before the soak stopped it."""
        fate = self.death.get(run["pid"], ("alive", 0.0))[0]
        return fate not in {"alive", "stopped"}

    def why_redelivered(self, a: dict[str, Any], b: dict[str, Any]) -> str:
        """Why one attempt of a task ran twice at once."""
        if self.faults_in({f"broker-cut:{a['broker']}"}, a["started"], b["started"]):
            return CUT_REDELIVERED
        if self.died(a) and a["broker"] == "rabbitmq":
            return SIGKILL_REDELIVERED
        return "redelivered (unexplained)"


def lease(led: Ledger, fp: str) -> float:
    """How long the run slot of ``fp`` outlives a worker that can no longer refresh it.

    A ``"finished"`` lock is its own slot, on the running lease (the TTL); the
    other policies keep the slot beside the lock on a lease of its own,
    :data:`SLOT_LEASE` (the middleware's default) or the running lease.
    """
    running = led.options.get("running_ttl")
    # By the lock's policy, not the soak's name for the task: "merge" runs
    # under "started" too, with its run slot beside the lock.
    until = POLICIES.get(policy_of(fp), {}).get("deduplication_until", "finished")
    if until in {"started", "expired"}:
        return float(running or SLOT_LEASE)
    return float(running) if running else led.ttl


def gave_up_waiting(led: Ledger, lapse: float, started: float) -> bool:
    """Whether a run that began at ``started`` may have waited a lease for Redis.

    An outage at least ``lapse`` long that still went on within a socket
    timeout of the start: the run's claim failed for a whole lease, and it ran.
    """
    return any(
        f["ended"] - f["started"] >= lapse
        for f in led.faults_in({"redis-pause", "redis-cut"}, started - led.timeout - 1.0, started)
    )


def why_overlap(led: Ledger, fp: str, a: dict[str, Any], b: dict[str, Any]) -> str:
    """Why run ``b`` of lock key ``fp`` started while run ``a`` still ran."""
    ka = led.kiq_of.get(a["task_id"])
    since = min(a["started"], ka["started"]) if ka else a["started"]
    if led.faults_in({"redis-restart"}, since, b["started"]):
        return LOST_IN_RESTART
    # A's lease lapsed in an outage while it ran; or b gave up waiting for Redis
    # after a lease of silence, the outage still going on as b began.
    lapse = lease(led, fp) - 1.0
    if any(
        f["ended"] - f["started"] >= lapse
        for f in led.faults_in({"redis-pause", "redis-cut"}, a["started"], b["started"])
    ) or gave_up_waiting(led, lapse, b["started"]):
        return LEASE_LAPSED
    for one in (b, a):  # a run whose own claim failed open holds no run slot
        if one["broker"] in led.fail_open and led.faults_in(
            REDIS_FAULTS, one["started"] - led.timeout - 1.0, one["started"] + 1.0
        ):
            return FAIL_OPEN
    if a["task_id"] == b["task_id"]:
        return led.why_redelivered(a, b)
    kb = led.kiq_of.get(b["task_id"])
    return led.why_two_at_once(
        a["task_id"], b["task_id"], b["broker"], kb["ended"] if kb else b["started"]
    )


def overlaps(led: Ledger) -> list[dict[str, Any]]:
    """Pairs of runs of one lock key (fingerprint) that ran at the same time, with their class."""
    by_fp: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in led.runs:
        by_fp[run["fp"]].append(run)
    found = []
    for fp, runs in by_fp.items():
        runs.sort(key=lambda r: r["started"])
        for i, a in enumerate(runs):
            end_a = led.end(a)
            for b in runs[i + 1 :]:
                if b["started"] >= end_a:
                    break
                found.append(
                    {
                        "fp": fp,
                        "broker": a["broker"],
                        "policy": policy_of(fp),
                        "same_task": a["task_id"] == b["task_id"],
                        "class": why_overlap(led, fp, a, b),
                        "a": (a["task_id"], a["attempt"], a["pid"], a["started"], end_a),
                        "b": (b["task_id"], b["attempt"], b["pid"], b["started"], led.end(b)),
                    }
                )
    return found


def interval(led: Ledger, fp: str) -> float:
    """The heartbeat's interval for the run slot of ``fp`` in the soak's workers."""
    return min(max(led.ttl / 3, 1.0), lease(led, fp) / 2)


def lost_in_restart(led: Ledger, task_id: str, ok: dict[str, Any], later: dict[str, Any]) -> bool:
    """Whether a Redis restart explains a copy of ``task_id`` run after its success ``ok``.

    A restart after the success emptied what remembered it; one as it ended
    kept it from being written, and emptied the run slot too. One before it
    explains the copy only where another run of the key began after the
    restart (another send let in by the emptied lock, or a copy that took it
    back): that run held the lock when ``ok`` ended, so ``ok``'s success could
    not be written, or that run's success replaced it.
    """
    if led.faults_in({"redis-restart"}, ok["ended"] - led.timeout - 0.5, ok["ended"] + 0.5):
        # A restart as the run ended: its end could not write the success, and
        # the restart took the run slot that would have held a copy off for a lease.
        return True
    first = led.kiq_of.get(task_id)
    since = (first["started"] if first else ok["started"]) - led.ttl
    for restart in led.faults_in({"redis-restart"}, since, later["started"]):
        if restart["started"] >= ok["ended"]:
            return True
        if any(
            run is not ok and run is not later and restart["started"] <= run["started"]
            for run in led.runs_by_fp[later["fp"]]
            if run["started"] < later["started"]
        ):
            return True
    return False


def copies_run(fp: str) -> bool:
    """Whether the copies of a call of ``fp`` run again by design.

    A task with ``deduplication_exclusive=False`` runs a copy at once, beside
    the first run; one with ``deduplication=False`` has no lock at all. Both
    are documented. The soak has no such task in its ledger today (its one
    undeduplicated task, ``poke``, writes nothing there); a policy of
    :data:`POLICIES` that gets either label is excluded here.
    """
    labels = POLICIES.get(policy_of(fp), {})
    return labels.get("deduplication_exclusive") is False or labels.get("deduplication") is False


def killed_before_success_written(led: Ledger, ok: dict[str, Any]) -> bool:
    """Whether the worker of the run ``ok`` was killed between its body's end and its success.

    The body's end is stamped before the middleware writes the success to
    Redis (one round trip, at most a socket timeout): a worker killed in
    between leaves nothing in Redis to tell a copy, which then runs once the
    run's lease lapses. No lock can close that window.
    """
    if not led.killed(ok) or ok["ended"] is None:
        return False
    died = led.death[ok["pid"]][1]
    return bool(ok["ended"] - 0.5 <= died <= ok["ended"] + led.timeout + 1.0)


def ran_again(led: Ledger) -> list[dict[str, Any]]:
    """Runs of a task that started after one of its runs had succeeded, with their class.

    A copy of a message whose run succeeded must not run its body, whatever
    the policy and with or without a success TTL, while the library remembers
    the success: for the success TTL, and for its ``redelivery_window`` (the
    report's ``redelivery_window`` option; none given: for ever). The windows
    are those that empty or never fill that memory: a Redis restart, a success
    whose end could not reach Redis or whose worker was killed before it did,
    a copy that waited a whole lease for Redis.
    """
    found = []
    for task_id, runs in led.runs_of.items():
        ok = next((r for r in runs if r["outcome"] == "ok"), None)
        if ok is None:
            continue
        for later in runs:
            if later is ok or later["started"] < ok["ended"]:
                continue  # before the success ended: an overlap, counted there
            fp = later["fp"]
            after = later["started"] - ok["ended"]
            remembered = policy_of(fp) == "remembered"
            window = max(led.window, SUCCESS_TTL) if remembered else led.window
            lapse = lease(led, fp) - 1.0
            if copies_run(fp):
                why = COPIES_RUN
            elif after > window:
                why = SUCCESS_FORGOTTEN
            elif lost_in_restart(led, task_id, ok, later):
                why = LOST_IN_RESTART
            elif killed_before_success_written(led, ok):
                why = SUCCESS_KILLED
            elif led.faults_in(
                REDIS_FAULTS, ok["ended"] - led.timeout - 0.5, ok["ended"] + 0.5
            ) and later["started"] >= ok["ended"] + lapse - interval(led, fp):
                # The end could not write the success: the run slot lives out
                # its lease (refreshed until the body ended), then a copy runs.
                why = SUCCESS_NOT_WRITTEN
            elif gave_up_waiting(led, lapse, later["started"]):
                why = LEASE_LAPSED  # it waited a whole lease for Redis, then ran
            elif remembered and after <= SUCCESS_TTL:
                why = REMEMBERED_RAN_AGAIN
            else:
                why = RAN_AGAIN
            found.append(
                {
                    "task_id": task_id,
                    "fp": fp,
                    "policy": policy_of(fp),
                    "broker": later["broker"],
                    "class": why,
                    "after": after,
                }
            )
    return found


def reruns_by_task(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One item per task id whose body ran again after a success: its worst copy.

    A task id with a copy outside the windows is counted in that copy's class,
    else in the class of its first copy.
    """
    by_task: dict[str, dict[str, Any]] = {}
    for item in found:
        kept = by_task.get(item["task_id"])
        if kept is None or (
            kept["class"] in RAN_AGAIN_WINDOWS and item["class"] not in RAN_AGAIN_WINDOWS
        ):
            by_task[item["task_id"]] = item
    return list(by_task.values())


def died_before_storing(led: Ledger, run: dict[str, Any]) -> bool:
    """Whether the worker of the successful ``run`` ended before it could store the result.

    taskiq stores the result after the middlewares' ``post_execute``: within
    a round trip to Redis and one to the backend of the body's end.
    """
    if not led.died(run) or run["ended"] is None:
        return False
    died = led.death[run["pid"]][1]
    return bool(run["ended"] - 1.5 <= died <= run["ended"] + led.timeout + 2.0)


def lost_results(led: Ledger) -> list[dict[str, Any]]:
    """Calls whose body succeeded at least once and that have no result stored at all.

    The caller of such a call waits for ever. On the at-most-once list broker,
    a worker that died between the body and the save takes the message with it;
    on the others the broker delivers the message again, and its copy must
    answer the caller.
    """
    found = []
    for task_id, runs in led.runs_of.items():
        oks = [r for r in runs if r["outcome"] == "ok"]
        if not oks or led.results_of.get(task_id):
            continue
        if not any(died_before_storing(led, r) for r in oks):
            why = RESULT_NEVER_STORED
        elif runs[0]["broker"] in AT_LEAST_ONCE:
            why = RESULT_LOST_WORKER_DIED
        else:
            why = RESULT_LOST_AT_MOST_ONCE
        found.append(
            {
                "task_id": task_id,
                "broker": runs[0]["broker"],
                "policy": policy_of(runs[0]["fp"]),
                "class": why,
                "at": oks[0]["ended"],
            }
        )
    return found


def answered_lost(led: Ledger) -> int:
    """Calls whose last result stored says their result was lost (``ResultLostError``)."""
    return sum(
        1 for rows in led.results_of.values() if rows and rows[-1]["error"] == "ResultLostError"
    )


def errors_seen(led: Ledger) -> tuple[list[dict[str, Any]], int]:
    """What the observer middleware saw go wrong that was not a body's own failure.

    Each ``on_error`` is matched to the run of its delivery (the observer's
    tag): one whose body failed (on purpose: the soak's failing attempts) is
    not counted. Nor is one whose body a worker stop cut short (taskiq cancels
    what outlasts its shutdown timeout): an injected fault. Everything else,
    and every ``pre_execute`` that could not read the arguments, is a delivery
    that deduplication left out and that the observer saw as an error.

    Returns:
        The errors counted, each with its class, and the number not counted
        (on_error of bodies that failed).
    """
    found, failed = [], 0
    for hook in led.hooks:
        kind = hook["error"].split(":")[0]
        run = led.run_in.get(hook["delivery"] or "")
        if hook["hook"] == "pre_execute":
            why = ARGS_UNREADABLE
        elif (run is not None and run["outcome"] == "failed") or (
            run is None and "fails on purpose" in hook["error"]
        ):
            failed += 1
            continue
        elif run is None:
            why = f"{ON_ERROR_NO_BODY} ({kind})"
        elif run["outcome"] is None:
            cut = kind == "CancelledError" or led.died(run)
            why = ON_ERROR_CUT_SHORT if cut else ON_ERROR_UNENDED
        else:
            why = ON_ERROR_AFTER_OK
        found.append(
            {
                "task_id": hook["task_id"],
                "broker": hook["broker"],
                "hook": hook["hook"],
                "class": why,
                "error": hook["error"],
                "at": hook["at"],
            }
        )
    return found, failed


def success_ttl_refusals(led: Ledger) -> dict[str, int]:
    """New sends refused because an earlier call's success is remembered, by task id.

    A refusal whose holder had succeeded before the send began: under a
    success TTL (within it, and the release margin: later ones are stale
    refusals), and, apart, without one (the moment a success is kept for the
    copies that waited for it).
    """
    remembered: set[str] = set()
    plain: set[str] = set()
    for kiq in led.kiqs:
        if kiq["outcome"] != "duplicate" or kiq["holder"] is None:
            continue
        runs = led.runs_of.get(kiq["holder"], [])
        ok = next((r for r in runs if r["outcome"] == "ok"), None)
        if ok is None or ok["ended"] > kiq["started"]:
            continue
        if policy_of(kiq["fp"]) != "remembered":
            plain.add(kiq["task_id"])
        elif kiq["started"] <= ok["ended"] + SUCCESS_TTL + RELEASE_MARGIN:
            remembered.add(kiq["task_id"])
    return {"success_ttl": len(remembered), "no_success_ttl": len(plain)}


def let_through(led: Ledger) -> list[dict[str, Any]]:
    """Accepted sends of a fingerprint whose earlier accepted send was still queued or running.

    Only clear cases count: the second ``kiq`` began after the first returned,
    and returned before the first task's last run ended.
    """
    by_fp: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for kiq in led.accepted.values():
        if policy_of(kiq["fp"]) in REFUSING_POLICIES:  # the others let a send in on purpose
            by_fp[kiq["fp"]].append(kiq)
    found = []
    for fp, kiqs in by_fp.items():
        kiqs.sort(key=lambda k: k["started"])
        for i, a in enumerate(kiqs):
            end_a = led.final_end(a["task_id"])
            if end_a is None:
                continue  # never ran: counted elsewhere
            last = led.runs_of[a["task_id"]][-1]
            if last["ended"] is None and not led.killed(last):
                end_a = min(end_a, led.end_of_run)
            ok = next((r for r in led.runs_of[a["task_id"]] if r["outcome"] == "ok"), None)
            if ok is not None:
                # Its call ended with its first success, which released the lock:
                # a copy run after that is counted by ``ran_again``.
                end_a = min(end_a, ok["ended"])
            for b in kiqs[i + 1 :]:
                if b["started"] > end_a:
                    break
                if b["started"] > a["ended"] and b["ended"] < end_a:
                    found.append(
                        {
                            "fp": fp,
                            "class": led.why_two_at_once(
                                a["task_id"], b["task_id"], b["broker"], b["ended"]
                            ),
                            "first": a["task_id"],
                            "second": b["task_id"],
                            "at": b["started"],
                        }
                    )
    return found


def never_ran(led: Ledger) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Accepted sends that never ran, and those that ran but never completed."""
    lost, unfinished = [], []
    for task_id, kiq in led.accepted.items():
        runs = led.runs_of.get(task_id)
        after = kiq["started"] - 1.0
        if not runs:
            if kiq["broker"] not in AT_LEAST_ONCE:
                if led.faults_in(
                    {"worker-sigkill:redis-list", "worker-sigterm:redis-list"}, after, INF
                ):
                    why = LIST_LOST_KILL
                elif led.faults_in(
                    {"broker-cut:redis-list", "broker-restart:redis-list"}, after, INF
                ):
                    why = LIST_LOST_BROKER
                else:
                    why = "never ran (unexplained)"
            else:
                why = NEVER_RAN_AT_LEAST_ONCE
            lost.append(
                {"task_id": task_id, "broker": kiq["broker"], "class": why, "at": kiq["started"]}
            )
            continue
        last = runs[-1]
        if any(
            r["outcome"] == "ok" or (r["outcome"] == "failed" and r["attempt"] >= MAX_ATTEMPTS - 1)
            for r in runs
        ):
            # Completed. A copy that ran beside the run that completed (an
            # overlap, counted there) and was killed is not redelivered: the
            # broker heard of the message's end from the other run.
            continue
        if last["outcome"] is None:
            if last["broker"] != "redis-list" and last["pid"] in led.death:
                why = "killed mid-run, not redelivered (at-least-once broker)"
            elif led.killed(last):
                why = KILLED_NOT_REDELIVERED_LIST
            elif last["pid"] in led.death:
                died_at = led.death[last["pid"]][1]
                broker_fault = led.faults_in(
                    {"broker-cut:redis-list", "broker-restart:redis-list"},
                    died_at - 3.0,
                    died_at + 1.0,
                )
                why = WORKER_DIED_LIST if broker_fault else "its worker process died (unexplained)"
            elif (
                last["broker"] == "redis-list"
                and last["pid"] not in led.seen
                and led.faults_in(
                    {"broker-cut:redis-list", "broker-restart:redis-list"},
                    last["started"] - 1.0,
                    last["started"] + 3.0,
                )
            ):
                # Processes are sampled once a second: a worker that taskiq had just
                # started, and that died in a broker fault within its first second,
                # was never seen, and neither was its death.
                why = WORKER_DIED_LIST
            else:
                why = "run never ended"
        else:  # failed, and its retry never ran
            when = led.end(last)
            kinds = set(REDIS_FAULTS) | {
                f"broker-cut:{last['broker']}",
                f"broker-restart:{last['broker']}",
            }
            kinds |= {f"worker-sigkill:{last['broker']}", f"worker-sigterm:{last['broker']}"}
            if last["broker"] == "redis-stream":  # its stream lives on the list broker's server
                kinds.add("broker-restart:redis-list")
            why = (
                RETRY_REFUSED_IN_FAULT
                if led.faults_in(kinds, when - 2.0, when + 2.0)
                else "retry lost"
            )
            if why == "retry lost" and runs[0]["started"] - kiq["ended"] > led.ttl:
                # Its lock expired in the queue and another send took it: the
                # retry is refused as that one's duplicate.
                why = QUEUED_TOO_LONG
            if why == "retry lost" and led.faults_in(
                {"redis-restart:locks"}, kiq["ended"], runs[0]["started"]
            ):
                # Its lock was lost in a Redis restart while it was queued, and a
                # later send of the same call took it: the retry is refused as
                # that one's duplicate (and the call runs as that one).
                why = LOST_IN_RESTART
            if (
                why == "retry lost"
                and last["broker"] == "redis-list"
                and led.faults_in(
                    {
                        "worker-sigkill:redis-list",
                        "worker-sigterm:redis-list",
                        "broker-cut:redis-list",
                        "broker-restart:redis-list",
                    },
                    when,
                    INF,
                )
            ):
                why = LIST_LOST_KILL
        unfinished.append(
            {"task_id": task_id, "broker": last["broker"], "class": why, "at": last["started"]}
        )
    return lost, unfinished


def stale_refusals(led: Ledger) -> list[dict[str, Any]]:
    """Duplicates refused after their holder had ended, each with its class."""
    found = []
    for kiq in led.kiqs:
        if kiq["outcome"] != "duplicate":
            continue
        holder = kiq["holder"]
        if holder is None:
            found.append(
                {"task_id": kiq["task_id"], "class": "holder unknown", "at": kiq["started"]}
            )
            continue
        runs = led.runs_of.get(holder)
        if not runs:
            if holder in led.accepted and led.accepted[holder]["broker"] == "redis-list":
                lost_after = led.faults_in(
                    {
                        "worker-sigkill:redis-list",
                        "worker-sigterm:redis-list",
                        "broker-cut:redis-list",
                        "broker-restart:redis-list",
                    },
                    led.accepted[holder]["started"] - 1.0,
                    kiq["started"],
                )
                if lost_after and kiq["started"] > lost_after[0]["started"] + 2.0:
                    found.append(
                        {"task_id": kiq["task_id"], "class": HOLDER_LOST, "at": kiq["started"]}
                    )
            continue  # still queued, or sent by a failed kiq
        last = runs[-1]
        complete = last["outcome"] == "ok" or (
            last["outcome"] == "failed" and last["attempt"] >= MAX_ATTEMPTS - 1
        )
        ended = led.end(last)
        if not (complete or (last["ended"] is None and last["pid"] in led.death)):
            continue  # a retry is on its way: the lock is rightly held
        if kiq["started"] < ended + RELEASE_MARGIN:
            continue
        policy = policy_of(kiq["fp"])
        if (
            policy == "remembered"
            and last["outcome"] == "ok"
            and kiq["started"] < ended + SUCCESS_TTL + RELEASE_MARGIN
        ):
            continue  # the success TTL refuses it, as it should
        holder_kiq = led.kiq_of.get(holder)
        if (
            policy == "expired"
            and holder_kiq is not None
            and kiq["started"] < holder_kiq["started"] + EXPIRED_TTL + RELEASE_MARGIN
        ):
            continue  # inside the holder's window
        death = led.death.get(last["pid"])
        # Killed between the end of its body and its release: the lock lives one TTL.
        killed_before_release = (
            last["ended"] is not None
            and death is not None
            and led.died(last)
            and death[1] - ended < RELEASE_MARGIN + 1.0
        )
        if killed_before_release and death is not None:
            ended = death[1]
        too_late = kiq["started"] > ended + led.ttl + RELEASE_MARGIN
        if last["ended"] is None or killed_before_release:
            why = "refused past the TTL of a killed holder" if too_late else HOLDER_KILLED
        elif led.faults_in(REDIS_FAULTS, ended - led.timeout - 0.5, ended + led.timeout + 0.5):
            why = "refused past the TTL of a lost release" if too_late else RELEASE_LOST
        else:
            why = "stale lock: refused after its holder ended"
        found.append(
            {
                "task_id": kiq["task_id"],
                "holder": holder,
                "class": why,
                "at": kiq["started"],
                "after_end": kiq["started"] - ended,
            }
        )
    return found


def over_limit(led: Ledger) -> list[dict[str, Any]]:
    """Starts of the limited task's runs that made more than :data:`LIMIT` run at once.

    A body's start and end are stamped within the time its run held its slot
    (a killed worker's body ends at its death): beyond the limit, the limit
    let a run in that it should not have, unless Redis forgot who held its
    slots (a restart since the oldest of those running began) or the slot of
    one of them lapsed in an outage of a lease (its worker cut off from Redis,
    or a run that waited a lease for Redis and went without one).
    """
    found = []
    running: list[dict[str, Any]] = []
    limited = (run for run in led.runs if policy_of(run["fp"]) == LIMITED)
    for run in sorted(limited, key=lambda r: r["started"]):
        running = [r for r in running if led.end(r) > run["started"]]
        running.append(run)
        if len(running) <= LIMIT:
            continue
        since = min(r["started"] for r in running)
        lapse = LIMIT_LEASE - 1.0
        if led.faults_in({"redis-restart"}, since - led.timeout, run["started"]):
            why = LOST_IN_RESTART
        elif any(
            f["ended"] - f["started"] >= lapse
            for f in led.faults_in({"redis-pause", "redis-cut"}, since, run["started"])
        ) or gave_up_waiting(led, lapse, run["started"]):
            why = LEASE_LAPSED
        else:
            why = "over the limit (unexplained)"
        found.append(
            {
                "task_id": run["task_id"],
                "broker": run["broker"],
                "class": why,
                "at": run["started"],
                "running": len(running),
            }
        )
    return found


def slots_left(slots: list[dict[str, Any]], options: dict[str, Any]) -> list[dict[str, Any]]:
    """The live places in a limit found once everything had ended, each with its class.

    A place (a slot held, or a place in line) is live while its lease runs, and
    its lease is refreshed while its run goes on. One last refreshed after the
    ledger had settled (every run ended) is kept alive by a run that never
    ends; one refreshed before lapses within its lease: its worker is gone.
    """
    settled = options.get("settled_at")
    return [
        {
            **slot,
            "class": SLOT_KEPT
            if settled is None or slot["deadline"] - LIMIT_LEASE > settled + 1.0
            else SLOT_LAPSING,
        }
        for slot in slots
    ]


def _percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "p50": at(0.5), "p99": at(0.99), "max": ordered[-1]}


def latencies(led: Ledger) -> dict[str, Any]:
    """kiq latency (whole kiq, and the lock's part) in quiet times and during each fault family."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for kiq in led.client_kiqs:
        during = {f["kind"] for f in led.faults_in(set(REDIS_FAULTS), kiq["started"], kiq["ended"])}
        if during:
            for kind in during:
                groups[kind].append(kiq)
            groups["any Redis fault"].append(kiq)
        elif led.faults_in({"broker-cut", "broker-restart"}, kiq["started"], kiq["ended"]):
            groups["broker fault"].append(kiq)
        else:
            groups["no Redis or broker fault"].append(kiq)
        groups["all"].append(kiq)
    return {
        name: {
            "kiq": _percentiles([k["latency"] for k in kiqs]),
            "lock": _percentiles([k["lock_latency"] for k in kiqs]),
            "outcomes": dict(Counter(k["outcome"] for k in kiqs)),
        }
        for name, kiqs in sorted(groups.items())
    }


def memory(led: Ledger) -> list[dict[str, Any]]:
    """First, last and largest resident memory of every process, in MiB."""
    series: dict[tuple[int, str], list[tuple[float, int]]] = defaultdict(list)
    for sample in led.rss:
        if sample["kb"] == 0:
            continue  # read while the process was exiting
        series[(sample["pid"], sample["role"])].append((sample["at"], sample["kb"]))
    rows = []
    for samples in series.values():
        samples.sort()
    for (pid, role), samples in sorted(series.items(), key=lambda i: (i[0][1], i[1][0][0])):
        start = samples[0][0]
        settled = [kb for at, kb in samples if at - start >= 10.0] or [samples[-1][1]]
        rows.append(
            {
                "pid": pid,
                "role": role,
                "seconds": round(samples[-1][0] - start, 1),
                "first_mib": round(samples[0][1] / 1024, 1),
                "after_10s_mib": round(settled[0] / 1024, 1),
                "last_mib": round(samples[-1][1] / 1024, 1),
                "max_mib": round(max(kb for _, kb in samples) / 1024, 1),
            }
        )
    return rows


def analyse(
    data: dict[str, list[dict[str, Any]]],
    locks: list[dict[str, Any]],
    options: dict[str, Any],
    slots: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Check every invariant; return the figures and the list of breaches.

    ``slots`` are the live places in a limit found at the end (a slot held or a
    place in line: ``limit``, ``kind``, ``member``, ``deadline``, the end of
    its lease in seconds); ``options["settled_at"]`` is when everything ended.
    """
    led = Ledger(data, options)
    over = over_limit(led)
    left = slots_left(slots or [], options)
    found_overlaps = overlaps(led)
    found_again = ran_again(led)
    by_task = reruns_by_task(found_again)
    found_through = let_through(led)
    lost, unfinished = never_ran(led)
    no_result = lost_results(led)
    seen, body_failures = errors_seen(led)
    stale = stale_refusals(led)
    lat = latencies(led)
    mem = memory(led)
    bound = led.timeout + options["latency_margin"]
    breaches: list[str] = []

    def classes(items: list[dict[str, Any]]) -> dict[str, int]:
        return dict(Counter(item["class"] for item in items))

    for name, key, items in (
        ("overlapping runs of one lock key", "overlaps", found_overlaps),
        ("bodies run again after a success, by task id", "reruns_by_task", by_task),
        ("results lost or never stored for a call", "lost_results", no_result),
        ("skips seen by another middleware as errors", "errors_seen", seen),
        ("sends let through", "let_through", found_through),
        ("accepted, never ran", "never_ran", lost),
        ("ran, never completed", "never_completed", unfinished),
        ("stale refusals", "stale_refusals", stale),
        ("runs of a limit over the limit", "over_limit", over),
        ("slots of a limit never freed", "slots_left", left),
    ):
        for why, n in classes(items).items():
            if why not in WINDOWS[key] and why != "holder unknown":
                breaches.append(f"{name}: {n} x {why}")
    if locks:
        breaches.append(f"locks left one TTL after everything ended: {len(locks)}")
    slow = [k for k in led.client_kiqs if k["lock_latency"] > bound]
    if slow:
        worst = max(k["lock_latency"] for k in slow)
        breaches.append(
            f"kiq lock latency beyond socket_timeout + margin ({bound:.1f}s): "
            f"{len(slow)} sends, worst {worst:.2f}s"
        )
    for row in mem:
        if row["role"] == "client" or row["seconds"] >= 60:
            grown = row["last_mib"] - row["after_10s_mib"]
            if grown > max(50.0, 0.5 * row["after_10s_mib"]):
                breaches.append(
                    f"memory of {row['role']} {row['pid']} grew from "
                    f"{row['after_10s_mib']} to {row['last_mib']} MiB"
                )
    return {
        "options": options,
        "totals": {
            "sends": len(led.kiqs),
            "sends_by_source": dict(Counter(k["source"] for k in led.kiqs)),
            "outcomes": dict(Counter(k["outcome"] for k in led.kiqs)),
            "errors": dict(
                Counter((k["error"] or "").split(":")[0] for k in led.kiqs if k["error"])
            ),
            "runs": len(led.runs),
            "run_outcomes": dict(Counter(r["outcome"] or "no end" for r in led.runs)),
            "client_skipped": int(led.notes.get("client_skipped", 0)),
            "faults": dict(Counter(f"{f['kind']}:{f['target']}" for f in led.faults)),
        },
        "faults": [{**f, "seconds": round(f["ended"] - f["started"], 2)} for f in led.faults],
        "overlaps": classes(found_overlaps),
        "overlaps_by": dict(
            Counter(
                f"{o['broker']}/{o['policy']}/{'copy' if o['same_task'] else 'another send'}"
                for o in found_overlaps
                if o["class"] not in OVERLAP_WINDOWS
            )
        ),
        "ran_again": classes(found_again),
        "reruns_by_task": classes(by_task),
        "reruns_by_policy": dict(
            Counter(i["policy"] for i in by_task if i["class"] not in RAN_AGAIN_WINDOWS)
        ),
        "reruns_after": _percentiles(
            [i["after"] for i in found_again if i["class"] not in RAN_AGAIN_WINDOWS]
        ),
        "redelivery_window": options.get("redelivery_window"),
        "lost_results": classes(no_result),
        "results": {
            "calls_succeeded": sum(
                1 for runs in led.runs_of.values() if any(r["outcome"] == "ok" for r in runs)
            ),
            "answered_result_lost": answered_lost(led),
        },
        "errors_seen": classes(seen),
        "errors_seen_tasks": len(
            {i["task_id"] for i in seen if i["class"] not in WINDOWS["errors_seen"]}
        ),
        "errors_not_counted": body_failures,
        "success_ttl_refusals": success_ttl_refusals(led),
        "let_through": classes(found_through),
        "never_ran": classes(lost),
        "never_completed": classes(unfinished),
        "stale_refusals": classes(stale),
        "over_limit": classes(over),
        "limited_runs": sum(1 for run in led.runs if policy_of(run["fp"]) == LIMITED),
        "slots_left": classes(left),
        "locks_left": locks,
        "latency_bound": bound,
        "latency": lat,
        "memory": mem,
        "breaches": breaches,
        "examples": {
            "overlaps": [o for o in found_overlaps if o["class"] not in OVERLAP_WINDOWS][:5],
            "ran_again": [o for o in found_again if o["class"] not in WINDOWS["ran_again"]][:5],
            "lost_results": [o for o in no_result if o["class"] not in DOCUMENTED][:5],
            "errors_seen": [o for o in seen if o["class"] not in DOCUMENTED][:5],
            "let_through": [o for o in found_through if o["class"] not in DOCUMENTED][:5],
            "stale_refusals": [o for o in stale if o["class"] not in DOCUMENTED][:5],
            "over_limit": [o for o in over if o["class"] not in WINDOWS["over_limit"]][:5],
            "slots_left": [o for o in left if o["class"] not in WINDOWS["slots_left"]][:5],
            "never_ran": [o for o in lost + unfinished if o["class"] not in DOCUMENTED][:5],
        },
    }


def render(result: dict[str, Any]) -> str:
    """The report as text."""
    t = result["totals"]
    lines = [
        "",
        "=== soak report ===",
        (
            f"sends: {t['sends']} {t['sends_by_source']} {t['outcomes']}; "
            f"client skipped {t['client_skipped']}"
        ),
        f"send errors: {t['errors']}",
        f"runs: {t['runs']} {t['run_outcomes']}",
        f"faults: {sum(t['faults'].values())} {t['faults']}",
        "",
        "invariant (class: count; * = outside the documented windows)",
    ]
    for title, key in (
        ("overlapping runs of one lock key", "overlaps"),
        ("bodies run again after a success", "ran_again"),
        ("sends accepted while the first was queued/running", "let_through"),
        ("accepted but never ran", "never_ran"),
        ("ran but never completed", "never_completed"),
        ("refused naming a holder that had ended", "stale_refusals"),
    ):
        counts = result[key]
        lines.append(_counted(title, result, key))
        if key == "overlaps":
            lapses = counts.get(LEASE_LAPSED, 0) + counts.get(LONG_PAUSE, 0)
            outside = sum(n for why, n in counts.items() if why not in OVERLAP_WINDOWS)
            lines.append(f"    outside the windows (must be 0): {outside} {result['overlaps_by']}")
            lines.append(f"    lease lapses under a cut-off worker (fenced): {lapses}")
        if key == "ran_again":
            lines.append(
                "    after a success the lock remembered (must be 0): "
                f"{counts.get(REMEMBERED_RAN_AGAIN, 0)}"
            )
            lines += _copy_lines(result)
        if key == "never_ran":
            lines.append(
                "    on an at-least-once broker (must be 0): "
                f"{counts.get(NEVER_RAN_AT_LEAST_ONCE, 0)}"
            )
    lines += _limit_lines(result)
    left = result["locks_left"]
    lines.append(f"  locks left one TTL after the end: {len(left)}")
    if left:
        ttls = sorted(lock["pttl"] for lock in left)
        lines.append(
            f"    PTTL of those, ms: min {ttls[0]} max {ttls[-1]} "
            "(near the TTL: something still refreshes them)"
        )
    lines += [
        "",
        f"kiq latency, seconds (bound for the lock's part: {result['latency_bound']:.1f})",
    ]
    for name, row in result["latency"].items():
        kiq, lock = row["kiq"], row["lock"]
        if not kiq["n"]:
            continue
        lines.append(
            f"  {name:26} n={kiq['n']:6}  kiq p50 {kiq['p50']:.3f} p99 {kiq['p99']:.3f} "
            f"max {kiq['max']:.3f} | lock p50 {lock['p50']:.3f} p99 {lock['p99']:.3f} "
            f"max {lock['max']:.3f}  {row['outcomes']}"
        )
    lines += ["", "resident memory, MiB (first / after 10 s / last / max, seconds watched)"]
    for row in result["memory"]:
        if row["seconds"] < 5:
            continue
        lines.append(
            f"  {row['role']:28} {row['pid']:8}  {row['first_mib']:6} {row['after_10s_mib']:6} "
            f"{row['last_mib']:6} {row['max_mib']:6}  {row['seconds']:6}s"
        )
    lines.append("")
    if result["breaches"]:
        lines.append("BROKEN INVARIANTS:")
        lines += [f"  - {b}" for b in result["breaches"]]
    else:
        lines.append("all invariants held")
    return "\n".join(lines)


def _limit_lines(result: dict[str, Any]) -> list[str]:
    """The lines of the limited task: over the limit, and slots never freed."""
    return [
        _counted(
            f"runs of the limited task ({result['limited_runs']}) over its limit of {LIMIT}",
            result,
            "over_limit",
        ),
        f"    over the limit (must be 0): {_outside(result, 'over_limit')}",
        _counted("live places in a limit once everything ended", result, "slots_left"),
        f"    slots never freed (must be 0): {_outside(result, 'slots_left')}",
    ]


def _counted(title: str, result: dict[str, Any], key: str) -> str:
    """One invariant's line: its total, then each class (``*``: outside the windows)."""
    counts = result[key]
    shown = ", ".join(
        f"{'' if why in WINDOWS[key] else '*'}{why}: {n}" for why, n in sorted(counts.items())
    )
    return f"  {title}: {sum(counts.values())}" + (f" ({shown})" if shown else "")


def _outside(result: dict[str, Any], key: str) -> int:
    return sum(n for why, n in result[key].items() if why not in WINDOWS[key])


def _copy_lines(result: dict[str, Any]) -> list[str]:
    """The lines of the copies of a success: reruns by task id, results, errors, refusals."""
    window = result["redelivery_window"]
    after = result["reruns_after"]
    told = "for ever (no redelivery_window)" if window is None else f"{window}s"
    lines = [
        _counted("bodies run again after a success, by task id", result, "reruns_by_task"),
        f"    outside the windows (must be 0): {_outside(result, 'reruns_by_task')} "
        f"{result['reruns_by_policy']}; copies remembered {told}"
        + (
            f"; began after the success p50 {after['p50']:.1f}s max {after['max']:.1f}s"
            if after["n"]
            else ""
        ),
        _counted("results lost or never stored for a call", result, "lost_results"),
        (
            f"    outside the windows (must be 0): {_outside(result, 'lost_results')}; "
            f"calls that succeeded {result['results']['calls_succeeded']}, "
            f"answered with ResultLostError {result['results']['answered_result_lost']}"
        ),
        _counted("skips seen by another middleware as errors", result, "errors_seen"),
        (
            f"    outside the windows (must be 0): {_outside(result, 'errors_seen')} "
            f"in {result['errors_seen_tasks']} task ids; not counted: "
            f"{result['errors_not_counted']} on_error of bodies that failed"
        ),
    ]
    refused = result["success_ttl_refusals"]
    lines.append(
        "  a new send within the success TTL is refused, by task id: "
        f"{refused['success_ttl']} (a count; without a success TTL, refused naming a "
        f"holder that had succeeded: {refused['no_success_ttl']})"
    )
    return lines
