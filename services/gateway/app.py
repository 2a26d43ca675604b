"""Composition root of the gateway: the public HTTP API in front of the task flow."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta

import httpx
from fastapi import FastAPI
from faststream import AckPolicy
from faststream.rabbit import RabbitBroker
from faststream.rabbit.annotations import RabbitMessage
from httpx_aiohttp import AiohttpTransport
from pydantic import ValidationError

from services.gateway.admin_api import admin_routes
from services.gateway.api import GatewayDeps, score_routes
from services.gateway.auth import caller_dependency
from services.gateway.cache import ResultCache
from services.gateway.deadletters import DeadLetterQueue
from services.gateway.errors import Unavailable
from services.gateway.publisher import TaskPublisher
from services.gateway.settings import GatewaySettings
from services.gateway.status_client import StatusClient
from services.gateway.submissions import Submissions
from services.gateway.submit import Publisher, remember_result, sweep_outbox
from shared.contracts import TaskCompleted, utcnow
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
    clock: Callable[[], datetime] = utcnow,
) -> FastAPI:
    """Wire the gateway: broker + database + status client + HTTP app, closed in lifespan."""
    broker = broker or make_broker(settings)
    mongo = mongo or make_mongo(settings)
    http = status_http or make_status_http(settings)
    submissions = Submissions(mongo, settings.database_name("gateway"))
    cache = ResultCache(
        mongo, settings.database_name("gateway"), timedelta(seconds=settings.result_cache_ttl_s)
    )
    publisher = TaskPublisher(broker, timeout_s=settings.broker_timeout_s)
    deps = GatewayDeps(
        settings=settings,
        submissions=submissions,
        cache=cache,
        publisher=publisher,
        status=StatusClient(http, base_url=settings.status_url),
        clock=clock,
    )

    subscribe_result_cache(broker, deps)

    async def ensure_indexes() -> None:
        await submissions.ensure_indexes()
        await cache.ensure_indexes()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await retry_until(ensure_indexes, what="MongoDB", deadline_s=settings.startup_timeout_s)
        await start_broker(broker, settings)
        sweeper = asyncio.create_task(keep_outbox_swept(deps, publisher))
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        await broker.stop()
        await http.aclose()
        await mongo.close()

    app = FastAPI(
        title="Scorebox",
        summary="Asynchronous LLM text scoring: submit a text, poll for its score.",
        version="1",
        lifespan=lifespan,
    )
    install_problem_handlers(app)
    app.include_router(
        health_router(
            {
                "rabbitmq": broker_ready(broker, settings.broker_timeout_s),
                "mongodb": mongo_ready(mongo, settings.mongo_timeout_s),
            }
        )
    )
    app.include_router(score_routes(deps, caller_dependency()))
    app.include_router(
        admin_routes(DeadLetterQueue(broker, publisher, clock), settings.admin_api_key)
    )
    return app


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
