"""A delivery is never POSTed on a claim whose lease could run out during the POST.

A claim's lease (`NotifierSettings.lease_s`) keeps the attempt from any other copy while
this one POSTs. It used to count from before the failure alert's lookup, and to cover the
POST alone: database time before the POST (the lookup, the claim's write, the keyring read)
ate into it, and a copy arriving when it ran out claimed the attempt and POSTed it too. Now
it counts from just before the claim's write, and an attempt with less of its lease left
than the longest POST is put off unsent, as a delivery whose destination is busy is.

`deliver_webhook` runs here on the real database and posts to an https receiver of the test,
on a clock of the test that the steps before the POST move on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry

from services.notifier.deliveries import Done, Send, Sender, deliver_once, deliver_webhook
from services.notifier.keyring import Keyring
from services.notifier.ledger import DeliveryState, Ledger
from services.notifier.metrics import NotifierMetrics
from services.notifier.registry import FailureAlerts
from services.notifier.sender import ReceiverAnswer
from services.notifier.ssrf import Destination
from shared.contracts import WebhookPurpose, utcnow
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import Receiver
from tests.integration.test_notifier_own_claims import LEASE, Deps, _delivery
from tests.support import sample

receiver = own_claims.receiver  # fixtures
ledger = own_claims.ledger
make_deps = own_claims.make_deps
# Moved on while the keyring is read: 5 s of the lease left, less than the longest request
# (10 s by default).
LATE = LEASE - timedelta(seconds=5)


class Clock:
    """A clock the test moves; to the millisecond, as the database keeps times."""

    def __init__(self) -> None:
        now = utcnow()
        self.now = now.replace(microsecond=now.microsecond // 1000 * 1000)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, by: timedelta) -> None:
        self.now += by


class SlowKeyring(Keyring):
    """The keyring, its read before the POST taking `by` on `clock`."""

    def __init__(self, keyring: Keyring, clock: Clock, by: timedelta) -> None:
        self._keyring, self._clock, self._by = keyring, clock, by

    async def in_force(self, tenant_id: str, *, now: datetime) -> list[str]:
        self._clock.advance(self._by)
        return await self._keyring.in_force(tenant_id, now=now)


class SlowAlerts(FailureAlerts):
    """A tenant's failure alert at `url`, its lookup taking `by` on `clock`."""

    def __init__(self, url: str, clock: Clock, by: timedelta) -> None:
        self._url, self._clock, self._by = url, clock, by

    async def url_of(self, tenant_id: str) -> str | None:
        self._clock.advance(self._by)
        return self._url


@dataclass
class LeaseAtPost:
    """A sender that notes the lease of the attempt's claim when the POST is made."""

    sender: Sender
    ledger: Ledger
    leases: list[datetime | None] = field(default_factory=list)

    async def post(
        self, destination: Destination, *, body: bytes, headers: Mapping[str, str]
    ) -> ReceiverAnswer:
        record = await self.ledger.find(headers["webhook-id"])
        self.leases.append(None if record is None else record.lease_until)
        return await self.sender.post(destination, body=body, headers=headers)


def _lease_short(registry: CollectorRegistry) -> float:
    return sample(registry, "scorebox_webhook_deferred_total", reason="lease_short")


async def test_an_attempt_whose_lease_ran_short_before_the_post_is_put_off_unsent(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    clock, registry = Clock(), CollectorRegistry()
    deps = replace(make_deps("proc-a"), clock=clock, metrics=NotifierMetrics(registry))
    delivery = _delivery(receiver[0])

    decision = await deliver_webhook(
        delivery, deps=replace(deps, keyring=SlowKeyring(deps.keyring, clock, LATE))
    )

    assert receiver[0].requests(delivery.url) == []
    assert isinstance(decision, Send)
    again = decision.command
    assert (again.attempt, again.deferrals) == (1, 1)  # the same attempt, not counted
    assert again.not_before is not None
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.attempt) == (DeliveryState.SENDING, 1)  # left to lapse
    assert _lease_short(registry) == 1

    clock.advance(again.not_before - clock())  # the copy comes back: its claim is taken over
    assert await deliver_webhook(again, deps=deps) == Done("delivered (200)")
    assert len(receiver[0].requests(delivery.url)) == 1


async def test_a_redelivery_whose_lease_ran_short_goes_down_the_ladder_unsent(
    make_deps: Deps, receiver: tuple[Receiver, Any]
) -> None:
    """Put off as a fresh copy is (its consumer slot freed; the consumer carries its
    delivery count on the copy), not held polling for a lease."""
    clock = Clock()
    deps = make_deps("proc-a")
    slow = replace(deps, clock=clock, keyring=SlowKeyring(deps.keyring, clock, LATE))
    delivery = _delivery(receiver[0])

    decision = await deliver_once(delivery, slow, True)

    assert isinstance(decision, Send), decision
    assert (decision.command.attempt, decision.command.deferrals) == (delivery.attempt, 1)
    assert receiver[0].requests(delivery.url) == []


async def test_the_lease_counts_from_the_claim_not_from_the_alert_lookup(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    clock = Clock()
    deps = make_deps("proc-a")
    url = receiver[0].endpoint(200)
    delivery = _delivery(receiver[0]).model_copy(
        update={"purpose": WebhookPurpose.FAILURE_ALERT, "url": url}
    )
    sender = LeaseAtPost(deps.sender, ledger)
    slow = replace(deps, clock=clock, alerts=SlowAlerts(url, clock, LATE), sender=sender)
    claimed_at = clock() + LATE

    decision = await deliver_webhook(delivery, deps=slow)

    assert decision == Done("delivered (200)")
    assert sender.leases == [claimed_at + LEASE]
    assert len(receiver[0].requests(url)) == 1
