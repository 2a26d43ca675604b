"""`shared.consumers` on the real broker: deliveries reach plain handlers, the handler settles
them, prefetch bounds what is in hand, a failed handler's message comes back counted, a
message returned as failed or failing its handler every time is dead-lettered at the
delivery limit, and stopping lets the
deliveries in hand finish."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from random import Random
from typing import Any, cast, override

import aio_pika
import aiormq
import pytest
from aio_pika.abc import AbstractRobustConnection
from faststream.rabbit import ExchangeType, QueueType, RabbitExchange, RabbitQueue
from faststream.rabbit.schemas.queue import QuorumQueueArgs

from shared import consumers
from shared.acks import ChannelAcks
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.log_context import CorrelationFilter
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import Binding
from tests.faults.slow_link import SlowLink
from tests.support import eventually, metric_sum

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


async def test_what_a_handler_logs_carries_its_deliverys_correlation_id(
    amqp_url: str, queue: Queue
) -> None:
    broker = new_broker(amqp_url)
    capture = Captured()
    records = capture.records
    capture.addFilter(CorrelationFilter())
    logger = logging.getLogger("scorebox.test.correlation")
    logger.addHandler(capture)
    logger.propagate = False

    @consume(broker, queue.declared)
    async def handle(delivery: Delivery) -> None:
        logger.warning("handling %s", delivery.message_id)
        await asyncio.gather(asyncio.create_task(_log_in_a_task_it_started(logger)))
        await delivery.ack()

    await queue.put(b"one")
    await broker.start()
    try:
        await eventually(lambda: _true(len(records) == 2), timeout_s=TIMEOUT_S, what="two logs")
        logger.warning("after the delivery")
    finally:
        await broker.stop()
        logger.removeHandler(capture)
    correlated = [getattr(record, "correlation_id", None) for record in records]
    assert correlated == ["c-1", "c-1", None]


async def test_the_log_of_a_failed_handling_carries_its_deliverys_correlation_id(
    amqp_url: str, queue: Queue
) -> None:
    """The traceback of a failed handling, the line most worth tracing, had no task id."""
    broker = new_broker(amqp_url)
    capture = Captured()
    capture.addFilter(CorrelationFilter())
    consumers_log = logging.getLogger("scorebox.consumers")
    consumers_log.addHandler(capture)

    @consume(broker, queue.declared)
    async def handle(delivery: Delivery) -> None:
        raise RuntimeError("handling failed")

    await queue.put(b"one")
    await broker.start()
    try:
        await eventually(lambda: _true(bool(capture.records)), timeout_s=TIMEOUT_S, what="log")
    finally:
        await broker.stop()
        consumers_log.removeHandler(capture)
    failure = capture.records[0]
    assert failure.exc_info is not None
    assert getattr(failure, "correlation_id", None) == "c-1"


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    @override
    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _log_in_a_task_it_started(logger: logging.Logger) -> None:
    logger.warning("a task the handler started")


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


async def test_a_handler_that_raises_once_gets_its_message_again_without_a_restart(
    amqp_url: str, queue: Queue
) -> None:
    """Returned to its queue counted, after a pause: left unsettled, it came back only when
    the channel closed (RabbitMQ's consumer timeout, 30 minutes)."""
    broker = new_broker(amqp_url)
    seen: list[tuple[bytes, bool]] = []

    @consume(broker, queue.declared)
    async def fail_once(delivery: Delivery) -> None:
        seen.append((delivery.body, delivery.redelivered))
        if len(seen) == 1:
            raise RuntimeError("a bug met once")
        await delivery.ack()

    await queue.put(b"poisoned once")
    await broker.start()
    try:
        await eventually(lambda: _true(len(seen) == 2), timeout_s=TIMEOUT_S, what="again")
        await eventually(lambda: _true_async(queue.ready(), 0), timeout_s=TIMEOUT_S)
    finally:
        await broker.stop()
    assert seen == [(b"poisoned once", False), (b"poisoned once", True)]
    assert await queue.ready() == 0  # acked the second time


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


@contextlib.asynccontextmanager
async def _quorum_queue_with_dlq(
    amqp_url: str, limit: int
) -> AsyncIterator[tuple[RabbitQueue, aio_pika.abc.AbstractQueue, aio_pika.abc.AbstractChannel]]:
    """A quorum queue of delivery limit `limit` dead-lettering to a queue of its own: (the
    queue, its DLQ, a channel of the test's own)."""
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
        try:
            yield failing, dead, channel
        finally:
            await channel.queue_delete(name, timeout=TIMEOUT_S)
            await channel.queue_delete(dead.name, timeout=TIMEOUT_S)


async def _deliveries_until_dead_lettered(
    amqp_url: str, limit: int, fail: Callable[[Delivery], Awaitable[None]]
) -> tuple[int, aio_pika.abc.AbstractIncomingMessage]:
    """How often a message was delivered to `fail` before it reached the DLQ, and its letter."""
    deliveries = 0
    async with _quorum_queue_with_dlq(amqp_url, limit) as (failing, dead, channel):
        broker = new_broker(amqp_url)

        @consume(broker, failing)
        async def counted(delivery: Delivery) -> None:
            nonlocal deliveries
            deliveries += 1
            await fail(delivery)

        await broker.start()
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(b"fails every time"), routing_key=failing.name, timeout=TIMEOUT_S
            )
            dead_letter = await eventually(
                lambda: dead.get(no_ack=True, fail=False, timeout=TIMEOUT_S),
                timeout_s=TIMEOUT_S * 3,
                what="the message dead-lettered",
            )
        finally:
            await broker.stop()
    return deliveries, dead_letter


async def test_a_message_returned_as_failed_every_time_is_dead_lettered_at_the_limit(
    amqp_url: str,
) -> None:
    """`requeue_failed` counts towards a quorum queue's delivery limit (a reject: counted on
    every RabbitMQ version, where a nack is not from 4.3 on), so a message that fails its
    handler every time ends in the dead-letter queue after `limit` deliveries."""

    async def fail(delivery: Delivery) -> None:
        await delivery.requeue_failed()

    deliveries, dead_letter = await _deliveries_until_dead_lettered(amqp_url, 3, fail)
    assert dead_letter.body == b"fails every time"
    # Dead-lettered once its delivery count passes the limit, not requeued for ever.
    assert 3 <= deliveries <= 4, deliveries


async def test_a_message_whose_handler_raises_every_time_is_dead_lettered_at_the_limit(
    amqp_url: str,
) -> None:
    """Without a restart or the consumer timeout: from RabbitMQ 4.3 on, a delivery the
    consumer timeout returns is not counted, and one left unsettled came back for ever."""

    async def fail(delivery: Delivery) -> None:
        raise RuntimeError("a bug met every time")

    deliveries, dead_letter = await _deliveries_until_dead_lettered(amqp_url, 2, fail)
    assert dead_letter.body == b"fails every time"
    assert 2 <= deliveries <= 3, deliveries


class CountedAcks:
    """A real aiormq channel whose `basic_ack` frames are counted on their way out."""

    def __init__(self, channel: aiormq.abc.AbstractChannel) -> None:
        self.channel = channel
        self.frames: list[tuple[int, bool]] = []

    @property
    def number(self) -> int:
        return self.channel.number

    async def basic_ack(self, delivery_tag: int, multiple: bool = False, wait: bool = True) -> None:
        self.frames.append((delivery_tag, multiple))
        await self.channel.basic_ack(delivery_tag, multiple=multiple, wait=wait)


@contextlib.asynccontextmanager
async def _held_with_counted_acks(
    amqp_url: str, queue: Queue, count: int
) -> AsyncIterator[tuple[list[aio_pika.abc.AbstractIncomingMessage], CountedAcks, ChannelAcks]]:
    """`count` messages put in `queue` and all delivered, held unsettled on a connection of
    the test's own, with a `ChannelAcks` on their channel whose frames are counted. Whatever
    is left unacknowledged returns to the queue when the block ends."""
    await queue.put(*(str(i).encode() for i in range(count)))
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=count)
        held: list[aio_pika.abc.AbstractIncomingMessage] = []

        async def keep(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            held.append(message)

        await (await channel.get_queue(queue.name)).consume(keep)
        await eventually(lambda: _true(len(held) == count), timeout_s=TIMEOUT_S, what="all held")
        counted = CountedAcks(held[0].channel)
        channel_acks = cast("aiormq.abc.AbstractChannel", counted)
        yield held, counted, ChannelAcks(channel_acks)


async def test_acks_of_handlers_finishing_together_go_out_as_one_frame(
    amqp_url: str, queue: Queue
) -> None:
    """Sixty-four handlers released in the same pass of the loop (as a group commit's round
    trip releases them) ack with one `multiple` frame, and every delivery is acknowledged."""
    count = 64
    async with _held_with_counted_acks(amqp_url, queue, count) as (held, counted, acks):
        release = asyncio.Event()

        async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await release.wait()
            acks.ack(cast("int", message.delivery_tag))

        handlers = [asyncio.create_task(handle(message)) for message in reversed(held)]
        await asyncio.sleep(0)  # let every handler reach its wait (not synchronisation)
        release.set()
        await asyncio.wait_for(asyncio.gather(*handlers), TIMEOUT_S)
        await asyncio.wait_for(acks.drain(), TIMEOUT_S)
        assert counted.frames == [(count, True)]
    # The connection is closed: whatever was not acknowledged would be ready again.
    assert await queue.ready() == 0


async def test_settling_out_of_order_acknowledges_exactly_what_was_acked(
    amqp_url: str, queue: Queue
) -> None:
    """Handlers finishing in any order, some nacking (requeued once) or rejecting: the broker
    never sees an ack it does not expect (that would close the channel and redeliver what
    was in hand), and nothing acked comes back."""
    count = 300
    broker = new_broker(amqp_url)
    deliveries: dict[bytes, int] = {}
    rejected: set[bytes] = set()
    random = Random(7)
    pauses = {str(i).encode(): random.random() / 50 for i in range(count)}

    @consume(broker, queue.declared, prefetch=50)
    async def handle(delivery: Delivery) -> None:
        body = delivery.body
        deliveries[body] = deliveries.get(body, 0) + 1
        await asyncio.sleep(pauses[body])  # work of uneven length, so handlers finish out of order
        number = int(body)
        if number % 11 == 0 and deliveries[body] == 1:
            await delivery.nack(requeue=True)
        elif number % 13 == 0:
            rejected.add(body)
            await delivery.reject()
        else:
            await delivery.ack()

    await queue.put(*pauses)
    await broker.start()
    try:
        await eventually(
            lambda: _true(sum(deliveries.values()) == count + len(range(0, count, 11))),
            timeout_s=TIMEOUT_S * 3,
            what="every delivery handled",
        )
    finally:
        await broker.stop()
    nacked_once = {str(i).encode() for i in range(0, count, 11)}
    assert {body for body, times in deliveries.items() if times == 2} == nacked_once
    assert all(times == 1 for body, times in deliveries.items() if body not in nacked_once)
    assert rejected == {str(i).encode() for i in range(0, count, 13)}
    assert await queue.ready() == 0  # acked and rejected alike: nothing came back


async def test_an_ack_above_a_delivery_in_hand_is_sent_at_once(amqp_url: str, queue: Queue) -> None:
    """A delivery still in its handler does not hold back the acks of later ones: each frees
    its place in the prefetch window, so the rest of the queue flows past the slow one."""
    broker = new_broker(amqp_url)
    release = asyncio.Event()
    acked: list[bytes] = []

    @consume(broker, queue.declared, prefetch=2)
    async def handle(delivery: Delivery) -> None:
        if delivery.body == b"slow":
            await release.wait()
        await delivery.ack()
        acked.append(delivery.body)

    await queue.put(b"slow", *(str(i).encode() for i in range(20)))
    await broker.start()
    try:
        await eventually(lambda: _true(len(acked) == 20), timeout_s=TIMEOUT_S, what="the rest")
        release.set()
        await eventually(lambda: _true(len(acked) == 21), timeout_s=TIMEOUT_S, what="slow")
    finally:
        release.set()
        await broker.stop()
    assert await queue.ready() == 0


async def test_acks_after_a_delivery_left_unsettled_still_reach_the_broker(
    amqp_url: str, queue: Queue
) -> None:
    """A delivery left unsettled (its handler raised) stops `multiple` at its tag: the acks
    after it go one by one and all reach the broker; once it settles, the next batch is one
    frame again."""
    count = 10
    async with _held_with_counted_acks(amqp_url, queue, count) as (held, counted, acks):
        for message in held[1:5]:  # one batch each
            acks.ack(cast("int", message.delivery_tag))
            await asyncio.wait_for(acks.drain(), TIMEOUT_S)
        assert counted.frames == [(2, False), (3, False), (4, False), (5, False)]
        acks.ack(cast("int", held[0].delivery_tag))
        await asyncio.wait_for(acks.drain(), TIMEOUT_S)
        for message in held[5:]:
            acks.ack(cast("int", message.delivery_tag))
        await asyncio.wait_for(acks.drain(), TIMEOUT_S)
        assert counted.frames[4:] == [(1, False), (count, True)]
    assert await queue.ready() == 0


@pytest.mark.parametrize("prefetch", [None, 2], ids=["shared-channel", "own-channel"])
async def test_a_broker_that_stops_answering_fails_the_consumers_start(
    amqp_url: str, queue: Queue, monkeypatch: pytest.MonkeyPatch, prefetch: int | None
) -> None:
    """The consuming connection opened, then every reply held back: opening the consuming
    channel (then its prefetch, then the consume) waited unbounded, holding the service's
    start until the heartbeat gave up. Each gives up after `BROKER_TIMEOUT_S` now."""
    link = SlowLink.to(amqp_url)
    async with link.running():
        settings = {"RABBITMQ_URL": link.url_through(amqp_url), "BROKER_TIMEOUT_S": "1"}
        broker = make_broker(ServiceSettings.model_validate(settings))

        @consume(broker, queue.declared, prefetch=prefetch)
        async def handle(delivery: Delivery) -> None:
            await delivery.ack()

        await broker.connect()  # the publishing connection, before the stall
        connect_robust = aio_pika.connect_robust

        async def connect_then_stall(url: str, **options: Any) -> AbstractRobustConnection:
            connection: AbstractRobustConnection = await connect_robust(url, **options)
            link.reply_delay_s = 3600.0  # every reply from here on held back
            return connection

        monkeypatch.setattr(aio_pika, "connect_robust", connect_then_stall)
        starting = asyncio.create_task(broker.start())
        try:
            done, _ = await asyncio.wait({starting}, timeout=30)
            assert starting in done, "the consumers' start still waits on the broker"
            assert isinstance(starting.exception(), TimeoutError)
        finally:
            starting.cancel()
            link.reply_delay_s = 0.0
            with contextlib.suppress(Exception):
                await asyncio.wait_for(broker.stop(), 10)


async def test_a_queue_of_its_own_is_bound_at_start_and_again_after_a_reconnection(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """An exclusive queue dies with its connection; the robust connection declares it again,
    and its bindings with it, or it would hear nothing more."""
    exchange = RabbitExchange(f"test.bound.{uuid.uuid4().hex[:8]}", type=ExchangeType.FANOUT)
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": broker_link.url_through(amqp_url)})
    broker = make_broker(settings)
    heard: list[bytes] = []

    @consume(
        broker,
        RabbitQueue(f"test.own.{uuid.uuid4().hex[:8]}", exclusive=True, auto_delete=True),
        ack_first=True,
        bindings=(Binding(exchange),),
    )
    async def hear(delivery: Delivery) -> None:
        heard.append(delivery.body)

    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        # Not auto-deleted: the queue's binding goes with the lost connection.
        target = await channel.declare_exchange(exchange.name, type="fanout")
        await broker.start()
        try:
            await target.publish(aio_pika.Message(b"before"), routing_key="", timeout=TIMEOUT_S)
            await eventually(lambda: _true(heard == [b"before"]), what="heard at start")
            assert _connected(broker) == {"publishers": 1, "consumers": 1, "own queues": 1}

            await broker_link.cut()
            await eventually(lambda: _not(broker.ping(1.0)), what="the connection lost")
            await eventually(
                lambda: _true(_connected(broker)["own queues"] == 0), what="shown down"
            )
            broker_link.down = False
            await eventually(lambda: broker.ping(1.0), what="the connection restored")

            async def after_the_reconnection() -> bool:
                await target.publish(aio_pika.Message(b"after"), routing_key="", timeout=TIMEOUT_S)
                return b"after" in heard

            # Published until heard: the consumer's queue may be declared again a moment after
            # its connection is, and what is published meanwhile reaches no queue.
            await eventually(after_the_reconnection, what="heard after the reconnection")
            assert _connected(broker)["own queues"] == 1
        finally:
            await broker.stop()
            await target.delete(timeout=TIMEOUT_S)


def _connected(broker: ScoreboxBroker) -> dict[str, float]:
    """`scorebox_broker_connected` by connection."""
    exposition = broker.metrics.exposition().decode()
    return {
        connection: metric_sum(exposition, "scorebox_broker_connected", connection=connection)
        for connection in ("publishers", "consumers", "own queues")
    }


async def _not(check: Awaitable[bool]) -> bool:
    return not await check


async def test_a_queue_of_its_own_held_elsewhere_after_a_reconnection_holds_up_no_work_queue(
    amqp_url: str, broker_link: SlowLink, queue: Queue
) -> None:
    """Reconnected before the broker noticed the lost connection (a partition, until its
    heartbeat expires), a replica finds its exclusive queue still held by that connection:
    declaring it again is refused (RESOURCE_LOCKED). On the connection of the work queues,
    aio-pika closed the whole connection at each attempt to restore it, and the work queue
    was consumed between attempts or not at all, its deliveries in hand returned each time."""
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": broker_link.url_through(amqp_url)})
    broker = make_broker(settings)
    own_queue = f"test.own.{uuid.uuid4().hex[:8]}"
    handled: list[tuple[bytes, bool]] = []
    acked: list[bytes] = []
    release = asyncio.Event()

    @consume(broker, queue.declared)
    async def work(delivery: Delivery) -> None:
        handled.append((delivery.body, delivery.redelivered))
        await release.wait()  # in hand while the queue of its own is refused, then restored
        await delivery.ack()
        acked.append(delivery.body)

    heard: list[bytes] = []

    @consume(broker, RabbitQueue(own_queue, exclusive=True, auto_delete=True), ack_first=True)
    async def hear(delivery: Delivery) -> None:
        heard.append(delivery.body)

    holder = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    await broker.start()
    try:
        await broker_link.cut()
        await eventually(lambda: _not(broker.ping(1.0)), what="the connection lost")
        # The lost connection's queue goes; another connection takes its name meanwhile.
        await eventually(lambda: _took_exclusive(holder, own_queue), what="the name taken")
        broker_link.down = False

        await queue.put(b"w1", b"w2", b"w3")
        await eventually(lambda: _true(len(handled) >= 3), what="the work queue consumed")

        await holder.close()  # the broker lets go of the name: the queue is restored

        async def consumed_again() -> bool:
            await queue.channel.default_exchange.publish(
                aio_pika.Message(b"again"), routing_key=own_queue, timeout=TIMEOUT_S
            )
            return b"again" in heard

        await eventually(consumed_again, what="its own queue consumed again")
        release.set()
        await eventually(lambda: _true(len(acked) == 3), what="all acknowledged")
    finally:
        release.set()
        await holder.close()
        await broker.stop()
    # Each once, never returned by a connection closed under it, and its ack taken.
    assert handled == [(b"w1", False), (b"w2", False), (b"w3", False)]
    assert await queue.ready() == 0


async def _took_exclusive(connection: aio_pika.abc.AbstractConnection, name: str) -> bool:
    channel = await connection.channel()
    try:
        await channel.declare_queue(name, exclusive=True, auto_delete=True, timeout=TIMEOUT_S)
    except aiormq.exceptions.ChannelLockedResource:
        return False
    return True


async def test_a_stop_does_not_wait_out_the_pause_of_a_delivery_that_failed(
    amqp_url: str, queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler fails once the stop has begun: its delivery goes back at once, and the
    stop ends without waiting for its pause (an hour here), which would have taken the
    deliveries' whole grace (a minute here)."""
    monkeypatch.setattr(consumers, "FAILED_PAUSE_BASE_S", 3600.0)
    monkeypatch.setattr(consumers, "FAILED_PAUSE_CAP_S", 3600.0)
    broker = make_broker(
        ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url, "BROKER_TIMEOUT_S": "60"})
    )
    started, stopping = asyncio.Event(), asyncio.Event()

    @consume(broker, queue.declared)
    async def fail_at_stop(delivery: Delivery) -> None:
        started.set()
        await stopping.wait()
        raise RuntimeError("a bug met as the service stops")

    await queue.put(b"in hand at the stop")
    await broker.start()
    await asyncio.wait_for(started.wait(), TIMEOUT_S)
    stop = asyncio.create_task(broker.stop())
    await eventually(lambda: _true_async(queue.consumers(), 0), timeout_s=TIMEOUT_S)
    stopping.set()
    await asyncio.wait_for(stop, TIMEOUT_S)
    assert await queue.ready() == 1


# A consumer with a channel of its own takes five round trips to start (its channel, its
# prefetch, the declaration and the consume among them): one after another, these many took
# 40 where one took 5.
SIDE_BY_SIDE = 8


async def test_consumers_start_side_by_side(amqp_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service's consumers started one after another, each adding its round trips to the
    start: over a broker far away, many consumers start in about the round trips of one."""
    link = SlowLink.to(amqp_url)
    link.latency_s = 0.05
    connect_robust = aio_pika.connect_robust

    async def counted_once_connected(url: str, **options: Any) -> AbstractRobustConnection:
        connection: AbstractRobustConnection = await connect_robust(url, **options)
        link.rounds = 0  # from here on: the consumers' own round trips
        return connection

    monkeypatch.setattr(aio_pika, "connect_robust", counted_once_connected)

    async def rounds_to_start(consumers: int) -> int:
        broker = new_broker(link.url_through(amqp_url))
        for _ in range(consumers):
            queue = RabbitQueue(f"test.start.{uuid.uuid4().hex[:8]}", auto_delete=True)

            @consume(broker, queue, prefetch=4)
            async def handle(delivery: Delivery) -> None:
                await delivery.ack()

        await broker.connect()
        try:
            await broker.start()
            return link.rounds
        finally:
            await asyncio.wait_for(broker.stop(), TIMEOUT_S)

    async with link.running():
        one = await rounds_to_start(1)
        many = await rounds_to_start(SIDE_BY_SIDE)
    # Slack for replies a busy machine sends apart; one after another adds 35.
    assert many < one + SIDE_BY_SIDE, f"{one} round trips for one consumer, {many} for many"


async def test_a_failed_start_leaves_every_consumer_that_started_counted(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One consumer's start failed (its queue missing) and the others' were cancelled where
    they stood: one whose `basic.consume` had reached the broker went on consuming, uncounted,
    its deliveries out of the stop's reach, and aiormq closed the channel of each RPC it
    cancelled (a re-read: the shared one too). Each start now finishes first."""
    link = SlowLink.to(amqp_url)
    link.latency_s = 0.05
    names = [f"test.failed-start.{uuid.uuid4().hex[:8]}" for _ in range(3)]
    async with link.running():
        broker = new_broker(link.url_through(amqp_url))
        for name in names:
            queue = RabbitQueue(name, auto_delete=True)

            @consume(broker, queue, prefetch=4)
            async def handle(delivery: Delivery) -> None:
                await delivery.ack()

        missing = RabbitQueue(f"test.missing.{uuid.uuid4().hex[:8]}", declare=False)

        @consume(broker, missing)
        async def never(delivery: Delivery) -> None:
            await delivery.ack()

        await broker.connect()
        try:
            with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
                await broker.start()
            assert [name for name in names if broker.in_handlers(name) is None] == []
        finally:
            await asyncio.wait_for(broker.stop(), TIMEOUT_S)
