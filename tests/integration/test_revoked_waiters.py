"""A key revoked while its request waits gets no more of the task than a new request with it
would (401): a long-poll opened before the revocation answered with the result, and an SSE
stream sent every change that came before its next heartbeat, the result included (found by
a review of tenant isolation). The gateway and the status service run in-process against
the real broker and database; the heartbeat is longer than the test, so only the changes
can have asked."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from shared.bus import publish_event
from shared.contracts import Phase, ScoreResult, TaskCompleted, event_sequence, utcnow
from shared.runtime import make_broker
from tests.integration.in_process import gateway_and_status
from tests.support import eventually

ADMIN = {"Authorization": "Bearer revoked-waiters-admin-key"}
RESULT_COMMENT = "the result a revoked key must not see"


@pytest.fixture(scope="module")
async def api(amqp_url: str, mongo: object, db_prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,  # type: ignore[attr-defined]
        "MONGO_DB_PREFIX": db_prefix,
        "INTERNAL_API_KEY": "revoked-waiters-internal-key",
        "ADMIN_API_KEY": "revoked-waiters-admin-key",
        "BOOTSTRAP_API_KEY": generate_key().token,
        "SSE_HEARTBEAT_S": "600",
        # One waiter per tenant: a second one refused (429) tells that the first is waiting.
        "LIVE_MAX_WAITERS_PER_TENANT": "1",
    }
    async with gateway_and_status(env) as services:
        yield services.api


async def _key(api: httpx.AsyncClient, tenant_id: str) -> tuple[str, dict[str, str]]:
    created = await api.post("/admin/v1/keys", json={"tenant_id": tenant_id}, headers=ADMIN)
    assert created.status_code == 201, created.text
    body = created.json()
    return body["key_id"], {"Authorization": f"Bearer {body['key']}"}


async def _submit(api: httpx.AsyncClient, headers: dict[str, str]) -> str:
    submitted = await api.post("/v1/scores", json={"text": f"t {uuid.uuid4()}"}, headers=headers)
    assert submitted.status_code == 202, submitted.text
    task_id: str = submitted.json()["task_id"]
    return task_id


async def _complete(amqp_url: str, task_id: str, tenant_id: str) -> None:
    event = TaskCompleted(
        task_id=task_id,
        tenant_id=tenant_id,
        attempt=1,
        submitted_at=utcnow(),
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        result=ScoreResult(score=7.5, comment=RESULT_COMMENT, model="m"),
    )
    broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await publish_event(broker, event, timeout=10)


@pytest.mark.parametrize("route", ["long-poll", "events"])
async def test_a_key_revoked_while_its_request_waits_gets_no_more_of_the_task(
    api: httpx.AsyncClient, amqp_url: str, route: str
) -> None:
    tenant_id = f"revoked-{uuid.uuid4().hex[:8]}"
    key_id, headers = await _key(api, tenant_id)
    task_id, probe_task = await _submit(api, headers), await _submit(api, headers)
    path = f"/v1/scores/{task_id}" + ("?wait=50" if route == "long-poll" else "/events")

    def wait_for_the_task() -> asyncio.Task[httpx.Response]:
        return asyncio.create_task(api.get(path, headers=headers, timeout=60))

    opened = [wait_for_the_task()]

    async def first_request_waits() -> bool:
        if opened[-1].done():  # refused (429): a probe held the tenant's one waiter then
            assert opened[-1].result().status_code == 429, opened[-1].result().text
            opened.append(wait_for_the_task())
            return False
        probe = await api.get(f"/v1/scores/{probe_task}?wait=0.01", headers=headers)
        return probe.status_code == 429

    await eventually(first_request_waits, what=f"the {route} waits for the task")
    waiting = opened[-1]
    revoked = await api.delete(f"/admin/v1/keys/{key_id}", headers=ADMIN)
    assert revoked.status_code == 200, revoked.text
    assert (await api.get(f"/v1/scores/{task_id}", headers=headers)).status_code == 401

    await _complete(amqp_url, task_id, tenant_id)
    answer = await waiting

    assert RESULT_COMMENT not in answer.text
    if route == "long-poll":
        assert answer.status_code == 401
        assert answer.headers["content-type"] == "application/problem+json"
    else:  # the stream had begun (200): it ends, the change unsent
        assert answer.status_code == 200
        assert '"completed"' not in answer.text
