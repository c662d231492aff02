"""The locks page over HTTP (``taskiq_deduplication.web``), through its ASGI app.

What a browser does with it (the countdown, a click through a release) is in
``test_web_browser.py``; here every page, form and JSON answer is asked of the
app directly, as a browser or a script would send it.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import re
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI
from starlette.exceptions import HTTPException
from taskiq import AsyncTaskiqTask, InMemoryBroker

from taskiq_deduplication import (
    InvalidArgumentError,
    InvalidSettingError,
    RedisDeduplicationMiddleware,
)
from taskiq_deduplication.cli import ExitCode
from taskiq_deduplication.web import Action, allow_anyone, locks_app
from tests._brokers import BrokerFactory, HoldingBroker
from tests._cli import dedup, one_line_error, start_dedup
from tests._locks import lock_keys
from tests._middlewares import dedup_middleware
from tests._topologies import all_topologies

if TYPE_CHECKING:
    import redis.asyncio
    from starlette.requests import Request
    from starlette.types import ASGIApp

CARD = "4242-card-number"  # an argument no page may show
HOST = "http://testserver"


def client(app: ASGIApp) -> httpx.AsyncClient:
    """A client of ``app`` as a browser on its own origin would be."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=HOST)


async def token(browser: httpx.AsyncClient, path: str = "/") -> str:
    """Open a page, as a browser does before it posts a form: the form token is its cookie."""
    await browser.get(path)
    found = browser.cookies.get("taskiq_dedup_csrf")
    assert found
    return found


def confirmed_locks(page: str) -> list[str]:
    """What the confirmation page's form sends: the owner and key of each lock."""
    return [html.unescape(value) for value in re.findall(r'name="lock" value="([^"]*)"', page)]


@pytest.fixture
async def held(make_broker: BrokerFactory) -> tuple[HoldingBroker, Any]:
    """A broker whose queue keeps its messages (their locks stay), and a task ``charge``."""
    broker = await make_broker(broker_class=HoldingBroker, record_task_name=True)

    @broker.task(deduplication_key_fields=["order"])
    async def charge(order: str, card: str) -> None: ...

    return broker, charge


@dataclass(frozen=True)
class Charged:
    """``charge`` sent once: its lock held while the message waits in the queue."""

    charge: Any
    middleware: RedisDeduplicationMiddleware
    key: str
    sent: AsyncTaskiqTask[None]


@pytest.fixture
async def charged(
    held: tuple[HoldingBroker, Any], redis_client: redis.asyncio.Redis, prefix: str
) -> Charged:
    broker, charge = held
    sent = await charge.kiq(order="A-1", card=CARD)
    [key] = await lock_keys(redis_client, prefix)
    return Charged(charge, dedup_middleware(broker), key, sent)


async def test_every_page_shows_a_lock_a_kiq_took_and_never_its_arguments(
    held: tuple[HoldingBroker, Any],
) -> None:
    broker, charge = held
    sent = await charge.kiq(order="A-1", card=CARD)
    middleware = dedup_middleware(broker)
    app = locks_app(middleware, allow_release=True, authorize=allow_anyone)
    async with client(app) as browser:
        listing = await browser.get("/")
        assert listing.status_code == 200
        [lock] = [lock async for lock in middleware.locks.scan()]
        for shown in (lock.key, charge.task_name, sent.task_id, "finished"):
            assert html.escape(shown) in listing.text
        pages = [
            listing,
            await browser.get("/lock", params={"key": lock.key}),
            await browser.get("/release", params={"key": lock.key}),
            await browser.get("/api/locks"),
            await browser.get("/api/lock", params={"key": lock.key}),
            await browser.post(
                "/key",
                data={
                    "csrf": await token(browser),
                    "task": charge.task_name,
                    "kwargs": f'{{"order": "A-1", "card": "{CARD}"}}',
                },
            ),
            await browser.post(
                "/api/key",
                json={"task_name": charge.task_name, "kwargs": {"order": "A-1", "card": CARD}},
            ),
        ]
    assert [page.status_code for page in pages] == [200] * len(pages)
    for page in pages:
        assert CARD not in page.text
    assert lock.key in pages[-2].text  # the key page answered with the key
    assert pages[-1].json()["lock"]["holder_task_id"] == sent.task_id


async def test_the_filter_narrows_by_name_and_by_task(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker, record_task_name=True)

    @broker.task(deduplication_key="report-daily")
    async def daily() -> None: ...

    @broker.task(deduplication_key="report-weekly")
    async def weekly() -> None: ...

    @broker.task(deduplication_key="export-all")
    async def export() -> None: ...

    for task in (daily, weekly, export):
        await task.kiq()
    async with client(locks_app(dedup_middleware(broker))) as browser:

        async def names(**query: str) -> set[str]:
            answer = await browser.get("/api/locks", params=query)
            return {lock["name"] for lock in answer.json()["locks"]}

        assert await names() == {"report-daily", "report-weekly", "export-all"}
        assert await names(match="report-*") == {"report-daily", "report-weekly"}
        assert await names(task=weekly.task_name) == {"report-weekly"}
        assert await names(task="*:export") == {"export-all"}
        page = await browser.get("/", params={"match": "report-*", "task": daily.task_name})
    assert "report-daily" in page.text
    assert "report-weekly" not in page.text
    assert "export-all" not in page.text


async def test_a_task_filter_over_locks_without_task_names_says_why_nothing_matches(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(broker_class=HoldingBroker, record_task_name=False)

    @broker.task
    async def job() -> None: ...

    await job.kiq()
    async with client(locks_app(dedup_middleware(broker))) as browser:
        page = await browser.get("/", params={"task": job.task_name})
    assert "No lock on this page matches." in page.text
    assert "record_task_name=True" in page.text


@all_topologies()
async def test_pages_cross_a_large_keyspace_with_scan(
    broker: HoldingBroker, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    @broker.task
    async def job(n: int) -> None: ...

    await asyncio.gather(*(job.kiq(n) for n in range(230)))
    seen: list[str] = []
    pages = 0
    async with client(locks_app(dedup_middleware(broker), page_size=50)) as browser:
        cursor: str | None = ""
        while cursor is not None:
            answer = (await browser.get("/api/locks", params={"cursor": cursor})).json()
            seen += [lock["key"] for lock in answer["locks"]]
            cursor, pages = answer["cursor"], pages + 1
        first = await browser.get("/")
        [next_link] = re.findall(r'<a class="next" href="([^"]+)"', first.text)
        second = await browser.get(html.unescape(next_link))
    assert set(seen) == set(await lock_keys(redis_client, prefix))
    assert len(set(seen)) == 230
    assert pages >= 3  # paged, not read whole
    assert second.status_code == 200
    assert second.text.count('href="/lock?key=') >= 1


async def test_the_list_sorts_by_age_or_by_time_left(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)
    order = []
    for ttl in (120, 30, 300):

        @broker.task(task_name=f"job-{ttl}", deduplication_ttl=ttl)
        async def job() -> None: ...

        order.append((await job.kiq()).task_id)
        await asyncio.sleep(0.01)  # an age apart
    async with client(locks_app(dedup_middleware(broker))) as browser:

        async def holders(sort: str) -> list[str]:
            answer = await browser.get("/api/locks", params={"sort": sort})
            return [lock["holder_task_id"] for lock in answer.json()["locks"]]

        assert await holders("age") == order  # the oldest first
        assert await holders("ttl") == [order[1], order[0], order[2]]  # 30 s, 120 s, 300 s
        refused = await browser.get("/", params={"sort": "size"})
    assert refused.status_code == 400
    assert "sort=&#x27;size&#x27;: one of age, ttl, key" in refused.text


async def test_a_release_asks_first_then_removes_the_lock(
    charged: Charged, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    charge, key = charged.charge, charged.key
    async with client(
        locks_app(charged.middleware, allow_release=True, authorize=allow_anyone)
    ) as browser:
        listing = await browser.get("/")
        [link] = re.findall(r'<a class="release" href="([^"]+)"', listing.text)
        asked = await browser.get(html.unescape(link))
        assert "Release 1 lock?" in asked.text
        assert await lock_keys(redis_client, prefix) == [key]  # asking released nothing
        done = await browser.post(
            "/release", data={"csrf": await token(browser), "lock": confirmed_locks(asked.text)}
        )
    assert done.status_code == 200
    assert f"<code>{html.escape(key)}</code>: released" in done.text
    assert await lock_keys(redis_client, prefix) == []
    await charge.kiq(order="A-1", card=CARD)  # the call can be sent again


async def test_a_release_leaves_a_lock_that_another_send_took_since_it_was_asked(
    charged: Charged,
) -> None:
    charge, key, first, middleware = charged.charge, charged.key, charged.sent, charged.middleware
    async with client(locks_app(middleware, allow_release=True, authorize=allow_anyone)) as browser:
        asked = await browser.get("/release", params={"key": key})
        assert await middleware.locks.release(key)  # released elsewhere meanwhile...
        second = await charge.kiq(order="A-1", card=CARD)  # ...and taken by a new send
        done = await browser.post(
            "/release", data={"csrf": await token(browser), "lock": confirmed_locks(asked.text)}
        )
    assert "not released: another send holds it now" in done.text
    lock = await middleware.locks.get(key)
    assert lock is not None
    assert lock.holder_task_id == second.task_id != first.task_id


async def test_a_read_only_app_offers_no_release_and_refuses_one(
    charged: Charged, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    key, middleware = charged.key, charged.middleware
    lock = await middleware.locks.get(key)
    assert lock is not None
    async with client(locks_app(middleware)) as browser:
        pages = [await browser.get("/"), await browser.get("/lock", params={"key": key})]
        asked = await browser.get("/release", params={"key": key})
        posted = await browser.post(
            "/release", data={"csrf": await token(browser), "lock": f"{lock.owner} {key}"}
        )
    for page in pages:
        assert page.status_code == 200
        assert "Release" not in page.text
        assert 'type="checkbox"' not in page.text
    assert (asked.status_code, posted.status_code) == (403, 403)
    assert "read-only" in posted.text
    assert await lock_keys(redis_client, prefix) == [key]


@pytest.mark.parametrize(
    ("headers", "form_token", "status"),
    [
        pytest.param({"sec-fetch-site": "cross-site"}, True, 403, id="another site's page"),
        pytest.param({"sec-fetch-site": "same-site"}, True, 403, id="a sibling subdomain"),
        pytest.param({"origin": "http://evil.example"}, True, 403, id="another origin"),
        pytest.param({"origin": "null"}, True, 403, id="an opaque origin"),
        pytest.param({}, False, 403, id="no form token"),
        pytest.param({"content-type": "application/json"}, True, 415, id="not a form"),
        pytest.param({"sec-fetch-site": "same-origin", "origin": HOST}, True, 200, id="its own"),
    ],
)
async def test_a_post_from_anywhere_but_the_apps_own_page_is_refused(
    charged: Charged,
    redis_client: redis.asyncio.Redis,
    prefix: str,
    headers: dict[str, str],
    form_token: bool,
    status: int,
) -> None:
    key = charged.key
    lock = await charged.middleware.locks.get(key)
    assert lock is not None
    async with client(
        locks_app(charged.middleware, allow_release=True, authorize=allow_anyone)
    ) as browser:
        real = await token(browser)
        body = f"csrf={real if form_token else 'guessed'}&lock={lock.owner}+{key}"
        answer = await browser.post(
            "/release",
            content=body,
            headers={"content-type": "application/x-www-form-urlencoded", **headers},
        )
    assert answer.status_code == status
    assert (await lock_keys(redis_client, prefix) == []) is (status == 200)


async def test_the_authorize_hook_decides_what_each_request_may_do(
    charged: Charged, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    key = charged.key
    asked: list[tuple[str, Action]] = []

    async def viewers_only(request: Request, action: Action) -> bool:
        asked.append((request.url.path, action))
        if "user" not in request.headers:
            raise HTTPException(401, headers={"WWW-Authenticate": 'Basic realm="locks"'})
        return action == "view"

    app = locks_app(charged.middleware, allow_release=True, authorize=viewers_only)
    async with client(app) as browser:
        anonymous = await browser.get("/api/locks")
        browser.headers["user"] = "ops"
        viewed = await browser.get("/")
        confirmed = await browser.get("/release", params={"key": key})
        posted = await browser.post("/release", data={"csrf": await token(browser), "lock": "x y"})
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"] == 'Basic realm="locks"'
    assert (viewed.status_code, confirmed.status_code, posted.status_code) == (200, 403, 403)
    assert ("/release", "release") in asked
    assert await lock_keys(redis_client, prefix) == [key]


async def test_releases_need_a_word_on_who_may_make_them(
    charged: Charged, redis_url: str, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    middleware = charged.middleware
    for source in (middleware, middleware.locks, redis_url):
        with pytest.raises(InvalidSettingError) as refused:
            locks_app(source, allow_release=True)
        assert isinstance(refused.value, ValueError)
        assert "allow_release=True without authorize would let whoever reaches the page" in str(
            refused.value
        )
        assert "authorize=allow_anyone" in str(refused.value)  # how to say so, if that is meant
    async with client(locks_app(middleware)) as browser:  # read-only needs no word
        assert (await browser.get("/")).status_code == 200
    app = locks_app(middleware, allow_release=True, authorize=allow_anyone)
    async with client(app) as browser:
        asked = await browser.get("/release", params={"key": charged.key})
        done = await browser.post(
            "/release", data={"csrf": await token(browser), "lock": confirmed_locks(asked.text)}
        )
    assert f"<code>{html.escape(charged.key)}</code>: released" in done.text
    assert await lock_keys(redis_client, prefix) == []


async def test_a_key_that_holds_markup_is_shown_as_text(make_broker: BrokerFactory) -> None:
    broker = await make_broker(broker_class=HoldingBroker)

    @broker.task(deduplication_key='<script>alert("x")</script>')
    async def job() -> None: ...

    await job.kiq()
    async with client(
        locks_app(dedup_middleware(broker), allow_release=True, authorize=allow_anyone)
    ) as browser:
        listing = await browser.get("/")
        [lock] = (await browser.get("/api/locks")).json()["locks"]
        shown = await browser.get("/lock", params={"key": lock["key"]})
    for page in (listing, shown):
        assert "<script>alert" not in page.text
        assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page.text
    assert "default-src 'none'; script-src 'self'" in listing.headers["content-security-policy"]


async def test_the_key_page_computes_the_key_kiq_takes(
    held: tuple[HoldingBroker, Any], redis_url: str
) -> None:
    broker, charge = held
    middleware = dedup_middleware(broker)
    expected = middleware.locks.key_for(charge, order="A-1", card="x")
    async with client(locks_app(middleware)) as browser:
        form = await browser.get("/key")
        csrf = await token(browser)
        free = await browser.post(
            "/key", data={"csrf": csrf, "task": charge.task_name, "kwargs": '{"order": "A-1"}'}
        )
        sent = await charge.kiq(order="A-1", card="y")
        taken = await browser.post(
            "/key", data={"csrf": csrf, "task": charge.task_name, "kwargs": '{"order": "A-1"}'}
        )
        bad = await browser.post("/key", data={"csrf": csrf, "task": charge.task_name, "args": "{"})
        unknown = await browser.post("/key", data={"csrf": csrf, "task": "nope"})
        by_script = await browser.post(
            "/api/key", json={"task_name": charge.task_name, "kwargs": {"order": "A-1"}}
        )
        as_form = await browser.post("/api/key", data={"task_name": charge.task_name})
    assert f'<option value="{charge.task_name}"' in form.text
    assert expected is not None
    assert f"<code>{expected}</code>. Nobody holds it" in free.text
    assert f"Held by task <code>{sent.task_id}</code>" in taken.text
    assert (bad.status_code, unknown.status_code) == (400, 404)
    assert "args: not JSON" in bad.text
    assert by_script.json()["key"] == expected
    assert by_script.json()["lock"]["holder_task_id"] == sent.task_id
    assert as_form.status_code == 415
    async with client(locks_app(redis_url, prefix=middleware.key_prefix)) as browser:
        from_url = await browser.get("/key")
    assert "cannot compute a call's key" in from_url.text


async def test_the_key_page_finds_a_task_by_its_functions_name(
    held: tuple[HoldingBroker, Any],
) -> None:
    broker, charge = held
    middleware = dedup_middleware(broker)
    expected = middleware.locks.key_for(charge, order="A-1", card="x")
    async with client(locks_app(middleware)) as browser:
        by_function = await browser.post(
            "/api/key", json={"task_name": "charge", "kwargs": {"order": "A-1"}}
        )

        @broker.task(task_name="billing.charge")
        async def charge_again(order: str) -> None: ...

        shared = await browser.post("/api/key", json={"task_name": "charge"})
        form = await browser.post("/key", data={"csrf": await token(browser), "task": "charge"})
    assert charge.task_name.endswith(":charge")  # taskiq's module:function
    assert by_function.json() == {"task_name": charge.task_name, "key": expected, "lock": None}
    message = f"'charge' names 2 tasks: billing.charge, {charge.task_name}; give the full name"
    assert (shared.status_code, shared.json()) == (400, {"error": message})
    assert form.status_code == 400
    assert html.escape(message) in form.text


async def test_mounted_in_fastapi_its_links_and_cookie_stay_under_the_mount(
    charged: Charged,
) -> None:
    checked: list[str] = []

    def admin(request: Request, action: Action) -> bool:
        checked.append(action)
        return request.headers.get("x-role") == "admin"

    app = FastAPI()

    @app.get("/health")
    async def health(role: Annotated[str, Depends(lambda: "ok")]) -> dict[str, str]:
        return {"status": role}

    app.mount("/admin/locks", locks_app(charged.middleware, allow_release=True, authorize=admin))
    async with client(app) as browser:
        refused = await browser.get("/admin/locks/")
        browser.headers["x-role"] = "admin"
        listing = await browser.get("/admin/locks/")
        style = await browser.get("/admin/locks/assets/locks.css")
        script = await browser.get("/admin/locks/assets/locks.js")
        links = re.findall(r'(?:href|src)="([^"]+)"', listing.text)
        followed = [await browser.get(html.unescape(link)) for link in links]
        actions = re.findall(r'action="([^"]+)"', listing.text)
        healthy = await browser.get("/health")
    assert refused.status_code == 403
    assert listing.status_code == 200
    assert links
    assert all(link.startswith("/admin/locks/") for link in links + actions)
    assert [page.status_code for page in followed] == [200] * len(followed)
    assert (style.status_code, script.status_code, healthy.json()) == (200, 200, {"status": "ok"})
    assert "Path=/admin/locks;" in refused.headers["set-cookie"]
    assert set(checked) == {"view", "release"}  # the row's release link: its confirmation


async def test_a_page_from_a_url_never_reads_or_releases_a_key_of_another_app(
    redis_url: str, redis_client: redis.asyncio.Redis
) -> None:
    other = f"session:{uuid.uuid4().hex}"  # another app's key, with a ':' as a full key has
    await redis_client.set(other, '{"user": 7, "token": "abc"}', ex=60)
    try:
        async with client(
            locks_app(redis_url, allow_release=True, authorize=allow_anyone)
        ) as browser:
            read = await browser.get("/api/lock", params={"key": other})
            shown = await browser.get("/lock", params={"key": other})
            asked = await browser.get("/release", params={"key": other})
            posted = await browser.post(
                "/release", data={"csrf": await token(browser), "lock": f'{{"user": {other}'}
            )
        assert (read.status_code, shown.status_code) == (404, 404)
        assert "Nothing to release." in asked.text
        assert "not released" in posted.text
        assert await redis_client.get(other) is not None
    finally:
        await redis_client.delete(other)


async def test_a_key_that_is_not_utf8_under_the_prefix_is_shown_and_can_be_released(
    held: tuple[HoldingBroker, Any], redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    broker, charge = held
    await charge.kiq(order="A-1", card=CARD)
    # Written by another program: the library refuses such a key itself.
    odd = prefix.encode() + b":caf\xe9-\xff"
    await redis_client.set(odd, f"tok{'x' * 8} {'0' * 32}", ex=60)
    async with client(
        locks_app(dedup_middleware(broker), allow_release=True, authorize=allow_anyone)
    ) as browser:
        listing = await browser.get("/")
        data = await browser.get("/api/locks")
        links = [
            html.unescape(link) for link in re.findall(r'href="(/lock\?key=[^"]+)"', listing.text)
        ]
        pages = [await browser.get(link) for link in links]
        asked = await browser.get(
            "/release",
            params=[
                ("key", value) for value in re.findall(r'name="key" value="([^"]+)"', listing.text)
            ],
        )
        done = await browser.post(
            "/release", data={"csrf": await token(browser), "lock": confirmed_locks(asked.text)}
        )
    assert listing.status_code == data.status_code == 200
    assert f"{prefix}:caf\\xe9-\\xff" in listing.text  # its bytes, as escapes
    assert len(data.json()["locks"]) == 2
    assert [page.status_code for page in pages] == [200, 200]
    assert done.text.count(": released") == 2
    assert await lock_keys(redis_client, prefix) == []


async def test_redis_down_is_said_on_the_page_and_in_json() -> None:
    app = locks_app("redis://127.0.0.1:1/0?socket_connect_timeout=0.5")
    async with client(app) as browser:
        page = await browser.get("/")
        data = await browser.get("/api/locks")
    assert (page.status_code, data.status_code) == (503, 503)
    assert "Redis failed: ConnectionError" in page.text
    assert data.json()["error"].startswith("Redis failed: ConnectionError")


async def test_bad_input_is_named(held: tuple[HoldingBroker, Any]) -> None:
    broker, _ = held
    middleware = dedup_middleware(broker)
    with pytest.raises(InvalidArgumentError, match="page_size=0"):
        locks_app(middleware, page_size=0)
    with pytest.raises(InvalidArgumentError, match="prefix: only with a URL"):
        locks_app(middleware, prefix="other")
    async with client(locks_app(middleware)) as browser:
        answers = {
            "cursor": await browser.get("/api/locks", params={"cursor": "x.7"}),
            "limit": await browser.get("/api/locks", params={"limit": "-3"}),
            "huge": await browser.get("/api/locks", params={"limit": "1001"}),
            "long": await browser.get("/api/locks", params={"limit": "9" * 5000}),
            "deep": await browser.post(
                "/api/key",
                content="[" * 100_000,
                headers={"content-type": "application/json"},
            ),
            "key": await browser.get("/lock"),
            "missing": await browser.get("/api/lock", params={"key": "no-such-lock"}),
        }
    assert {name: answer.status_code for name, answer in answers.items()} == {
        "cursor": 400,
        "limit": 400,
        "huge": 400,
        "long": 400,
        "deep": 400,
        "key": 400,
        "missing": 404,
    }
    assert "not one that a page of locks returned" in answers["cursor"].json()["error"]


WITHOUT_THE_EXTRA = """
import sys
from importlib.abc import MetaPathFinder

class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"starlette", "uvicorn", "fastapi"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
import taskiq_deduplication as t
from taskiq_deduplication.cli import main
t.RedisDeduplicationMiddleware(redis_url="redis://localhost"), t.Locks
try:
    import taskiq_deduplication.web
except ImportError as exc:
    print(exc)
sys.exit(main(["web", "--url", "redis://localhost"]))
"""


def test_without_the_web_extra_the_library_works_and_the_page_says_what_to_install() -> None:
    shown = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_EXTRA],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shown.stdout.strip() == (
        "taskiq_deduplication.web needs Starlette: pip install 'taskiq-dedup[web]'"
    )
    assert shown.returncode == 2
    assert "install taskiq-dedup[web]" in shown.stderr


def _free_port() -> int:
    """A port no one listens on, free for the command to take."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        port: int = listening.getsockname()[1]
    return port


async def _answering(browser: httpx.AsyncClient, served: asyncio.subprocess.Process) -> None:
    """Wait until ``taskiq dedup web`` answers, failing at once if it exits instead."""
    for _ in range(300):
        if served.returncode is not None:
            pytest.fail(f"taskiq dedup web exited with {served.returncode}")
        with contextlib.suppress(httpx.TransportError):
            await browser.get("/api/locks")
            return
        await asyncio.sleep(0.05)
    pytest.fail("taskiq dedup web did not answer within 15 s")


@pytest.mark.parametrize("source", ["url", "app"])
async def test_taskiq_dedup_web_serves_the_page_until_stopped(
    charged: Charged, redis_url: str, prefix: str, source: str
) -> None:
    port = _free_port()
    where = ["--prefix", prefix] if source == "url" else ["--app", "tests.cli_app:broker"]
    # The app reads its Redis and prefix from these, as an app reads its settings.
    env = {"REDIS_URL": redis_url, "DEDUP_CLI_REDIS_URL": redis_url, "DEDUP_CLI_PREFIX": prefix}
    served = await start_dedup("web", *where, "--port", str(port), "--root-path", "/ops", **env)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as browser:
            await _answering(browser, served)
            answer = await browser.get("/api/locks")
            listing = await browser.get("/")
            refused = await browser.get("/release", params={"key": f"{prefix}:x"})
            keyed = await browser.post("/api/key", json={"task_name": "nightly"})
    finally:
        if served.returncode is None:
            served.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(served.communicate(), 15)
    assert [lock["holder_task_id"] for lock in answer.json()["locks"]] == [charged.sent.task_id]
    assert listing.status_code == 200
    assert 'href="/ops/lock?key=' in listing.text  # under the proxy's path
    assert refused.status_code == 403  # read-only without --allow-release
    if source == "app":  # the app's middleware computes keys
        assert (keyed.status_code, keyed.json()["key"]) == (200, f"{prefix}:nightly-run")
    else:
        assert keyed.status_code == 404
    assert f"serving the locks under {prefix} at http://127.0.0.1:{port}/" in err.decode()
    assert served.returncode == ExitCode.INTERRUPTED  # Ctrl-C, after a graceful shutdown


async def test_served_from_an_apps_middleware_it_closes_that_redis_client_at_shutdown(
    redis_url: str, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    import uvicorn  # noqa: PLC0415 (only this test serves in process)

    name = f"locks-page-{uuid.uuid4().hex[:12]}"
    joined = "&" if "?" in redis_url else "?"
    middleware = RedisDeduplicationMiddleware(
        redis_url=f"{redis_url}{joined}client_name={name}", key_prefix=prefix
    )
    InMemoryBroker().with_middlewares(middleware)  # the app's, never started here

    async def connections() -> int:
        return sum(1 for client in await redis_client.client_list() if client["name"] == name)

    # Served as `taskiq dedup web --app` serves it: uvicorn, in this event loop.
    config = uvicorn.Config(locks_app(middleware), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(300):
            if server.started:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the server did not start within 15 s")
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as browser:
            answer = await browser.get("/api/locks")
        while_serving = await connections()
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 15)
    assert answer.status_code == 200
    assert while_serving >= 1
    assert await connections() == 0  # closed by the app's shutdown, the loop still running


async def test_taskiq_dedup_web_offers_releases_only_when_told_anyone_may(
    charged: Charged, redis_url: str, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    # Refused before anything else, Redis (unreachable here) too.
    unreachable = "redis://127.0.0.1:1/0?socket_connect_timeout=0.5"
    alone = await dedup("web", "--url", unreachable, "--allow-release")
    assert alone.status == ExitCode.USAGE
    assert one_line_error(alone) == (
        "taskiq dedup: error: --allow-release: served alone the page has no login, so whoever "
        "reaches it could release locks; put it behind a proxy that asks for one and pass "
        "--allow-release-without-auth, or mount locks_app(..., authorize=...) in your app"
    )
    port = _free_port()
    served = await start_dedup(
        "web", "--prefix", prefix, "--port", str(port), "--allow-release-without-auth",
        REDIS_URL=redis_url,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as browser:
            await _answering(browser, served)
            asked = await browser.get("/release", params={"key": charged.key})
            done = await browser.post(
                "/release", data={"csrf": await token(browser), "lock": confirmed_locks(asked.text)}
            )
    finally:
        if served.returncode is None:
            served.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(served.communicate(), 15)
    assert f"<code>{html.escape(charged.key)}</code>: released" in done.text
    assert await lock_keys(redis_client, prefix) == []
    assert (
        f"taskiq dedup: warning: whoever reaches http://127.0.0.1:{port}/ may release locks: "
        "the page has no login of its own (--allow-release-without-auth)"
    ) in err.decode().splitlines()


async def test_taskiq_dedup_web_says_what_it_lacks_before_serving() -> None:
    no_url = await dedup("web")
    bad_url = await dedup("web", "--url", "redis://127.0.0.1:1/0?socket_connect_timeout=0.5")
    both = await dedup("web", "--app", "tests.cli_app:broker", "--url", "redis://x")
    assert (no_url.status, one_line_error(no_url)) == (
        2,
        "taskiq dedup: error: no Redis URL: pass --url or --app, or set REDIS_URL",
    )
    assert bad_url.status == 3
    assert "Redis: ConnectionError" in bad_url.stderr
    assert both.status == 2
    assert one_line_error(both).endswith("--url: not with --app, whose middleware the page uses")
