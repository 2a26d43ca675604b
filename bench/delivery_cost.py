"""Consumer CPU per delivery: FastStream's subscriber, `shared.consumers` (as every service
consumes) and a bare aio-pika consumer, on the same queue and broker.

Each way drains `DELIVERIES` waiting messages with prefetch 64 and a manual ack per message;
the process's CPU time from the start of consuming to the last ack, per delivery. The ways
alternate `ROUNDS` times and the median of each is reported (the machine may be shared).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from faststream import AckPolicy
from faststream.rabbit import RabbitBroker, RabbitQueue
from faststream.rabbit.message import RabbitMessage
from faststream.rabbit.schemas import Channel

from bench.procstat import cpu_seconds
from bench.stats import alternating_medians
from shared.consumers import Delivery, ScoreboxBroker, consume

DELIVERIES = 5_000
PREFETCH = 64
ROUNDS = 3
_QUIET: dict[str, Any] = {
    "logger": logging.getLogger("bench.broker"),
    "log_level": logging.DEBUG,
    "apply_types": False,
}
BODY = b'{"task_id": "0123456789abcdef0123456789abcdef", "sequence": 1, "status": "completed"}'


async def _fill(url: str, queue_name: str) -> None:
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue_name, auto_delete=True, durable=True)
        for _ in range(DELIVERIES):
            message = aio_pika.Message(BODY, headers={"x-tenant-id": "bench"})
            await channel.default_exchange.publish(message, routing_key=queue_name)


BrokerMeter = tuple[int, list[float]]  # the broker's pid, and where its µs per delivery go


async def _cpu_us_per_delivery(
    start: Callable[[asyncio.Event], Awaitable[None]], broker: BrokerMeter | None = None
) -> float:
    drained = asyncio.Event()
    broker_started = cpu_seconds(broker[0]) if broker else None
    started = time.process_time()
    await start(drained)
    await asyncio.wait_for(drained.wait(), timeout=120)
    spent = time.process_time() - started
    broker_spent = cpu_seconds(broker[0]) if broker else None
    if broker and broker_started is not None and broker_spent is not None:
        broker[1].append((broker_spent - broker_started) / DELIVERIES * 1e6)
    return spent / DELIVERIES * 1e6


def _counter(drained: asyncio.Event) -> Callable[[], None]:
    count = 0

    def one_more() -> None:
        nonlocal count
        count += 1
        if count == DELIVERIES:
            drained.set()

    return one_more


def _fresh_queue() -> RabbitQueue:
    # Durable: RabbitMQ 4.3 refuses transient queues that are not exclusive, and these are
    # filled on one connection and drained on another.
    return RabbitQueue(f"bench.delivery.{uuid.uuid4().hex[:8]}", durable=True, auto_delete=True)


async def through_faststream(url: str) -> float:
    """FastStream's own subscriber, as the services consumed until `shared.consumers`: the
    body passed through undecoded, the message read from the broker's context."""
    queue = _fresh_queue()
    await _fill(url, queue.name)
    broker = RabbitBroker(url, default_channel=Channel(prefetch_count=PREFETCH), **_QUIET)

    async def body_as_is(message: RabbitMessage) -> bytes:
        return message.body

    async def start(drained: asyncio.Event) -> None:
        counted = _counter(drained)

        async def handle(body: bytes) -> None:
            await broker.context.get_local("message").ack()
            counted()

        broker.subscriber(queue, ack_policy=AckPolicy.MANUAL, decoder=body_as_is)(handle)
        await broker.start()

    try:
        return await _cpu_us_per_delivery(start)
    finally:
        await broker.stop()


async def through_scorebox(url: str, broker_meter: BrokerMeter | None = None) -> float:
    """`shared.consumers.consume`, as every service consumes (acks coalesced per loop pass)."""
    queue = _fresh_queue()
    await _fill(url, queue.name)
    broker = ScoreboxBroker(
        url,
        default_channel=Channel(prefetch_count=PREFETCH),
        graceful_timeout=10,
        timeout=10,
        **_QUIET,
    )

    async def start(drained: asyncio.Event) -> None:
        counted = _counter(drained)

        @consume(broker, queue)
        async def handle(delivery: Delivery) -> None:
            await delivery.ack()
            counted()

        await broker.start()

    try:
        return await _cpu_us_per_delivery(start, broker_meter)
    finally:
        await broker.stop()


async def bare_aio_pika(url: str, broker_meter: BrokerMeter | None = None) -> float:
    """A bare aio-pika consumer acking each delivery with a frame of its own."""
    name = _fresh_queue().name
    await _fill(url, name)
    connection = await aio_pika.connect_robust(url, timeout=10)

    async def start(drained: asyncio.Event) -> None:
        counted = _counter(drained)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        queue = await channel.declare_queue(name, durable=True, auto_delete=True)

        async def handle(message: AbstractIncomingMessage) -> None:
            await message.ack()
            counted()

        await queue.consume(handle)

    try:
        return await _cpu_us_per_delivery(start, broker_meter)
    finally:
        await connection.close()


async def delivery_cost(url: str, broker_pid: int | None = None) -> None:
    """Print the consumer's CPU per delivery each way, and the broker's where `broker_pid`
    names the local node (its acknowledgements differ: one per loop pass, or one each)."""
    broker_scorebox: list[float] = []
    broker_bare: list[float] = []
    faststream, scorebox, bare = await alternating_medians(
        ROUNDS,
        lambda: through_faststream(url),
        lambda: through_scorebox(url, (broker_pid, broker_scorebox) if broker_pid else None),
        lambda: bare_aio_pika(url, (broker_pid, broker_bare) if broker_pid else None),
    )
    print(
        f"consumer CPU per delivery (manual ack, prefetch {PREFETCH}), median of {ROUNDS}: "
        f"FastStream's subscriber {faststream:.0f} µs, shared.consumers {scorebox:.0f} µs, "
        f"bare aio-pika {bare:.0f} µs"
    )
    if broker_scorebox and broker_bare:
        print(
            f"broker CPU per delivery, median of {ROUNDS}: shared.consumers "
            f"{statistics.median(broker_scorebox):.0f} µs, bare aio-pika "
            f"{statistics.median(broker_bare):.0f} µs"
        )
