"""A delivery that fails its handler every time ends in its queue's DLQ with the reason, on the
real broker and topology: the status projection and the gateway's outcome consumer over a
database that refuses their writes for good. Left to RabbitMQ's delivery limit, the letter
said only `delivery_limit`; the consumer now dead-letters the delivery the limit would, with
the error as `x-scorebox-error`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from services.gateway.api import GatewayDeps
from services.gateway.consumers import subscribe_task_outcomes
from services.gateway.submissions import Submissions
from services.status.app import subscribe_projection
from services.status.settings import StatusSettings
from shared.bus import publish_event
from shared.consumers import ScoreboxBroker
from shared.contracts import (
    Phase,
    ScoreResult,
    TaskAccepted,
    TaskCompleted,
    TaskError,
    TaskRetrying,
    event_sequence,
    new_id,
    utcnow,
)
from shared.dead_letters import reason
from shared.event_batches import BATCH_HEADER
from shared.failed_deliveries import failure_reason, return_failed
from shared.group_writes import GroupWriter
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import (
    DEAD_LETTERED_FROM_HEADER,
    DELIVERY_COUNT_HEADER,
    EARLIER_DELIVERIES_HEADER,
    ERROR_HEADER,
    EVENTS,
    GATEWAY_TASK_OUTCOMES,
    STATUS_PROJECTION,
    WorkQueue,
    declare_topology,
)
from tests.integration.test_database_refusals import RefusingCollection
from tests.support import HandedDelivery, eventually, publish_together

pytestmark = pytest.mark.integration

Json = dict[str, Any]
TIMEOUT_S = 10.0
Subscribe = Callable[[ScoreboxBroker, AsyncCollection[Json]], None]


@pytest.fixture
async def database(mongo: Any, db_prefix: str) -> AsyncIterator[Any]:
    client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
    yield client[f"{db_prefix}_failed_deliveries"]
    await client.close()


def _projection(broker: ScoreboxBroker, refusing: AsyncCollection[Json]) -> None:
    subscribe_projection(broker, GroupWriter(refusing), StatusSettings(), clock=utcnow)


def _gateway_outcomes(broker: ScoreboxBroker, refusing: AsyncCollection[Json]) -> None:
    database = refusing.database
    submissions = Submissions(database.client, database.name)
    submissions._writes = GroupWriter(refusing)  # the store's own group writer, refusing
    deps = SimpleNamespace(submissions=submissions, in_flight=None, cache=None, clock=utcnow)
    subscribe_task_outcomes(broker, cast(GatewayDeps, deps), broker_timeout_s=TIMEOUT_S)


def _completion() -> TaskCompleted:
    now = utcnow()
    return TaskCompleted(
        task_id=new_id(),
        tenant_id="acme",
        sequence=1,
        submitted_at=now,
        occurred_at=now,
        result=ScoreResult(score=5, comment="ok", model="m"),
        has_callback=False,
    )


@asynccontextmanager
async def _topology_broker(
    amqp_url: str, *, consuming: Callable[[ScoreboxBroker], object] | None = None
) -> AsyncIterator[ScoreboxBroker]:
    """A broker connected to the test's vhost with the topology declared; with `consuming`,
    its consumers subscribed and started on outcome queues emptied of earlier tests' events."""
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    if consuming is not None:
        consuming(broker)
    await broker.connect()
    try:
        await declare_topology(broker)
        if consuming is not None:
            await _purge_outcome_queues(amqp_url)
            await broker.start()
        yield broker
    finally:
        await broker.stop()


async def _purge_outcome_queues(amqp_url: str) -> None:
    """Both queues take every test's outcome: a test starts with none of the earlier ones."""
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        for work_queue in (STATUS_PROJECTION, GATEWAY_TASK_OUTCOMES):
            queue = await channel.get_queue(work_queue.name, ensure=False)
            await queue.purge(timeout=TIMEOUT_S)


async def _submitted(submissions: AsyncCollection[Json], task_id: str) -> None:
    expires_at = utcnow() + timedelta(hours=1)
    document = {"_id": task_id, "tenant_id": "acme", "state": "accepted", "expires_at": expires_at}
    await submissions.insert_one(document)


async def _dead_letter(
    amqp_url: str, work_queue: WorkQueue, task_id: str
) -> AbstractIncomingMessage:
    """The task's letter in the queue's DLQ (the tests of this module share a vhost, and each
    queue bound to outcomes takes every test's event)."""
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        dlq = await channel.get_queue(work_queue.dead_letter_routing_key, ensure=False)

        async def found() -> AbstractIncomingMessage | None:
            while (letter := await dlq.get(no_ack=True, fail=False, timeout=TIMEOUT_S)) is not None:
                if letter.correlation_id == task_id:
                    return letter
            return None

        return await eventually(found, timeout_s=60, what=f"a dead letter of {work_queue.name}")


async def _dead_letters(
    amqp_url: str, work_queue: WorkQueue, task_ids: set[str], *, others: list[Json]
) -> dict[str, AbstractIncomingMessage]:
    """The letters of these tasks in the queue's DLQ, whatever their order; the headers of
    every other letter read on the way go to `others`."""
    found: dict[str, AbstractIncomingMessage] = {}
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        dlq = await channel.get_queue(work_queue.dead_letter_routing_key, ensure=False)

        async def all_found() -> bool:
            while (letter := await dlq.get(no_ack=True, fail=False, timeout=TIMEOUT_S)) is not None:
                if letter.correlation_id in task_ids:
                    found[letter.correlation_id] = letter
                else:
                    others.append(dict(letter.headers))
            return found.keys() == task_ids

        await eventually(all_found, timeout_s=60, what=f"dead letters of {work_queue.name}")
    return found


async def _letters_left(amqp_url: str, work_queue: WorkQueue) -> list[Json]:
    """The headers of every letter still in the queue's DLQ (taken out)."""
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        dlq = await channel.get_queue(work_queue.dead_letter_routing_key, ensure=False)
        left = []
        while (letter := await dlq.get(no_ack=True, fail=False, timeout=TIMEOUT_S)) is not None:
            left.append(dict(letter.headers))
        return left


async def _ready(amqp_url: str, work_queue: WorkQueue) -> int:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(work_queue.name, passive=True, timeout=TIMEOUT_S)
        count = queue.declaration_result.message_count
        assert count is not None
        return count


@pytest.mark.parametrize(
    ("subscribe", "work_queue", "collection"),
    [
        (_projection, STATUS_PROJECTION, "tasks"),
        (_gateway_outcomes, GATEWAY_TASK_OUTCOMES, "submissions"),
    ],
    ids=["status-projection", "gateway-outcomes"],
)
async def test_a_delivery_refused_at_every_try_is_dead_lettered_with_the_reason(
    amqp_url: str, database: Any, subscribe: Subscribe, work_queue: WorkQueue, collection: str
) -> None:
    refusing = RefusingCollection(database[collection])
    writes = cast("AsyncCollection[Json]", refusing)
    async with _topology_broker(amqp_url, consuming=lambda b: subscribe(b, writes)) as broker:
        event = _completion()
        if work_queue is GATEWAY_TASK_OUTCOMES:  # an outcome of no submission is dropped
            await _submitted(database["submissions"], event.task_id)
        await publish_event(broker, event, timeout=TIMEOUT_S)
        letter = await _dead_letter(amqp_url, work_queue, event.task_id)

    headers = dict(letter.headers)
    assert "Document failed validation" in str(headers[ERROR_HEADER])
    assert "delivery limit" in str(headers[ERROR_HEADER])
    assert reason(headers) == headers[ERROR_HEADER]  # what `scorebox dlq list` would show
    assert headers[DEAD_LETTERED_FROM_HEADER] == work_queue.name
    # Published by the consumer, not by RabbitMQ, and without the count that would have it
    # given up at once were it moved back to its queue.
    assert "x-death" not in headers
    assert headers.get(DELIVERY_COUNT_HEADER, 0) == 0
    # Tried at every delivery the limit allows, the first included.
    assert refusing.bulk_writes == work_queue.delivery_limit + 1


async def test_events_of_a_batch_refused_at_every_try_are_dead_lettered_one_by_one(
    amqp_url: str, database: Any
) -> None:
    """A batch's parts carry its delivery count: at the limit, each event the database
    refuses becomes a letter of its own, with the reason, as it would have alone."""
    refusing = RefusingCollection(database["tasks"])
    writes = cast("AsyncCollection[Json]", refusing)
    async with _topology_broker(amqp_url, consuming=lambda b: _projection(b, writes)) as broker:
        events = [_completion() for _ in range(3)]
        assert await publish_together(broker, events) == len(events)
        others: list[Json] = []
        task_ids = {e.task_id for e in events}
        letters = await _dead_letters(amqp_url, STATUS_PROJECTION, task_ids, others=others)

    # The batch itself acked: not dead-lettered whole as well, nor left to come back.
    others.extend(await _letters_left(amqp_url, STATUS_PROJECTION))
    assert not [headers for headers in others if BATCH_HEADER in headers]
    assert await _ready(amqp_url, STATUS_PROJECTION) == 0
    for event in events:
        letter = letters[event.task_id]
        assert BATCH_HEADER not in letter.headers
        assert TaskCompleted.model_validate_json(letter.body) == event
        assert "Document failed validation" in str(letter.headers[ERROR_HEADER])
        assert letter.headers["x-tenant-id"] == event.tenant_id
        assert letter.message_id == event.message_id


async def test_a_letter_carries_no_count_of_deliveries_before_it(
    amqp_url: str, database: Any
) -> None:
    """Deliveries lost on earlier copies count towards the limit (`x-scorebox-earlier-
    deliveries`), and the letter leaves the count behind: moved back to its queue, it would be
    given up at its first failure."""
    refusing = RefusingCollection(database["tasks"])
    writes = cast("AsyncCollection[Json]", refusing)
    earlier = 3
    async with _topology_broker(amqp_url, consuming=lambda b: _projection(b, writes)):
        event = _completion()
        await _publish_raw(amqp_url, event, headers={EARLIER_DELIVERIES_HEADER: earlier})
        letter = await _dead_letter(amqp_url, STATUS_PROJECTION, event.task_id)

    assert ERROR_HEADER in letter.headers
    assert EARLIER_DELIVERIES_HEADER not in letter.headers
    assert refusing.bulk_writes == STATUS_PROJECTION.delivery_limit + 1 - earlier


async def _publish_raw(amqp_url: str, event: TaskCompleted, *, headers: Json) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        events = await channel.get_exchange(EVENTS.name, ensure=False)
        message = aio_pika.Message(
            event.model_dump_json().encode(), headers=headers, correlation_id=event.task_id
        )
        await events.publish(message, routing_key=event.routing_key, timeout=TIMEOUT_S)


async def _publish_body(amqp_url: str, routing_key: str, task_id: str, body: bytes) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        events = await channel.get_exchange(EVENTS.name, ensure=False)
        message = aio_pika.Message(body, correlation_id=task_id)
        await events.publish(message, routing_key=routing_key, timeout=TIMEOUT_S)


def _far_future_retry() -> Json:
    """A retry whose next attempt is due in the year 9999: a retention added to it leaves
    `datetime`'s range (`OverflowError`), so the contracts refuse it."""
    now = utcnow()
    retrying = TaskRetrying(
        task_id=new_id(),
        tenant_id="acme",
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.RETRYING),
        attempt=1,
        submitted_at=now,
        error=TaskError(code="model_unavailable", message="down", retryable=True),
        next_attempt_at=now,
    )
    return retrying.model_dump(mode="json") | {"next_attempt_at": "9999-12-30T00:00:00Z"}


def _acceptance(task_id: str) -> Json:
    now = utcnow()
    accepted = TaskAccepted(task_id=task_id, tenant_id="acme", sequence=0, submitted_at=now)
    return accepted.model_dump(mode="json")


async def test_events_the_projection_cannot_apply_are_dead_lettered_not_held(
    amqp_url: str, database: Any
) -> None:
    """An event that passed its contract and then failed to apply with an error other than
    the database's (a date out of range, a number BSON cannot hold) was left unsettled: it
    held its prefetch place until the broker's consumer timeout, and came back. The
    contracts now refuse what they can (unreadable), and the projection dead-letters what
    still fails to apply."""
    tasks = database["tasks"]
    writes = cast("AsyncCollection[Json]", tasks)
    async with _topology_broker(amqp_url, consuming=lambda b: _projection(b, writes)) as broker:
        far = _far_future_retry()
        huge, many_attempts, past_int64 = new_id(), new_id(), new_id()
        beyond = _completion().model_dump(mode="json")
        generation = beyond | {"task_id": huge, "generation": 10**13, "sequence": 10**19}
        attempt = beyond | {"task_id": many_attempts, "attempt": 10**19}
        # Client metadata is checked at the gateway's edge, not by the contract.
        metadata = _acceptance(past_int64) | {"metadata": {"n": 10**19}}
        for task_id, body, routing_key in (
            (far["task_id"], far, "task.retrying"),
            (huge, generation, "task.completed"),
            (many_attempts, attempt, "task.completed"),
            (past_int64, metadata, "task.accepted"),
        ):
            await _publish_body(amqp_url, routing_key, task_id, json.dumps(body).encode())
        others: list[Json] = []
        task_ids = {far["task_id"], huge, many_attempts, past_int64}
        letters = await _dead_letters(amqp_url, STATUS_PROJECTION, task_ids, others=others)
        after = _completion()
        await publish_event(broker, after, timeout=TIMEOUT_S)

        async def applied() -> bool:
            return await tasks.find_one({"_id": after.task_id}) is not None

        await eventually(applied, what="a later event applied")
    for task_id in (far["task_id"], huge, many_attempts):
        assert "unreadable" in str(letters[task_id].headers[ERROR_HEADER])
    assert "cannot be applied" in str(letters[past_int64].headers[ERROR_HEADER])
    assert await _ready(amqp_url, STATUS_PROJECTION) == 0


# `return_failed` on its own, over the real broker.


async def test_a_letter_the_broker_refuses_is_left_to_rabbitmqs_own_dead_lettering(
    amqp_url: str,
) -> None:
    """A DLQ that is gone (or an alarm that lasts): after `letter_deadline_s` the delivery is
    returned as failed, for RabbitMQ to dead-letter, instead of held by its handler for as
    long as the broker refuses the copy."""
    async with _topology_broker(amqp_url) as broker:
        await _delete_queue(amqp_url, STATUS_PROJECTION.dead_letter_routing_key)
        delivery = _at_the_limit(STATUS_PROJECTION)
        async with asyncio.timeout(TIMEOUT_S):  # held while the broker refuses: the bug
            await return_failed(
                broker,
                STATUS_PROJECTION,
                delivery,
                error="refused",
                timeout=TIMEOUT_S,
                letter_deadline_s=1.0,
            )
        await declare_topology(broker)  # the DLQ back, for the other tests
    assert delivery.settled == ["reject(requeue=True)"]


async def test_below_the_limit_a_failed_delivery_is_returned_and_at_it_dead_lettered(
    amqp_url: str,
) -> None:
    async with _topology_broker(amqp_url) as broker:
        below = _at_the_limit(STATUS_PROJECTION, short_by=1)
        at = _at_the_limit(STATUS_PROJECTION)
        for delivery in (below, at):
            await return_failed(
                broker, STATUS_PROJECTION, delivery, error="refused", timeout=TIMEOUT_S
            )
        letter = await _dead_letter(amqp_url, STATUS_PROJECTION, at.correlation_id or "")
    assert below.settled == ["reject(requeue=True)"]
    assert at.settled == ["ack"]
    assert letter.headers[ERROR_HEADER] == "refused (at the queue's delivery limit)"


def test_the_reason_keeps_its_end_whatever_the_errors_length() -> None:
    reason_ = failure_reason(ValueError("x" * 5000))
    assert reason_.startswith("ValueError: xxx")
    assert reason_.endswith(" (at the queue's delivery limit)")
    assert len(reason_) <= 1000  # what `publish_dead_letter` keeps of it


def _at_the_limit(work_queue: WorkQueue, *, short_by: int = 0) -> HandedDelivery:
    return HandedDelivery(
        b"{}",
        headers={DELIVERY_COUNT_HEADER: work_queue.delivery_limit - short_by},
        redelivered=True,
        message_id=new_id(),
        correlation_id=new_id(),
    )


async def _delete_queue(amqp_url: str, name: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(name, timeout=TIMEOUT_S)
