"""`shared.consumers` on the real broker: deliveries reach plain handlers, the handler settles
them, prefetch bounds what is in hand, a failed handler leaves its message for redelivery, a
message returned as failed is dead-lettered at the delivery limit, and stopping lets the
deliveries in hand finish."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable

import aio_pika
import aiormq
import pytest
from faststream.rabbit import QueueType, RabbitQueue
from faststream.rabbit.schemas.queue import QuorumQueueArgs

from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from tests.support import eventually

pytestmark = pytest.mark.integration

TIMEOUT_S = 10.0


class Queue:
    """A durable queue of the test's own, filled and inspected over a connection of its own."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel, name: str) -> None:
        self.channel = channel
        self.name = name
        self.declared = RabbitQueue(name, durable=True)

    async def put(self, *bodies: bytes) -> None:
        for body in bodies:
            message = aio_pika.Message(body, message_id=body.decode(), correlation_id="c-1")
            await self.channel.default_exchange.publish(
                message, routing_key=self.name, timeout=TIMEOUT_S
            )

    async def ready(self) -> int:
        """Messages waiting to be delivered (not those delivered and unacknowledged)."""
        count = (await self._declared()).message_count
        assert count is not None
        return count

    async def consumers(self) -> int:
        count = (await self._declared()).consumer_count
        assert count is not None
        return count

    async def _declared(self) -> aiormq.spec.Queue.DeclareOk:
        queue = await self.channel.declare_queue(self.name, passive=True, timeout=TIMEOUT_S)
        return queue.declaration_result


@pytest.fixture
async def queue(amqp_url: str) -> AsyncIterator[Queue]:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        name = f"test.consumers.{uuid.uuid4().hex[:8]}"
        await channel.declare_queue(name, durable=True, timeout=TIMEOUT_S)
        yield Queue(channel, name)
        await channel.queue_delete(name, timeout=TIMEOUT_S)


def new_broker(amqp_url: str) -> ScoreboxBroker:
    return make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))


async def test_a_delivery_reaches_its_handler_with_what_it_carries(
    amqp_url: str, queue: Queue
) -> None:
    broker = new_broker(amqp_url)
    seen: list[tuple[bytes, str | None, str | None, str, bool]] = []

    @consume(broker, queue.declared)
    async def handle(delivery: Delivery) -> None:
        seen.append(
            (
                delivery.body,
                delivery.message_id,
                delivery.correlation_id,
                delivery.routing_key,
                delivery.redelivered,
            )
        )
        await delivery.ack()

    await queue.put(b"one")
    await broker.start()
    try:
        await eventually(lambda: _true(len(seen) == 1), timeout_s=TIMEOUT_S, what="delivery")
        assert seen == [(b"one", "one", "c-1", queue.name, False)]
        assert await queue.ready() == 0
    finally:
        await broker.stop()
    assert await queue.ready() == 0  # acked: not redelivered once the consumer is gone


async def test_settling_twice_is_a_no_op(amqp_url: str, queue: Queue) -> None:
    """A second ack (or a nack after an ack) must not reach the broker: an unknown delivery
    tag closes the channel, and with it every delivery in hand."""
    broker = new_broker(amqp_url)
    handled: list[bytes] = []

    @consume(broker, queue.declared)
    async def handle(delivery: Delivery) -> None:
        await delivery.ack()
        await delivery.ack()
        await delivery.nack(requeue=True)
        await delivery.reject()
        handled.append(delivery.body)

    await broker.start()
    try:
        await queue.put(b"first", b"second")
        await eventually(lambda: _true(len(handled) == 2), timeout_s=TIMEOUT_S, what="both")
        await queue.put(b"third")  # the channel is still open: it is delivered too
        await eventually(lambda: _true(len(handled) == 3), timeout_s=TIMEOUT_S, what="third")
    finally:
        await broker.stop()
    assert handled == [b"first", b"second", b"third"]


async def test_prefetch_bounds_the_deliveries_in_hand(amqp_url: str, queue: Queue) -> None:
    broker = new_broker(amqp_url)
    release = asyncio.Event()
    in_hand: list[bytes] = []

    @consume(broker, queue.declared, prefetch=2)
    async def handle(delivery: Delivery) -> None:
        in_hand.append(delivery.body)
        await release.wait()
        await delivery.ack()

    await queue.put(b"1", b"2", b"3", b"4", b"5")
    await broker.start()
    try:
        # Two in hand and three still waiting: the broker sends no more than the prefetch.
        async def two_in_hand_three_waiting() -> bool:
            return len(in_hand) == 2 and await queue.ready() == 3

        await eventually(two_in_hand_three_waiting, timeout_s=TIMEOUT_S, what="prefetch 2")
        release.set()
        await eventually(lambda: _true(len(in_hand) == 5), timeout_s=TIMEOUT_S, what="all")
    finally:
        release.set()
        await broker.stop()


async def test_a_handler_that_raises_leaves_its_message_for_redelivery(
    amqp_url: str, queue: Queue
) -> None:
    first = new_broker(amqp_url)
    failed: list[bytes] = []

    @consume(first, queue.declared)
    async def fail(delivery: Delivery) -> None:
        failed.append(delivery.body)
        raise RuntimeError("a bug")

    await queue.put(b"poisoned")
    await first.start()
    try:
        await eventually(lambda: _true(failed == [b"poisoned"]), timeout_s=TIMEOUT_S, what="fail")
        assert await queue.ready() == 0  # in hand, unsettled: neither requeued nor dropped
    finally:
        await first.stop()
    assert failed == [b"poisoned"]  # delivered once: not requeued to spin on the same bug

    second = new_broker(amqp_url)
    redelivered: list[tuple[bytes, bool]] = []

    @consume(second, queue.declared)
    async def handle(delivery: Delivery) -> None:
        redelivered.append((delivery.body, delivery.redelivered))
        await delivery.ack()

    await second.start()
    try:
        await eventually(lambda: _true(len(redelivered) == 1), timeout_s=TIMEOUT_S, what="again")
    finally:
        await second.stop()
    assert redelivered == [(b"poisoned", True)]


async def test_stopping_lets_the_deliveries_in_hand_finish(amqp_url: str, queue: Queue) -> None:
    broker = new_broker(amqp_url)
    started = asyncio.Event()
    release = asyncio.Event()
    finished: list[bytes] = []

    @consume(broker, queue.declared)
    async def handle(delivery: Delivery) -> None:
        started.set()
        await release.wait()
        await delivery.ack()
        finished.append(delivery.body)

    await queue.put(b"slow")
    await broker.start()
    await asyncio.wait_for(started.wait(), TIMEOUT_S)
    stopping = asyncio.create_task(broker.stop())
    # Stopping cancels the consumer first; what arrives afterwards is not delivered here.
    await eventually(lambda: _true_async(queue.consumers(), 0), timeout_s=TIMEOUT_S)
    await queue.put(b"after-stop")
    assert not stopping.done()  # still waiting for "slow"
    release.set()
    await asyncio.wait_for(stopping, TIMEOUT_S)
    assert finished == [b"slow"]
    assert await queue.ready() == 1  # "after-stop" waits; "slow" was acked before the close


async def _true(condition: bool) -> bool:
    return condition


async def _true_async(count: Awaitable[int], expected: int) -> bool:
    return await count == expected


async def test_a_message_returned_as_failed_every_time_is_dead_lettered_at_the_limit(
    amqp_url: str,
) -> None:
    """`requeue_failed` counts towards a quorum queue's delivery limit (a reject: counted on
    every RabbitMQ version, where a nack is not from 4.3 on), so a message that fails its
    handler every time ends in the dead-letter queue after `limit` deliveries."""
    limit = 3
    name = f"test.consumers.failing.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        dead = await channel.declare_queue(f"{name}.dlq", durable=True, timeout=TIMEOUT_S)
        arguments: QuorumQueueArgs = {
            "x-delivery-limit": limit,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dead.name,
        }
        failing = RabbitQueue(name, QueueType.QUORUM, arguments=arguments, declare=False)
        await channel.declare_queue(
            name, durable=True, arguments=failing.arguments, timeout=TIMEOUT_S
        )
        broker = new_broker(amqp_url)
        deliveries = 0

        @consume(broker, failing)
        async def fail(delivery: Delivery) -> None:
            nonlocal deliveries
            deliveries += 1
            await delivery.requeue_failed()

        await broker.start()
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(b"fails every time"), routing_key=name, timeout=TIMEOUT_S
            )
            dead_letter = await eventually(
                lambda: dead.get(no_ack=True, fail=False, timeout=TIMEOUT_S),
                timeout_s=TIMEOUT_S * 3,
                what="the message dead-lettered",
            )
        finally:
            await broker.stop()
            await channel.queue_delete(name, timeout=TIMEOUT_S)
            await channel.queue_delete(dead.name, timeout=TIMEOUT_S)
    assert dead_letter.body == b"fails every time"
    # Dead-lettered once its delivery count passes the limit, not requeued for ever.
    assert limit <= deliveries <= limit + 1, deliveries
