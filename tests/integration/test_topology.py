"""`declare_topology` on the real broker: idempotent, it removes retired queues and bindings,
and it routes to the notifier only the outcomes it acts on."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import aiormq
import pytest
from pamqp.common import FieldTable

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
from shared.runtime import DependencyUnreachable, make_broker, start_broker
from shared.settings import ServiceSettings
from shared.topology import (
    DLQ_DELIVERY_LIMIT,
    DLX,
    EVENTS,
    GATEWAY_TASK_OUTCOMES,
    NOTIFICATIONS,
    RETIRED_QUEUES,
    SCORE_REQUESTS,
    declare_topology,
)
from tests.faults.slow_link import SlowLink

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


async def test_a_retired_queue_still_holding_messages_is_left_with_a_warning(
    amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The retired queues were deleted on upgrade even when they held messages: the dead
    letters in `scorebox.result-cache.dlq` were lost. Such a queue is kept, named in a
    warning with its depth, and the empty ones are deleted still."""
    holding = "scorebox.result-cache.dlq"
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel(publisher_confirms=True)
        for name in RETIRED_QUEUES:
            await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
        for body in (b"dead letter 1", b"dead letter 2"):
            await channel.default_exchange.publish(aio_pika.Message(body), routing_key=holding)
    finally:
        await connection.close()

    try:
        await _declare_topology(amqp_url)

        assert await queue_depth(amqp_url, holding) == 2
        assert f"{holding} is retired but still holds 2 message(s)" in caplog.text
        for name in RETIRED_QUEUES:
            if name != holding:
                assert not await queue_exists(amqp_url, name), name
    finally:
        await _delete_queue(amqp_url, holding)  # this module's vhost is shared


async def queue_depth(amqp_url: str, name: str) -> int:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True, timeout=10)
        return queue.declaration_result.message_count or 0
    finally:
        await connection.close()


async def _delete_queue(amqp_url: str, name: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        await (await connection.channel()).queue_delete(name)


async def _declare_topology(amqp_url: str) -> None:
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    try:
        await declare_topology(broker)
    finally:
        await broker.stop()


async def _declare(amqp_url: str, name: str, arguments: FieldTable) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        quorum: FieldTable = {"x-queue-type": "quorum", **arguments}
        await channel.declare_queue(name, durable=True, arguments=quorum, timeout=10)
    finally:
        await connection.close()


async def test_a_dlq_is_declared_with_a_delivery_limit_out_of_reach(amqp_url: str) -> None:
    """On RabbitMQ 4.0 to 4.2 every look at a dead letter counts against the default limit
    of 20; the DLQ carries its own. The broker refuses a declaration whose arguments differ
    from the queue's, so it tells which limit the DLQ has."""
    await _declare_topology(amqp_url)
    dlq = SCORE_REQUESTS.dead_letter_routing_key
    await _declare(amqp_url, dlq, {"x-delivery-limit": DLQ_DELIVERY_LIMIT})
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
        await _declare(amqp_url, dlq, {})


async def test_a_dlq_of_an_earlier_version_is_kept_as_it_is(
    amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    dlq = SCORE_REQUESTS.dead_letter_routing_key
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        await (await connection.channel()).queue_delete(dlq)  # this module's vhost is shared
    await _declare(amqp_url, dlq, {})  # as versions before the limit declared it
    await _declare_topology(amqp_url)  # no PRECONDITION_FAILED

    assert f"{dlq} was declared without a delivery limit" in caplog.text
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel(publisher_confirms=True)
        dlx = await channel.get_exchange(DLX.name)
        await dlx.publish(aio_pika.Message(b"dead"), routing_key=dlq, mandatory=True)
        queue = await channel.declare_queue(dlq, passive=True, timeout=10)
        message = await queue.get(fail=False, timeout=10)
        assert message is not None  # still bound to the DLX
        assert message.body == b"dead"
        await message.ack()
    finally:
        await connection.close()


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
    await _declare_topology(amqp_url)  # the queue, whichever tests of the module ran before
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


async def test_a_broker_that_stops_answering_fails_the_start_within_its_timeout(
    amqp_url: str,
) -> None:
    """Connected, then every reply held back: declaring the topology gives up after
    `STARTUP_TIMEOUT_S` (the service exits and its supervisor restarts it) instead of
    waiting for ever."""
    target = urlsplit(amqp_url)
    link = SlowLink((target.hostname or "127.0.0.1", target.port or 5672))
    await link.start()
    through_link = target._replace(netloc=f"{target.netloc.rsplit(':', 1)[0]}:{link.port}")
    settings = ServiceSettings.model_validate(
        {"RABBITMQ_URL": urlunsplit(through_link), "STARTUP_TIMEOUT_S": "1"}
    )
    broker = make_broker(settings)
    try:
        await broker.connect()
        link.reply_delay_s = 3600.0
        starting = asyncio.create_task(start_broker(broker, settings))
        done, _ = await asyncio.wait({starting}, timeout=30)
        assert starting in done, "the start still waits on the broker"
        refused = starting.exception()
        assert isinstance(refused, DependencyUnreachable)
        assert "(declaring the topology) not done within STARTUP_TIMEOUT_S" in str(refused)
    finally:
        link.reply_delay_s = 0.0
        await link.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(broker.stop(), 5)
