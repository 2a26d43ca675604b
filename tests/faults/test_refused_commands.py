"""A full score queue refuses commands; the status projection may take its copy all the same.

`scorebox.tasks` routes a command to the scorer's queue and to the projection's. When the
score queue is full (`x-overflow: reject-publish`) the broker refuses the publish, and the
gateway answers 503 and keeps nothing, but the projection's queue has taken its copy. The
gateway then withdraws the task, so the projection never shows a task nobody was told of.

The score queue is made full with a policy (`max-length` 0, the lower of policy and argument
applies) and one message over it in this module's vhost, then emptied and the policy
removed. Gateway and status service run in-process on the real broker and database; nothing
scores. A re-score is not copied to the projection at all, and one the full queue refuses
leaves the task's earlier outcome in view.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import httpx
import pytest
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.projection import readable
from services.status.settings import StatusSettings
from shared.contracts import (
    Contract,
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    event_sequence,
    utcnow,
)
from shared.http import PROBLEM_JSON
from shared.topology import EVENTS, SCORE_REQUESTS, STATUS_PROJECTION, TASKS
from tests.faults.harness import rabbitmqctl, rabbitmqctl_available, vhost_of
from tests.support import eventually, queue_made_full, rescore_request, running

API_KEY = generate_key().token
POLICY = "scorebox-test-score-queue-full"
TIMEOUT_S = 30.0

Mongo = AsyncMongoClient[dict[str, Any]]


@dataclass
class Stack:
    api: httpx.AsyncClient
    tasks: Any  # the status projection's collection
    amqp_url: str

    async def task(self, task_id: str, **fields: Any) -> dict[str, Any] | None:
        """The task's visible document, when it has `fields`."""
        found: dict[str, Any] | None = await self.tasks.find_one(
            {"_id": task_id, **fields, **readable(utcnow())}
        )
        return found

    async def visible_tasks(self) -> list[dict[str, Any]]:
        """The projection's documents a read can see (not withdrawn, not expired)."""
        return [document async for document in self.tasks.find(readable(utcnow()))]

    async def projection_settled(self) -> bool:
        """Every message of the projection's queue handled and acknowledged."""
        listed = await rabbitmqctl(
            "list_queues", "-q", "-p", vhost_of(self.amqp_url), "name", "messages",
            "--formatter", "json",
        )  # fmt: skip
        depths = {queue["name"]: queue["messages"] for queue in json.loads(listed)}
        return depths.get(STATUS_PROJECTION.name) == 0


@pytest.fixture(scope="module")
async def stack(amqp_url: str, mongo: Endpoint, db_prefix: str) -> AsyncIterator[Stack]:
    if not rabbitmqctl_available(amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "BOOTSTRAP_API_KEY": API_KEY,
        "RATE_LIMIT_PER_MIN": "0",
    }
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    async with running(create_status(StatusSettings.model_validate(env))) as status_http:
        gateway = create_gateway(GatewaySettings.model_validate(env), status_http=status_http)
        async with running(gateway) as api:
            api.headers["Authorization"] = f"Bearer {API_KEY}"
            yield Stack(api, client[f"{db_prefix}_status"]["tasks"], amqp_url)
    await client.close()


def _score_queue_full(amqp_url: str) -> contextlib.AbstractAsyncContextManager[None]:
    return queue_made_full(amqp_url, SCORE_REQUESTS.name, policy=POLICY, timeout_s=TIMEOUT_S)


async def _publish(amqp_url: str, exchange: str, routing_key: str, message: Contract) -> None:
    """As the scorer or the scheduler sends `message`."""
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        target = await channel.get_exchange(exchange, ensure=False)
        body = aio_pika.Message(
            message.model_dump_json().encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT
        )
        await target.publish(body, routing_key=routing_key, timeout=TIMEOUT_S)


async def _true(value: bool) -> bool:
    return value


async def test_a_refused_submission_leaves_no_task_in_the_projection(stack: Stack) -> None:
    async with _score_queue_full(stack.amqp_url):
        single = await stack.api.post("/v1/scores", json={"text": "Refused, alone."})
        batch = await stack.api.post(
            "/v1/batches", json={"items": [{"text": "Refused, first."}, {"text": "Second."}]}
        )
        assert (single.status_code, batch.status_code) == (503, 503), (single.text, batch.text)
        for refused in (single, batch):
            assert refused.headers["content-type"].startswith(PROBLEM_JSON)
        await eventually(
            stack.projection_settled, timeout_s=TIMEOUT_S, what="the projection's queue handled"
        )
        assert await stack.visible_tasks() == []

    accepted = await stack.api.post("/v1/scores", json={"text": "Taken, once there is room."})
    assert accepted.status_code == 202, accepted.text
    await eventually(
        stack.projection_settled, timeout_s=TIMEOUT_S, what="the projection's queue handled"
    )
    [task] = await stack.visible_tasks()
    assert (task["_id"], task["status"]) == (accepted.json()["task_id"], "queued")


async def test_a_refused_rescore_leaves_the_earlier_outcome_in_view(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """A re-score goes to the scorer alone; the projection learns of it once the broker has
    confirmed it. It used to take its own copy of the command, which a full score queue
    refused all the same: the task showed `queued` for a generation that never ran, its
    result gone (for good once the request's retries ran out)."""
    caplog.set_level(logging.WARNING, logger="scorebox.gateway.rescore")
    submitted = await stack.api.post("/v1/scores", json={"text": "Scored, then re-scored."})
    assert submitted.status_code == 202, submitted.text
    task_id = submitted.json()["task_id"]
    queued = await eventually(lambda: stack.task(task_id), timeout_s=TIMEOUT_S, what="queued")
    completed = TaskCompleted(
        task_id=task_id,
        tenant_id=queued["tenant_id"],
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        attempt=1,
        submitted_at=queued["created_at"],
        result=ScoreResult(score=7.5, comment="good", model="fake-judge-1"),
    )
    await _publish(stack.amqp_url, EVENTS.name, completed.routing_key, completed)
    await eventually(
        lambda: stack.task(task_id, status="completed"), timeout_s=TIMEOUT_S, what="completed"
    )
    command = ScoreText(task_id=task_id, tenant_id=queued["tenant_id"], text="-")
    # Its first command, which nothing here scores, would keep the filler out.
    await rabbitmqctl("purge_queue", "-p", vhost_of(stack.amqp_url), SCORE_REQUESTS.name)

    async with _score_queue_full(stack.amqp_url):
        request = rescore_request(command)
        await _publish(stack.amqp_url, TASKS.name, request.routing_key, request)
        await eventually(
            lambda: _true(f"re-score of {task_id} not sent" in caplog.text),
            timeout_s=TIMEOUT_S,
            what="the re-score refused",
        )
        await eventually(
            stack.projection_settled, timeout_s=TIMEOUT_S, what="the projection's queue handled"
        )
        [task] = [task for task in await stack.visible_tasks() if task["_id"] == task_id]
        assert (task["status"], task["result"]["score"]) == ("completed", 7.5)

    # Room again: the request's retry sends the command, and the projection is told.
    requeued = await eventually(
        lambda: stack.task(task_id, status="queued"), timeout_s=TIMEOUT_S, what="re-scored"
    )
    assert requeued["sequence"] == event_sequence(generation=1, attempt=0, phase=Phase.ACCEPTED)
