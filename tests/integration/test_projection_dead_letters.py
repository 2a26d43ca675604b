"""The status projection's dead letters on the real broker and topology: moved back to their
queue once the cause is mended (what a shovel or the management UI's "move messages" does:
published through the default exchange under the queue's name), they are applied as the
events they were; a letter of a letter keeps the first reason; and a part of a batch is
dead-lettered once, however often a sibling brings the batch back.

Found in review: a moved-back letter was read as an event of type
`scorebox.status-projection` and dead-lettered again, its first reason overwritten."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError

from services.status.app import subscribe_projection
from services.status.projection import find_task
from services.status.settings import StatusSettings
from shared.bus import publish_event
from shared.consumers import ScoreboxBroker
from shared.contracts import TaskStatus, utcnow
from shared.event_batches import BATCH_HEADER, OneEvent, encode_batch
from shared.group_writes import GroupWriter
from shared.topology import (
    ERROR_HEADER,
    EVENTS,
    FIRST_ERROR_HEADER,
    ROUTING_KEY_HEADER,
    STATUS_PROJECTION,
)
from tests.integration.test_failed_deliveries import (
    TIMEOUT_S,
    _completion,
    _dead_letter,
    _topology_broker,
)
from tests.support import eventually

pytestmark = pytest.mark.integration

Json = dict[str, Any]


class MendableCollection:
    """A real collection whose bulk writes are refused for good (a failed validation, with
    `refusal` as its message) until `refusal` is None: the cause mended."""

    def __init__(self, collection: AsyncCollection[Json], refusal: str | None) -> None:
        self._collection = collection
        self.refusal = refusal

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    async def bulk_write(self, requests: list[Any], **options: Any) -> Any:
        if self.refusal is None:
            return await self._collection.bulk_write(requests, **options)
        refused = [{"index": i, "code": 121, "errmsg": self.refusal} for i in range(len(requests))]
        raise BulkWriteError({"writeErrors": refused, "writeConcernErrors": [], "nInserted": 0})


@pytest.fixture
async def tasks(mongo: Any, db_prefix: str) -> AsyncIterator[AsyncCollection[Json]]:
    client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
    yield client[f"{db_prefix}_projection_letters"]["tasks"]
    await client.close()


def _projection(
    collection: MendableCollection | AsyncCollection[Json],
) -> Callable[[ScoreboxBroker], object]:
    writes = GroupWriter(cast("AsyncCollection[Json]", collection))
    return lambda broker: subscribe_projection(broker, writes, StatusSettings(), clock=utcnow)


async def move_back(
    amqp_url: str, letter: AbstractIncomingMessage, queue: str = STATUS_PROJECTION.name
) -> None:
    """As a shovel moves a letter: through the default exchange, properties and headers kept."""
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        message = aio_pika.Message(
            letter.body,
            headers=dict(letter.headers),
            message_id=letter.message_id,
            correlation_id=letter.correlation_id,
        )
        await channel.default_exchange.publish(message, routing_key=queue, timeout=TIMEOUT_S)


async def _completed(tasks: AsyncCollection[Json], task_id: str) -> None:
    async def applied() -> bool:
        view = await find_task(task_id, tenant_id="acme", tasks=tasks, now=utcnow())
        return view is not None and view.status is TaskStatus.COMPLETED

    await eventually(applied, timeout_s=20, what="the moved-back completion applied")


class Letters:
    """The letters taken out of the projection's DLQ, counted by task."""

    def __init__(self, amqp_url: str) -> None:
        self._amqp_url = amqp_url
        self.by_task: Counter[str | None] = Counter()

    async def take_all(self) -> None:
        connection = await aio_pika.connect(self._amqp_url, timeout=TIMEOUT_S)
        async with connection:
            channel = await connection.channel()
            dlq = await channel.get_queue(STATUS_PROJECTION.dead_letter_routing_key, ensure=False)
            while (letter := await dlq.get(no_ack=True, fail=False, timeout=TIMEOUT_S)) is not None:
                self.by_task[letter.correlation_id] += 1

    async def until(self, *task_ids: str) -> None:
        async def each_found() -> bool:
            await self.take_all()
            return all(self.by_task[task_id] for task_id in task_ids)

        await eventually(each_found, timeout_s=60, what=f"letters of {task_ids}")


async def test_a_letter_moved_back_once_the_cause_is_mended_is_applied(
    amqp_url: str, tasks: AsyncCollection[Json]
) -> None:
    mendable = MendableCollection(tasks, refusal="Document failed validation")
    async with _topology_broker(amqp_url, consuming=_projection(mendable)) as broker:
        event = _completion()
        await publish_event(broker, event, timeout=TIMEOUT_S)
        letter = await _dead_letter(amqp_url, STATUS_PROJECTION, event.task_id)
        assert letter.headers[ROUTING_KEY_HEADER] == event.routing_key

        mendable.refusal = None
        await move_back(amqp_url, letter)
        await _completed(tasks, event.task_id)

    letters = Letters(amqp_url)
    await letters.take_all()
    assert letters.by_task[event.task_id] == 0  # not dead-lettered again


async def test_a_letter_of_a_letter_keeps_the_first_reason_and_the_first_key(
    amqp_url: str, tasks: AsyncCollection[Json]
) -> None:
    mendable = MendableCollection(tasks, refusal="the first cause")
    async with _topology_broker(amqp_url, consuming=_projection(mendable)) as broker:
        event = _completion()
        await publish_event(broker, event, timeout=TIMEOUT_S)
        first = await _dead_letter(amqp_url, STATUS_PROJECTION, event.task_id)

        mendable.refusal = "another cause"  # mended badly
        await move_back(amqp_url, first)
        second = await _dead_letter(amqp_url, STATUS_PROJECTION, event.task_id)

    assert "another cause" in str(second.headers[ERROR_HEADER])
    assert second.headers[FIRST_ERROR_HEADER] == first.headers[ERROR_HEADER]
    assert "the first cause" in str(second.headers[FIRST_ERROR_HEADER])
    assert second.headers[ROUTING_KEY_HEADER] == event.routing_key


async def test_a_letter_of_rabbitmqs_own_moved_back_is_applied(
    amqp_url: str, tasks: AsyncCollection[Json]
) -> None:
    """RabbitMQ's letters (a reject, the delivery limit) name the key in `x-death`."""
    event = _completion()
    async with _topology_broker(amqp_url) as broker:
        await publish_event(broker, event, timeout=TIMEOUT_S)
        await _rejected_by_hand(amqp_url, event.task_id)
    letter = await _dead_letter(amqp_url, STATUS_PROJECTION, event.task_id)
    assert "x-death" in letter.headers
    assert ROUTING_KEY_HEADER not in letter.headers

    async with _topology_broker(amqp_url, consuming=_projection(tasks)):
        await move_back(amqp_url, letter)
        await _completed(tasks, event.task_id)


async def _rejected_by_hand(amqp_url: str, task_id: str) -> None:
    """The projection's copy of the task's event, rejected: RabbitMQ dead-letters it."""
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(STATUS_PROJECTION.name, ensure=False)

        async def taken() -> AbstractIncomingMessage | None:
            return await queue.get(fail=False, timeout=TIMEOUT_S)

        message = await eventually(taken, what="the projection's copy")
        assert message.correlation_id == task_id
        await message.reject(requeue=False)


async def test_a_part_of_a_batch_is_dead_lettered_once_however_often_the_batch_comes_back(
    amqp_url: str, tasks: AsyncCollection[Json]
) -> None:
    """One part unreadable, the other refused by the database until the delivery limit: the
    refused part returns the whole batch each time, and the unreadable part was copied to
    the DLQ at every delivery (six letters of one event)."""
    refusing = MendableCollection(tasks, refusal="Document failed validation")
    unreadable_id = "unreadable-" + _completion().task_id
    refused = _completion()
    parts = [
        OneEvent(json.dumps({"task_id": unreadable_id}).encode(), "m-1", unreadable_id, "acme"),
        OneEvent(refused.model_dump_json().encode(), refused.message_id, refused.task_id, "acme"),
    ]
    async with _topology_broker(amqp_url, consuming=_projection(refusing)):
        await _publish_batch(amqp_url, parts)
        letters = Letters(amqp_url)
        await letters.until(refused.task_id, unreadable_id)
    await letters.take_all()  # the projection stopped: whatever it wrote meanwhile, too
    assert letters.by_task[refused.task_id] == 1
    assert letters.by_task[unreadable_id] == 1


async def _publish_batch(amqp_url: str, events: list[OneEvent]) -> None:
    body, parts = encode_batch(events)
    headers: Json = {"x-schema-version": 2, "x-message-type": "TaskCompleted", BATCH_HEADER: parts}
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(EVENTS.name, ensure=False)
        message = aio_pika.Message(body, headers=headers, message_id="batch-1")
        await exchange.publish(message, routing_key="task.completed", timeout=TIMEOUT_S)
