"""Odd characters in key prefixes and explicit keys: keys stay well formed and distinct.

Each test has a server of its own, so that it can list every key in it.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from taskiq_deduplication import DuplicateTaskError
from taskiq_deduplication.model.fingerprint import call_fingerprint
from tests._locks import without_done
from tests._server import Server
from tests.faults._harness import RecordingBroker, admin
from tests.faults.conftest import BrokerMaker

pytestmark = pytest.mark.timeout(20)

PREFIXES = ["app:dedup", "{tag}", "with space", "ünï:cödé:🔥", "{a}:{b} c:", "x}{y"]
EXPLICIT_KEYS = ["user:42", "{user}", "a b", "ключ", "🔑:{}", " ", "a\tb\nc", "tail:"]

# "<owner token> <task_id>"; the token has no spaces.
_VALUE = re.compile(r"\S+ (\S+)")


@pytest.fixture
async def broker(
    key_prefix: str, make_recording_broker: BrokerMaker, server: Server
) -> RecordingBroker:
    """A started broker on the test's server, its locks under the odd ``key_prefix``."""
    return await make_recording_broker(server.url, key_prefix=key_prefix)


@pytest.mark.parametrize("key_prefix", PREFIXES)
async def test_explicit_keys_are_kept_verbatim_and_distinct(
    key_prefix: str, broker: RecordingBroker, server: Server
) -> None:
    finish = asyncio.Event()

    @broker.task
    async def work(n: int) -> int:
        await finish.wait()
        return n

    handles = [
        await work.kicker().with_labels(deduplication_key=key).kiq(n=n)
        for n, key in enumerate(EXPLICIT_KEYS)
    ]
    expected = {
        f"{key_prefix}:{key}": h.task_id for key, h in zip(EXPLICIT_KEYS, handles, strict=True)
    }
    await asyncio.sleep(0)  # the last send's extension goes at the end of the loop's turn
    with admin(server.port) as client:
        stored = {str(k): str(client.get(k)) for k in client.keys("*")}
    assert set(stored) == set(expected)  # one key each, exactly as written
    for key, value in stored.items():
        match = _VALUE.fullmatch(value)
        assert match is not None, value
        assert match[1] == expected[key]

    for n, key in enumerate(EXPLICIT_KEYS):  # the same key is a duplicate, whatever n
        with pytest.raises(DuplicateTaskError) as caught:
            await work.kicker().with_labels(deduplication_key=key).kiq(n=n + 100)
        assert caught.value.key == f"{key_prefix}:{key}"
        assert caught.value.holder_task_id == handles[n].task_id

    finish.set()
    for handle in handles:
        await handle.wait_result(timeout=5)
    await broker.wait_all()
    with admin(server.port) as client:
        assert without_done(client.keys("*")) == []  # every one released


@pytest.mark.parametrize("key_prefix", PREFIXES)
async def test_fingerprint_keys_under_an_odd_prefix_are_well_formed(
    key_prefix: str, broker: RecordingBroker, server: Server
) -> None:
    texts = ["a", "a:b", "{a}", "ünï 🔥"]
    finish = asyncio.Event()

    @broker.task
    async def work(text: str) -> str:
        await finish.wait()
        return text

    for text in texts:
        await work.kiq(text=text)
    with admin(server.port) as client:
        keys = {str(k) for k in client.keys("*")}
    assert keys == {
        f"{key_prefix}:{call_fingerprint(work.task_name, [], {'text': text})}" for text in texts
    }
    # The digest part is plain ASCII: nothing in it can be read as a separator,
    # a hash tag or a glob by a tool that lists the keys.
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", key.rsplit(":", 1)[1]) for key in keys)
    finish.set()
    await broker.wait_all()
