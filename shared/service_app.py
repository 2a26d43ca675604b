"""The HTTP app of a service behind the gateway (status, scorer, scheduler, notifier): what
each of them answers the same way, so their composition roots add only their own routes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI
from pydantic import SecretStr

from shared.consumers import ScoreboxBroker
from shared.head_requests import answer_head_as_get
from shared.http import (
    METRICS_PROBLEMS,
    health_router,
    install_problem_handlers,
    internal_metrics_guard,
)
from shared.metrics import serve_metrics
from shared.query_parameters import document_before_serving, only_known_query_parameters
from shared.runtime import MongoClient, broker_ready, mongo_ready
from shared.settings import MetricsApiSettings

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def internal_service_app(
    title: str,
    *,
    service: str,
    settings: MetricsApiSettings,
    broker: ScoreboxBroker,
    mongo: MongoClient,
    lifespan: Lifespan,
    admin_key: SecretStr | None = None,
    **options: Any,
) -> FastAPI:
    """A FastAPI app answering every error as problem+json, with `/metrics` (behind
    `METRICS_API_KEY`, or `admin_key` where the service holds one; `service` names it in the
    warning when the key is unset) and `/healthz` and `/readyz` on the broker and the
    database, HEAD wherever GET is, a 422 for a query parameter a route does not take, and
    no redirect of a path with a trailing slash. `options` go to FastAPI."""
    app = FastAPI(
        title=title,
        lifespan=document_before_serving(lifespan),
        dependencies=[only_known_query_parameters()],
        # No 307 from `/x/` to `/x`: a drop of an empty id (`DELETE .../dead-letters/`) was
        # sent to the purge, method and key kept by a client following redirects. The
        # notifier's dead-letter routes came after the gateway's and the scheduler's were
        # mended, without it (review of the notifier).
        redirect_slashes=False,
        **options,
    )
    install_problem_handlers(app)
    access = internal_metrics_guard(settings.metrics_api_key, service, admin_key=admin_key)
    serve_metrics(app, broker.metrics, guard=access, responses=METRICS_PROBLEMS)
    checks = {
        "rabbitmq": broker_ready(broker, settings.broker_timeout_s),
        "mongodb": mongo_ready(mongo, settings.mongo_timeout_s),
    }
    app.include_router(health_router(checks))
    answer_head_as_get(app)
    return app
