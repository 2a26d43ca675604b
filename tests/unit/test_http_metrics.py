"""`GET /metrics` and the HTTP request metrics of `shared.metrics`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import SecretStr
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.http import Problem, admin_guard, install_problem_handlers
from shared.metrics import Metrics, serve_metrics
from tests.support import running, sample


def app_with_metrics(metrics: Metrics, *, admin_key: str | None = None) -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)

    @app.get("/v1/things/{thing_id}")
    async def thing(thing_id: str) -> dict[str, str]:
        if thing_id == "missing":
            raise Problem(404, "No such thing.")
        return {"thing_id": thing_id}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    guard = None if admin_key is None else admin_guard(SecretStr(admin_key))
    serve_metrics(app, metrics, guard=guard)
    return app


def requests_counted(metrics: Metrics, method: str, route: str, status: str) -> float:
    return sample(
        metrics.registry,
        "scorebox_http_request_seconds_count",
        method=method,
        route=route,
        status=status,
    )


async def test_requests_are_counted_by_route_template_and_status() -> None:
    metrics = Metrics()
    async with running(app_with_metrics(metrics)) as client:
        for thing_id in ("a", "b", "missing"):
            await client.get(f"/v1/things/{thing_id}")
        await client.get("/no/such/path")
        await client.get("/another/unknown/path")
    assert requests_counted(metrics, "GET", "/v1/things/{thing_id}", "200") == 2
    assert requests_counted(metrics, "GET", "/v1/things/{thing_id}", "404") == 1
    # Paths no route serves share one series, whatever they are.
    assert requests_counted(metrics, "GET", "unmatched", "404") == 2


class ShedPosts:
    """Answers every POST 503 before routing, as the gateway's admission control sheds."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            await JSONResponse({"detail": "shed"}, status_code=503)(scope, receive, send)
            return
        await self._app(scope, receive, send)


async def test_a_request_answered_before_routing_is_counted_under_its_route() -> None:
    metrics = Metrics()
    app = FastAPI()

    @app.post("/v1/things/{thing_id}")
    async def create(thing_id: str) -> None:
        raise AssertionError("shed before it gets here")

    app.add_middleware(ShedPosts)
    serve_metrics(app, metrics)  # outermost, as the gateway has it
    async with running(app) as client:
        await client.post("/v1/things/a")
        await client.post("/nowhere")
    assert requests_counted(metrics, "POST", "/v1/things/{thing_id}", "503") == 1
    assert requests_counted(metrics, "POST", "unmatched", "503") == 1


async def test_a_handler_that_raises_is_counted_as_a_500() -> None:
    metrics = Metrics()
    transport = httpx.ASGITransport(app=app_with_metrics(metrics), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://scorebox.test") as client:
        answer = await client.get("/boom")
    assert answer.status_code == 500
    assert requests_counted(metrics, "GET", "/boom", "500") == 1


async def test_the_exposition_is_prometheus_text_with_every_family() -> None:
    metrics = Metrics()
    async with running(app_with_metrics(metrics)) as client:
        await client.get("/v1/things/a")
        answer = await client.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=")
    text = answer.text
    for family in (
        "scorebox_deliveries_total",
        "scorebox_delivery_handling_seconds",
        "scorebox_publishes_total",
        "scorebox_http_request_seconds",
    ):
        assert f"# TYPE {family} " in text
    route = 'route="/v1/things/{thing_id}"'
    assert f'scorebox_http_request_seconds_count{{method="GET",{route},status="200"}} 1.0' in text


async def test_metrics_behind_the_admin_key_need_it() -> None:
    metrics = Metrics()
    async with running(app_with_metrics(metrics, admin_key="s3cret")) as client:
        anonymous = await client.get("/metrics")
        wrong = await client.get("/metrics", headers={"Authorization": "Bearer nope"})
        admin = await client.get("/metrics", headers={"Authorization": "Bearer s3cret"})
    assert (anonymous.status_code, wrong.status_code, admin.status_code) == (401, 401, 200)
    assert anonymous.headers["content-type"] == "application/problem+json"
    assert "scorebox_http_request_seconds" in admin.text


async def test_an_event_stream_is_counted_when_it_starts_and_odd_methods_share_a_series() -> None:
    """A stream was observed only when it ended, its whole life in the +Inf bucket; and a
    server that accepts any method token made a series of each."""
    metrics = Metrics()
    app = app_with_metrics(metrics)
    stop = asyncio.Event()

    @app.get("/v1/stream")
    async def stream() -> StreamingResponse:
        async def frames() -> AsyncIterator[bytes]:
            yield b"data: first\n\n"
            await stop.wait()

        return StreamingResponse(frames(), media_type="text/event-stream")

    counted_while_open: list[float] = []

    async def receive() -> Message:
        await stop.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            counted_while_open.append(requests_counted(metrics, "GET", "/v1/stream", "200"))
            stop.set()

    # Called as a server would (httpx's in-process transport reads a stream to its end).
    async with asyncio.timeout(30):
        await app(_scope("GET", "/v1/stream"), receive, send)
    assert counted_while_open == [1]
    assert requests_counted(metrics, "GET", "/v1/stream", "200") == 1  # not counted twice
    async with running(app) as client:
        await client.request("BREW", "/v1/things/a")
    assert requests_counted(metrics, "other", "/v1/things/{thing_id}", "405") == 1


def _scope(method: str, path: str) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [],
        "client": ("127.0.0.1", 40000),
        "server": ("scorebox.test", 80),
    }
