"""``taskiq dedup`` on one Redis server, run as a user runs it: a process, its output, its status.

The locks it looks at are taken by real sends through the middleware, of tasks
that keep running (and so keep their locks) until the test ends.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis.asyncio
from taskiq import InMemoryBroker

from taskiq_deduplication import DuplicateTaskError
from taskiq_deduplication.cli import main
from tests._brokers import BrokerFactory, HoldingBroker
from tests._cli import dedup, dedup_in, one_line_error, start_dedup
from tests._docs import documented_acl
from tests._locks import lock_keys


class Held:
    """Tasks that run until the test ends, each holding its lock."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self.finish = asyncio.Event()
        finish = self.finish

        @broker.task(task_name="cli.job")
        async def job(n: int) -> None:
            await finish.wait()

        @broker.task(task_name="cli.named", deduplication_key="nightly")
        async def named() -> None:
            await finish.wait()

        self.job = job
        self.named = named

    async def jobs(self, count: int) -> list[str]:
        """Send ``count`` different jobs; their task ids."""
        return [(await self.job.kiq(n)).task_id for n in range(count)]


@pytest.fixture
async def held(make_broker: BrokerFactory) -> AsyncIterator[Held]:
    tasks = Held(await make_broker())
    try:
        yield tasks
    finally:
        tasks.finish.set()


@pytest.fixture
def url(redis_url: str) -> dict[str, str]:
    """The environment that points the command at the test Redis."""
    return {"REDIS_URL": redis_url}


async def test_taskiq_finds_the_dedup_command_in_its_entry_points() -> None:
    taskiq = shutil.which("taskiq", path=str(Path(sys.executable).parent))
    assert taskiq is not None
    process = await asyncio.create_subprocess_exec(
        taskiq, "dedup", "--help", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0
    for command in ("list", "show", "release", "key", "limits", "exit status"):
        assert command in out.decode()


async def test_list_every_lock_with_its_holder_and_time_left(
    held: Held, url: dict[str, str], prefix: str
) -> None:
    ids = await held.jobs(3)
    named_id = (await held.named.kiq()).task_id
    as_json, as_text, matched = await asyncio.gather(
        dedup("list", "--prefix", prefix, "--json", **url),
        dedup("list", "--prefix", prefix, **url),
        dedup("list", "--prefix", prefix, "--match", "night*", "--json", **url),
    )
    assert as_json.status == 0, as_json.stderr
    locks = as_json.json()
    assert [lock["key"] for lock in locks] == sorted(lock["key"] for lock in locks)
    assert {lock["holder_task_id"] for lock in locks} == {*ids, named_id}
    for lock in locks:
        assert set(lock) == {"key", "name", "holder_task_id", "owner_token", "ttl_ms"} | {
            "task_name",
            "policy",
            "age_ms",
            "sent",
        }
        assert lock["key"] == f"{prefix}:{lock['name']}"
        assert 0 < lock["ttl_ms"] <= 300_000
        # The lock's record, its task's name included (recorded by default).
        named = "cli.named" if lock["holder_task_id"] == named_id else "cli.job"
        assert (lock["task_name"], lock["policy"], lock["sent"]) == (named, "finished", True)
        assert 0 <= lock["age_ms"] < 60_000
    assert [lock["holder_task_id"] for lock in matched.json()] == [named_id]
    assert as_text.status == 0
    header, *rows, summary = as_text.stdout.splitlines()
    columns = ["KEY", "HOLDER", "TASK", "ID", "TASK", "POLICY", "AGE", "SENT", "TIME", "LEFT"]
    assert header.split() == columns
    assert len(rows) == 4
    assert f"{prefix}:nightly" in as_text.stdout
    assert all(task_id in as_text.stdout for task_id in ids)
    assert summary == f"4 locks under {prefix}:*"


async def test_list_of_nothing_is_empty_and_succeeds(url: dict[str, str], prefix: str) -> None:
    as_text = await dedup("list", "--prefix", prefix, **url)
    assert (as_text.status, as_text.stdout) == (0, f"0 locks under {prefix}:*\n")


async def test_show_one_lock_by_key_or_by_name(
    held: Held, redis_url: str, url: dict[str, str], prefix: str
) -> None:
    task_id = (await held.named.kiq()).task_id
    by_name, by_key, missing = await asyncio.gather(
        dedup("show", "nightly", "--prefix", prefix, "--json", **url),
        dedup("show", f"{prefix}:nightly", "--prefix", prefix, "--url", redis_url),
        dedup("show", "daily", "--prefix", prefix, **url),
    )
    assert by_name.status == 0
    shown = by_name.json()
    assert (shown["key"], shown["holder_task_id"]) == (f"{prefix}:nightly", task_id)
    assert by_key.status == 0
    assert f"holder task id  {task_id}" in by_key.stdout
    assert missing.status == 1
    assert one_line_error(missing) == f"taskiq dedup: no lock at '{prefix}:daily'"


async def test_release_asks_first_and_keeps_the_lock_on_no(
    held: Held, redis_client: redis.asyncio.Redis, url: dict[str, str], prefix: str
) -> None:
    task_id = (await held.named.kiq()).task_id
    for answer in ("n\n", ""):
        declined = await dedup("release", "nightly", "--prefix", prefix, stdin=answer, **url)
        assert declined.status == 1
        assert "Release 1 lock? [y/N]" in declined.stderr
        assert task_id in declined.stderr  # what it would release is shown before asking
        assert declined.stderr.rstrip().endswith("taskiq dedup: nothing released")
        assert declined.stdout == ""
    assert await lock_keys(redis_client, prefix) == [f"{prefix}:nightly"]

    accepted = await dedup("release", "nightly", "--prefix", prefix, stdin="y\n", **url)
    assert accepted.status == 0
    assert accepted.stdout == f"released {prefix}:nightly (held by task {task_id})\n"
    assert await lock_keys(redis_client, prefix) == []
    # Free again: the same call is accepted.
    await held.named.kiq()


async def test_release_many_by_glob_without_asking(
    held: Held, redis_client: redis.asyncio.Redis, url: dict[str, str], prefix: str
) -> None:
    await held.jobs(5)
    named_id = (await held.named.kiq()).task_id
    digests = [key for key in await lock_keys(redis_client, prefix) if not key.endswith("nightly")]
    released = await dedup(
        "release", "--match", "[^n]*", "--prefix", prefix, "--yes", "--json", **url
    )
    assert released.status == 0, released.stderr
    assert released.stderr == ""
    assert {(lock["key"], lock["released"]) for lock in released.json()} == {
        (key, True) for key in digests
    }
    assert await lock_keys(redis_client, prefix) == [f"{prefix}:nightly"]
    with pytest.raises(DuplicateTaskError) as caught:
        await held.named.kiq()
    assert caught.value.holder_task_id == named_id


async def test_release_says_which_locks_were_not_there(
    held: Held, redis_client: redis.asyncio.Redis, url: dict[str, str], prefix: str
) -> None:
    await held.named.kiq()
    partly = await dedup("release", "nightly", "daily", "--prefix", prefix, "--yes", **url)
    assert partly.status == 1
    assert partly.stdout.startswith(f"released {prefix}:nightly")
    assert partly.stderr == f"taskiq dedup: no lock at '{prefix}:daily'\n"
    # Not "--match *": the task still runs, and its heartbeat takes back the lock
    # released under it (within its 10 s interval: seconds, on a loaded machine).
    nothing = await dedup("release", "--match", "daily*", "--prefix", prefix, "--yes", **url)
    assert nothing.status == 1
    assert one_line_error(nothing) == "taskiq dedup: nothing to release"


async def test_a_lock_taken_again_while_asking_is_not_released(
    held: Held, redis_client: redis.asyncio.Redis, url: dict[str, str], prefix: str
) -> None:
    await held.named.kiq()
    key = f"{prefix}:nightly"
    process = await start_dedup("release", "nightly", "--prefix", prefix, **url)
    try:
        assert process.stderr is not None
        assert process.stdin is not None
        shown = b""
        while not shown.endswith(b"[y/N] "):
            chunk = await asyncio.wait_for(process.stderr.read(100), 30)
            assert chunk, shown
            shown += chunk
        # Meanwhile the task ended and a new send took the lock: another owner.
        await redis_client.set(key, "newOwnerTok 0123456789abcdef0123456789abcdef", px=60_000)
        process.stdin.write(b"y\n")
        out, err = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 1
    assert out == b""
    assert err.decode() == (
        f"taskiq dedup: not released {key!r}: another send holds it now, or it expired\n"
    )
    assert await redis_client.get(key) == "newOwnerTok 0123456789abcdef0123456789abcdef"


async def test_releasing_a_queued_debounced_lock_takes_its_merged_arguments(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, url: dict[str, str], prefix: str
) -> None:
    queue = await make_broker(broker_class=HoldingBroker)

    @queue.task(task_name="cli.debounced", deduplication_key="doc-7", deduplication_debounce=60)
    async def save(text: str) -> None: ...

    first = await save.kiq("a")
    assert (await save.kiq("b")).task_id == first.task_id  # merged into the queued task
    assert [key async for key in redis_client.scan_iter(match=f"{prefix}#merge:*")] == [
        f"{prefix}#merge:doc-7"
    ]
    released = await dedup("release", "doc-7", "--prefix", prefix, "--yes", **url)
    assert released.status == 0, released.stderr
    assert [key async for key in redis_client.scan_iter(match=f"{prefix}[:#]*")] == []
    queue.queued.clear()  # the test is over: the queued task never runs


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("lst",), "invalid choice: 'lst'"),
        (("release", "--url", "redis://x"), "name the locks to release: KEY ... or --match GLOB"),
        (("list", "--prefix", "", "--url", "redis://x"), "--prefix: key_prefix must be"),
        (("list", "--url", "redis+sentinel://h:1"), "expected redis+sentinel://host:port"),
        (("list", "--url", "http://x"), "--url http://x:"),
        (
            ("list", "--url", "redis+sentinel://u:secret@h:x/svc"),
            "--url redis+sentinel://u:***@h:x/svc: bad port in sentinel address 'h:x'",
        ),
        (("show",), "the following arguments are required: KEY"),
        (
            ("list", "--app", "tests.cli_app:broker", "--prefix", "p"),
            "--prefix: not with --app, whose middleware names its key_prefix",
        ),
        (("list", "--app", "tests.no_such_app:broker"), "cannot import 'tests.no_such_app:broker'"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(
    args: tuple[str, ...], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In the test process: the command line is all there is to these.
    assert main(args) == 2
    line = _one_line_error(capsys)
    assert line.startswith("taskiq dedup: error: ")
    assert error in line


async def test_a_usage_error_from_the_real_command(prefix: str) -> None:
    run = await dedup("list", "--prefix", prefix)
    assert run.status == 2
    assert one_line_error(run) == (
        "taskiq dedup: error: no Redis URL: pass --url or --app, or set REDIS_URL"
    )


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    (line,) = err.splitlines()
    return line


async def test_an_unreachable_redis_is_one_line_with_status_3() -> None:
    run = await dedup("list", "--url", "redis://u:secret@127.0.0.1:1/0")
    assert run.status == 3
    line = one_line_error(run)
    assert line.startswith("taskiq dedup: Redis: ConnectionError: ")
    assert "secret" not in line


# The user of docs/operations.md: the one of docs/deploying.md, plus what listing needs.
_OPERATIONS = documented_acl("operations.md")
_LISTING = ("scan",)


@pytest.fixture
async def acl_user(redis_client: redis.asyncio.Redis, prefix: str) -> AsyncIterator[Any]:
    """Make users of this test's prefix with the given extra commands; their URLs."""
    names: list[str] = []
    admin: Any = redis_client  # redis-py leaves execute_command unannotated

    async def make(*extra: str) -> str:
        name = f"cli-{uuid.uuid4().hex[:8]}"
        names.append(name)
        rules = [*_OPERATIONS.rules(prefix, "pw", _middleware_commands()), *extra]
        await admin.execute_command("ACL", "SETUSER", name, *rules)
        kwargs = redis_client.connection_pool.connection_kwargs
        return f"redis://{name}:pw@{kwargs['host']}:{kwargs['port']}/0"

    try:
        yield make
    finally:
        for name in names:
            await admin.execute_command("ACL", "DELUSER", name)


def _middleware_commands() -> tuple[str, ...]:
    return tuple(c for c in _OPERATIONS.commands if c not in _LISTING)


def test_the_operations_user_is_the_deploying_user_plus_listing() -> None:
    deploying = documented_acl("deploying.md")
    assert _OPERATIONS.key_patterns == deploying.key_patterns
    assert _middleware_commands() == deploying.commands
    assert set(_OPERATIONS.commands) - set(deploying.commands) == set(_LISTING)


async def test_the_minimal_acl_plus_scan_lists_and_releases(
    held: Held, acl_user: Any, redis_client: redis.asyncio.Redis, prefix: str
) -> None:
    ids = await held.jobs(2)
    scan_only, with_pttl, without_scan = await asyncio.gather(
        acl_user("+scan", "-pttl"), acl_user("+scan"), acl_user()
    )
    listed, timed, refused = await asyncio.gather(
        dedup("list", "--prefix", prefix, "--json", "--url", scan_only),
        dedup("list", "--prefix", prefix, "--json", "--url", with_pttl),
        dedup("list", "--prefix", prefix, "--url", without_scan),
    )
    assert listed.status == 0
    assert {lock["holder_task_id"] for lock in listed.json()} == set(ids)
    assert {lock["ttl_ms"] for lock in listed.json()} == {None}
    assert listed.stderr == (
        "taskiq dedup: time left unknown: the Redis user may not run PTTL (grant it +pttl)\n"
    )
    assert timed.status == 0
    assert timed.stderr == ""
    assert all(lock["ttl_ms"] > 0 for lock in timed.json())
    assert refused.status == 3
    assert "NoPermissionError" in one_line_error(refused)

    released = await dedup(
        "release", "--match", "*", "--prefix", prefix, "--yes", "--url", scan_only
    )
    assert released.status == 0, released.stderr
    assert await lock_keys(redis_client, prefix) == []


# `taskiq dedup key`, against the app in tests/cli_app.py


@pytest.fixture
def app(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, prefix: str
) -> Iterator[tuple[ModuleType, dict[str, str]]]:
    """The test app, imported here as the command imports it: same Redis, same prefix."""
    env = {"REDIS_URL": redis_url, "DEDUP_CLI_PREFIX": prefix}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sys.modules.pop("tests.cli_app", None)
    module = importlib.import_module("tests.cli_app")
    yield module, env
    sys.modules.pop("tests.cli_app", None)


@pytest.fixture
async def started_app(
    app: tuple[ModuleType, dict[str, str]],
) -> AsyncIterator[tuple[ModuleType, dict[str, str]]]:
    module, env = app
    await module.broker.startup()
    try:
        yield module, env
    finally:
        module.finish.set()
        await module.broker.wait_all()
        await module.broker.shutdown()


async def _refused_key(task: Any, *args: Any, **kwargs: Any) -> DuplicateTaskError:
    with pytest.raises(DuplicateTaskError) as caught:
        await task.kiq(*args, **kwargs)
    return caught.value


async def test_key_names_the_lock_a_call_takes_and_its_holder(
    started_app: tuple[ModuleType, dict[str, str]],
) -> None:
    app, env = started_app
    sent = await app.monthly_report.kiq("2024-05", pages=3)
    synced = await app.sync_user.kiq(user_id=7, reason="signup")
    refused = await _refused_key(app.monthly_report, "2024-05", pages=3)
    refused_sync = await _refused_key(app.sync_user, user_id=7, reason="other")
    held, held_text, other_call, by_field = await asyncio.gather(
        dedup(
            "key", "tests.cli_app:broker", "reports.monthly",
            "--args", '["2024-05"]', "--kwargs", '{"pages": 3}', "--json", **env,
        ),
        dedup(
            "key", "tests.cli_app:broker", "reports.monthly",
            "--args", '["2024-05"]', "--kwargs", '{"pages": 3}', **env,
        ),
        dedup("key", "tests.cli_app:broker", "reports.monthly", "--args", '["2024-06"]', **env),
        dedup(
            "key", "tests.cli_app:broker", "users.sync", "--kwargs", '{"user_id": 7}', "--json",
            **env,
        ),
    )  # fmt: skip
    assert held.status == 0, held.stderr
    found = held.json()
    assert (found["key"], found["held"], found["holder_task_id"]) == (
        refused.key,
        True,
        sent.task_id,
    )
    assert 0 < found["ttl_ms"] <= 300_000
    assert held_text.stdout.splitlines()[1:] == [
        f"key     {refused.key}",
        f"held    yes, by task {sent.task_id}, {held_text.stdout.split(', ')[-1].strip()}",
    ]
    assert other_call.status == 1
    assert other_call.stdout.splitlines()[-1] == "held    no: the call would take this lock now"
    assert by_field.status == 0
    assert (by_field.json()["key"], by_field.json()["holder_task_id"]) == (
        refused_sync.key,
        synced.task_id,
    )


async def test_key_follows_the_labels_of_the_task_and_of_the_call(
    started_app: tuple[ModuleType, dict[str, str]], prefix: str
) -> None:
    _, env = started_app
    nightly, relabelled, switched_off, off_by_label, missing_field = await asyncio.gather(
        dedup("key", "tests.cli_app:broker", "nightly", "--json", **env),
        dedup(
            "key", "tests.cli_app:broker", "nightly",
            "--labels", '{"deduplication_key": "weekly"}', "--json", **env,
        ),
        dedup("key", "tests.cli_app:broker", "ping", **env),
        dedup(
            "key", "tests.cli_app:broker", "reports.monthly", "--args", '["x"]',
            "--labels", '{"deduplication": false}', "--json", **env,
        ),
        dedup("key", "tests.cli_app:broker", "users.sync", "--args", "[7]", **env),
    )  # fmt: skip
    assert (nightly.status, nightly.json()["key"]) == (1, f"{prefix}:nightly-run")
    assert relabelled.json()["key"] == f"{prefix}:weekly"
    assert switched_off.status == 1
    assert "deduplication is off for this call" in switched_off.stdout
    assert (off_by_label.status, off_by_label.json()["key"]) == (1, None)
    # The middleware's own warning, in the command's words.
    assert missing_field.status == 1
    assert "taskiq dedup: warning: Key field 'user_id' of task users.sync is missing" in (
        missing_field.stderr
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("tests.no_such_app:broker", "x"), "cannot import 'tests.no_such_app:broker'"),
        (("tests.cli_app:nothing", "x"), "AttributeError"),
        (("tests.cli_app:not_a_broker", "x"), "is a str, not a taskiq broker"),
        (("tests.cli_app", "x"), "module:variable"),
        (("tests.cli_app:broker", "nope"), "has no task 'nope' (its tasks: nightly, ping,"),
        (("tests.cli_app:broker", "export"), "'export' names 2 tasks: shop.exports:export, shop:"),
        (("tests.cli_app:broker", "nightly", "--args", "{"), "--args: not JSON"),
        (("tests.cli_app:broker", "nightly", "--kwargs", "[]"), "--kwargs: expected a JSON object"),
        (("tests.cli_app:broker", "nightly", "--url", "http://x"), "--url http://x: "),
        (("--app", "tests.cli_app:broker", "tests.cli_app:broker", "x"), "expected MODULE:BROKER"),
        (("nightly",), "expected MODULE:BROKER TASK_NAME, or --app MODULE:BROKER TASK_NAME"),
        (
            ("tests.cli_app:broker", "nightly", "--labels", '{"deduplication_ttl": "abc"}'),
            "invalid value 'abc' for label 'deduplication_ttl'",
        ),
    ],
)
def test_key_usage_errors(
    app: tuple[ModuleType, dict[str, str]],
    args: tuple[str, ...],
    error: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["key", *args]) == 2
    assert error in _one_line_error(capsys)


async def test_a_key_usage_error_from_the_real_command(
    app: tuple[ModuleType, dict[str, str]],
) -> None:
    run = await dedup("key", "tests.cli_app:broker", "nope", **app[1])
    assert run.status == 2
    assert "has no task 'nope'" in one_line_error(run)


async def test_key_finds_a_task_by_its_functions_name_as_the_readme_shows(
    started_app: tuple[ModuleType, dict[str, str]],
) -> None:
    app, env = started_app
    sent = await app.build_report.kiq(user_id=42)
    refused = await _refused_key(app.build_report, user_id=42)
    call = ("--kwargs", '{"user_id": 42}')
    by_function, by_full_name, as_text, after_a_dot, shared = await asyncio.gather(
        dedup("key", "tests.cli_app:broker", "build_report", *call, "--json", **env),
        dedup("key", "tests.cli_app:broker", "tests.cli_app:build_report", *call, "--json", **env),
        dedup("key", "--app", "tests.cli_app:broker", "build_report", *call, **env),
        dedup("key", "tests.cli_app:broker", "monthly", "--args", '["2024-05"]', "--json", **env),
        dedup("key", "tests.cli_app:broker", "export", **env),
    )
    for run in (by_function, by_full_name):
        assert run.status == 0, run.stderr
        found = run.json()
        assert found["task_name"] == "tests.cli_app:build_report"  # its full name, said back
        assert (found["key"], found["holder_task_id"]) == (refused.key, sent.task_id)
    assert as_text.stdout.splitlines()[:2] == [
        "task    tests.cli_app:build_report",
        f"key     {refused.key}",
    ]
    assert (after_a_dot.status, after_a_dot.json()["task_name"]) == (1, "reports.monthly")
    assert shared.status == 2
    assert one_line_error(shared) == (
        "taskiq dedup: error: 'export' names 2 tasks: shop.exports:export, shop:export; "
        "give the full name"
    )


# An app as a user has it: a module in their project's directory, installed nowhere.
_PROJECT_APP = """
import os

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(
        redis_url=os.environ["REDIS_URL"], key_prefix=os.environ["DEDUP_CLI_PREFIX"]
    )
)


@broker.task(deduplication_key="nightly-export")
async def nightly_export() -> None: ...
"""


async def test_the_app_is_imported_from_the_current_directory_or_pythonpath(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    (tmp_path / "shop_project.py").write_text(_PROJECT_APP)
    env = {"REDIS_URL": redis_url, "DEDUP_CLI_PREFIX": prefix}
    task = ("shop_project:broker", "shop_project:nightly_export")
    on_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    elsewhere, keyed, listed, from_path = await asyncio.gather(
        dedup("key", *task, **env),  # from the project root: not there
        dedup_in(tmp_path, "key", *task, "--json", **env),
        dedup_in(tmp_path, "list", "--app", task[0], "--json", **env),
        dedup("key", "--app", *task, "--json", **env, PYTHONPATH=on_path),
    )
    assert elsewhere.status == 2
    assert "cannot import 'shop_project:broker': ModuleNotFoundError" in one_line_error(elsewhere)
    assert "looked in the current directory" in elsewhere.stderr
    for run in (keyed, from_path):
        assert (run.status, run.json()["key"]) == (1, f"{prefix}:nightly-export"), run.stderr
    assert (listed.status, listed.json()) == (0, []), listed.stderr


async def test_a_full_key_as_the_library_prints_it_needs_no_prefix(
    started_app: tuple[ModuleType, dict[str, str]],
    redis_client: redis.asyncio.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    app, _ = started_app
    sent = await app.nightly.kiq()
    refused = await _refused_key(app.nightly)  # an app with a key_prefix of its own
    listed = await dedup("list", "--prefix", prefix, "--json", REDIS_URL=redis_url)
    assert [lock["key"] for lock in listed.json()] == [refused.key]
    shown = await dedup("show", refused.key, "--json", REDIS_URL=redis_url)
    assert shown.status == 0, shown.stderr
    assert shown.json()["holder_task_id"] == sent.task_id
    released = await dedup("release", refused.key, "--yes", REDIS_URL=redis_url)
    assert released.stdout == f"released {refused.key} (held by task {sent.task_id})\n"
    assert await lock_keys(redis_client, prefix) == []
    gone = await dedup("show", refused.key, REDIS_URL=redis_url)
    assert gone.status == 1
    assert one_line_error(gone) == (
        f"taskiq dedup: no lock at {refused.key!r} (nor at 'taskiq:deduplication:{refused.key}')"
    )


async def test_a_name_with_a_colon_is_still_a_name_under_the_default_prefix(
    redis_client: redis.asyncio.Redis, redis_url: str
) -> None:
    name = f"user:{uuid.uuid4().hex[:12]}"
    key = f"taskiq:deduplication:{name}"
    await redis_client.set(key, "tok 0123456789abcdef0123456789abcdef", px=60_000)
    try:
        shown = await dedup("show", name, "--json", REDIS_URL=redis_url)
        assert shown.status == 0, shown.stderr
        assert (shown.json()["key"], shown.json()["name"]) == (key, name)
    finally:
        await redis_client.delete(key)


async def test_every_command_reads_the_url_and_the_prefix_from_the_app(
    started_app: tuple[ModuleType, dict[str, str]], redis_url: str, prefix: str
) -> None:
    app, _ = started_app
    sent = await app.nightly.kiq()
    # No REDIS_URL and no --prefix: the app's middleware says both.
    env = {"DEDUP_CLI_REDIS_URL": redis_url, "DEDUP_CLI_PREFIX": prefix}
    listed, shown, keyed, keyed_positional = await asyncio.gather(
        dedup("list", "--app", "tests.cli_app:broker", "--json", **env),
        dedup("show", "nightly-run", "--app", "tests.cli_app:broker", "--json", **env),
        dedup("key", "--app", "tests.cli_app:broker", "nightly", "--json", **env),
        dedup("key", "tests.cli_app:broker", "nightly", "--json", **env),
    )
    assert listed.status == 0, listed.stderr
    assert [lock["key"] for lock in listed.json()] == [f"{prefix}:nightly-run"]
    assert (shown.status, shown.json()["holder_task_id"]) == (0, sent.task_id)
    for found in (keyed.json(), keyed_positional.json()):
        assert (found["key"], found["holder_task_id"]) == (f"{prefix}:nightly-run", sent.task_id)
    released = await dedup(
        "release", "nightly-run", "--app", "tests.cli_app:broker", "--yes", **env
    )
    assert released.status == 0, released.stderr
    assert (await app.nightly.kiq()).task_id != sent.task_id  # free again


async def test_show_tells_what_a_lock_is_for_and_shows_an_older_lock_as_before(
    make_broker: BrokerFactory, redis_client: redis.asyncio.Redis, url: dict[str, str], prefix: str
) -> None:
    broker = await make_broker(record_task_name=True)
    finish = asyncio.Event()

    @broker.task(task_name="cli.recorded", deduplication_key="recorded")
    async def recorded() -> None:
        await finish.wait()

    try:
        task_id = (await recorded.kiq()).task_id
        # A lock of an older version: its value has no record.
        await redis_client.set(f"{prefix}:older", "AAAAAAAAAAA older-task", px=60_000)
        new, old, listed = await asyncio.gather(
            dedup("show", "recorded", "--prefix", prefix, **url),
            dedup("show", "older", "--prefix", prefix, **url),
            dedup("list", "--prefix", prefix, **url),
        )
    finally:
        finish.set()
    assert new.status == 0, new.stderr
    shown = {line[:15].strip(): line[16:] for line in new.stdout.splitlines()}
    assert shown["holder task id"] == task_id
    assert shown["task name"] == "cli.recorded"
    assert shown["policy"] == "finished"
    assert shown["age"].endswith(" ms")
    assert shown["sent"].startswith("yes")
    assert [line.split()[0] for line in old.stdout.splitlines()] == [
        "key",
        "name",
        "holder",
        "owner",
        "time",
    ]
    assert "older-task" in old.stdout
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:-1]}
    assert rows[f"{prefix}:recorded"][2:4] == ["cli.recorded", "finished"]
    assert rows[f"{prefix}:older"][2:6] == ["-", "-", "-", "-"]
