"""`queue_settled`, the scorer's wait at start for the cancels queued before its work
(`services/scorer/cancels.py`): it answers within its time whatever the broker does, its
looks never disturb the deliveries in hand, and each reads the queue anew. Reviews found it
raising out of the scorer's start when the connection dropped, closing the consumer's
channel when a look got no answer in time (the cancels in hand came back counted), waiting
unbounded for a connection gone before its look began, and reading the first look's count
for ever. Real broker, reached through a proxy to cut or slow.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aio_pika
import pytest
from faststream.rabbit import RabbitQueue

from services.scorer.cancels import queue_settled
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from tests.faults.slow_link import SlowLink
from tests.support import eventually

pytestmark = pytest.mark.integration

BROKER_TIMEOUT_S = 1.0
WITHIN_S = 1.0
# Only keeps a failing test from waiting for ever: `settled` answers within WITHIN_S.
GUARD_S = 20.0


@dataclass
class Held:
    """A consumer of a queue of its own holding its one delivery until `release`."""

    broker: ScoreboxBroker
    queue: str
    amqp_url: str
    release: asyncio.Event = field(default_factory=asyncio.Event)
    seen: list[bool] = field(default_factory=list)  # each delivery's redelivered flag


@pytest.fixture
async def held(amqp_url: str, broker_link: SlowLink) -> AsyncIterator[Held]:
    name = f"test.settled.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, timeout=10)
        settings = ServiceSettings.model_validate(
            {
                "RABBITMQ_URL": broker_link.url_through(amqp_url),
                "BROKER_TIMEOUT_S": str(BROKER_TIMEOUT_S),
            }
        )
        broker = make_broker(settings, graceful_timeout_s=2.0)
        held = Held(broker, name, amqp_url)

        @consume(broker, RabbitQueue(name, durable=True), prefetch=4)
        async def hold(delivery: Delivery) -> None:
            held.seen.append(delivery.redelivered)
            await held.release.wait()
            await delivery.ack()

        await broker.start()
        await channel.default_exchange.publish(aio_pika.Message(b"x"), routing_key=name)

        async def in_hand() -> bool:
            return held.seen == [False]

        await eventually(in_hand, what="the delivery in the handler")
        try:
            yield held
        finally:
            broker_link.down, broker_link.reply_delay_s = False, 0.0
            held.release.set()
            await asyncio.wait_for(broker.stop(), GUARD_S)
            await channel.queue_delete(name, timeout=10)


async def _settled(held: Held) -> bool:
    return await queue_settled(
        held.broker, held.queue, within_s=WITHIN_S, timeout_s=BROKER_TIMEOUT_S
    )


async def test_a_delivery_in_hand_is_not_settled_and_the_wait_ends_on_time(held: Held) -> None:
    assert not await asyncio.wait_for(_settled(held), GUARD_S)


@pytest.mark.parametrize("fault", ["cut", "slow"])
async def test_a_broker_cut_or_slow_answers_not_settled_and_keeps_the_delivery_in_hand(
    held: Held, broker_link: SlowLink, fault: str
) -> None:
    if fault == "cut":
        await broker_link.cut()
    else:
        broker_link.reply_delay_s = 3 * BROKER_TIMEOUT_S

    settled = await asyncio.wait_for(_settled(held), GUARD_S)
    broker_link.down, broker_link.reply_delay_s = False, 0.0
    held.release.set()

    assert not settled
    if fault == "slow":  # the connection stands: its delivery is acked, never sent again

        async def acked() -> bool:
            return await _settled(held)

        await eventually(acked, what="the delivery acked, the queue settled")
        assert held.seen == [False]


async def test_messages_ready_then_handled_settle(held: Held) -> None:
    """Messages ready behind the one in hand (the consumer's prefetch is full), then handled:
    settled. A look that kept aio-pika's copy of the queue read the first count for ever
    (a review: a start with more cancels queued than the prefetch never settled)."""
    connection = await aio_pika.connect(held.amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        for _ in range(6):
            await channel.default_exchange.publish(aio_pika.Message(b"x"), routing_key=held.queue)
    assert not await _settled(held)  # looked at with messages ready
    held.release.set()

    async def settled() -> bool:
        return await _settled(held)

    await eventually(settled, what="the queue settled once its messages were handled")
