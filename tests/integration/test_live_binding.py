"""The gateway's live queue on the real broker: bound to `scorebox.events` only while
requests wait, so a replica nobody waits on receives no task events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from faststream.rabbit import RabbitBroker

from services.gateway.push import BrokerLiveBinding, LiveUpdates, subscribe_live_updates
from shared.bus import publish_event
from shared.contracts import Phase, TaskStarted, event_sequence, new_id, utcnow
from shared.runtime import make_broker, start_broker
from shared.settings import ServiceSettings
from tests.faults.slow_link import SlowLink
from tests.support import eventually

pytestmark = pytest.mark.integration

LINGER_S = 0.3
TIMEOUT_S = 10.0


def started_event(task_id: str) -> TaskStarted:
    now = utcnow()
    return TaskStarted(
        task_id=task_id,
        tenant_id="tenant-a",
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.STARTED),
        attempt=1,
        generation=0,
        submitted_at=now,
        occurred_at=now,
    )


@pytest.fixture
async def replica(amqp_url: str) -> AsyncIterator[tuple[LiveUpdates, RabbitBroker]]:
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url})
    broker = make_broker(settings)
    replica_id = new_id()[:16]
    live = LiveUpdates(
        binding=BrokerLiveBinding(broker, replica_id, timeout_s=TIMEOUT_S), linger_s=LINGER_S
    )
    subscribe_live_updates(broker, live, replica_id=replica_id)
    await start_broker(broker, settings)
    try:
        yield live, broker
    finally:
        await live.stop_listening()
        await broker.stop()


async def heard(live: LiveUpdates, task_id: str) -> bool:
    """Whether the replica heard an event of `task_id`: a new waiter starts with the task's
    recent events. Asked after a later event was heard, which the queue delivers in order."""
    with live.waiting(task_id, "tenant-a") as waiter:
        return await waiter.next(0.01) is not None


async def test_events_reach_the_replica_only_while_requests_wait(
    replica: tuple[LiveUpdates, RabbitBroker],
) -> None:
    live, broker = replica
    unheard = new_id()
    await publish_event(broker, started_event(unheard), timeout=TIMEOUT_S)

    awaited = new_id()
    with live.waiting(awaited, "tenant-a") as waiter:
        await live.listen()
        assert live.listening
        await publish_event(broker, started_event(awaited), timeout=TIMEOUT_S)
        event = await waiter.next(TIMEOUT_S)
        assert event is not None
        assert event.task_id == awaited

    assert not await heard(live, unheard)

    await eventually(lambda: _unbound(live), what="live queue unbound after the last waiter")
    after_unbind = new_id()
    await publish_event(broker, started_event(after_unbind), timeout=TIMEOUT_S)
    marker = new_id()
    with live.waiting(marker, "tenant-a") as waiter:
        await live.listen()
        await publish_event(broker, started_event(marker), timeout=TIMEOUT_S)
        assert await waiter.next(TIMEOUT_S) is not None
    assert not await heard(live, after_unbind)


async def _unbound(live: LiveUpdates) -> bool:
    return not live.listening


async def test_a_waiter_goes_on_without_live_events_when_the_broker_is_not_there() -> None:
    """Binding fails (no broker connection): `listen` logs and returns, the request still
    answers from its reads, and the waiters of the next `BIND_RETRY_S` do not wait for
    another bind."""
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": "amqp://guest:guest@127.0.0.1:9/"})
    broker = make_broker(settings)  # never connected
    live = LiveUpdates(binding=BrokerLiveBinding(broker, new_id()[:16], timeout_s=1.0))

    for _ in range(2):
        with live.waiting(new_id(), "tenant-a"):
            await live.listen()
            assert not live.listening


async def test_a_waiter_goes_on_while_the_broker_connection_is_being_restored(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """The broker went away after the replica connected: aio-pika's robust channel waits
    for the connection to come back before it binds, without end, and every long-poll of
    the replica queued behind that bind past its own deadline. The bind is bounded as a
    whole (its `timeout` covered only the round trip); 60 s here only stops a hang."""
    link = broker_link
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": link.url_through(amqp_url)})
    broker = make_broker(settings)
    replica_id = new_id()[:16]
    live = LiveUpdates(binding=BrokerLiveBinding(broker, replica_id, timeout_s=1.0))
    subscribe_live_updates(broker, live, replica_id=replica_id)
    await start_broker(broker, settings)
    try:
        await link.cut()

        async def reconnecting() -> bool:
            return not await broker.ping(1.0)

        await eventually(reconnecting, what="the broker connection lost")
        with live.waiting(new_id(), "tenant-a"):
            async with asyncio.timeout(60):
                await live.listen()
            assert not live.listening
    finally:
        link.down = False
        await live.stop_listening()
        async with asyncio.timeout(60):
            await broker.stop()


async def test_waiters_are_told_when_the_live_queues_connection_is_back(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """An event published while the live queue's connection was down reached no queue of
    the replica, and nothing told its waiters: a stream heard of it at its next periodic
    re-read, a long-poll at its deadline (review of live updates). They are nudged to
    read again once the connection, its queue and binding are back."""
    link = broker_link
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": link.url_through(amqp_url)})
    broker = make_broker(settings)
    replica_id = new_id()[:16]
    live = LiveUpdates(binding=BrokerLiveBinding(broker, replica_id, timeout_s=TIMEOUT_S))
    subscribe_live_updates(broker, live, replica_id=replica_id)
    await start_broker(broker, settings)
    try:
        with live.waiting(new_id(), "tenant-a") as waiter:
            await live.listen()
            waiter.missed = False  # what its bind may have missed, read again
            await link.cut()

            async def reconnecting() -> bool:
                return not await broker.ping(1.0)

            await eventually(reconnecting, what="the broker connection lost")
            link.down = False

            async def told() -> bool:
                return waiter.missed

            await eventually(told, timeout_s=60, what="the waiter told of the reconnection")
    finally:
        link.down = False
        await live.stop_listening()
        async with asyncio.timeout(60):
            await broker.stop()
