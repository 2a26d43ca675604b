"""A memory alarm on the broker blocks every connection that publishes; consumers go on.

RabbitMQ stops reading a connection that published while an alarm lasts, acknowledgements
included. A service's consumers therefore use a connection of their own
(`shared.consumers`): a service whose publishes are blocked still settles the deliveries it
handles, so its queues keep draining. The alarm is real: the broker's memory watermark is set
below what it uses (`rabbitmqctl set_vm_memory_high_watermark`) for the few seconds the test
takes, then restored to what it was.

A handler whose own publish the alarm holds back keeps trying while it holds its delivery
(`shared.runtime.keep_publishing`) and settles it once the alarm ends: each service is
started in-process under the alarm with a message whose handling must publish.

Readiness needs both connections: with only the consuming one down, a service is not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aio_pika
import pytest
from fastapi import FastAPI
from faststream.rabbit import RabbitBroker, RabbitQueue
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.gateway.app import create_app as create_gateway
from services.gateway.settings import GatewaySettings
from services.gateway.submissions import Submissions
from services.notifier.app import create_app as create_notifier
from services.notifier.settings import NotifierSettings
from services.scheduler.app import create_app as create_scheduler
from services.scheduler.config import parse_config
from services.scheduler.messaging import SchedulerBus
from services.scheduler.settings import SchedulerSettings
from services.scorer.app import create_app as create_scorer
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.consumers import Delivery, consume
from shared.contracts import utcnow
from shared.dead_letters import DeadLetterWalker
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import (
    CRON_JOBS,
    NOTIFICATIONS,
    RESCORE_REQUESTS,
    SCORE_REQUESTS,
    STATUS_PROJECTION,
    USAGE_METER,
    WEBHOOK_DELIVERIES,
    WorkQueue,
    declare_topology,
)
from tests.faults.harness import memory_alarm, rabbitmqctl, rabbitmqctl_available, vhost_of
from tests.support import accepted_submission, eventually, rescore_request, running

TIMEOUT_S = 45.0  # each alarm probe runs rabbitmqctl: seconds apiece on a loaded machine
MESSAGES = 10
PREFETCH = 2


@pytest.fixture
async def queue(amqp_url: str) -> AsyncIterator[tuple[aio_pika.abc.AbstractChannel, str]]:
    if not rabbitmqctl_available(amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        name = f"test.alarm.{uuid.uuid4().hex[:8]}"
        await channel.declare_queue(name, durable=True, timeout=TIMEOUT_S)
        yield channel, name
        await channel.queue_delete(name, timeout=TIMEOUT_S)


async def test_consumers_settle_while_the_broker_blocks_the_services_publishes(
    amqp_url: str, queue: tuple[aio_pika.abc.AbstractChannel, str]
) -> None:
    channel, name = queue
    for index in range(MESSAGES):
        await channel.default_exchange.publish(
            aio_pika.Message(f"m{index}".encode()), routing_key=name, timeout=TIMEOUT_S
        )
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url, "BROKER_TIMEOUT_S": "30"})
    broker = make_broker(settings, prefetch=PREFETCH, name="alarm-test")
    publishes_blocked = asyncio.Event()
    handled: list[bytes] = []

    @consume(broker, RabbitQueue(name, durable=True))
    async def handle(delivery: Delivery) -> None:
        await publishes_blocked.wait()  # every ack goes out after the block
        handled.append(delivery.body)
        await delivery.ack()

    await broker.start()
    try:
        async with _a_publish_held_back(broker, amqp_url, name) as publishing:
            publishes_blocked.set()

            await eventually(
                lambda: _true(len(handled) == MESSAGES),
                timeout_s=TIMEOUT_S,
                what=f"all {MESSAGES} deliveries handled and acknowledged during the alarm "
                f"(prefetch {PREFETCH}: without acknowledgements only {PREFETCH} arrive)",
            )
            assert not publishing.done()  # the publish is still held back by the alarm
    finally:
        await broker.stop()


@contextlib.asynccontextmanager
async def _a_publish_held_back(
    broker: RabbitBroker, amqp_url: str, queue: str
) -> AsyncIterator[asyncio.Task[object]]:
    """A memory alarm, and a publish of `broker` to `queue` it holds back (the publishing
    connection blocked); on the way out the alarm is lifted and the publish goes through."""
    publishing: asyncio.Task[object] | None = None
    try:
        async with memory_alarm(timeout_s=TIMEOUT_S):
            publishing = asyncio.create_task(broker.publish(b"during the alarm", queue=queue))
            await eventually(
                lambda: _a_connection_blocked(amqp_url),
                timeout_s=TIMEOUT_S,
                what="a blocked publish",
            )
            yield publishing
    finally:
        if publishing is not None:
            await asyncio.wait_for(publishing, TIMEOUT_S)  # goes through once unblocked


async def _a_connection_blocked(amqp_url: str) -> bool:
    listed = await rabbitmqctl("list_connections", "-q", "vhost", "state", "--formatter", "json")
    vhost = vhost_of(amqp_url)
    return any(c["vhost"] == vhost and c["state"] == "blocked" for c in json.loads(listed))


async def _true(value: bool) -> bool:
    return value


async def test_a_service_publishes_and_consumes_on_two_named_connections(
    amqp_url: str, queue: tuple[aio_pika.abc.AbstractChannel, str]
) -> None:
    _, name = queue
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url})
    broker = make_broker(settings, name="naming-test")

    @consume(broker, RabbitQueue(name, durable=True))
    async def handle(delivery: Delivery) -> None:
        await delivery.ack()

    await broker.start()
    try:
        listed = json.loads(
            await rabbitmqctl(
                "list_connections", "-q", "vhost", "client_properties", "--formatter", "json"
            )
        )
        names = {
            {key: value for key, _, value in c["client_properties"]}.get("connection_name")
            for c in listed
            if c["vhost"] == vhost_of(amqp_url)
        }
        assert {"naming-test publishers", "naming-test consumers"} <= names, names
    finally:
        await broker.stop()


# --- Handlers whose publish the alarm holds back -------------------------------------------------


@pytest.fixture
def env(amqp_url: str, mongo: Endpoint, db_prefix: str) -> dict[str, str]:
    """The settings of a service started in-process on this module's vhost."""
    if not rabbitmqctl_available(amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    return {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "LLM_PROVIDER": "heuristic",
        "BROKER_TIMEOUT_S": "2",
    }


def _service_app(service: str, env: dict[str, str]) -> FastAPI:
    """One service, wired as in production, with its consumers on the module's vhost."""
    match service:
        case "scorer":
            return create_scorer(
                ScorerSettings.model_validate(env), ModelSettings.model_validate(env)
            )
        case "status":
            return create_status(StatusSettings.model_validate(env))
        case "notifier":
            return create_notifier(NotifierSettings.model_validate(env))
        case "scheduler":
            return create_scheduler(
                SchedulerSettings.model_validate(env), config=parse_config({"jobs": {}}, {})
            )
    raise ValueError(service)


@pytest.mark.parametrize(
    ("service", "work_queue"),
    [
        ("scorer", SCORE_REQUESTS),
        ("status", STATUS_PROJECTION),
        ("notifier", NOTIFICATIONS),
        ("notifier", WEBHOOK_DELIVERIES),
        ("scheduler", CRON_JOBS),
        ("scheduler", USAGE_METER),
    ],
    ids=lambda value: value if isinstance(value, str) else value.name,
)
async def test_a_handler_whose_publish_an_alarm_holds_back_settles_once_it_ends(
    amqp_url: str,
    env: dict[str, str],
    caplog: pytest.LogCaptureFixture,
    service: str,
    work_queue: WorkQueue,
) -> None:
    """An unreadable message is copied to its queue's DLQ, a publish the alarm blocks. The
    handler keeps trying while it holds the delivery, and settles it once the alarm ends:
    not left unacknowledged (holding a prefetch slot until its channel closes) and not
    requeued (which spins through the delivery limit on RabbitMQ 3.x, and without end on
    4.x, where a requeue is not counted)."""
    dlq = work_queue.dead_letter_routing_key
    await _purged(amqp_url, work_queue)
    await _put(amqp_url, work_queue, b"not json")
    caplog.set_level(logging.WARNING, logger="scorebox")
    async with memory_alarm(timeout_s=TIMEOUT_S) as alarm, running(_service_app(service, env)):
        await eventually(
            lambda: _true(_logged_failing(f"a dead letter of {work_queue.name}", caplog)),
            timeout_s=TIMEOUT_S * 3,
            what=f"the {service}'s dead letter of {work_queue.name} failing in the alarm",
        )
        await alarm.lift()
        await eventually(
            # Two copies when the publish the alarm held back went through as well.
            lambda: _depths(amqp_url, lambda d: d[work_queue.name] == 0 and d[dlq] >= 1),
            timeout_s=TIMEOUT_S * 3,
            what=f"{work_queue.name} settled and its message in the DLQ",
        )
    headers = await _dead_letter_headers(amqp_url, work_queue)
    assert "x-scorebox-error" in headers, headers
    assert headers.get("x-delivery-count", 0) == 0, f"requeued before it was settled: {headers}"


async def _purged(amqp_url: str, work_queue: WorkQueue) -> None:
    """The topology declared, and the queue and its DLQ emptied."""
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url})
    broker = make_broker(settings, name="alarm-test")
    async with broker:
        await broker.connect()
        await declare_topology(broker)
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        for name in (work_queue.name, work_queue.dead_letter_routing_key):
            queue = await channel.get_queue(name, ensure=False)
            await queue.purge(timeout=TIMEOUT_S)


async def _put(amqp_url: str, work_queue: WorkQueue, body: bytes, *, dlq: bool = False) -> None:
    """`body` into the work queue, or into its DLQ."""
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        await channel.default_exchange.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=work_queue.dead_letter_routing_key if dlq else work_queue.name,
            timeout=TIMEOUT_S,
        )


def _logged_failing(what: str, caplog: pytest.LogCaptureFixture) -> bool:
    """`keep_publishing` warned that publishing `what` did not go through and that it tries
    again (a handler that gave up instead never logs this)."""
    return any(
        record.name == "scorebox.runtime"
        and record.levelno == logging.WARNING
        and f"publishing {what} failed" in record.getMessage()
        for record in caplog.records
    )


async def _depths(amqp_url: str, holds: Callable[[dict[str, int]], bool]) -> bool:
    """Whether the queues' depths (ready and unacknowledged messages) satisfy `holds`."""
    listed = await rabbitmqctl(
        "list_queues", "-q", "-p", vhost_of(amqp_url), "name", "messages", "--formatter", "json"
    )
    return holds({queue["name"]: queue["messages"] for queue in json.loads(listed)})


async def _dead_letter_headers(amqp_url: str, work_queue: WorkQueue) -> dict[str, object]:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(work_queue.dead_letter_routing_key, ensure=False)
        message = await queue.get(timeout=TIMEOUT_S, fail=True)
        assert message is not None
        await message.ack()
        return dict(message.headers)


async def test_a_rescore_the_alarm_holds_back_goes_down_the_ladder_once_it_ends(
    amqp_url: str, env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway's re-score consumer owns its retry: a command the broker does not confirm
    sends the request down the wait ladder. When the alarm holds that publish back too, the
    consumer keeps trying while it holds the delivery; once the alarm ends the request comes
    back up the ladder and its command is queued."""
    settings = GatewaySettings.model_validate(env)
    for work_queue in (SCORE_REQUESTS, RESCORE_REQUESTS):
        await _purged(amqp_url, work_queue)
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(env["MONGO_URL"], tz_aware=True)
    try:
        command = await accepted_submission(Submissions(client, settings.database_name("gateway")))
    finally:
        await client.close()
    request = rescore_request(command)
    await _put(amqp_url, RESCORE_REQUESTS, request.model_dump_json().encode())
    caplog.set_level(logging.WARNING, logger="scorebox")
    async with memory_alarm(timeout_s=TIMEOUT_S) as alarm, running(create_gateway(settings)):
        await eventually(
            lambda: _true(_logged_failing(f"the re-score retry of {command.task_id}", caplog)),
            timeout_s=TIMEOUT_S * 3,
            what="the re-score's retry failing in the alarm",
        )
        await alarm.lift()
        await eventually(
            lambda: _depths(
                amqp_url,
                lambda d: d[SCORE_REQUESTS.name] >= 1 and d[RESCORE_REQUESTS.name] == 0,
            ),
            timeout_s=TIMEOUT_S * 3,
            what="the re-score request settled and its command queued",
        )
    assert await _depths(amqp_url, lambda d: d[RESCORE_REQUESTS.dead_letter_routing_key] == 0)


async def test_the_dead_letters_can_be_looked_at_and_purged_while_an_alarm_blocks_publishes(
    amqp_url: str, queue: tuple[aio_pika.abc.AbstractChannel, str]
) -> None:
    """A look at a DLQ (a listing, a replay's walk, the housekeeping's depth probe) and a
    purge went through the service's publishing connection, which a memory alarm blocks once
    the service has published: they waited out the alarm and answered 503, an operator's
    purge of a DLQ whose letters raised the alarm included. They use the consuming
    connection, which never publishes."""
    _, name = queue
    await _purged(amqp_url, SCORE_REQUESTS)
    await _put(amqp_url, SCORE_REQUESTS, b"a letter", dlq=True)
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url, "BROKER_TIMEOUT_S": "5"})
    broker = make_broker(settings, name="alarm-look-test")

    @consume(broker, RabbitQueue(name, durable=True))
    async def handle(delivery: Delivery) -> None:
        await delivery.ack()

    await broker.start()
    walker = DeadLetterWalker(broker, SCORE_REQUESTS, timeout_s=5)
    try:
        async with _a_publish_held_back(broker, amqp_url, name) as publishing:
            depth, _ = await SchedulerBus(broker, 5, utcnow).dead_letter_depth(SCORE_REQUESTS)
            assert depth == 1
            async with walker.walk() as held:
                assert [letter.body for letter in held] == [b"a letter"]
            assert await walker.purge() == 1
            assert not publishing.done()  # the publishing connection is still blocked
    finally:
        await broker.stop()
