"""A full work queue (`max-length` + `reject-publish`, applied as a policy to this module's
vhost, no scorer running) answers 503 with Retry-After and keeps nothing half-written."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import httpx
import pytest
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint, InfraError, set_queue_policy
from services.gateway.keys import generate_key
from shared.topology import SCORE_REQUESTS
from tests.integration.in_process import gateway_and_status

API_KEY = generate_key().token
QUEUE_LENGTH = 2
POLICY = {"max-length": QUEUE_LENGTH, "overflow": "reject-publish"}
MAX_TRIES = 20

Json = dict[str, Any]


def _apply_tiny_queue_policy(amqp_url: str, rabbitmq: Endpoint) -> None:
    try:
        set_queue_policy(
            amqp_url,
            "tiny-queue",
            SCORE_REQUESTS.name,
            POLICY,
            management_url=rabbitmq.management_url,
        )
    except (InfraError, OSError) as error:
        pytest.skip(f"cannot apply a queue policy (no rabbitmqctl, no management API): {error}")


@dataclass
class Stack:
    api: httpx.AsyncClient
    amqp_url: str
    mongo: AsyncMongoClient[Json]
    db_prefix: str

    @property
    def db(self) -> Any:
        return self.mongo[f"{self.db_prefix}_gateway"]


@pytest.fixture(scope="module")
async def stack(
    amqp_url: str, rabbitmq: Endpoint, mongo: Any, db_prefix: str
) -> AsyncIterator[Stack]:
    _apply_tiny_queue_policy(amqp_url, rabbitmq)
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "BOOTSTRAP_API_KEY": API_KEY,
        "RATE_LIMIT_PER_MIN": "0",
        "BROKER_TIMEOUT_S": "5",
    }
    async with gateway_and_status(env, api_key=API_KEY) as services:
        client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
        yield Stack(services.api, amqp_url, client, db_prefix)
        await client.close()


async def _purge_work_queue(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(SCORE_REQUESTS.name, ensure=True)
        await queue.purge()


async def test_a_full_queue_answers_503_and_keeps_nothing(stack: Stack) -> None:
    accepted: list[str] = []
    refused: httpx.Response | None = None
    refused_request: tuple[Json, str] | None = None
    for _ in range(MAX_TRIES):
        body = {"text": f"text {uuid.uuid4().hex}", "use_cache": False}
        key = uuid.uuid4().hex
        response = await stack.api.post("/v1/scores", json=body, headers={"Idempotency-Key": key})
        if response.status_code == 503:
            refused, refused_request = response, (body, key)
            break
        assert response.status_code == 202, response.text
        accepted.append(response.json()["task_id"])

    assert refused is not None, f"no 503 within {MAX_TRIES} submissions"
    assert refused_request is not None
    assert len(accepted) >= QUEUE_LENGTH
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert int(refused.headers["retry-after"]) > 0
    problem = refused.json()
    assert problem["status"] == 503
    assert "nothing of this request was kept" in problem["detail"]

    # Exactly the accepted submissions are kept, each counted once in flight.
    stored = [d["_id"] async for d in stack.db["submissions"].find({}, projection={"_id": 1})]
    assert sorted(stored) == sorted(accepted)
    marked = stack.db["submissions"].find({"in_flight": True}, projection={"_id": 1})
    markers = [d["_id"] async for d in marked]
    assert sorted(markers) == sorted(accepted)
    counter = await stack.db["in_flight_tenants"].find_one({"_id": "default"})
    assert counter is not None
    assert counter["count"] == len(accepted)

    # Still full: still 503, never 500.
    again = await stack.api.post("/v1/scores", json={"text": "still full", "use_cache": False})
    assert again.status_code == 503, again.text

    # Nothing was kept under the refused request's Idempotency-Key either: once there is room,
    # the same request is a new task, not a 409 or an earlier task.
    await _purge_work_queue(stack.amqp_url)
    body, key = refused_request
    retried = await stack.api.post("/v1/scores", json=body, headers={"Idempotency-Key": key})
    assert retried.status_code == 202, retried.text
    assert retried.json()["task_id"] not in accepted
