"""HEAD is answered wherever GET is (`shared.head_requests`), over a real uvicorn server on a
local port: FastAPI routes answer only the methods they name, and `HEAD /v1/scores/{id}` was
a 405."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from services.gateway.app import create_app as create_gateway
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.head_requests import answer_head_as_get
from shared.http import install_problem_handlers
from tests.support import eventually

HEARTBEATS_BEFORE_END = 10_000  # a stream that would outlast the test if HEAD let it run


class Stream:
    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.parts_made = 0

    async def parts(self) -> AsyncIterator[bytes]:
        try:
            for _ in range(HEARTBEATS_BEFORE_END):
                self.parts_made += 1
                yield b": heartbeat\n\n"
                await asyncio.sleep(0.05)  # the stream's own pace, not a synchronisation
        finally:
            self.closed.set()


def _app(stream: Stream) -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)

    @app.get("/things/{name}")
    async def read(name: str) -> dict[str, str]:
        return {"name": name, "kind": "thing"}

    @app.post("/things")
    async def create() -> dict[str, str]:
        return {}

    @app.get("/events")
    async def events() -> StreamingResponse:
        return StreamingResponse(stream.parts(), media_type="text/event-stream")

    answer_head_as_get(app)
    return app


@asynccontextmanager
async def _served(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="critical", ws="none")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))

    async def started() -> bool:
        return server.started

    await eventually(started, what="the server started")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield client
    finally:
        server.should_exit = True
        async with asyncio.timeout(20):  # a hang guard only
            await serving
        sock.close()


async def test_head_answers_a_get_route_with_its_head_and_no_body() -> None:
    async with _served(_app(Stream())) as client:
        got = await client.get("/things/a")
        head = await client.head("/things/a")
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    assert head.headers["content-length"] == got.headers["content-length"]


async def test_head_on_a_route_without_get_is_refused_as_get_would_be() -> None:
    async with _served(_app(Stream())) as client:
        head = await client.head("/things")
        missing = await client.head("/nowhere")
    assert head.status_code == 405
    assert head.headers["allow"] == "POST"
    assert head.headers["content-type"] == "application/problem+json"
    assert missing.status_code == 404


async def test_head_on_a_stream_ends_it_and_the_connection_serves_the_next_request() -> None:
    stream = Stream()
    async with _served(_app(stream)) as client:
        head = await client.head("/events")
        # Same connection (keep-alive): it would wait behind a stream left running.
        after = await client.get("/things/b")

        async def stream_closed() -> bool:
            return stream.closed.is_set()

        await eventually(stream_closed, what="the stream's generator closed")
    assert head.status_code == 200
    assert head.headers["content-type"].startswith("text/event-stream")
    assert after.json() == {"name": "b", "kind": "thing"}
    assert stream.parts_made < HEARTBEATS_BEFORE_END


def _gateway() -> FastAPI:
    return create_gateway(GatewaySettings.model_validate({}))


def _status() -> FastAPI:
    return create_status(StatusSettings.model_validate({}))


@pytest.mark.parametrize("make_app", [_gateway, _status])
async def test_the_services_answer_head_where_they_answer_get(
    make_app: Callable[[], FastAPI],
) -> None:
    # No lifespan: the route needs neither the broker nor the database.
    transport = httpx.ASGITransport(app=make_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
        head = await client.head("/healthz")
    assert head.status_code == 200
    assert head.content == b""


async def test_a_405_names_the_methods_of_every_route_of_the_path() -> None:
    """Starlette's `Allow` named the first route's alone (`POST /v1/webhooks/failure-alert`
    was told GET where PUT and DELETE are taken too; found in review)."""
    app = _app(Stream())

    @app.put("/things/{name}")
    async def replace(name: str) -> dict[str, str]:
        return {"name": name}

    @app.delete("/things/{name}")
    async def remove(name: str) -> dict[str, str]:
        return {"name": name}

    async with _served(app) as client:
        refused = await client.post("/things/a")
    assert refused.status_code == 405
    assert refused.headers["allow"] == "DELETE, GET, HEAD, PUT"
    assert refused.json()["detail"].endswith("it takes DELETE, GET, HEAD, PUT.")


async def test_a_method_a_route_does_not_take_is_told_what_it_takes_head_included() -> None:
    async with _served(_app(Stream())) as client:
        refused = await client.delete("/things/a")
        unknown = await client.get("/nowhere")
    assert refused.status_code == 405
    assert refused.headers["allow"] == "GET, HEAD"
    assert refused.json()["detail"] == "DELETE is not allowed on /things/a; it takes GET, HEAD."
    # The router's own words were "Not Found" and "Method Not Allowed" alone.
    assert unknown.json()["detail"] == (
        "No route answers GET /nowhere; the routes are listed at /docs and /openapi.json."
    )


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/v1/scores/" + "0" * 32, "GET, HEAD"),
        ("POST", "/v1/webhooks/failure-alert", "DELETE, GET, HEAD, PUT"),
        ("PUT", "/admin/v1/dead-letters", "DELETE, GET, HEAD"),
        ("POST", "/asyncapi.json", "GET, HEAD"),  # left out of the document: HEAD all the same
    ],
)
async def test_the_gateways_405_names_every_method_of_the_path(
    method: str, path: str, allowed: str
) -> None:
    """The gateway's routes come from included routers, which FastAPI keeps as nodes of
    their own: a 405 of its routes named GET alone, HEAD left out (found by hand)."""
    transport = httpx.ASGITransport(app=_gateway())
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        refused = await client.request(method, path)
    assert refused.status_code == 405
    assert refused.headers["allow"] == allowed


async def test_a_405_names_the_paths_methods_behind_a_root_path() -> None:
    """The templates have no root path; the request's path has it (found in review)."""
    app = create_gateway(GatewaySettings.model_validate({}))
    app.root_path = "/api"
    transport = httpx.ASGITransport(app=app, root_path="/api")
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        refused = await client.post("/api/v1/webhooks/failure-alert")
    assert refused.status_code == 405
    assert refused.headers["allow"] == "DELETE, GET, HEAD, PUT"
