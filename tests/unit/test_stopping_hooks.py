"""`shared.runtime.Server` calls the app's stopping hooks as it begins to stop, over a real
uvicorn server on a local port."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from fastapi import FastAPI

from shared.runtime import Server, stopping_hooks, when_stopping
from tests.support import eventually


async def _serve_and_stop(app: FastAPI) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_level="critical", ws="none")
    server = Server(config, stopping_hooks(app))
    serving = asyncio.create_task(server.serve(sockets=[sock]))

    async def started() -> bool:
        return server.started

    await eventually(started, what="the server started")
    server.should_exit = True  # what SIGTERM does
    async with asyncio.timeout(20):  # a hang guard only
        await serving
    sock.close()


async def test_a_failing_hook_neither_stops_the_others_nor_the_server() -> None:
    app, called = FastAPI(), []

    def failing() -> None:
        called.append("failing")
        raise RuntimeError("a hook's own bug")

    when_stopping(app, failing)
    hooks = stopping_hooks(app)  # what the server takes at its start
    when_stopping(app, lambda: called.append("late"))  # registered after: still run
    assert hooks is stopping_hooks(app)

    await _serve_and_stop(app)

    assert called == ["failing", "late"]
