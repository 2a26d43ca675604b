"""Composition root of the notifier: webhooks for task outcomes and failure alerts."""

from __future__ import annotations

import logging
import os
import random
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta

from fastapi import FastAPI

from services.notifier.admin_api import webhook_dead_letter_routes
from services.notifier.api import tenant_routes
from services.notifier.consumer import send_delivery, subscribe_deliveries, subscribe_notifications
from services.notifier.dead_letters import WebhookDeadLetters
from services.notifier.deliveries import DeliveryDeps, RetryPolicy, Sender
from services.notifier.hosts import Slots, TenantSlots, host_share
from services.notifier.keyring import Keyring
from services.notifier.ledger import Ledger
from services.notifier.metrics import NotifierMetrics
from services.notifier.notifications import NotificationDeps
from services.notifier.registry import Callbacks, FailureAlerts
from services.notifier.sender import WebhookSender, make_ssl_context
from services.notifier.settings import NotifierSettings
from services.notifier.ssrf import CaresResolver, Resolver, TestHostAddresses, WebhookGuard
from shared.clock_offset import DatabaseClock
from shared.consumers import ScoreboxBroker
from shared.contracts import DeliverWebhook, new_id
from shared.dead_letters import DeadLetterWalker
from shared.http import (
    warn_if_internal_routes_open,
)
from shared.runtime import (
    MongoClient,
    clock_watch_of,
    make_broker,
    make_mongo,
    prepare_service_database,
    start_broker,
)
from shared.service_app import internal_service_app
from shared.topology import WEBHOOK_DELIVERIES

log = logging.getLogger("scorebox.notifier")


def create_app(
    settings: NotifierSettings,
    *,
    broker: ScoreboxBroker | None = None,
    mongo: MongoClient | None = None,
    resolver: Resolver | None = None,
    sender: Sender | None = None,
    clock: Callable[[], datetime] | None = None,
    rng: random.Random | None = None,
) -> FastAPI:
    """Wire the notifier: broker (both consumers) + database + webhook sender + internal API.

    `resolver` and `sender` replace DNS and the HTTP client (tests); the SSRF guard stays.
    """
    clock = clock or DatabaseClock()  # the time its records are judged by
    # At stop, a delivery in hand may be resolving its host, posting, then recording and
    # publishing what it decided: cut short, its redelivery would post again.
    broker = broker or make_broker(
        settings,
        prefetch=settings.deliveries_in_hand,  # the reserve for idle tenants included
        name="notifier",
        graceful_timeout_s=settings.stop_grace_s,
    )
    mongo = mongo or make_mongo(settings)
    database = settings.database_name("notifier")
    callbacks = Callbacks(mongo, database)
    alerts = FailureAlerts(mongo, database)
    keyring = Keyring(mongo, database)
    ledger = Ledger(mongo, database, retention=timedelta(seconds=settings.delivery_retention_s))
    system_resolver = CaresResolver(timeout_s=settings.dns_timeout_s)
    lookups: Resolver = resolver or system_resolver
    test_host_table = settings.test_host_table
    if test_host_table:  # tests and `WEBHOOKS=local make run` only: before DNS
        lookups = TestHostAddresses(test_host_table, lookups)
    guard = WebhookGuard(lookups, allowed_test_hosts=settings.test_hosts)

    async def enqueue(delivery: DeliverWebhook) -> None:
        await send_delivery(broker, delivery, timeout=settings.broker_timeout_s, now=clock())

    subscribe_notifications(
        broker,
        NotificationDeps(
            callbacks=callbacks,
            alerts=alerts,
            ledger=ledger,
            enqueue=enqueue,
            clock=clock,
            max_attempts=settings.max_attempts,
            callback_retention=timedelta(seconds=settings.callback_retention_s),
            unclaimed_outcome_ttl=timedelta(seconds=settings.unclaimed_outcome_ttl_s),
        ),
        timeout_s=settings.broker_timeout_s,
        clock=clock,
    )
    subscribe_deliveries(
        broker,
        DeliveryDeps(
            ledger=ledger,
            keyring=keyring,
            alerts=alerts,
            guard=guard,
            sender=sender
            or WebhookSender(
                ssl_context=make_ssl_context(settings.ca_file),
                connect_timeout_s=settings.connect_timeout_s,
                timeout_s=settings.timeout_s,
                max_response_bytes=settings.max_response_bytes,
            ),
            policy=RetryPolicy(base_s=settings.retry_base_s, cap_s=settings.retry_cap_s),
            clock=clock,
            rng=rng or random.Random(),  # noqa: S311 - jitter, not cryptography
            owner=f"{socket.gethostname()}:{os.getpid()}:{new_id()[:8]}",
            lease=timedelta(seconds=settings.lease_s),
            hosts=Slots(settings.per_host),
            host_shares=Slots(host_share(settings.per_host)),
            tenants=TenantSlots(settings.per_tenant, shared=settings.concurrency),
            post_time=timedelta(seconds=settings.timeout_s),
            max_attempts=settings.max_attempts,
            metrics=NotifierMetrics(broker.metrics.registry),
        ),
        timeout_s=settings.broker_timeout_s,
    )

    dead_letters = WebhookDeadLetters(
        DeadLetterWalker(broker, WEBHOOK_DELIVERIES, timeout_s=settings.broker_timeout_s),
        broker,
        clock=clock,
        timeout_s=settings.broker_timeout_s,
    )

    async def ensure_indexes() -> None:
        await callbacks.ensure_indexes()
        await ledger.ensure_indexes()

    clock_watch = clock_watch_of(mongo, settings, broker.metrics, service="notifier", clock=clock)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.test_hosts:
            log.warning(
                "WEBHOOK_ALLOWED_TEST_HOSTS=%s: webhooks may reach these NON-PUBLIC hosts. "
                "This is for tests only; unset it in any real deployment.",
                ",".join(sorted(settings.test_hosts)),
            )
        if test_host_table:
            log.warning(
                "WEBHOOK_TEST_HOST_ADDRESSES=%s: these names are answered from this table, "
                "not DNS. This is for tests only; unset it in any real deployment.",
                ",".join(
                    f"{name}={address}"
                    for name, addresses in sorted(test_host_table.items())
                    for address in addresses
                ),
            )
        warn_if_internal_routes_open(settings.internal_api_key, "notifier")
        await prepare_service_database(
            mongo,
            settings,
            ensure_indexes,
            service="notifier",
            clock_watch=clock_watch,
        )
        await start_broker(broker, settings)
        clock_watch.start()
        yield
        await broker.stop()
        await clock_watch.stop()
        await mongo.close()
        await system_resolver.close()

    app = internal_service_app(
        "Scorebox notifier",
        service="notifier",
        settings=settings,
        broker=broker,
        mongo=mongo,
        lifespan=lifespan,
        admin_key=settings.admin_api_key,
    )
    app.include_router(
        tenant_routes(
            keyring=keyring,
            alerts=alerts,
            guard=guard,
            clock=clock,
            rotation_grace=timedelta(seconds=settings.secret_rotation_grace_s),
            internal_key=settings.internal_api_key,
        )
    )
    app.include_router(
        webhook_dead_letter_routes(dead_letters=dead_letters, admin_key=settings.admin_api_key)
    )
    return app
