"""Publishes of one message id in flight together are each confirmed or refused as their own,
on the real broker.

aiormq matches a `basic.return` to its publish by message id: of two unroutable publishes of
one id in flight at once, the first's return was charged to the second, and the first's
`basic.ack` then confirmed it, so `send_raw` reported a publish that reached no queue as
confirmed (found in review). Publishes of one id now go one at a time on a broker, the
wait counting towards the publish's timeout (past it, nothing was sent: a TimeoutError, not
"unconfirmed")."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest
from faststream.rabbit import ExchangeType, RabbitExchange

from shared import bus
from shared.bus import send_raw
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from tests.faults.slow_link import SlowLink
from tests.support import eventually

pytestmark = pytest.mark.integration

COPIES = 3


async def _send(
    broker: object, exchange: RabbitExchange, routing_key: str, *, timeout: float = 10
) -> None:
    await send_raw(
        broker,  # type: ignore[arg-type]
        b"{}",
        exchange=exchange,
        routing_key=routing_key,
        timeout=timeout,
        message_id="one-id",
        correlation_id=None,
        headers={},
    )


async def test_unroutable_publishes_of_one_id_in_flight_together_each_fail(
    amqp_url: str,
) -> None:
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    nowhere = RabbitExchange(f"test.nowhere.{uuid.uuid4().hex[:8]}", type=ExchangeType.DIRECT)
    try:
        outcomes = await asyncio.gather(
            *(_send(broker, nowhere, "no.binding") for _ in range(COPIES)),
            return_exceptions=True,
        )
    finally:
        await broker.stop()
    assert all(isinstance(outcome, Exception) for outcome in outcomes), outcomes


async def test_routable_publishes_of_one_id_in_flight_together_are_each_confirmed(
    amqp_url: str,
) -> None:
    name = f"test.same-id.{uuid.uuid4().hex[:8]}"
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        await channel.declare_queue(name)
        broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
        await broker.connect()
        direct = RabbitExchange("")
        try:
            await asyncio.gather(*(_send(broker, direct, name) for _ in range(COPIES)))
        finally:
            await broker.stop()
        declared = await channel.declare_queue(name, passive=True)
        assert declared.declaration_result.message_count == COPIES
        await channel.queue_delete(name)


def _settings(amqp_url: str, link: SlowLink) -> ServiceSettings:
    return ServiceSettings.model_validate({"RABBITMQ_URL": link.url_through(amqp_url)})


async def _queued(channel: aio_pika.abc.AbstractChannel, name: str) -> int:
    declared = await channel.declare_queue(name, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def test_a_publish_that_waited_out_its_timeout_for_its_id_was_not_sent(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """It waited its whole timeout, then took another for its publish; and what it raised
    said "may be queued; retrying may send it twice" of a message never written."""
    name = f"test.same-id.{uuid.uuid4().hex[:8]}"
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        await channel.declare_queue(name)
        settings = ServiceSettings.model_validate(
            {"RABBITMQ_URL": broker_link.url_through(amqp_url)}
        )
        broker = make_broker(settings)
        await broker.connect()
        direct = RabbitExchange("")
        try:
            broker_link.reply_delay_s = 2.0  # the first's confirm comes late
            first = asyncio.create_task(_send(broker, direct, name))

            async def first_in_flight() -> bool:
                return "one-id" in bus._IN_FLIGHT.get(broker, {})

            await eventually(first_in_flight, what="the first publish took its id")
            with pytest.raises(TimeoutError):
                await _send(broker, direct, name, timeout=0.5)
            await first
        finally:
            broker_link.reply_delay_s = 0
            await broker.stop()
        assert await _queued(channel, name) == 1  # the first's alone
        await channel.queue_delete(name)
