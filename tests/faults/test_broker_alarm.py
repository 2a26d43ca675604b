"""A memory alarm on the broker blocks every connection that publishes; consumers go on.

RabbitMQ stops reading a connection that published while an alarm lasts, acknowledgements
included. A service's consumers therefore use a connection of their own
(`shared.consumers`): a service whose publishes are blocked still settles the deliveries it
handles, so its queues keep draining. The alarm is real: the broker's memory watermark is set
below what it uses (`rabbitmqctl set_vm_memory_high_watermark`) for the few seconds the test
takes, then restored to what it was.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest
from faststream.rabbit import RabbitQueue

from shared.consumers import Delivery, consume
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from tests.faults.harness import rabbitmqctl, rabbitmqctl_available, vhost_of
from tests.support import eventually

TIMEOUT_S = 10.0
MESSAGES = 10
PREFETCH = 2
ALARMING_WATERMARK = "0.0001"  # a fraction of the machine's memory far below what it uses


async def _status() -> dict[str, object]:
    status: dict[str, object] = json.loads(await rabbitmqctl("status", "--formatter", "json"))
    return status


async def _watermark_args() -> list[str]:
    """The `set_vm_memory_high_watermark` arguments that restore the current setting."""
    setting = await _status()
    value = setting["vm_memory_high_watermark_setting"]
    assert isinstance(value, dict)
    if "relative" in value:
        return [str(value["relative"])]
    return ["absolute", str(value["absolute"])]


async def _memory_alarm() -> bool:
    alarms = (await _status())["alarms"]
    assert isinstance(alarms, list)
    return any(alarm.get("resource") == "memory" for alarm in alarms)


async def _no_memory_alarm() -> bool:
    return not await _memory_alarm()


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
    restore = await _watermark_args()
    publishing: asyncio.Task[object] | None = None
    try:
        await rabbitmqctl("set_vm_memory_high_watermark", ALARMING_WATERMARK)
        await eventually(_memory_alarm, timeout_s=TIMEOUT_S, what="a memory alarm")
        publishing = asyncio.create_task(broker.publish(b"during the alarm", queue=name))
        await eventually(
            lambda: _a_connection_blocked(amqp_url), timeout_s=TIMEOUT_S, what="a blocked publish"
        )
        publishes_blocked.set()

        await eventually(
            lambda: _true(len(handled) == MESSAGES),
            timeout_s=TIMEOUT_S,
            what=f"all {MESSAGES} deliveries handled and acknowledged during the alarm "
            f"(prefetch {PREFETCH}: without acknowledgements only {PREFETCH} arrive)",
        )
        assert not publishing.done()  # the publish is still held back by the alarm
    finally:
        await rabbitmqctl("set_vm_memory_high_watermark", *restore)
        await eventually(_no_memory_alarm, timeout_s=TIMEOUT_S, what="the alarm cleared")
        if publishing is not None:
            await asyncio.wait_for(publishing, TIMEOUT_S)  # goes through once unblocked
        await broker.stop()


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
