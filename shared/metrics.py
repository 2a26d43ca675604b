"""Prometheus metrics of one service process, served as `GET /metrics`.

Each composition root builds one `Metrics` (a registry of its own, so that services built
side by side in one test process never share counters) and hands it to what records:
the broker (deliveries handled and publishes, `shared.consumers` and `shared.bus`), the
HTTP app (requests by route template and status, `install_http_metrics`), and the service's
own handlers (model calls, webhook attempts, cron runs), which add families of their own to
`metrics.registry`. Queue depths, consumers and confirms are the broker's to report
(RabbitMQ's `rabbitmq_prometheus` plugin), and what the database does, MongoDB's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.routing import Match

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fastapi import FastAPI
    from starlette.routing import BaseRoute
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Seconds: from a quick handler (a projection update) to a model call near its timeout.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A request to a path no route serves (scanners, typos): one label, not one per path.
UNMATCHED_ROUTE = "unmatched"
# The OpenAPI `responses` of a route, by status.
Responses = dict[int | str, dict[str, Any]]
_EXPOSITION: dict[str, Any] = {
    "description": "The process's metrics in Prometheus' text exposition format.",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}


class Metrics:
    """The metric families every service records; `registry` takes a service's own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.deliveries = Counter(
            "scorebox_deliveries",
            "Deliveries handled, by queue and how the handler left them "
            "(ack, nack, reject, requeue, unsettled: kept for the broker to redeliver; "
            "failed: the handler raised).",
            ["queue", "settled"],
            registry=self.registry,
        )
        self.events_per_batch = Histogram(
            "scorebox_events_per_batch",
            "Events sent together in one batch message (`shared.batched_publish`); an event "
            "sent alone is not counted.",
            buckets=(2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )
        self.handling_seconds = Histogram(
            "scorebox_delivery_handling_seconds",
            "Time from a delivery's arrival to the end of its handler, by queue.",
            ["queue"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.publishes = Counter(
            "scorebox_publishes",
            "Publishes with confirms, by exchange and what the broker answered "
            "(confirmed; not_sent: refused or returned, it reached no queue; unconfirmed: "
            "no answer, it may be queued).",
            ["exchange", "outcome"],
            registry=self.registry,
        )
        self.broker_connected = Gauge(
            "scorebox_broker_connected",
            "1 while a broker connection of this process is up, by what it carries "
            "(publishers; consumers: the work queues; own queues: this replica's exclusive "
            "queues, which may stay refused for a heartbeat after a network partition).",
            ["connection"],
            registry=self.registry,
        )
        self.http_seconds = Histogram(
            "scorebox_http_request_seconds",
            "HTTP requests answered, by method, route template and status.",
            ["method", "route", "status"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


def metrics_router(
    metrics: Metrics, *, guard: Any = None, responses: Responses | None = None
) -> APIRouter:
    """`GET /metrics` in Prometheus' text format; `guard` is a dependency that must pass
    first (`shared.http.metrics_guard`, `internal_metrics_guard`). Guarded, the route is in
    the app's OpenAPI document with the guard's security scheme and `responses` (its
    problem+json answers); open, it stays out of it, as it was before the metrics key."""
    router = APIRouter(tags=["health"], dependencies=[] if guard is None else [guard])

    @router.get(
        "/metrics",
        response_class=Response,
        include_in_schema=guard is not None,
        summary="Prometheus metrics of this process",
        responses={200: _EXPOSITION, **(responses or {})},
    )
    async def exposition() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router


def serve_metrics(
    app: FastAPI, metrics: Metrics, *, guard: Any = None, responses: Responses | None = None
) -> None:
    """Serve `metrics` at `GET /metrics` of `app` (see `metrics_router`), and count and time
    every request of `app` by its route template (`/v1/scores/{task_id}`, never the path
    itself, whose ids would make a series each)."""
    app.include_router(metrics_router(metrics, guard=guard, responses=responses))
    app.add_middleware(_HttpMetrics, metrics=metrics, routes=app.router.routes)


class _HttpMetrics:
    """A plain ASGI middleware: the status is read off the response's start message."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute]) -> None:
        self._app = app
        self._metrics = metrics
        self._routes = routes  # the app's own list: routes added later are found too

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the server answers when the app raises before starting a response
        observed = False

        def observe() -> None:
            self._metrics.http_seconds.labels(
                _method_of(scope), _route_of(scope, self._routes), str(status)
            ).observe(time.perf_counter() - started)

        async def recording_send(message: Message) -> None:
            nonlocal status, observed
            if message["type"] == "http.response.start":
                status = message["status"]
                # An event stream lasts as long as its client listens: timed to its start.
                if _is_event_stream(message):
                    observe()
                    observed = True
            await send(message)

        try:
            await self._app(scope, receive, recording_send)
        finally:
            if not observed:
                observe()


# Any other method (a server that accepts every token) is one series, not one per token.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _method_of(scope: Scope) -> str:
    method = scope["method"]
    return method if method in KNOWN_METHODS else "other"


def _is_event_stream(start: Message) -> bool:
    return any(
        name.lower() == b"content-type" and value.startswith(b"text/event-stream")
        for name, value in start.get("headers", ())
    )


def _route_of(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The template of the route that served the request; for one answered before routing
    (a submission the gateway's admission control shed), of the route that would have."""
    route = scope.get("route")
    if route is None:
        route = next((each for each in routes if each.matches(scope)[0] is Match.FULL), None)
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED_ROUTE
