"""`/readyz` answers a probe before the probe gives up, 503 included, whatever hangs.

Its checks ran one after another, each waiting for its dependency as long as the service's
own timeout allows (`BROKER_TIMEOUT_S`, `MONGO_TIMEOUT_S`): during an outage it said 503 after
15 s, so a probe (Kubernetes waits 1 s by default) saw a timeout, never the 503. Here the
probe's own timeout is a few seconds, well past the readiness deadline and well short of
the dependencies' timeouts: it failed before."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI

from shared.http import health_router
from shared.runtime import make_mongo, mongo_ready
from shared.settings import ServiceSettings

# How long the probes of these tests wait for an answer before giving up, as a prober does.
PROBE_TIMEOUT_S = 3.0
# The dependencies' own timeouts, as the services' defaults (`MONGO_TIMEOUT_S`): past the
# probe's.
MONGO_TIMEOUT_S = 5.0


async def _probe(app: FastAPI) -> httpx.Response:
    """`GET /readyz` as a prober sends it: given up after `PROBE_TIMEOUT_S`."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                return await client.get("/readyz")
        except TimeoutError:
            raise AssertionError(f"/readyz did not answer within {PROBE_TIMEOUT_S} s") from None


async def test_readyz_answers_503_while_a_check_hangs_and_asks_every_check() -> None:
    never = asyncio.Event()
    asked: list[str] = []

    async def hanging() -> bool:
        asked.append("rabbitmq")
        await never.wait()
        return True

    async def answering() -> bool:
        asked.append("mongodb")
        return True

    app = FastAPI()
    app.include_router(health_router({"rabbitmq": hanging, "mongodb": answering}))

    response = await _probe(app)

    assert response.status_code == 503
    assert response.json()["checks"] == {"rabbitmq": False, "mongodb": True}
    assert sorted(asked) == ["mongodb", "rabbitmq"]


@contextlib.asynccontextmanager
async def _silent_server() -> AsyncIterator[int]:
    """A local port that accepts connections and never answers on them: a database that
    hangs (a stalled network, a frozen host)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in held:
            writer.close()
        await server.wait_closed()


async def test_a_database_that_never_answers_is_not_ready_within_a_probe() -> None:
    """The database's check alone waited the whole `MONGO_TIMEOUT_S` for its ping."""
    async with _silent_server() as port:
        settings = ServiceSettings.model_validate(
            {
                "MONGO_URL": f"mongodb://127.0.0.1:{port}/?directConnection=true",
                "MONGO_TIMEOUT_S": str(MONGO_TIMEOUT_S),
            }
        )
        client = make_mongo(settings)
        try:
            check = mongo_ready(client, settings.mongo_timeout_s)
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                assert await check() is False
        finally:
            await client.close()
