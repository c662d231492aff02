"""A lock tells what it is for: when it was taken, its policy, its task, whether its send went out.

The record lives in the lock's value (see `model/formats.py`): the acquire script
writes it, in the round trip that takes the lock; the send's ``post_send``
marks it accepted. A lock of an older version (``"<owner token> <task_id>"``)
keeps working with every script, and a worker of the older version, running
its own scripts (a copy of them is in ``tests/fixtures/lua_before_record``),
keeps a new lock as it kept its own.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from taskiq import TaskiqMessage

from taskiq_deduplication import DuplicateTaskError, LockEvent, LockEventKind, Locks, kiq_or_join
from taskiq_deduplication.exceptions import UNSENT_HOLDER
from taskiq_deduplication.model.formats import (
    LOCK_OWNER_LABEL,
    new_run_token,
    new_token,
    read_lock_value,
)
from taskiq_deduplication.store.lock_store import Lock, LockStore, Reasserted
from tests._brokers import BrokerFactory, HoldingBroker
from tests._locks import answered, lock_keys, lock_value, wait_until
from tests._middlewares import dedup_middleware

if TYPE_CHECKING:
    import redis.asyncio
    from taskiq import AsyncTaskiqDecoratedTask

OLD_SCRIPTS = Path(__file__).parent / "fixtures" / "lua_before_record"
#: A task name of 30 characters, the size the memory budget is stated for.
NAME_30 = "billing.tasks:send_invoice_now"


async def server_ms(client: redis.asyncio.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def accepted(client: redis.asyncio.Redis, key: str) -> bool:
    """Whether the lock at ``key`` says its send was accepted (post_send's call is detached)."""
    record = read_lock_value(await lock_value(client, key))
    return record is not None and record.sent is True


def message_of(task: AsyncTaskiqDecoratedTask[Any, Any], task_id: str) -> TaskiqMessage:
    """A message of ``task`` as ``kiq`` builds it, for a test that calls the hooks itself."""
    return TaskiqMessage(
        task_id=task_id, task_name=task.task_name, labels=dict(task.labels), args=[], kwargs={}
    )


async def test_a_lock_records_when_it_was_taken_its_policy_and_that_its_send_went_out(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task(deduplication_until="expired")
    async def job() -> None: ...

    before = await server_ms(redis_client)
    sent = await job.kiq()
    after = await server_ms(redis_client)
    (key,) = await lock_keys(redis_client, prefix)
    await wait_until(lambda: accepted(redis_client, key))
    record = read_lock_value(await lock_value(redis_client, key))
    assert record is not None
    assert record.holder_task_id == sent.task_id
    assert record.policy == "expired"
    assert record.taken_ms is not None
    assert before <= record.taken_ms <= after
    assert record.task_name == job.task_name  # recorded by default (issue 31)
    assert (record.sent, record.running, record.succeeded) == (True, False, False)


async def test_a_lock_records_its_task_name_when_asked(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, record_task_name=True)
    name = "billing.tasks:send invoice/100%"  # what would end a word is escaped

    @broker.task(task_name=name, deduplication_until="started")
    async def job() -> None: ...

    sent = await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    await wait_until(lambda: accepted(redis_client, key))
    value = await lock_value(redis_client, key)
    assert len(value.split(" ")) == 2
    record = read_lock_value(value)
    assert record is not None
    assert (record.task_name, record.policy, record.holder_task_id) == (
        name,
        "started",
        sent.task_id,
    )


async def test_the_record_lives_through_the_run_and_its_success(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(
        broker_class=HoldingBroker, record_task_name=True, default_success_ttl=60
    )
    during: list[Any] = []

    @broker.task(task_name=NAME_30)
    async def job() -> None:
        (key,) = await lock_keys(redis_client, prefix)
        during.append(read_lock_value(await lock_value(redis_client, key)))

    sent = await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    taken = read_lock_value(await lock_value(redis_client, key))
    await broker.deliver()
    await broker.wait_all()
    (running,) = during
    after = read_lock_value(await lock_value(redis_client, key))
    assert taken is not None
    assert running is not None
    assert after is not None
    assert running.running
    assert after.succeeded
    for record in (running, after):
        assert (record.task_name, record.policy, record.taken_ms, record.holder_task_id) == (
            NAME_30,
            "finished",
            taken.taken_ms,
            sent.task_id,
        )


async def test_a_send_that_dies_before_the_broker_accepts_it_is_refused_as_unsent(
    broker: HoldingBroker,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @broker.task(deduplication_key_fields=["n"])
    async def job(n: int = 1) -> None: ...

    middleware = dedup_middleware(broker)
    message = message_of(job, "dies-mid-send")
    message.kwargs = {"n": 1}
    # Its process dies here: pre_send took the lock, no broker ever had the message.
    await middleware.pre_send(message)
    (key,) = await lock_keys(redis_client, prefix)
    record = read_lock_value(await lock_value(redis_client, key))
    assert record is not None
    assert record.sent is False
    assert 0 < await redis_client.pttl(key) <= 10_000  # the grace TTL bounds it

    caplog.set_level(logging.DEBUG, logger="taskiq_deduplication")
    events: list[LockEvent] = []
    middleware.subscribe(events.append)
    with pytest.raises(DuplicateTaskError) as caught:
        await job.kiq(n=1)
    refused = caught.value
    assert (refused.holder_task_id, refused.holder_sent) == ("dies-mid-send", False)
    assert str(refused).endswith(f"held by 'dies-mid-send', {UNSENT_HOLDER}")
    (said,) = [r for r in caplog.records if r.name == "taskiq_deduplication.refusals"]
    assert UNSENT_HOLDER in said.getMessage()

    caplog.clear()
    joined = await kiq_or_join(job, n=1)
    assert joined.joined
    (said,) = [r for r in caplog.records if "joined" in r.getMessage()]
    assert said.levelno == logging.INFO
    assert f"joined task dies-mid-send, {UNSENT_HOLDER}" in said.getMessage()
    assert broker.queued == []
    assert [(e.kind, e.holder_task_id, e.holder_sent) for e in events] == [
        (LockEventKind.DUPLICATE, "dies-mid-send", False),
        (LockEventKind.JOINED, "dies-mid-send", False),
    ]

    # The broker accepts it after all: the refusal says nothing of the kind now.
    await middleware.post_send(message)
    await wait_until(lambda: accepted(redis_client, key))
    with pytest.raises(DuplicateTaskError) as caught:
        await job.kiq(n=1)
    assert caught.value.holder_sent is True
    assert UNSENT_HOLDER not in str(caught.value)


async def test_a_lock_of_an_older_version_is_read_refused_extended_claimed_and_released(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task
    async def job() -> None: ...

    # A send by an older version: its lock's value has no record.
    await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    await wait_until(lambda: accepted(redis_client, key))
    old = Lock(key, "AAAAAAAAAAA", "old-sender", 60_000)
    await redis_client.set(key, old.value, px=60_000)
    record = read_lock_value(old.value)
    assert record is not None
    assert (record.holder_task_id, record.owner_token) == ("old-sender", "AAAAAAAAAAA")
    assert (record.sent, record.policy, record.taken_ms, record.task_name) == (None,) * 4

    with pytest.raises(DuplicateTaskError) as caught:
        await job.kiq()
    assert (caught.value.holder_task_id, caught.value.holder_sent) == ("old-sender", None)
    assert "accepted" not in str(caught.value)

    store = LockStore(redis_client)
    try:
        other = Lock(key, new_token(), "another", 60_000)
        assert answered(await store.acquire(other, 10_000, record="f")).holder == old.value
        assert await store.extend(old, 30_000)
        assert await store.held(old)
        assert await store.reassert([old]) == [Reasserted.REFRESHED]
        assert await lock_value(redis_client, key) == old.value  # no record is added
        run = Lock(key, new_run_token(old.token), old.task_id, 30_000)
        claimed = answered(await store.claim(old, step="reassert", run=run))
        assert claimed.outcome == Reasserted.REFRESHED
        assert await lock_value(redis_client, key) == run.value
        assert await store.finish(run, "failed")
        await redis_client.set(key, old.value, px=60_000)
        assert await store.release(old)
        assert await redis_client.exists(key) == 0
        # A retry of the old send takes its lock over, and records itself.
        await redis_client.set(key, old.value, px=60_000)
        retry = Lock(key, new_token(), old.task_id, 60_000)
        taken = answered(await store.acquire(retry, 10_000, replaces=old.value, record="f"))
        assert taken.holder is None
        assert taken.token is not None
        assert taken.token.startswith(retry.token + "/")
        # An acquire whose reply never came is undone knowing only the owner part.
        assert await store.release(retry)
        assert await redis_client.exists(key) == 0
    finally:
        await store.close()


async def old_script(client: redis.asyncio.Redis, name: str) -> Any:
    """A script as a worker of the version before the record runs it."""
    return client.register_script((OLD_SCRIPTS / f"{name}.lua").read_text("utf-8"))


async def test_a_worker_of_the_older_version_keeps_a_new_lock_as_its_own(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, record_task_name=True)

    @broker.task(task_name=NAME_30)
    async def job() -> None: ...

    sent = await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    await wait_until(lambda: accepted(redis_client, key))
    # What the old worker reads from the message: "<token> <task_id>".
    label = broker.queued[0].labels[LOCK_OWNER_LABEL]
    token, task_id = label.split(" ")
    assert task_id == sent.task_id
    assert await lock_value(redis_client, key) == label  # once accepted: the label's value

    held, reassert, extend, claim = [
        await old_script(redis_client, name) for name in ("held", "reassert", "extend", "claim")
    ]
    assert await held(keys=[key], args=[label]) == 1
    assert await reassert(keys=[key], args=[300_000, label]) == [1]
    assert await extend(keys=[key], args=[token, 300_000]) == 1
    # Its exclusive "finished" run begins: the lock was its send's.
    run = "~" + "R" * 10
    reply = await claim(keys=[key] * 4, args=[label, 300_000, 0, 0, "reassert", 0, 0, run, 0])
    assert reply[0] == 1
    assert await lock_value(redis_client, key) == f"{run} {task_id}"
    # Its release at the end (the run token's, owner-checked by prefix).
    finish = await old_script(redis_client, "finish")
    assert await finish(keys=[key], args=[run, "failed", 0, 0, task_id]) == 1
    assert await redis_client.exists(key) == 0

    # The rare race: the old worker claims before post_send's extension lands.
    # It does not skip the run (the lock is not its task's by its reading): it
    # takes the lock for its run, as from a send queued meanwhile.
    middleware = dedup_middleware(broker)
    message = message_of(job, "in-flight")
    await middleware.pre_send(message)
    label = message.labels[LOCK_OWNER_LABEL]
    assert await lock_value(redis_client, key) == label + "!"
    assert await held(keys=[key], args=[label]) == 0
    reply = await claim(keys=[key] * 4, args=[label, 300_000, 0, 0, "reassert", 0, 0, run, 0])
    assert reply[0] == label + "!"  # "taken over": it runs, once, holding the lock
    assert await lock_value(redis_client, key) == f"{run} in-flight"
    await middleware.post_send(message)  # finds its lock a run's now: leaves it
    await asyncio.sleep(0.2)  # its extension is not awaited
    assert await lock_value(redis_client, key) == f"{run} in-flight"
    assert await finish(keys=[key], args=[run, "failed", 0, 0, "in-flight"]) == 1


async def test_a_lock_with_its_record_stays_within_200_bytes(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    """``MEMORY USAGE`` of a typical lock: a fingerprint key, a prefix as long as the default."""
    typical = f"{prefix}:ab"  # as long as "taskiq:deduplication", and cleaned up with the test's
    assert len(typical) == len("taskiq:deduplication")
    for record_task_name, most in ((False, 200), (True, 232)):  # the name, 30 bytes more
        broker = await make_broker(
            broker_class=HoldingBroker, key_prefix=typical, record_task_name=record_task_name
        )

        @broker.task(task_name=NAME_30)
        async def job(n: int) -> None: ...

        await job.kiq(n=1)
        (key,) = await lock_keys(redis_client, typical)
        await wait_until(lambda: accepted(redis_client, key))  # noqa: B023
        assert len(key) == len(typical) + 1 + 43
        usage = await redis_client.memory_usage(key)
        assert usage is not None
        assert usage <= most, record_task_name
        await redis_client.delete(key)


async def test_the_lock_api_reads_the_record(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, record_task_name=True)

    @broker.task(task_name=NAME_30, deduplication_key="nightly")
    async def job() -> None: ...

    before = await server_ms(redis_client)
    sent = await job.kiq()
    await redis_client.set(f"{prefix}:older", "AAAAAAAAAAA older-task", px=60_000)
    await wait_until(lambda: accepted(redis_client, f"{prefix}:nightly"))
    locks = Locks(redis_client, prefix=prefix)
    lock = await locks.get("nightly")
    older = await locks.get("older")
    assert lock is not None
    assert older is not None
    assert (lock.holder_task_id, lock.task_name, lock.policy, lock.sent) == (
        sent.task_id,
        NAME_30,
        "finished",
        True,
    )
    assert lock.taken_at is not None
    assert lock.age is not None
    assert before / 1000 <= lock.taken_at <= before / 1000 + 5
    assert 0 <= lock.age < 5
    assert (older.holder_task_id, older.owner) == ("older-task", "AAAAAAAAAAA")
    assert (older.policy, older.taken_at, older.age, older.sent, older.task_name) == (None,) * 5
