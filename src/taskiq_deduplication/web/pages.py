"""The HTML of the locks page (`web/app.py`): every page, built from what a lock records.

Every text that comes from Redis or from a request goes through ``_e`` (HTML
escaping) or ``_q`` (URL quoting): a key may hold any character, even bytes
that are not UTF-8 (a key another program wrote under the prefix). A key in a
link or a form travels as a token (``key_token``), so that such bytes come back
as they were. Times are
written once by the server and counted down in the browser by ``locks.js``,
which the page works without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from html import escape
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import quote, unquote, urlencode

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from taskiq_deduplication.locks import LimitInfo, LockInfo


@dataclass(frozen=True)
class View:
    """What every page needs: where the app is mounted, its form token, what it offers."""

    base: str
    """The path the app is mounted at, without a trailing ``/`` (``""`` at the root)."""
    token: str
    """The token a form sends back, to show it came from this app's page."""
    prefix: str
    """The key prefix of the locks."""
    releases: bool
    """Whether the app offers releases."""

    def url(self, path: str, **query: str | None) -> str:
        """The page at ``path`` under the app's base, with the ``query`` items that are set."""
        given = {name: value for name, value in query.items() if value is not None}
        return f"{self.base}{path}" + (f"?{urlencode(given)}" if given else "")


class Query(NamedTuple):
    """What the list was asked for."""

    match: str
    """A glob over the locks' names."""
    task: str
    """A task name, or a glob over it; ``""`` for any."""
    sort: str
    """``age`` (the oldest first), ``ttl`` (the nearest expiry first) or ``key``."""
    cursor: str | None
    """Where the page starts, as the last page gave it; ``None``: the first page."""


class KeyAnswer(NamedTuple):
    """The key a call would take, and the lock there now."""

    task_name: str
    key: str | None
    lock: LockInfo | None


def _e(text: object) -> str:
    """``text`` fit for HTML: escaped; a byte that is not UTF-8 shows as a backslash escape."""
    shown = str(text)
    try:
        raw = shown.encode("utf-8", "surrogateescape")  # a key's bytes, as Redis has them
    except UnicodeEncodeError:
        raw = shown.encode("utf-8", "backslashreplace")
    return escape(raw.decode("utf-8", "backslashreplace"), quote=True)


def _to(view: View, path: str, key: str) -> str:
    """The link to the page of ``path`` for the lock at ``key``, fit for an attribute."""
    return _q(view, path, key=key_token(key))


def key_token(key: str) -> str:
    """A key as a link or a form carries it: percent-encoded, whatever bytes it holds."""
    return quote(key, safe="", errors="surrogatepass")


def key_of_token(token: str) -> str:
    """The key that ``key_token`` made ``token`` of (a plain key is its own token)."""
    return unquote(token, errors="surrogatepass")


def _q(view: View, path: str, **query: str | None) -> str:
    return _e(view.url(path, **query))


def _page(view: View, title: str, body: str) -> str:
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)} · taskiq-deduplication</title>
<link rel="stylesheet" href="{_q(view, "/assets/locks.css")}">
<script src="{_q(view, "/assets/locks.js")}" defer></script>
</head>
<body>
<header>
<a class="home" href="{_q(view, "/")}">Deduplication locks</a>
<span class="prefix">prefix <code>{_e(view.prefix)}</code></span>
<nav><a href="{_q(view, "/")}">Locks</a> <a href="{_q(view, "/limits")}">Limits</a>
<a href="{_q(view, "/key")}">Which key?</a></nav>
</header>
<main>
<h1>{_e(title)}</h1>
{body}
</main>
</body>
</html>
"""


# Durations


def duration(seconds: float | None) -> str:
    """``850 ms``, ``12.3 s``, ``4 min 05 s``, ``2 h 03 min``: what ``locks.js`` also writes."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{max(round(seconds * 1000), 0)} ms"
    if seconds < 60:  # noqa: PLR2004 (a minute)
        return f"{math.floor(seconds * 10) / 10:.1f} s"
    whole = int(seconds)
    if whole < 3600:  # noqa: PLR2004 (an hour)
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def _time_left(lock: LockInfo) -> str:
    if not lock.ttl_readable:
        return '<span title="the Redis user may not run PTTL">?</span>'
    if lock.ttl is None:
        return "never expires"
    return f'<span class="countdown" data-ms="{round(lock.ttl * 1000)}">{duration(lock.ttl)}</span>'


def _age(lock: LockInfo) -> str:
    if lock.age is None:
        return "-"
    return f'<span class="age" data-ms="{round(lock.age * 1000)}">{duration(lock.age)}</span>'


def _state(lock: LockInfo) -> str:
    """Where the holder is: not yet queued, queued, running, or remembered as a success."""
    if lock.succeeded:
        return "succeeded"
    if lock.running:
        return "running"
    if lock.sent is False:
        return '<span class="warn">not yet accepted by the broker</span>'
    if lock.sent:
        return "queued or running"
    return "-"


# The list


def list_page(view: View, query: Query, locks: Sequence[LockInfo], after: str | None) -> str:
    """The held locks of one page, their filter, and the way to the next page."""
    match, task, sort = query.match, query.task, query.sort
    sorts = "".join(
        f'<option value="{value}"{" selected" if value == sort else ""}>{label}</option>'
        for value, label in (
            ("age", "oldest first"),
            ("ttl", "least time left first"),
            ("key", "key"),
        )
    )
    filters = f"""<form class="filter" method="get" action="{_q(view, "/")}">
<label>Name <input name="match" value="{_e(match)}" placeholder="*"
 title="A glob over the lock's name (the key without the prefix), as Redis' SCAN MATCH"></label>
<label>Task <input name="task" value="{_e(task)}" placeholder="any"
 title="The task's name, or a glob over it (locks record it with record_task_name=True)"></label>
<label>Sort <select name="sort">{sorts}</select></label>
<button type="submit">Filter</button>
</form>"""
    if not locks:
        table = '<p class="empty">No lock on this page matches.</p>'
    else:
        table = _table(view, locks)
    count = len(locks)
    pager = [f"{count} lock{'' if count == 1 else 's'} on this page, sorted within it."]
    same: dict[str, str | None] = {"match": match, "task": task or None, "sort": sort}
    if after is not None:
        pager.append(f'<a class="next" href="{_q(view, "/", **same, cursor=after)}">Next page</a>')
    pager.append(f'<a href="{_q(view, "/", **same)}">First page</a>')
    untold = task and not any(lock.task_name for lock in locks)
    hint = (
        '<p class="hint">Only locks that record their task name match a task: build the '
        "middleware with <code>record_task_name=True</code>.</p>"
        if untold
        else ""
    )
    return _page(view, "Locks", f"{filters}\n{hint}\n{table}\n<p class=pager>{' '.join(pager)}</p>")


def _table(view: View, locks: Sequence[LockInfo]) -> str:
    heads = ["Key", "Task", "Policy", "Holder task id", "Age", "Time left", "State"]
    rows = []
    for lock in locks:
        cells = [
            f'<a href="{_to(view, "/lock", lock.key)}">{_e(lock.key)}</a>',
            _e(lock.task_name or "-"),
            _e(lock.policy or "-"),
            f"<code>{_e(lock.holder_task_id or '-')}</code>",
            _age(lock),
            _time_left(lock),
            _state(lock),
        ]
        if view.releases:
            box = (
                f'<input type="checkbox" name="key" value="{_e(key_token(lock.key))}" '
                f'aria-label="select {_e(lock.key)}">'
            )
            link = f'<a class="release" href="{_to(view, "/release", lock.key)}">Release</a>'
            cells = [box, *cells, link]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    if view.releases:
        heads = ["", *heads, ""]
    table = (
        '<table class="locks"><thead><tr>'
        + "".join(f"<th>{head}</th>" for head in heads)
        + "</tr></thead><tbody>"
        + "\n".join(rows)
        + "</tbody></table>"
    )
    if not view.releases:
        return table
    # The selection goes to the confirmation page, which reads the locks again.
    return (
        f'<form method="get" action="{_q(view, "/release")}">{table}'
        '<p><button type="submit" class="danger">Release selected</button></p></form>'
    )


# One lock


def lock_page(view: View, lock: LockInfo) -> str:
    """Everything one lock records; its release, where releases are offered."""
    rows: list[tuple[str, str]] = [
        ("Key", f"<code>{_e(lock.key)}</code>"),
        ("Name", f"<code>{_e(lock.name or '-')}</code>"),
        ("Task", _e(lock.task_name or "- (recorded with record_task_name=True)")),
        ("Policy", _e(lock.policy or "- (a lock of an older version)")),
        (
            "Holder task id",
            f"<code>{_e(lock.holder_task_id or '- (not a lock of this library)')}</code>",
        ),
        ("State", _state(lock)),
        ("Age", _age(lock)),
        ("Time left", _time_left(lock)),
        ("Owner token", f"<code>{_e(lock.owner or '-')}</code>"),
    ]
    body = "<dl class=lock>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"
    if view.releases and lock.holder_task_id is not None:
        body += (
            f'<p><a class="release danger" href="{_to(view, "/release", lock.key)}">'
            "Release this lock</a></p>"
        )
    return _page(view, "Lock", body)


# Releasing


def confirm_page(view: View, locks: Sequence[LockInfo], gone: int) -> str:
    """The locks about to be released, as read now, and the button that does it."""
    note = f"<p>{gone} of the chosen locks are gone already.</p>" if gone else ""
    ours = [lock for lock in locks if lock.owner is not None and lock.holder_task_id]
    if not ours:
        return _page(view, "Release", note + '<p class="empty">Nothing to release.</p>')
    fields = "".join(
        f'<input type="hidden" name="lock" value="{_e(f"{lock.owner} {key_token(lock.key)}")}">'
        for lock in ours
    )
    count = len(ours)
    body = f"""{note}<p>Release {count} lock{"" if count == 1 else "s"}? A task that holds one
goes on running, and a new identical <code>kiq()</code> may be sent at once.
A lock that another send took since this page was read is left to it.</p>
{_table(replace(view, releases=False), ours)}
<form method="post" action="{_q(view, "/release")}">
<input type="hidden" name="csrf" value="{_e(view.token)}">{fields}
<button type="submit" class="danger">Release {count} lock{"" if count == 1 else "s"}</button>
<a href="{_q(view, "/")}">Cancel</a>
</form>"""
    return _page(view, "Release", body)


def released_page(view: View, outcome: Iterable[tuple[str, bool]]) -> str:
    """What each release did."""
    items = "".join(
        f'<li class="{"done" if done else "kept"}"><code>{_e(key)}</code>: '
        + ("released" if done else "not released: another send holds it now, or it ended")
        + "</li>"
        for key, done in outcome
    )
    return _page(
        view,
        "Released",
        f'<ul class="released">{items}</ul><p><a href="{_q(view, "/")}">Back to the locks</a></p>',
    )


# Limits


def limits_page(view: View, match: str, limits: Sequence[LimitInfo]) -> str:
    """The limits of runs whose names match ``match``: their use, limit, rate and waiting runs."""
    form = f"""<form class="filter" method="get" action="{_q(view, "/limits")}">
<label>Name <input name="match" value="{_e(match)}" placeholder="*"
 title="A glob over the limit's name: its limit_key or task name (:digest with key fields)"></label>
<button type="submit">Filter</button>
</form>"""
    if not limits:
        table = '<p class="empty">No limit matches: none is in use, or was used lately.</p>'
    else:
        heads = ("Limit", "In use", "Rate", "Waiting", "Holder task ids")
        table = (
            '<table class="locks limits"><thead><tr>'
            + "".join(f"<th>{head}</th>" for head in heads)
            + "</tr></thead><tbody>"
            + "\n".join(_limit_row(limit) for limit in limits)
            + "</tbody></table>"
        )
    count = len(limits)
    note = (
        f'<p class="pager">{count} limit{"" if count == 1 else "s"}. A limit is kept while it '
        "is used and for two leases after; a run whose worker died is not counted once its "
        "lease lapsed.</p>"
    )
    return _page(view, "Limits", f"{form}\n{table}\n{note}")


def _limit_row(limit: LimitInfo) -> str:
    cells = [
        f"<code>{_e(limit.name)}</code>",
        "-" if limit.concurrency is None else f"{limit.in_use} of {limit.concurrency}",
        _e(limit.rate or "-"),
        str(limit.waiting),
        " ".join(f"<code>{_e(task_id)}</code>" for task_id in limit.holders) or "-",
    ]
    return "<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>"


# Keys


def key_page(view: View, tasks: Sequence[str] | None, answer: KeyAnswer | None) -> str:
    """The form that asks which key a call would take; the answer, if it was asked.

    The call's arguments are never written back into the page.
    """
    if tasks is None:
        body = (
            "<p>This app was built from a Redis URL: it finds locks, but cannot "
            "compute a call's key. Build it from the middleware "
            "(<code>locks_app(middleware)</code>, or <code>taskiq dedup web --app "
            "MODULE:BROKER</code>) to ask here.</p>"
        )
        return _page(view, "Which key would a call take?", body)
    options = "".join(
        f'<option value="{_e(name)}"'
        f"{' selected' if answer is not None and answer.task_name == name else ''}>"
        f"{_e(name)}</option>"
        for name in tasks
    )
    form = f"""<form class="call" method="post" action="{_q(view, "/key")}">
<input type="hidden" name="csrf" value="{_e(view.token)}">
<label>Task <select name="task">{options}</select></label>
<label>Arguments (JSON array) <textarea name="args" rows="2" placeholder="[]"></textarea></label>
<label>Keyword arguments (JSON object)
<textarea name="kwargs" rows="2" placeholder="{{}}"></textarea></label>
<label>Labels of the call (JSON object)
<textarea name="labels" rows="2" placeholder="{{}}"></textarea></label>
<button type="submit">Find the key</button>
</form>"""
    result = "" if answer is None else _key_answer(view, answer)
    return _page(view, "Which key would a call take?", result + form)


def _key_answer(view: View, answer: KeyAnswer) -> str:
    if answer.key is None:
        return (
            f'<p class="answer">A call of <code>{_e(answer.task_name)}</code> takes no lock: '
            "deduplication is off for it.</p>"
        )
    held = (
        "Nobody holds it: the call would take it now."
        if answer.lock is None
        else f"Held by task <code>{_e(answer.lock.holder_task_id or '-')}</code>, "
        f"{_time_left(answer.lock)} left. "
        f'<a href="{_to(view, "/lock", answer.key)}">See the lock</a>'
    )
    return (
        f'<p class="answer">A call of <code>{_e(answer.task_name)}</code> takes '
        f"<code>{_e(answer.key)}</code>. {held}</p>"
    )


def error_page(view: View, message: str) -> str:
    """The page that says a request was not done, and why."""
    return _page(
        view,
        "Not done",
        f'<p class="error">{_e(message)}</p><p><a href="{_q(view, "/")}">Back to the locks</a></p>',
    )
