"""The locks page, mounted in a FastAPI app behind the app's own login.

Serve it with ``uvicorn locks_page:app`` and open http://127.0.0.1:8000/ops/locks/;
run as a script, it asks the page as a browser would and prints the answers.
"""

import asyncio
import base64
import contextlib
import hmac
import os
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from taskiq import InMemoryBroker

from taskiq_deduplication import InvalidSettingError, RedisDeduplicationMiddleware
from taskiq_deduplication.web import Action, allow_anyone, locks_app

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
PREFIX = f"shop-{uuid.uuid4().hex[:8]}"
middleware = RedisDeduplicationMiddleware(REDIS_URL, key_prefix=PREFIX, record_task_name=True)
broker = InMemoryBroker().with_middlewares(middleware)


@broker.task(deduplication_key="nightly-export", deduplication_until="expired")
async def nightly_export() -> None: ...


# --8<-- [start:mount]
OPERATORS = {"ops": "change me"}  # your users and their rights: yours to look up
RELEASERS = {"ops"}


def operators_only(request: Request, action: Action) -> bool:
    """Let operators see the locks, and those who may release them release them."""
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    try:
        user, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except ValueError:  # not base64, or not UTF-8
        user = password = ""
    known = OPERATORS.get(user)
    if scheme.lower() != "basic" or known is None or not hmac.compare_digest(known, password):
        raise HTTPException(401, headers={"WWW-Authenticate": 'Basic realm="locks"'})
    return action == "view" or user in RELEASERS


@contextlib.asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    await broker.startup()
    yield
    await broker.shutdown()


app = FastAPI(lifespan=lifespan)
app.mount(
    "/ops/locks",
    locks_app(middleware, allow_release=True, authorize=operators_only),
)
# --8<-- [end:mount]

# --8<-- [start:read-only]
# An app on an internal network: the page read-only, no login of its own.
internal = FastAPI(lifespan=lifespan)
internal.mount("/ops/locks", locks_app(middleware))
# --8<-- [end:read-only]

# --8<-- [start:anyone]
# Behind a proxy that asks for a login: whoever it lets through may release.
proxied = FastAPI(lifespan=lifespan)
proxied.mount("/ops/locks", locks_app(middleware, allow_release=True, authorize=allow_anyone))
# --8<-- [end:anyone]


async def main() -> None:
    try:
        locks_app(middleware, allow_release=True)  # releases, and no word on who may
    except InvalidSettingError as exc:
        print(f"allow_release without authorize: {type(exc).__name__}")
    async with lifespan(app):
        await nightly_export.kiq()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as browser:
            anonymous = await browser.get("/ops/locks/")
            print(f"without a login: {anonymous.status_code}")
            browser.auth = ("ops", "change me")
            page = await browser.get("/ops/locks/")
            print(
                f"as ops: {page.status_code}, nightly-export shown: {'nightly-export' in page.text}"
            )
            held = (await browser.get("/ops/locks/api/locks")).json()["locks"]
            print(f"as JSON: {[(lock['name'], lock['policy']) for lock in held]}")
        await middleware.locks.release(f"{PREFIX}:nightly-export")


if __name__ == "__main__":
    asyncio.run(main())
