"""The wait ladder on the real broker: a delay takes the tier it asked for, and an event a
consumer sends itself again reaches that consumer alone, however late its publish is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import aio_pika
import pytest
from faststream.rabbit import RabbitBroker

from services.notifier.consumer import _come_back_later
from shared.bus import publish_delayed
from shared.contracts import Contract, TaskAccepted, TaskError, TaskFailed, new_id, utcnow
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import (
    EVENTS,
    GATEWAY_TASK_OUTCOMES,
    NOTIFICATIONS,
    STATUS_PROJECTION,
    USAGE_METER,
    declare_topology,
)
from tests.support import eventually


@pytest.fixture
async def broker(amqp_url: str) -> AsyncIterator[RabbitBroker]:
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        yield broker


async def _depth(amqp_url: str, queue: str) -> int:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True, timeout=10)
        return int(declared.declaration_result.message_count or 0)


async def _purge(amqp_url: str, *queues: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        for name in queues:
            await (await channel.get_queue(name, ensure=True)).purge(timeout=10)


def _failed() -> TaskFailed:
    return TaskFailed(
        task_id=new_id(),
        sequence=190,
        attempt=1,
        submitted_at=utcnow(),
        error=TaskError(code="input_rejected", message="no", retryable=False),
        dead_lettered=False,
    )


def _accepted() -> TaskAccepted:
    return TaskAccepted(
        task_id=new_id(),
        sequence=0,
        submitted_at=utcnow(),
        callback_url="https://example.com/hook",
    )


async def test_a_delay_of_five_seconds_from_now_waits_five_seconds(
    broker: RabbitBroker, amqp_url: str
) -> None:
    """Read a moment after "5 s from now" was computed, the delay was 4.9999 s and took the
    1 s tier: the notifier's and the usage meter's retries came back 4 s early."""
    await publish_delayed(
        broker,
        _failed(),
        exchange=EVENTS,
        routing_key="task.failed",
        not_before=utcnow() + timedelta(seconds=5),
        now=utcnow(),
        timeout=10,
    )
    assert await _depth(amqp_url, "scorebox.wait.5s") == 1
    assert await _depth(amqp_url, "scorebox.wait.1s") == 0


@pytest.mark.parametrize(
    ("event", "routing_key"), [(_failed(), "task.failed"), (_accepted(), "task.accepted")]
)
async def test_an_event_sent_again_late_reaches_its_consumer_alone(
    broker: RabbitBroker, amqp_url: str, event: Contract, routing_key: str
) -> None:
    """The notifier's database retry, published again after its delay had passed (the first
    publish unconfirmed for longer than the delay), went straight to `scorebox.events`: every
    consumer of outcomes got the event a second time. An acceptance (which an earlier
    version's binding still brings the notifier) was dropped at the end of its wait: nothing
    in `scorebox.due` took its key (found in review)."""
    others = (STATUS_PROJECTION.name, GATEWAY_TASK_OUTCOMES.name, USAGE_METER.name)
    await _purge(amqp_url, NOTIFICATIONS.name, *others)
    long_ago = utcnow() - timedelta(seconds=6)
    await _come_back_later(broker, event, routing_key, clock=lambda: long_ago, timeout_s=10)

    async def arrived() -> bool:
        return await _depth(amqp_url, NOTIFICATIONS.name) == 1

    await eventually(arrived, what="the event back in the notifications queue")
    for queue in others:
        assert await _depth(amqp_url, queue) == 0, queue
