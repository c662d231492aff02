"""The soak's verdict (tests/soak/report.py) on small ledgers made up here.

The soak itself runs for minutes (``python -m tests.soak``); these check only
that its analysis tells a breach from a documented window.
"""

from __future__ import annotations

from typing import Any

import pytest

# The soak's modules need its extra (psycopg, taskiq-redis); the floors check has neither.
pytest.importorskip("psycopg", reason="the soak's report needs the soak extra (psycopg)")
pytest.importorskip("taskiq_redis", reason="the soak's report needs the soak extra (taskiq-redis)")

from tests.soak import app, report

OPTIONS = {"ttl": 15, "socket_timeout": 1.0, "latency_margin": 0.5, "fail_open": ["redis-list"]}


def kiq(task_id: str, fp: str, started: float, **extra: Any) -> dict[str, Any]:
    row = {
        "fp": fp,
        "task_id": task_id,
        "broker": "rabbitmq",
        "started": started,
        "ended": started + 0.01,
        "latency": 0.01,
        "lock_latency": 0.005,
        "outcome": "accepted",
        "holder": None,
        "error": None,
        "source": "client",
    }
    return {**row, **extra}


def run(task_id: str, fp: str, started: float, ended: float | None, **extra: Any) -> dict[str, Any]:
    row = {
        "fp": fp,
        "task_id": task_id,
        "broker": "rabbitmq",
        "attempt": 0,
        "pid": 100,
        "started": started,
        "ended": ended,
        "outcome": "ok" if ended is not None else None,
    }
    return {**row, **extra}


def fault(kind: str, target: str, started: float, ended: float) -> dict[str, Any]:
    return {"kind": kind, "target": target, "started": started, "ended": ended, "detail": ""}


def stored(task_id: str, at: float, error: str | None = None, **extra: Any) -> dict[str, Any]:
    row = {
        "task_id": task_id,
        "broker": "rabbitmq",
        "pid": 100,
        "at": at,
        "is_err": error is not None,
        "error": error,
        "body": "{}",
    }
    return {**row, **extra}


def hook(task_id: str, at: float, error: str, **extra: Any) -> dict[str, Any]:
    row = {
        "task_id": task_id,
        "broker": "rabbitmq",
        "pid": 100,
        "at": at,
        "hook": "on_error",
        "delivery": None,
        "error": error,
    }
    return {**row, **extra}


def verdict(
    kiqs: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    faults: list[dict[str, Any]] | None = None,
    locks: list[dict[str, Any]] | None = None,
    send_failures: list[dict[str, Any]] | None = None,
    options: dict[str, Any] | None = None,
    results: list[dict[str, Any]] | None = None,
    hooks: list[dict[str, Any]] | None = None,
    procs: list[dict[str, Any]] | None = None,
    slots: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    data = {"kiqs": kiqs, "runs": runs, "faults": faults or [], "rss": [], "notes": []}
    data["procs"] = procs or []
    data["send_failures"] = send_failures or []
    if results is None:  # every run that succeeded stored its result
        results = [stored(r["task_id"], r["ended"]) for r in runs if r["outcome"] == "ok"]
    data["results"] = results
    data["hooks"] = hooks or []
    return report.analyse(data, locks or [], {**OPTIONS, **(options or {})}, slots)


def two_at_once() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # Two sends of one call, the second while the first runs; both ran.
    kiqs = [kiq("a", "f", 100.0), kiq("b", "f", 101.0)]
    runs = [run("a", "f", 100.5, 103.0), run("b", "f", 101.5, 102.0, pid=101)]
    return kiqs, runs


def test_a_clean_ledger_holds_every_invariant() -> None:
    kiqs = [kiq("a", "f", 100.0), kiq("b", "f", 101.0, outcome="duplicate", holder="a")]
    result = verdict(kiqs, [run("a", "f", 100.5, 102.0)])
    assert result["breaches"] == []
    assert result["overlaps"] == {}


def test_two_runs_at_once_without_a_fault_are_a_breach() -> None:
    result = verdict(*two_at_once())
    assert result["overlaps"] == {"unexplained": 1}
    assert result["let_through"] == {"unexplained": 1}
    assert any("overlapping runs" in b for b in result["breaches"])


def test_two_runs_at_once_after_a_redis_restart_are_a_documented_window() -> None:
    kiqs, runs = two_at_once()
    result = verdict(kiqs, runs, [fault("redis-restart", "locks", 100.5, 100.6)])
    assert result["overlaps"] == {report.LOST_IN_RESTART: 1}
    assert result["breaches"] == []


def test_a_copy_redelivered_after_a_broker_cut_that_runs_beside_the_first_is_a_breach() -> None:
    # The copy must wait for the run of its lock to end.
    kiqs = [kiq("a", "f", 100.0)]
    runs = [run("a", "f", 100.5, 103.0), run("a", "f", 101.5, 102.5, pid=101)]
    result = verdict(kiqs, runs, [fault("broker-cut", "rabbitmq", 101.0, 101.2)])
    assert result["overlaps"] == {report.CUT_REDELIVERED: 1}
    assert result["breaches"] == [
        "overlapping runs of one lock key: 1 x redelivered after a broker connection cut"
    ]


def test_a_copy_that_waits_for_the_first_run_to_end_is_no_overlap() -> None:
    kiqs = [kiq("a", "f", 100.0, broker="redis-stream")]
    runs = [
        run("a", "f", 100.5, 103.0, broker="redis-stream", outcome="failed"),
        run("a", "f", 103.2, 104.0, broker="redis-stream", pid=101, attempt=1),
    ]
    result = verdict(kiqs, runs)
    assert result["overlaps"] == {}
    assert result["breaches"] == []


def test_a_call_accepted_under_started_that_runs_beside_the_last_is_a_breach() -> None:
    # "started" lets the call in; its run must still wait for the last one.
    kiqs = [kiq("a", "q:started:1", 100.0), kiq("b", "q:started:1", 101.0)]
    runs = [run("a", "q:started:1", 100.5, 103.0), run("b", "q:started:1", 101.5, 102.0, pid=101)]
    result = verdict(kiqs, runs)
    assert result["let_through"] == {}, "started lets a send in on purpose"
    assert result["overlaps"] == {"unexplained": 1}
    assert result["overlaps_by"] == {"rabbitmq/started/another send": 1}
    assert result["breaches"] == ["overlapping runs of one lock key: 1 x unexplained"]


def test_a_lease_that_lapsed_under_a_worker_cut_off_from_redis_is_counted_apart() -> None:
    kiqs = [kiq("a", "f", 100.0), kiq("b", "f", 118.0)]
    runs = [run("a", "f", 100.5, 125.0), run("b", "f", 118.5, 119.0, pid=101)]
    cut = fault("redis-cut", "locks", 101.0, 117.0)  # longer than the TTL (15 s)
    result = verdict(kiqs, runs, [cut])
    assert result["overlaps"] == {report.LEASE_LAPSED: 1}
    assert result["breaches"] == []
    text = report.render(result)
    assert "lease lapses under a cut-off worker (fenced): 1" in text
    assert "outside the windows (must be 0): 0" in text
    # A short cut does not lapse a lease: the same overlap is a breach.
    short = verdict(kiqs, runs, [fault("redis-cut", "locks", 101.0, 103.0)])
    assert short["overlaps"] == {"unexplained": 1}


def test_a_copy_that_runs_again_after_a_remembered_success_is_a_breach() -> None:
    fp = "rabbitmq:remembered:1"
    runs = [run("a", fp, 100.5, 101.0), run("a", fp, 102.0, 102.5, pid=101)]
    result = verdict([kiq("a", fp, 100.0)], runs)
    assert result["ran_again"] == {report.REMEMBERED_RAN_AGAIN: 1}
    assert result["breaches"] == [
        f"bodies run again after a success, by task id: 1 x {report.REMEMBERED_RAN_AGAIN}"
    ]
    assert "after a success the lock remembered (must be 0): 1" in report.render(result)
    # Without a success TTL the library remembers the success for copies too.
    plain = [run("a", "f", 100.5, 101.0), run("a", "f", 102.0, 102.5, pid=101)]
    result = verdict([kiq("a", "f", 100.0)], plain)
    assert result["ran_again"] == {report.RAN_AGAIN: 1}
    assert result["breaches"] == [
        f"bodies run again after a success, by task id: 1 x {report.RAN_AGAIN}"
    ]
    # Only for its redelivery window: a copy after it runs, as documented.
    result = verdict([kiq("a", "f", 100.0)], plain, options={"redelivery_window": 0})
    assert result["ran_again"] == {report.SUCCESS_FORGOTTEN: 1}
    assert result["breaches"] == []


@pytest.mark.parametrize("broker", ["redis-stream", "nats"])
def test_an_accepted_send_that_never_ran_on_a_redelivering_broker_is_a_breach(
    broker: str,
) -> None:
    result = verdict([kiq("a", "f", 100.0, broker=broker)], [])
    assert result["never_ran"] == {report.NEVER_RAN_AT_LEAST_ONCE: 1}
    assert result["breaches"]
    assert "on an at-least-once broker (must be 0): 1" in report.render(result)


def test_refusals_inside_a_success_ttl_or_a_window_are_not_stale() -> None:
    remembered, expired = "rabbitmq:remembered:1", "rabbitmq:expired:2"
    kiqs = [
        kiq("a", remembered, 100.0),
        kiq("b", remembered, 104.0, outcome="duplicate", holder="a"),  # within the success TTL
        kiq("c", expired, 100.0),
        kiq("d", expired, 103.5, outcome="duplicate", holder="c"),  # within the window
    ]
    runs = [run("a", remembered, 100.5, 101.0), run("c", expired, 100.5, 101.0, pid=101)]
    result = verdict(kiqs, runs)
    assert result["stale_refusals"] == {}
    assert result["breaches"] == []


def test_an_accepted_send_that_never_ran_on_rabbitmq_is_a_breach() -> None:
    result = verdict([kiq("a", "f", 100.0)], [])
    assert result["never_ran"] == {"never ran on an at-least-once broker": 1}
    assert result["breaches"]


def test_a_list_message_lost_with_a_killed_worker_is_counted_apart() -> None:
    kiqs = [kiq("a", "f", 100.0, broker="redis-list")]
    result = verdict(kiqs, [], [fault("worker-sigkill", "redis-list", 100.2, 100.2)])
    assert result["never_ran"] == {report.LIST_LOST_KILL: 1}
    assert result["breaches"] == []


def test_a_refusal_long_after_the_holder_ended_is_a_stale_lock() -> None:
    kiqs = [kiq("a", "f", 100.0), kiq("b", "f", 110.0, outcome="duplicate", holder="a")]
    result = verdict(kiqs, [run("a", "f", 100.5, 101.0)])
    assert result["stale_refusals"] == {"stale lock: refused after its holder ended": 1}
    assert result["breaches"]


def test_locks_left_and_slow_sends_are_breaches() -> None:
    kiqs = [kiq("a", "f", 100.0, lock_latency=1.6, latency=1.6)]
    locks = [{"key": "k", "value": "owner a", "pttl": 14000}]
    result = verdict(kiqs, [run("a", "f", 102.0, 103.0)], locks=locks)
    assert len(result["breaches"]) == 2
    assert "locks left" in result["breaches"][0]
    assert "latency" in result["breaches"][1]


def test_a_list_run_whose_unseen_worker_died_in_a_broker_fault_is_counted_apart() -> None:
    # taskiq had just started the worker process, and a broker restart ended it
    # within its first second: the sampler never saw it, nor its death.
    kiqs = [kiq("a", "f", 100.0, broker="redis-list")]
    runs = [run("a", "f", 100.5, None, broker="redis-list", pid=555)]
    result = verdict(kiqs, runs, [fault("broker-restart", "redis-list", 100.55, 100.6)])
    assert result["never_completed"] == {report.WORKER_DIED_LIST: 1}
    assert result["breaches"] == []
    # Without the fault, the same lost run is a breach.
    assert verdict(kiqs, runs)["never_completed"] == {"run never ended": 1}


def test_a_retry_refused_after_its_lock_was_lost_in_a_restart_is_a_documented_window() -> None:
    # Queued while Redis restarted empty; a later send of the call took the lock,
    # so the first one's retry was refused as that send's duplicate.
    kiqs = [kiq("a", "f", 100.0)]
    runs = [run("a", "f", 106.0, 107.0, outcome="failed")]
    result = verdict(kiqs, runs, [fault("redis-restart", "locks", 101.0, 101.1)])
    assert result["never_completed"] == {report.LOST_IN_RESTART: 1}
    assert result["breaches"] == []
    assert verdict(kiqs, runs)["never_completed"] == {"retry lost": 1}


def test_a_killed_copy_of_a_call_that_completed_is_no_lost_call() -> None:
    # The copy ran beside the first run (an overlap) and was killed; the first
    # run's ack ended the message, so no broker delivers it again.
    kiqs = [kiq("a", "f", 100.0, broker="redis-stream")]
    runs = [
        run("a", "f", 100.5, 104.0, broker="redis-stream"),
        run("a", "f", 103.0, None, broker="redis-stream", pid=101),
    ]
    data = {"kiqs": kiqs, "runs": runs, "faults": [], "rss": [], "notes": []}
    data["procs"] = [
        {
            "pid": 101,
            "role": "w",
            "broker": "redis-stream",
            "first_seen": 99.0,
            "last_seen": 105.0,
            "fate": "sigkill",
        }
    ]
    result = report.analyse(data, [], OPTIONS)
    assert result["never_completed"] == {}
    assert result["overlaps"] == {"redelivered (unexplained)": 1}


def test_a_run_beside_one_whose_claim_failed_open_is_a_documented_window() -> None:
    # "a" could not reach Redis as it began and, with fail_open, ran at once
    # without its run slot; "b" then found the slot free.
    fp = "redis-list:started:1"
    kiqs = [kiq("a", fp, 100.0, broker="redis-list"), kiq("b", fp, 101.0, broker="redis-list")]
    runs = [
        run("a", fp, 102.0, 110.0, broker="redis-list"),
        run("b", fp, 106.0, 107.0, broker="redis-list", pid=101),
    ]
    cut = fault("redis-cut", "locks", 101.5, 102.5)
    assert verdict(kiqs, runs, [cut])["overlaps"] == {report.FAIL_OPEN: 1}
    assert verdict(kiqs, runs)["overlaps"] == {"unexplained": 1}


def test_a_copy_that_waited_through_an_outage_longer_than_its_lease_is_a_lapse() -> None:
    # The copy waited for Redis a whole lease, from before "a" began, then ran.
    fp = "nats:started:1"
    kiqs = [kiq("a", fp, 100.0, broker="nats")]
    runs = [
        run("a", fp, 113.0, 120.0, broker="nats", attempt=1),
        run("a", fp, 114.0, 115.0, broker="nats", pid=101),
    ]
    pause = fault("redis-pause", "locks", 101.0, 112.0)  # past the 10 s run slot lease
    assert verdict(kiqs, runs, [pause])["overlaps"] == {report.LEASE_LAPSED: 1}
    short = fault("redis-pause", "locks", 101.0, 104.0)
    assert verdict(kiqs, runs, [short])["overlaps"] == {"redelivered (unexplained)": 1}


def test_a_restart_during_the_run_explains_a_copy_only_where_another_run_took_the_lock() -> None:
    # The run's end writes its success even into a lock the restart emptied:
    # a copy after it is a breach, unless another run of the key began after the
    # restart (it held the lock as the success ended, or replaced the success).
    fp = "nats:remembered:1"
    runs = [run("a", fp, 100.5, 104.0), run("a", fp, 105.0, 106.0, pid=101)]
    restart = fault("redis-restart", "locks", 102.0, 102.1)
    alone = verdict([kiq("a", fp, 100.0)], runs, [restart])
    assert alone["ran_again"] == {report.REMEMBERED_RAN_AGAIN: 1}
    took = [*runs, run("a", fp, 102.5, 103.0, pid=102, outcome="failed")]
    assert verdict([kiq("a", fp, 100.0)], took, [restart])["ran_again"] == {
        report.LOST_IN_RESTART: 1
    }
    # Nor does a restart up to a TTL before the send, with no other run.
    early = fault("redis-restart", "locks", 90.0, 90.1)
    assert verdict([kiq("a", fp, 100.0)], runs, [early])["ran_again"] == {
        report.REMEMBERED_RAN_AGAIN: 1
    }


def test_a_restart_as_the_run_ended_explains_a_copy_at_once() -> None:
    # Seen in a 10-minute soak: Redis restarted as the run ended, so its end
    # wrote no success, and the emptied run slot let a copy run 0.6 s later.
    fp = "redis-stream:remembered:1"
    runs = [
        run("a", fp, 100.5, 104.0, broker="redis-stream"),
        run("a", fp, 104.6, 105.0, broker="redis-stream", pid=101),
    ]
    restart = fault("redis-restart", "locks", 103.9, 104.05)
    assert verdict([kiq("a", fp, 100.0, broker="redis-stream")], runs, [restart])["ran_again"] == {
        report.LOST_IN_RESTART: 1
    }
    # One that was over more than a call's timeout before the end explains nothing.
    before = fault("redis-restart", "locks", 101.0, 101.1)
    assert verdict([kiq("a", fp, 100.0, broker="redis-stream")], runs, [before])["ran_again"] == {
        report.REMEMBERED_RAN_AGAIN: 1
    }


def test_an_outage_over_before_the_copy_began_does_not_excuse_a_remembered_success() -> None:
    # Redis was up as the copy claimed: it had to find the success.
    fp = "nats:remembered:1"
    runs = [run("a", fp, 117.5, 118.0), run("a", fp, 120.0, 121.0, pid=101)]
    pause = fault("redis-pause", "locks", 100.0, 116.0)
    assert verdict([kiq("a", fp, 117.0)], runs, [pause])["ran_again"] == {
        report.REMEMBERED_RAN_AGAIN: 1
    }
    # A copy that began while that outage still went on had waited a lease for it.
    during = [run("a", fp, 111.0, 112.0), run("a", fp, 115.5, 116.5, pid=101)]
    assert verdict([kiq("a", fp, 100.0)], during, [pause])["ran_again"] == {report.LEASE_LAPSED: 1}


def test_an_outage_over_before_both_runs_began_does_not_excuse_their_overlap() -> None:
    fp = "nats:expired:1"
    kiqs = [kiq("a", fp, 105.0, broker="nats"), kiq("b", fp, 106.5, broker="nats")]
    runs = [
        run("a", fp, 106.0, 110.0, broker="nats"),
        run("b", fp, 107.0, 108.0, broker="nats", pid=101),
    ]
    pause = fault("redis-pause", "locks", 100.0, 103.5)
    assert report.LEASE_LAPSED not in verdict(kiqs, runs, [pause])["overlaps"]


def test_a_copy_right_after_a_success_whose_end_was_lost_is_a_breach() -> None:
    # The lost end leaves the run slot to live out its lease: a copy waits for
    # it and runs that much later, never 2 s after.
    fp = "nats:remembered:1"
    runs = [run("a", fp, 100.5, 104.0), run("a", fp, 106.0, 107.0, pid=101)]
    cut = fault("redis-cut", "locks", 103.5, 105.0)
    assert verdict([kiq("a", fp, 100.0)], runs, [cut])["ran_again"] == {
        report.REMEMBERED_RAN_AGAIN: 1
    }
    # With a running lease of 3 s the slot lapses soon enough for the window.
    later = [run("a", fp, 100.5, 104.0), run("a", fp, 106.0, 107.0, pid=101)]
    short = verdict([kiq("a", fp, 100.0)], later, [cut], options={"running_ttl": 3})
    assert short["ran_again"] == {report.SUCCESS_NOT_WRITTEN: 1}


def test_a_merged_task_runs_under_started_and_its_slot_lives_the_slot_lease() -> None:
    # "merge" is "started" with merged calls: its run slot is beside the lock, on
    # the 10 s slot lease, not on the TTL (15 s). A copy 8 s after a success whose
    # end met a Redis cut waited for that lease to lapse: the documented window.
    # (The soak of 2026-12-06 classed three such copies as breaches.)
    fp = "nats:merge:1"
    runs = [run("a", fp, 100.5, 104.0), run("a", fp, 112.0, 113.0, pid=101)]
    cut = fault("redis-cut", "locks", 103.5, 106.0)
    assert verdict([kiq("a", fp, 100.0)], runs, [cut])["ran_again"] == {
        report.SUCCESS_NOT_WRITTEN: 1
    }


def test_a_send_accepted_after_the_first_succeeded_is_not_let_through_by_its_copy() -> None:
    # "a" succeeded and released its lock; "b" was accepted; a late copy of "a"
    # ran after that (counted by ran_again, here after the redelivery window).
    kiqs = [kiq("a", "f", 100.0), kiq("b", "f", 102.0)]
    runs = [
        run("a", "f", 100.5, 101.0),
        run("a", "f", 102.5, 103.5, pid=101),
        run("b", "f", 104.0, 105.0),
    ]
    result = verdict(kiqs, runs, options={"redelivery_window": 1})
    assert result["let_through"] == {}
    assert result["ran_again"] == {report.SUCCESS_FORGOTTEN: 1}
    assert result["breaches"] == []


def test_a_stream_retry_lost_in_a_restart_of_its_server_is_a_documented_window() -> None:
    # The stream lives on the list broker's server: its restart fails the retry's send.
    kiqs = [kiq("a", "f", 100.0, broker="redis-stream")]
    runs = [run("a", "f", 100.5, 101.0, broker="redis-stream", outcome="failed")]
    restart = fault("broker-restart", "redis-list", 100.9, 101.1)
    assert verdict(kiqs, runs, [restart])["never_completed"] == {report.RETRY_REFUSED_IN_FAULT: 1}
    assert verdict(kiqs, runs)["never_completed"] == {"retry lost": 1}


def test_a_send_let_in_while_a_retry_could_not_be_sent_is_a_documented_window() -> None:
    # "a" failed and its retry's send failed: the lock was released, and the
    # message came again (the same attempt) after "b" got in.
    kiqs = [kiq("a", "f", 100.0), kiq("b", "f", 101.5)]
    runs = [
        run("a", "f", 100.5, 101.0, outcome="failed"),
        run("b", "f", 101.6, 102.0),
        run("a", "f", 103.0, 104.0, pid=101),
    ]
    failed = [{"task_id": "a", "broker": "rabbitmq", "at": 101.05, "error": "SendTaskError"}]
    result = verdict(kiqs, runs, send_failures=failed)
    assert result["let_through"] == {report.RETRY_SEND_FAILED: 1}
    assert result["breaches"] == []
    # Without a failed send in the ledger the retry held the lock: a breach.
    assert verdict(kiqs, runs)["let_through"] == {"unexplained": 1}
    retried = [*runs[:2], run("a", "f", 103.0, 104.0, pid=101, attempt=1)]
    assert verdict(kiqs, retried, send_failures=failed)["let_through"] == {"unexplained": 1}


def test_a_retry_whose_send_failed_in_a_redis_fault_is_a_documented_window() -> None:
    # The retry's kiq raised as Redis failed (its acquire undone): the lock was
    # free, and the unacknowledged message came again.
    kiqs = [kiq("a", "f", 100.0), kiq("b", "f", 101.5)]
    runs = [
        run("a", "f", 100.5, 101.0, outcome="failed"),
        run("b", "f", 101.6, 102.0),
        run("a", "f", 103.0, 104.0, pid=101),
    ]
    pause = fault("redis-pause", "locks", 100.9, 101.4)
    assert verdict(kiqs, runs, [pause])["let_through"] == {report.RETRY_SEND_FAILED: 1}


def proc(pid: int, fate: str, last_seen: float, broker: str = "rabbitmq") -> dict[str, Any]:
    return {
        "pid": pid,
        "role": "w",
        "broker": broker,
        "first_seen": 90.0,
        "last_seen": last_seen,
        "fate": fate,
    }


def test_bodies_run_again_after_a_success_are_counted_by_task_id() -> None:
    # "a": two copies ran after its success (one task id); "b": one copy, after a
    # Redis restart emptied what remembered its success (a documented window).
    kiqs = [kiq("a", "f", 100.0), kiq("b", "g", 100.0)]
    runs = [
        run("a", "f", 100.5, 101.0),
        run("a", "f", 103.0, 103.5, pid=101),
        run("a", "f", 106.0, 106.5, pid=102),
        run("b", "g", 100.5, 101.0),
        run("b", "g", 106.2, 106.5, pid=101),
    ]
    restart = fault("redis-restart", "locks", 102.0, 102.1)
    result = verdict(kiqs, runs, [restart])
    assert result["ran_again"] == {report.LOST_IN_RESTART: 3}
    assert result["reruns_by_task"] == {report.LOST_IN_RESTART: 2}
    assert result["breaches"] == []
    # A restart between the copies of "a" explains only the later one: "a" is a breach.
    result = verdict(kiqs, runs, [fault("redis-restart", "locks", 105.0, 105.1)])
    assert result["ran_again"] == {report.RAN_AGAIN: 1, report.LOST_IN_RESTART: 2}
    assert result["reruns_by_task"] == {report.RAN_AGAIN: 1, report.LOST_IN_RESTART: 1}
    assert result["reruns_by_policy"] == {"finished": 1}
    assert result["breaches"] == [
        f"bodies run again after a success, by task id: 1 x {report.RAN_AGAIN}"
    ]
    text = report.render(result)
    assert (
        f"bodies run again after a success, by task id: 2 ({report.LOST_IN_RESTART}: 1, "
        f"*{report.RAN_AGAIN}: 1)"
    ) in text
    assert "outside the windows (must be 0): 1 {'finished': 1}" in text
    assert "copies remembered for ever (no redelivery_window)" in text


def test_a_copy_counts_only_within_the_redelivery_window() -> None:
    runs = [run("a", "f", 100.5, 101.0), run("a", "f", 131.0, 131.5, pid=101)]
    kiqs = [kiq("a", "f", 100.0)]
    # No window (a library without the option): every copy counts.
    assert verdict(kiqs, runs)["reruns_by_task"] == {report.RAN_AGAIN: 1}
    inside = verdict(kiqs, runs, options={"redelivery_window": 3600})
    assert inside["reruns_by_task"] == {report.RAN_AGAIN: 1}
    assert "copies remembered 3600s" in report.render(inside)
    outside = verdict(kiqs, runs, options={"redelivery_window": 15})
    assert outside["reruns_by_task"] == {report.SUCCESS_FORGOTTEN: 1}
    assert outside["breaches"] == []


def test_a_copy_after_its_worker_was_killed_before_the_success_reached_redis_is_a_window() -> None:
    kiqs = [kiq("a", "f", 100.0)]
    runs = [run("a", "f", 100.5, 101.0), run("a", "f", 116.0, 116.5, pid=101)]
    killed = [proc(100, "sigkill", 101.05)]
    result = verdict(kiqs, runs, procs=killed)
    assert result["reruns_by_task"] == {report.SUCCESS_KILLED: 1}
    assert result["breaches"] == []
    # Killed a while after its success: the success had reached Redis.
    later = verdict(kiqs, runs, procs=[proc(100, "sigkill", 110.0)])
    assert later["reruns_by_task"] == {report.RAN_AGAIN: 1}


def test_copies_of_a_task_whose_runs_may_overlap_are_not_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(app.POLICIES, "overlap", {"deduplication_exclusive": False})
    fp = "rabbitmq:overlap:1"
    runs = [run("a", fp, 100.5, 101.0), run("a", fp, 102.0, 102.5, pid=101)]
    result = verdict([kiq("a", fp, 100.0)], runs)
    assert result["reruns_by_task"] == {report.COPIES_RUN: 1}
    assert result["breaches"] == []


def test_a_call_that_succeeded_without_a_stored_result_is_a_breach() -> None:
    kiqs = [kiq("a", "f", 100.0), kiq("b", "g", 100.0), kiq("c", "h", 100.0)]
    runs = [
        run("a", "f", 100.5, 101.0),
        run("b", "g", 100.5, 101.0),
        run("c", "h", 100.5, 101.0, outcome="failed", attempt=2),  # never succeeded
    ]
    result = verdict(kiqs, runs, results=[stored("b", 101.01)])
    assert result["lost_results"] == {report.RESULT_NEVER_STORED: 1}
    assert result["examples"]["lost_results"][0]["task_id"] == "a"
    assert result["breaches"] == [
        f"results lost or never stored for a call: 1 x {report.RESULT_NEVER_STORED}"
    ]
    text = report.render(result)
    assert f"results lost or never stored for a call: 1 (*{report.RESULT_NEVER_STORED}: 1)" in text
    assert "calls that succeeded 2, answered with ResultLostError 0" in text


def test_a_result_lost_with_a_killed_worker_is_a_window_only_on_the_list_broker() -> None:
    killed = [proc(100, "sigkill", 101.02)]
    listed = verdict(
        [kiq("a", "f", 100.0, broker="redis-list")],
        [run("a", "f", 100.5, 101.0, broker="redis-list")],
        results=[],
        procs=killed,
    )
    assert listed["lost_results"] == {report.RESULT_LOST_AT_MOST_ONCE: 1}
    assert listed["breaches"] == []
    # A redelivering broker gives the message to another worker: its copy must answer.
    redelivered = verdict(
        [kiq("a", "f", 100.0, broker="nats")],
        [run("a", "f", 100.5, 101.0, broker="nats")],
        results=[],
        procs=killed,
    )
    assert redelivered["lost_results"] == {report.RESULT_LOST_WORKER_DIED: 1}
    assert redelivered["breaches"]
    # A copy that stored ResultLostError answered the caller.
    answered = verdict(
        [kiq("a", "f", 100.0, broker="nats")],
        [run("a", "f", 100.5, 101.0, broker="nats")],
        results=[stored("a", 104.0, "ResultLostError", pid=101)],
        procs=killed,
    )
    assert answered["lost_results"] == {}
    assert answered["results"]["answered_result_lost"] == 1


def test_errors_seen_by_a_later_middleware_leave_out_the_bodies_that_failed() -> None:
    fp = "rabbitmq:remembered:1"
    kiqs = [kiq("a", fp, 100.0)]
    runs = [
        run("a", fp, 100.5, 101.0, outcome="failed", delivery="d1"),
        run("a", fp, 101.5, 102.0, attempt=1, delivery="d2"),
    ]
    hooks = [
        # The first attempt failed on purpose: its on_error is the body's.
        hook("a", 101.0, "RuntimeError: attempt 0 fails on purpose", delivery="d1"),
        # A copy of the success, left out: seen as an error, and its arguments unreadable.
        hook("a", 103.0, "NoResultError: ", hook="pre_execute", delivery="d3"),
        hook("a", 103.0, "NoResultError: ", delivery="d3"),
    ]
    result = verdict(kiqs, runs, hooks=hooks)
    no_body = f"{report.ON_ERROR_NO_BODY} (NoResultError)"
    assert result["errors_seen"] == {report.ARGS_UNREADABLE: 1, no_body: 1}
    assert result["errors_seen_tasks"] == 1
    assert result["errors_not_counted"] == 1
    assert sorted(result["breaches"]) == [
        f"skips seen by another middleware as errors: 1 x {no_body}",
        f"skips seen by another middleware as errors: 1 x {report.ARGS_UNREADABLE}",
    ]
    text = report.render(result)
    assert "skips seen by another middleware as errors: 2 (" in text
    assert "outside the windows (must be 0): 2 in 1 task ids; not counted: 1 on_error" in text
    # Only the body's own failure is left out.
    clean = verdict(kiqs, runs, hooks=hooks[:1])
    assert clean["errors_seen"] == {}
    assert clean["breaches"] == []


def test_an_error_of_a_body_cut_short_by_a_worker_stop_is_a_window() -> None:
    kiqs = [kiq("a", "f", 100.0), kiq("b", "g", 100.0)]
    runs = [
        run("a", "f", 100.5, None, delivery="d1"),
        run("a", "f", 110.0, 111.0, pid=101, attempt=0, delivery="d2"),
        run("b", "g", 100.5, 101.0, delivery="d3"),
    ]
    hooks = [
        hook("a", 106.0, "CancelledError: ", delivery="d1"),
        hook("b", 101.0, "ValueError: late", delivery="d3"),  # after a body that succeeded
    ]
    result = verdict(kiqs, runs, hooks=hooks, procs=[proc(100, "sigterm", 106.5)])
    assert result["errors_seen"] == {report.ON_ERROR_CUT_SHORT: 1, report.ON_ERROR_AFTER_OK: 1}
    assert result["breaches"] == [
        f"skips seen by another middleware as errors: 1 x {report.ON_ERROR_AFTER_OK}"
    ]


def test_new_sends_refused_within_the_success_ttl_are_counted_not_checked() -> None:
    fp = "rabbitmq:remembered:1"
    kiqs = [
        kiq("a", fp, 100.0),
        kiq("b", fp, 100.7, outcome="duplicate", holder="a"),  # "a" still runs
        kiq("c", fp, 103.0, outcome="duplicate", holder="a"),  # its success remembered
        kiq("d", fp, 104.0, outcome="duplicate", holder="a"),
        kiq("e", "f", 100.0),
        kiq("g", "f", 101.5, outcome="duplicate", holder="e"),  # right after e's success
    ]
    runs = [run("a", fp, 100.5, 101.0), run("e", "f", 100.5, 101.0)]
    result = verdict(kiqs, runs)
    assert result["success_ttl_refusals"] == {"success_ttl": 2, "no_success_ttl": 1}
    assert result["breaches"] == []
    assert (
        "a new send within the success TTL is refused, by task id: 2 (a count; without a "
        "success TTL, refused naming a holder that had succeeded: 1)"
    ) in report.render(result)


def test_the_four_lines_of_copies_follow_the_reruns_in_the_report() -> None:
    text = report.render(verdict([kiq("a", "f", 100.0)], [run("a", "f", 100.5, 101.0)]))
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if "by task id" in line)
    assert lines[first - 1].startswith("    after a success the lock remembered")
    titles = [line.split(":")[0].strip() for line in lines[first : first + 7 : 2]]
    assert titles == [
        "bodies run again after a success, by task id",
        "results lost or never stored for a call",
        "skips seen by another middleware as errors",
        "a new send within the success TTL is refused, by task id",
    ]


# The limited task: never over its limit, and no slot kept once everything ended


def limited(
    count: int, started: float = 100.0, **extra: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``count`` calls of the limited task that start together and run 2 s each."""
    runs = [
        run(f"l{i}", f"rabbitmq:limited:{i}", started + i * 0.01, started + 2.0, **extra)
        for i in range(count)
    ]
    return [kiq(r["task_id"], r["fp"], started - 1.0) for r in runs], runs


def test_runs_of_the_limited_task_beyond_its_limit_are_a_breach() -> None:
    result = verdict(*limited(app.LIMIT + 1))
    assert result["over_limit"] == {"over the limit (unexplained)": 1}
    assert result["breaches"] == [
        "runs of a limit over the limit: 1 x over the limit (unexplained)"
    ]
    assert "    over the limit (must be 0): 1" in report.render(result)
    # Up to the limit, across brokers, and one after another: none.
    kiqs, runs = limited(app.LIMIT)
    later = run("z", "redis-list:limited:9", 102.5, 103.0, broker="redis-list")
    result = verdict([*kiqs, kiq("z", later["fp"], 99.0)], [*runs, later])
    assert result["over_limit"] == {}
    assert result["breaches"] == []
    assert "    over the limit (must be 0): 0" in report.render(result)


def test_runs_over_the_limit_after_a_redis_restart_are_a_window() -> None:
    kiqs, runs = limited(app.LIMIT + 1)
    runs[-1]["started"] = 101.0  # after the restart forgot who held the slots
    result = verdict(kiqs, runs, [fault("redis-restart", "locks", 100.5, 100.6)])
    assert result["over_limit"] == {report.LOST_IN_RESTART: 1}
    assert result["breaches"] == []


def test_the_run_of_a_killed_worker_ends_at_its_death_for_the_limit() -> None:
    kiqs, runs = limited(app.LIMIT, pid=100)
    for one in runs:
        one["ended"], one["outcome"] = None, None
    later = run("z", "rabbitmq:limited:9", 140.0, 141.0, pid=101)
    procs = [proc(100, "sigkill", 105.0)]
    result = verdict([*kiqs, kiq("z", later["fp"], 139.0)], [*runs, later], procs=procs)
    assert result["over_limit"] == {}


def test_a_slot_kept_alive_after_everything_ended_is_a_breach() -> None:
    options = {"settled_at": 200.0}
    slots = [
        # Last refreshed before the end: its worker is gone, it lapses.
        {"limit": "soak-limited", "kind": "holder", "member": "a", "deadline": 225.0},
        # Refreshed 10 s after everything ended: a run that never ends keeps it.
        {"limit": "soak-limited", "kind": "waiter", "member": "t b", "deadline": 240.0},
    ]
    result = verdict([], [], options=options, slots=slots)
    assert result["slots_left"] == {report.SLOT_LAPSING: 1, report.SLOT_KEPT: 1}
    assert result["breaches"] == [f"slots of a limit never freed: 1 x {report.SLOT_KEPT}"]
    assert "    slots never freed (must be 0): 1" in report.render(result)
    assert verdict([], [], options=options, slots=slots[:1])["breaches"] == []
