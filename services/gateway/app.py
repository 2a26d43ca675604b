"""Composition root of the gateway: the public HTTP API in front of the task flow.

`build_gateway` makes every adapter once; `create_app` subscribes the consumers, opens and
closes the clients in the lifespan, and mounts the routes. Tests pass their own broker,
database client, HTTP clients or clock. The HTTP clients of the internal services, made here
or passed in, send `INTERNAL_API_KEY` on every call when it is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI

from services.gateway.admin_api import admin_routes
from services.gateway.admission import install_admission
from services.gateway.api import GatewayDeps, score_routes
from services.gateway.auth import Authenticator, caller_dependencies
from services.gateway.batches import Batches
from services.gateway.batches_api import batch_routes
from services.gateway.cache import ResultCache
from services.gateway.cancels_api import cancel_routes
from services.gateway.consumers import (
    keep_outbox_swept,
    subscribe_task_outcomes,
    write_off_before_stopping,
)
from services.gateway.deadletters import DeadLetterQueue
from services.gateway.errors import database_known_away
from services.gateway.events_api import event_routes
from services.gateway.keys import ApiKeys, bootstrap_key, retire_replaced_bootstrap_keys
from services.gateway.keys_api import key_admin_routes
from services.gateway.limits import (
    InFlight,
    RateLimiter,
    install_body_timeout,
)
from services.gateway.publisher import TaskPublisher
from services.gateway.push import BrokerLiveBinding, LiveUpdates, subscribe_live_updates
from services.gateway.rescore import RescoreRequests, subscribe_rescore_requests
from services.gateway.scheduler_client import SchedulerClient, make_scheduler_http
from services.gateway.settings import GatewaySettings
from services.gateway.status_client import StatusClient
from services.gateway.submissions import Submissions
from services.gateway.unknown_keys import UnknownKeyBudget
from services.gateway.usage_api import usage_routes
from services.gateway.webhooks_api import NotifierClient, make_notifier_http, webhook_routes
from shared.aiohttp_transport import MappedAiohttpTransport
from shared.asyncapi import build_document
from shared.away_gate import AwayGate
from shared.clock_offset import DatabaseClock
from shared.coalescing import server_watch
from shared.consumers import ScoreboxBroker
from shared.contracts import DEFAULT_TENANT, new_id
from shared.head_requests import answer_head_as_get
from shared.http import (
    GATEWAY_METRICS_PROBLEMS,
    health_router,
    install_problem_handlers,
    internal_key_headers,
    metrics_guard,
)
from shared.metrics import serve_metrics
from shared.query_parameters import document_before_serving, only_known_query_parameters
from shared.runtime import (
    MongoClient,
    broker_ready,
    clock_watch_of,
    make_broker,
    make_mongo,
    mongo_ready,
    prepare_service_database,
    start_broker,
    when_stopping,
)

Clock = Callable[[], datetime]

log = logging.getLogger("scorebox.gateway")


def make_status_http(settings: GatewaySettings) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.AsyncClient(
        transport=MappedAiohttpTransport(limits=limits, total_timeout_s=settings.status_timeout_s),
        timeout=httpx.Timeout(settings.status_timeout_s),
        limits=limits,
    )


@dataclass(frozen=True)
class Gateway:
    """Every adapter of the gateway, made once."""

    settings: GatewaySettings
    broker: ScoreboxBroker
    mongo: MongoClient
    status_http: httpx.AsyncClient
    notifier_http: httpx.AsyncClient
    scheduler_http: httpx.AsyncClient
    keys: ApiKeys
    authenticator: Authenticator
    rate_limiter: RateLimiter
    batches: Batches
    publisher: TaskPublisher
    status: StatusClient
    deps: GatewayDeps

    async def ensure_indexes(self) -> None:
        for store in (
            self.deps.submissions,
            self.batches,
            self.deps.cache,
            self.keys,
            self.rate_limiter,
            self.deps.in_flight,
        ):
            await store.ensure_indexes()

    async def close_clients(self) -> None:
        await self.status_http.aclose()
        await self.notifier_http.aclose()
        await self.scheduler_http.aclose()
        await self.mongo.close()


def build_gateway(
    settings: GatewaySettings,
    *,
    broker: ScoreboxBroker | None = None,
    mongo: MongoClient | None = None,
    status_http: httpx.AsyncClient | None = None,
    notifier_http: httpx.AsyncClient | None = None,
    scheduler_http: httpx.AsyncClient | None = None,
    clock: Clock | None = None,
) -> Gateway:
    clock = clock or DatabaseClock()  # the time its records are judged by
    broker = broker or make_broker(settings, prefetch=settings.outcome_prefetch, name="gateway")
    mongo = mongo or make_mongo(settings)
    status_http = status_http or make_status_http(settings)
    notifier_http = notifier_http or make_notifier_http(settings)
    scheduler_http = scheduler_http or make_scheduler_http(settings)
    for internal_http in (status_http, notifier_http, scheduler_http):
        internal_http.headers.update(internal_key_headers(settings.internal_api_key))
    database = settings.database_name("gateway")
    keys = ApiKeys(mongo, database)
    publisher = TaskPublisher(broker, timeout_s=settings.broker_timeout_s, clock=clock)
    status = StatusClient(status_http, base_url=settings.status_url)
    deps = GatewayDeps(
        settings=settings,
        submissions=Submissions(mongo, database),
        cache=ResultCache(
            mongo,
            database,
            timedelta(seconds=settings.result_cache_ttl_s),
            prompt_versions=settings.cached_prompt_versions,
        ),
        publisher=publisher,
        status=status,
        clock=clock,
        in_flight=InFlight(mongo, database, max_per_tenant=settings.max_in_flight_per_tenant),
        live=live_updates(broker, settings),
    )
    # One for the key store and the rate counters: both the gateway's database.
    away = AwayGate(known=server_watch(mongo).known, refusal=database_known_away)
    return Gateway(
        settings=settings,
        broker=broker,
        mongo=mongo,
        status_http=status_http,
        notifier_http=notifier_http,
        scheduler_http=scheduler_http,
        keys=keys,
        authenticator=Authenticator(
            keys,
            cache_ttl_s=settings.api_key_cache_ttl_s,
            clock=clock,
            unknown_keys=UnknownKeyBudget(
                settings.unknown_keys_per_min,
                replica_per_minute=settings.unknown_keys_per_min_per_replica,
            ),
            gate=away,
        ),
        rate_limiter=RateLimiter(
            mongo, database, per_minute=settings.rate_limit_per_min, clock=clock, gate=away
        ),
        batches=Batches(mongo, database),
        publisher=publisher,
        status=status,
        deps=deps,
    )


def create_app(settings: GatewaySettings, **overrides: Any) -> FastAPI:
    """Wire the gateway (see `build_gateway` for what `overrides` may replace)."""
    gateway = build_gateway(settings, **overrides)
    subscribe_task_outcomes(
        gateway.broker, gateway.deps, broker_timeout_s=settings.broker_timeout_s
    )
    subscribe_rescore_requests(
        gateway.broker, rescore_requests(gateway), prefetch=settings.rescore_prefetch
    )
    app = FastAPI(
        title="Scorebox",
        summary="Asynchronous LLM text scoring: submit a text, poll for its score.",
        version="1",
        lifespan=document_before_serving(gateway_lifespan(gateway)),
        # No 307 from `/x/` to `/x`: `DELETE /admin/v1/dead-letters/` (a drop of an empty id)
        # was sent to the purge, method and key kept by a client following redirects.
        redirect_slashes=False,
        dependencies=[only_known_query_parameters()],
    )
    install_problem_handlers(app)
    install_body_timeout(app, settings.request_body_timeout_s)
    app.state.submission_admission = install_admission(
        app,
        target_ms=settings.submit_latency_target_ms,
        max_limit=settings.submit_max_concurrency,
    )
    for router in gateway_routes(gateway):
        app.include_router(router)
    when_stopping(app, gateway.deps.live.stop_waiting)
    # Last, so outermost: the submissions admission sheds are counted too. The gateway faces
    # the internet, so its metrics need the metrics key or the admin key, and without either
    # they are disabled, never open.
    metrics_access = metrics_guard(settings.metrics_api_key, settings.admin_api_key)
    serve_metrics(
        app, gateway.broker.metrics, guard=metrics_access, responses=GATEWAY_METRICS_PROBLEMS
    )
    answer_head_as_get(app)
    return app


def gateway_lifespan(gateway: Gateway) -> Callable[[FastAPI], Any]:
    settings = gateway.settings

    clock_watch = clock_watch_of(
        gateway.mongo,
        settings,
        gateway.broker.metrics,
        service="gateway",
        clock=gateway.deps.clock,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if warning := settings.outbox_grace_warning():
            log.warning(warning)
        await prepare_service_database(
            gateway.mongo,
            settings,
            gateway.ensure_indexes,
            service="gateway",
            clock_watch=clock_watch,
        )
        token = settings.bootstrap_api_key.get_secret_value() if settings.bootstrap_api_key else ""
        # Empty means unset (compose passes `${SCOREBOX_API_KEY:-}`); a token that is no key
        # was refused with the settings, before the database was waited for.
        if token:
            now = gateway.deps.clock()
            key = await bootstrap_key(gateway.keys, token, tenant_id=DEFAULT_TENANT, now=now)
            await retire_replaced_bootstrap_keys(gateway.keys, key, now=now)
        await gateway.authenticator.learn_keys()
        await start_broker(gateway.broker, settings)
        sweeper = asyncio.create_task(
            keep_outbox_swept(gateway.deps, gateway.publisher, gateway.batches)
        )
        clock_watch.start()
        yield
        # The write-off and the deliveries in hand share the stop's grace (`BROKER_TIMEOUT_S`):
        # one after the other, a stop in a database outage outlasted compose's grace period.
        stopping = asyncio.get_running_loop().time()
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        await write_off_before_stopping(
            gateway.deps, gateway.batches, within_s=settings.broker_timeout_s / 2
        )
        await gateway.deps.live.stop_listening()
        await gateway.broker.stop(begun_at=stopping)
        await clock_watch.stop()
        await gateway.close_clients()

    return lifespan


def gateway_routes(gateway: Gateway) -> list[APIRouter]:
    settings, deps = gateway.settings, gateway.deps
    # Every public route takes its `Caller` from these dependencies (API key, then rate limit).
    callers = caller_dependencies(gateway.authenticator, gateway.rate_limiter)
    authenticated = callers.authenticated
    notifier = NotifierClient(gateway.notifier_http, base_url=settings.notifier_url)
    health = {
        "rabbitmq": broker_ready(gateway.broker, settings.broker_timeout_s),
        "mongodb": mongo_ready(gateway.mongo, settings.mongo_timeout_s),
    }
    return [
        health_router(health),
        asyncapi_route(),
        score_routes(deps, callers, gateway.authenticator.still_valid),
        cancel_routes(deps, gateway.publisher, authenticated, batches=gateway.batches),
        event_routes(
            deps, deps.live, gateway.status, authenticated, gateway.authenticator.still_valid
        ),
        batch_routes(
            deps,
            batches=gateway.batches,
            publisher=gateway.publisher,
            status=gateway.status,
            callers=callers,
        ),
        webhook_routes(notifier, authenticated),
        usage_routes(
            SchedulerClient(gateway.scheduler_http, base_url=settings.scheduler_url),
            authenticated,
            clock=deps.clock,
        ),
        key_admin_routes(
            gateway.keys,
            settings.admin_api_key,
            clock=deps.clock,
            forget=gateway.authenticator.forget,
            remember=gateway.authenticator.remember,
        ),
        admin_routes(
            DeadLetterQueue(
                gateway.broker,
                gateway.publisher,
                deps.submissions,
                deps.clock,
                timeout_s=settings.broker_timeout_s,
            ),
            settings.admin_api_key,
        ),
    ]


def rescore_requests(gateway: Gateway) -> RescoreRequests:
    """The consumer of the scheduler's re-score requests (the gateway keeps the texts)."""
    return RescoreRequests(
        submissions=gateway.deps.submissions,
        publisher=gateway.publisher,
        broker=gateway.broker,
        clock=gateway.deps.clock,
        timeout_s=gateway.settings.broker_timeout_s,
        cache=gateway.deps.cache,
    )


def live_updates(broker: ScoreboxBroker, settings: GatewaySettings) -> LiveUpdates:
    """This replica's waiters, woken by its own queue of task events (SSE and long-polls)."""
    replica_id = new_id()[:16]
    live = LiveUpdates(
        max_waiters=settings.live_max_waiters,
        max_per_tenant=settings.live_max_waiters_per_tenant,
        binding=BrokerLiveBinding(broker, replica_id, timeout_s=settings.broker_timeout_s),
    )
    subscribe_live_updates(broker, live, replica_id=replica_id)
    return live


def asyncapi_route() -> APIRouter:
    """The AsyncAPI document of every message, next to the OpenAPI one."""
    router = APIRouter(tags=["docs"])
    document = build_document()

    @router.get("/asyncapi.json", include_in_schema=False)
    async def asyncapi() -> dict[str, object]:
        return document

    return router
