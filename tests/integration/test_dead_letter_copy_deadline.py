"""A copy to a DLQ the broker will not take does not hold its delivery: on the real broker and
topology, the status projection with its DLQ deleted (every copy comes back unroutable).

`keep_dead_lettering` tried the copy until the broker confirmed it, the handler holding the
delivery meanwhile: once the consumer's prefetch was full of such deliveries, it applied
nothing more (found in review). The copy is now tried for `letter_deadline_s`, then the
delivery is returned as failed, and RabbitMQ dead-letters it at the queue's delivery limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from services.status.app import subscribe_projection
from services.status.settings import StatusSettings
from shared.consumers import ScoreboxBroker
from shared.contracts import TaskAccepted, TaskCompleted, new_id, utcnow
from shared.group_writes import GroupWriter
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import STATUS_PROJECTION, declare_topology
from tests.integration.test_failed_deliveries import (
    _completion,
    _delete_queue,
    _publish_body,
    _ready,
)
from tests.support import HandedDelivery, eventually, sample

pytestmark = pytest.mark.integration

Json = dict[str, Any]
PREFETCH = 2
# Short, for the test: each delivery of an unreadable event is held this long at most.
LETTER_DEADLINE_S = 0.3


@pytest.fixture
async def tasks(mongo: Any, db_prefix: str) -> AsyncIterator[AsyncCollection[Json]]:
    client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
    yield client[f"{db_prefix}_copy_deadline"]["tasks"]
    await client.close()


async def test_unreadable_events_the_dlq_cannot_take_do_not_stop_the_projection(
    amqp_url: str, tasks: AsyncCollection[Json]
) -> None:
    """As many unreadable events as the prefetch, then a valid one: the valid one is applied,
    and every delivery of the unreadable ones is returned as failed (none held), until
    RabbitMQ takes them out of the queue at its delivery limit."""
    broker = make_broker(
        ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}),
        prefetch=PREFETCH,
        name="copy-deadline-test",
    )
    subscribe_projection(
        broker,
        GroupWriter(tasks),
        StatusSettings(),
        letter_deadline_s=LETTER_DEADLINE_S,
        clock=utcnow,
    )
    await broker.connect()
    try:
        await declare_topology(broker)
        await _delete_queue(amqp_url, STATUS_PROJECTION.dead_letter_routing_key)
        await broker.start()
        for _ in range(PREFETCH):
            await _publish_body(amqp_url, TaskCompleted.routing_key, new_id(), b"not json")
        later = _completion()
        body = later.model_dump_json().encode()
        await _publish_body(amqp_url, later.routing_key, later.task_id, body)

        async def applied() -> bool:
            return await tasks.find_one({"_id": later.task_id}) is not None

        await eventually(applied, timeout_s=60, what="the valid event behind them applied")

        # Each unreadable event is handed out once and again at every return the queue's
        # delivery limit allows (every RabbitMQ version counts a return as failed).
        every_delivery = PREFETCH * (STATUS_PROJECTION.delivery_limit + 1)

        async def all_returned_and_gone() -> bool:
            returned = _settled(broker, "requeue") >= every_delivery
            return returned and await _ready(amqp_url, STATUS_PROJECTION) == 0

        await eventually(
            all_returned_and_gone,
            timeout_s=60,
            what="every delivery of the unreadable events returned, and none left in the queue",
        )
        assert _settled(broker, "ack") == 1  # the valid event; nothing acked unlettered
        assert _settled(broker, "unsettled") == 0
        assert _settled(broker, "failed") == 0
    finally:
        await broker.stop()
        restoring = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
        async with restoring:
            await restoring.connect()
            await declare_topology(restoring)  # the DLQ back


def _beyond_int64() -> bytes:
    """A valid acceptance whose metadata BSON cannot encode: the projection cannot apply it."""
    now = utcnow()
    accepted = TaskAccepted(task_id=new_id(), tenant_id="acme", sequence=0, submitted_at=now)
    return json.dumps(accepted.model_dump(mode="json") | {"metadata": {"n": 10**19}}).encode()


@pytest.mark.parametrize(
    ("routing_key", "body"),
    [
        (TaskCompleted.routing_key, b"not json"),
        (TaskAccepted.routing_key, _beyond_int64()),
    ],
    ids=["unreadable", "unapplicable"],
)
async def test_a_delivery_whose_copy_is_refused_is_returned_as_failed_not_acked(
    amqp_url: str,
    tasks: AsyncCollection[Json],
    caplog: pytest.LogCaptureFixture,
    routing_key: str,
    body: bytes,
) -> None:
    """Both of the projection's dead-letter paths: returned as failed once the deadline
    passes, and that is its only settlement (an ack after it would say it was lettered)."""
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    # Called here as the consumer would: the broker is connected, never started.
    handler = subscribe_projection(
        broker,
        GroupWriter(tasks),
        StatusSettings(),
        letter_deadline_s=LETTER_DEADLINE_S,
        clock=utcnow,
    )
    delivery = HandedDelivery(body, routing_key=routing_key, message_id=new_id())
    caplog.set_level(logging.WARNING, logger="scorebox")
    await broker.connect()
    try:
        await declare_topology(broker)
        await _delete_queue(amqp_url, STATUS_PROJECTION.dead_letter_routing_key)
        async with asyncio.timeout(60):  # held while the broker refuses the copy: the bug
            await handler(delivery)
        await declare_topology(broker)  # the DLQ back
    finally:
        await broker.stop()
    assert delivery.settled == ["reject(requeue=True)"]
    refused = f"did not take the dead letter of {delivery.message_id}"
    assert any(refused in record.getMessage() for record in caplog.records)


def _settled(broker: ScoreboxBroker, how: str) -> float:
    """How many deliveries of the projection's queue its handler left `how`."""
    registry = broker.metrics.registry
    return sample(registry, "scorebox_deliveries_total", queue=STATUS_PROJECTION.name, settled=how)
