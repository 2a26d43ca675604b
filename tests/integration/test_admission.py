"""Admission control of submissions on a real gateway: over its limit a submission gets 503
problem+json with `Retry-After` at once and nothing is kept; other requests pass."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from services.gateway.admission import AdaptiveLimit
from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from tests.support import eventually, running

API_KEY = generate_key().token


@dataclass
class Gateway:
    api: httpx.AsyncClient
    admission: AdaptiveLimit


@pytest.fixture(scope="module")
async def gateway(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Gateway]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "BOOTSTRAP_API_KEY": API_KEY,
        "RATE_LIMIT_PER_MIN": "0",
        "SUBMIT_MAX_CONCURRENCY": "1",  # one submission at a time, whatever the latency
    }
    status = create_status(StatusSettings.model_validate(env))
    async with running(status) as status_client:
        app = create_gateway(GatewaySettings.model_validate(env), status_http=status_client)
        admission = app.state.submission_admission
        assert isinstance(admission, AdaptiveLimit)
        async with running(app) as api:
            api.headers["Authorization"] = f"Bearer {API_KEY}"
            yield Gateway(api, admission)


async def _held_submission(
    gateway: Gateway, release: asyncio.Event
) -> asyncio.Task[httpx.Response]:
    """A submission whose body arrives only once `release` is set: it holds the one place."""

    async def body() -> AsyncIterator[bytes]:
        yield b'{"text": "Held at the door'
        await release.wait()
        yield b' until the test lets it in."}'

    held = asyncio.create_task(
        gateway.api.post("/v1/scores", content=body(), headers={"Content-Type": "application/json"})
    )

    async def admitted() -> bool:
        return gateway.admission.in_flight == 1

    await eventually(admitted, what="the held submission admitted")
    return held


async def test_a_submission_over_the_limit_is_refused_at_once_and_keeps_nothing(
    gateway: Gateway,
) -> None:
    release = asyncio.Event()
    held = await _held_submission(gateway, release)
    key = {"Idempotency-Key": f"adm-{uuid.uuid4().hex}"}
    try:
        refused = await gateway.api.post("/v1/scores", json={"text": "Turned away."}, headers=key)
        batch = await gateway.api.post("/v1/batches", json={"items": [{"text": "Turned away."}]})
        unknown = await gateway.api.get(f"/v1/scores/{uuid.uuid4().hex}")
    finally:
        release.set()
        accepted = await held
    assert accepted.status_code == 202, accepted.text

    for answer in (refused, batch):
        assert answer.status_code == 503, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.headers["Retry-After"] == "1"
        problem = answer.json()
        assert problem["limit"] == "admission"
        assert problem["type"].endswith("/overloaded")
        assert "nothing was kept" in problem["detail"]
    assert unknown.status_code == 404  # reads are not submissions: never refused by it

    # Nothing was kept of the refused submission: its Idempotency-Key starts a new task.
    retried = await gateway.api.post("/v1/scores", json={"text": "Turned away."}, headers=key)
    assert retried.status_code == 202, retried.text
    assert gateway.admission.in_flight == 0
