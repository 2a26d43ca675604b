"""A result-cache hit is answered `200 completed` at once, and announced by two publishes, its
acceptance and its completion. When the status service has applied only the acceptance (the
completion not confirmed: the outbox sweep announces it again after `OUTBOX_GRACE_S`), every
read still shows the completion, from the gateway's record of the submission: it read `queued`
with no result meanwhile (found in review). And the POST's answer describes the task as its
status URL does (rubric, model, metadata: found in a walkthrough).

Gateway and status in process, on the real broker and database; the half-announced hit is
the gateway's own record of it plus its acceptance published to the real broker."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from services.gateway.keys import generate_key
from services.gateway.submissions import Submissions
from shared.bus import publish_event
from shared.contracts import (
    CACHED_COMPLETION_SEQUENCE,
    DEFAULT_TENANT,
    HEURISTIC_PROMPT_VERSION,
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskEvent,
    accepted_event,
    event_sequence,
    new_id,
    utcnow,
)
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from tests.integration.in_process import GatewayAndStatus, gateway_and_status
from tests.support import eventually

API_KEY = generate_key().token
RESULT = ScoreResult(
    score=6.5,
    comment="From the cache.",
    model=HEURISTIC_PROMPT_VERSION,
    prompt_version=HEURISTIC_PROMPT_VERSION,  # the prompt of the gateway's LLM_PROVIDER
    cached=True,
)

pytestmark = pytest.mark.integration


@dataclass
class Stack:
    services: GatewayAndStatus
    submissions: Submissions
    settings: ServiceSettings
    raw: Any  # the gateway's submissions collection, read directly


@pytest.fixture(scope="module")
async def stack(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Stack]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "BOOTSTRAP_API_KEY": API_KEY,
        "OUTBOX_GRACE_S": "3600",  # the sweep's own announcement is not what this looks at
    }
    settings = ServiceSettings.model_validate(env)
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    async with gateway_and_status(env, api_key=API_KEY) as services:
        database = settings.database_name("gateway")
        yield Stack(
            services, Submissions(client, database), settings, client[database]["submissions"]
        )
    await client.close()


async def _publish(stack: Stack, event: TaskEvent) -> None:
    broker = make_broker(stack.settings)
    async with broker:
        await broker.connect()
        await publish_event(broker, event, timeout=10)


async def _half_announced_hit(stack: Stack) -> ScoreText:
    """A cache hit as the gateway records it, whose completion the broker did not confirm:
    only its acceptance reaches the status service."""
    command = ScoreText(
        task_id=new_id(),
        tenant_id=DEFAULT_TENANT,
        text=f"A text whose score was cached {uuid.uuid4().hex}.",
        rubric="clarity",
        metadata={"order": 42},
    )
    await stack.submissions.insert(
        command,
        request_hash="h",
        idempotency_key=None,
        retention=timedelta(days=1),
        cache_key="k",
        cached_result=RESULT,
    )
    await stack.submissions.mark_unconfirmed(command.task_id)
    await _publish(stack, accepted_event(command))

    async def acceptance_applied() -> bool:
        answer = await stack.services.status.get(
            f"/internal/v1/tasks/{command.task_id}", params={"tenant_id": DEFAULT_TENANT}
        )
        return answer.status_code == 200

    await eventually(acceptance_applied, what="the status service applied the acceptance")
    return command


async def test_a_cache_hit_whose_completion_the_status_service_lacks_still_reads_completed(
    stack: Stack,
) -> None:
    command = await _half_announced_hit(stack)
    api = stack.services.api

    read = (await api.get(f"/v1/scores/{command.task_id}")).json()
    waited = await api.get(f"/v1/scores/{command.task_id}", params={"wait": 1, "status": "queued"})
    stream = await api.get(f"/v1/scores/{command.task_id}/events")

    assert (read["status"], read["result"]["score"]) == ("completed", 6.5)
    assert read["sequence"] == CACHED_COMPLETION_SEQUENCE
    assert (read["rubric"], read["metadata"]) == ("clarity", {"order": 42})
    assert waited.json()["status"] == "completed"  # differs from `queued`: answered at once
    assert stream.status_code == 200
    events = [line for line in stream.text.splitlines() if line.startswith("id:")]
    assert events == ["id: 0", f"id: {CACHED_COMPLETION_SEQUENCE}"]  # and the stream ended


async def test_the_answer_to_a_cache_hit_describes_the_task_as_its_status_url_does(
    stack: Stack,
) -> None:
    text = f"A text scored twice {uuid.uuid4().hex}."
    body = {"text": text, "rubric": "clarity", "metadata": {"order": 42}}
    first = await stack.services.api.post("/v1/scores", json=body)
    assert first.status_code == 202, first.text
    # Scored by no one here: its completion is published as a scorer would.
    task_id = first.json()["task_id"]
    await _publish(
        stack,
        TaskCompleted(
            task_id=task_id,
            sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
            attempt=1,
            submitted_at=utcnow(),
            result=RESULT.model_copy(update={"cached": False}),
        ),
    )

    async def cached() -> bool:  # the gateway's outcome consumer caches it as it notes it
        recorded = await stack.raw.find_one({"_id": task_id})
        return bool(recorded.get("finished_generation") == 0)

    await eventually(cached, what="the result cached")

    hit = await stack.services.api.post("/v1/scores", json=body)

    assert hit.status_code == 200, hit.text
    answer = hit.json()
    assert answer["result"]["cached"] is True
    assert (answer["rubric"], answer["model"], answer["metadata"]) == (
        "clarity",
        None,
        {"order": 42},
    )
    status_url = await stack.services.api.get(f"/v1/scores/{answer['task_id']}")
    shown = status_url.json()
    assert {k: shown[k] for k in ("rubric", "model", "metadata")} == {
        k: answer[k] for k in ("rubric", "model", "metadata")
    }
