"""Composition root of the scheduler: its clock, broker and database."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from faststream.rabbit import RabbitBroker

from services.scheduler.settings import SchedulerSettings
from shared.http import health_router, install_problem_handlers
from shared.runtime import (
    MongoClient,
    broker_ready,
    make_broker,
    make_mongo,
    mongo_ready,
    start_broker,
)


def create_app(
    settings: SchedulerSettings,
    *,
    broker: RabbitBroker | None = None,
    mongo: MongoClient | None = None,
) -> FastAPI:
    """Wire the scheduler: broker + database + HTTP health."""
    broker = broker or make_broker(settings)
    mongo = mongo or make_mongo(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await start_broker(broker, settings)
        yield
        await broker.stop()
        await mongo.close()

    app = FastAPI(title="Scorebox scheduler", lifespan=lifespan)
    install_problem_handlers(app)
    app.include_router(
        health_router(
            {
                "rabbitmq": broker_ready(broker, settings.broker_timeout_s),
                "mongodb": mongo_ready(mongo, settings.mongo_timeout_s),
            }
        )
    )
    return app
