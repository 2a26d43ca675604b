"""Composition root of the gateway: the public HTTP API in front of the task flow."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI
from faststream import AckPolicy
from faststream.rabbit import RabbitBroker
from faststream.rabbit.annotations import RabbitMessage
from httpx_aiohttp import AiohttpTransport
from pydantic import ValidationError

from services.gateway.admin_api import admin_routes
from services.gateway.api import GatewayDeps, score_routes
from services.gateway.auth import Authenticator, caller_dependency
from services.gateway.batches import Batches
from services.gateway.batches_api import batch_routes
from services.gateway.cache import ResultCache
from services.gateway.deadletters import DeadLetterQueue
from services.gateway.errors import Unavailable
from services.gateway.events_api import event_routes
from services.gateway.keys import ApiKeys, bootstrap_key
from services.gateway.keys_api import key_admin_routes
from services.gateway.limits import (
    InFlight,
    RateLimiter,
    install_body_timeout,
    subscribe_task_outcomes,
)
from services.gateway.publisher import TaskPublisher
from services.gateway.push import LiveUpdates, subscribe_live_updates
from services.gateway.settings import GatewaySettings
from services.gateway.status_client import StatusClient
from services.gateway.submissions import Submissions
from services.gateway.submit import Publisher, remember_result, sweep_outbox
from services.gateway.webhooks_api import NotifierClient, make_notifier_http, webhook_routes
from shared.contracts import DEFAULT_TENANT, TaskCompleted, new_id, utcnow
from shared.http import health_router, install_problem_handlers
from shared.runtime import (
    MongoClient,
    broker_ready,
    make_broker,
    make_mongo,
    mongo_ready,
    retry_until,
    start_broker,
)
from shared.topology import RESULT_CACHE

log = logging.getLogger("scorebox.gateway")


def make_status_http(settings: GatewaySettings) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.AsyncClient(
        transport=AiohttpTransport(limits=limits),
        timeout=httpx.Timeout(settings.status_timeout_s),
        limits=limits,
    )


def create_app(
    settings: GatewaySettings,
    *,
    broker: RabbitBroker | None = None,
    mongo: MongoClient | None = None,
    status_http: httpx.AsyncClient | None = None,
    notifier_http: httpx.AsyncClient | None = None,
    clock: Callable[[], datetime] = utcnow,
) -> FastAPI:
    """Wire the gateway: broker + database + status client + HTTP app, closed in lifespan."""
    broker = broker or make_broker(settings)
    mongo = mongo or make_mongo(settings)
    http = status_http or make_status_http(settings)
    notifier = notifier_http or make_notifier_http(settings)
    submissions = Submissions(mongo, settings.database_name("gateway"))
    cache = ResultCache(
        mongo, settings.database_name("gateway"), timedelta(seconds=settings.result_cache_ttl_s)
    )
    publisher = TaskPublisher(broker, timeout_s=settings.broker_timeout_s)
    keys = ApiKeys(mongo, settings.database_name("gateway"))
    authenticator = Authenticator(keys, cache_ttl_s=settings.api_key_cache_ttl_s, clock=clock)
    rate_limiter = RateLimiter(
        mongo,
        settings.database_name("gateway"),
        per_minute=settings.rate_limit_per_min,
        clock=clock,
    )
    in_flight = InFlight(
        mongo, settings.database_name("gateway"), max_per_tenant=settings.max_in_flight_per_tenant
    )
    # Every public route takes its `Caller` from this dependency (API key, then rate limit).
    authenticated = caller_dependency(authenticator, rate_limiter)
    status = StatusClient(http, base_url=settings.status_url)
    batches = Batches(mongo, settings.database_name("gateway"))
    live = live_updates(broker, settings)
    deps = GatewayDeps(
        settings=settings,
        submissions=submissions,
        cache=cache,
        publisher=publisher,
        status=status,
        clock=clock,
        in_flight=in_flight,
        live=live,
    )

    subscribe_result_cache(broker, deps)
    subscribe_task_outcomes(broker, in_flight)

    async def ensure_indexes() -> None:
        await submissions.ensure_indexes()
        await batches.ensure_indexes()
        await cache.ensure_indexes()
        await keys.ensure_indexes()
        await rate_limiter.ensure_indexes()
        await in_flight.ensure_indexes()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await retry_until(ensure_indexes, what="MongoDB", deadline_s=settings.startup_timeout_s)
        if settings.bootstrap_api_key is not None:
            token = settings.bootstrap_api_key.get_secret_value()
            await bootstrap_key(keys, token, tenant_id=DEFAULT_TENANT, now=clock())
        await start_broker(broker, settings)
        sweeper = asyncio.create_task(keep_outbox_swept(deps, publisher))
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        await broker.stop()
        await http.aclose()
        await notifier.aclose()
        await mongo.close()

    app = FastAPI(
        title="Scorebox",
        summary="Asynchronous LLM text scoring: submit a text, poll for its score.",
        version="1",
        lifespan=lifespan,
    )
    install_problem_handlers(app)
    install_body_timeout(app, settings.request_body_timeout_s)
    app.include_router(
        health_router(
            {
                "rabbitmq": broker_ready(broker, settings.broker_timeout_s),
                "mongodb": mongo_ready(mongo, settings.mongo_timeout_s),
            }
        )
    )
    app.include_router(score_routes(deps, authenticated))
    app.include_router(
        push_and_batch_routes(
            deps, batches=batches, publisher=publisher, status=status, authenticated=authenticated
        )
    )
    app.include_router(
        webhook_routes(NotifierClient(notifier, base_url=settings.notifier_url), authenticated)
    )
    app.include_router(
        key_admin_routes(keys, settings.admin_api_key, clock=clock, forget=authenticator.forget)
    )
    app.include_router(
        admin_routes(DeadLetterQueue(broker, publisher, clock), settings.admin_api_key)
    )
    return app


def live_updates(broker: RabbitBroker, settings: GatewaySettings) -> LiveUpdates:
    """This replica's waiters, woken by its own queue of task events (SSE and long-polls)."""
    live = LiveUpdates(
        max_waiters=settings.live_max_waiters,
        max_per_tenant=settings.live_max_waiters_per_tenant,
    )
    subscribe_live_updates(broker, live, replica_id=new_id()[:16])
    return live


def push_and_batch_routes(
    deps: GatewayDeps,
    *,
    batches: Batches,
    publisher: TaskPublisher,
    status: StatusClient,
    authenticated: Any,
) -> APIRouter:
    """`/v1/scores/{id}/events` (SSE) and `/v1/batches`."""
    router = APIRouter()
    router.include_router(event_routes(deps, deps.live, status, authenticated))
    router.include_router(
        batch_routes(
            deps, batches=batches, publisher=publisher, status=status, authenticated=authenticated
        )
    )
    return router


def subscribe_result_cache(broker: RabbitBroker, deps: GatewayDeps) -> None:
    @broker.subscriber(RESULT_CACHE.queue, ack_policy=AckPolicy.MANUAL)
    async def remember_completed_result(message: RabbitMessage) -> None:
        try:
            event = TaskCompleted.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("dead-lettering an unreadable task.completed: %s", error)
            await message.reject(requeue=False)
            return
        await remember_result(
            event.task_id,
            event.result,
            submissions=deps.submissions,
            cache=deps.cache,
            now=deps.clock(),
        )
        await message.ack()


async def keep_outbox_swept(deps: GatewayDeps, publisher: Publisher) -> None:
    """Send interrupted submissions at start-up and then periodically."""
    grace = timedelta(seconds=deps.settings.outbox_grace_s)
    while True:
        try:
            sent = await sweep_outbox(
                submissions=deps.submissions, publisher=publisher, clock=deps.clock, grace=grace
            )
            if sent:
                log.info("outbox sweep sent %d interrupted submission(s)", sent)
        except Unavailable as error:
            log.warning("outbox sweep postponed: %r", error)
        await asyncio.sleep(deps.settings.outbox_interval_s)
