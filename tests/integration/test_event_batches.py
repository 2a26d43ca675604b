"""Batches of events on the real broker: the scorer's publisher sends callback-less
completions that queue behind a confirm as one message (`shared.batched_publish`), and every
consumer takes each event of a batch as a delivery of its own, the batch settled as the
strictest of its parts asks (`shared.consumers`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import aiormq
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from faststream.rabbit import QueueType, RabbitQueue
from faststream.rabbit.schemas.queue import QuorumQueueArgs

from bench.load import CompletionListener
from shared.batched_publish import EventBatcher
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import ScoreResult, TaskCompleted, new_id, utcnow
from shared.event_batches import BATCH_HEADER, OneEvent, encode_batch, split_batch
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import CALLBACK_HEADER, DELIVERY_COUNT_HEADER, EVENTS, deliveries_lost
from tests.support import completion_ids, eventually, publish_together, watching_completions

pytestmark = pytest.mark.integration

TIMEOUT_S = 10.0
LIMIT = 3
Handler = Callable[[Delivery], Any]


def _broker(amqp_url: str) -> ScoreboxBroker:
    return make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))


def _completion(tenant: str, *, callback: str | None = None) -> TaskCompleted:
    now = utcnow()
    return TaskCompleted(
        task_id=new_id(),
        tenant_id=tenant,
        sequence=90,
        submitted_at=now,
        occurred_at=now,
        result=ScoreResult(score=4, comment="fine", model="m"),
        has_callback=callback is not None,
        callback_url=callback,
    )


# --- Consuming a batch ---------------------------------------------------------------------


class LimitedQueue:
    """A quorum queue of the test's own with a delivery limit and a DLQ."""

    def __init__(self, channel: AbstractChannel, name: str) -> None:
        self.channel = channel
        self.name = name
        self.dlq = f"{name}.dlq"
        arguments: QuorumQueueArgs = {
            "x-delivery-limit": LIMIT,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.dlq,
        }
        self.declared = RabbitQueue(name, QueueType.QUORUM, arguments=arguments, declare=False)

    async def put_batch(self, events: list[OneEvent]) -> bytes:
        body, parts = encode_batch(events)
        headers: dict[str, Any] = {"x-schema-version": 2, BATCH_HEADER: parts}
        message = aio_pika.Message(body, headers=headers, message_id="batch-1")
        await self.channel.default_exchange.publish(
            message, routing_key=self.name, timeout=TIMEOUT_S
        )
        return body

    async def put_raw(
        self, body: bytes, headers: dict[str, Any], *, message_id: str | None = None
    ) -> None:
        message = aio_pika.Message(body, headers=headers, message_id=message_id)
        await self.channel.default_exchange.publish(
            message, routing_key=self.name, timeout=TIMEOUT_S
        )

    async def ready(self) -> int:
        queue = await self.channel.declare_queue(self.name, passive=True, timeout=TIMEOUT_S)
        count = queue.declaration_result.message_count
        assert count is not None
        return count

    async def letter(self) -> AbstractIncomingMessage:
        dlq = await self.channel.get_queue(self.dlq, ensure=False)
        return await eventually(
            lambda: dlq.get(no_ack=True, fail=False, timeout=TIMEOUT_S),
            timeout_s=TIMEOUT_S,
            what="a dead letter",
        )


@pytest.fixture
async def limited(amqp_url: str) -> AsyncIterator[LimitedQueue]:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        queue = LimitedQueue(channel, f"test.batches.{uuid.uuid4().hex[:8]}")
        await channel.declare_queue(queue.dlq, durable=True, timeout=TIMEOUT_S)
        await channel.declare_queue(
            queue.name, durable=True, arguments=queue.declared.arguments, timeout=TIMEOUT_S
        )
        yield queue
        await channel.queue_delete(queue.name, timeout=TIMEOUT_S)
        await channel.queue_delete(queue.dlq, timeout=TIMEOUT_S)


THREE = [
    OneEvent(b'{"n":1}', "m-1", "t-1", "acme"),
    OneEvent(b'{"n":2}', "m-2", "t-2", "globex"),
    OneEvent(b'{"n":3}', "m-3", "t-3", "acme"),
]


@asynccontextmanager
async def _consuming(
    amqp_url: str,
    queue: LimitedQueue,
    handler: Handler,
    *,
    ack_first: bool = False,
    prefetch: int | None = None,
) -> AsyncIterator[None]:
    broker = _broker(amqp_url)
    consume(broker, queue.declared, ack_first=ack_first, prefetch=prefetch)(handler)
    await broker.start()
    try:
        yield
    finally:
        await broker.stop()


async def _seen(seen: list[Any], count: int, what: str) -> None:
    async def enough() -> bool:
        return len(seen) >= count

    await eventually(enough, timeout_s=TIMEOUT_S, what=what)


async def test_each_event_of_a_batch_reaches_the_handler_as_a_delivery_of_its_own(
    amqp_url: str, limited: LimitedQueue
) -> None:
    seen: list[tuple[bytes, str | None, str | None, str | None, bool]] = []

    async def handle(delivery: Delivery) -> None:
        tenant = delivery.headers.get("x-tenant-id")
        assert BATCH_HEADER not in delivery.headers
        seen.append(
            (
                delivery.body,
                delivery.message_id,
                delivery.correlation_id,
                tenant,
                delivery.redelivered,
            )
        )
        await delivery.ack()

    await limited.put_batch(THREE)
    async with _consuming(amqp_url, limited, handle):
        await _seen(seen, 3, "three parts")
    assert sorted(seen) == [
        (b'{"n":1}', "m-1", "t-1", "acme", False),
        (b'{"n":2}', "m-2", "t-2", "globex", False),
        (b'{"n":3}', "m-3", "t-3", "acme", False),
    ]
    assert await limited.ready() == 0  # acked: nothing came back once the consumer stopped


async def test_a_part_returned_as_failed_brings_the_whole_batch_back(
    amqp_url: str, limited: LimitedQueue
) -> None:
    seen: list[tuple[str | None, bool]] = []

    async def handle(delivery: Delivery) -> None:
        seen.append((delivery.message_id, delivery.redelivered))
        if delivery.message_id == "m-2" and not delivery.redelivered:
            await delivery.requeue_failed()
            return
        await delivery.ack()

    await limited.put_batch(THREE)
    async with _consuming(amqp_url, limited, handle):
        await _seen(seen, 6, "the batch twice")
        assert await limited.ready() == 0
    assert sorted(seen) == sorted(
        [
            ("m-1", False),
            ("m-2", False),
            ("m-3", False),
            ("m-1", True),
            ("m-2", True),
            ("m-3", True),
        ]
    )
    assert await limited.ready() == 0  # acked the second time


async def test_a_part_whose_handler_raises_returns_the_batch_counted(
    amqp_url: str, limited: LimitedQueue
) -> None:
    """The whole batch comes back to the same consumer (its handled parts harmlessly), after
    a pause: left unsettled, it came back only when the channel closed."""
    seen: list[tuple[str | None, bool]] = []

    async def fail_one_once(delivery: Delivery) -> None:
        seen.append((delivery.message_id, delivery.redelivered))
        if delivery.message_id == "m-1" and len(seen) <= 3:
            raise RuntimeError("a bug met once")
        await delivery.ack()

    await limited.put_batch(THREE)
    async with _consuming(amqp_url, limited, fail_one_once):
        await _seen(seen, 6, "the batch twice")
        assert await limited.ready() == 0
    assert sorted(seen[3:]) == [("m-1", True), ("m-2", True), ("m-3", True)]
    assert await limited.ready() == 0  # acked the second time


async def test_a_part_dead_lettered_dead_letters_the_whole_batch(
    amqp_url: str, limited: LimitedQueue
) -> None:
    seen: list[str | None] = []

    async def reject_one(delivery: Delivery) -> None:
        seen.append(delivery.message_id)
        if delivery.message_id == "m-3":
            await delivery.reject(requeue=False)
            return
        await delivery.ack()

    body = await limited.put_batch(THREE)
    async with _consuming(amqp_url, limited, reject_one):
        letter = await limited.letter()
    assert sorted(map(str, seen)) == ["m-1", "m-2", "m-3"]  # once each: not requeued
    assert letter.body == body  # every event kept, for a replay to apply again
    assert [part.message_id for part in split_batch(letter.body, dict(letter.headers))] == [
        "m-1",
        "m-2",
        "m-3",
    ]


async def test_a_batch_returned_as_failed_every_time_is_dead_lettered_at_the_limit(
    amqp_url: str, limited: LimitedQueue
) -> None:
    """The parts carry the batch's delivery count, which is what `return_failed` reads to
    dead-letter a part itself at the limit."""
    counts: list[int] = []

    async def fail(delivery: Delivery) -> None:
        if delivery.message_id == "m-1":
            counts.append(int(delivery.headers.get("x-delivery-count", 0)))
        await delivery.requeue_failed()

    await limited.put_batch(THREE)
    async with _consuming(amqp_url, limited, fail):
        letter = await limited.letter()
    assert BATCH_HEADER in letter.headers
    assert counts[:LIMIT] == list(range(LIMIT))


async def test_an_unreadable_batch_is_dead_lettered_without_reaching_the_handler(
    amqp_url: str, limited: LimitedQueue
) -> None:
    seen: list[bytes] = []

    async def handle(delivery: Delivery) -> None:
        seen.append(delivery.body)
        await delivery.ack()

    await limited.put_raw(b'[{"n":1}]', {BATCH_HEADER: [[99, "m-1", "t-1", "acme"]]})
    async with _consuming(amqp_url, limited, handle):
        letter = await limited.letter()
    assert letter.body == b'[{"n":1}]'
    assert seen == []


async def test_a_batch_consumed_ack_first_is_acked_before_its_parts_are_handled(
    amqp_url: str, limited: LimitedQueue
) -> None:
    seen: list[str | None] = []

    async def fail(delivery: Delivery) -> None:
        seen.append(delivery.message_id)
        raise RuntimeError("lost, as a notification may be")

    await limited.put_batch(THREE)
    async with _consuming(amqp_url, limited, fail, ack_first=True):
        await _seen(seen, 3, "three parts")
    assert await limited.ready() == 0  # acked first: not redelivered


async def test_no_more_parts_are_handled_at_once_than_the_prefetch(
    amqp_url: str, limited: LimitedQueue
) -> None:
    """A prefetch counts messages; parts of batches are bounded by it too, or a consumer would
    take prefetch x batch size events in at once."""
    prefetch = 2
    in_hand = 0
    most = 0
    done: list[str | None] = []

    async def handle(delivery: Delivery) -> None:
        nonlocal in_hand, most
        in_hand += 1
        most = max(most, in_hand)
        for _ in range(3):  # holds its part through a few loop passes
            await asyncio.sleep(0)
        in_hand -= 1
        done.append(delivery.message_id)
        await delivery.ack()

    many = [OneEvent(b"{}", f"m-{i}", f"t-{i}", "acme") for i in range(12)]
    await limited.put_batch(many)
    await limited.put_batch(many)
    async with _consuming(amqp_url, limited, handle, prefetch=prefetch):
        await _seen(done, 24, "both batches")
    assert most == prefetch


# --- Publishing batches ---------------------------------------------------------------------


@asynccontextmanager
async def _publisher(amqp_url: str) -> AsyncIterator[ScoreboxBroker]:
    broker = _broker(amqp_url)
    await broker.connect()
    try:
        await broker.declare_exchange(EVENTS)
        yield broker
    finally:
        await broker.stop()


async def test_completions_published_together_go_out_in_batches_each_once(amqp_url: str) -> None:
    completions = [_completion(f"tenant-{i % 3}") for i in range(40)]
    async with watching_completions(amqp_url) as received, _publisher(amqp_url) as broker:
        assert await publish_together(broker, completions, max_batch=16) == 40
        await _seen(received, 3, "three messages")
        tasks = [task for message in received for task in completion_ids(message)]
        assert tasks == [event.task_id for event in completions]  # each once, in order
        assert [len(completion_ids(message)) for message in received] == [16, 16, 8]
        for message in received:
            parts = split_batch(message.body, dict(message.headers))
            for part in parts:
                event = TaskCompleted.model_validate_json(part.body)
                assert part.headers["x-tenant-id"] == event.tenant_id
            assert message.routing_key == "task.completed"
            assert CALLBACK_HEADER not in message.headers
            assert message.headers["x-schema-version"] == 2  # not the notifier's schema-1 binding


async def test_a_lone_completion_goes_out_as_it_always_did(amqp_url: str) -> None:
    event = _completion("acme")
    async with watching_completions(amqp_url) as received, _publisher(amqp_url) as broker:
        await EventBatcher(broker, timeout=TIMEOUT_S, max_batch=16).publish(event)
        await _seen(received, 1, "the completion")
    [message] = received
    assert BATCH_HEADER not in message.headers
    assert message.body == event.model_dump_json().encode()
    assert message.correlation_id == event.task_id
    assert message.headers["x-tenant-id"] == "acme"


async def test_completions_with_a_callback_are_never_batched(amqp_url: str) -> None:
    completions = [_completion("acme", callback="https://example.com/hook") for _ in range(8)]
    async with watching_completions(amqp_url) as received, _publisher(amqp_url) as broker:
        batcher = EventBatcher(broker, timeout=TIMEOUT_S, max_batch=16)
        await asyncio.gather(*(batcher.publish(event) for event in completions))
        await _seen(received, 8, "eight messages")
    assert all(BATCH_HEADER not in message.headers for message in received)
    assert all(message.headers[CALLBACK_HEADER] == "yes" for message in received)


async def test_with_a_batch_of_one_every_completion_goes_alone(amqp_url: str) -> None:
    completions = [_completion("acme") for _ in range(5)]
    async with watching_completions(amqp_url) as received, _publisher(amqp_url) as broker:
        batcher = EventBatcher(broker, timeout=TIMEOUT_S, max_batch=1)
        await asyncio.gather(*(batcher.publish(event) for event in completions))
        await _seen(received, 5, "five messages")
    assert all(BATCH_HEADER not in message.headers for message in received)


async def test_a_batch_the_broker_does_not_take_fails_every_caller_in_it(amqp_url: str) -> None:
    """Nothing bound to `task.completed` in this vhost outside `_watching_completions`: the
    mandatory publish comes back unroutable, and each caller learns it (to publish again)."""
    completions = [_completion("acme") for _ in range(6)]
    async with _publisher(amqp_url) as broker:
        batcher = EventBatcher(broker, timeout=TIMEOUT_S, max_batch=16)
        outcomes = await asyncio.gather(
            *(batcher.publish(event) for event in completions), return_exceptions=True
        )
        assert all(isinstance(o, aiormq.exceptions.DeliveryError) for o in outcomes), outcomes
        # And the publisher goes on: the next batch is sent (and refused) as well.
        with pytest.raises(aiormq.exceptions.DeliveryError):
            await batcher.publish(_completion("acme"))


async def test_a_caller_cancelled_while_its_event_waits_holds_up_no_one(amqp_url: str) -> None:
    """Its event is an attempt's recorded outcome: it goes out with the others all the same."""
    first, cancelled, last = (_completion("acme") for _ in range(3))
    async with watching_completions(amqp_url) as received, _publisher(amqp_url) as broker:
        batcher = EventBatcher(broker, timeout=TIMEOUT_S, max_batch=16)
        sending = [asyncio.create_task(batcher.publish(e)) for e in (first, cancelled, last)]
        await asyncio.sleep(0)  # one loop pass: every caller queued, the sender not run yet
        sending[1].cancel()
        outcomes = await asyncio.gather(*sending, return_exceptions=True)
        await _seen(received, 1, "the batch")
    assert isinstance(outcomes[1], asyncio.CancelledError)
    assert outcomes[0] is None
    assert outcomes[2] is None
    assert [task for message in received for task in completion_ids(message)] == [
        first.task_id,
        cancelled.task_id,
        last.task_id,
    ]


async def test_the_benchmark_times_every_completion_of_a_batch(amqp_url: str) -> None:
    """`make bench` times completions by their events: those of a batch count one by one."""
    completions = [_completion("acme") for _ in range(5)]
    async with CompletionListener(amqp_url) as listener, _publisher(amqp_url) as broker:
        listener.track_all(event.task_id for event in completions)
        batcher = EventBatcher(broker, timeout=TIMEOUT_S, max_batch=16)
        await asyncio.gather(*(batcher.publish(event) for event in completions))
        assert await listener.wait_for(len(completions), timeout_s=TIMEOUT_S)
    assert {task: seen.status for task, seen in listener.seen.items()} == {
        event.task_id: "completed" for event in completions
    }


@pytest.mark.parametrize("batched", [False, True], ids=["event", "batch"])
async def test_a_count_a_moved_back_letter_carries_is_read_only_once_the_broker_counts(
    amqp_url: str, limited: LimitedQueue, batched: bool
) -> None:
    """A letter moved back by a shovel or the management UI carries its DLQ's
    `x-delivery-count` (RabbitMQ 4.0-4.2 write the source queue's failures into it): read as
    the broker's on its first delivery, it had the letter taken for one at its limit and
    dead-lettered at its first failure (session 51's review of RabbitMQ 4.x). Returned, the
    broker's own count is read."""
    counts: list[int] = []

    async def fail_once(delivery: Delivery) -> None:
        if delivery.message_id == "m-1":
            counts.append(deliveries_lost(delivery.headers))
        if len(counts) == 1:
            await delivery.requeue_failed()
        else:
            await delivery.ack()

    carried = {DELIVERY_COUNT_HEADER: LIMIT}
    if batched:
        body, parts = encode_batch(THREE)
        await limited.put_raw(body, {BATCH_HEADER: parts, **carried})
    else:
        await limited.put_raw(b'{"n":1}', carried, message_id="m-1")
    async with _consuming(amqp_url, limited, fail_once):
        await _seen(counts, 2, "the letter handed twice")
    assert counts[:2] == [0, 1]
