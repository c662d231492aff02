"""The pytest plugin, used as an application's project uses it.

``docs/examples/testing/`` is such a project: a ``conftest.py`` that opts in, an
app on InMemoryBroker and one on a module-level ListQueueBroker run by a real
``taskiq worker``. Each run copies it into a fresh directory and runs pytest
there, in this process or in a new one, with ``REDIS_URL`` set (the session's
Redis) or unset (the plugin starts an embedded Valkey).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
from importlib import metadata
from pathlib import Path

import pytest
import redis

pytest_plugins = ["pytester"]

PROJECT = Path(__file__).resolve().parent.parent / "docs" / "examples" / "testing"

# Asks the server who it is: with REDIS_URL unset it must be the embedded Valkey.
_WHICH_SERVER = """
import os

import redis


def test_the_session_redis(dedup_redis_url: str) -> None:
    assert os.environ["REDIS_URL"] == dedup_redis_url
    info = redis.Redis.from_url(dedup_redis_url).info("server")
    print("SERVER", "valkey" if "valkey_version" in info else "redis", dedup_redis_url)
"""


def _project(pytester: pytest.Pytester, *names: str) -> None:
    pytest.importorskip("taskiq_redis", reason="the docs' apps use taskiq-redis")
    for name in ("conftest.py", *names):
        shutil.copy(PROJECT / name, pytester.path / name)
    pytester.makepyfile(test_which_server=_WHICH_SERVER)


# pytest-asyncio warns about its loop scope when a project's ini does not set it.
_QUIET = ("-o", "asyncio_default_fixture_loop_scope=function")


def _run(pytester: pytest.Pytester, mode: str) -> pytest.RunResult:
    # Hypothesis is not the application's; loading it costs seconds per run.
    options = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-s", "-q", *_QUIET)
    if mode == "subprocess":
        return pytester.runpytest_subprocess(*options, timeout=60)
    return pytester.runpytest_inprocess(*options)


def _check_server(result: pytest.RunResult, session_redis: str | None) -> None:
    (line,) = [line for line in result.outlines if "SERVER " in line]
    if session_redis is None:
        assert "SERVER valkey redis://127.0.0.1:" in line, line
    else:
        assert line.endswith(f" {session_redis}"), line


APPS = ("invoices.py", "test_invoices.py", "shop.py", "test_shop.py")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("mode", "url"), [("in-process", "REDIS_URL set"), ("subprocess", "REDIS_URL unset")]
)
def test_the_docs_project_passes_with_deduplication_on(
    pytester: pytest.Pytester,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    url: str,
) -> None:
    session_redis = redis_url if url == "REDIS_URL set" else None
    if session_redis is None:
        monkeypatch.delenv("REDIS_URL", raising=False)
    else:
        monkeypatch.setenv("REDIS_URL", session_redis)
    _project(pytester, *APPS)
    result = _run(pytester, mode)
    result.assert_outcomes(passed=4)
    _check_server(result, session_redis)


def test_the_embedded_valkey_ends_with_the_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    _project(pytester, "invoices.py", "test_invoices.py")
    result = _run(pytester, "in-process")
    result.assert_outcomes(passed=3)
    (line,) = [line for line in result.outlines if "SERVER " in line]
    url = line.split()[-1]
    assert "REDIS_URL" not in os.environ  # put back as it was
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()


def test_the_plugin_is_not_loaded_unless_a_project_asks_for_it(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_no_plugin="def test_it(dedup):\n    pass\n")
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:hypothesispytest", *_QUIET
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'dedup' not found*"])


_EDGES = """
import pytest
from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware
from taskiq_deduplication.testing import Deduplication

pytestmark = pytest.mark.asyncio


async def test_a_middleware_of_the_test(dedup_middleware, dedup: Deduplication) -> None:
    assert dedup_middleware.key_prefix == dedup.key_prefix
    broker = InMemoryBroker(await_inplace=True).with_middlewares(dedup_middleware)

    @broker.task(task_name="edges.plain")
    async def plain(n: int) -> int:
        return n

    off = plain.kicker().with_labels(deduplication=False)
    assert dedup.key(off, n=1) is None
    assert await dedup.holder(off, n=1) is None
    assert not await dedup.is_locked(off, n=1)
    assert dedup.key(plain, n=1).startswith(dedup.key_prefix + ":")


async def test_install_on_a_broker_without_one_adds_it(dedup: Deduplication) -> None:
    broker = InMemoryBroker()

    @broker.task(task_name="edges.bare")
    async def bare() -> None: ...

    with pytest.raises(LookupError):
        dedup.key(bare)
    added = dedup.install(broker, default_ttl=7)
    assert broker.middlewares == [added]
    assert added.default_ttl == 7 and added.key_prefix == dedup.key_prefix
    assert dedup.key(bare) is not None
"""


def test_the_helpers_edges(
    pytester: pytest.Pytester, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    shutil.copy(PROJECT / "conftest.py", pytester.path / "conftest.py")
    pytester.makepyfile(test_edges=_EDGES)
    result = _run(pytester, "in-process")
    result.assert_outcomes(passed=2)


def _distribution(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def test_the_testing_extra_brings_what_the_projects_tests_import() -> None:
    # docs/testing.md: `pip install 'taskiq-dedup[testing]'`, then these tests run.
    local = {path.stem for path in PROJECT.glob("*.py")}
    imported = {
        name.split(".")[0]
        for path in [PROJECT / "conftest.py", *PROJECT.glob("test_*.py")]
        for name in _imports(path)
    }
    third_party = imported - local - set(sys.stdlib_module_names) - {"taskiq_deduplication"}
    provided = metadata.packages_distributions()
    required = {
        _distribution(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0])
        for requirement in metadata.requires("taskiq-dedup") or []
        if "extra" not in requirement or re.search(r"""extra\s*==\s*["']testing["']""", requirement)
    }
    missing = {
        module: provided.get(module)
        for module in third_party
        if not {_distribution(d) for d in provided.get(module, [])} & required
    }
    assert missing == {}


# An application with a TaskLock task, a task that merges its calls, and a
# subscriber of its own; its queue keeps what is sent, so a merged call's
# arguments stay stored as when a test ends before its task ran.
_APP_WITH_SIDE_KEYS = """
from taskiq import BrokerMessage, InMemoryBroker, TaskiqDepends

from taskiq_deduplication import RedisDeduplicationMiddleware, TaskLock


class KeptQueue(InMemoryBroker):
    async def kick(self, message: BrokerMessage) -> None:
        pass  # queued, never run in these tests


middleware = RedisDeduplicationMiddleware("redis://127.0.0.1:1/0", default_ttl=600)
broker = InMemoryBroker(await_inplace=True).with_middlewares(middleware)
queue = KeptQueue().with_middlewares(RedisDeduplicationMiddleware("redis://127.0.0.1:1/0"))
events = []
middleware.subscribe(events.append)


@broker.task(task_name="app.fenced", deduplication_key="nightly")
async def fenced(lock: TaskLock = TaskiqDepends()) -> int:
    return lock.fence


@queue.task(task_name="app.merged", deduplication_key_fields=["user"], deduplication_merge="latest")
async def merged(user: int, data: str) -> None: ...
"""

_TESTS_OF_THE_APP = """
import pytest
import pytest_asyncio
import redis

from app import broker, events, fenced, merged, queue
from taskiq_deduplication import DuplicateTaskError

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def started(dedup):
    dedup.install(broker)
    dedup.install(queue)
    await broker.startup()
    await queue.startup()
    print("PREFIX", dedup.key_prefix)
    yield dedup
    await broker.shutdown()
    await queue.shutdown()


async def test_a_fenced_task_and_a_merged_call(started) -> None:
    assert await (await fenced.kiq()).wait_result() is not None
    first = await merged.kiq(user=1, data="a")
    assert (await merged.kiq(user=1, data="b")).task_id == first.task_id  # merged into it
    assert set(await started.locks()) == {started.key(merged, user=1, data="a")}


async def test_release_all_takes_the_merged_arguments_with_the_locks(started) -> None:
    await merged.kiq(user=2, data="a")
    assert await started.release_all() == 1
    assert await started.locks() == {}
    with redis.Redis.from_url(started.redis_url) as client:
        assert list(client.scan_iter(match=started.key_prefix + "#merge:*")) == []


async def test_the_apps_subscriber_hears_the_tests_middleware(started) -> None:
    events.clear()
    await fenced.kiq()
    assert [event.kind.value for event in events] == ["locked", "released"]
"""


def _keys_of(redis_url: str, prefix: str) -> list[str]:
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        return sorted(client.scan_iter(match=f"{prefix}[:#]*"))


def _run_app_tests(pytester: pytest.Pytester, *names: str) -> pytest.RunResult:
    shutil.copy(PROJECT / "conftest.py", pytester.path / "conftest.py")
    pytester.makepyfile(app=_APP_WITH_SIDE_KEYS, test_app=_TESTS_OF_THE_APP)
    return _run_selected(pytester, *names)


def _run_selected(pytester: pytest.Pytester, *names: str) -> pytest.RunResult:
    options = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-s", "-q", *_QUIET)
    return pytester.runpytest_inprocess(*options, *(f"test_app.py::{name}" for name in names))


def test_a_test_leaves_no_key_behind(
    pytester: pytest.Pytester, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    result = _run_app_tests(
        pytester,
        "test_a_fenced_task_and_a_merged_call",
        "test_release_all_takes_the_merged_arguments_with_the_locks",
    )
    prefixes = re.findall(r"PREFIX (\S+)", result.stdout.str())
    assert len(prefixes) == 2
    # Each test wrote a lock and merged arguments, the first a fence counter too.
    for prefix in prefixes:
        assert _keys_of(redis_url, prefix) == []
    result.assert_outcomes(passed=2)


def test_the_apps_subscribers_hear_the_tests_middleware(
    pytester: pytest.Pytester, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    result = _run_app_tests(pytester, "test_the_apps_subscriber_hears_the_tests_middleware")
    result.assert_outcomes(passed=1)
