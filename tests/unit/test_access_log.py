"""`ACCESS_LOG=true` logs a line per HTTP request (found missing in a walkthrough: the gateway
logged nothing of its clients' requests); off by default. Served by a real uvicorn with the
services' own configuration (`shared.runtime.server_config`)."""

from __future__ import annotations

import asyncio
import logging
import socket

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from services.status.settings import StatusSettings
from shared.runtime import server_config
from tests.support import eventually


async def _access_lines(access_log: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    settings = StatusSettings.model_validate({"ACCESS_LOG": access_log, "LOG_FORMAT": "json"})
    config = server_config(app, settings)
    config.lifespan = "off"
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))

    async def started() -> bool:
        return server.started

    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        await eventually(started, what="the server started")
        port = sock.getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert (await client.get("/ping")).status_code == 200
        server.should_exit = True
        async with asyncio.timeout(20):  # a hang guard only
            await serving
    sock.close()
    return [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]


async def test_access_log_on_writes_a_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    lines = await _access_lines("true", caplog)
    assert len(lines) == 1
    assert '"GET /ping HTTP/1.1" 200' in lines[0]


async def test_access_log_is_off_by_default(caplog: pytest.LogCaptureFixture) -> None:
    assert await _access_lines("false", caplog) == []
