"""A stop lets the deliveries in hand finish when the broker is slow to answer, on the real
broker reached through a link that holds its replies.

The stop cancels each consumer with a bounded `basic.cancel`; bounded by aiormq's own timeout,
an RPC that ran out closed its channel (aiormq sends `Channel.Close` 504 after a timed-out or
cancelled RPC), and the delivery in hand, finished within the stop's grace, could not be
acked: it went back to its queue, counted (found in review). The cancel is now bounded by the
stop itself and left running when the broker has not answered."""

from __future__ import annotations

import asyncio
import logging
import uuid

import aio_pika
import pytest
from faststream.rabbit import RabbitQueue

from shared.consumers import Delivery, consume
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from tests.faults.slow_link import SlowLink
from tests.support import eventually

pytestmark = pytest.mark.integration

BROKER_TIMEOUT_S = 1.0


async def _ready_in(channel: aio_pika.abc.AbstractChannel, name: str) -> int:
    declared = await channel.declare_queue(name, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def test_a_delivery_in_hand_is_acked_though_the_broker_answers_the_cancel_late(
    amqp_url: str, broker_link: SlowLink, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"test.stop.{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING, logger="scorebox")
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True)
        settings = ServiceSettings.model_validate(
            {
                "RABBITMQ_URL": broker_link.url_through(amqp_url),
                "BROKER_TIMEOUT_S": str(BROKER_TIMEOUT_S),
            }
        )
        broker = make_broker(settings, graceful_timeout_s=30.0)
        in_hand, release = asyncio.Event(), asyncio.Event()

        @consume(broker, RabbitQueue(name, durable=True))
        async def handle(delivery: Delivery) -> None:
            in_hand.set()
            await release.wait()
            await delivery.ack()

        await broker.start()
        await channel.default_exchange.publish(aio_pika.Message(b"work"), routing_key=name)
        await asyncio.wait_for(in_hand.wait(), 10)
        broker_link.reply_delay_s = 3 * BROKER_TIMEOUT_S  # slow, not gone
        stopping = asyncio.create_task(broker.stop())

        async def cancel_overran() -> bool:
            return any("cancel" in record.getMessage() for record in caplog.records)

        await eventually(cancel_overran, what="the consumer's cancel outlasted its bound")
        release.set()  # the handler finishes well within the stop's grace
        await asyncio.wait_for(stopping, 60)
        broker_link.reply_delay_s = 0.0

        async def acked() -> bool:
            return await _ready_in(channel, name) == 0

        await eventually(acked, timeout_s=10, what="the delivery finished in the grace acked")
        assert not any("not sent" in record.getMessage() for record in caplog.records)
        await channel.queue_delete(name)
