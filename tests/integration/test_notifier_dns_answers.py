"""What a callback host's DNS answered decides whether its given-up delivery is dead-lettered.

A name server that answers for good about the name, that it does not exist (NXDOMAIN) or that
it has no address (NOERROR with an empty answer, NODATA: an apex with only MX or TXT
records), speaks for the tenant's URL: the delivery is retried, then recorded failed without
a letter, as a refusal of its receiver is. NODATA used to be taken for our resolver failing,
and every task of such a tenant put a letter in `scorebox.webhook-deliveries.dlq`, which the
operators are alerted on. A name server failing or refusing may be our resolver's doing: the
operators' DLQ still keeps it.

`deliver_webhook` runs here on the real database with the real c-ares resolver, asking the
test's name server on 127.0.0.1 (`tests/fake_dns.py`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from services.notifier.deliveries import (
    DeliveryDecision,
    DeliveryDeps,
    Done,
    GiveUp,
    Send,
    deliver_webhook,
)
from services.notifier.ledger import DeliveryState, Ledger
from services.notifier.ssrf import CaresResolver, WebhookGuard
from shared.contracts import DeliverWebhook, WebhookPurpose, new_id, utcnow
from tests.fake_dns import fake_name_server
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier_own_claims import Deps

receiver = own_claims.receiver  # fixtures
ledger = own_claims.ledger
make_deps = own_claims.make_deps
MAX_ATTEMPTS = 2


@pytest.fixture
async def dns_guard() -> AsyncIterator[WebhookGuard]:
    """The SSRF guard, resolving through c-ares and the test's name server."""
    async with fake_name_server({}) as (_, address):
        resolver = CaresResolver(timeout_s=2, nameservers=[address])
        try:
            yield WebhookGuard(resolver)
        finally:
            await resolver.close()


def _callback(url: str) -> DeliverWebhook:
    return DeliverWebhook(
        task_id=new_id(),
        delivery_id=f"msg_{uuid.uuid4().hex}",
        purpose=WebhookPurpose.CALLBACK,
        url=url,
        event_type="task.completed",
        payload={"type": "task.completed"},
        max_attempts=MAX_ATTEMPTS,
    )


async def _every_attempt(delivery: DeliverWebhook, deps: DeliveryDeps) -> DeliveryDecision:
    """Deliver each attempt as soon as the previous one decided it (the wait ladder skipped);
    what the last one decided."""
    current = delivery
    while isinstance(decision := await deliver_webhook(current, deps=deps), Send):
        current = decision.command.model_copy(update={"not_before": None})
    return decision


@pytest.mark.parametrize(
    ("host", "answer", "decision", "dead_letter"),
    [
        pytest.param("mx-only.example.nodata", "has no address", Done, False, id="nodata"),
        pytest.param("hooks.misspelt.nx", "does not exist", Done, False, id="nxdomain"),
        pytest.param("hooks.example.servfail", "did not resolve", GiveUp, True, id="servfail"),
    ],
)
async def test_what_dns_answered_for_the_host_decides_the_dead_letter(
    make_deps: Deps,
    ledger: Ledger,
    dns_guard: WebhookGuard,
    host: str,
    answer: str,
    decision: type[Done | GiveUp],
    dead_letter: bool,
) -> None:
    delivery = _callback(f"https://{host}/hook")
    await ledger.register(delivery, now=utcnow())

    last = await _every_attempt(delivery, replace(make_deps("proc-a"), guard=dns_guard))

    record = await ledger.find(delivery.delivery_id)
    assert isinstance(last, decision), last
    assert record is not None
    assert record.state is DeliveryState.FAILED
    assert record.attempt == MAX_ATTEMPTS
    assert record.last_error is not None
    assert f"{host} {answer}" in record.last_error
    assert record.dead_letter is dead_letter
