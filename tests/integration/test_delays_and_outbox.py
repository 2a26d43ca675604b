"""Delayed tasks wait on the broker's wait-queue ladder; interrupted submissions are sent by the
gateway's outbox sweep. Gateway, scorer (offline heuristic model) and status in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from pymongo import AsyncMongoClient

from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.scorer.app import create_app as create_scorer
from services.scorer.model.settings import ModelSettings
from services.scorer.scoring import DUE_SLACK
from services.scorer.settings import ScorerSettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.contracts import DEFAULT_TENANT, ScoreText, new_id, utcnow
from tests.support import eventually, running

API_KEY = generate_key().token


@dataclass
class Flow:
    api: httpx.AsyncClient
    status: httpx.AsyncClient
    submissions: Any
    status_database: Any

    async def view(self, task_id: str) -> dict[str, Any]:
        response = await self.api.get(f"/v1/scores/{task_id}")
        body: dict[str, Any] = response.json()
        return body

    async def completed(self, task_id: str) -> dict[str, Any]:
        async def done() -> dict[str, Any] | None:
            view = await self.view(task_id)
            return view if view.get("status") == "completed" else None

        return await eventually(done, timeout_s=60, what=f"{task_id} completed")

    async def status_view(self, task_id: str) -> dict[str, Any] | None:
        response = await self.status.get(
            f"/internal/v1/tasks/{task_id}", params={"tenant_id": DEFAULT_TENANT}
        )
        return response.json() if response.status_code == 200 else None

    async def history(self, task_id: str) -> list[dict[str, Any]]:
        response = await self.status.get(
            f"/internal/v1/tasks/{task_id}/history", params={"tenant_id": DEFAULT_TENANT}
        )
        changes: list[dict[str, Any]] = response.json()["changes"]
        return changes


@pytest.fixture(scope="module")
async def flow(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Flow]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "LLM_PROVIDER": "heuristic",
        "BOOTSTRAP_API_KEY": API_KEY,
        "RATE_LIMIT_PER_MIN": "0",
        "OUTBOX_GRACE_S": "1",
        "OUTBOX_INTERVAL_S": "0.2",
        "SCORER_STARTED_AFTER_S": "0",  # every attempt announces `processing`
    }
    scorer = create_scorer(ScorerSettings.model_validate(env), ModelSettings.model_validate(env))
    status = create_status(StatusSettings.model_validate(env))
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    async with running(status) as status_client, running(scorer):
        gateway = create_gateway(GatewaySettings.model_validate(env), status_http=status_client)
        async with running(gateway) as api:
            api.headers["Authorization"] = f"Bearer {API_KEY}"
            yield Flow(
                api,
                status_client,
                client[f"{db_prefix}_gateway"]["submissions"],
                client[f"{db_prefix}_status"],
            )
    await client.close()


async def test_a_delayed_task_is_scheduled_and_not_scored_before_it_is_due(flow: Flow) -> None:
    response = await flow.api.post(
        "/v1/scores", json={"text": "Later, please.", "delay_seconds": 3}
    )
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "scheduled"
    task_id = response.json()["task_id"]
    first = await flow.view(task_id)
    assert first["status"] == "scheduled"
    due = datetime.fromisoformat(first["not_before"])

    await flow.completed(task_id)
    changes = await flow.history(task_id)
    assert [change["status"] for change in changes] == ["scheduled", "processing", "completed"]
    started = datetime.fromisoformat(changes[1]["occurred_at"])
    # The scorer takes a task up to DUE_SLACK early rather than wait on the ladder again.
    assert started >= due - DUE_SLACK, f"scored at {started}, before it was due at {due}"


async def test_not_before_in_the_past_is_queued_at_once(flow: Flow) -> None:
    past = (utcnow() - timedelta(minutes=5)).isoformat()
    response = await flow.api.post("/v1/scores", json={"text": "Now.", "not_before": past})
    assert response.json()["status"] == "queued"
    await flow.completed(response.json()["task_id"])


async def test_a_task_delayed_beyond_the_retention_keeps_its_record_until_it_ran(
    flow: Flow,
) -> None:
    """Its record carries the in-flight mark its outcome releases: expiring it before the
    task runs (a day after the submission, IDEMPOTENCY_TTL_S) would leak the slot."""
    delay = timedelta(days=7)
    response = await flow.api.post(
        "/v1/scores",
        json={"text": "Next week.", "delay_seconds": int(delay.total_seconds())},
    )
    assert response.status_code == 202, response.text
    record = await flow.submissions.find_one({"_id": response.json()["task_id"]})
    assert record is not None
    assert record["expires_at"] >= record["not_before"] + timedelta(days=1)


async def test_a_delayed_task_the_projection_never_heard_of_reads_scheduled_until_due(
    flow: Flow,
) -> None:
    """Its announcement (`task.accepted`, best effort) was lost, so the status service hears
    of it only when it runs: the gateway answers from its own record until then, not only
    for READ_YOUR_WRITES_WINDOW_S after the submission (it answered 404 for up to 7 days)."""
    response = await flow.api.post(
        "/v1/scores", json={"text": "Tomorrow.", "delay_seconds": 86_400}
    )
    assert response.status_code == 202, response.text
    task_id = response.json()["task_id"]

    async def announced() -> bool:
        return (await flow.status_view(task_id)) is not None

    await eventually(announced, what="the projection heard of the task")
    await flow.status_database["tasks"].delete_one({"_id": task_id})  # as if never announced
    an_hour_ago = utcnow() - timedelta(hours=1)
    await flow.submissions.update_one({"_id": task_id}, {"$set": {"created_at": an_hour_ago}})

    view = await flow.view(task_id)
    assert view["status"] == "scheduled", view


@pytest.mark.parametrize(
    "state",
    [
        pytest.param("accepting", id="interrupted before its publish"),
        pytest.param("unconfirmed", id="published, confirm never came"),
    ],
)
async def test_a_submission_whose_command_may_be_unsent_is_sent_by_the_outbox(
    flow: Flow, state: str
) -> None:
    # What a gateway that died between recording a submission and publishing it leaves
    # behind, or one whose publish the broker did not confirm (a memory alarm).
    submitted_at = utcnow() - timedelta(minutes=1)
    command = ScoreText(task_id=new_id(), text="Left behind by a crash.", submitted_at=submitted_at)
    await flow.submissions.insert_one(
        {
            "_id": command.task_id,
            "tenant_id": command.tenant_id,
            "state": state,
            "request_hash": "x",
            "cache_key": "x",
            "created_at": submitted_at,
            "not_before": None,
            "expires_at": submitted_at + timedelta(days=1),
            "command": command.model_dump(mode="json"),
        }
    )
    view = await flow.completed(command.task_id)
    assert view["result"]["model"] == "heuristic-v1"
    stored = await flow.submissions.find_one({"_id": command.task_id})
    assert stored["state"] == "accepted"
