"""`/healthz` and `/readyz` answer HEAD as they answer GET: load balancers that probe with HEAD
(AWS target groups may, HAProxy's `option httpchk` does by default) got 405 and took every
replica out of service."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from shared.head_requests import answer_head_as_get
from shared.http import health_router


def _app(*, ready: bool) -> FastAPI:
    async def check() -> bool:
        return ready

    app = FastAPI()
    app.include_router(health_router({"database": check}))
    answer_head_as_get(app)  # as every service's app does
    return app


async def _answers(app: FastAPI, method: str, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
        return await client.request(method, path)


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_healthz_answers_get_and_head(method: str) -> None:
    response = await _answers(_app(ready=False), method, "/healthz")
    assert response.status_code == 200


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize(("ready", "status"), [(True, 200), (False, 503)])
async def test_readyz_answers_get_and_head_with_the_dependencies_state(
    method: str, ready: bool, status: int
) -> None:
    response = await _answers(_app(ready=ready), method, "/readyz")
    assert response.status_code == status
    if method == "HEAD":
        assert response.content == b""
