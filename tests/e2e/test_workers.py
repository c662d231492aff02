"""A client and ``taskiq worker --workers 2`` processes, on every broker.

A duplicate is rejected while the original waits in the queue and while it
runs; once it has finished, the same call is accepted again. Labels set on the
decorator and with ``with_labels`` work on the worker as they do on the sender,
although they reach it as strings.
"""

from __future__ import annotations

from typing import Any

from tests.e2e.app import EXPLICIT_KEY, SHORT_TTL
from tests.e2e.conftest import Launch

#: The spec: a lock is first taken for 10 s, then given its full TTL once sent.
GRACE_TTL = 10


async def test_duplicate_rejected_while_queued_and_running_accepted_after(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind)
    hold = app.tasks.hold
    first = await hold.kiq(tag="a")
    await app.assert_duplicate(hold, first.task_id, tag="a")  # queued: no worker yet
    key = await app.lock_of(first.task_id)
    assert key is not None

    async def full_ttl() -> bool:  # the send went out: the lock has its full TTL
        return await app.redis.pttl(key) > GRACE_TTL * 1000

    await app.wait_until(full_ttl, "the lock to get its full TTL")
    other = await hold.kiq(tag="b")  # other arguments are another task

    app.start_worker()
    await app.wait_started("a")
    await app.assert_duplicate(hold, first.task_id, tag="a")  # running

    await app.open_gate("a")
    result = await first.wait_result(timeout=20)
    assert result.return_value["run"] == 1
    await app.assert_duplicate(hold, other.task_id, tag="b")  # still running

    again = await hold.kiq(tag="a")  # finished: accepted again
    await app.open_gate("a")
    await app.open_gate("b")
    assert (await again.wait_result(timeout=20)).return_value["run"] == 2
    assert not (await other.wait_result(timeout=20)).is_err
    assert await app.runs("a") == 2
    assert await app.runs("b") == 1
    assert await app.locks() == {}


async def test_ttl_label_is_the_lock_ttl_on_the_worker(launch: Launch, broker_kind: str) -> None:
    # The middleware's default is 30 s; the label asks for 3 s.
    app = await launch(broker=broker_kind, default_ttl=30)
    on_decorator = await app.tasks.hold_short_ttl.kiq(tag="decorator")
    on_call = await app.tasks.hold.kicker().with_labels(deduplication_ttl=SHORT_TTL).kiq(tag="call")
    app.start_worker()
    await app.wait_started("decorator")
    await app.wait_started("call")
    keys = {}
    for handle in (on_decorator, on_call):
        key = await app.lock_of(handle.task_id)
        assert key is not None, f"no lock held by {handle.task_id}"
        keys[handle.task_id] = key

    # A heartbeat refreshes each lock, to the TTL of the label, not the default.
    for key in keys.values():
        await app.wait_refreshed(key, SHORT_TTL)
    await app.assert_duplicate(app.tasks.hold_short_ttl, on_decorator.task_id, tag="decorator")
    await app.assert_duplicate(
        app.tasks.hold,
        on_call.task_id,
        labels={"deduplication_ttl": SHORT_TTL},
        tag="call",
    )

    await app.open_gate("decorator")
    await app.open_gate("call")
    assert not (await on_decorator.wait_result(timeout=20)).is_err
    assert not (await on_call.wait_result(timeout=20)).is_err
    assert await app.locks() == {}


async def test_opt_out_label_sends_and_runs_every_call(launch: Launch, broker_kind: str) -> None:
    app = await launch(broker=broker_kind)
    on_decorator = app.tasks.hold_opt_out
    on_call = app.tasks.hold.kicker().with_labels(deduplication=False)
    handles = [
        await on_decorator.kiq(tag="decorator"),
        await on_decorator.kiq(tag="decorator"),
        await on_call.kiq(tag="call"),
        await on_call.kiq(tag="call"),
    ]
    app.start_worker()
    # Both copies of each call run at the same time, and none takes a lock.
    await app.wait_started("decorator", runs=2)
    await app.wait_started("call", runs=2)
    assert await app.locks() == {}

    await app.open_gate("decorator", runs=2)
    await app.open_gate("call", runs=2)
    for handle in handles:
        assert not (await handle.wait_result(timeout=20)).is_err
    assert await app.locks() == {}


async def test_key_fields_label_deduplicates_on_those_fields(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind)
    on_decorator = app.tasks.hold_key_fields
    # taskiq annotates label values as str | float; a list is what the spec passes.
    fields: dict[str, Any] = {"deduplication_key_fields": ["user_id"]}
    on_call = app.tasks.hold.kicker().with_labels(**fields)

    first_decorator = await on_decorator.kiq(tag="d1", user_id=1, locale="en")
    first_call = await on_call.kiq(tag="c1", user_id=1, locale="en")
    other_user = await on_decorator.kiq(tag="d3", user_id=2, locale="en")

    async def same_user_is_a_duplicate() -> None:
        await app.assert_duplicate(
            on_decorator, first_decorator.task_id, tag="d2", user_id=1, locale="fr"
        )
        await app.assert_duplicate(
            app.tasks.hold, first_call.task_id, labels=fields, tag="c2", user_id=1, locale="fr"
        )

    await same_user_is_a_duplicate()  # queued
    app.start_worker()
    await app.wait_started("d1")
    await app.wait_started("c1")
    await same_user_is_a_duplicate()  # running
    for tag in ("d1", "c1", "d3"):
        await app.open_gate(tag)
    for handle in (first_decorator, first_call, other_user):
        assert not (await handle.wait_result(timeout=20)).is_err
    assert await app.locks() == {}

    # The lock was the user's: with the first call done, the other locale goes.
    second = await on_decorator.kiq(tag="d2", user_id=1, locale="fr")
    await app.open_gate("d2")
    assert not (await second.wait_result(timeout=20)).is_err


async def test_explicit_key_label_is_one_lock_for_every_call(
    launch: Launch, broker_kind: str
) -> None:
    app = await launch(broker=broker_kind)
    on_decorator = app.tasks.hold_explicit_key
    labels = {"deduplication_key": "call-key"}
    on_call = app.tasks.hold.kicker().with_labels(**labels)
    first_decorator = await on_decorator.kiq(tag="d1", user_id=1)
    first_call = await on_call.kiq(tag="c1")
    assert await app.holders() == {
        f"{app.config.lock_prefix}:{EXPLICIT_KEY}": first_decorator.task_id,
        f"{app.config.lock_prefix}:call-key": first_call.task_id,
    }

    async def other_arguments_are_duplicates() -> None:
        await app.assert_duplicate(on_decorator, first_decorator.task_id, tag="d2", user_id=2)
        await app.assert_duplicate(app.tasks.hold, first_call.task_id, labels=labels, tag="c2")

    await other_arguments_are_duplicates()  # queued
    app.start_worker()
    await app.wait_started("d1")
    await app.wait_started("c1")
    await other_arguments_are_duplicates()  # running
    await app.open_gate("d1")
    await app.open_gate("c1")
    assert not (await first_decorator.wait_result(timeout=20)).is_err
    assert not (await first_call.wait_result(timeout=20)).is_err
    assert await app.locks() == {}

    second = await on_decorator.kiq(tag="d2", user_id=2)
    await app.open_gate("d2")
    assert not (await second.wait_result(timeout=20)).is_err


async def test_task_sent_by_a_script_that_exits_keeps_its_full_ttl_while_queued(
    launch: Launch,
) -> None:
    # A script that sends a task and ends without broker.shutdown(), as many do.
    # Its task waits in the queue; an identical send must be rejected for the
    # whole TTL (30 s here), not only for the 10 s grace TTL of a send in flight.
    # The broker does not matter: one is enough.
    app = await launch(broker="redis-list", default_ttl=30)
    script = app.start_client("script", "send-and-exit", "s")
    assert script.wait(timeout=20) == 0, script.log()
    [task_id] = await app.report("sent")
    key = await app.lock_of(task_id)
    assert key is not None
    pttl = await app.redis.pttl(key)
    assert pttl > GRACE_TTL * 1000, f"the queued task's lock expires in {pttl} ms"
