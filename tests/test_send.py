"""Sending: what a caller of ``kiq()`` sees, and the lock it leaves in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import re
from typing import Any

import pytest
import redis.asyncio
from taskiq import AsyncTaskiqTask, BrokerMessage, SendTaskError

from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware
from taskiq_deduplication.model.formats import new_token
from taskiq_deduplication.send import pending as pending_module
from tests._brokers import BrokerFactory, HoldingBroker, RefusingBroker, holds_no_lock, queued_job
from tests._locks import lock_keys, lock_value
from tests._middlewares import dedup_middleware
from tests._topologies import Topology, all_topologies, primary_client


@all_topologies()
async def test_second_identical_kiq_raises_naming_the_holder(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task
    async def send_email(user_id: int) -> None: ...

    first = await send_email.kiq(user_id=42)
    with pytest.raises(DuplicateTaskError) as caught:
        await send_email.kiq(user_id=42)

    err = caught.value
    (key,) = await lock_keys(redis_client, prefix)
    assert err.task_name == send_email.task_name
    assert err.key == key
    assert err.holder_task_id == first.task_id
    assert first.task_id in str(err)
    assert send_email.task_name in str(err)
    assert len(broker.queued) == 1  # the duplicate never reached the broker


async def test_lock_value_names_the_holder_and_an_owner_token(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    _, job = await queued_job(make_broker)

    first = await job.kiq()
    (key,) = await lock_keys(redis_client, prefix)
    token, task_id = (await lock_value(redis_client, key)).split(" ")
    assert task_id == first.task_id
    owner, taken, policy, name = token.split("/")  # the owner, and the lock's record
    assert name == job.task_name  # recorded by default (issue 31)
    assert len(owner) == 11
    assert taken.isdigit()
    assert policy == "f"
    assert key == f"{prefix}:" + key.rsplit(":", 1)[1]
    assert len(key.rsplit(":", 1)[1]) == 43  # the full SHA-256 digest, base64url


def _tokens_of_a_forked_child(count: int, pipe: Any) -> None:
    pipe.send([new_token() for _ in range(count)])
    pipe.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="only where processes fork")
def test_a_forked_worker_process_makes_tokens_of_its_own() -> None:
    # taskiq forks its worker processes: tokens drawn from a generator that each
    # child inherited as it was would repeat from one process to the next.
    context = multiprocessing.get_context("fork")
    theirs, ours = context.Pipe(duplex=False)
    child = context.Process(target=_tokens_of_a_forked_child, args=(200, ours))
    child.start()
    child_tokens = theirs.recv()
    child.join(30)
    parent_tokens = [new_token() for _ in range(200)]
    assert not set(child_tokens) & set(parent_tokens)
    assert len(set(child_tokens)) == len(set(parent_tokens)) == 200
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{11}", token) for token in child_tokens)


async def test_duplicate_is_logged_as_a_warning_without_arguments(
    broker: HoldingBroker, caplog: pytest.LogCaptureFixture
) -> None:
    @broker.task
    async def charge(card_number: str) -> None: ...

    first = await charge.kiq(card_number="4111-SECRET-1111")
    caplog.set_level(logging.DEBUG, logger="taskiq_deduplication")
    with pytest.raises(DuplicateTaskError):
        await charge.kiq(card_number="4111-SECRET-1111")

    # One line at INFO on a logger of its own: a refusal is the library working.
    said = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [(r.name, r.levelno) for r in said] == [("taskiq_deduplication.refusals", logging.INFO)]
    text = said[0].getMessage()
    assert charge.task_name in text
    assert first.task_id in text
    assert "SECRET" not in caplog.text


async def test_different_arguments_are_different_locks(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task
    async def job(user_id: int) -> None: ...

    await job.kiq(user_id=1)
    await job.kiq(user_id=2)
    await job.kiq(2)  # positional: a different fingerprint from user_id=2, as documented
    await job.kiq("2")  # type: ignore[call-overload]  # a string is not the number 2
    with pytest.raises(DuplicateTaskError):
        await job.kiq(2)
    assert len(broker.queued) == 4


async def test_keyword_order_does_not_matter(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task
    async def job(a: int, b: int) -> None: ...

    await job.kiq(a=1, b=2)
    with pytest.raises(DuplicateTaskError):
        await job.kiq(b=2, a=1)


async def test_same_arguments_to_different_tasks_do_not_collide(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task
    async def first(user_id: int) -> None: ...

    @broker.task
    async def second(user_id: int) -> None: ...

    await first.kiq(user_id=1)
    await second.kiq(user_id=1)
    assert len(broker.queued) == 2


class PeekingBroker(HoldingBroker):
    """Holds each message, and tells the lock's TTL while the send is on its way."""

    def __init__(self, await_inplace: bool = False) -> None:
        super().__init__(await_inplace=await_inplace)
        self.client: redis.asyncio.Redis | None = None
        self.ttls_in_flight: list[int] = []

    async def kick(self, message: BrokerMessage) -> None:
        assert self.client is not None
        key = message.labels["_deduplication_lock_key"]
        self.ttls_in_flight.append(await self.client.pttl(key))
        await super().kick(message)


@pytest.mark.parametrize(("ttl", "grace_ms"), [(120, 10_000), (3, 3_000)])
async def test_lock_gets_the_grace_ttl_then_its_full_ttl(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    ttl: int,
    grace_ms: int,
) -> None:
    broker = await make_broker(broker_class=PeekingBroker, default_ttl=ttl)
    broker.client = redis_client

    @broker.task
    async def job() -> None: ...

    await job.kiq()
    # While the send is on its way, the lock has the grace TTL (or its own, if shorter).
    (in_flight,) = broker.ttls_in_flight
    assert grace_ms - 1_000 < in_flight <= grace_ms
    await dedup_middleware(broker).shutdown()  # sends the queued extension
    (key,) = await lock_keys(redis_client, prefix)
    assert ttl * 1000 - 10_000 < await redis_client.pttl(key) <= ttl * 1000


class GatedBroker(HoldingBroker):
    """Holds every send in its ``kick`` until ``open`` is set: all are in flight at once."""

    def __init__(self, await_inplace: bool = False) -> None:
        super().__init__(await_inplace=await_inplace)
        self.open = asyncio.Event()
        self.all_in = asyncio.Event()
        self.expected = 0
        self.in_kick = 0

    async def kick(self, message: BrokerMessage) -> None:
        self.in_kick += 1
        if self.in_kick == self.expected:
            self.all_in.set()
        await self.open.wait()
        await super().kick(message)


async def test_more_sends_in_flight_than_are_remembered_still_get_their_full_ttl(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A bulk enqueue of thousands: more sends between pre_send and post_send
    # than the middleware keeps a record of (4096; 3 here).
    monkeypatch.setattr(pending_module, "MAX_SENDS_IN_FLIGHT", 3)
    broker = await make_broker(broker_class=GatedBroker, default_ttl=120)

    @broker.task
    async def job(number: int) -> None: ...

    broker.expected = 10
    sends = [asyncio.ensure_future(job.kiq(number)) for number in range(broker.expected)]
    await asyncio.wait_for(broker.all_in.wait(), timeout=10)
    broker.open.set()
    await asyncio.gather(*sends)
    await dedup_middleware(broker).shutdown()  # sends the queued extensions
    keys = await lock_keys(redis_client, prefix)
    assert len(keys) == 10
    assert all([await redis_client.pttl(key) > 110_000 for key in keys])  # none on the grace TTL


async def test_a_send_the_broker_refuses_releases_its_lock(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=RefusingBroker, default_ttl=120)

    @broker.task
    async def job() -> None: ...

    for _ in range(2):  # the second is no duplicate of the first, never queued
        with pytest.raises(SendTaskError):
            await job.kiq()
    await dedup_middleware(broker).shutdown()  # sends the queued releases
    assert await lock_keys(redis_client, prefix) == []


async def test_ttl_label_on_the_decorator_and_on_the_call(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, default_ttl=300)

    @broker.task(deduplication_ttl=60)
    async def job(n: int) -> None: ...

    await job.kiq(n=1)
    await job.kicker().with_labels(deduplication_ttl=30).kiq(n=2)
    await dedup_middleware(broker).shutdown()
    ttls = {}
    for message in broker.queued:
        key = message.labels["_deduplication_lock_key"]
        ttls[message.labels["deduplication_ttl"]] = await redis_client.pttl(key)
    assert 50_000 < ttls["60"] <= 60_000
    assert 20_000 < ttls["30"] <= 30_000
    assert {k async for k in redis_client.scan_iter(match=f"{prefix}:*")} == {
        m.labels["_deduplication_lock_key"] for m in broker.queued
    }


async def test_opting_out_on_the_decorator_and_on_the_call(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task(deduplication=False)
    async def always_run(payload: str) -> None: ...

    @broker.task
    async def usually_deduplicated(payload: str) -> None: ...

    await always_run.kiq(payload="x")
    await always_run.kiq(payload="x")
    opted_out = usually_deduplicated.kicker().with_labels(deduplication=False)
    await opted_out.kiq(payload="x")
    await opted_out.kiq(payload="x")
    assert len(broker.queued) == 4
    assert await lock_keys(redis_client, prefix) == []
    assert all("_deduplication_lock_key" not in m.labels for m in broker.queued)


async def test_opt_in_mode(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, default_deduplication=False)

    @broker.task
    async def plain() -> None: ...

    @broker.task(deduplication=True)
    async def guarded() -> None: ...

    await plain.kiq()
    await plain.kiq()
    await guarded.kiq()
    with pytest.raises(DuplicateTaskError):
        await guarded.kiq()
    await plain.kicker().with_labels(deduplication=True).kiq()
    with pytest.raises(DuplicateTaskError):
        await plain.kicker().with_labels(deduplication=True).kiq()
    assert len(await lock_keys(redis_client, prefix)) == 2


async def test_explicit_key_shares_one_lock_whatever_the_arguments(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task(deduplication_key="send-welcome-email")
    async def send_welcome_email(user_id: int, locale: str) -> None: ...

    await send_welcome_email.kiq(user_id=1, locale="en")
    with pytest.raises(DuplicateTaskError) as caught:
        await send_welcome_email.kiq(user_id=2, locale="fr")
    assert caught.value.key == f"{prefix}:send-welcome-email"
    assert await lock_keys(redis_client, prefix) == [f"{prefix}:send-welcome-email"]


async def test_explicit_key_on_the_call_wins_over_key_fields(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task(deduplication_key_fields=["user_id"])
    async def job(user_id: int) -> None: ...

    keyed = job.kicker().with_labels(deduplication_key="one")
    await keyed.kiq(user_id=1)
    with pytest.raises(DuplicateTaskError):
        await job.kicker().with_labels(deduplication_key="one").kiq(user_id=2)
    await job.kiq(user_id=1)  # the key fields still apply without the explicit key


async def test_key_fields_deduplicate_on_a_subset_of_kwargs(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task(deduplication_key_fields=["user_id"])
    async def send_welcome_email(user_id: int, locale: str) -> None: ...

    await send_welcome_email.kiq(user_id=1, locale="en")
    with pytest.raises(DuplicateTaskError):
        await send_welcome_email.kiq(user_id=1, locale="fr")
    await send_welcome_email.kiq(user_id=2, locale="en")
    labelled = send_welcome_email.kicker().with_labels(
        deduplication_key_fields=["locale"]  # type: ignore[arg-type]  # list labels work
    )
    await labelled.kiq(user_id=3, locale="de")
    with pytest.raises(DuplicateTaskError):
        await labelled.kiq(user_id=4, locale="de")


async def test_missing_key_field_is_dropped_with_a_warning(
    broker: HoldingBroker, caplog: pytest.LogCaptureFixture
) -> None:
    @broker.task(deduplication_key_fields=["user_id", "tenant"])
    async def job(user_id: int, tenant: str = "main") -> None: ...

    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    await job.kiq(user_id=1)
    assert any("'tenant'" in r.getMessage() for r in caplog.records)
    with pytest.raises(DuplicateTaskError):
        await job.kiq(user_id=1)


async def test_positional_arguments_with_key_fields_are_left_out_with_a_warning(
    broker: HoldingBroker, caplog: pytest.LogCaptureFixture
) -> None:
    @broker.task(deduplication_key_fields=["user_id"])
    async def job(item: str, user_id: int = 0) -> None: ...

    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    await job.kiq("book", user_id=1)
    assert any("positional" in r.getMessage() for r in caplog.records)
    assert "book" not in caplog.text
    with pytest.raises(DuplicateTaskError):
        await job.kiq("pen", user_id=1)


async def test_labels_given_as_strings_are_read_as_their_values(make_broker: BrokerFactory) -> None:
    # A scheduled send loses taskiq's label types: every label is a string.
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task
    async def job(user_id: int, locale: str) -> None: ...

    strings = job.kicker().with_labels(
        deduplication="False", deduplication_ttl="30", deduplication_key_fields="['user_id']"
    )
    await strings.kiq(user_id=1, locale="en")
    await strings.kiq(user_id=1, locale="en")  # "False" means off, though it is truthy
    fields = job.kicker().with_labels(deduplication="true", deduplication_key_fields='["user_id"]')
    await fields.kiq(user_id=1, locale="en")
    with pytest.raises(DuplicateTaskError):
        await fields.kiq(user_id=1, locale="fr")


@pytest.mark.parametrize(
    ("label", "value"),
    [
        ("deduplication_ttl", "abc"),
        ("deduplication_ttl", 0),
        ("deduplication_ttl", -5),
        ("deduplication_ttl", 1.5),
        ("deduplication", "maybe"),
        ("deduplication_key", ""),
        ("deduplication_key", None),
        ("deduplication_key_fields", "user_id"),
        ("deduplication_key_fields", []),
        ("deduplication_key_fields", ["user id"]),
        ("deduplication_key_fields", [1]),
    ],
)
async def test_invalid_label_raises_before_anything_is_sent(
    broker: HoldingBroker,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    label: str,
    value: object,
) -> None:
    @broker.task
    async def job(user_id: int) -> None: ...

    labels: dict[str, Any] = {label: value}
    with pytest.raises(ValueError, match=label) as caught:
        await job.kicker().with_labels(**labels).kiq(user_id=1)
    assert repr(str(value)) in str(caught.value)
    assert broker.queued == []
    assert await lock_keys(redis_client, prefix) == []


async def test_arguments_that_cannot_be_fingerprinted_raise_naming_the_task(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task
    async def job(handle: Any) -> None: ...

    with pytest.raises(TypeError, match="deduplication_key") as caught:
        await job.kiq(handle=object())
    assert job.task_name in str(caught.value)
    assert broker.queued == []
    assert await lock_keys(redis_client, prefix) == []


async def test_duplicate_error_survives_pickling() -> None:
    err = DuplicateTaskError("tasks:job", "prefix:key", "abc")
    copy = pickle.loads(pickle.dumps(err))  # noqa: S301 (our own object)
    assert (copy.task_name, copy.key, copy.holder_task_id) == ("tasks:job", "prefix:key", "abc")
    assert str(copy) == str(err)
    assert "an unknown task" in str(DuplicateTaskError("t", "k", None))
    unsent = DuplicateTaskError("tasks:job", "prefix:key", "abc", holder_sent=False)
    copy = pickle.loads(pickle.dumps(unsent))  # noqa: S301 (our own object)
    assert copy.holder_sent is False
    assert str(copy) == str(unsent)
    assert str(unsent).endswith("whose send the broker has not accepted yet")


async def test_foreign_lock_value_gives_no_holder(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task(deduplication_key="shared")
    async def job() -> None: ...

    await redis_client.set(f"{prefix}:shared", "written-by-something-else", ex=30)
    with pytest.raises(DuplicateTaskError) as caught:
        await job.kiq()
    assert caught.value.holder_task_id is None


async def test_waiting_for_the_winner(make_broker: BrokerFactory) -> None:
    broker = await make_broker()
    started = asyncio.Event()
    finish = asyncio.Event()

    @broker.task
    async def compute(user_id: int) -> int:
        started.set()
        await finish.wait()
        return user_id * 10

    winner = await compute.kiq(user_id=4)
    await started.wait()
    holder: str | None = None
    try:
        await compute.kiq(user_id=4)
    except DuplicateTaskError as err:
        holder = err.holder_task_id
    assert holder == winner.task_id
    handle = AsyncTaskiqTask(holder, broker.result_backend)
    finish.set()
    result = await handle.wait_result(timeout=5)
    assert result.return_value == 40


@all_topologies()
async def test_a_burst_of_concurrent_identical_sends_lets_exactly_one_through(
    broker: HoldingBroker,
) -> None:
    @broker.task
    async def job(n: int) -> None: ...

    outcomes = await asyncio.gather(*(job.kiq(n=1) for _ in range(300)), return_exceptions=True)
    accepted = [o for o in outcomes if isinstance(o, AsyncTaskiqTask)]
    rejected = [o for o in outcomes if isinstance(o, DuplicateTaskError)]
    assert len(accepted) == 1
    assert len(rejected) == 299
    assert {r.holder_task_id for r in rejected} == {accepted[0].task_id}


@all_topologies()
async def test_a_burst_of_distinct_sends_never_runs_out_of_connections(
    make_broker: BrokerFactory,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    topology: Topology,
    request: pytest.FixtureRequest,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        options: dict[str, Any] = {}
        if topology.name == "sentinel":
            # The Sentinel client of the other tests gives a call 0.5 s from the
            # moment it is made: on a loaded machine the last of 2,000 calls made
            # at once can wait that long for its turn, which says nothing about
            # connections, what this test is about.
            client = primary_client(request.getfixturevalue("sentinels"), socket_timeout=5)
            stack.push_async_callback(client.aclose)
            options["client"] = client
        broker: HoldingBroker = await make_broker(broker_class=HoldingBroker, **options)

        @broker.task
        async def job(n: int) -> None: ...

        outcomes = await asyncio.gather(
            *(job.kiq(n=i) for i in range(2000)), return_exceptions=True
        )
        assert [o for o in outcomes if isinstance(o, BaseException)] == []
        assert len(await lock_keys(redis_client, prefix)) == 2000
        await broker.shutdown()


async def test_fail_open_sends_without_a_lock_when_redis_is_unreachable(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    dead = "redis://127.0.0.1:1/0?socket_connect_timeout=0.5"
    caplog.set_level(logging.WARNING, logger="taskiq_deduplication")
    broker = HoldingBroker().with_middlewares(
        RedisDeduplicationMiddleware(redis_url=dead, fail_open=True)
    )

    @broker.task
    async def job() -> None: ...

    await job.kiq()
    await job.kiq()  # no lock could be taken, so no duplicate could be seen
    assert len(broker.queued) == 2
    assert all(holds_no_lock(m.labels) for m in broker.queued)
    assert "fail_open" in caplog.text


async def test_without_fail_open_an_unreachable_redis_fails_the_send() -> None:
    dead = "redis://127.0.0.1:1/0?socket_connect_timeout=0.5"
    broker = HoldingBroker().with_middlewares(RedisDeduplicationMiddleware(redis_url=dead))

    @broker.task
    async def job() -> None: ...

    with pytest.raises(redis.exceptions.ConnectionError):
        await job.kiq()
    assert broker.queued == []
    await dedup_middleware(broker).shutdown()
