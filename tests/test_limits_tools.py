"""The limits of runs as an operator sees them: ``Locks.limits``, ``taskiq dedup limits``, the page.

The limits are real: tasks with ``limit_concurrency`` and ``limit_rate`` run
through a broker with the middleware, two of them holding their slots and a
third waiting in line until the test ends. The worker that dies holding a slot
is a process of its own, killed.
"""

from __future__ import annotations

import asyncio
import html
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis.asyncio
from starlette.requests import Request

from taskiq_deduplication import LimitInfo, LockEvent, LockEventKind, Locks
from taskiq_deduplication.web import Action, locks_app
from tests._brokers import BrokerFactory
from tests._cli import dedup
from tests._middlewares import dedup_middleware
from tests._topologies import all_topologies

_TIMEOUT = 10


@dataclass
class Busy:
    """``export`` (limit ``"exports"``, two at once) sent a few times, and ``mail`` sent once.

    Two exports hold a slot until ``finish`` is set; any more wait in line.
    ``mail`` has a rate alone, one limit per ``user``; its run is over.
    """

    locks: Locks
    export: Any
    mail: Any
    finish: asyncio.Event
    holders: set[str] = field(default_factory=set)
    """The task ids of the exports that run (and hold a slot)."""


@pytest.fixture
async def busy(make_broker: BrokerFactory) -> AsyncIterator[Busy]:
    """Three exports: two hold a slot, the third waits in line for one."""
    async for busy in _busy(make_broker, waiting=1):
        yield busy


@pytest.fixture
async def full(make_broker: BrokerFactory) -> AsyncIterator[Busy]:
    """Two exports, each holding a slot, and none waiting.

    On a Redis Cluster a run that waits is never woken when a slot frees (the
    wake-ups cannot subscribe there), so a test on every topology leaves none
    waiting: its teardown would wait for that run.
    """
    async for busy in _busy(make_broker, waiting=0):
        yield busy


async def _busy(make_broker: BrokerFactory, waiting: int) -> AsyncIterator[Busy]:
    broker = await make_broker()
    middleware = dedup_middleware(broker)
    finish, running = asyncio.Event(), asyncio.Queue[int]()
    limited: asyncio.Queue[LockEvent] = asyncio.Queue()
    middleware.subscribe(
        lambda event: limited.put_nowait(event) if event.kind is LockEventKind.LIMITED else None
    )

    @broker.task(task_name="tools.export", limit_key="exports", limit_concurrency=2)
    async def export(n: int) -> None:
        running.put_nowait(n)
        await finish.wait()

    @broker.task(task_name="tools.mail", limit_rate="5/m", limit_key_fields=["user"])
    async def mail(user: int, body: str) -> None: ...

    busy = Busy(middleware.locks, export, mail, finish)
    try:
        ids = [(await export.kiq(n)).task_id for n in range(2 + waiting)]
        started = {await asyncio.wait_for(running.get(), _TIMEOUT) for _ in range(2)}
        busy.holders = {ids[n] for n in started}
        for _ in range(waiting):
            waits = await asyncio.wait_for(limited.get(), _TIMEOUT)
            assert waits.task_id not in busy.holders
        sent = await mail.kiq(user=7, body="secret")
        await asyncio.wait_for(sent.wait_result(), _TIMEOUT)
        yield busy
    finally:
        finish.set()


async def _only(locks: Locks, match: str) -> LimitInfo:
    (limit,) = await locks.limits(match)
    return limit


# The lock API


@all_topologies()
async def test_each_limit_shows_its_use_limit_and_rate(full: Busy, prefix: str) -> None:
    exports, mails = await full.locks.limits()
    assert exports == LimitInfo(
        name="exports",
        key=f"{prefix}#limit:{{exports}}",
        concurrency=2,
        rate=None,
        in_use=2,
        waiting=0,
        holders=exports.holders,
    )
    assert set(exports.holders) == full.holders
    # One limit per user, named by a digest: never the argument's value.
    assert mails.name.startswith("tools.mail:")
    assert "7" not in mails.name.removeprefix("tools.mail:")
    assert mails.key == f"{prefix}#limit:{{{mails.name}}}"
    assert (mails.concurrency, mails.rate, mails.in_use, mails.waiting) == (None, "5/m", 0, 0)
    assert mails.holders == ()
    assert await full.locks.limits("exp*") == [exports]
    assert await full.locks.limits("tools.mail:*") == [mails]
    assert await full.locks.limits("no-such-limit") == []


async def test_a_run_that_waits_for_a_slot_is_counted_as_waiting(busy: Busy) -> None:
    exports = await _only(busy.locks, "exports")
    assert (exports.in_use, exports.waiting) == (2, 1)
    assert set(exports.holders) == busy.holders


async def test_a_limit_whose_runs_ended_shows_no_use(busy: Busy) -> None:
    busy.finish.set()  # the waiting export takes a slot, and every export ends
    await asyncio.wait_for(busy.export.broker.wait_all(), _TIMEOUT)
    done = await _only(busy.locks, "exports")
    assert (done.concurrency, done.in_use, done.waiting, done.holders) == (2, 0, 0, ())


async def test_a_run_whose_worker_died_counts_until_its_lease_lapses(
    redis_url: str, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _DYING_WORKER,
        env={**os.environ, "URL": redis_url, "PREFIX": prefix},
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert worker.stdout is not None
        line = await asyncio.wait_for(worker.stdout.readline(), 30)
        assert line == b"holding\n"
        async with Locks.from_url(redis_url, prefix=prefix) as locks:
            alive = await _only(locks, "reports")
            worker.send_signal(signal.SIGKILL)  # nothing frees its slot, nor its place in line
            await worker.wait()
            assert (alive.in_use, alive.waiting, len(alive.holders)) == (1, 1, 1)
            # The leases are 1 s (running_ttl=1), refreshed every third of it.
            deadline = time.monotonic() + _TIMEOUT
            while (lapsed := await _only(locks, "reports")).in_use or lapsed.waiting:
                assert time.monotonic() < deadline, lapsed
                await asyncio.sleep(0.1)
            # Still in Redis (the limit's next use deletes them), yet not counted.
            assert await redis_client.zcard(alive.key) == 1
            assert await redis_client.zcard(f"{alive.key}:waiting") == 1
        assert (lapsed.concurrency, lapsed.in_use, lapsed.waiting, lapsed.holders) == (1, 0, 0, ())
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()


# A worker that takes the only slot of limit "reports" and a place in its line, then dies.
_DYING_WORKER = """
import asyncio, os
from taskiq import InMemoryBroker
from taskiq_deduplication import LockEventKind, RedisDeduplicationMiddleware

async def main():
    middleware = RedisDeduplicationMiddleware(
        redis_url=os.environ["URL"], key_prefix=os.environ["PREFIX"], running_ttl=1
    )
    broker = InMemoryBroker().with_middlewares(middleware)
    waits = asyncio.Event()
    middleware.subscribe(lambda event: event.kind is LockEventKind.LIMITED and waits.set())
    runs = asyncio.Event()

    @broker.task(task_name="tools.report", limit_key="reports", limit_concurrency=1)
    async def report(n: int) -> None:
        runs.set()
        await asyncio.Event().wait()

    await broker.startup()
    await report.kiq(1)
    await runs.wait()
    await report.kiq(2)
    await waits.wait()
    print("holding", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


# taskiq dedup limits


async def test_the_limits_command_prints_each_limit(
    busy: Busy, redis_url: str, prefix: str
) -> None:
    url = {"REDIS_URL": redis_url}
    as_text, as_json, matched = await asyncio.gather(
        dedup("limits", "--prefix", prefix, **url),
        dedup("limits", "--prefix", prefix, "--json", **url),
        dedup("limits", "--prefix", prefix, "--match", "tools.mail:*", **url),
    )
    assert (as_text.status, as_text.stderr) == (0, "")
    header, exports, mails, summary = as_text.stdout.splitlines()
    assert header.split() == ["LIMIT", "IN", "USE", "RATE", "WAITING"]
    assert exports.split() == ["exports", "2/2", "-", "1"]
    mail_name, *mail_cells = mails.split()
    assert mail_name.startswith("tools.mail:")
    assert mail_cells == ["-", "5/m", "0"]
    assert summary == f"2 limits under {prefix}"

    assert as_json.status == 0
    shown = as_json.json()
    assert [limit["name"] for limit in shown] == ["exports", mail_name]
    assert set(shown[0]["holders"]) == busy.holders
    assert shown[0] | {"holders": None} == {
        "name": "exports",
        "key": f"{prefix}#limit:{{exports}}",
        "concurrency": 2,
        "rate": None,
        "in_use": 2,
        "waiting": 1,
        "holders": None,
    }
    assert (shown[1]["concurrency"], shown[1]["rate"], shown[1]["in_use"]) == (None, "5/m", 0)

    assert matched.status == 0
    assert matched.stdout.splitlines()[1:] == [
        mails,
        f"1 limit under {prefix} matching tools.mail:*",
    ]


async def test_the_limits_command_with_no_limit(redis_url: str, prefix: str) -> None:
    run = await dedup("limits", "--prefix", prefix, "--url", redis_url)
    assert (run.status, run.stdout) == (0, f"0 limits under {prefix}\n")


# The locks page


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


async def test_the_page_shows_each_limit_and_its_json(busy: Busy) -> None:
    async with _client(locks_app(busy.locks)) as browser:
        listing = await browser.get("/")
        page = await browser.get("/limits")
        mails = await browser.get("/limits", params={"match": "tools.mail:*"})
        none = await browser.get("/limits", params={"match": "no-such-limit"})
        answer = await browser.get("/api/limits")
    assert 'href="/limits"' in listing.text
    assert page.status_code == 200
    rows = {cells[0]: cells[1:] for cells in map(_cells, _rows(page.text))}
    exports = rows.pop("exports")
    assert exports[:3] == ["2 of 2", "-", "1"]
    assert set(exports[3].split()) == busy.holders
    ((mail_name, mail_cells),) = rows.items()
    assert mail_name.startswith("tools.mail:")
    assert mail_cells == ["-", "5/m", "0", "-"]
    assert "secret" not in page.text  # a call's argument is never shown
    assert [row[0] for row in map(_cells, _rows(mails.text))] == [mail_name]
    assert _rows(none.text) == []
    assert "No limit matches" in none.text

    assert answer.status_code == 200
    shown = answer.json()
    assert shown["prefix"] == busy.locks.prefix
    assert [limit["name"] for limit in shown["limits"]] == ["exports", mail_name]
    assert shown["limits"][0]["in_use"] == 2
    assert shown["limits"][0]["waiting"] == 1


async def test_the_limits_are_shown_only_to_whom_authorize_lets_see(busy: Busy) -> None:
    asked: list[tuple[str, Action]] = []

    def refuse(request: Request, action: Action) -> bool:
        asked.append((request.url.path, action))
        return False

    async with _client(locks_app(busy.locks, authorize=refuse)) as browser:
        page = await browser.get("/limits")
        answer = await browser.get("/api/limits")
    assert (page.status_code, answer.status_code) == (403, 403)
    assert "exports" not in page.text
    assert "exports" not in answer.text
    assert asked == [("/limits", "view"), ("/api/limits", "view")]


def _rows(page: str) -> list[str]:
    """The rows of the page's table, as HTML."""
    body = page.partition("<tbody>")[2].partition("</tbody>")[0]
    return [row for row in body.split("</tr>") if "<td>" in row]


def _cells(row: str) -> list[str]:
    """The text of each cell of ``row``."""
    cells = re.findall(r"<td>(.*?)</td>", row)
    return [html.unescape(re.sub(r"<[^>]+>", " ", cell)).strip() for cell in cells]
