"""A publish whose connection stalls is reported unconfirmed, never as a cancellation.

When the broker stops answering (a partition, a frozen node behind a load balancer),
aiormq's heartbeat finds the link dead and closes the connection, rejecting every confirm
still awaited with a `CancelledError` as the reason, though no task was cancelled. Passed
through, it escaped every handler that catches `Exception`: a submission answered 500 and
left to the outbox, a consumer's delivery left unsettled. On the real broker, reached
through `SlowLink`, which holds the broker's frames back; heartbeats of 1 s find the stall
within seconds, well before the publish's own timeout."""

from __future__ import annotations

import asyncio

import pytest
from faststream.rabbit import RabbitQueue

from shared.bus import PublishUnconfirmed, publish_event
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import Phase, TaskStarted, event_sequence, new_id, utcnow
from shared.runtime import make_broker, start_broker
from shared.settings import ServiceSettings
from tests.faults.slow_link import SlowLink

PUBLISH_TIMEOUT_S = 60.0  # longer than the heartbeat takes to find the stall


def _event() -> TaskStarted:
    now = utcnow()
    return TaskStarted(
        task_id=new_id(),
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.STARTED),
        attempt=1,
        submitted_at=now,
        occurred_at=now,
    )


async def test_a_publish_on_a_stalled_connection_is_unconfirmed(
    amqp_url: str, broker_link: SlowLink
) -> None:
    link = broker_link
    proxied = link.url_through(amqp_url, query="heartbeat=1")
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": proxied})
    broker = make_broker(settings)
    await start_broker(broker, settings)
    try:
        await publish_event(broker, _event(), timeout=PUBLISH_TIMEOUT_S)  # a healthy link
        link.reply_delay_s = 3600.0
        with pytest.raises(PublishUnconfirmed):
            await publish_event(broker, _event(), timeout=PUBLISH_TIMEOUT_S)
    finally:
        link.reply_delay_s = 0.0
        await broker.stop()


async def test_stopping_while_the_broker_stalls_is_bounded(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """Each close waited for the broker's CloseOk, up to the heartbeat: a minute and more
    with the broker stalled, past any orchestrator's grace period (then SIGKILL)."""
    link = broker_link
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": link.url_through(amqp_url)})
    broker = make_broker(settings, graceful_timeout_s=1.0)
    await start_broker(broker, settings)
    link.reply_delay_s = 3600.0
    try:
        async with asyncio.timeout(30):  # a hang guard: each close is bounded by 1 s now
            await broker.stop()
    finally:
        link.reply_delay_s = 0.0


async def test_cancelling_the_consumers_of_a_stalled_broker_is_bounded_too(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """The consumers were cancelled one after another, each waiting `BROKER_TIMEOUT_S` (10 s)
    for its CancelOk: a service with three consuming channels spent 30 s there alone, past
    the grace period compose gives it, before the stop's own bounded steps."""
    link = broker_link
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": link.url_through(amqp_url)})
    broker = make_broker(settings, graceful_timeout_s=1.0)
    for prefetch in (1, 2, 3):  # a channel each
        queue = RabbitQueue(f"test.stall.{new_id()[:8]}", auto_delete=True)
        consume(broker, queue, prefetch=prefetch)(_never_called)
    await start_broker(broker, settings)
    link.reply_delay_s = 3600.0
    try:
        async with asyncio.timeout(20):  # a hang guard: three cancels of 10 s each took 30
            await broker.stop()
    finally:
        link.reply_delay_s = 0.0


async def test_stopping_with_a_delivery_stuck_in_hand_is_bounded_as_a_whole(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """Every step of a stop had a graceful timeout of its own: a delivery that never
    finished, with the broker stalled, made the stop last four of them (cancel, wait for the
    delivery, two closes), 40 s here; the cancel and the wait share one now, and the closes
    run together: about 20 s. The guard sits halfway, well clear of either on a busy
    machine (it was 6.5 s between 4 and 8)."""
    link = broker_link
    broker = await _holding_a_delivery_forever(link.url_through(amqp_url), graceful_timeout_s=10.0)
    link.reply_delay_s = 3600.0
    try:
        async with asyncio.timeout(30):
            await broker.stop()
    finally:
        link.reply_delay_s = 0.0


async def test_a_stop_begun_earlier_gives_the_deliveries_in_hand_what_is_left_of_the_grace(
    amqp_url: str,
) -> None:
    """A service that waits for work of its own before `stop()` (the scorer: its decisions)
    passes when its stop began: the deliveries in hand get what is left of the graceful
    timeout, not a whole one more. Here nothing is left: the stop does not wait for the
    delivery that never finishes (it waited all 30 s, found in review)."""
    broker = await _holding_a_delivery_forever(amqp_url, graceful_timeout_s=30.0)
    begun_at = asyncio.get_running_loop().time() - 30.0
    async with asyncio.timeout(15):  # a hang guard: the whole grace again took 30 s
        await broker.stop(begun_at=begun_at)


async def _holding_a_delivery_forever(
    amqp_url: str, *, graceful_timeout_s: float
) -> ScoreboxBroker:
    """A started broker whose consumer holds one delivery and never finishes it."""
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url})
    broker = make_broker(settings, graceful_timeout_s=graceful_timeout_s)
    queue = RabbitQueue(f"test.stall.{new_id()[:8]}", auto_delete=True)
    in_hand = asyncio.Event()

    @consume(broker, queue)
    async def never_finishes(delivery: Delivery) -> None:
        in_hand.set()
        await asyncio.Event().wait()

    await start_broker(broker, settings)
    await broker.publish(b"{}", queue.name)
    await asyncio.wait_for(in_hand.wait(), 30)
    return broker


async def _never_called(delivery: Delivery) -> None:
    raise AssertionError("nothing is published to these queues")
