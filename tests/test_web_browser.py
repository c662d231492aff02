"""The locks page in a real headless Chromium: what an operator sees and clicks.

Debian's ``chromium`` and ``chromium-driver``, driven by Selenium; the app is
served by uvicorn on a port of the test's own. Without them the tests skip, or
fail where ``DEDUP_REQUIRE_SERVICES=1`` (CI) says they must run. Set
``DEDUP_SCREENSHOT=path.png`` to keep the screenshot of the list (the one in
``docs/operations.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import struct
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import uvicorn
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.responses import HTMLResponse, RedirectResponse
from starlette.routing import Route

from taskiq_deduplication import Locks
from taskiq_deduplication.web import Action, allow_anyone, locks_app
from tests._brokers import HoldingBroker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator

    from starlette.requests import Request
    from starlette.types import ASGIApp

    from taskiq_deduplication.testing import Deduplication

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import (  # noqa: E402 (after the skip)
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.xdist_group("browser")  # one worker, one browser for them all

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# What keeps Chromium from reaching for the network this machine does not have.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,720",
)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A headless Chromium, for every test of the module."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        reason = f"{', '.join(missing)} not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("DEDUP_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{reason}; DEDUP_REQUIRE_SERVICES=1 requires it")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    try:
        driver = webdriver.Chrome(options=options, service=service)
    except WebDriverException as exc:
        pytest.fail(f"Chromium did not start: {exc.msg}")
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


@contextlib.contextmanager
def served(app: ASGIApp, host: str = "localhost") -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread of its own; yield its root URL."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive(), "uvicorn stopped before it started"
        assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listening.close()


def kiq_held(dedup: Deduplication, *keys: str) -> list[str]:
    """Send one task per key, as an app would, to a queue that keeps them: their locks stay.

    Returns the task ids.
    """

    async def send() -> list[str]:
        broker = HoldingBroker().with_middlewares(dedup.middleware(record_task_name=True))
        await broker.startup()
        sent = []
        for key in keys:
            task = broker.register_task(_noop, task_name=f"reports:{key}", deduplication_key=key)
            sent.append((await task.kiq()).task_id)
        await broker.shutdown()
        return sent

    return asyncio.run(send())


async def _noop() -> None: ...


def held_keys(dedup: Deduplication) -> set[str]:
    async def read() -> set[str]:
        async with Locks.from_url(dedup.redis_url, prefix=dedup.key_prefix) as locks:
            return {lock.name or "" async for lock in locks.scan()}

    return asyncio.run(read())


def rows(browser: Any) -> list[str]:
    """The keys of the list's rows, as shown."""
    return [
        cell.text
        for cell in browser.find_elements(By.CSS_SELECTOR, "table.locks td a[href*='/lock?key=']")
    ]


def until(browser: Any, condition: Callable[[Any], object], timeout: float = 10) -> Any:
    """Wait for ``condition``, reading again where a form's reply replaced the page mid-read."""
    return WebDriverWait(
        browser, timeout, ignored_exceptions=(StaleElementReferenceException,)
    ).until(condition)


def test_the_list_shows_the_locks_kiq_took_and_counts_their_time_down(
    browser: Any, dedup: Deduplication, tmp_path: Path
) -> None:
    kiq_held(dedup, "report-daily", "report-weekly", "export-all")
    app = locks_app(
        dedup.redis_url, prefix=dedup.key_prefix, allow_release=True, authorize=allow_anyone
    )
    with served(app) as root:
        browser.get(f"{root}/")
        assert sorted(rows(browser)) == [
            f"{dedup.key_prefix}:{key}" for key in ("export-all", "report-daily", "report-weekly")
        ]
        assert "reports:report-daily" in browser.page_source  # the task, as recorded
        countdown = browser.find_element(By.CSS_SELECTOR, ".countdown")
        first = countdown.text
        until(browser, lambda _: countdown.text != first)  # the page's script counts
        screenshot = Path(os.environ.get("DEDUP_SCREENSHOT") or tmp_path / "locks.png")
        browser.save_screenshot(str(screenshot))
    signature, width, height = struct.unpack(">8s8xII", screenshot.read_bytes()[:24])
    assert signature == b"\x89PNG\r\n\x1a\n"
    assert [width, height] == browser.execute_script(
        "return [window.innerWidth * devicePixelRatio, window.innerHeight * devicePixelRatio]"
    )


def test_the_filter_narrows_the_list(browser: Any, dedup: Deduplication) -> None:
    kiq_held(dedup, "report-daily", "report-weekly", "export-all")
    app = locks_app(dedup.redis_url, prefix=dedup.key_prefix)
    with served(app) as root:
        browser.get(f"{root}/")
        assert len(rows(browser)) == 3
        name = browser.find_element(By.NAME, "match")
        name.clear()
        name.send_keys("report-*")
        browser.find_element(By.CSS_SELECTOR, "form.filter button").click()
        until(browser, lambda b: len(rows(b)) == 2)
        task = browser.find_element(By.NAME, "task")
        task.send_keys("reports:report-weekly")
        browser.find_element(By.CSS_SELECTOR, "form.filter button").click()
        until(browser, lambda b: rows(b) == [f"{dedup.key_prefix}:report-weekly"])
        assert browser.find_element(By.NAME, "match").get_attribute("value") == "report-*"


def test_a_release_asks_then_removes_the_lock(browser: Any, dedup: Deduplication) -> None:
    [holder] = kiq_held(dedup, "export-all")
    app = locks_app(
        dedup.redis_url, prefix=dedup.key_prefix, allow_release=True, authorize=allow_anyone
    )
    with served(app) as root:
        browser.get(f"{root}/")
        browser.find_element(By.CSS_SELECTOR, "a.release").click()
        until(browser, lambda b: "Release 1 lock?" in b.page_source)
        assert holder in browser.page_source
        assert held_keys(dedup) == {"export-all"}  # asked, not yet released
        browser.find_element(By.CSS_SELECTOR, "form button.danger").click()
        until(browser, lambda b: "released" in b.find_element(By.CSS_SELECTOR, "ul.released").text)
    assert held_keys(dedup) == set()


def test_a_lock_is_released_from_its_own_page(browser: Any, dedup: Deduplication) -> None:
    kiq_held(dedup, "export-all")
    app = locks_app(
        dedup.redis_url, prefix=dedup.key_prefix, allow_release=True, authorize=allow_anyone
    )
    with served(app) as root:
        browser.get(f"{root}/")
        browser.find_element(By.CSS_SELECTOR, "td a[href*='/lock?key=']").click()
        until(browser, lambda b: "Owner token" in b.page_source)
        button = browser.find_element(By.LINK_TEXT, "Release this lock")
        # Its words stand out from its colour (a rule for every release link once hid them).
        assert button.value_of_css_property("color") != button.value_of_css_property(
            "background-color"
        )
        button.click()
        until(browser, lambda b: "Release 1 lock?" in b.page_source)
        browser.find_element(By.CSS_SELECTOR, "form button.danger").click()
        until(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "ul.released li.done"))
    assert held_keys(dedup) == set()


def test_selected_locks_are_released_together(browser: Any, dedup: Deduplication) -> None:
    kiq_held(dedup, "report-daily", "report-weekly", "export-all")
    app = locks_app(
        dedup.redis_url, prefix=dedup.key_prefix, allow_release=True, authorize=allow_anyone
    )
    with served(app) as root:
        browser.get(f"{root}/?match=report-*")
        for box in browser.find_elements(By.CSS_SELECTOR, "input[type=checkbox]"):
            box.click()
        browser.find_element(By.CSS_SELECTOR, "button.danger").click()
        until(browser, lambda b: "Release 2 locks?" in b.page_source)
        browser.find_element(By.CSS_SELECTOR, "form button.danger").click()
        until(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "ul.released li.done"))
    assert held_keys(dedup) == {"export-all"}


def test_a_read_only_page_offers_no_release(browser: Any, dedup: Deduplication) -> None:
    kiq_held(dedup, "export-all")
    app = locks_app(dedup.redis_url, prefix=dedup.key_prefix)
    with served(app) as root:
        browser.get(f"{root}/")
        assert len(rows(browser)) == 1
        assert browser.find_elements(By.CSS_SELECTOR, "a.release, input[type=checkbox]") == []
        # Nor does the lock's own page.
        browser.find_element(By.CSS_SELECTOR, "td a").click()
        until(browser, lambda b: "Owner token" in b.page_source)
        assert "Release" not in browser.page_source
        browser.get(f"{root}/release?key={dedup.key_prefix}:export-all")
        assert "read-only" in browser.page_source
    assert held_keys(dedup) == {"export-all"}


def test_a_form_on_another_site_cannot_release(browser: Any, dedup: Deduplication) -> None:
    kiq_held(dedup, "export-all")
    app = locks_app(
        dedup.redis_url, prefix=dedup.key_prefix, allow_release=True, authorize=allow_anyone
    )
    with served(app) as root:
        browser.get(f"{root}/")  # the operator has the page open: its cookie is set

        async def lock_value() -> str:
            async with Locks.from_url(dedup.redis_url, prefix=dedup.key_prefix) as locks:
                lock = await locks.get("export-all")
                assert lock is not None
                return f"{lock.owner} {lock.key}"

        value = asyncio.run(lock_value())  # all a forger could learn

        async def forged(_request: Request) -> HTMLResponse:
            return HTMLResponse(
                f'<form method="post" action="{root}/release">'
                f'<input type="hidden" name="csrf" value="guessed">'
                f'<input type="hidden" name="lock" value="{value}">'
                "<button>win a prize</button></form>"
            )

        # 127.0.0.1 is another site than localhost, where the page is.
        with served(Starlette(routes=[Route("/", forged)]), host="127.0.0.1") as elsewhere:
            browser.get(f"{elsewhere}/")
            browser.find_element(By.TAG_NAME, "button").click()
            until(browser, lambda b: b.current_url.startswith(root))
            assert "Refused" in browser.page_source
    assert held_keys(dedup) == {"export-all"}


def test_mounted_in_a_fastapi_app_behind_its_login(browser: Any, dedup: Deduplication) -> None:
    kiq_held(dedup, "export-all")
    locks = Locks.from_url(dedup.redis_url, prefix=dedup.key_prefix)

    def admins(request: Request, action: Action) -> bool:
        return request.cookies.get("role") == "admin"

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await locks.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/login")
    async def login() -> RedirectResponse:
        response = RedirectResponse("/ops/locks/")
        response.set_cookie("role", "admin", httponly=True, samesite="strict")
        return response

    app.mount("/ops/locks", locks_app(locks, allow_release=True, authorize=admins))
    with served(app) as root:
        browser.get(f"{root}/ops/locks/")
        assert "Not allowed." in browser.page_source
        browser.get(f"{root}/login")
        until(browser, lambda b: rows(b) == [f"{dedup.key_prefix}:export-all"])
        browser.find_element(By.CSS_SELECTOR, "a.release").click()
        until(browser, lambda b: b.current_url.startswith(f"{root}/ops/locks/release?"))
        browser.find_element(By.CSS_SELECTOR, "form button.danger").click()
        until(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "ul.released li.done"))
        browser.find_element(By.LINK_TEXT, "Back to the locks").click()
        until(browser, lambda b: "No lock on this page matches." in b.page_source)
    assert held_keys(dedup) == set()
