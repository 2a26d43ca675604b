"""Tenants with hanging receivers leave a tenant with nothing in flight a slot.

The bound per tenant (`test_notifier_tenant_limit.py`) defaults to half of
`WEBHOOK_CONCURRENCY`: two tenants at it held every slot, the consumer's prefetch was full,
and a third tenant's healthy webhook was not even handed to the notifier until one of their
POSTs timed out. Now the consumer holds a reserve beyond `WEBHOOK_CONCURRENCY` (a quarter of
it, at least 1), which a tenant already holding a slot may not take (`hosts.TenantSlots`): it
is put off as over its bound is, counted as `tenant_reserve`.

The notifier runs in-process on the real broker and database. The hanging tenants' receiver
holds its requests, on a port of its own for each; the healthy tenant's answers at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import pytest

from services.notifier.deliveries import Send, deliver_once
from services.notifier.hosts import TenantSlots
from services.notifier.settings import NotifierSettings
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import Receiver, _tls
from tests.integration.test_notifier_own_claims import Deps, _delivery
from tests.integration.test_notifier_tenant_limit import Tenants, notifier_with_receivers
from tests.support import eventually

receiver = own_claims.receiver  # fixtures
ledger = own_claims.ledger
make_deps = own_claims.make_deps
CONCURRENCY = 4  # WEBHOOK_CONCURRENCY_PER_TENANT left unset: its default, half of it (2)
HELD_PORTS = 5
Document = dict[str, Any]


@pytest.fixture
async def tenants(
    amqp_url: str, mongo: Any, db_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Tenants]:
    server_tls, ca_file = _tls(tmp_path_factory.mktemp("tenant-reserve"))
    settings = NotifierSettings.model_validate(
        {
            "RABBITMQ_URL": amqp_url,
            "MONGO_URL": mongo.url,
            "MONGO_DB_PREFIX": db_prefix,
            "WEBHOOK_CONCURRENCY": str(CONCURRENCY),
            "WEBHOOK_CONCURRENCY_PER_HOST": "2",
            "WEBHOOK_TIMEOUT_S": "300",  # hanging receivers: held POSTs stay in flight
            "WEBHOOK_ALLOWED_TEST_HOSTS": "127.0.0.1",
            "WEBHOOK_CA_FILE": str(ca_file),
        }
    )
    assert (settings.per_tenant, settings.tenant_reserve) == (CONCURRENCY // 2, 1)
    async with notifier_with_receivers(settings, server_tls, held_ports=HELD_PORTS) as tenants:
        yield tenants


def _held(tenants: Tenants) -> list[str]:
    """A held URL on each port of the hanging receiver: one destination each."""
    slow = tenants.notifier.slow
    return [slow.held().replace(f":{slow.port}/", f":{p}/", 1) for p in tenants.held_ports]


async def _in_flight(tenants: Tenants, count: int, what: str) -> None:
    async def reached() -> bool:
        return tenants.notifier.slow.in_flight >= count

    await eventually(reached, what=what)


async def test_two_tenants_at_their_bound_leave_a_third_tenant_a_slot(tenants: Tenants) -> None:
    notifier = tenants.notifier
    held = _held(tenants)
    await tenants.publish("tenant-a", held[:2])
    await tenants.publish("tenant-c", held[2:4])
    await _in_flight(tenants, CONCURRENCY, "tenants A and C at their bounds")

    healthy = await tenants.publish("tenant-b", [notifier.fast.endpoint(200)])

    await eventually(
        lambda: notifier.all_delivered(healthy),
        timeout_s=15,
        what="tenant B's webhook delivered while tenants A and C hang",
    )
    assert notifier.slow.in_flight == CONCURRENCY  # theirs still held


async def test_a_tenant_holding_a_slot_is_refused_the_reserve(tenants: Tenants) -> None:
    """Every shared slot taken (A at its bound, C and D one each): C's next webhook, under
    its own bound, is put off rather than take the reserve, which B then gets."""
    notifier = tenants.notifier
    held = _held(tenants)
    await tenants.publish("tenant-a", held[:2])
    await tenants.publish("tenant-c", held[2:3])
    await tenants.publish("tenant-d", held[3:4])
    await _in_flight(tenants, CONCURRENCY, "every shared slot taken")

    await tenants.publish("tenant-c", held[4:])

    async def refused() -> bool:
        reason = {"reason": "tenant_reserve"}
        return await notifier.metric("scorebox_webhook_deferred_total", reason) >= 1

    await eventually(refused, what="tenant C's second webhook refused the reserve")
    healthy = await tenants.publish("tenant-b", [notifier.fast.endpoint(200)])
    await eventually(
        lambda: notifier.all_delivered(healthy),
        timeout_s=15,
        what="tenant B's webhook delivered in the reserve",
    )
    assert notifier.slow.in_flight == CONCURRENCY  # C's second never sent
    assert notifier.slow.requests(held[4]) == []


async def test_a_redelivery_refused_the_reserve_goes_down_the_ladder_rather_than_held(
    make_deps: Deps, receiver: tuple[Receiver, Any]
) -> None:
    """Held (as a redelivery put off is), it kept its consumer slot, the reserve's very own,
    for a tenant already holding one: an idle tenant's webhook was not handed out (found in
    review). It goes down the wait ladder as a fresh copy does, its count carried."""
    deps = replace(make_deps("notifier-a"), tenants=TenantSlots(2, shared=4))
    delivery = _delivery(receiver[0]).model_copy(update={"tenant_id": "c"})
    with ExitStack() as hanging:  # tenant a at its bound, c and d one each
        for tenant in ("a", "a", "c", "d"):
            hanging.enter_context(deps.tenants.taking(tenant))
        decision = await deliver_once(delivery, deps, True)

    assert isinstance(decision, Send), decision
    assert (decision.command.attempt, decision.command.deferrals) == (delivery.attempt, 1)
    assert decision.command.not_before is not None
