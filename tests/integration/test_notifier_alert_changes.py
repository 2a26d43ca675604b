"""A failure alert's delivery follows its tenant's setting at every attempt.

The alert's URL travelled in the delivery command, read once when the task failed: a tenant
that removed or changed it while a delivery was being retried still had every retry POSTed
to the old URL. Now each attempt reads the setting (the notifier's own `failure_alerts`):
removed, the delivery is cancelled unsent; changed, it goes to the new URL. `deliver_webhook`
runs here on the real database and posts to an https receiver of the test.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError
from standardwebhooks import Webhook

from services.notifier.deliveries import DeliveryDeps, Done, Send, deliver_webhook
from services.notifier.keyring import Keyring
from services.notifier.ledger import DeliveryState, Ledger
from services.notifier.registry import FailureAlerts
from shared.contracts import DeliverWebhook, WebhookPurpose, new_id, utcnow
from tests.faults.slow_link import SlowLink
from tests.integration import test_notifier_acceptances as acceptances
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import Receiver
from tests.integration.test_notifier_own_claims import Deps

receiver = own_claims.receiver  # fixtures
notifier_db = acceptances.notifier_db
ledger = own_claims.ledger
make_deps = own_claims.make_deps
Mongo = AsyncMongoClient[dict[str, Any]]


@pytest.fixture
def alerts(notifier_db: tuple[Mongo, str]) -> FailureAlerts:
    return FailureAlerts(*notifier_db)


def _alert(tenant_id: str, url: str) -> DeliverWebhook:
    return DeliverWebhook(
        task_id=new_id(),
        tenant_id=tenant_id,
        delivery_id=f"msg_{uuid.uuid4().hex}",
        purpose=WebhookPurpose.FAILURE_ALERT,
        url=url,
        event_type="task.failed",
        payload={"type": "task.failed"},
    )


async def _first_attempt_failed(
    tenant_id: str, url: str, *, alerts: FailureAlerts, ledger: Ledger, deps: DeliveryDeps
) -> DeliverWebhook:
    """Register `url` as the tenant's alert and deliver to it once; the retry it decided."""
    await alerts.register(tenant_id, url, now=utcnow())
    first = _alert(tenant_id, url)
    await ledger.register(first, now=utcnow())
    retry = await deliver_webhook(first, deps=deps)
    assert isinstance(retry, Send), retry
    return retry.command


async def test_a_removed_failure_alert_cancels_its_retry_unsent(
    make_deps: Deps, ledger: Ledger, alerts: FailureAlerts, receiver: tuple[Receiver, Any]
) -> None:
    tenant_id, url = f"removed-{new_id()[:8]}", receiver[0].endpoint(503)
    deps = make_deps("proc-a")
    retry = await _first_attempt_failed(tenant_id, url, alerts=alerts, ledger=ledger, deps=deps)
    await alerts.remove(tenant_id)

    cancelled = await deliver_webhook(retry, deps=deps)
    copy = await deliver_webhook(retry, deps=deps, redelivered=True)

    assert cancelled == Done("cancelled: the tenant removed its failure alert")
    assert copy == Done("already cancelled")  # settled, not sent on or held
    record = await ledger.find(retry.delivery_id)
    assert record is not None
    assert (record.state, record.attempt) == (DeliveryState.CANCELLED, 2)
    assert len(receiver[0].requests(url)) == 1


async def test_a_failure_alert_retries_to_its_url_until_it_changes_then_to_the_new_one(
    make_deps: Deps,
    ledger: Ledger,
    alerts: FailureAlerts,
    notifier_db: tuple[Mongo, str],
    receiver: tuple[Receiver, Any],
) -> None:
    tenant_id = f"changed-{new_id()[:8]}"
    old_url, new_url = receiver[0].endpoint(503), receiver[0].endpoint(200)
    deps = make_deps("proc-a")
    second = await _first_attempt_failed(
        tenant_id, old_url, alerts=alerts, ledger=ledger, deps=deps
    )

    unchanged = await deliver_webhook(second, deps=deps)
    assert isinstance(unchanged, Send), unchanged
    await alerts.register(tenant_id, new_url, now=utcnow())
    delivered = await deliver_webhook(unchanged.command, deps=deps)

    assert delivered == Done("delivered (200)")
    assert len(receiver[0].requests(old_url)) == 2
    [request] = receiver[0].requests(new_url)
    secret = await Keyring(*notifier_db).current(tenant_id, now=utcnow())
    Webhook(secret.secret).verify(request.body, request.headers)
    assert request.headers["webhook-id"] == second.delivery_id


async def test_a_retry_that_cannot_read_the_setting_posts_nothing_and_holds_no_lease(
    make_deps: Deps,
    ledger: Ledger,
    alerts: FailureAlerts,
    database_link: SlowLink,
    db_prefix: str,
    receiver: tuple[Receiver, Any],
) -> None:
    """The setting cannot be read (its database away): the attempt fails before its claim,
    which the consumer answers by sending the command again a little later. No POST is made
    to a URL that may be gone, and no lease is left for a later try to wait out."""
    tenant_id, url = f"unread-{new_id()[:8]}", receiver[0].endpoint(503, 200)
    deps = make_deps("proc-a")
    retry = await _first_attempt_failed(tenant_id, url, alerts=alerts, ledger=ledger, deps=deps)
    client: Mongo = AsyncMongoClient(database_link.mongo_url, tz_aware=True, timeoutMS=2000)
    unreadable = replace(deps, alerts=FailureAlerts(client, f"{db_prefix}_notifier"))
    try:
        await database_link.cut()
        with pytest.raises(PyMongoError):
            await deliver_webhook(retry, deps=unreadable)
        record = await ledger.find(retry.delivery_id)
        assert record is not None
        assert record.state is DeliveryState.RETRYING
        assert len(receiver[0].requests(url)) == 1

        database_link.down = False
        by_another_process = replace(unreadable, owner="proc-b")
        delivered = await deliver_webhook(retry, deps=by_another_process)
    finally:
        await client.close()

    assert delivered == Done("delivered (200)")
    assert len(receiver[0].requests(url)) == 2
