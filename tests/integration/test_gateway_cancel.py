"""`POST /v1/scores/{task_id}/cancel`: the gateway and the status service in-process against
the real broker and database (no scorer): what it answers, and the `score.cancel` it sends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import httpx
import pytest
from pymongo import AsyncMongoClient

from services.gateway.app import create_app as create_gateway
from services.gateway.keys import ApiKeys, generate_key
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.bus import publish_event
from shared.contracts import (
    CancelTask,
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    event_sequence,
    utcnow,
)
from shared.runtime import make_broker
from shared.topology import TASK_CANCELS
from tests.support import eventually, running

API_KEY = generate_key().token  # registered for the default tenant by BOOTSTRAP_API_KEY
CALLBACK = "https://example.com/hook"


@dataclass
class Stack:
    api: httpx.AsyncClient
    amqp_url: str
    mongo: AsyncMongoClient[dict[str, Any]]
    db_prefix: str

    @property
    def submissions(self) -> Any:
        return self.mongo[f"{self.db_prefix}_gateway"]["submissions"]


@pytest.fixture(scope="module")
async def stack(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Stack]:
    env = {"RABBITMQ_URL": amqp_url, "MONGO_URL": mongo.url, "MONGO_DB_PREFIX": db_prefix}
    status_app = create_status(StatusSettings.model_validate(env))
    async with running(status_app) as status_client:
        settings = GatewaySettings.model_validate({**env, "BOOTSTRAP_API_KEY": API_KEY})
        async with running(create_gateway(settings, status_http=status_client)) as api:
            api.headers["Authorization"] = f"Bearer {API_KEY}"
            client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
            yield Stack(api, amqp_url, client, db_prefix)
            await client.close()


async def _sent_cancels(amqp_url: str) -> list[CancelTask]:
    """Drain `scorebox.task-cancels` (no scorer consumes it here)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(TASK_CANCELS.name, ensure=True)
        cancels = []
        while (message := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
            assert message.routing_key == CancelTask.routing_key
            cancels.append(CancelTask.model_validate_json(message.body))
        return cancels


async def _submitted(stack: Stack) -> str:
    body = {"text": "A task to cancel.", "delay_seconds": 600, "callback_url": CALLBACK}
    response = await stack.api.post("/v1/scores", json=body)
    assert response.status_code == 202, response.text
    task_id: str = response.json()["task_id"]
    return task_id


def _assert_problem(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")


async def test_a_cancel_is_accepted_and_sends_the_tasks_latest_generation(stack: Stack) -> None:
    task_id = await _submitted(stack)
    await _sent_cancels(stack.amqp_url)
    recorded = await stack.submissions.find_one({"_id": task_id})

    response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    assert response.status_code == 202, response.text
    assert response.headers["Location"] == f"/v1/scores/{task_id}"
    assert response.json() == {
        "task_id": task_id,
        "status": "cancelling",
        "status_url": f"/v1/scores/{task_id}",
    }
    [sent] = await _sent_cancels(stack.amqp_url)
    command = ScoreText.model_validate(recorded["command"])
    assert (sent.task_id, sent.tenant_id, sent.generation) == (task_id, "default", 0)
    assert sent.submitted_at == command.submitted_at
    assert (sent.api_key_id, sent.callback_url) == (command.api_key_id, CALLBACK)
    assert sent.api_key_id is not None

    # A re-score or a replay took generation 2 since: a second cancel (idempotent) sends that.
    await stack.submissions.update_one({"_id": task_id}, {"$set": {"generation": 2}})
    again = await stack.api.post(f"/v1/scores/{task_id}/cancel")
    assert again.status_code == 202, again.text
    assert [cancel.generation for cancel in await _sent_cancels(stack.amqp_url)] == [2]


async def test_an_unknown_task_or_another_tenants_is_not_found(stack: Stack) -> None:
    task_id = await _submitted(stack)
    keys = ApiKeys(stack.mongo, f"{stack.db_prefix}_gateway")
    _, other_key = await keys.create(tenant_id="other", name="test", now=utcnow())
    await _sent_cancels(stack.amqp_url)

    others = await stack.api.post(
        f"/v1/scores/{task_id}/cancel", headers={"Authorization": f"Bearer {other_key}"}
    )
    unknown = await stack.api.post("/v1/scores/0123456789abcdef/cancel")
    malformed = await stack.api.post("/v1/scores/not%20an%20id/cancel")

    for response in (others, unknown, malformed):
        _assert_problem(response, 404)
    assert others.json()["detail"] == unknown.json()["detail"].replace("0123456789abcdef", task_id)
    assert await _sent_cancels(stack.amqp_url) == []


async def test_a_finished_task_is_refused_with_409(stack: Stack) -> None:
    task_id = await _submitted(stack)
    recorded = await stack.submissions.find_one({"_id": task_id})
    completed = TaskCompleted(
        task_id=task_id,
        attempt=1,
        submitted_at=ScoreText.model_validate(recorded["command"]).submitted_at,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        result=ScoreResult(score=7.5, comment="fine", model="m"),
    )
    broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": stack.amqp_url}))
    async with broker:
        await broker.connect()
        await publish_event(broker, completed, timeout=10)

    async def completed_view() -> bool:
        view = (await stack.api.get(f"/v1/scores/{task_id}")).json()
        return bool(view["status"] == "completed")

    await eventually(completed_view, what="completed")
    await _sent_cancels(stack.amqp_url)

    response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    _assert_problem(response, 409)
    assert await _sent_cancels(stack.amqp_url) == []
