"""`declare_topology` on the real broker: idempotent, it removes retired queues and bindings,
and it routes to the notifier only the outcomes it acts on."""

from __future__ import annotations

import aio_pika
import aiormq
import pytest

from shared.bus import publish_event
from shared.contracts import (
    Phase,
    ScoreResult,
    TaskCompleted,
    TaskError,
    TaskFailed,
    event_sequence,
    utcnow,
)
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import (
    EVENTS,
    GATEWAY_TASK_OUTCOMES,
    NOTIFICATIONS,
    RETIRED_QUEUES,
    declare_topology,
)

pytestmark = pytest.mark.integration


async def queue_exists(amqp_url: str, name: str) -> bool:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, passive=True, timeout=10)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True
    finally:
        await connection.close()


async def test_retired_queues_are_deleted_and_declaring_twice_is_harmless(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        for name in RETIRED_QUEUES:
            await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        await connection.close()
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    try:
        await declare_topology(broker)
        await declare_topology(broker)
    finally:
        await broker.stop()

    for name in RETIRED_QUEUES:
        assert not await queue_exists(amqp_url, name), name
    assert await queue_exists(amqp_url, GATEWAY_TASK_OUTCOMES.name)


def _completed(task_id: str, *, callback_url: str | None) -> TaskCompleted:
    return TaskCompleted(
        task_id=task_id,
        attempt=1,
        submitted_at=utcnow(),
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        result=ScoreResult(score=7.5, comment="fine", model="m"),
        has_callback=callback_url is not None,
        callback_url=callback_url,
    )


async def _notifications(amqp_url: str) -> list[str]:
    """Take everything waiting in `scorebox.notifications`: the task id of each message."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(NOTIFICATIONS.name, passive=True, timeout=10)
        taken = []
        while (message := await queue.get(fail=False, timeout=10)) is not None:
            taken.append(message.correlation_id or "")
            await message.ack()
        return taken
    finally:
        await connection.close()


async def test_the_notifier_gets_every_failure_but_only_completions_with_a_callback(
    amqp_url: str,
) -> None:
    # An earlier version's binding, which sent it every completion: declaring removes it.
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        events = await channel.declare_exchange(EVENTS.name, type="topic", durable=True)
        queue = await channel.declare_queue(NOTIFICATIONS.name, passive=True, timeout=10)
        await queue.bind(events, routing_key="task.completed")
    finally:
        await connection.close()
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    try:
        await declare_topology(broker)
        await _notifications(amqp_url)
        plain, with_callback, failed = (
            _completed("plain", callback_url=None),
            _completed("with-callback", callback_url="https://example.com/hook"),
            _failed("failed"),
        )
        for event in (plain, with_callback, failed):
            await publish_event(broker, event, timeout=10)
        # A completion of a version-1 producer: no header, perhaps a callback all the same.
        legacy = _completed("legacy", callback_url=None).model_copy(
            update={"schema_version": 1, "has_callback": None}
        )
        await broker.publish(
            legacy.model_dump_json().encode(),
            exchange=EVENTS,
            routing_key="task.completed",
            correlation_id="legacy",
            headers={"x-schema-version": 1, "x-message-type": "TaskCompleted"},
            timeout=10,
        )

        # Every publish was confirmed, so each is in every queue it was routed to by now.
        assert sorted(await _notifications(amqp_url)) == ["failed", "legacy", "with-callback"]
    finally:
        await broker.stop()


def _failed(task_id: str) -> TaskFailed:
    return TaskFailed(
        task_id=task_id,
        attempt=1,
        submitted_at=utcnow(),
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        error=TaskError(code="model_unavailable", message="down", retryable=True),
        dead_lettered=False,
        has_callback=False,
    )
