"""Publisher CPU per confirmed message: FastStream's `broker.publish` against bare aio-pika
(which `shared.bus` uses), both with the options of every Scorebox publish (persistent,
mandatory, headers, awaiting the confirm), on the same broker.

Each way publishes `MESSAGES` messages to a fresh queue with `IN_FLIGHT` publishes (and
so confirms) outstanding, as a busy service has; the process's CPU time per message. The
ways alternate `ROUNDS` times and the median of each is reported.
"""

from __future__ import annotations

import uuid

import aio_pika
from aiormq.abc import FieldValue
from faststream.rabbit import RabbitBroker, RabbitQueue
from faststream.rabbit.schemas import Channel

from bench.stats import cpu_us_each, faststream_against_bare

MESSAGES = 4_000
IN_FLIGHT = 64
ROUNDS = 3
TIMEOUT_S = 10.0
BODY = (
    b'{"task_id":"0123456789abcdef0123456789abcdef","tenant_id":"bench","sequence":2,'
    b'"attempt":1,"generation":0,"submitted_at":"2026-12-01T00:00:00Z"}'
)
HEADERS: dict[str, FieldValue] = {
    "x-tenant-id": "bench",
    "x-schema-version": 2,
    "x-message-type": "TaskStarted",
}


async def through_faststream(url: str) -> float:
    queue = f"bench.publish.{uuid.uuid4().hex[:8]}"
    broker = RabbitBroker(
        url, default_channel=Channel(publisher_confirms=True, on_return_raises=True)
    )
    await broker.connect()
    declared = await broker.declare_queue(RabbitQueue(queue, durable=True, auto_delete=True))
    try:

        async def publish(i: int) -> None:
            await broker.publish(
                BODY,
                queue=queue,
                persist=True,
                mandatory=True,
                timeout=TIMEOUT_S,
                message_id=f"m{i}",
                correlation_id="0123456789abcdef0123456789abcdef",
                content_type="application/json",
                headers=HEADERS,
            )

        return await cpu_us_each(MESSAGES, IN_FLIGHT, publish)
    finally:
        await declared.delete(if_unused=False, if_empty=False)
        await broker.stop()


async def bare_aio_pika(url: str) -> float:
    queue = f"bench.publish.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect_robust(url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        declared = await channel.declare_queue(queue, durable=True, auto_delete=True)

        async def publish(i: int) -> None:
            message = aio_pika.Message(
                BODY,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=f"m{i}",
                correlation_id="0123456789abcdef0123456789abcdef",
                content_type="application/json",
                headers=HEADERS,
            )
            await channel.default_exchange.publish(
                message, routing_key=queue, mandatory=True, timeout=TIMEOUT_S
            )

        try:
            return await cpu_us_each(MESSAGES, IN_FLIGHT, publish)
        finally:
            await declared.delete(if_unused=False, if_empty=False)


async def publish_cost(url: str) -> None:
    what = f"publisher CPU per confirmed message ({IN_FLIGHT} in flight)"
    await faststream_against_bare(what, url, (through_faststream, bare_aio_pika), rounds=ROUNDS)
