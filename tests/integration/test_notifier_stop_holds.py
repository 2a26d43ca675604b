"""A webhook redelivery held for another process's lease is handed on at a stop, not sent.

A redelivery whose attempt another notifier holds waits in hand until that lease ends. During
a stop's grace it kept waiting, then claimed the attempt and POSTed seconds before the stop
cut it off: its outcome never recorded, the attempt stayed `sending` under this dead
process's lease, and the next replica POSTed it again once that lease ended (found in
review). Once the stop begins, such a delivery sends a copy of its attempt, due when it was
to try again and carrying its lost deliveries, and is acked. The delivery handler runs as a
broker hands it a message, on the real database and a real broker whose stop has begun: the
copy is read from a queue bound to the delivery commands' routes."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from services.notifier.consumer import MOVED_BACK_REASON, is_moved_back_letter
from services.notifier.ledger import Ledger
from shared.contracts import DeliverWebhook, utcnow
from shared.topology import DELAY, EARLIER_DELIVERIES_HEADER, ERROR_HEADER, WEBHOOK_DELIVERIES
from tests.integration import test_notifier_delivery_limit as delivery_limit
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import Receiver
from tests.integration.test_notifier_delivery_limit import Notifier
from tests.integration.test_notifier_own_claims import LEASE, Deps, _delivery
from tests.support import HandedDelivery

pytestmark = pytest.mark.integration

receiver = own_claims.receiver  # fixtures
ledger = own_claims.ledger
make_deps = own_claims.make_deps
notifier = delivery_limit.notifier


async def test_a_redelivery_held_for_a_lease_is_handed_on_at_a_stop_unsent(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    delivery = _delivery(receiver[0])
    await ledger.register(delivery, now=utcnow())
    claim = await ledger.claim(
        delivery, process="proc-b", owner="proc-b/1", now=utcnow(), lease=LEASE
    )
    assert claim.won
    handle = notifier.handler(make_deps("proc-a"))
    await notifier.stop_consuming()
    message = HandedDelivery.redelivery(delivery.model_dump_json().encode(), count=2)

    await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    [published] = await notifier.sent()
    assert published.exchange == DELAY.name  # due when the lease ends
    copy = DeliverWebhook.model_validate_json(published.body)
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert record.lease_until is not None
    assert (copy.attempt, copy.not_before) == (delivery.attempt, record.lease_until)
    assert published.headers[EARLIER_DELIVERIES_HEADER] == 2
    assert receiver[0].requests(delivery.url) == []


@pytest.mark.parametrize(
    ("letter", "reason"),
    [
        ({ERROR_HEADER: "gave up earlier"}, "gave up earlier"),
        (
            {"x-death": [{"queue": WEBHOOK_DELIVERIES.name, "reason": "delivery_limit"}]},
            MOVED_BACK_REASON,
        ),
    ],
    ids=["ours", "rabbitmqs"],
)
async def test_a_moved_back_letter_held_at_a_stop_is_handed_on_as_a_letter_still(
    make_deps: Deps,
    ledger: Ledger,
    receiver: tuple[Receiver, Any],
    letter: dict[str, Any],
    reason: str,
    notifier: Notifier,
) -> None:
    """Held on through the stop (a first fix spared it, as it spares one at its delivery
    limit), it claimed and POSTed once the lease ended, in the stop's grace (found in
    review). Its copy carries the letter's reason, so that it is still read as one."""
    delivery = _delivery(receiver[0])
    await ledger.register(delivery, now=utcnow())
    claim = await ledger.claim(
        delivery, process="proc-b", owner="proc-b/1", now=utcnow(), lease=timedelta(seconds=3)
    )
    assert claim.won
    handle = notifier.handler(make_deps("proc-a"))
    await notifier.stop_consuming()
    message = HandedDelivery(
        delivery.model_dump_json().encode(),
        headers={"x-delivery-count": 1, **letter},
        redelivered=True,
    )

    await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    [published] = await notifier.sent()
    assert is_moved_back_letter(published.headers)
    assert published.headers[ERROR_HEADER] == reason
    assert receiver[0].requests(delivery.url) == []
