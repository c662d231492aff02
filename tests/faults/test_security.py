"""Security: task arguments never leave the process; passwords, a minimal ACL, TLS.

The minimal ACL is the one ``docs/deploying.md`` tells users to create, read
from the page (see :func:`minimal_acl`): ``PING`` at startup, ``SCRIPT LOAD`` at
startup and after a server lost its script cache, ``EVALSHA`` for every lock
operation, and inside the scripts the commands they call, on the locks and the
keys beside them under the middleware's ``key_prefix``. ``SELECT`` only when
the URL names a database other than 0.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions
from taskiq import InMemoryBroker, SimpleRetryMiddleware, TaskiqDepends

import taskiq_deduplication
from taskiq_deduplication import DuplicateTaskError, TaskLock
from tests._docs import documented_acl
from tests._server import Server, free_port
from tests._tasks import echo_task, held_task
from tests.faults._harness import (
    GRACE_TTL_MS,
    LogRecords,
    RecordingBroker,
    admin,
    dedup_of,
    lock_keys,
    wait_until,
)
from tests.faults._proxy import Proxy
from tests.faults.conftest import FAST, BrokerMaker

pytestmark = pytest.mark.timeout(30)

USER = "dedup"
PASSWORD = "pw-" + uuid.uuid4().hex

#: The user of docs/deploying.md ("Access control and TLS").
DOCUMENTED = documented_acl("deploying.md")
#: Every command the middleware sends, or its scripts run, as the page lists them.
MINIMAL_COMMANDS = DOCUMENTED.commands
_LUA = Path(taskiq_deduplication.__file__).parent / "store" / "lua"


def minimal_acl(key_prefix: str, commands: tuple[str, ...] = MINIMAL_COMMANDS) -> list[str]:
    """The ``ACL SETUSER`` rules of the page's user, for ``key_prefix`` and these tests."""
    return DOCUMENTED.rules(key_prefix, PASSWORD, commands)


def _set_user(server: Server, rules: list[str]) -> None:
    with admin(server.port) as client:
        client.acl_setuser(USER, reset=True)  # creates it; the rules below replace it
        client.execute_command("ACL", "SETUSER", USER, *rules)


def _acl_url(port: int, query: str = FAST, db: int = 0, scheme: str = "redis") -> str:
    return f"{scheme}://{USER}:{PASSWORD}@127.0.0.1:{port}/{db}?{query}"


# Task arguments never appear in logs, keys, values, or on the wire


async def test_task_arguments_never_reach_logs_keys_values_or_the_wire(
    make_recording_broker: BrokerMaker, proxy: Proxy, server: Server, prefix: str, logs: LogRecords
) -> None:
    secret = "s3cr3t-" + uuid.uuid4().hex
    broker = await make_recording_broker(
        proxy.url(FAST),
        fail_open=True,
        default_ttl=3,
        extra=(SimpleRetryMiddleware(default_retry_count=2),),
    )
    finish = asyncio.Event()
    attempts: list[int] = []

    @broker.task
    async def work(token: str, nested: object = None) -> int:
        await finish.wait()
        return len(token)

    @broker.task
    async def positional(*parts: str, token: str = "") -> int:
        await finish.wait()
        return len(parts) + len(token)

    @broker.task(retry_on_error=True)
    async def flaky(token: str) -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")  # the message names no argument
        return len(token)

    handle = await work.kiq(secret, nested={"inner": [secret, {secret: secret}]})
    with pytest.raises(DuplicateTaskError) as duplicate:
        await work.kiq(secret, nested={"inner": [secret, {secret: secret}]})
    assert secret not in str(duplicate.value)
    key_fields: dict[str, Any] = {"deduplication_key_fields": ["token", "absent"]}
    fields = positional.kicker().with_labels(**key_fields)
    await fields.kiq(secret, token=secret)  # warns: positional args, a missing key field
    explicit = work.kicker().with_labels(deduplication_key="explicit")
    await explicit.kiq(token=secret)
    with pytest.raises(TypeError) as unencodable:
        await work.kiq(token=secret, nested=object())
    assert secret not in str(unencodable.value)
    await flaky.kiq(token=secret)  # fails once, and its retry takes the lock over
    await wait_until(lambda: _async(len(attempts) == 2), timeout=5)

    await proxy.cut()  # fail-open send, failed refreshes and releases, all logged
    await work.kiq(token=secret, nested=1)
    await asyncio.sleep(1.2)
    finish.set()
    await handle.wait_result(timeout=5)
    await broker.wait_all()
    await proxy.restore()

    assert logs.warnings("missing from its keyword arguments")
    assert logs.warnings("positional arguments")
    assert logs.warnings("fail_open")
    assert logs.warnings("Could not")
    # Plain booleans: pytest's explanation of a failed "in" on a long text is slow.
    assert _where(secret, logs.text()) is None
    assert _where(secret, proxy.sent_by_client.decode("utf-8", "replace")) is None
    with admin(server.port) as client:
        for key in client.scan_iter("*"):
            assert _where(secret, f"{key} = {client.get(key)}") is None
        fingerprint_key = re.compile(re.escape(prefix) + ":([A-Za-z0-9_-]+|explicit)")
        assert all(fingerprint_key.fullmatch(k) for k in lock_keys(client, prefix))


async def _async(value: bool) -> bool:
    return value


def _where(secret: str, text: str) -> str | None:
    """The text around the first place ``secret`` occurs in ``text``, if any."""
    at = text.find(secret)
    return None if at < 0 else text[max(0, at - 300) : at + 100]


# Passwords


async def test_a_password_protected_server_works_with_the_password_in_the_url(
    make_recording_broker: BrokerMaker, server: Server, logs: LogRecords
) -> None:
    with admin(server.port) as client:
        client.config_set("requirepass", PASSWORD)
    wrong = await make_recording_broker(
        f"redis://:wrong-{PASSWORD}@127.0.0.1:{server.port}/0?{FAST}",
        start=False,
        startup_retries=2,
        startup_retry_delay=0,
    )
    with pytest.raises(ConnectionError) as caught:
        await wrong.startup()
    assert isinstance(caught.value.__cause__, redis.exceptions.AuthenticationError)
    missing = await make_recording_broker(f"{server.url}?{FAST}", start=False, startup_retries=1)
    with pytest.raises(ConnectionError) as caught:
        await missing.startup()
    assert isinstance(caught.value.__cause__, redis.exceptions.AuthenticationError)
    assert _where(PASSWORD, logs.text()) is None

    broker = await make_recording_broker(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0?{FAST}")
    await _exercise(broker, server, password=PASSWORD)


# A user with the minimal ACL


async def test_a_user_with_the_minimal_acl_can_do_everything(
    make_recording_broker: BrokerMaker, server: Server, prefix: str, logs: LogRecords
) -> None:
    _set_user(server, minimal_acl(prefix))
    broker = await make_recording_broker(_acl_url(server.port), default_ttl=3)
    await _exercise(broker, server)
    # Every Redis call the middleware makes went through: nothing was logged.
    assert logs.warnings("Could not") == []
    with admin(server.port) as client:  # the server lost its script cache
        client.script_flush()
    await _exercise(broker, server)
    assert logs.warnings("Could not") == []


async def test_the_documented_user_can_use_every_feature(
    make_recording_broker: BrokerMaker, server: Server, prefix: str, logs: LogRecords
) -> None:
    _set_user(server, minimal_acl(prefix))
    broker = await make_recording_broker(_acl_url(server.port), hold=True)
    ran: list[object] = []

    @broker.task(deduplication_key_fields=["user"], deduplication_merge="latest")
    async def sync_profile(user: int, data: str) -> None:
        ran.append(data)

    @broker.task(deduplication_key="reindex", deduplication_debounce=0.2)
    async def reindex(x: int) -> None:
        ran.append(x)

    @broker.task(deduplication_key="nightly")
    async def nightly(lock: TaskLock = TaskiqDepends()) -> None:
        ran.append((lock.fence, await lock.held()))

    old = await sync_profile.kiq(user=1, data="old")
    assert (await sync_profile.kiq(user=1, data="new")).task_id == old.task_id  # merged
    first = await reindex.kiq(1)
    assert (await reindex.kiq(2)).task_id == first.task_id  # merged: the debounce waits
    await nightly.kiq()
    broker.deliver_held()
    await wait_until(lambda: _async(len(ran) == 3), timeout=5)
    await broker.wait_all()

    assert sorted(map(str, ran)) == sorted(["new", "2", "(1, True)"])
    assert logs.warnings("Could not") == []
    with admin(server.port) as client:  # no lock and no merged arguments are left
        left = [k for k in client.scan_iter() if k.startswith((f"{prefix}:", f"{prefix}#merge"))]
        assert left == []


async def test_the_documented_user_runs_limited_tasks_and_hands_their_slots_on(
    server: Server, prefix: str, logs: LogRecords
) -> None:
    _set_user(server, minimal_acl(prefix))
    middleware = taskiq_deduplication.RedisDeduplicationMiddleware(
        _acl_url(server.port), key_prefix=prefix, running_ttl=600
    )
    broker = InMemoryBroker().with_middlewares(middleware)
    await broker.startup()
    ran: list[int] = []

    # A lease of 10 minutes: the second run can only start by the channel's wake-up.
    @broker.task(limit_concurrency=1, limit_rate="100/s")
    async def limited(x: int) -> None:
        await asyncio.sleep(0.05)
        ran.append(x)

    handles = [await limited.kiq(x) for x in range(2)]
    for handle in handles:
        assert not (await handle.wait_result(timeout=20)).is_err
    assert ran == [0, 1]
    assert logs.warnings("Could not") == []
    await broker.shutdown()


def test_the_documented_user_may_run_every_command_the_scripts_call() -> None:
    called = {
        command.lower()
        for script in _LUA.glob("*.lua")
        for command in re.findall(r"redis\.p?call\(\s*'(\w+)'", script.read_text("utf-8"))
    }
    assert called
    assert called - set(MINIMAL_COMMANDS) == set()


@pytest.mark.parametrize("command", ["ping", "script|load"])
async def test_without_a_startup_command_startup_fails(
    command: str, make_recording_broker: BrokerMaker, server: Server, prefix: str
) -> None:
    commands = tuple(c for c in MINIMAL_COMMANDS if c != command)
    _set_user(server, minimal_acl(prefix, commands))
    broker = await make_recording_broker(_acl_url(server.port), start=False, startup_retries=1)
    with pytest.raises(ConnectionError) as caught:
        await broker.startup()
    assert isinstance(caught.value.__cause__, redis.exceptions.NoPermissionError)


@pytest.mark.parametrize("command", ["evalsha", "get", "set"])
async def test_without_an_acquire_command_kiq_fails(
    command: str, make_recording_broker: BrokerMaker, server: Server, prefix: str
) -> None:
    _set_user(server, minimal_acl(prefix))
    broker = await make_recording_broker(_acl_url(server.port))
    commands = tuple(c for c in MINIMAL_COMMANDS if c != command)
    _set_user(server, minimal_acl(prefix, commands))  # after a startup with all of them

    work = echo_task(broker)

    with pytest.raises(redis.exceptions.ResponseError):
        await work.kiq(x=1)
    assert broker.sent == []


async def test_without_pexpire_a_run_cannot_refresh_its_lock(
    make_recording_broker: BrokerMaker, server: Server, prefix: str, logs: LogRecords
) -> None:
    _set_user(server, minimal_acl(prefix, tuple(c for c in MINIMAL_COMMANDS if c != "pexpire")))
    # Not exclusive: an exclusive run's start sets its lock's value (and TTL) anew.
    broker = await make_recording_broker(
        _acl_url(server.port), default_ttl=60, default_exclusive=False
    )
    work, gate = held_task(broker)
    finish = gate.finish

    handle = await work.kiq(x=1)
    await asyncio.sleep(0.2)
    # The send's extension writes the lock's value anew (its "!" goes), with its
    # TTL; the re-assert at the run's start only refreshes a TTL, and cannot.
    assert logs.warnings("Could not re-assert lock")
    with admin(server.port) as client:
        (key,) = lock_keys(client, prefix)
        assert client.pttl(key) > GRACE_TTL_MS
    finish.set()
    await handle.wait_result(timeout=5)


async def test_without_del_the_lock_outlives_the_task(
    make_recording_broker: BrokerMaker, server: Server, prefix: str, logs: LogRecords
) -> None:
    _set_user(server, minimal_acl(prefix, tuple(c for c in MINIMAL_COMMANDS if c != "del")))
    broker = await make_recording_broker(_acl_url(server.port))

    work = echo_task(broker)

    await (await work.kiq(x=1)).wait_result(timeout=5)
    await broker.wait_all()
    assert logs.warnings("Could not release lock")
    with admin(server.port) as client:
        assert len(lock_keys(client, prefix)) == 1


async def test_keys_outside_the_acl_pattern_are_refused(
    make_recording_broker: BrokerMaker, server: Server, prefix: str
) -> None:
    _set_user(server, minimal_acl(f"{prefix}-other"))
    broker = await make_recording_broker(_acl_url(server.port))

    work = echo_task(broker)

    with pytest.raises(redis.exceptions.ResponseError):
        await work.kiq(x=1)


async def test_a_database_other_than_0_also_needs_select(
    make_recording_broker: BrokerMaker, server: Server, prefix: str
) -> None:
    _set_user(server, minimal_acl(prefix))
    without = await make_recording_broker(
        _acl_url(server.port, db=1), start=False, startup_retries=1
    )
    with pytest.raises(ConnectionError):
        await without.startup()
    _set_user(server, minimal_acl(prefix, (*MINIMAL_COMMANDS, "select")))
    broker = await make_recording_broker(_acl_url(server.port, db=1))
    await _exercise(broker, server, db=1)


# TLS


@pytest.fixture
def certificate(tmp_path: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (``cert.pem`` and ``key.pem`` in a dir)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for the TLS test")
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return tmp_path


@pytest.fixture
def tls_server(certificate: Path) -> Iterator[tuple[Server, int]]:
    """A server that also listens with TLS; skips if its binary has no TLS."""
    tls_port = free_port()
    cert = str(certificate / "cert.pem")
    own = Server(
        extra_args=(
            "--tls-port", str(tls_port),
            "--tls-cert-file", cert,
            "--tls-key-file", str(certificate / "key.pem"),
            "--tls-ca-cert-file", cert,
            "--tls-auth-clients", "no",
        )
    )  # fmt: skip
    try:
        try:
            own.start()
        except RuntimeError as exc:
            pytest.skip(f"{own.binary} does not serve TLS: {exc}")
        yield own, tls_port
    finally:
        own.cleanup()


async def test_a_rediss_url_with_a_password_works(
    make_recording_broker: BrokerMaker,
    tls_server: tuple[Server, int],
    certificate: Path,
    prefix: str,
    logs: LogRecords,
) -> None:
    server, tls_port = tls_server
    _set_user(server, minimal_acl(prefix))
    ca = certificate / "cert.pem"
    unverified = await make_recording_broker(
        _acl_url(tls_port, scheme="rediss"), start=False, startup_retries=1
    )
    with pytest.raises(ConnectionError):  # no CA given: the certificate is not trusted
        await unverified.startup()
    broker = await make_recording_broker(
        _acl_url(tls_port, f"{FAST}&ssl_cert_reqs=required&ssl_ca_certs={ca}", scheme="rediss")
    )
    await _exercise(broker, server)
    assert _where(PASSWORD, logs.text()) is None


async def _exercise(
    broker: RecordingBroker, server: Server, *, password: str | None = None, db: int = 0
) -> None:
    """Send, be refused a duplicate, run, release: all of the middleware's Redis calls."""
    prefix = dedup_of(broker).key_prefix
    finish = asyncio.Event()
    name = f"exercise_{uuid.uuid4().hex[:8]}"

    @broker.task(task_name=name, deduplication_ttl=3, deduplication_key="k")
    async def work(x: int) -> int:
        await finish.wait()
        return x

    handle = await work.kiq(x=1)
    with pytest.raises(DuplicateTaskError):
        await work.kiq(x=2)
    await asyncio.sleep(1.5)  # one heartbeat refresh (every 1 s for a 3 s TTL)
    with admin(server.port, password=password, db=db) as client:
        assert 1900 < client.pttl(f"{prefix}:k") <= 3000  # unrefreshed, it would be 1500
    finish.set()
    assert (await handle.wait_result(timeout=5)).return_value == 1
    await broker.wait_all()
    with admin(server.port, password=password, db=db) as client:
        assert not client.exists(f"{prefix}:k")
