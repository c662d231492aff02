"""The code in the docs: every example runs, and every Python block comes from one.

Each file under ``docs/examples/`` is run as a script, the way a reader would run
it, against the session's Redis (``REDIS_URL``). The scripts are started all at
once, a few at a time, and each test waits for its own, so the whole module
costs about as long as its slowest examples rather than their sum. The pair in
``docs/examples/worker/`` (a tasks module and a sender) runs against a real
``taskiq worker`` process instead.

Every sample output on the site comes from a run too: a page shows it by
including ``docs/examples/<name>.out``, and the test of ``<name>.py`` compares
what the script printed (stdout and stderr, in order) with that file, once task
ids, owner tokens, digests, run suffixes and ports are replaced by placeholders.
After a change that alters an output on purpose, record the files again with
``DOCS_EXAMPLES_RECORD=1 .venv/bin/pytest tests/test_docs_examples.py``.

Every example module that builds a real broker for ``taskiq worker`` runs as one
(see :data:`WORKER_APPS`): the worker idles past redis-py's 5-second read limit,
and runs a task; the ones a reader starts with ``taskiq worker`` stop, idle, at one
``SIGTERM`` (see :data:`WAKING_APPS`).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

# The module's fixtures start every selected example and worker at once, from the
# session's list of tests: with pytest-xdist, all of them run in one worker.
pytestmark = pytest.mark.xdist_group("docs-examples")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = sorted((DOCS / "examples").glob("*.py"))
WORKER_APP = DOCS / "examples" / "worker"
EVERY_EXAMPLE = sorted((DOCS / "examples").rglob("*.py"))
OUTPUTS = sorted((DOCS / "examples").rglob("*.out"))
PAGES = sorted(DOCS.glob("*.md"))

# Each example finishes in a few seconds (operations.py, which runs the CLI ten
# times, in 5 s on an idle machine and 30 s on a loaded one); a hung one fails
# instead of stalling.
_TIMEOUT = 60
# How many run at once: fewer in a pytest-xdist worker, whose neighbours use the cores too.
_PARALLEL = 2 if os.environ.get("PYTEST_XDIST_WORKER") else 4
_RECORD = os.environ.get("DOCS_EXAMPLES_RECORD") == "1"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<info>[^\n]*)$", re.MULTILINE)
_SNIPPET = re.compile(r"""--8<--\s+["'](?P<path>[^"':]+)(?::[^"']+)?["']""")

# What differs from run to run, in the order it is replaced. Each pattern matches
# only the exact shape the library produces (a 43-character base64url digest, an
# 11-character token), so a change of format shows up as a difference.
# An owner token: 11 random characters, or, for a lock under an explicit key or
# key fields, 6 random ones, a dot and a digest of the call's arguments.
# Then the lock's record: the server's time in ms, the policy's letter, and the
# task's name where the middleware records it (its spaces escaped).
_RECORD_SHAPE = r"(?:/\d{13}/[fse](?:/[^\s\"]+)?)?"
_OWNER_SHAPE = rf"(?:[A-Za-z0-9_-]{{11}}|[A-Za-z0-9_-]{{6}}\.[A-Za-z0-9_-]{{4}}){_RECORD_SHAPE}"
# A run's token, in a lock while its task runs: ~ (or =, once the run succeeded)
# and 10 more characters, or 5, a dot and the digest; then the record.
_RUN_SHAPE = (
    rf"(?:[~=][A-Za-z0-9_-]{{10}}|[~=][A-Za-z0-9_-]{{5}}\.[A-Za-z0-9_-]{{4}}){_RECORD_SHAPE}"
)
_VARYING = (
    (re.compile(r"\b[0-9a-f]{32}\b"), "<task_id>"),
    (re.compile(r"(?<=:)[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])"), "<digest>"),
    (re.compile(rf"(?<![A-Za-z0-9_.-])(?:{_OWNER_SHAPE})(?= (?:of task )?<task_id>)"), "<token>"),
    (
        re.compile(rf"(?<![A-Za-z0-9_.~=-])(?:{_RUN_SHAPE})(?= (?:of task )?<task_id>)"),
        "<run token>",
    ),
    (re.compile(r"(?<=-)[0-9a-f]{8}(?=:)"), "<run>"),
    (re.compile(r"(?<=127\.0\.0\.1:)\d+|(?<='127\.0\.0\.1', )\d+"), "<port>"),
    # The scheduler process that sent a tick: <host>/<pid>.
    (re.compile(r"(?<=replica )[^\s/]+/\d+"), "<replica>"),
    # What `taskiq dedup` prints of a lock: its owner token and its time left.
    (re.compile(rf'(?<="owner_token": ")(?:{_OWNER_SHAPE})(?=")'), "<token>"),
    (re.compile(rf'(?<="owner_token": ")(?:{_RUN_SHAPE})(?=")'), "<run token>"),
    (re.compile(r'(?<="ttl_ms": )\d+\b|(?<="age_ms": )\d+\b|\b\d+(?= ms\b)'), "<ms>"),
    # A table's columns are as wide as their widest cell: an age of 999 or 1000 ms.
    (re.compile(r"(?<=\S)  +(?=\S)"), "  "),
)


def normalised(output: str) -> str:
    """``output`` with what differs between runs replaced by placeholders."""
    for pattern, placeholder in _VARYING:
        output = pattern.sub(placeholder, output)
    return output


def _env(redis_url: str) -> dict[str, str]:
    return {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}


def _run(example: Path, redis_url: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    # stderr goes into stdout, so that log lines keep their place among the prints.
    return subprocess.run(
        # A relative path, as a reader types it: taskiq names the tasks after it.
        [sys.executable, str(example.relative_to(cwd))],
        cwd=cwd,
        env=_env(redis_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=_TIMEOUT,
        check=False,
    )


def _check_output(example: Path, output: str) -> None:
    """Compare with ``<example>.out`` if the docs show this example's output."""
    expected = example.with_suffix(".out")
    if _RECORD and expected.exists():
        expected.write_text(output, "utf-8")
    if not expected.exists():
        return
    assert normalised(output) == normalised(expected.read_text("utf-8")), (
        f"{example.name} printed something else than {expected.name} shows:\n{output}"
    )


Runs = dict[Path, "Future[subprocess.CompletedProcess[str]]"]


@pytest.fixture(scope="module")
def example_runs(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Runs]:
    """Start the selected examples in the background; each test waits for its own."""
    selected: list[Path] = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "example" in params:
            selected.append(params["example"])
    with ThreadPoolExecutor(max_workers=_PARALLEL) as pool:
        yield {example: pool.submit(_run, example, redis_url) for example in selected}


def test_there_are_examples() -> None:
    assert EXAMPLES, "no docs/examples/*.py found"


# One worker runs them all: the fixture starts every example of the session in
# the background, and a worker that tested only a few would run the rest for nothing.
@pytest.mark.xdist_group("docs-examples")
@pytest.mark.timeout(2 * _TIMEOUT)  # its own run, and one it may wait for
@pytest.mark.parametrize("example", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_runs(example: Path, example_runs: Runs, redis_url: str) -> None:
    future = example_runs[example]
    # Still queued behind the others (the machine is slow): run it here and now,
    # rather than count the queue against it. Once started, _TIMEOUT bounds it.
    run = _run(example, redis_url) if future.cancel() else future.result()
    assert run.returncode == 0, f"{example.name} exited with {run.returncode}\n{run.stdout}"
    _check_output(example, run.stdout)


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of a Markdown page, as ``(info string, body)``."""
    blocks = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence = opening["fence"]
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index])
            index += 1
        blocks.append((opening["info"].strip(), "\n".join(body)))
        index += 1
    return blocks


def _is_python(info: str) -> bool:
    language = re.match(r"[{.\s]*(\w*)", info)
    return language is not None and language[1].lower() in {"python", "py", "python3", "pycon"}


@pytest.mark.parametrize("page", PAGES, ids=[path.name for path in PAGES])
def test_python_blocks_of_a_page_are_included_from_examples(page: Path) -> None:
    for info, body in _code_blocks(page.read_text("utf-8")):
        if not _is_python(info):
            continue
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        assert lines, f"{page.name}: an empty Python block"
        for line in lines:
            match = _SNIPPET.fullmatch(line)
            assert match is not None, (
                f"{page.name}: a Python block with inline code ({line!r}); "
                "put the code in docs/examples/ and include it with --8<--"
            )
            assert (ROOT / match["path"]).is_file(), f"{page.name}: {match['path']} is missing"


@pytest.mark.parametrize("page", PAGES, ids=[path.name for path in PAGES])
def test_sample_outputs_of_a_page_come_from_runs(page: Path) -> None:
    for info, body in _code_blocks(page.read_text("utf-8")):
        if info != "text":
            continue
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        match = _SNIPPET.fullmatch(lines[0]) if len(lines) == 1 else None
        assert match is not None, (
            f"{page.name}: a text block that no run printed ({body[:60]!r}...); "
            'show the output of an example with --8<-- "docs/examples/<name>.out"'
        )
        output = ROOT / match["path"]
        assert output.suffix == ".out", f"{page.name}: {match['path']} is not an output"
        assert output.is_file(), f"{page.name}: {match['path']} is missing"
        assert output.with_suffix(".py").is_file(), f"{match['path']}: no script printed it"


def test_every_example_and_output_appears_in_the_docs() -> None:
    included = {
        (ROOT / match["path"]).resolve()
        for page in PAGES
        for match in _SNIPPET.finditer(page.read_text("utf-8"))
    }
    orphans = [
        str(path.relative_to(DOCS))
        for path in [*EVERY_EXAMPLE, *OUTPUTS]
        if path.resolve() not in included
    ]
    assert not orphans, f"examples or outputs that no page includes: {orphans}"


def test_python_blocks_of_the_readme_compile() -> None:
    # The README is rendered on PyPI, where snippets do not work: its code is inline.
    for info, body in _code_blocks((ROOT / "README.md").read_text("utf-8")):
        if _is_python(info):
            compile(body, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def test_install_lines_name_this_distribution() -> None:
    declared = re.search(r'^name = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None
    for page in [ROOT / "README.md", *PAGES]:
        for line in page.read_text("utf-8").splitlines():
            install = re.search(r"pip install (?!-e\b)['\"]?([A-Za-z0-9_.-]+)", line)
            if install is not None and install[1].startswith("taskiq-d"):
                assert install[1] == declared[1], f"{page.name}: {line.strip()}"


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/getting-started.md"])
def test_the_install_pages_say_how_to_install_from_a_clone(page: str) -> None:
    # Until the first release, `pip install taskiq-dedup` finds nothing on PyPI.
    text = (ROOT / page).read_text("utf-8")
    assert "not on PyPI" in text
    assert re.search(r"pip install \.(?:\s|`|$)", text, re.MULTILINE), page


# redis-py 8 gives up on a reply after 5 s by default (its socket_timeout). The
# worker waits longer than that for its first message, as a worker does between
# messages: without socket_timeout=None on its broker, it dies in that pause.
_IDLE = 7.0
_WORKER_START = 30.0
# An idle worker that saw the signal stops within a second or two.
_WORKER_STOP = 20.0
_QUEUE = "welcome"  # the queue_name in docs/examples/worker/tasks.py


def _wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text("utf-8", errors="replace"):
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{path.read_text()}"
        time.sleep(0.1)


@pytest.mark.timeout(90)
def test_getting_started_runs_against_a_taskiq_worker(redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.delete(_QUEUE)  # a message that an aborted run left would be run first
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "taskiq", "worker", "tasks:broker", "--workers", "1"],
            cwd=WORKER_APP,
            env=_env(redis_url),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for_text(log, "Listening started.", _WORKER_START)
        time.sleep(_IDLE)
        run = _run(WORKER_APP / "send.py", redis_url, cwd=WORKER_APP)
        assert run.returncode == 0, f"send.py exited with {run.returncode}\n{run.stdout}"
        _check_output(WORKER_APP / "send.py", run.stdout)

        held = re.search(r"holds lock '([^']+)'", run.stdout)
        assert held is not None, run.stdout
        deadline = time.monotonic() + 10
        while client.exists(held[1]):  # the worker releases it when the task ends
            assert time.monotonic() < deadline, f"{held[1]} still held after the task"
            time.sleep(0.05)
        worker_log = log.read_text("utf-8", errors="replace")
        assert "is dead" not in worker_log, worker_log
        assert worker_log.count("Listening started.") == 1, worker_log  # never restarted
        assert "Traceback" not in worker_log, worker_log
        assert worker.poll() is None, worker_log
    finally:
        _kill(worker)
        client.delete(_QUEUE)
        client.close()


def _stopped_by_one_sigterm(workers: dict[Path, subprocess.Popen[bytes]]) -> dict[Path, bool]:
    """Send what ``kill``, Docker and Kubernetes send, once, to each main process."""
    for worker in workers.values():
        worker.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _WORKER_STOP
    return {path: _exits_cleanly(worker, deadline) for path, worker in workers.items()}


def _exits_cleanly(worker: subprocess.Popen[bytes], deadline: float) -> bool:
    try:
        return worker.wait(timeout=max(0.0, deadline - time.monotonic())) == 0
    except subprocess.TimeoutExpired:
        return False


def _kill(worker: subprocess.Popen[bytes]) -> None:
    """End the worker and its child, if a failed test left them running."""
    with contextlib.suppress(ProcessLookupError):  # it has stopped already
        os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)


# The example modules that build a real broker for `taskiq worker`, beside the
# Getting started pair above; each is started as `taskiq worker module:broker`.
@dataclass(frozen=True, eq=False)  # each is itself (a key of Workers)
class WorkerApp:
    """An example module run as a worker, and the task the test sends it."""

    path: Path
    task: str
    kwargs: dict[str, Any]
    queue: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def module(self) -> str:
        return self.path.stem


WORKER_APPS = (
    WorkerApp(
        DOCS / "examples" / "scheduler" / "reports.py",
        "build_sales_report",
        {},
        queue="reports",
    ),
    WorkerApp(DOCS / "examples" / "scheduler" / "replicas.py", "refresh_prices", {}, "replicas"),
    WorkerApp(
        DOCS / "examples" / "testing" / "invoices.py",
        "send_invoice",
        {"invoice_id": 1},
        queue="invoices",
        env={"BROKER": "redis"},
    ),
    WorkerApp(DOCS / "examples" / "testing" / "shop.py", "ship_order", {"order_id": 1}, "shop"),
)
# The modules that wake their idle worker up, so that one SIGTERM stops it (as
# docs/deploying.md shows): the ones a reader runs with `taskiq worker`.
WAKING_APPS = (WORKER_APP / "tasks.py", DOCS / "examples" / "scheduler" / "reports.py")
# Sends one task from the application's own module, and prints its task_id.
_KICK = """
import asyncio, importlib, json, sys
app = importlib.import_module(sys.argv[1])
async def kick():
    await app.broker.startup()
    task = await getattr(app, sys.argv[2]).kiq(**json.loads(sys.argv[3]))
    await app.broker.shutdown()
    print(task.task_id)
asyncio.run(kick())
"""
_REAL_BROKERS = re.compile(
    r"\b(ListQueueBroker|RedisStreamBroker|AioPikaBroker|\w*Nats\w*Broker)\("
)


def test_every_example_with_a_real_broker_runs_as_a_worker() -> None:
    builders = {path for path in EVERY_EXAMPLE if _REAL_BROKERS.search(path.read_text("utf-8"))}
    # A script that runs its own receiver is run by test_example_runs.
    scripts = {path for path in builders if "run_receiver_task" in path.read_text("utf-8")}
    covered = {WORKER_APP / "tasks.py", *(app.path for app in WORKER_APPS)}
    assert builders - scripts == covered


def test_every_list_queue_broker_of_the_examples_has_no_read_timeout() -> None:
    for path in EVERY_EXAMPLE:
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ListQueueBroker":
                keywords = {k.arg: k.value for k in node.keywords}
                timeout = keywords.get("socket_timeout")
                assert isinstance(timeout, ast.Constant), f"{path.name}: no socket_timeout=None"
                assert timeout.value is None, f"{path.name}: socket_timeout={timeout.value!r}"


Workers = dict[WorkerApp, tuple["subprocess.Popen[bytes]", Path]]


@dataclass
class ExampleWorkers:
    """The running workers of the selected example modules, and how their idle twins stopped."""

    running: Workers
    #: For each module of WAKING_APPS, whether one SIGTERM stopped its idle worker.
    stopped_idle: dict[Path, bool]


def _start_worker(path: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "taskiq", "worker", f"{path.stem}:broker", "--workers", "1"],
            cwd=path.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture(scope="module")
def example_workers(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ExampleWorkers]:
    """Start a worker for each example module, and let them all idle together.

    The idle workers of WAKING_APPS are signalled at the end of the idle time,
    before any task is sent, so that they take none of the tests' messages.
    """
    wanted = {
        params["app"]
        for item in request.session.items
        if "app" in (params := getattr(getattr(item, "callspec", None), "params", {}))
    }
    client = redis.Redis.from_url(redis_url)
    logs = tmp_path_factory.mktemp("workers")
    running: Workers = {}
    idle: dict[Path, subprocess.Popen[bytes]] = {}
    try:
        for app in WORKER_APPS:
            if app in wanted:
                client.delete(app.queue)  # a message an aborted run left would be run first
                log = logs / f"{app.module}.log"
                running[app] = (_start_worker(app.path, {**_env(redis_url), **app.env}, log), log)
        for path in WAKING_APPS if wanted & set(WAKING_APPS) else ():
            idle[path] = _start_worker(path, _env(redis_url), logs / f"{path.stem}.idle.log")
        for log in [*(log for _, log in running.values()), *logs.glob("*.idle.log")]:
            _wait_for_text(log, "Listening started.", _WORKER_START)
        time.sleep(_IDLE)
        stopped = _stopped_by_one_sigterm(idle)
        for worker in idle.values():
            _kill(worker)
        yield ExampleWorkers(running, stopped)
    finally:
        for worker in [*idle.values(), *(worker for worker, _ in running.values())]:
            _kill(worker)
        for app in running:
            client.delete(app.queue)
        client.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("app", WAKING_APPS, ids=[path.stem for path in WAKING_APPS])
def test_an_idle_worker_stops_at_one_sigterm(app: Path, example_workers: ExampleWorkers) -> None:
    # taskiq's handler only sets an event; the example's waker lets the loop see it.
    assert example_workers.stopped_idle[app], f"the idle worker of {app.name} outlived SIGTERM"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("app", WORKER_APPS, ids=[app.module for app in WORKER_APPS])
def test_an_example_module_runs_as_a_taskiq_worker(
    app: WorkerApp, example_workers: ExampleWorkers, redis_url: str
) -> None:
    worker, log = example_workers.running[app]
    kick = subprocess.run(
        [sys.executable, "-c", _KICK, app.module, app.task, json.dumps(app.kwargs)],
        cwd=app.path.parent,
        env={**_env(redis_url), **app.env},
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
        check=False,
    )
    assert kick.returncode == 0, kick.stderr
    _wait_for_text(
        log, f"Executing task {app.module}:{app.task} with ID: {kick.stdout.strip()}", 10
    )
    worker_log = log.read_text("utf-8", errors="replace")
    assert "is dead" not in worker_log, worker_log
    assert worker_log.count("Listening started.") == 1, worker_log  # never restarted
    assert "Traceback" not in worker_log, worker_log
    assert worker.poll() is None, worker_log
