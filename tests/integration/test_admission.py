"""Admission control of submissions on a real gateway: over its limit a submission gets 503
problem+json with `Retry-After` at once and nothing is kept; other requests pass; uploads that
have not arrived in full hold no place."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.types import Scope

from services.gateway import admission
from services.gateway.admission import AdaptiveLimit
from services.gateway.keys import generate_key
from tests.integration.in_process import gateway_and_status
from tests.support import eventually

API_KEY = generate_key().token
ADMIN_KEY = "admission-admin"


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
        "ADMIN_API_KEY": ADMIN_KEY,
        "RATE_LIMIT_PER_MIN": "0",
        "SUBMIT_MAX_CONCURRENCY": "1",  # one submission at a time, whatever the latency
    }
    async with gateway_and_status(env, api_key=API_KEY) as services:
        admission = services.gateway.state.submission_admission
        assert isinstance(admission, AdaptiveLimit)
        yield Gateway(services.api, admission)


@asynccontextmanager
async def _place_held(gateway: Gateway) -> AsyncIterator[None]:
    """The one place taken, as by a submission being worked on (its body arrived), until the
    block ends; a submission whose body is still on its way holds none."""
    assert gateway.admission.try_acquire()
    try:
        yield
    finally:
        gateway.admission.release(took_s=None)


async def _tenant_key(gateway: Gateway, tenant: str) -> dict[str, str]:
    made = await gateway.api.post(
        "/admin/v1/keys",
        json={"tenant_id": f"{tenant}-{uuid.uuid4().hex[:8]}"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert made.status_code == 201, made.text
    return {"Authorization": f"Bearer {made.json()['key']}"}


async def _stalled_uploads(
    gateway: Gateway, headers: dict[str, str], count: int, release: asyncio.Event
) -> list[asyncio.Task[httpx.Response]]:
    """`count` submissions whose bodies stop halfway until `release` is set; returned once the
    gateway has read the first half of each and is waiting for the rest."""
    waiting = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal waiting
        yield b'{"text": "An upload that stalls'
        waiting += 1  # the gateway asked for the rest (the in-process transport reads lazily)
        await release.wait()
        yield b' halfway through its body."}'

    uploads = [
        asyncio.create_task(
            gateway.api.post(
                "/v1/scores",
                content=body(),
                headers={**headers, "Content-Type": "application/json"},
            )
        )
        for _ in range(count)
    ]

    async def all_stalled() -> bool:
        return waiting == count

    await eventually(all_stalled, what="every upload stalled halfway through its body")
    return uploads


async def test_a_submission_over_the_limit_is_refused_at_once_and_keeps_nothing(
    gateway: Gateway,
) -> None:
    key = {"Idempotency-Key": f"adm-{uuid.uuid4().hex}"}
    async with _place_held(gateway):
        refused = await gateway.api.post("/v1/scores", json={"text": "Turned away."}, headers=key)
        batch = await gateway.api.post("/v1/batches", json={"items": [{"text": "Turned away."}]})
        unknown = await gateway.api.get(f"/v1/scores/{uuid.uuid4().hex}")

    for answer in (refused, batch):
        assert answer.status_code == 503, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.headers["Retry-After"] == "1"
        problem = answer.json()
        assert problem["limit"] == "admission"
        assert problem["type"].endswith("/overloaded")
    assert "; nothing was kept. Retry after 1 s." in batch.json()["detail"]
    # Keyed, a replay is told its key's first request, if any, goes on (it read "nothing was
    # kept", which told a client whose first request had been accepted that it was lost).
    assert refused.json()["detail"].endswith(
        "; nothing of this request was kept, and a request accepted earlier under its "
        "Idempotency-Key is unaffected. Retry after 1 s with the same Idempotency-Key."
    )
    assert unknown.status_code == 404  # reads are not submissions: never refused by it

    # Nothing was kept of the refused submission: its Idempotency-Key starts a new task.
    retried = await gateway.api.post("/v1/scores", json={"text": "Turned away."}, headers=key)
    assert retried.status_code == 202, retried.text
    assert gateway.admission.in_flight == 0


@pytest.mark.parametrize(
    "keys",
    [[("Idempotency-Key", "")], [("Idempotency-Key", "a"), ("Idempotency-Key", "b")]],
    ids=["empty", "sent twice"],
)
async def test_a_key_the_route_would_refuse_is_not_named_in_the_overload_answer(
    gateway: Gateway, keys: list[tuple[str, str]]
) -> None:
    """ "Retry with the same Idempotency-Key" would be answered 400: the plain words."""
    async with _place_held(gateway):
        refused = await gateway.api.post(
            "/v1/scores", json={"text": "Turned away."}, headers=httpx.Headers(keys)
        )
    assert refused.status_code == 503, refused.text
    assert refused.json()["detail"].endswith("; nothing was kept. Retry after 1 s.")


async def test_one_tenants_stalled_uploads_do_not_shut_out_another_tenants_submissions(
    gateway: Gateway,
) -> None:
    """As many uploads as the limit has places, stalled halfway: had they taken places as they
    came in, every other submission would be shed until the body timeout (30 s) freed them."""
    noisy, quiet = await _tenant_key(gateway, "noisy"), await _tenant_key(gateway, "quiet")
    release = asyncio.Event()
    uploads = await _stalled_uploads(gateway, noisy, int(gateway.admission.limit), release)
    try:
        answer = await gateway.api.post(
            "/v1/scores", json={"text": "A quiet tenant's text."}, headers=quiet
        )
    finally:
        release.set()
        finished = await asyncio.gather(*uploads)
    assert answer.status_code == 202, answer.text
    assert [upload.status_code for upload in finished] == [202] * len(uploads), [
        upload.text for upload in finished
    ]
    assert gateway.admission.in_flight == 0


async def test_a_batch_tells_admission_control_how_many_tasks_it_took_on(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through every middleware of the real gateway, the route's word reaches the limit: a
    batch is timed per task (`tests/unit/test_admission.py` for what that changes)."""
    weighed: list[int] = []
    tasks_taken = admission._tasks_taken

    def recorded(scope: Scope) -> int:
        weighed.append(tasks_taken(scope))
        return weighed[-1]

    monkeypatch.setattr(admission, "_tasks_taken", recorded)
    items = [{"text": f"Item {number} of a weighed batch."} for number in range(3)]
    answer = await gateway.api.post("/v1/batches", json={"items": items})
    single = await gateway.api.post("/v1/scores", json={"text": "A single text, weighed."})
    assert (answer.status_code, single.status_code) == (202, 202), answer.text + single.text
    assert weighed == [3, 1]
