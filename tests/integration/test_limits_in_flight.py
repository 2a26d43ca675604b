"""Tasks in flight per tenant, across replicas, released by outcomes, on the real broker and
database (no scorer: outcomes are published by hand)."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pymongo import AsyncMongoClient

from services.gateway.admission import AdaptiveLimit
from services.gateway.app import create_app as create_gateway
from services.gateway.cache import ResultCache
from services.gateway.errors import DatabaseUnavailable
from services.gateway.limits import InFlight
from services.gateway.settings import GatewaySettings
from services.gateway.submissions import Submissions
from services.gateway.submit import OutcomeProgress, settle_outcome
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.bus import publish_event
from shared.contracts import (
    HEURISTIC_PROMPT_VERSION,
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskError,
    TaskEvent,
    TaskFailed,
    event_sequence,
    new_id,
    utcnow,
)
from shared.runtime import make_broker
from shared.topology import GATEWAY_TASK_OUTCOMES
from tests.support import eventually, metric_sum, publish_together, running

ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MAX_IN_FLIGHT = 3

Json = dict[str, Any]


@dataclass
class Stack:
    api: httpx.AsyncClient
    status_app: FastAPI
    settings: GatewaySettings
    amqp_url: str
    mongo: AsyncMongoClient[Json]
    db_prefix: str
    admission: AdaptiveLimit

    @property
    def db(self) -> Any:
        return self.mongo[f"{self.db_prefix}_gateway"]

    async def tenant(self) -> tuple[str, dict[str, str]]:
        tenant_id = f"t-{uuid.uuid4().hex[:8]}"
        response = await self.api.post(
            "/admin/v1/keys", json={"tenant_id": tenant_id}, headers=ADMIN
        )
        assert response.status_code == 201, response.text
        return tenant_id, {"Authorization": f"Bearer {response.json()['key']}"}

    async def in_flight(self, tenant_id: str) -> int:
        document = await self.db["in_flight_tenants"].find_one({"_id": tenant_id})
        return 0 if document is None else int(document["count"])

    async def markers(self, tenant_id: str) -> int:
        """Submissions of the tenant marked as counted in flight."""
        marked = {"tenant_id": tenant_id, "in_flight": True}
        return int(await self.db["submissions"].count_documents(marked))

    async def stored(self, tenant_id: str) -> int:
        return int(await self.db["submissions"].count_documents({"tenant_id": tenant_id}))

    async def publish(self, *events: TaskEvent) -> None:
        broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": self.amqp_url}))
        async with broker:
            await broker.connect()
            for event in events:
                await publish_event(broker, event, timeout=10)

    async def outcomes_handled(self) -> float:
        """Events the gateway's outcome consumer has handled (its `/metrics`), however it
        settled them."""
        answer = await self.api.get("/metrics", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        queue = GATEWAY_TASK_OUTCOMES.name
        return metric_sum(answer.text, "scorebox_deliveries_total", queue=queue)

    async def publish_batch(self, events: list[TaskCompleted]) -> None:
        """`events` published together, as the scorer's batching publisher sends them: in
        one message (checked)."""
        broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": self.amqp_url}))
        async with broker:
            await broker.connect()
            batched = await publish_together(broker, events, max_batch=len(events))
            assert batched == len(events), "not sent as one batch"


@pytest.fixture(scope="module")
async def stack(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Stack]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "ADMIN_API_KEY": ADMIN_KEY,
        "RATE_LIMIT_PER_MIN": "0",
        "MAX_IN_FLIGHT_PER_TENANT": str(MAX_IN_FLIGHT),
        "MAX_BATCH_ITEMS": str(MAX_IN_FLIGHT),  # at most the limit: larger ones never fit
    }
    settings = GatewaySettings.model_validate(env)
    status = create_status(StatusSettings.model_validate(env))
    gateway = create_gateway(settings, status_http=_status_http(status))
    async with running(status), running(gateway) as api:
        client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
        admission = gateway.state.submission_admission
        assert isinstance(admission, AdaptiveLimit)
        yield Stack(api, status, settings, amqp_url, client, db_prefix, admission)
        await client.close()


def _status_http(status: FastAPI) -> httpx.AsyncClient:
    """A client of the in-process status app (each gateway closes its own)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=status), base_url="http://status")


def _assert_in_flight_problem(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.headers["retry-after"] == "5"
    body = response.json()
    assert body["status"] == 429
    assert body["limit"] == "in_flight"
    assert body["maximum"] == MAX_IN_FLIGHT
    assert str(MAX_IN_FLIGHT) in body["detail"]


async def _submit(stack: Stack, headers: dict[str, str], **fields: Any) -> httpx.Response:
    body = {"text": f"text {uuid.uuid4().hex}", "use_cache": False, **fields}
    return await stack.api.post("/v1/scores", json=body, headers=headers)


async def _up_to_the_limit(stack: Stack, headers: dict[str, str]) -> list[str]:
    """`MAX_IN_FLIGHT` tasks submitted, each accepted: their ids."""
    tasks = []
    for _ in range(MAX_IN_FLIGHT):
        response = await _submit(stack, headers)
        assert response.status_code == 202, response.text
        tasks.append(response.json()["task_id"])
    return tasks


def _completed(task_id: str, tenant_id: str, score: float = 6.0) -> TaskCompleted:
    return TaskCompleted(
        task_id=task_id,
        tenant_id=tenant_id,
        attempt=1,
        submitted_at=utcnow(),
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        result=ScoreResult(
            score=score, comment="ok", model="m", prompt_version=HEURISTIC_PROMPT_VERSION
        ),
        requested_model=HEURISTIC_PROMPT_VERSION,  # the stack's scorer is the offline one
    )


def _failed(task_id: str, tenant_id: str) -> TaskFailed:
    return TaskFailed(
        task_id=task_id,
        tenant_id=tenant_id,
        attempt=1,
        submitted_at=utcnow(),
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        error=TaskError(code="unusable_output", message="no", retryable=False),
        dead_lettered=False,
    )


async def _released(stack: Stack, task_id: str) -> None:
    async def gone() -> bool:
        marked = {"_id": task_id, "in_flight": True}
        return int(await stack.db["submissions"].count_documents(marked)) == 0

    await eventually(gone, what=f"in-flight slot of {task_id} released")


async def test_a_tenant_at_its_limit_gets_429_until_a_task_ends(stack: Stack) -> None:
    tenant, key = await stack.tenant()
    tasks = await _up_to_the_limit(stack, key)
    assert await stack.in_flight(tenant) == MAX_IN_FLIGHT

    _assert_in_flight_problem(await _submit(stack, key))
    _assert_in_flight_problem(await _submit(stack, key, delay_seconds=60))  # scheduled counts
    # Nothing half-written: no submission, no slot, no marker for the refused ones.
    assert await stack.stored(tenant) == MAX_IN_FLIGHT
    assert await stack.markers(tenant) == MAX_IN_FLIGHT
    assert await stack.in_flight(tenant) == MAX_IN_FLIGHT

    # The limit is the tenant's, not everyone's.
    _, other = await stack.tenant()
    assert (await _submit(stack, other)).status_code == 202

    await stack.publish(_completed(tasks[0], tenant))
    await _released(stack, tasks[0])
    assert await stack.in_flight(tenant) == MAX_IN_FLIGHT - 1
    fourth = await _submit(stack, key)
    assert fourth.status_code == 202, fourth.text
    _assert_in_flight_problem(await _submit(stack, key))

    await stack.publish(_failed(tasks[1], tenant))
    await _released(stack, tasks[1])
    assert await stack.in_flight(tenant) == MAX_IN_FLIGHT - 1

    # Duplicates and a completion after a failure release nothing more. The outcome queue has
    # one consumer and RabbitMQ keeps order, so once the last event's slot is released, the
    # duplicates before it have been handled.
    await stack.publish(
        _completed(tasks[0], tenant),
        _failed(tasks[0], tenant),
        _completed(tasks[1], tenant),
        _completed(tasks[2], tenant),
    )
    await _released(stack, tasks[2])
    assert await stack.in_flight(tenant) == 1  # the fourth task
    assert await stack.markers(tenant) == 1


async def test_completions_arriving_in_one_batch_release_each_slot_once(stack: Stack) -> None:
    """The scorer sends completions that finish together as one message: each of them
    releases its slot, reaches the status projection, and a repeat of the whole batch (a
    lost confirm) releases nothing more."""
    tenant, key = await stack.tenant()
    tasks = await _up_to_the_limit(stack, key)
    _, other_key = await stack.tenant()
    sentinel = (await _submit(stack, other_key)).json()["task_id"]

    batch = [
        _completed(task_id, tenant, score=i).model_copy(update={"has_callback": False})
        for i, task_id in enumerate(tasks[:2])
    ]
    handled = await stack.outcomes_handled()
    await stack.publish_batch(batch)
    await stack.publish_batch(batch)
    await stack.publish(_completed(sentinel, "another"))
    await _released(stack, sentinel)

    async def every_event_handled() -> bool:
        return await stack.outcomes_handled() >= handled + 2 * len(batch) + 1

    await eventually(every_event_handled, what="both batches' events and the sentinel handled")
    assert await stack.in_flight(tenant) == 1  # the third task; twice released, it read 0
    assert await stack.markers(tenant) == 1

    async def scored() -> list[float] | None:
        views = [(await stack.api.get(f"/v1/scores/{t}", headers=key)).json() for t in tasks[:2]]
        if any(view["status"] != "completed" for view in views):
            return None
        return [view["result"]["score"] for view in views]

    assert await eventually(scored, what="both completions projected") == [0, 1]


async def test_replicas_share_one_in_flight_count(stack: Stack) -> None:
    other = create_gateway(stack.settings, status_http=_status_http(stack.status_app))
    async with running(other) as second:
        tenant, key = await stack.tenant()
        for api in (stack.api, second, stack.api):
            body = {"text": uuid.uuid4().hex, "use_cache": False}
            assert (await api.post("/v1/scores", json=body, headers=key)).status_code == 202
        for api in (second, stack.api):
            response = await api.post("/v1/scores", json={"text": "one more"}, headers=key)
            _assert_in_flight_problem(response)
        assert await stack.in_flight(tenant) == MAX_IN_FLIGHT


async def test_an_idempotent_replay_takes_no_slot(stack: Stack) -> None:
    tenant, key = await stack.tenant()
    headers = {**key, "Idempotency-Key": uuid.uuid4().hex}
    body = {"text": "once", "use_cache": False}
    first = await stack.api.post("/v1/scores", json=body, headers=headers)
    assert first.status_code == 202
    for _ in range(MAX_IN_FLIGHT + 1):
        again = await stack.api.post("/v1/scores", json=body, headers=headers)
        assert again.status_code == 200
        assert again.json()["task_id"] == first.json()["task_id"]
    assert await stack.in_flight(tenant) == 1


async def test_a_result_from_the_cache_takes_no_slot(stack: Stack) -> None:
    tenant, key = await stack.tenant()
    text = f"Cache me {uuid.uuid4().hex}"
    first = await stack.api.post("/v1/scores", json={"text": text}, headers=key)
    assert first.status_code == 202
    task_id = first.json()["task_id"]
    await stack.publish(_completed(task_id, tenant))
    await _released(stack, task_id)

    async def cached() -> bool:
        return int(await stack.db["result_cache"].count_documents({"task_id": task_id})) == 1

    await eventually(cached, what="result cached")
    for _ in range(MAX_IN_FLIGHT + 1):
        hit = await stack.api.post("/v1/scores", json={"text": text}, headers=key)
        assert hit.status_code == 200, hit.text
        assert hit.json()["result"]["cached"] is True
    assert await stack.in_flight(tenant) == 0
    assert await stack.markers(tenant) == 0
    # It did the work admission control guards (a record, an announcement): quick, with
    # half the limit in use, it grows the limit as a 202 does (review of admission).
    admission = stack.admission
    before = admission.limit
    others = math.ceil(before / 2) - 1
    for _ in range(others):
        assert admission.try_acquire()
    try:
        hit = await stack.api.post("/v1/scores", json={"text": text}, headers=key)
        assert hit.status_code == 200, hit.text
    finally:
        for _ in range(others):
            admission.release(None, accepted=False)
    assert admission.limit == before + 1


async def test_an_outcome_after_its_submission_expired_still_frees_its_slot(
    stack: Stack,
) -> None:
    """Retries waiting out long Retry-Afters (up to a day each) outlast the submission's
    retention: its outcome found no record and kept the slot for good."""
    tenant, key = await stack.tenant()
    response = await _submit(stack, key)
    assert response.status_code == 202, response.text
    task_id = response.json()["task_id"]
    assert await stack.in_flight(tenant) == 1
    await stack.db["submissions"].delete_one({"_id": task_id})  # what the TTL monitor does

    await stack.publish(_completed(task_id, tenant))

    async def freed() -> bool:
        return await stack.in_flight(tenant) == 0

    await eventually(freed, what=f"the slot of {task_id} freed")


async def test_a_batch_takes_its_slots_all_or_none(stack: Stack) -> None:
    tenant, key = await stack.tenant()

    async def batch(size: int) -> httpx.Response:
        items = [{"text": uuid.uuid4().hex} for _ in range(size)]
        return await stack.api.post("/v1/batches", json={"items": items}, headers=key)

    assert (await batch(2)).status_code == 202
    _assert_in_flight_problem(await batch(2))
    assert await stack.stored(tenant) == 2
    assert await stack.markers(tenant) == 2
    assert (await batch(MAX_IN_FLIGHT + 1)).status_code == 422  # could never fit
    assert (await batch(1)).status_code == 202
    assert await stack.in_flight(tenant) == MAX_IN_FLIGHT


class Repositories:
    """The gateway's own repositories on the test database, for the release protocol."""

    def __init__(self, stack: Stack) -> None:
        database = f"{stack.db_prefix}_gateway"
        self.stack = stack
        self.in_flight = InFlight(stack.mongo, database, max_per_tenant=MAX_IN_FLIGHT)
        self.submissions = Submissions(stack.mongo, database)
        self.cache = ResultCache(stack.mongo, database, ttl=timedelta(hours=1))

    async def accept(self, tenant_id: str, count: int) -> list[str]:
        """`count` marked submissions of the tenant, counted as one batch."""
        commands = [
            ScoreText(task_id=new_id(), tenant_id=tenant_id, text="t", submitted_at=utcnow())
            for _ in range(count)
        ]
        for command in commands:
            await self.submissions.insert(
                command,
                request_hash="h",
                idempotency_key=None,
                retention=timedelta(hours=1),
                cache_key="k",
                counted=True,
            )
        await self.in_flight.acquire(tenant_id, count)
        return [command.task_id for command in commands]

    async def settle(self, event: TaskEvent) -> None:
        await settle_outcome(
            event,
            submissions=self.submissions,
            in_flight=self.in_flight,
            cache=self.cache,
            now=utcnow(),
        )


async def test_a_later_generations_outcome_with_its_submission_gone_frees_no_slot(
    stack: Stack,
) -> None:
    """A submission that expired before its outcome releases its slot on its first run's
    outcome; a re-score's or a replay's (a later generation, which took no slot) released one
    all the same (a mutant that survived the suite): another task's, and the tenant went
    past its limit."""
    repositories = Repositories(stack)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    await repositories.accept(tenant, 2)
    replayed_and_gone = _failed(new_id(), tenant).model_copy(
        update={
            "generation": 1,
            "sequence": event_sequence(generation=1, attempt=1, phase=Phase.TERMINAL),
        }
    )

    await repositories.settle(replayed_and_gone)

    assert await stack.in_flight(tenant) == 2
    await repositories.settle(_failed(new_id(), tenant))  # a first run's: it releases
    assert await stack.in_flight(tenant) == 1


async def test_an_outcome_releases_once_even_when_repeated_midway(stack: Stack) -> None:
    """The release protocol on the real database: an outcome whose handling died between
    the counter and the mark, or two deliveries of one outcome at once, take the slot back
    exactly once."""
    repositories = Repositories(stack)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    first, second, third = await repositories.accept(tenant, 3)
    assert await repositories.in_flight.count(tenant) == 3
    assert await stack.markers(tenant) == 3

    # A handling that decremented, then died before removing the mark (as `release` leaves
    # it); its redelivery must not decrement again, but does remove the mark.
    await repositories.in_flight.release(tenant, first)
    assert await stack.markers(tenant) == 3
    await repositories.settle(_failed(first, tenant))
    assert await stack.markers(tenant) == 2
    assert await repositories.in_flight.count(tenant) == 2

    # Two deliveries of the same outcome at once (one grouped write after the other).
    await asyncio.gather(
        repositories.settle(_completed(second, tenant)),
        repositories.settle(_completed(second, tenant)),
    )
    assert await repositories.in_flight.count(tenant) == 1

    await repositories.settle(_completed(third, tenant))
    assert await repositories.in_flight.count(tenant) == 0
    await repositories.settle(_failed(third, tenant))
    assert await repositories.in_flight.count(tenant) == 0
    assert await stack.markers(tenant) == 0


async def test_the_count_never_goes_below_zero(stack: Stack) -> None:
    repositories = Repositories(stack)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    [task] = await repositories.accept(tenant, 1)
    # An under-count (a crash between the marked submission and the counter).
    await stack.db["in_flight_tenants"].update_one({"_id": tenant}, {"$set": {"count": 0}})
    await repositories.settle(_completed(task, tenant))
    assert await repositories.in_flight.count(tenant) == 0


async def test_markers_of_an_earlier_build_are_adopted_at_start_up(stack: Stack) -> None:
    """Before the mark lived on submissions, `in_flight_tasks` held one marker per counted
    task; after an upgrade their outcomes must still release their slots."""
    repositories = Repositories(stack)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    [task] = await repositories.accept(tenant, 1)
    await stack.db["submissions"].update_one({"_id": task}, {"$unset": {"in_flight": ""}})
    await stack.db["in_flight_tasks"].insert_one({"_id": task, "tenant_id": tenant})

    await repositories.submissions.ensure_indexes()
    assert await stack.markers(tenant) == 1
    assert "in_flight_tasks" not in await stack.db.list_collection_names()
    await repositories.settle(_failed(task, tenant))
    assert await repositories.in_flight.count(tenant) == 0


class UnmarkFailsOnce(Submissions):
    """Removing the in-flight mark fails once, after the slot was released."""

    failures = 1

    async def note_outcome(
        self,
        task_id: str,
        *,
        generation: int | None,
        finished: int | None,
        uncount: bool,
        completed: int | None = None,
    ) -> None:
        if self.failures:
            self.failures -= 1
            raise DatabaseUnavailable("timed out")
        await super().note_outcome(
            task_id, generation=generation, finished=finished, uncount=uncount, completed=completed
        )


class CountedReleases(InFlight):
    releases = 0

    async def release(self, tenant_id: str, task_id: str) -> None:
        self.releases += 1
        await super().release(tenant_id, task_id)


async def test_a_settling_tried_again_does_not_release_again(stack: Stack) -> None:
    """A release is idempotent only while the tenant's counter remembers the task among its
    latest 64 releases; under load a try after a failed unmarking released a second slot."""
    repositories = Repositories(stack)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    [task_id] = await repositories.accept(tenant, 1)
    database = f"{stack.db_prefix}_gateway"
    submissions = UnmarkFailsOnce(stack.mongo, database)
    in_flight = CountedReleases(stack.mongo, database, max_per_tenant=MAX_IN_FLIGHT)
    progress = OutcomeProgress()

    async def settle() -> None:
        await settle_outcome(
            _completed(task_id, tenant),
            submissions=submissions,
            in_flight=in_flight,
            cache=repositories.cache,
            now=utcnow(),
            progress=progress,
        )

    with pytest.raises(DatabaseUnavailable):
        await settle()
    await settle()  # as the outcome consumer tries again

    assert in_flight.releases == 1
    assert await in_flight.count(tenant) == 0
    assert await stack.markers(tenant) == 0
