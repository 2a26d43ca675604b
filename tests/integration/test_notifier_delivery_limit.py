"""At the webhook queue's delivery limit the notifier decides, not RabbitMQ; and a delivery
its receiver refused is the tenant's business, recorded but not dead-lettered.

A message whose consumers kept dying or crashing on it (`x-delivery-count` at the queue's
limit) is handed once more, and RabbitMQ dead-letters it if it comes back again: unexplained,
nothing recorded, and a retry its attempt had recorded never published. The handler now POSTs
nothing then: it carries out what the attempt recorded, or records the delivery failed and
dead-letters it with the reason. A receiver's 3xx/4xx (or an unsafe destination) used to be
dead-lettered too, into a DLQ nothing drains and operators are alerted on at depth 1.

The delivery handler runs here as a broker hands it a message (`HandedDelivery`), on the
real database, posting to an https receiver of the test, and publishing on the real broker:
the delivery commands it sent are read from a queue bound to their routes, its dead letters
from the queue's real DLQ, and every publish it made, whatever its route, from the broker's
publish counter.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import aio_pika
import pytest
from faststream.rabbit import RabbitBroker
from pymongo.errors import AutoReconnect

from services.notifier.consumer import subscribe_deliveries
from services.notifier.deliveries import DeliveryDeps
from services.notifier.ledger import Claim, DeliveryState, Ledger
from shared.consumers import Delivery, ScoreboxBroker
from shared.contracts import DeliverWebhook, new_id, utcnow
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import (
    DELAY,
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
from tests.support import HandedDelivery, closed_port, drain, watching

receiver = own_claims.receiver  # fixtures
ledger = own_claims.ledger
make_deps = own_claims.make_deps
LIMIT = WEBHOOK_DELIVERIES.delivery_limit
Handler = Callable[[Delivery], Awaitable[None]]
Message = aio_pika.abc.AbstractIncomingMessage


class Notifier:
    """The notifier's delivery handler on a broker built as the notifier builds its own, and
    what that broker took from it."""

    def __init__(
        self, broker: ScoreboxBroker, amqp_url: str, sends: aio_pika.abc.AbstractQueue
    ) -> None:
        self._broker, self._amqp_url, self._sends = broker, amqp_url, sends
        self._seen: Counter[str] = Counter()

    def handler(self, deps: DeliveryDeps) -> Handler:
        """The handler `subscribe_deliveries` registers with `deps`, called here as the
        queue's consumer would call it (nothing consumes the queue)."""
        return subscribe_deliveries(self._broker, deps, timeout_s=10)

    async def stop_consuming(self) -> None:
        """The broker stopping as a service's stop begins (`stop_consuming`, the first step
        of its `stop()`): consumers cancelled, the deliveries in hand going on, and
        publishing still open to them."""
        await self._broker.stop_consuming()

    def published(self) -> dict[str, int]:
        """Every publish of the broker since the last look, by exchange (`(default)` for the
        default one), whatever the broker answered: its `scorebox_publishes_total`, counted
        by `shared.bus.send_raw`, which every publish of ours goes through. `sent` sees the
        delivery commands' routes only."""
        [family] = self._broker.metrics.publishes.collect()
        now: Counter[str] = Counter()
        for sample in family.samples:
            if sample.name == "scorebox_publishes_total":
                now[sample.labels["exchange"]] += int(sample.value)
        since, self._seen = now - self._seen, now
        return dict(since)

    async def sent(self) -> list[Message]:
        """The delivery commands published since the last look, now (`scorebox.tasks`) or
        down the wait ladder (`scorebox.delay`); each confirmed publish is in the queue by the
        time the handler returns."""
        found = []
        while (message := await self._sends.get(no_ack=True, fail=False, timeout=10)) is not None:
            found.append(message)
        return found

    async def letters(self, delivery: DeliverWebhook) -> list[Message]:
        """The letters of `delivery` in the webhook queue's DLQ (the DLQ drained: the
        module's earlier tests' letters go with it)."""
        letters = await drain(self._amqp_url, WEBHOOK_DELIVERIES.dead_letter_routing_key)
        return [
            letter
            for letter in letters
            if DeliverWebhook.model_validate_json(letter.body).delivery_id == delivery.delivery_id
        ]


@asynccontextmanager
async def _watching_sends(amqp_url: str) -> AsyncIterator[aio_pika.abc.AbstractQueue]:
    """A queue of its own, for the block, bound to every route of a delivery command."""
    key = DeliverWebhook.routing_key
    async with watching(amqp_url, (TASKS.name, key), (DELAY.name, f"*.{key}")) as queue:
        yield queue


@pytest.fixture
async def notifier(amqp_url: str, task_broker: RabbitBroker) -> AsyncIterator[Notifier]:
    """On the module's vhost, whose topology `task_broker` declared."""
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url})
    broker = make_broker(settings, name="notifier", graceful_timeout_s=1.0)
    await broker.connect()
    try:
        async with _watching_sends(amqp_url) as sends:
            yield Notifier(broker, amqp_url, sends)
    finally:
        await broker.stop()


def _at_the_limit(delivery: DeliverWebhook) -> HandedDelivery:
    return HandedDelivery.redelivery(delivery.model_dump_json().encode(), count=LIMIT)


async def _claimed_by_a_dead_process(ledger: Ledger, delivery: DeliverWebhook) -> None:
    """Claimed by another notifier that died in it: its lease has run out, nothing decided."""
    await ledger.register(delivery, now=utcnow())
    long_ago = utcnow() - 2 * LEASE
    await ledger.claim(delivery, process="proc-b", owner="proc-b/1", now=long_ago, lease=LEASE)


async def test_an_undecided_attempt_at_the_limit_is_dead_lettered_with_its_reason_unsent(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    delivery = _delivery(receiver[0])
    await _claimed_by_a_dead_process(ledger, delivery)
    handle = notifier.handler(make_deps("proc-a"))
    message = _at_the_limit(delivery)

    await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []
    assert notifier.published() == {DLX.name: 1}  # its letter, nothing else
    [dead] = await notifier.letters(delivery)
    assert dead.body == message.body
    reason = str(dead.headers[ERROR_HEADER])
    assert f"delivery limit {LIMIT}" in reason
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.last_error, record.dead_letter) == (
        DeliveryState.FAILED,
        reason,
        True,
    )


async def test_a_retry_recorded_before_the_limit_is_published_at_it(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
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
    handle = notifier.handler(make_deps("proc-a"))
    message = _at_the_limit(delivery)

    await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []
    [sent] = await notifier.sent()
    assert (sent.exchange, sent.routing_key) == (TASKS.name, DeliverWebhook.routing_key)
    assert DeliverWebhook.model_validate_json(sent.body) == following
    assert notifier.published() == {TASKS.name: 1}  # that command alone
    assert await notifier.letters(delivery) == []


async def test_a_limit_reached_while_another_process_holds_the_attempt_waits_for_its_decision(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """Another process's live lease: its decision (here, a retry) is carried out, not overruled
    by giving the delivery up under it."""
    delivery = _delivery(receiver[0])
    await ledger.register(delivery, now=utcnow())
    await ledger.claim(delivery, process="proc-b", owner="proc-b/1", now=utcnow(), lease=LEASE)
    handle = notifier.handler(make_deps("proc-a"))
    message = _at_the_limit(delivery)
    handling = asyncio.ensure_future(handle(message))
    following = delivery.model_copy(
        update={"attempt": delivery.attempt + 1, "not_before": utcnow(), "message_id": new_id()}
    )
    # Decided before or after the handler's first look: either way it is carried out.
    assert await ledger.mark_retrying(
        delivery, owner="proc-b/1", now=utcnow(), next_delivery=following, error="503", status=503
    )

    await asyncio.wait_for(handling, timeout=30)

    assert message.settled == ["ack"]
    assert await notifier.letters(delivery) == []
    [sent] = await notifier.sent()
    assert DeliverWebhook.model_validate_json(sent.body) == following


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
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """A copy sent later, as for a database error before the limit, would start its delivery
    count again: the limit would never be reached."""
    delivery = _delivery(receiver[0])
    await _claimed_by_a_dead_process(ledger, delivery)
    away = AwayOnce(ledger)
    handle = notifier.handler(replace(make_deps("proc-a"), ledger=away))
    message = _at_the_limit(delivery)

    await asyncio.wait_for(handle(message), timeout=30)

    assert away.failed
    assert message.settled == ["ack"]
    assert notifier.published() == {DLX.name: 1}  # its letter: no copy sent later
    [dead] = await notifier.letters(delivery)
    assert dead.body == message.body


async def test_a_delivery_its_receiver_refuses_is_recorded_failed_and_not_dead_lettered(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """A 3xx/4xx (or an unsafe destination) is the tenant's business: recorded with its
    reason, acked, and kept out of the DLQ, which nothing drains and whose depth alerts the
    operators. A copy of the attempt that comes later does not dead-letter it either."""
    delivery = _delivery(receiver[0]).model_copy(update={"url": receiver[0].endpoint(404)})
    handle = notifier.handler(make_deps("proc-a"))
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
    assert notifier.published() == {}
    assert await notifier.letters(delivery) == []
    assert len(receiver[0].requests(delivery.url)) == 1


def _unanswered_last_attempt(receiver: Receiver) -> DeliverWebhook:
    unreachable = f"https://{RECEIVER_HOST}:{closed_port()}/hooks/never"  # no answer
    return _delivery(receiver).model_copy(
        update={"url": unreachable, "attempt": 3, "max_attempts": 3}
    )


async def test_a_given_up_delivery_of_ours_is_dead_lettered_again_by_a_later_copy(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
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
    handle = notifier.handler(make_deps("proc-a"))

    await asyncio.wait_for(
        handle(HandedDelivery.redelivery(delivery.model_dump_json().encode())), timeout=30
    )

    [dead] = await notifier.letters(delivery)
    assert str(dead.headers[ERROR_HEADER]) == given_up
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.dead_letter, record.lettered) == (DeliveryState.FAILED, True, True)


async def test_a_given_up_delivery_is_dead_lettered_once_however_many_copies_follow(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """Every copy of the given-up attempt copied it to the DLQ again, a fresh duplicate too
    (the enqueue race, a copy put off, a replayed retry): one operators' alert per copy for
    one delivery (found in review)."""
    delivery = _unanswered_last_attempt(receiver[0])
    handle = notifier.handler(make_deps("proc-a"))
    body = delivery.model_dump_json().encode()
    duplicate = delivery.model_copy(update={"message_id": new_id()}).model_dump_json().encode()

    for message in (
        HandedDelivery(body),
        HandedDelivery(duplicate),
        HandedDelivery.redelivery(body),
    ):
        await asyncio.wait_for(handle(message), timeout=30)
        assert message.settled == ["ack"]

    [dead] = await notifier.letters(delivery)
    assert "gave up after 3 attempt(s)" in str(dead.headers[ERROR_HEADER])


async def test_a_redelivery_sent_again_on_a_database_error_carries_its_count(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """A fresh copy starts its `x-delivery-count` at zero: sent again without the count, a
    delivery that kills its consumer would loop for ever whenever a database error fell on one
    of its redeliveries."""
    delivery = _delivery(receiver[0])
    await _claimed_by_a_dead_process(ledger, delivery)
    away = AwayOnce(ledger)
    handle = notifier.handler(replace(make_deps("proc-a"), ledger=away))
    message = HandedDelivery(
        delivery.model_dump_json().encode(),
        headers={DELIVERY_COUNT_HEADER: 2, EARLIER_DELIVERIES_HEADER: 1},
        redelivered=True,
    )

    await asyncio.wait_for(handle(message), timeout=30)

    assert away.failed
    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []
    [copy] = await notifier.sent()  # down the wait ladder, a little later
    assert copy.exchange == DELAY.name
    assert DeliverWebhook.model_validate_json(copy.body).attempt == delivery.attempt
    assert copy.headers[EARLIER_DELIVERIES_HEADER] == 3  # carried 1, and 2 on it
    assert await notifier.letters(delivery) == []


async def test_the_limit_counts_the_deliveries_carried_from_earlier_copies(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    delivery = _delivery(receiver[0])
    await _claimed_by_a_dead_process(ledger, delivery)
    handle = notifier.handler(make_deps("proc-a"))
    message = HandedDelivery(
        delivery.model_dump_json().encode(),
        headers={DELIVERY_COUNT_HEADER: 1, EARLIER_DELIVERIES_HEADER: LIMIT - 1},
        redelivered=True,
    )

    await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []  # nothing POSTed
    [dead] = await notifier.letters(delivery)
    assert f"delivery limit {LIMIT}" in str(dead.headers[ERROR_HEADER])
