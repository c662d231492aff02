"""Canaries: the taskiq behaviours this library relies on, each pinned by itself.

None of these tests uses the middleware or Redis. Each one checks one fact of
taskiq that ``send/``, ``run/`` or ``model/settings.py`` is built on (see docs/design.md,
"taskiq facts the locks depend on"), and its failure message says what changed upstream
and which part of this library depends on it. When one fails after a taskiq
upgrade, fix the library (or the declared taskiq range) before anything else.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from taskiq import (
    AckableMessage,
    AsyncBroker,
    AsyncTaskiqTask,
    BrokerMessage,
    Context,
    InMemoryBroker,
    NoResultError,
    SendTaskError,
    SimpleRetryMiddleware,
    SmartRetryMiddleware,
    TaskiqDepends,
    TaskiqMessage,
    TaskiqMiddleware,
    TaskiqResult,
)

RETRY_CLASSES = [SimpleRetryMiddleware, SmartRetryMiddleware]


def _retry(retry_class: type[TaskiqMiddleware]) -> TaskiqMiddleware:
    if retry_class is SmartRetryMiddleware:
        # No delay, no jitter: the retry is sent at once, from inside on_error.
        return SmartRetryMiddleware(default_retry_count=3, default_delay=0, use_jitter=False)
    return SimpleRetryMiddleware(default_retry_count=3)


class Recorder(TaskiqMiddleware):
    """Records every hook call as ``(name, hook, task_id)``, with what it saw."""

    def __init__(self, name: str, events: list[tuple[str, str, str]] | None = None) -> None:
        super().__init__()
        self.name = name
        self.events = [] if events is None else events
        self.sent: list[TaskiqMessage] = []
        self.labels_at_pre_execute: list[dict[str, Any]] = []
        self.labels_snapshot_at_pre_execute: list[dict[str, Any]] = []
        self.messages_at_post_execute: list[TaskiqMessage] = []
        self.results: list[TaskiqResult[Any]] = []
        self.tasks: dict[str, list[asyncio.Task[Any] | None]] = {}

    def _record(self, hook: str, message: TaskiqMessage) -> None:
        self.events.append((self.name, hook, message.task_id))
        self.tasks.setdefault(hook, []).append(asyncio.current_task())

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        self._record("pre_send", message)
        self.sent.append(message)
        return message

    async def post_send(self, message: TaskiqMessage) -> None:
        self._record("post_send", message)

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        self._record("pre_execute", message)
        self.labels_at_pre_execute.append(message.labels)
        self.labels_snapshot_at_pre_execute.append(dict(message.labels))
        return message

    async def on_error(
        self, message: TaskiqMessage, result: TaskiqResult[Any], exception: BaseException
    ) -> None:
        self._record("on_error", message)

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        self._record("post_execute", message)
        self.messages_at_post_execute.append(message)
        self.results.append(result)


async def run_a_task_that_fails_once(*middlewares: TaskiqMiddleware) -> AsyncTaskiqTask[None]:
    """Kick a task whose first attempt fails on a broker with ``middlewares``; wait for all runs."""
    broker = InMemoryBroker().with_middlewares(*middlewares)
    calls = 0

    @broker.task(retry_on_error=True, max_retries=3)
    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("first attempt fails")

    task = await flaky.kiq()
    await drain(broker)
    return task


async def recorded_retry(retry_class: type[TaskiqMiddleware]) -> Recorder:
    """What a recorder behind ``retry_class`` saw of a task whose first attempt fails."""
    recorder = Recorder("A")
    await run_a_task_that_fails_once(_retry(retry_class), recorder)
    return recorder


def requeued_once(broker: InMemoryBroker) -> Any:
    """Register ``job()``, whose first run requeues its message (``Context.requeue()``)."""
    contexts: list[Context] = []

    async def job(context: Context = TaskiqDepends()) -> None:
        contexts.append(context)
        if len(contexts) == 1:
            await context.requeue()

    return broker.register_task(job)


async def drain(broker: InMemoryBroker) -> None:
    """Wait for every task, also those a retry or a requeue started meanwhile."""
    for _ in range(100):
        await broker.wait_all()
        await asyncio.sleep(0)  # lets the ended tasks leave broker._running_tasks
        if not broker._running_tasks:
            return
    msg = "tasks still running after 100 rounds"
    raise AssertionError(msg)


def hooks(events: list[tuple[str, str, str]], name: str | None = None) -> list[str]:
    """The hooks in ``events`` as ``"name.hook"``, optionally of one recorder only."""
    return [f"{n}.{hook}" for n, hook, _ in events if name is None or n == name]


async def test_labels_are_strings_by_the_time_pre_send_sees_them() -> None:
    recorder = Recorder("A")
    broker = InMemoryBroker().with_middlewares(recorder)

    @broker.task(flag=False, ttl=30, fields=["user_id"])
    async def job() -> None: ...

    await job.kiq()
    await broker.wait_all()
    labels = recorder.sent[0].labels
    assert (labels["flag"], labels["ttl"], labels["fields"]) == ("False", "30", "['user_id']"), (
        "taskiq no longer turns label values into str (bool -> 'False', int -> '30', list "
        f"-> its repr) before pre_send: got {labels!r}. model/settings.py reads the deduplication "
        "labels in exactly these string forms (and the Python ones); check that "
        "deduplication=False still disables deduplication."
    )


async def test_labels_of_one_call_do_not_stick_to_the_task() -> None:
    recorder = Recorder("A")
    broker = InMemoryBroker().with_middlewares(recorder)

    @broker.task(fields=["user_id"])
    async def job() -> None: ...

    await job.kicker().with_labels(key="one").kiq()
    await job.kiq()
    await broker.wait_all()
    assert "key" not in recorder.sent[1].labels, (
        "A label given to one call with task.kicker().with_labels() now stays on the task "
        "for every later call (taskiq before 0.13 updated the task's own labels dict). "
        "Per-call deduplication labels (deduplication_key, deduplication=False, ...) "
        "would then apply to every later send of that task."
    )


async def test_the_message_pre_send_returns_is_the_one_sent() -> None:
    class Replaces(TaskiqMiddleware):
        async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
            return message.model_copy(update={"labels": {**message.labels, "added": "yes"}})

    events: list[tuple[str, str, str]] = []
    after = Recorder("after", events)
    broker = InMemoryBroker().with_middlewares(Replaces(), after)

    @broker.task
    async def job() -> None: ...

    await job.kiq()
    await broker.wait_all()
    assert after.sent[0].labels.get("added") == "yes"
    assert after.labels_snapshot_at_pre_execute[0].get("added") == "yes", (
        "taskiq no longer sends the message that pre_send returns. The middleware's "
        "pre_send writes the lock labels (key, owner token, TTL) on the message it "
        "returns, and the worker's hooks find the lock through them."
    )


async def test_no_post_send_when_the_broker_refuses_the_message() -> None:
    class Refusing(InMemoryBroker):
        async def kick(self, message: BrokerMessage) -> None:
            raise ConnectionError("broker down")

    events: list[tuple[str, str, str]] = []
    broker = Refusing().with_middlewares(Recorder("A", events))

    @broker.task
    async def job() -> None: ...

    with pytest.raises(SendTaskError):
        await job.kiq()
    assert hooks(events) == ["A.pre_send"], (
        "taskiq now calls post_send (or something else) after kick() raised, or no longer "
        f"raises SendTaskError: hooks {hooks(events)}. The two-phase send relies on "
        "post_send meaning 'the broker accepted the message': only then is the grace TTL "
        "extended to the full TTL."
    )


async def test_worker_hooks_run_in_order_and_post_execute_also_after_an_error() -> None:
    events: list[tuple[str, str, str]] = []
    broker = InMemoryBroker().with_middlewares(Recorder("A", events))

    @broker.task
    async def fails() -> None:
        events.append(("task", "run", ""))
        raise RuntimeError("boom")

    @broker.task
    async def works() -> None:
        events.append(("task", "run", ""))

    await fails.kiq()
    await broker.wait_all()
    failed = hooks(events)
    events.clear()
    await works.kiq()
    await broker.wait_all()
    succeeded = hooks(events)
    expected_failed = [
        "A.pre_send",
        "A.post_send",
        "A.pre_execute",
        "task.run",
        "A.on_error",
        "A.post_execute",
    ]
    expected_succeeded = ["A.pre_send", "A.post_send", "A.pre_execute", "task.run"]
    assert (failed, succeeded) == (expected_failed, [*expected_succeeded, "A.post_execute"]), (
        "taskiq's worker hooks changed order: expected pre_execute, the task, on_error "
        "(only when it raised), then post_execute (also after an error); got "
        f"{failed} and {succeeded}. The middleware stops the heartbeat in on_error and "
        "releases the lock in post_execute, so a failed task must still reach post_execute."
    )


@pytest.mark.parametrize("retry_class", RETRY_CLASSES)
async def test_retry_middlewares_resend_the_same_task_id_from_inside_on_error(
    retry_class: type[TaskiqMiddleware],
) -> None:
    events: list[tuple[str, str, str]] = []
    task = await run_a_task_that_fails_once(
        Recorder("A", events), _retry(retry_class), Recorder("B", events)
    )
    # The first attempt's run, from its first pre_execute to its last post_execute.
    start = hooks(events).index("A.pre_execute")
    first_run = hooks(events)[start : hooks(events).index("A.post_execute") + 1]
    assert {task_id for _, _, task_id in events} == {task.task_id}, (
        f"{retry_class.__name__} no longer re-sends with the same task_id. The middleware "
        "tells a retry (which takes the lock over) from a duplicate by that task_id."
    )
    assert first_run == [
        "A.pre_execute",
        "B.pre_execute",
        "B.on_error",
        "A.pre_send",
        "B.pre_send",
        "B.post_send",
        "A.post_send",
        "A.on_error",
        "B.post_execute",
        "A.post_execute",
    ], (
        f"{retry_class.__name__} no longer sends the retry from inside on_error, or the "
        f"order of the hooks around it changed (docs/design.md): {first_run}. The "
        "middleware's pre_send finds the failing attempt still running and takes its lock "
        "over; its post_execute then leaves the lock to the retry."
    )


@pytest.mark.parametrize("retry_class", RETRY_CLASSES)
async def test_the_retry_is_sent_in_the_running_attempts_asyncio_task(
    retry_class: type[TaskiqMiddleware],
) -> None:
    recorder = await recorded_retry(retry_class)
    # pre_send #0 is the caller's kiq, #1 the retry sent from the worker's on_error.
    assert recorder.tasks["pre_send"][1] is recorder.tasks["pre_execute"][0], (
        f"{retry_class.__name__}'s re-send no longer runs in the asyncio task (and so the "
        "contextvars context) of the attempt that failed. The middleware finds the running "
        "attempt of a retry through a ContextVar set in pre_execute."
    )


@pytest.mark.parametrize("retry_class", RETRY_CLASSES)
async def test_retry_middlewares_count_retries_on_the_running_messages_labels(
    retry_class: type[TaskiqMiddleware],
) -> None:
    recorder = await recorded_retry(retry_class)
    seen = recorder.labels_at_pre_execute[0]
    after = recorder.messages_at_post_execute[0].labels
    assert after is seen, (
        "taskiq's worker no longer hands the same labels dict to pre_execute and "
        "post_execute of one run."
    )
    before = recorder.labels_snapshot_at_pre_execute[0].get("_retries")
    assert (before, after.get("_retries")) == (None, 1), (
        f"{retry_class.__name__} no longer counts '_retries' up on the running message's "
        f"own labels dict (before {before!r}, after {after.get('_retries')!r}). "
        "post_execute tells a run that was passed on to a later attempt (keep the lock) "
        "from one that ended (release it) by this change."
    )


async def test_requeue_counts_on_the_running_labels_and_kicks_without_pre_send() -> None:
    class Counting(InMemoryBroker):
        def __init__(self) -> None:
            super().__init__()
            self.kicked: list[BrokerMessage] = []

        async def kick(self, message: BrokerMessage) -> None:
            self.kicked.append(message)
            await super().kick(message)

    events: list[tuple[str, str, str]] = []
    recorder = Recorder("A", events)
    broker = Counting().with_middlewares(recorder)
    job = requeued_once(broker)
    task = await job.kiq()
    await drain(broker)
    first = recorder.messages_at_post_execute[0].labels
    assert first is recorder.labels_at_pre_execute[0]
    assert (first.get("X-Taskiq-requeue"), hooks(events).count("A.pre_send")) == ("1", 1), (
        "Context.requeue() no longer counts 'X-Taskiq-requeue' up on the running "
        "message's labels, or now sends through pre_send: requeue label "
        f"{first.get('X-Taskiq-requeue')!r}, pre_send calls {hooks(events).count('A.pre_send')}."
        " post_execute keeps the lock for a requeued run by this count."
    )
    assert [m.task_id for m in broker.kicked] == [task.task_id, task.task_id]


async def test_a_requeued_run_ends_with_no_result_error() -> None:
    recorder = Recorder("A")
    broker = InMemoryBroker().with_middlewares(recorder)
    job = requeued_once(broker)
    await job.kiq()
    await drain(broker)
    assert isinstance(recorder.results[0].error, NoResultError), (
        "A run that called Context.requeue() no longer ends with NoResultError as "
        f"result.error (got {recorder.results[0].error!r}). post_execute keeps the lock "
        "only for a run that ended so."
    )


@pytest.mark.parametrize("retry_class", RETRY_CLASSES)
async def test_a_run_whose_retry_was_sent_ends_with_no_result_error(
    retry_class: type[TaskiqMiddleware],
) -> None:
    recorder = await recorded_retry(retry_class)
    assert isinstance(recorder.results[0].error, NoResultError), (
        f"{retry_class.__name__} no longer replaces the failed run's error with "
        f"NoResultError once it sent the retry (got {recorder.results[0].error!r}). "
        "post_execute tells a run passed on to a retry from a plain failure by it."
    )
    assert recorder.results[1].error is None


async def test_in_memory_broker_awaiting_in_place_runs_post_send_after_the_task() -> None:
    events: list[tuple[str, str, str]] = []
    broker = InMemoryBroker(await_inplace=True).with_middlewares(Recorder("A", events))

    @broker.task
    async def job() -> None:
        events.append(("task", "run", ""))

    await job.kiq()
    assert hooks(events) == [
        "A.pre_send",
        "A.pre_execute",
        "task.run",
        "A.post_execute",
        "A.post_send",
    ], (
        "InMemoryBroker(await_inplace=True) no longer runs the whole task inside kick(), "
        f"before post_send: {hooks(events)}. The middleware's post_send extension is "
        "owner-checked so that it cannot revive a lock the task already released; the "
        "tests of that rely on this order."
    )


def test_brokers_say_whether_they_run_in_a_worker_process() -> None:
    from taskiq.cli.worker import run  # noqa: PLC0415 (only this test needs it)

    assert InMemoryBroker().is_worker_process is False
    assert "is_worker_process = True" in inspect.getsource(run), (
        "taskiq's worker no longer sets broker.is_worker_process = True. The client and "
        "the worker processes run the same middleware startup(); this flag is how they "
        "tell each other apart."
    )


async def test_broker_startup_and_shutdown_run_the_middlewares_own() -> None:
    class Lifecycle(TaskiqMiddleware):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        async def startup(self) -> None:
            self.calls.append("startup")

        async def shutdown(self) -> None:
            self.calls.append("shutdown")

    class Broker(AsyncBroker):
        """A broker as the real ones are (taskiq-redis, aio-pika, nats): no own startup."""

        async def kick(self, message: BrokerMessage) -> None: ...

        def listen(self) -> AsyncGenerator[bytes, None]:
            raise NotImplementedError

    lifecycle = Lifecycle()
    broker = Broker().with_middlewares(lifecycle)
    await broker.startup()
    await broker.shutdown()
    assert lifecycle.calls == ["startup", "shutdown"], (
        "AsyncBroker.startup()/shutdown() no longer run the middlewares' own "
        f"(calls: {lifecycle.calls}). The middleware connects to Redis (with its startup "
        "retries) in startup() and closes its client in shutdown(). (InMemoryBroker runs "
        "them only from taskiq 0.13 on; before, the middleware connects on first use.)"
    )


def test_a_broker_lists_its_tasks_with_the_labels_they_were_declared_with() -> None:
    broker = InMemoryBroker()

    @broker.task(deduplication_ttl=60, deduplication_key_fields=["order_id"])
    async def charge(order_id: str) -> None: ...

    tasks = broker.get_all_tasks()
    assert tasks[charge.task_name].labels == {
        "deduplication_ttl": 60,
        "deduplication_key_fields": ["order_id"],
    }, (
        "broker.get_all_tasks() no longer maps each task name to a task whose .labels "
        "are the decorator's labels, as given. The middleware's startup() checks every "
        "registered task's deduplication labels through it."
    )


@pytest.mark.parametrize("retry_class", RETRY_CLASSES)
@pytest.mark.parametrize("sync", [False, True])
async def test_arguments_that_raise_no_result_error_when_unpacked_end_the_run_unrun(
    retry_class: type[TaskiqMiddleware], sync: bool
) -> None:
    """The fallback of a copy that must not run (`_copies.NotRun`) relies on this.

    taskiq unpacks the positional arguments inside the guard that turns a
    ``NoResultError`` into a run that sets no result (and whose message is
    acknowledged); the retry middlewares ignore that error; reading the
    arguments by index (parameter parsing) still works.
    """

    class NotRun(list[Any]):
        def __iter__(self) -> Any:
            raise NoResultError

    class Skip(TaskiqMiddleware):
        def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
            message.args = NotRun(message.args)
            return message

    broker = InMemoryBroker().with_middlewares(Skip(), _retry(retry_class))
    bodies: list[int] = []

    body = _counted_body(broker, bodies, sync=sync)

    try:
        acked = await _delivered_once(broker, body.task_name)
        assert bodies == [], "the body ran although its arguments raised NoResultError"
        assert not await broker.result_backend.is_result_ready("t1"), "a result was set"
        assert acked == [True], "the message was not acknowledged"
    finally:
        await broker.shutdown()


@pytest.mark.parametrize("retry_class", RETRY_CLASSES)
@pytest.mark.parametrize("sync", [False, True])
async def test_the_receiver_finds_the_task_before_pre_execute_and_calls_it_after(
    retry_class: type[TaskiqMiddleware], sync: bool
) -> None:
    """A copy that must not run (`_copies.watch_deliveries`) relies on this.

    taskiq's receiver looks a delivery's task up with ``broker.find_task``, in
    the asyncio task of the delivery, before the ``pre_execute`` hooks, and
    reads the function to call from what it found after them: a middleware
    that gives its delivery's copy of the task another function gets a run
    that returns, as any other, with no ``on_error``, no retry, a stored result
    and an acknowledgement, and the task itself is left as it was.
    """
    found: list[tuple[asyncio.Task[Any] | None, Any]] = []

    class Skip(TaskiqMiddleware):
        def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
            (current, task), *_ = found
            assert current is asyncio.current_task(), "find_task ran in another asyncio task"

            async def instead(*_args: object, **_kwargs: object) -> str:
                return "not run"

            task.original_func = instead
            return message

        def on_error(self, *_: object) -> None:
            errors.append("on_error")

    errors: list[str] = []
    broker = InMemoryBroker().with_middlewares(Skip(), _retry(retry_class))
    find = broker.find_task

    def find_task(name: str) -> Any:
        task = find(name)
        if not found:
            found.append((asyncio.current_task(), copy.copy(task)))
        return found[0][1]

    broker.find_task = find_task  # type: ignore[method-assign,assignment]
    bodies: list[int] = []

    body = _counted_body(broker, bodies, sync=sync)

    original = body.original_func
    try:
        acked = await _delivered_once(broker, body.task_name)
        assert found, "the receiver no longer looks the task up with broker.find_task"
        assert bodies == [], "the receiver called a function it looked up before pre_execute"
        assert errors == [], "a run that returned was reported as an error"
        result = await broker.result_backend.get_result("t1")
        assert (result.is_err, result.return_value) == (False, "not run")
        assert acked == [True], "the message was not acknowledged"
        assert body.original_func is original, "the registered task was changed"
    finally:
        await broker.shutdown()


def _counted_body(broker: InMemoryBroker, bodies: list[int], *, sync: bool) -> Any:
    """A task, sync or async, retried on error, whose body appends its argument to ``bodies``."""
    if sync:

        @broker.task(retry_on_error=True)
        def body(n: int) -> int:
            bodies.append(n)
            return n

        return body

    @broker.task(retry_on_error=True)
    async def async_body(n: int) -> int:
        bodies.append(n)
        return n

    return async_body


async def _delivered_once(broker: InMemoryBroker, task_name: str) -> list[bool]:
    """Start ``broker`` and deliver ``task_name(5)`` once, as ``t1``; its acknowledgements."""
    acked: list[bool] = []

    async def ack() -> None:
        acked.append(True)

    message = broker.formatter.dumps(
        TaskiqMessage(task_id="t1", task_name=task_name, labels={}, args=["5"], kwargs={})
    ).message
    await broker.startup()
    await broker.receiver.callback(message=AckableMessage(data=message, ack=ack))
    await drain(broker)
    return acked


def test_a_delivery_copies_its_task_whole_whatever_its_class() -> None:
    """Each delivery's copy of its task (`watch_deliveries`) has every attribute, and is its own.

    The registered task's ``__dict__`` is copied into a new object of its class
    (the copy is made for every delivery); a class that keeps values in slots
    or copies itself its own way is copied as ``copy.copy`` does.
    """
    from taskiq_deduplication.run.copies import _copy  # noqa: PLC0415 (private, tested here)

    broker = InMemoryBroker()

    @broker.task(some_label="x")
    async def job(n: int) -> int:
        return n

    task = broker.find_task(job.task_name)
    assert task is not None
    delivered = _copy(task)
    assert delivered is not task
    assert type(delivered) is type(task)
    assert vars(delivered) == vars(task)
    delivered.original_func = print
    assert task.original_func is not print  # the registered task is left as it was

    class Slotted:
        __slots__ = ("__dict__", "func")

        def __init__(self) -> None:
            self.func = "body"
            self.name = "job"

    class OwnCopy:
        def __init__(self) -> None:
            self.copies = 0

        def __copy__(self) -> OwnCopy:
            made = OwnCopy()
            made.copies = self.copies + 1
            return made

    slotted = _copy(Slotted())  # type: ignore[arg-type]
    assert (slotted.func, slotted.name) == ("body", "job")  # type: ignore[attr-defined]
    assert _copy(OwnCopy()).copies == 1  # type: ignore[arg-type,attr-defined]
