"""`POST /v1/scores/{task_id}/cancel`: the gateway and the status service in-process against
the real broker and database (no scorer): what it answers, and the `score.cancel` it sends."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import httpx
import pytest
from pymongo import AsyncMongoClient

from services.gateway import publisher
from services.gateway.keys import ApiKeys, generate_key
from services.gateway.settings import GatewaySettings
from services.gateway.submissions import Submissions
from services.gateway.submit import settle_outcome
from shared.bus import publish_delayed, publish_event
from shared.contracts import (
    HEURISTIC_PROMPT_VERSION,
    CancelTask,
    Phase,
    RescoreTask,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskError,
    TaskEvent,
    TaskFailed,
    event_sequence,
    generation_of,
    new_id,
    utcnow,
)
from shared.runtime import make_broker
from shared.topology import TASK_CANCELS, TASKS
from tests.integration.in_process import gateway_and_status
from tests.support import CommandCounter, drain, eventually

API_KEY = generate_key().token  # registered for the default tenant by BOOTSTRAP_API_KEY
CALLBACK = "https://example.com/hook"
# As the scorer of the gateway's LLM_PROVIDER (the heuristic, unset) sends it: cached.
RESULT = ScoreResult(score=7.5, comment="fine", model="m", prompt_version=HEURISTIC_PROMPT_VERSION)


@dataclass
class Stack:
    api: httpx.AsyncClient
    amqp_url: str
    mongo: AsyncMongoClient[dict[str, Any]]
    db_prefix: str
    # While set, every request of the gateway to the status service fails to connect.
    status_is_away: bool = False

    @property
    def submissions(self) -> Any:
        return self.mongo[f"{self.db_prefix}_gateway"]["submissions"]

    @contextmanager
    def status_away(self) -> Iterator[None]:
        self.status_is_away = True
        try:
            yield
        finally:
            self.status_is_away = False


@pytest.fixture(scope="module")
async def stack(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Stack]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "BOOTSTRAP_API_KEY": API_KEY,
    }
    async with gateway_and_status(env, api_key=API_KEY) as services:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
        stack = Stack(services.api, amqp_url, client, db_prefix)

        async def away_or_through(request: httpx.Request) -> None:
            if stack.status_is_away:
                raise httpx.ConnectError("the status service is away", request=request)

        services.status.event_hooks = {"request": [away_or_through], "response": []}
        yield stack
        await client.close()


async def _sent_cancels(amqp_url: str) -> list[CancelTask]:
    """Drain `scorebox.task-cancels` (no scorer consumes it here)."""
    cancels = []
    for message in await drain(amqp_url, TASK_CANCELS.name):
        assert message.routing_key == CancelTask.routing_key
        cancels.append(CancelTask.model_validate_json(message.body))
    return cancels


async def _submitted(stack: Stack, text: str = "A task to cancel.") -> str:
    body = {"text": text, "delay_seconds": 600, "callback_url": CALLBACK}
    response = await stack.api.post("/v1/scores", json=body)
    assert response.status_code == 202, response.text
    task_id: str = response.json()["task_id"]
    return task_id


def _terminal(
    kind: type[TaskEvent],
    task_id: str,
    *,
    tenant_id: str = "default",
    generation: int = 0,
    submitted_at: datetime | None = None,
) -> TaskEvent:
    """A `task.completed` or `task.failed` of the task's `generation`, as the scorer sends it."""
    fields: dict[str, Any] = {
        "task_id": task_id,
        "tenant_id": tenant_id,
        "generation": generation,
        "attempt": 1,
        "submitted_at": submitted_at or utcnow(),
        "sequence": event_sequence(generation=generation, attempt=1, phase=Phase.TERMINAL),
    }
    if kind is TaskCompleted:
        # The stack's scorer is the offline one, which asks for its own name.
        return TaskCompleted(**fields, result=RESULT, requested_model=HEURISTIC_PROMPT_VERSION)
    error = TaskError(code="model_refused", message="refused", retryable=False)
    return TaskFailed(**fields, error=error, dead_lettered=False)


async def _outcome(stack: Stack, task_id: str, kind: type[TaskEvent]) -> TaskEvent:
    """The outcome of the submitted task's generation 0."""
    recorded = await stack.submissions.find_one({"_id": task_id})
    submitted_at = ScoreText.model_validate(recorded["command"]).submitted_at
    return _terminal(kind, task_id, submitted_at=submitted_at)


async def _published(stack: Stack, event: TaskEvent) -> None:
    broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": stack.amqp_url}))
    async with broker:
        await broker.connect()
        await publish_event(broker, event, timeout=10)


async def _finished_generation_noted(stack: Stack, task_id: str, generation: int) -> None:
    """Wait for the gateway's outcome consumer to note the generation as finished."""

    async def noted() -> bool:
        recorded = await stack.submissions.find_one({"_id": task_id})
        return bool(recorded.get("finished_generation") == generation)

    await eventually(noted, what=f"generation {generation} of {task_id} noted as finished")


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
    # The delayed task's due time: the scorer keeps the cancellation until a retention after it.
    assert sent.not_before is not None
    assert sent.not_before == recorded["not_before"]

    # A re-score or a replay took generation 2 since: a second cancel (idempotent) sends that.
    await stack.submissions.update_one({"_id": task_id}, {"$set": {"generation": 2}})
    again = await stack.api.post(f"/v1/scores/{task_id}/cancel")
    assert again.status_code == 202, again.text
    assert [cancel.generation for cancel in await _sent_cancels(stack.amqp_url)] == [2]


@pytest.mark.parametrize("body", [b"{bad", b'{"reason": "a mistake"}'])
async def test_a_cancel_sent_a_body_is_refused_and_cancels_nothing(
    stack: Stack, body: bytes
) -> None:
    """A route that takes no body ignored one, a malformed one included, and cancelled (found
    in a walkthrough, where `{bad` fired a cron run). Refused after the key check: without a
    key, 401 first."""
    task_id = await _submitted(stack)
    await _sent_cancels(stack.amqp_url)
    path = f"/v1/scores/{task_id}/cancel"
    json_type = {"Content-Type": "application/json"}

    refused = await stack.api.post(path, content=body, headers=json_type)
    keyless = await stack.api.post(path, content=body, headers={**json_type, "Authorization": ""})
    empty = await stack.api.post(path, content=b"{}", headers=json_type)

    _assert_problem(refused, 422)
    assert refused.json()["detail"] == (
        "body: this route takes no request body; send none; nothing was cancelled."
    )
    assert keyless.status_code == 401
    assert empty.status_code == 202, empty.text  # `{}`: what some clients send for none
    assert len(await _sent_cancels(stack.amqp_url)) == 1  # the `{}` one's alone


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


@pytest.mark.parametrize("kind", [TaskCompleted, TaskFailed], ids=["completed", "failed"])
async def test_a_generation_whose_outcome_the_gateway_applied_is_refused_without_the_status(
    stack: Stack, kind: type[TaskEvent]
) -> None:
    """The outcome noted on the submission is enough: the status service may be away, or have
    expired the task, and the scorer may have forgotten it (its attempts' retention shorter
    than the submission's), which then recorded a second, contradicting outcome."""
    task_id = await _submitted(stack)
    await _published(stack, await _outcome(stack, task_id, kind))
    await _finished_generation_noted(stack, task_id, 0)
    await _sent_cancels(stack.amqp_url)

    with stack.status_away():
        response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    _assert_problem(response, 409)
    assert await _sent_cancels(stack.amqp_url) == []

    # Generation 1 taken since: after a failure a DLQ replay, not finished, so cancelled;
    # after a completion a re-score, which the scorer never cancels (the completion stands).
    await stack.submissions.update_one({"_id": task_id}, {"$set": {"generation": 1}})
    with stack.status_away():
        again = await stack.api.post(f"/v1/scores/{task_id}/cancel")
    if kind is TaskCompleted:
        _assert_problem(again, 409)
        assert await _sent_cancels(stack.amqp_url) == []
        return
    assert again.status_code == 202, again.text
    assert [cancel.generation for cancel in await _sent_cancels(stack.amqp_url)] == [1]


@pytest.mark.parametrize("kind", [TaskCompleted, TaskFailed], ids=["completed", "failed"])
async def test_a_generation_the_status_shows_finished_is_refused_before_the_gateway_notes_it(
    stack: Stack, kind: type[TaskEvent]
) -> None:
    """The status service shows the outcome; the gateway's record does not yet (its outcome
    consumer behind): the status answers alone. A check taking only a later generation's end
    for the end of this one (a mutant that survived the suite) let a failed task's cancel
    through, 202 and a cancel sent for nothing."""
    task_id = await _submitted(stack)
    outcome = await _outcome(stack, task_id, kind)
    await _published(stack, outcome)
    await _finished_generation_noted(stack, task_id, 0)
    status = "completed" if kind is TaskCompleted else "failed"

    async def shown() -> bool:
        return bool((await stack.api.get(f"/v1/scores/{task_id}")).json()["status"] == status)

    await eventually(shown, what=f"the status service showing {task_id} {status}")
    await stack.submissions.update_one({"_id": task_id}, {"$unset": {"finished_generation": ""}})
    await _sent_cancels(stack.amqp_url)

    response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    _assert_problem(response, 409)
    assert await _sent_cancels(stack.amqp_url) == []


async def test_a_task_answered_from_the_result_cache_is_refused_with_409(stack: Stack) -> None:
    text = f"A text scored once, then answered from the cache ({uuid.uuid4().hex})."
    scored = await _submitted(stack, text)
    await _published(stack, await _outcome(stack, scored, TaskCompleted))
    await _finished_generation_noted(stack, scored, 0)  # and its result cached

    hit = await stack.api.post("/v1/scores", json={"text": text, "callback_url": CALLBACK})
    assert hit.status_code == 200, hit.text
    assert hit.json()["result"]["cached"] is True
    task_id = hit.json()["task_id"]
    # Its announcement of the completion, applied, notes its generation 0 as finished too;
    # forgotten here, as when that announcement was lost (answered all the same): the cache
    # hit recorded on the submission answers alone, the status service away.
    await _finished_generation_noted(stack, task_id, 0)
    await stack.submissions.update_one({"_id": task_id}, {"$unset": {"finished_generation": ""}})
    await _sent_cancels(stack.amqp_url)

    with stack.status_away():
        response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    _assert_problem(response, 409)
    assert await _sent_cancels(stack.amqp_url) == []


async def test_a_cancel_is_sent_while_the_status_service_is_away(stack: Stack) -> None:
    """The scorer finds a finished task too late to cancel: the status is not needed."""
    task_id = await _submitted(stack)
    await _sent_cancels(stack.amqp_url)

    with stack.status_away():
        response = await stack.api.post(f"/v1/scores/{task_id}/cancel")
        poll = await stack.api.get(f"/v1/scores/{task_id}")

    assert response.status_code == 202, response.text
    assert [cancel.task_id for cancel in await _sent_cancels(stack.amqp_url)] == [task_id]
    assert poll.status_code == 503, poll.text  # the status service was away indeed
    # A read changes nothing: never the submission's "nothing was kept", which told a
    # client polling an accepted task that it was lost (resubmitted, it was scored twice).
    assert "nothing was kept" not in poll.json()["detail"]
    assert "cannot be read right now" in poll.json()["detail"]


async def test_a_cancel_the_broker_did_not_confirm_is_503_and_may_have_been_queued(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the 503 of a request that kept nothing: an unconfirmed publish may be queued."""
    task_id = await _submitted(stack)

    async def unconfirmed(*_: Any, **__: Any) -> None:
        raise TimeoutError("no confirm")

    monkeypatch.setattr(publisher, "publish_cancel", unconfirmed)
    response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    _assert_problem(response, 503)
    assert response.headers["Retry-After"] == "5"
    detail = response.json()["detail"]
    assert "nothing was kept" not in detail
    assert "may or may not have been queued; send it again" in detail


class NoSlots:
    """The in-flight gate, releasing nothing (only the submission's writes are counted)."""

    enabled = True

    async def acquire(self, tenant_id: str, tasks: int) -> None:
        return None

    async def refuse_if_full(self, tenant_id: str, tasks: int) -> None:
        return None

    async def release(self, tenant_id: str, task_id: str) -> None:
        return None


@pytest.mark.parametrize("kind", [TaskCompleted, TaskFailed], ids=["completed", "failed"])
async def test_the_finished_generation_is_noted_in_the_outcomes_one_write(
    mongo: Any, db_prefix: str, kind: type[TaskEvent]
) -> None:
    """With the task's generation and the removal of its in-flight mark: no statement more
    per task than before."""
    writes = CommandCounter("update")
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        mongo.url, tz_aware=True, event_listeners=[writes]
    )
    database = f"{db_prefix}_outcome_write_{uuid.uuid4().hex[:8]}"
    task_id = new_id()
    try:
        await client[database]["submissions"].insert_one(
            {"_id": task_id, "tenant_id": "acme", "state": "accepted", "in_flight": True}
        )
        await settle_outcome(
            _terminal(kind, task_id, tenant_id="acme", generation=2),
            submissions=Submissions(client, database),
            in_flight=NoSlots(),
            cache=cast(Any, None),  # the submission has no cache key: not asked
            now=utcnow(),
        )
        stored = await client[database]["submissions"].find_one({"_id": task_id})
    finally:
        await client.drop_database(database)
        await client.close()

    assert writes.statements == 1
    assert stored is not None
    assert stored["finished_generation"] == 2
    assert "in_flight" not in stored


async def _replayed_after(stack: Stack, kind: type[TaskEvent]) -> str:
    """A task whose generation 0 ended with `kind`, as the status service shows it, and that
    generation 1 (a DLQ replay, or a re-score) now runs without the status service having
    heard of it yet (its best-effort `task.accepted` not applied)."""
    task_id = await _submitted(stack)
    await _published(stack, await _outcome(stack, task_id, kind))
    await _finished_generation_noted(stack, task_id, 0)
    submissions = Submissions(stack.mongo, f"{stack.db_prefix}_gateway")
    assert await submissions.replay_generation(task_id, of=0) == 1
    await _sent_cancels(stack.amqp_url)
    return task_id


async def test_a_pending_dlq_replay_is_cancelled_while_the_status_shows_its_failure(
    stack: Stack,
) -> None:
    """The status service's failure was taken as the end of any generation: a replay not yet
    run was refused 409 "finished" (and ran), though the scorer cancels it, and the same
    request with the status service away was accepted."""
    task_id = await _replayed_after(stack, TaskFailed)

    response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    assert response.status_code == 202, response.text
    assert [cancel.generation for cancel in await _sent_cancels(stack.amqp_url)] == [1]


async def test_a_rescore_of_a_completed_task_is_still_refused_with_409(stack: Stack) -> None:
    """A completion stands over a newer generation (the scorer refuses that cancel)."""
    task_id = await _replayed_after(stack, TaskCompleted)

    response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    _assert_problem(response, 409)
    assert await _sent_cancels(stack.amqp_url) == []


async def test_a_rescore_the_status_service_shows_queued_is_refused_with_409(
    stack: Stack,
) -> None:
    """The re-score announced to the projection, the task read `queued` again and a cancel
    was answered 202 "cancelling", though the scorer never cancels a re-score of a completed
    task (found in review). The gateway's record knows its latest outcome is a completion."""
    task_id = await _submitted(stack)
    await _published(stack, await _outcome(stack, task_id, TaskCompleted))
    await _finished_generation_noted(stack, task_id, 0)
    broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": stack.amqp_url}))
    async with broker:
        await broker.connect()
        request = RescoreTask(task_id=task_id, rubric_version="judge-v2", run_id=new_id())
        await publish_delayed(
            broker,
            request,
            exchange=TASKS,
            routing_key=request.routing_key,
            not_before=None,
            now=utcnow(),
            timeout=10,
        )

    async def queued_again() -> bool:
        view = (await stack.api.get(f"/v1/scores/{task_id}")).json()
        return bool(view["status"] == "queued" and generation_of(view["sequence"]) == 1)

    await eventually(queued_again, what="the re-score shown queued")
    await _sent_cancels(stack.amqp_url)

    response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    _assert_problem(response, 409)
    assert await _sent_cancels(stack.amqp_url) == []


async def test_a_generation_past_the_one_after_a_completion_is_left_to_the_status_service(
    stack: Stack,
) -> None:
    """Generation 2 over a completion of 0 noted: generation 1 (a re-score) may have failed
    without its outcome noted here (an older replica applied it, or the outcome consumer is
    behind), and 2 be its DLQ replay, which the scorer cancels. Refused from the record
    alone, it was answered 409 (found in review); the status service is asked instead."""
    task_id = await _submitted(stack)
    await _published(stack, await _outcome(stack, task_id, TaskCompleted))
    await _finished_generation_noted(stack, task_id, 0)
    await stack.submissions.update_one({"_id": task_id}, {"$set": {"generation": 2}})
    await _sent_cancels(stack.amqp_url)

    with stack.status_away():
        response = await stack.api.post(f"/v1/scores/{task_id}/cancel")

    assert response.status_code == 202, response.text
    assert [cancel.generation for cancel in await _sent_cancels(stack.amqp_url)] == [2]
