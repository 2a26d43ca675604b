"""Publishes of one message id in flight together are each confirmed or refused as their own,
on the real broker.

aiormq matches a `basic.return` to its publish by message id: of two unroutable publishes of
one id in flight at once, the first's return was charged to the second, and the first's
`basic.ack` then confirmed it, so `send_raw` reported a publish that reached no queue as
confirmed (found in review). Publishes of one id now go one at a time on a broker."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest
from faststream.rabbit import ExchangeType, RabbitExchange

from shared.bus import send_raw
from shared.runtime import make_broker
from shared.settings import ServiceSettings

pytestmark = pytest.mark.integration

COPIES = 3


async def _send(broker: object, exchange: RabbitExchange, routing_key: str) -> None:
    await send_raw(
        broker,  # type: ignore[arg-type]
        b"{}",
        exchange=exchange,
        routing_key=routing_key,
        timeout=10,
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
