"""One tenant cannot take every delivery slot of a notifier, whatever its destinations.

The bound per destination (`test_notifier_host_limit.py`) is keyed on scheme, host and port:
a tenant whose callback URLs named as many ports (or wildcard DNS names) of one hanging
receiver as the notifier has slots filled all `WEBHOOK_CONCURRENCY` of them, and every other
tenant's webhooks waited behind it. Now at most `WEBHOOK_CONCURRENCY_PER_TENANT` POSTs of one
tenant are in flight; a delivery over it is deferred down the wait ladder, unclaimed and not
counted as an attempt.

The notifier runs in-process on the real broker and database. Tenant A's receiver holds its
requests, on a port of its own for each of them; tenant B's answers at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from pymongo import AsyncMongoClient

from services.notifier.app import create_app as create_notifier
from services.notifier.consumer import send_delivery
from services.notifier.settings import NotifierSettings
from shared.contracts import DeliverWebhook, utcnow
from shared.runtime import make_broker
from tests.integration.test_notifier import RECEIVER_HOST, Receiver, TableResolver, _tls
from tests.integration.test_notifier_host_limit import (
    CountingReceiver,
    Notifier,
    _callback,
    _serving,
)
from tests.support import eventually, running

CONCURRENCY = 4
PER_HOST = 2
PER_TENANT = 2
HELD_WEBHOOKS = 6  # tenant A's, each to a destination of its own: more than the slots
HEALTHY_WEBHOOKS = 3  # tenant B's
Document = dict[str, Any]


@dataclass(frozen=True)
class Tenants:
    notifier: Notifier
    held_ports: list[int]  # the ports of tenant A's receiver: one destination each

    async def publish(self, tenant_id: str, urls: list[str]) -> list[DeliverWebhook]:
        commands = [_callback(url).model_copy(update={"tenant_id": tenant_id}) for url in urls]
        broker = make_broker(self.notifier.settings)
        async with broker:
            await broker.connect()
            for command in commands:
                await send_delivery(broker, command, now=utcnow(), timeout=10)
        return commands


@contextlib.asynccontextmanager
async def _serving_on_ports(receiver: Receiver, tls: Any, ports: int) -> AsyncIterator[list[int]]:
    """`receiver` listening on `ports` ports of 127.0.0.1 at once."""
    app = web.Application()
    app.router.add_post("/hooks/{name}", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for _ in range(ports):
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
    listening = [address[1] for address in runner.addresses]
    receiver.port = listening[0]
    try:
        yield listening
    finally:
        await runner.cleanup()


@pytest.fixture
async def tenants(
    amqp_url: str, mongo: Any, db_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Tenants]:
    server_tls, ca_file = _tls(tmp_path_factory.mktemp("tenant-limit"))
    settings = NotifierSettings.model_validate(
        {
            "RABBITMQ_URL": amqp_url,
            "MONGO_URL": mongo.url,
            "MONGO_DB_PREFIX": db_prefix,
            "WEBHOOK_CONCURRENCY": str(CONCURRENCY),
            "WEBHOOK_CONCURRENCY_PER_HOST": str(PER_HOST),
            "WEBHOOK_CONCURRENCY_PER_TENANT": str(PER_TENANT),
            "WEBHOOK_TIMEOUT_S": "300",  # a held POST stays in flight: no attempt fails
            "WEBHOOK_ALLOWED_TEST_HOSTS": "127.0.0.1",
            "WEBHOOK_CA_FILE": str(ca_file),
        }
    )
    async with notifier_with_receivers(settings, server_tls, held_ports=HELD_WEBHOOKS) as tenants:
        yield tenants


@contextlib.asynccontextmanager
async def notifier_with_receivers(
    settings: NotifierSettings, server_tls: Any, *, held_ports: int
) -> AsyncIterator[Tenants]:
    """The notifier running on `settings`, a receiver holding its requests on `held_ports`
    ports of its own, and one answering at once."""
    app = create_notifier(settings, resolver=TableResolver({RECEIVER_HOST: ["127.0.0.1"]}))
    database: AsyncMongoClient[Document] = AsyncMongoClient(settings.mongo_url, tz_aware=True)
    slow = CountingReceiver()
    try:
        async with (
            _serving_on_ports(slow, server_tls, held_ports) as ports,
            _serving(Receiver(), server_tls) as fast,
            running(app) as api,
        ):
            deliveries = database[settings.database_name("notifier")]["deliveries"]
            try:
                yield Tenants(Notifier(api, settings, slow, fast, deliveries), ports)
            finally:
                slow.release.set()  # let the notifier's held POSTs finish before it stops
    finally:
        await database.close()


async def test_a_tenant_at_its_bound_leaves_the_other_tenants_their_slots(
    tenants: Tenants,
) -> None:
    notifier = tenants.notifier
    slow, fast = notifier.slow, notifier.fast
    held_urls = [
        slow.held().replace(f":{slow.port}/", f":{port}/", 1) for port in tenants.held_ports
    ]
    assert len({url.split("/")[2] for url in held_urls}) == HELD_WEBHOOKS  # all destinations
    held = await tenants.publish("tenant-a", held_urls)

    async def saturated() -> bool:
        return slow.in_flight >= PER_TENANT

    await eventually(saturated, what="tenant A's slots all in flight")
    healthy = await tenants.publish(
        "tenant-b", [fast.endpoint(200) for _ in range(HEALTHY_WEBHOOKS)]
    )

    await eventually(
        lambda: notifier.all_delivered(healthy),
        timeout_s=20,
        what="tenant B's webhooks delivered while tenant A's receiver holds its requests",
    )
    assert slow.in_flight == PER_TENANT  # tenant A's still held, no more of them
    deferred = await notifier.metric("scorebox_webhook_deferred_total", {"reason": "tenant_busy"})
    assert deferred > 0
    slow.release.set()
    delivered = await eventually(
        lambda: notifier.all_delivered(held), what="every webhook of tenant A delivered"
    )

    assert slow.peak == PER_TENANT
    assert [len(slow.requests(c.url)) for c in held] == [1] * HELD_WEBHOOKS
    assert [len(fast.requests(c.url)) for c in healthy] == [1] * HEALTHY_WEBHOOKS
    assert {(r["attempt"], r["last_error"]) for r in delivered} == {(1, None)}
