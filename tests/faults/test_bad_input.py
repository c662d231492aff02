"""Bad input: a clear error that names the culprit, and nothing half-done.

These need no fault, so they run on the session's shared server; every check
that "no key was written" looks at this test's own key prefix.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio

from taskiq_deduplication import RedisDeduplicationMiddleware
from tests.faults._harness import RecordingBroker
from tests.faults.conftest import BrokerMaker

pytestmark = pytest.mark.timeout(20)

#: The ``nothing_went_out`` fixture: ``await nothing_went_out()`` checks a refused call.
Check = Callable[[], Awaitable[None]]


@pytest.fixture
async def broker(make_recording_broker: BrokerMaker, redis_url: str) -> RecordingBroker:
    """A started recording broker on the session's server, under this test's prefix."""
    return await make_recording_broker(redis_url)


@pytest.fixture
def nothing_went_out(
    broker: RecordingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> Check:
    """Check that a refused call left nothing behind: no message sent, no key written."""

    async def check() -> None:
        assert broker.sent == []
        assert await redis_client.keys(f"{prefix}:*") == []

    return check


def _user_task(broker: RecordingBroker, task_name: str | None = None, **labels: Any) -> Any:
    """Register ``work(user_id)``, which returns ``user_id``, with ``labels`` on the task."""

    async def work(user_id: int) -> int:
        return user_id

    return broker.register_task(work, task_name=task_name, **labels)


def _label_values(label: str, *values: object) -> list[tuple[str, object]]:
    """One case a value: ``(label, value)``, in the order given."""
    return [(label, value) for value in values]


def _alone(option: str, *values: object) -> list[tuple[str, dict[str, Any]]]:
    """One case a value: ``option`` set to it, every other option left at its default."""
    return [(option, {option: value}) for value in values]


_OPTION_CASES: list[tuple[str, dict[str, Any]]] = [
    *_alone("redis_url", None, "", 6379, "http://127.0.0.1:6379", "127.0.0.1:6379"),
    ("client", {"redis_url": None, "client": object()}),
    ("client", {"client": "redis://127.0.0.1:6379"}),
    *_alone("default_deduplication", "yes", 1, None),
    *_alone("default_ttl", 0, -1, 1.5, "300", True, None),
    *_alone("key_prefix", "", 1, None, b"taskiq", b"app-\xe9".decode("utf-8", "surrogateescape")),
    *_alone("startup_retries", 0, -1, 2.0, "3", True, None),
    *_alone("startup_retry_delay", -0.1, "1", True, None, math.nan),
    *_alone("heartbeat", "yes", 0, None),
    *_alone("heartbeat_interval", 0, -1, "5", True, math.nan, math.inf),
    ("heartbeat_interval", {"heartbeat_interval": 300}),  # = default_ttl: lapses
    ("heartbeat_interval", {"default_ttl": 10, "heartbeat_interval": 12.5}),
    *_alone("fail_open", "no", 1, None),
    *_alone("running_ttl", -1, 1.5, "15", True),  # 0: no lease
    ("running_ttl", {"running_ttl": 15, "heartbeat": False}),  # nobody keeps the lease
    ("running_ttl", {"running_ttl": 5, "heartbeat_interval": 5}),  # lapses between beats
]


def _case_id(option: str, options: dict[str, Any]) -> str:
    # Without the address of the object() case: pytest-xdist needs the same ids in every process.
    return re.sub(r" at 0x[0-9a-fA-F]+", "", f"{option}={options}")


@pytest.mark.parametrize(
    ("option", "options"), _OPTION_CASES, ids=[_case_id(o, v) for o, v in _OPTION_CASES]
)
def test_a_bad_option_raises_value_error_naming_it(
    option: str, options: dict[str, Any], redis_url: str
) -> None:
    options = {"redis_url": redis_url, "key_prefix": "unused", **options}
    with pytest.raises(ValueError, match=option):
        RedisDeduplicationMiddleware(**options)


def test_both_a_url_and_a_client_is_refused(redis_url: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    with pytest.raises(ValueError, match="redis_url") as caught:
        RedisDeduplicationMiddleware(redis_url=redis_url, client=client)
    assert "client" in str(caught.value)


@pytest.mark.parametrize(
    ("option", "options"),
    [
        # A retry delay no startup can ever wait out: a Redis down at startup
        # would hang the application instead of failing it.
        ("startup_retry_delay", {"startup_retry_delay": math.inf}),
        # A TTL Redis cannot store (its PX is a signed 64-bit count of ms): the
        # extension after the send and every refresh would fail, and each lock
        # would lapse after its 10 s grace TTL (see the label test below).
        ("default_ttl", {"default_ttl": 10**16}),
    ],
    ids=["startup_retry_delay=inf", "default_ttl=1e16"],
)
def test_an_option_no_deployment_can_use_is_refused(
    option: str, options: dict[str, Any], redis_url: str
) -> None:
    with pytest.raises(ValueError, match=option):
        RedisDeduplicationMiddleware(redis_url=redis_url, **options)


_LABEL_CASES: list[tuple[str, object]] = [
    *_label_values("deduplication", "maybe", 2, "", None),
    *_label_values(
        "deduplication_ttl", "abc", 0, -5, "-5", "", 1.5, "1.5", True, "0x10", [30], None
    ),
    *_label_values("deduplication_key", "", b""),
    # What os.listdir gives for a file name that is not UTF-8: no Redis client can send it.
    ("deduplication_key", "file:" + b"report-\xe9.csv".decode("utf-8", "surrogateescape")),
    *_label_values("deduplication_key_fields", "user_id", [], (), "", "[", [1], ["user id"], [""]),
    *_label_values("deduplication_key_fields", {"user_id": 1}, "['a'] + ['b']", None, 7),
    *_label_values("deduplication_running_ttl", "abc", 0, "-5", 1.5, True, None),
]


@pytest.mark.parametrize(
    ("label", "value"), _LABEL_CASES, ids=[f"{label}={v!r}" for label, v in _LABEL_CASES]
)
async def test_a_malformed_label_at_the_call_raises_value_error_naming_it(
    label: str,
    value: object,
    broker: RecordingBroker,
    nothing_went_out: Check,
) -> None:
    work = _user_task(broker)
    labels: dict[str, Any] = {label: value}
    with pytest.raises(ValueError, match=label):
        await work.kicker().with_labels(**labels).kiq(user_id=1)
    await nothing_went_out()


@pytest.mark.parametrize(
    ("label", "value"),
    [("deduplication_ttl", "abc"), ("deduplication_key_fields", "user_id")],
)
async def test_a_malformed_label_on_the_task_raises_value_error_naming_it(
    label: str,
    value: object,
    broker: RecordingBroker,
    nothing_went_out: Check,
) -> None:
    labels: dict[str, Any] = {label: value}
    work = _user_task(broker, "bad_label_task", **labels)
    with pytest.raises(ValueError, match=label):
        await work.kiq(user_id=1)
    await nothing_went_out()


async def test_a_ttl_label_redis_cannot_store_raises_value_error_naming_it(
    broker: RecordingBroker,
    nothing_went_out: Check,
) -> None:
    # 10**16 s is 10**19 ms, past Redis's signed 64-bit PX. The acquire (at the
    # 10 s grace TTL) still works, so the kiq goes through; then the extension
    # to the full TTL and every heartbeat refresh fail inside Redis, and the
    # lock of a task that may run for hours silently lapses after 10 s.
    work = _user_task(broker)
    with pytest.raises(ValueError, match="deduplication_ttl"):
        await work.kicker().with_labels(deduplication_ttl=10**16).kiq(user_id=1)
    await nothing_went_out()


class _Opaque:
    """A value neither JSON nor taskiq can send; its repr holds a secret."""

    def __repr__(self) -> str:
        return "<opaque hunter2>"


def _circular() -> list[object]:
    loop: list[object] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    "value",
    [_Opaque(), {"nested": [1, {"deep": _Opaque()}]}, _circular(), {1, _Opaque()}],
    ids=["object", "nested-object", "circular", "set-with-object"],
)
async def test_arguments_the_fingerprint_cannot_encode_raise_type_error(
    value: object,
    broker: RecordingBroker,
    nothing_went_out: Check,
) -> None:
    @broker.task
    async def work(payload: Any) -> None:
        return None

    with pytest.raises(TypeError, match="work") as caught:
        await work.kiq(payload=value)
    assert "deduplication_key" in str(caught.value)  # says how to get out of it
    assert "hunter2" not in str(caught.value)  # names the type, not the value
    await nothing_went_out()


#: A name as ``os.listdir`` gives it for a file whose name is not UTF-8.
_UNDECODABLE = b"report-\xe9.csv".decode("utf-8", "surrogateescape")


@pytest.mark.parametrize("fail_open", [False, True])
@pytest.mark.parametrize("culprit", ["key", "task_id"])
async def test_a_call_redis_cannot_take_fails_alone_not_the_calls_beside_it(
    culprit: str,
    fail_open: bool,
    make_recording_broker: BrokerMaker,
    redis_url: str,
) -> None:
    broker = await make_recording_broker(redis_url, fail_open=fail_open)

    @broker.task
    async def other(n: int) -> None: ...

    @broker.task
    async def process_file(path: str) -> None: ...

    kicker = process_file.kicker()
    if culprit == "key":  # caught by the label check, before any lock call
        kicker = kicker.with_labels(deduplication_key=f"file:{_UNDECODABLE}")
    else:  # no label to check: the lock call itself fails, on its own
        kicker = kicker.with_task_id(f"id-{_UNDECODABLE}")
    await other.kiq(-1)  # a connection in place: the next calls share batches
    calls = [other.kiq(n) for n in range(20)]
    calls.insert(10, kicker.kiq(_UNDECODABLE))
    results = await asyncio.gather(*calls, return_exceptions=True)
    bad = results.pop(10)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert isinstance(bad, ValueError)
    assert ("deduplication_key" if culprit == "key" else "cannot be sent") in str(bad)
    assert _UNDECODABLE not in str(bad) or culprit == "key"  # a call's text is not echoed
    assert [m.task_name for m in broker.sent] == [other.task_name] * 21
