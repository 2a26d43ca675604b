"""`shared.metrics` on the real broker: deliveries are counted by how their handler left them,
publishes by what the broker answered."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import aio_pika
import aiormq
import pytest
from faststream.rabbit import RabbitQueue

from shared.bus import publish_command
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import TASKS
from tests import support
from tests.support import eventually

pytestmark = pytest.mark.integration

TIMEOUT_S = 10.0


def sample(broker: ScoreboxBroker, name: str, labels: dict[str, str]) -> float:
    return support.sample(broker.metrics.registry, name, **labels)


@pytest.fixture
async def queue_name(amqp_url: str) -> AsyncIterator[str]:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        name = f"test.metrics.{uuid.uuid4().hex[:8]}"
        await channel.declare_queue(name, durable=True, timeout=TIMEOUT_S)
        for body in (b"ack", b"nack", b"reject", b"requeue-once", b"keep", b"bug"):
            await channel.default_exchange.publish(
                aio_pika.Message(body), routing_key=name, timeout=TIMEOUT_S
            )
        yield name
        await channel.queue_delete(name, timeout=TIMEOUT_S)


async def test_deliveries_are_counted_by_how_their_handler_left_them(
    amqp_url: str, queue_name: str
) -> None:
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    handled: list[bytes] = []

    @consume(broker, RabbitQueue(queue_name, durable=True, declare=False))
    async def handle(delivery: Delivery) -> None:
        handled.append(delivery.body)
        match delivery.body:
            case b"ack":
                await delivery.ack()
            case b"nack":
                await delivery.nack(requeue=False)
            case b"reject":
                await delivery.reject()
            case b"requeue-once" if not delivery.redelivered:
                await delivery.requeue_failed()
            case b"requeue-once":
                await delivery.ack()
            case b"bug":
                raise RuntimeError("a bug")
            case _:
                pass  # left for the broker to redeliver

    await broker.start()
    try:
        await eventually(
            lambda: _true(len(handled) == 7), timeout_s=TIMEOUT_S, what="seven deliveries"
        )
    finally:
        await broker.stop()
    counted = {
        settled: sample(
            broker, "scorebox_deliveries_total", {"queue": queue_name, "settled": settled}
        )
        for settled in ("ack", "nack", "reject", "requeue", "unsettled", "failed")
    }
    assert counted == {
        "ack": 2,
        "nack": 1,
        "reject": 1,
        "requeue": 1,
        "unsettled": 1,
        "failed": 1,
    }
    timed = sample(broker, "scorebox_delivery_handling_seconds_count", {"queue": queue_name})
    assert timed == 7


async def test_a_replicas_own_queue_is_counted_under_the_label_it_is_given(
    amqp_url: str, queue_name: str
) -> None:
    """A gateway replica's live queue is named after the replica: by its name, every process
    started would leave a series of its own behind."""
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    handled: list[bytes] = []

    @consume(broker, RabbitQueue(queue_name, durable=True, declare=False), metric_label="own")
    async def handle(delivery: Delivery) -> None:
        handled.append(delivery.body)
        await delivery.ack()

    await broker.start()
    try:
        await eventually(lambda: _true(len(handled) == 6), timeout_s=TIMEOUT_S, what="six")
    finally:
        await broker.stop()
    assert sample(broker, "scorebox_deliveries_total", {"queue": "own", "settled": "ack"}) == 6
    exposition = broker.metrics.exposition().decode()
    assert queue_name not in exposition


async def test_publishes_are_counted_by_what_the_broker_answered(amqp_url: str) -> None:
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.start()
    try:
        await broker.declare_exchange(TASKS)
        command = ScoreText(task_id=new_id(), tenant_id="acme", text="An essay.")
        # No queue is bound in this vhost yet: the broker returns the message.
        with pytest.raises(aiormq.exceptions.DeliveryError):
            await publish_command(broker, command, now=utcnow(), timeout=TIMEOUT_S)
        queue = await broker.declare_queue(
            RabbitQueue(f"test.metrics.{uuid.uuid4().hex[:8]}", exclusive=True)
        )
        await queue.bind(TASKS.name, routing_key=command.routing_key)
        await publish_command(broker, command, now=utcnow(), timeout=TIMEOUT_S)
    finally:
        await broker.stop()
    outcomes = {
        outcome: sample(
            broker, "scorebox_publishes_total", {"exchange": TASKS.name, "outcome": outcome}
        )
        for outcome in ("confirmed", "not_sent", "unconfirmed")
    }
    assert outcomes == {"confirmed": 1, "not_sent": 1, "unconfirmed": 0}


async def _true(value: bool) -> bool:
    return value
