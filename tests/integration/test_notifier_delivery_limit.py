"""At the webhook queue's delivery limit the notifier decides, not RabbitMQ; and a delivery
its receiver refused is the tenant's business, recorded but not dead-lettered.

A message whose consumers kept dying or crashing on it (`x-delivery-count` at the queue's
limit) is handed once more, and RabbitMQ dead-letters it if it comes back again: unexplained,
nothing recorded, and a retry its attempt had recorded never published. The handler now POSTs
nothing then: it carries out what the attempt recorded, or records the delivery failed and
dead-letters it with the reason. A receiver's 3xx/4xx (or an unsafe destination) used to be
dead-lettered too, into a DLQ nothing drains and operators are alerted on at depth 1.

The delivery handler runs here as a broker hands it a message (`HandedDelivery`), on the
real database, posting to an https receiver of the test; what it publishes is recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import aio_pika
from faststream.rabbit import RabbitExchange
from pymongo.errors import AutoReconnect

from services.notifier.consumer import subscribe_deliveries
from services.notifier.deliveries import DeliveryDeps
from services.notifier.ledger import Claim, DeliveryState, Ledger
from shared.consumers import Delivery
from shared.contracts import DeliverWebhook, new_id, utcnow
from shared.topology import (
    DELIVERY_COUNT_HEADER,
    DLX,
    EARLIER_DELIVERIES_HEADER,
    ERROR_HEADER,
    TASKS,
    WEBHOOK_DELIVERIES,
)
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import RECEIVER_HOST, Receiver
from tests.integration.test_notifier_own_claims import LEASE, Deps, _delivery
from tests.support import HandedDelivery, HandlerOnly, closed_port

receiver = own_claims.receiver  # fixtures
ledger = own_claims.ledger
make_deps = own_claims.make_deps
LIMIT = WEBHOOK_DELIVERIES.delivery_limit


@dataclass(frozen=True)
class Published:
    exchange: str
    routing_key: str
    message: aio_pika.Message


@dataclass
class RecordingExchange:
    name: str
    published: list[Published]

    async def publish(self, message: aio_pika.Message, routing_key: str, **_: Any) -> None:
        self.published.append(Published(self.name, routing_key, message))


class RecordingBroker(HandlerOnly):
    """Takes the handler as a broker would, and records what it publishes (all confirmed)."""

    def __init__(self) -> None:
        self.published: list[Published] = []

    async def declare_exchange(self, exchange: RabbitExchange) -> RecordingExchange:
        return RecordingExchange(exchange.name, self.published)

    def dead_letters(self) -> list[Published]:
        return [p for p in self.published if p.exchange == DLX.name]


def _handler(
    deps: DeliveryDeps,
) -> tuple[RecordingBroker, Callable[[Delivery], Coroutine[Any, Any, None]]]:
    broker = RecordingBroker()
    subscribe_deliveries(broker, deps, timeout_s=10)  # type: ignore[arg-type]
    return broker, broker.handler


def _at_the_limit(delivery: DeliverWebhook) -> HandedDelivery:
    return HandedDelivery.redelivery(delivery.model_dump_json().encode(), count=LIMIT)


async def _claimed_by_a_dead_process(ledger: Ledger, delivery: DeliverWebhook) -> None:
    """Claimed by another notifier that died in it: its lease has run out, nothing decided."""
    await ledger.register(delivery, now=utcnow())
    long_ago = utcnow() - 2 * LEASE
    await ledger.claim(delivery, process="proc-b", owner="proc-b/1", now=long_ago, lease=LEASE)


async def test_an_undecided_attempt_at_the_limit_is_dead_lettered_with_its_reason_unsent(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    delivery = _delivery(receiver[0])
    await _claimed_by_a_dead_process(ledger, delivery)
    broker, handle = _handler(make_deps("proc-a"))
    message = _at_the_limit(delivery)

    await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []
    [dead] = broker.published
    assert (dead.exchange, dead.routing_key) == (
        DLX.name,
        WEBHOOK_DELIVERIES.dead_letter_routing_key,
    )
    assert dead.message.body == message.body
    reason = str(dead.message.headers[ERROR_HEADER])
    assert f"delivery limit {LIMIT}" in reason
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.last_error, record.dead_letter) == (
        DeliveryState.FAILED,
        reason,
        True,
    )


async def test_a_retry_recorded_before_the_limit_is_published_at_it(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """The attempt recorded `retrying` with its next command, and its consumer died before
    publishing it, every time: at the limit the next attempt goes out, and nothing is POSTed
    or dead-lettered."""
    delivery = _delivery(receiver[0])
    await ledger.register(delivery, now=utcnow())
    await ledger.claim(delivery, process="proc-b", owner="proc-b/1", now=utcnow(), lease=LEASE)
    following = delivery.model_copy(
        update={"attempt": delivery.attempt + 1, "not_before": utcnow(), "message_id": new_id()}
    )
    assert await ledger.mark_retrying(
        delivery, owner="proc-b/1", now=utcnow(), next_delivery=following, error="503", status=503
    )
    broker, handle = _handler(make_deps("proc-a"))
    message = _at_the_limit(delivery)

    await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []
    [sent] = broker.published
    assert (sent.exchange, sent.routing_key) == (TASKS.name, DeliverWebhook.routing_key)
    assert DeliverWebhook.model_validate_json(sent.message.body) == following


async def test_a_limit_reached_while_another_process_holds_the_attempt_waits_for_its_decision(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """Another process's live lease: its decision (here, a retry) is carried out, not overruled
    by giving the delivery up under it."""
    delivery = _delivery(receiver[0])
    await ledger.register(delivery, now=utcnow())
    await ledger.claim(delivery, process="proc-b", owner="proc-b/1", now=utcnow(), lease=LEASE)
    broker, handle = _handler(make_deps("proc-a"))
    message = _at_the_limit(delivery)
    handling = asyncio.create_task(handle(message))
    following = delivery.model_copy(
        update={"attempt": delivery.attempt + 1, "not_before": utcnow(), "message_id": new_id()}
    )
    # Decided before or after the handler's first look: either way it is carried out.
    assert await ledger.mark_retrying(
        delivery, owner="proc-b/1", now=utcnow(), next_delivery=following, error="503", status=503
    )

    await asyncio.wait_for(handling, timeout=30)

    assert message.settled == ["ack"]
    assert broker.dead_letters() == []
    [sent] = broker.published
    assert DeliverWebhook.model_validate_json(sent.message.body) == following


class AwayOnce(Ledger):
    """The ledger, the database away for its first claim."""

    def __init__(self, ledger: Ledger) -> None:  # shares the real one's collection
        self.__dict__.update(ledger.__dict__)
        self.failed = False

    async def claim(
        self,
        delivery: DeliverWebhook,
        *,
        process: str,
        owner: str,
        now: datetime,
        lease: timedelta,
        reclaim_own: bool = False,
    ) -> Claim:
        if not self.failed:
            self.failed = True
            raise AutoReconnect("the database is away")
        return await super().claim(
            delivery, process=process, owner=owner, now=now, lease=lease, reclaim_own=reclaim_own
        )


async def test_a_database_away_at_the_limit_is_waited_out_with_the_delivery_held(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """A copy sent later, as for a database error before the limit, would start its delivery
    count again: the limit would never be reached."""
    delivery = _delivery(receiver[0])
    await _claimed_by_a_dead_process(ledger, delivery)
    away = AwayOnce(ledger)
    broker, handle = _handler(replace(make_deps("proc-a"), ledger=away))
    message = _at_the_limit(delivery)

    await asyncio.wait_for(handle(message), timeout=30)

    assert away.failed
    assert message.settled == ["ack"]
    assert [(p.exchange, p.routing_key) for p in broker.published] == [
        (DLX.name, WEBHOOK_DELIVERIES.dead_letter_routing_key)
    ]


async def test_a_delivery_its_receiver_refuses_is_recorded_failed_and_not_dead_lettered(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """A 3xx/4xx (or an unsafe destination) is the tenant's business: recorded with its
    reason, acked, and kept out of the DLQ, which nothing drains and whose depth alerts the
    operators. A copy of the attempt that comes later does not dead-letter it either."""
    delivery = _delivery(receiver[0]).model_copy(update={"url": receiver[0].endpoint(404)})
    broker, handle = _handler(make_deps("proc-a"))
    body = delivery.model_dump_json().encode()
    first = HandedDelivery(body)

    await asyncio.wait_for(handle(first), timeout=30)

    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.last_status, record.dead_letter) == (
        DeliveryState.FAILED,
        404,
        False,
    )
    assert "404" in (record.last_error or "")
    redelivery = HandedDelivery.redelivery(body)
    await asyncio.wait_for(handle(redelivery), timeout=30)
    assert first.settled == redelivery.settled == ["ack"]
    assert broker.published == []
    assert len(receiver[0].requests(delivery.url)) == 1


def _unanswered_last_attempt(receiver: Receiver) -> DeliverWebhook:
    unreachable = f"https://{RECEIVER_HOST}:{closed_port()}/hooks/never"  # no answer
    return _delivery(receiver).model_copy(
        update={"url": unreachable, "attempt": 3, "max_attempts": 3}
    )


async def test_a_given_up_delivery_of_ours_is_dead_lettered_again_by_a_later_copy(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """Retries spent (or the delivery limit) stay ours: a copy that finds the attempt given up
    and not yet in the DLQ carries the dead-lettering out (its consumer died before it)."""
    delivery = _unanswered_last_attempt(receiver[0])
    await ledger.register(delivery, now=utcnow())
    claim = await ledger.claim(
        delivery, process="proc-b", owner="proc-b/1", now=utcnow(), lease=LEASE
    )
    assert claim.won
    given_up = "gave up after 3 attempt(s); last: no answer"
    failed = await ledger.mark_failed(
        delivery, owner="proc-b/1", now=utcnow(), error=given_up, status=None, dead_letter=True
    )
    assert failed  # and proc-b died before its letter
    broker, handle = _handler(make_deps("proc-a"))

    await asyncio.wait_for(
        handle(HandedDelivery.redelivery(delivery.model_dump_json().encode())), timeout=30
    )

    [dead] = broker.dead_letters()
    assert str(dead.message.headers[ERROR_HEADER]) == given_up
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.dead_letter, record.lettered) == (DeliveryState.FAILED, True, True)


async def test_a_given_up_delivery_is_dead_lettered_once_however_many_copies_follow(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """Every copy of the given-up attempt copied it to the DLQ again, a fresh duplicate too
    (the enqueue race, a copy put off, a replayed retry): one operators' alert per copy for
    one delivery (found in review)."""
    delivery = _unanswered_last_attempt(receiver[0])
    broker, handle = _handler(make_deps("proc-a"))
    body = delivery.model_dump_json().encode()
    duplicate = delivery.model_copy(update={"message_id": new_id()}).model_dump_json().encode()

    for message in (
        HandedDelivery(body),
        HandedDelivery(duplicate),
        HandedDelivery.redelivery(body),
    ):
        await asyncio.wait_for(handle(message), timeout=30)
        assert message.settled == ["ack"]

    [dead] = broker.dead_letters()
    assert "gave up after 3 attempt(s)" in str(dead.message.headers[ERROR_HEADER])


async def test_a_redelivery_sent_again_on_a_database_error_carries_its_count(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """A fresh copy starts its `x-delivery-count` at zero: sent again without the count, a
    delivery that kills its consumer would loop for ever whenever a database error fell on one
    of its redeliveries."""
    delivery = _delivery(receiver[0])
    await _claimed_by_a_dead_process(ledger, delivery)
    away = AwayOnce(ledger)
    broker, handle = _handler(replace(make_deps("proc-a"), ledger=away))
    message = HandedDelivery(
        delivery.model_dump_json().encode(),
        headers={DELIVERY_COUNT_HEADER: 2, EARLIER_DELIVERIES_HEADER: 1},
        redelivered=True,
    )

    await asyncio.wait_for(handle(message), timeout=30)

    assert away.failed
    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []
    [copy] = broker.published
    assert DeliverWebhook.model_validate_json(copy.message.body).attempt == delivery.attempt
    assert copy.message.headers[EARLIER_DELIVERIES_HEADER] == 3  # carried 1, and 2 on it


async def test_the_limit_counts_the_deliveries_carried_from_earlier_copies(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    delivery = _delivery(receiver[0])
    await _claimed_by_a_dead_process(ledger, delivery)
    broker, handle = _handler(make_deps("proc-a"))
    message = HandedDelivery(
        delivery.model_dump_json().encode(),
        headers={DELIVERY_COUNT_HEADER: 1, EARLIER_DELIVERIES_HEADER: LIMIT - 1},
        redelivered=True,
    )

    await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []  # nothing POSTed
    [dead] = broker.dead_letters()
    assert f"delivery limit {LIMIT}" in str(dead.message.headers[ERROR_HEADER])
