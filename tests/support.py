"""Test helpers: poll with a deadline (never sleep to synchronise), run apps in-process."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any, override

import aio_pika
import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from pymongo import AsyncMongoClient, monitoring
from pymongo.asynchronous.collection import AsyncCollection

from devtools.infra import clear_queue_policy, set_queue_policy
from services.gateway.submissions import Submissions
from shared.batched_publish import EventBatcher
from shared.consumers import Delivery, ScoreboxBroker
from shared.contracts import RescoreTask, ScoreText, TaskEvent, new_id
from shared.event_batches import BATCH_HEADER, split_batch
from shared.runtime import make_broker
from shared.topology import EVENTS, SCORE_REQUESTS, counted_headers

POLL_INTERVAL_S = 0.05
# What the gateway keeps a submission the outbox sweep sends (its IDEMPOTENCY_TTL_S default).
SWEEP_RETENTION = timedelta(days=1)

# A time as every answer writes one (`shared.contracts.rfc3339`).
RFC3339_UTC = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z")


def closed_port() -> int:
    """A local port nothing listens on (bound, then released): a connection to it is
    refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def advancing_clock(start: datetime) -> Callable[[], datetime]:
    """A clock that reads `start` now and goes on with real time. A service's clock frozen
    at `start` never reaches a `not_before` it set itself: a scheduler delivery deferred for
    a second (a run's next slice arriving before its hand-on was recorded) was deferred
    again for ever."""
    began = time.monotonic()
    return lambda: start + timedelta(seconds=time.monotonic() - began)


def stack_env(
    *,
    amqp_url: str,
    mongo_url: str,
    db_prefix: str,
    llm_url: str,
    api_key: str,
    admin_key: str | None = None,
    llm_timeout_s: float = 10,
    **overrides: str,
) -> dict[str, str]:
    """The settings of services run in-process against the fake model: quick retries, the
    test's own databases, and no per-key rate limit (tests poll more often than any sensible
    limit allows). `overrides` adds or replaces settings by name."""
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo_url,
        "MONGO_DB_PREFIX": db_prefix,
        "RETRY_BASE_S": "0.5",
        "RETRY_CAP_S": "2",
        "LLM_PROVIDER": "openai",
        "LLM_BASE_URL": llm_url,
        "LLM_API_KEY": "test-key",
        "LLM_MODEL": "fake-judge-1",
        "LLM_TIMEOUT_S": str(llm_timeout_s),
        "BOOTSTRAP_API_KEY": api_key,
        "RATE_LIMIT_PER_MIN": "0",
    }
    if admin_key is not None:
        env["ADMIN_API_KEY"] = admin_key
    return env | overrides


async def eventually[T](
    probe: Callable[[], Awaitable[T | None]], *, timeout_s: float = 30.0, what: str = "condition"
) -> T:
    """Call `probe` until it returns something other than None/False, or fail at the deadline."""
    last: T | None = None
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                last = await probe()
                if last is not None and last is not False:
                    return last
                await asyncio.sleep(POLL_INTERVAL_S)
    except TimeoutError:
        raise AssertionError(f"{what} not reached within {timeout_s}s (last: {last!r})") from None


async def loop_turns(turns: int = 50) -> None:
    """Let the event loop go round `turns` times: before checking that something did not
    happen, where nothing else runs (a fake clock, no I/O). One turn let what happens only
    a few steps later pass for what does not happen."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def none_done(*waiters: asyncio.Future[Any], turns: int = 50) -> bool:
    """Whether none of `waiters` is done once the event loop has gone round `turns` times
    (`loop_turns`)."""
    await loop_turns(turns)
    return not any(waiter.done() for waiter in waiters)


async def run_cron_job_by_hand(api: httpx.AsyncClient, job: str) -> dict[str, Any]:
    """Run `job` by hand through the scheduler's admin API (`api` carries the admin key) and
    wait for its run to end: the run as the API shows it. A run that does not end fails
    with the state it was last read in."""
    accepted = await api.post(f"/admin/v1/cron/jobs/{job}/run")
    assert accepted.status_code == 202, accepted.text
    run_url = accepted.json()["status_url"]
    last: list[dict[str, Any]] = []

    async def ended() -> dict[str, Any] | None:
        body: dict[str, Any] = (await api.get(run_url)).json()
        last[:] = [body]
        return body if body.get("state") in {"succeeded", "failed"} else None

    try:
        return await eventually(ended, what=f"the {job} run ended")
    except AssertionError as error:
        raise AssertionError(f"{error}; the run last read: {last}") from None


@asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Run `app`'s lifespan and give an HTTP client that talks to it in-process.

    The lifespan ends as a server ends it, whatever the body raised: thrown into the
    lifespan, a failing test's error skipped the services' shutdown (their brokers stayed
    connected, and the session hung at its end)."""
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://scorebox.test", timeout=10
        ) as client:
            yield client
    finally:
        await lifespan.__aexit__(None, None, None)


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """An aiohttp app on a free local port (a real HTTP peer); yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class CommandCounter(monitoring.CommandListener):
    """Counts the commands of the given names a PyMongo client sends (`sent`), and the
    statements they carry (`statements`: the updates, documents or deletes of a write)."""

    def __init__(self, *names: str) -> None:
        self.names = frozenset(names)
        self.sent = 0
        self.statements = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in self.names:
            self.sent += 1
            listed = [event.command.get(field) for field in ("updates", "documents", "deletes")]
            self.statements += next((len(items) for items in listed if items is not None), 1)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@asynccontextmanager
async def scratch_collection(
    mongo_url: str, commands: CommandCounter, *, prefix: str
) -> AsyncIterator[AsyncCollection[dict[str, Any]]]:
    """A collection in a database of its own, whose client reports its commands to
    `commands`; the database is dropped afterwards."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        mongo_url, tz_aware=True, event_listeners=[commands], serverSelectionTimeoutMS=10_000
    )
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    try:
        yield client[name]["docs"]
    finally:
        await client.drop_database(name)
        await client.close()


async def accepted_submission(submissions: Submissions) -> ScoreText:
    """A submission the gateway accepted (its command confirmed), as a re-score finds it."""
    command = ScoreText(task_id=new_id(), tenant_id="acme", text="An essay.")
    await submissions.insert(
        command, request_hash="h", idempotency_key=None, retention=timedelta(hours=1), cache_key="k"
    )
    await submissions.mark_accepted(command.task_id)
    return command


def rescore_request(command: ScoreText, *, attempt: int = 1) -> RescoreTask:
    """A re-score of the task under a rubric version of its own, as the fan-out sends it."""
    request = RescoreTask.for_task(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        rubric_version=f"v{uuid.uuid4().hex[:6]}",
        previous_rubric_version=None,
        model=None,
        run_id=new_id(),
    )
    return request.model_copy(update={"attempt": attempt})


class HandedDelivery(Delivery):
    """A delivery as the broker hands it to a handler, without a broker message behind it:
    what the handler reads, and how it settled the delivery (`settled`, in order)."""

    def __init__(
        self,
        body: bytes = b"",
        *,
        routing_key: str = "",
        headers: dict[str, Any] | None = None,
        redelivered: bool = False,
        message_id: str | None = None,
        correlation_id: str | None = None,
    ) -> None:
        # No raw message to wrap: every member a handler uses is answered here.
        self._body = body
        self._routing_key = routing_key
        # As `shared.consumers.Delivery` reads a broker's: a count only on a redelivery.
        self._headers = counted_headers(headers or {}, redelivered=redelivered)
        self._redelivered = redelivered
        self._message_id = message_id
        self._correlation_id = correlation_id
        self.settled: list[str] = []

    @classmethod
    def redelivery(cls, body: bytes, *, count: int = 1) -> HandedDelivery:
        """Delivered `count` times before, as a quorum queue hands it again."""
        return cls(body, headers={"x-delivery-count": count}, redelivered=True)

    @property
    @override
    def body(self) -> bytes:
        return self._body

    @property
    @override
    def routing_key(self) -> str:
        return self._routing_key

    @property
    @override
    def headers(self) -> dict[str, Any]:
        return self._headers

    @property
    @override
    def redelivered(self) -> bool:
        return self._redelivered

    @property
    @override
    def message_id(self) -> str | None:
        return self._message_id

    @property
    @override
    def correlation_id(self) -> str | None:
        return self._correlation_id

    @override
    async def ack(self) -> None:
        self.settled.append("ack")

    @override
    async def nack(self, *, requeue: bool = True) -> None:
        self.settled.append(f"nack(requeue={requeue})")

    @override
    async def reject(self, *, requeue: bool = False) -> None:
        self.settled.append(f"reject(requeue={requeue})")


class HandlerOnly:
    """Takes the handler a `subscribe_*` function registers, as a broker would to consume."""

    handler: Callable[[Delivery], Coroutine[Any, Any, None]]
    stopping = False  # a `ScoreboxBroker`'s, set when its stop begins

    def add_consumer(self, subscription: Any) -> None:
        self.handler = subscription.handler


@asynccontextmanager
async def queue_made_full(
    amqp_url: str,
    queue: str,
    *,
    policy: str,
    timeout_s: float = 60.0,
    management_url: str | None = None,
) -> AsyncIterator[None]:
    """`queue` of `amqp_url`'s vhost (a quorum queue with `reject-publish`) refusing every
    publish with a negative confirm, as a full queue does, for the block: a policy gives it
    `max-length` 0 (the lower of policy and argument applies), and fillers go in until it
    refuses one (a quorum queue refuses once over its limit, not at it, and a policy applies
    a moment after it is set). On the way out, the policy is removed, and once the queue takes
    a publish again (the removal applies a moment later too: the block's next publishes would
    be refused meanwhile), emptied."""
    await asyncio.to_thread(
        set_queue_policy, amqp_url, policy, queue, {"max-length": 0}, management_url=management_url
    )
    try:
        async with _publishing_to(amqp_url, queue, timeout_s) as publish:
            await eventually(
                lambda: _not(publish()), timeout_s=timeout_s, what=f"{queue} refusing publishes"
            )
        yield
    finally:
        try:
            await asyncio.to_thread(
                clear_queue_policy, amqp_url, policy, management_url=management_url
            )
            async with _publishing_to(amqp_url, queue, timeout_s) as publish:
                await eventually(
                    publish, timeout_s=timeout_s, what=f"{queue} taking publishes again"
                )
        finally:  # the fillers go whatever happened: later readers of the queue meet none
            connection = await aio_pika.connect(amqp_url, timeout=timeout_s)
            async with connection:
                channel = await connection.channel()
                await (await channel.get_queue(queue, ensure=True)).purge(timeout=timeout_s)


async def _not(taken: Awaitable[bool]) -> bool:
    return not await taken


@asynccontextmanager
async def _publishing_to(
    amqp_url: str, queue: str, timeout_s: float
) -> AsyncIterator[Callable[[], Awaitable[bool]]]:
    """A publish of a filler to `queue`, confirmed (True) or refused with a negative confirm
    (False)."""
    connection = await aio_pika.connect(amqp_url, timeout=timeout_s)
    async with connection:
        channel = await connection.channel()  # with publisher confirms

        async def publish() -> bool:
            try:
                await channel.default_exchange.publish(
                    aio_pika.Message(b"filler"), routing_key=queue, timeout=timeout_s
                )
            except aio_pika.exceptions.DeliveryError:
                return False
            return True

        yield publish


async def drain(amqp_url: str, queue_name: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message of `queue_name` in the vhost at `amqp_url`, taken off it in its order."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(queue_name, ensure=True)
        found = []
        while (message := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
            found.append(message)
        return found


async def queued_commands(amqp_url: str) -> list[ScoreText]:
    """Drain the score-requests queue of the vhost at `amqp_url`: the commands sent to the
    scorer so far (none runs in the tests that read them: they wait in its queue)."""
    return [
        ScoreText.model_validate_json(message.body)
        for message in await drain(amqp_url, SCORE_REQUESTS.name)
    ]


@asynccontextmanager
async def watching(
    amqp_url: str, *routes: tuple[str, str]
) -> AsyncIterator[aio_pika.abc.AbstractQueue]:
    """A queue of its own for the block, bound to each `(exchange, routing key)` of `routes`:
    what is published to them meanwhile, sent now or, with the wait ladder's
    `(scorebox.delay, "*.<key>")`, down the ladder."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, timeout=10)
        for exchange, routing_key in routes:
            await queue.bind(exchange, routing_key, timeout=10)
        yield queue


@asynccontextmanager
async def watching_completions(
    amqp_url: str,
) -> AsyncIterator[list[aio_pika.abc.AbstractIncomingMessage]]:
    """Every message `scorebox.events` routes as `task.completed` while the block lasts, a
    batch as one message (`completion_ids` reads the tasks of either)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        events = await channel.declare_exchange(
            EVENTS.name, aio_pika.ExchangeType.TOPIC, durable=True, timeout=10
        )
        queue = await channel.declare_queue(exclusive=True, timeout=10)
        await queue.bind(events, "task.completed", timeout=10)
        received: list[aio_pika.abc.AbstractIncomingMessage] = []

        async def keep(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.append(message)
            await message.ack()

        await queue.consume(keep)
        yield received


def completion_ids(message: aio_pika.abc.AbstractIncomingMessage) -> list[str | None]:
    """The tasks a `task.completed` message completes: one, or each of a batch's."""
    if BATCH_HEADER not in message.headers:
        return [message.correlation_id]
    return [part.correlation_id for part in split_batch(message.body, dict(message.headers))]


async def publish_together(
    broker: ScoreboxBroker, events: Sequence[TaskEvent], *, max_batch: int = 64
) -> float:
    """`events` published at once through the scorer's batching publisher; how many of them
    went out in batches (a callback-less completion goes alone only when nothing queued)."""
    batcher = EventBatcher(broker, timeout=10, max_batch=max_batch)
    await asyncio.gather(*(batcher.publish(event) for event in events))
    [family] = broker.metrics.events_per_batch.collect()
    return sum(sample.value for sample in family.samples if sample.name.endswith("_sum"))


def metric_sum(exposition: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples named `name` with these labels, in a `/metrics` text."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The value of the sample `name` with exactly these labels in `registry`, read as
    `/metrics` would export it; 0 for a series never recorded (a labelled counter exports
    none until it is first counted)."""
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def graceful_timeout_given(
    monkeypatch: pytest.MonkeyPatch, app_module: ModuleType, build: Callable[[], object]
) -> float:
    """The graceful timeout `build()` (a service's `create_app`, nothing started) gives the
    broker it makes through `app_module.make_broker`."""
    given: dict[str, Any] = {}

    def recording(*args: Any, **kwargs: Any) -> Any:
        given.update(kwargs)
        return make_broker(*args, **kwargs)

    monkeypatch.setattr(app_module, "make_broker", recording)
    build()
    return float(given["graceful_timeout_s"])
