"""The locks in a browser: an ASGI app that lists, shows and releases them, and shows limits.

Mount it under any path of a FastAPI or Starlette app, or serve it alone with
``taskiq dedup web``::

    from taskiq_deduplication.web import locks_app

    app.mount("/admin/locks", locks_app(middleware, allow_release=True, authorize=is_admin))

It pages through the locks with ``SCAN`` (on a single server, Sentinel's
primary or every primary of a cluster), shows one lock, computes the key a call
would take, lists the limits of runs with their use, and releases locks
(owner-checked, after a confirmation) when it is built with
``allow_release=True``. ``/api/...`` answers the same in JSON. It
shows what a lock records, never a task's arguments; its assets ship in the
package. Needs the extra ``[web]`` (Starlette; uvicorn for ``taskiq dedup web``).

Releases need a word on who may make them: an ``authorize`` check of yours, or
``authorize=allow_anyone`` where a login in front of the page (a proxy's, an ASGI
middleware's) already decides who reaches it. ``allow_release=True`` alone is
refused when the app is built::

    locks_app(middleware, allow_release=True, authorize=allow_anyone)  # behind your proxy's login
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import inspect
import json
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import parse_qsl, urlsplit

try:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles
except ImportError as exc:  # pragma: no cover (the extra is installed wherever tests run)
    msg = "taskiq_deduplication.web needs Starlette: pip install 'taskiq-dedup[web]'"
    raise ImportError(msg) from exc

from redis.exceptions import RedisError

from taskiq_deduplication.exceptions import (
    DeduplicationError,
    InvalidArgumentError,
    InvalidSettingError,
)
from taskiq_deduplication.locks import DEFAULT_PREFIX, LockInfo, Locks
from taskiq_deduplication.middleware import RedisDeduplicationMiddleware, loop_states
from taskiq_deduplication.store.scan import find_task
from taskiq_deduplication.web import pages

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

__all__ = ["Action", "Authorize", "allow_anyone", "locks_app"]

#: What a request asks to do: read locks (every page, the JSON view) or release them.
Action = Literal["view", "release"]
#: The application's own check of a request: ``True`` lets it through, ``False``
#: answers 403; it may also raise Starlette's ``HTTPException`` (a 401 that asks
#: the browser to log in, say). A plain function or a coroutine function.
Authorize = Callable[[Request, Action], bool | Awaitable[bool]]

_ASSETS: Final = Path(__file__).parent / "static"
_CSRF_COOKIE: Final = "taskiq_dedup_csrf"
_MAX_FORM: Final = 1 << 20  # bytes of a form: far more than a page of checkboxes
_RELEASED_AT_ONCE: Final = 100
# The most locks a JSON page may ask for: each SCAN call asks for as many keys,
# and one that asks for millions holds the server up.
_MAX_LIMIT: Final = 1000
_SORTS: Final = ("age", "ttl", "key")
_HEADERS: Final = {
    # Nothing but the page's own files, no frame around it, and never cached:
    # a lock list is out of date at once.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def locks_app(
    source: RedisDeduplicationMiddleware | Locks | str,
    *,
    prefix: str | None = None,
    allow_release: bool = False,
    authorize: Authorize | None = None,
    page_size: int = 50,
) -> Starlette:
    """The locks page: an ASGI app to mount in yours, or to serve alone.

    Served alone, its shutdown closes the Redis client it made: a URL's, or the
    one a middleware made for its pages in the server's event loop (as
    ``taskiq dedup web --app`` serves it). Mounted in your app, your app's
    shutdown of its broker closes the middleware's.

    Args:
        source: A middleware (its Redis, its ``key_prefix``, and the key a call
            of its broker's tasks would take), a [Locks][taskiq_deduplication.Locks],
            or a Redis URL (as for ``Locks.from_url``).
        prefix: With a URL, the middleware's ``key_prefix``; by default the
            middleware's default.
        allow_release: Offer releases. Without it the app is read-only: it
            shows no release and refuses one. With it, ``authorize`` is needed.
        authorize: Called with each request and what it asks (``"view"`` or
            ``"release"``) before anything is read; ``False`` answers 403.
            Without it, whoever reaches a read-only app may read it: mount it
            behind your own authentication, or give this. To let whoever
            reaches the app release locks too (a login in front of it decides
            who that is), say so with ``authorize=allow_anyone``.
        page_size: The locks a page of the list shows (about: see ``Locks.page``),
            at most 1,000; ``/api/locks?limit=`` asks for another number.

    Raises:
        InvalidArgumentError: ``prefix`` with a middleware or ``Locks`` (they
            have their own), or ``page_size`` not from 1 to 1,000.
        InvalidSettingError: ``prefix`` cannot be a key prefix, or
            ``allow_release=True`` without ``authorize`` (a ``ValueError``).
    """
    if not 1 <= page_size <= _MAX_LIMIT:
        raise InvalidArgumentError(f"page_size={page_size!r}: must be from 1 to {_MAX_LIMIT}")
    if allow_release and authorize is None:
        msg = (
            "allow_release=True without authorize would let whoever reaches the page release "
            "locks: pass authorize=<your check of the request>, or authorize=allow_anyone "
            "(from taskiq_deduplication.web) if a login in front of the page decides who reaches it"
        )
        raise InvalidSettingError(msg)
    middleware = source if isinstance(source, RedisDeduplicationMiddleware) else None
    if isinstance(source, str):
        # With the prefix named, a key given to the page is read under it only:
        # the page never reads (or deletes) a key of another application.
        locks = Locks.from_url(source, prefix=prefix or DEFAULT_PREFIX)
    elif prefix is not None:
        msg = "prefix: only with a URL; a middleware or Locks has a key prefix of its own"
        raise InvalidArgumentError(msg)
    else:
        locks = source.locks if isinstance(source, RedisDeduplicationMiddleware) else source
    site = _Site(
        locks,
        middleware=middleware,
        allow_release=allow_release,
        authorize=authorize,
        page_size=page_size,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        # A middleware's client in this loop is made by the first page served
        # (``taskiq dedup web --app``), unless its app used it here before.
        states = None if middleware is None else loop_states(middleware)
        made_here = states is not None and states.get() is None
        yield
        if isinstance(source, str):
            await locks.aclose()  # the client made here; one given is its owner's
        elif middleware is not None and made_here:
            await middleware.shutdown()  # closes what the pages opened, in this loop only

    return Starlette(
        routes=[
            Route("/", site.list_page, name="list"),
            Route("/lock", site.lock_page, name="lock"),
            Route("/key", site.key_page, methods=["GET", "POST"], name="key"),
            Route("/release", site.release_page, methods=["GET", "POST"], name="release"),
            Route("/limits", site.limits_page, name="limits"),
            Route("/api/locks", site.api_locks),
            Route("/api/lock", site.api_lock),
            Route("/api/key", site.api_key, methods=["POST"]),
            Route("/api/limits", site.api_limits),
            Mount("/assets", StaticFiles(directory=_ASSETS), name="assets"),
        ],
        lifespan=lifespan,
    )


def allow_anyone(_request: Request, _action: Action) -> bool:
    """An ``authorize`` that lets every request through, releases too.

    Says where the app is built that whoever reaches the page may release
    locks, because something in front of it (a proxy's login, an ASGI
    middleware of yours, a network only operators reach) decides who that is:
    ``locks_app(middleware, allow_release=True, authorize=allow_anyone)``.
    ``allow_release=True`` without any ``authorize`` is refused.

    Returns:
        Always ``True``.
    """
    return True


class _RefusedError(Exception):
    """A request the app will not answer, with its status and what to say."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Site:
    """The app's pages, over one ``Locks``."""

    def __init__(
        self,
        locks: Locks,
        *,
        middleware: RedisDeduplicationMiddleware | None,
        allow_release: bool,
        authorize: Authorize | None,
        page_size: int,
    ) -> None:
        self._locks = locks
        self._middleware = middleware
        self._allow_release = allow_release
        self._authorize = authorize
        self._page_size = page_size

    # The pages

    async def list_page(self, request: Request) -> Response:
        async def page(view: pages.View) -> str:
            query = _list_query(request)
            found, after = await self._page(query, self._page_size)
            return pages.list_page(view, query, found, after)

        return await self._html(request, "view", page)

    async def lock_page(self, request: Request) -> Response:
        async def page(view: pages.View) -> str:
            key = pages.key_of_token(_one(request.query_params.getlist("key"), "key"))
            lock = await self._lock(key)
            if lock is None:
                raise _RefusedError(404, f"No lock at {key!r} (it may have ended or expired).")
            return pages.lock_page(view, lock)

        return await self._html(request, "view", page)

    async def key_page(self, request: Request) -> Response:
        async def page(view: pages.View) -> str:
            tasks = self._task_names()
            if request.method != "POST":
                return pages.key_page(view, tasks, None)
            form = await _checked_form(request)
            name = _one(form.get("task", []), "task")
            call = {
                "args": _json(form.get("args", [""])[0] or "[]", "args", list),
                "kwargs": _json(form.get("kwargs", [""])[0] or "{}", "kwargs", dict),
                "labels": _json(form.get("labels", [""])[0] or "{}", "labels", dict),
            }
            name, key, lock = await self._key_of(name, call)
            return pages.key_page(view, tasks, pages.KeyAnswer(name, key, lock))

        return await self._html(request, "view", page)

    async def release_page(self, request: Request) -> Response:
        async def page(view: pages.View) -> str:
            if not self._allow_release:
                raise _RefusedError(
                    403, "This page is read-only: it was built without allow_release."
                )
            if request.method != "POST":
                keys = [pages.key_of_token(key) for key in request.query_params.getlist("key")]
                if not keys:
                    raise _RefusedError(400, "Choose the locks to release first.")
                if len(keys) > _MAX_LIMIT:
                    raise _RefusedError(413, f"Release at most {_MAX_LIMIT} locks at once.")
                named = await asyncio.gather(*(self._lock(key) for key in keys))
                found = [lock for lock in named if lock is not None]
                return pages.confirm_page(view, found, len(keys) - len(found))
            form = await _checked_form(request)
            chosen = [_owned(value) for value in form.get("lock", [])]
            if len(chosen) > _MAX_LIMIT:
                raise _RefusedError(413, f"Release at most {_MAX_LIMIT} locks at once.")
            released: list[bool] = []
            for start in range(0, len(chosen), _RELEASED_AT_ONCE):
                batch = chosen[start : start + _RELEASED_AT_ONCE]
                released += await asyncio.gather(
                    *(self._release(key, owner) for owner, key in batch)
                )
            outcome = [(key, done) for (_, key), done in zip(chosen, released, strict=True)]
            return pages.released_page(view, outcome)

        return await self._html(request, "release", page)

    async def limits_page(self, request: Request) -> Response:
        async def page(view: pages.View) -> str:
            match = request.query_params.get("match") or "*"
            return pages.limits_page(view, match, await self._locks.limits(match))

        return await self._html(request, "view", page)

    # The JSON view

    async def api_locks(self, request: Request) -> Response:
        async def answer() -> object:
            query = _list_query(request)
            limit = _limit(request.query_params.get("limit"), self._page_size)
            found, after = await self._page(query, limit)
            return {
                "prefix": self._locks.prefix,
                "locks": [_as_json(lock) for lock in found],
                "cursor": after,
            }

        return await self._json(request, answer)

    async def api_lock(self, request: Request) -> Response:
        async def answer() -> object:
            key = _one(request.query_params.getlist("key"), "key")
            lock = await self._lock(key)
            if lock is None:
                raise _RefusedError(404, f"no lock at {key!r}")
            return _as_json(lock)

        return await self._json(request, answer)

    async def api_key(self, request: Request) -> Response:
        async def answer() -> object:
            # Only JSON: a browser asks before sending JSON to another site's
            # app, and this one never says yes.
            if _content_type(request) != "application/json":
                raise _RefusedError(415, "send the call as application/json")
            _check_same_site(request)
            body = _json((await _body(request)).decode("utf-8", "replace"), "body", dict)
            name = body.get("task_name")
            if not isinstance(name, str):
                raise _RefusedError(400, "task_name: a task's name is needed")
            call: dict[str, Any] = {}
            for field, kind in (("args", list), ("kwargs", dict), ("labels", dict)):
                call[field] = body.get(field, kind())
                if not isinstance(call[field], kind):
                    raise _RefusedError(400, f"{field}: expected a JSON {_kind_name(kind)}")
            name, key, lock = await self._key_of(name, call)
            return {"task_name": name, "key": key, "lock": lock and _as_json(lock)}

        return await self._json(request, answer)

    async def api_limits(self, request: Request) -> Response:
        async def answer() -> object:
            found = await self._locks.limits(request.query_params.get("match") or "*")
            limits = [dataclasses.asdict(limit) for limit in found]
            return {"prefix": self._locks.prefix, "limits": limits}

        return await self._json(request, answer)

    # What the pages share

    async def _page(self, query: pages.Query, limit: int) -> tuple[list[LockInfo], str | None]:
        found, after = await self._locks.page(
            query.match, cursor=query.cursor, limit=limit, task_name=query.task or None
        )
        return _sorted(found, query.sort), after

    async def _lock(self, key: str) -> LockInfo | None:
        """The lock at ``key``, a full key or a name under the prefix; never a key outside it."""
        lock = await self._locks.get(key)
        return lock if lock is not None and lock.name is not None else None

    async def _release(self, key: str, owner: str) -> bool:
        lock = await self._lock(key)
        return lock is not None and await self._locks.release(lock, owner=owner)

    def _task_names(self) -> list[str] | None:
        """The broker's tasks, ``None`` where the app cannot compute keys (built from a URL)."""
        broker = getattr(self._middleware, "broker", None)
        return None if broker is None else sorted(broker.get_all_tasks())

    async def _key_of(
        self, name: str, call: dict[str, Any]
    ) -> tuple[str, str | None, LockInfo | None]:
        """The full name of the task ``name`` names, the key its call takes, and the lock there."""
        broker = getattr(self._middleware, "broker", None)
        if broker is None:
            raise _RefusedError(404, "Keys are computed by an app built from a middleware.")
        task = find_task(broker, name)  # its full name, or its function's name alone
        if task is None:
            raise _RefusedError(404, f"The broker has no task {name!r}.")
        name = task.task_name
        try:
            kicker = task.kicker().with_labels(**call["labels"])
            key = self._locks.key_for(kicker, *call["args"], **call["kwargs"])
        except DeduplicationError as exc:  # says what is wrong without a value of the call
            raise _RefusedError(400, f"Task {name!r}: {exc}") from None
        except (ValueError, TypeError) as exc:  # taskiq's, which may quote the arguments
            msg = f"Task {name!r}: the call does not fit the task ({type(exc).__name__})."
            raise _RefusedError(400, msg) from None
        return name, key, (None if key is None else await self._lock(key))

    async def _allowed(self, request: Request, action: Action) -> None:
        if self._authorize is None:
            return
        verdict = self._authorize(request, action)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        if not verdict:
            raise _RefusedError(403, "Not allowed.")

    async def _html(
        self, request: Request, action: Action, page: Callable[[pages.View], Awaitable[str]]
    ) -> Response:
        token = request.cookies.get(_CSRF_COOKIE) or secrets.token_urlsafe(32)
        base = request.scope.get("root_path", "").rstrip("/")
        view = pages.View(base, token, self._locks.prefix, self._allow_release)
        try:
            await self._allowed(request, action)
            body, status = await page(view), 200
        except _RefusedError as refused:
            body, status = pages.error_page(view, str(refused)), refused.status
        except (RedisError, OSError) as exc:
            body, status = pages.error_page(view, f"Redis failed: {_redis_error(exc)}"), 503
        except DeduplicationError as exc:
            body, status = pages.error_page(view, str(exc)), 400
        response = HTMLResponse(body, status_code=status, headers=_HEADERS)
        if _CSRF_COOKIE not in request.cookies:
            response.set_cookie(
                _CSRF_COOKIE,
                token,
                path=base or "/",
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
        return response

    async def _json(self, request: Request, answer: Callable[[], Awaitable[object]]) -> Response:
        try:
            await self._allowed(request, "view")
            return _JSONResponse(await answer(), headers=_HEADERS)
        except _RefusedError as refused:
            return _JSONResponse({"error": str(refused)}, refused.status, headers=_HEADERS)
        except (RedisError, OSError) as exc:
            error = f"Redis failed: {_redis_error(exc)}"
            return _JSONResponse({"error": error}, 503, headers=_HEADERS)
        except DeduplicationError as exc:
            return _JSONResponse({"error": str(exc)}, 400, headers=_HEADERS)


class _JSONResponse(JSONResponse):
    """JSON in ASCII: a key that is not UTF-8 (not one of ours) is escaped, not an error."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _list_query(request: Request) -> pages.Query:
    """What the list is asked for, from the query string."""
    params = request.query_params
    sort = params.get("sort") or "age"
    if sort not in _SORTS:
        raise _RefusedError(400, f"sort={sort!r}: one of {', '.join(_SORTS)}")
    return pages.Query(
        params.get("match") or "*",
        (params.get("task") or "").strip(),
        sort,
        params.get("cursor") or None,
    )


def _sorted(locks: Sequence[LockInfo], sort: str) -> list[LockInfo]:
    """The oldest first (``age``), the nearest expiry first (``ttl``), or by key."""
    never = float("inf")
    if sort == "age":
        unknown = -1.0  # a lock of an older version records no age: last
        return sorted(
            locks, key=lambda lock: (-(unknown if lock.age is None else lock.age), lock.key)
        )
    if sort == "ttl":
        return sorted(locks, key=lambda lock: (never if lock.ttl is None else lock.ttl, lock.key))
    return sorted(locks, key=lambda lock: lock.key)


async def _body(request: Request) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _MAX_FORM:
            raise _RefusedError(413, "The request is too large.")
    return body


async def _checked_form(request: Request) -> dict[str, list[str]]:
    """The form of a POST from this app's own page, else a refusal."""
    _check_same_site(request)
    if _content_type(request) != "application/x-www-form-urlencoded":
        raise _RefusedError(415, "Send the form as the page does.")
    form: dict[str, list[str]] = {}
    for name, value in parse_qsl(
        (await _body(request)).decode("utf-8", "replace"), keep_blank_values=True
    ):
        form.setdefault(name, []).append(value)
    cookie = request.cookies.get(_CSRF_COOKIE, "")
    field = form.get("csrf", [""])[0]
    if not cookie or not hmac.compare_digest(cookie.encode(), field.encode()):
        raise _RefusedError(403, "Refused: the form did not come from this page (reload it).")
    return form


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip()


def _check_same_site(request: Request) -> None:
    """Refuse a request that a browser says comes from another site's page."""
    fetched_from = request.headers.get("sec-fetch-site")
    if fetched_from is not None:
        if fetched_from not in {"same-origin", "none"}:
            raise _RefusedError(403, "Refused: a cross-site request.")
        return
    origin = request.headers.get("origin")  # a browser that does not send Sec-Fetch-Site
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise _RefusedError(403, "Refused: a cross-site request.")


def _one(values: Sequence[str], name: str) -> str:
    if len(values) != 1 or not values[0]:
        raise _RefusedError(400, f"{name}: give exactly one")
    return values[0]


def _owned(value: str) -> tuple[str, str]:
    """A released lock as the confirmation sent it: ``"<owner token> <key>"``."""
    owner, space, token = value.partition(" ")
    if not space or not owner or not token:
        raise _RefusedError(400, "lock: not a lock the confirmation named")
    return owner, pages.key_of_token(token)


def _json(text: str, field: str, kind: type[list[Any] | dict[str, Any]]) -> Any:  # noqa: ANN401 (a JSON array or object)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _RefusedError(400, f"{field}: not JSON ({exc})") from None
    if not isinstance(value, kind):
        raise _RefusedError(400, f"{field}: expected a JSON {_kind_name(kind)}")
    return value


def _kind_name(kind: type) -> str:
    return "array" if kind is list else "object"


def _limit(text: str | None, default: int) -> int:
    if text is None:
        return default
    digits = text.isdigit() and text.isascii() and len(text) <= len(str(_MAX_LIMIT))
    if not digits or not 1 <= int(text) <= _MAX_LIMIT:
        raise _RefusedError(400, f"limit={text!r}: a whole number from 1 to {_MAX_LIMIT}")
    return int(text)


def _as_json(lock: LockInfo) -> dict[str, Any]:
    """A lock's fields, as ``LockInfo`` names them, but for its raw ``value``.

    The value of a key under the prefix that is not a lock of this library
    (``holder_task_id`` is ``None``) could hold anything; the others say it all.
    """
    shown = dataclasses.asdict(lock)
    del shown["value"]
    return shown


def _redis_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split()) or 'no message'}"
