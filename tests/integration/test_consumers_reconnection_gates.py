"""A consumer that starts after something (`consume(..., starts_after=...)`) waits for it
again after its connection comes back: aio-pika restored every consumer at once, so the
scorer's work was delivered alongside the cancellations queued while the connection was
down, and a task whose cancel came after its claim was scored (`shared.reconnection_gates`).
Real broker, reached through a proxy that cuts the connection.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aio_pika
import pytest
from faststream.rabbit import ExchangeType, RabbitExchange, RabbitQueue

from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import Binding
from tests.faults.slow_link import SlowLink
from tests.support import eventually

pytestmark = pytest.mark.integration

GUARD_S = 20.0


@dataclass
class Gated:
    """A consumer of `queue` that starts after `wait_for`: at once at start, and after a
    reconnection only once `release` is set."""

    broker: ScoreboxBroker
    queue: str
    link: SlowLink
    release: asyncio.Event = field(default_factory=asyncio.Event)
    waits: int = 0
    heard: list[bytes] = field(default_factory=list)

    async def wait_for(self) -> None:
        self.waits += 1
        if self.waits > 1:
            await self.release.wait()


@pytest.fixture
async def gated(amqp_url: str, broker_link: SlowLink) -> AsyncIterator[Gated]:
    name = f"test.gated.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, timeout=10)
        settings = ServiceSettings.model_validate(
            {"RABBITMQ_URL": broker_link.url_through(amqp_url), "BROKER_TIMEOUT_S": "2"}
        )
        broker = make_broker(settings, graceful_timeout_s=2.0)
        gated = Gated(broker, name, broker_link)

        @consume(broker, RabbitQueue(name, durable=True), starts_after=gated.wait_for)
        async def hear(delivery: Delivery) -> None:
            gated.heard.append(delivery.body)
            await delivery.ack()

        await broker.start()
        try:
            yield gated
        finally:
            broker_link.down = False
            gated.release.set()
            await asyncio.wait_for(broker.stop(), GUARD_S)
            await channel.queue_delete(name, timeout=10)


async def _reconnected(gated: Gated) -> None:
    await gated.link.cut()
    await eventually(lambda: _not(gated.broker.ping(1.0)), what="the connection lost")
    gated.link.down = False

    async def waiting_again() -> bool:
        return gated.waits == 2

    await eventually(waiting_again, what="what it starts after run again", timeout_s=GUARD_S)


async def _publish(amqp_url: str, queue: str, body: bytes) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.default_exchange.publish(aio_pika.Message(body), routing_key=queue)


async def test_after_a_reconnection_deliveries_wait_for_what_the_consumer_starts_after(
    gated: Gated, amqp_url: str
) -> None:
    assert gated.waits == 1  # at start
    await _reconnected(gated)
    await _publish(amqp_url, gated.queue, b"after")

    async def held_in_hand() -> bool:
        return gated.broker.in_handlers(gated.queue) == 1

    await eventually(held_in_hand, what="the delivery in hand", timeout_s=GUARD_S)
    assert gated.heard == []  # held at the gate, not handled

    gated.release.set()

    async def handled() -> bool:
        return gated.heard == [b"after"]

    await eventually(handled, what="handled once what it waits for is done")


async def test_a_stop_during_the_wait_lets_the_delivery_in_hand_through(
    gated: Gated, amqp_url: str
) -> None:
    await _reconnected(gated)
    await _publish(amqp_url, gated.queue, b"held")

    async def held_in_hand() -> bool:
        return gated.broker.in_handlers(gated.queue) == 1

    await eventually(held_in_hand, what="the delivery in hand", timeout_s=GUARD_S)

    await asyncio.wait_for(gated.broker.stop_consuming(), GUARD_S)

    async def handled() -> bool:
        return gated.heard == [b"held"]

    await eventually(handled, what="handled as the stop lets it")


async def test_the_gate_waits_for_the_own_queues_connection_too(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """A replica's own queue (the scorer's batch cancellations) is on a connection of its
    own, back seconds after the consuming one: the gate opened without it, and what was
    announced before its queue was bound again was heard by no one (a review)."""
    work, own = f"test.work.{uuid.uuid4().hex[:8]}", f"test.own.{uuid.uuid4().hex[:8]}"
    fanout = RabbitExchange(f"test.ann.{uuid.uuid4().hex[:8]}", type=ExchangeType.FANOUT)
    settings = ServiceSettings.model_validate(
        {"RABBITMQ_URL": broker_link.url_through(amqp_url), "BROKER_TIMEOUT_S": "2"}
    )
    broker = make_broker(settings, graceful_timeout_s=2.0)
    own_up_at_each_run: list[bool] = []
    heard: list[bytes] = []

    async def starts_after() -> None:
        connection = broker.own_queues_connection
        own_up_at_each_run.append(connection is not None and connection.connected.is_set())

    @consume(broker, RabbitQueue(work, durable=True), starts_after=starts_after)
    async def on_work(delivery: Delivery) -> None:
        await delivery.ack()

    @consume(
        broker,
        RabbitQueue(own, exclusive=True, auto_delete=True),
        ack_first=True,
        bindings=(Binding(fanout),),
    )
    async def on_own(delivery: Delivery) -> None:
        heard.append(delivery.body)

    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(work, durable=True, timeout=10)
        exchange = await channel.declare_exchange(fanout.name, type="fanout", timeout=10)
        await broker.start()
        try:
            await broker_link.cut()
            await eventually(lambda: _not(broker.ping(1.0)), what="the connection lost")
            broker_link.down = False
            await eventually(
                lambda: _true(len(own_up_at_each_run) == 2), what="run again", timeout_s=GUARD_S
            )
            await exchange.publish(aio_pika.Message(b"announced"), routing_key="", timeout=10)

            assert own_up_at_each_run == [True, True]
            await eventually(lambda: _true(heard == [b"announced"]), what="heard on its own queue")
        finally:
            broker_link.down = False
            await asyncio.wait_for(broker.stop(), GUARD_S)
            await channel.queue_delete(work, timeout=10)
            await exchange.delete(timeout=10)


async def _true(value: bool) -> bool:
    return value


async def _not(check: asyncio.Future[bool] | object) -> bool:
    assert asyncio.iscoroutine(check)
    return not await check
