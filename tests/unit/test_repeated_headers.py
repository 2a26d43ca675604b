"""A header that decides how a request is read, sent twice, is a 400 (found in a
walkthrough): `Authorization` (the first was taken, and an intermediary taking the last
authenticates another tenant), `Content-Type`, and a `charset` given twice in it. The shared
guards and body reader, served by a real uvicorn with the services' configuration: the
repeated headers travel as sent."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from pydantic import SecretStr

from services.status.settings import StatusSettings
from shared.bodies import read_json_object
from shared.http import (
    PROBLEM_JSON,
    admin_guard,
    install_problem_handlers,
    internal_guard,
    metrics_guard,
)
from shared.runtime import server_config
from tests.support import eventually

ADMIN = "admin-key-0123456789"
INTERNAL = "internal-key-0123456789"
METRICS = "metrics-key-0123456789"
JSON_TYPE = ("Content-Type", "application/json")


def _app() -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)

    @app.get("/admin", dependencies=[admin_guard(SecretStr(ADMIN))])
    async def admin() -> dict[str, str]:
        return {"ok": "admin"}

    @app.get("/internal", dependencies=[internal_guard(SecretStr(INTERNAL))])
    async def internal() -> dict[str, str]:
        return {"ok": "internal"}

    @app.get("/metrics", dependencies=[metrics_guard(SecretStr(METRICS), SecretStr(ADMIN))])
    async def metrics() -> dict[str, str]:
        return {"ok": "metrics"}

    @app.post("/object")
    async def read(request: Request) -> dict[str, Any]:
        return await read_json_object(request, what="object", limit=1 << 20)

    return app


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    config = server_config(_app(), StatusSettings.model_validate({}))
    config.lifespan = "off"
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))

    async def started() -> bool:
        return server.started

    try:
        await eventually(started, what="the server started")
        port = sock.getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            yield http
    finally:
        server.should_exit = True
        async with asyncio.timeout(20):  # a hang guard only
            await serving
        sock.close()


def _refused(response: httpx.Response, said: str) -> None:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert said in response.json()["detail"]


@pytest.mark.parametrize(
    ("path", "keys"),
    [
        ("/admin", (ADMIN, "not-a-key")),
        ("/admin", ("not-a-key", ADMIN)),
        ("/admin", (ADMIN, ADMIN)),
        ("/internal", (INTERNAL, "not-a-key")),
        ("/metrics", (METRICS, ADMIN)),
    ],
)
async def test_authorization_sent_twice_is_a_400(
    client: httpx.AsyncClient, path: str, keys: tuple[str, str]
) -> None:
    """Of two, the first was taken: with the right key first the request was admitted."""
    headers = [("Authorization", f"Bearer {key}") for key in keys]
    _refused(await client.get(path, headers=headers), "Authorization was sent more than once")
    # Once, each route takes its key as before.
    once = await client.get(path, headers={"Authorization": f"Bearer {keys[0]}"})
    assert once.status_code in (200, 401), once.text


@pytest.mark.parametrize(
    "headers",
    [
        [JSON_TYPE, JSON_TYPE],
        [JSON_TYPE, ("Content-Type", "text/plain")],
        [("Content-Type", "application/json; charset=utf-8; charset=latin-1")],
        [("Content-Type", 'application/json; charset="utf-8";Charset=utf-8')],
    ],
    ids=["content-type-twice", "two-content-types", "charset-twice", "same-charset-twice"],
)
async def test_a_content_type_or_charset_given_twice_is_a_400(
    client: httpx.AsyncClient, headers: list[tuple[str, str]]
) -> None:
    """Of two, the first was taken (`charset=utf-8; charset=latin-1` read as UTF-8)."""
    response = await client.post("/object", content=b'{"a": 1}', headers=headers)
    _refused(response, "more than once")
    once = await client.post("/object", content=b'{"a": 1}', headers=[JSON_TYPE])
    assert once.json() == {"a": 1}
