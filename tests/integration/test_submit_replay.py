"""A repeated single submission (same Idempotency-Key) whose lookup of the earlier request
the database fails: the earlier one was received, so the client is told to retry with the
same key (409), never that nothing was kept (503), after which a client resubmitting without
the key had its text scored twice. Gateway and status in-process, on the real broker and
database; the lookup fails as a timed-out `find_by_key` of the real repository."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pymongo import AsyncMongoClient

from services.gateway.cache import ResultCache
from services.gateway.errors import DatabaseUnavailable
from services.gateway.keys import generate_key
from services.gateway.schemas import ScoreSubmission
from services.gateway.submissions import Submission, Submissions, request_hash
from tests.integration.in_process import gateway_and_status
from tests.support import queued_commands

API_KEY = generate_key().token
OUTBOX_GRACE_S = 60  # the default, which the stack keeps

Json = dict[str, Any]


@dataclass
class Stack:
    api: httpx.AsyncClient
    amqp_url: str
    submissions: Any  # the gateway's collection, reached directly


@pytest.fixture(scope="module")
async def stack(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Stack]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "BOOTSTRAP_API_KEY": API_KEY,
        "RATE_LIMIT_PER_MIN": "0",
    }
    client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
    async with gateway_and_status(env, api_key=API_KEY) as services:
        yield Stack(services.api, amqp_url, client[f"{db_prefix}_gateway"]["submissions"])
    await client.close()


@dataclass
class LookupFails:
    """`Submissions.find_by_key` of the real repository, failing as the database timing out
    while `failing` (each failed call counted)."""

    failing: bool = True
    failed: int = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = Submissions.find_by_key

        async def find_by_key(
            submissions: Submissions, idempotency_key: str, *, tenant_id: str
        ) -> Submission | None:
            if self.failing:
                self.failed += 1
                raise DatabaseUnavailable("timed out")
            return await original(submissions, idempotency_key, tenant_id=tenant_id)

        monkeypatch.setattr(Submissions, "find_by_key", find_by_key)


async def test_a_retry_whose_lookup_fails_is_told_to_retry_with_the_key_and_keeps_nothing_new(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"key-{uuid.uuid4().hex}"
    body = {"text": f"An essay {uuid.uuid4().hex}.", "use_cache": False}
    headers = {"Idempotency-Key": key}
    first = await stack.api.post("/v1/scores", json=body, headers=headers)
    assert first.status_code == 202, first.text  # ... and the client never saw it
    task_id = first.json()["task_id"]
    assert [command.task_id for command in await queued_commands(stack.amqp_url)] == [task_id]
    lookup = LookupFails()
    lookup.install(monkeypatch)

    retry = await stack.api.post("/v1/scores", json=body, headers=headers)

    assert lookup.failed >= 1  # the retry did reach the failing lookup
    assert retry.status_code == 409, retry.text  # not 503: "nothing was kept" was untrue
    assert retry.headers["content-type"].startswith("application/problem+json")
    assert retry.headers["retry-after"] == "5"
    problem = retry.json()
    assert problem["status"] == 409
    assert problem["type"].endswith("/request-in-progress")
    assert "received" in problem["detail"]
    assert "same Idempotency-Key" in problem["detail"]
    # Nothing new kept or sent: the key's one submission, its one command.
    stored = [document["_id"] async for document in stack.submissions.find({})]
    assert stored == [task_id]
    assert await queued_commands(stack.amqp_url) == []

    lookup.failing = False  # the database answers again: the retry finds the first request
    again = await stack.api.post("/v1/scores", json=body, headers=headers)
    assert again.status_code == 200, again.text
    assert again.json()["task_id"] == task_id
    assert [document["_id"] async for document in stack.submissions.find({})] == [task_id]
    assert await queued_commands(stack.amqp_url) == []


async def test_a_replay_whose_cache_lookup_fails_is_answered_with_the_earlier_task(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The result-cache lookup is a submission's first database call, before the insert that
    finds the key taken: on a slow database it failed first, and the replay of an accepted
    task was told nothing was kept (503). A failed lookup is now a miss."""
    key = f"key-{uuid.uuid4().hex}"
    body = {"text": f"An essay {uuid.uuid4().hex}."}  # the result cache is consulted
    headers = {"Idempotency-Key": key}
    first = await stack.api.post("/v1/scores", json=body, headers=headers)
    assert first.status_code == 202, first.text
    task_id = first.json()["task_id"]
    assert [command.task_id for command in await queued_commands(stack.amqp_url)] == [task_id]
    failed: list[str] = []

    async def find(cache: ResultCache, *, tenant_id: str, key: str, now: datetime) -> None:
        failed.append(key)
        raise DatabaseUnavailable("timed out")

    monkeypatch.setattr(ResultCache, "find", find)
    kept = await stack.submissions.count_documents({})

    replay = await stack.api.post("/v1/scores", json=body, headers=headers)

    assert failed  # the replay did reach the failing lookup
    assert replay.status_code == 200, replay.text  # not 503: "nothing was kept" was untrue
    assert replay.json()["task_id"] == task_id
    assert await stack.submissions.count_documents({}) == kept  # nothing new kept
    assert await queued_commands(stack.amqp_url) == []  # nor sent


async def test_a_replay_with_another_body_is_a_conflict_even_while_the_first_is_accepted(
    stack: Stack,
) -> None:
    """Checked after "still being accepted", a client misusing its key was told to retry
    shortly (request-in-progress) instead of that the key was taken (found in review)."""
    key = {"Idempotency-Key": f"conflict-{uuid.uuid4().hex}"}
    first = await stack.api.post("/v1/scores", json={"text": "The first body."}, headers=key)
    assert first.status_code == 202, first.text
    await queued_commands(stack.amqp_url)
    # As while its request still runs: recorded, not yet accepted.
    task_id = first.json()["task_id"]
    await stack.submissions.update_one({"_id": task_id}, {"$set": {"state": "accepting"}})

    other = await stack.api.post("/v1/scores", json={"text": "Another body."}, headers=key)
    assert other.status_code == 409, other.text
    assert other.json()["type"].endswith("/idempotency-key-reused")
    same = await stack.api.post("/v1/scores", json={"text": "The first body."}, headers=key)
    assert same.json()["type"].endswith("/request-in-progress")


async def test_a_replay_of_a_submission_left_accepting_past_the_grace_answers_with_it(
    stack: Stack,
) -> None:
    """Its request was answered 202 but could not mark it sent (a database blip), or died
    after the send: the outbox sweep sends it after `OUTBOX_GRACE_S`. A replay answered 409
    "retry shortly" for as long as the sweep could not (the broker refusing it), and a
    client whose retries ran out resubmitted without the key (found in review). Within the
    grace it is still the request's own, as above."""
    key = {"Idempotency-Key": f"left-{uuid.uuid4().hex}"}
    body = {"text": f"An essay left accepting {uuid.uuid4().hex}.", "use_cache": False}
    first = await stack.api.post("/v1/scores", json=body, headers=key)
    assert first.status_code == 202, first.text
    task_id = first.json()["task_id"]
    await queued_commands(stack.amqp_url)
    grace_ago = datetime.now(UTC) - timedelta(seconds=OUTBOX_GRACE_S + 1)
    await stack.submissions.update_one(
        {"_id": task_id}, {"$set": {"state": "accepting", "created_at": grace_ago}}
    )

    replay = await stack.api.post("/v1/scores", json=body, headers=key)

    assert replay.status_code == 200, replay.text
    assert replay.json()["task_id"] == task_id
    # Left to the sweep (`unconfirmed`, or `accepted` once it sent it): a refusal's write-off
    # pending on another replica no longer makes it a tombstone (it did after the 200, and
    # the task read 404, found in review).
    database = stack.submissions.database
    await Submissions(database.client, database.name).abandon((task_id,), now=datetime.now(UTC))
    kept = await stack.submissions.find_one({"_id": task_id})
    assert kept is not None
    assert kept["state"] in ("unconfirmed", "accepted")
    assert kept["command"]["task_id"] == task_id


@pytest.mark.parametrize(("ran_s", "told_s"), [(0, 1), (20, 20), (OUTBOX_GRACE_S - 10, 10)])
async def test_a_replay_while_its_request_runs_is_told_to_wait_as_long_as_it_ran(
    stack: Stack, ran_s: int, told_s: int
) -> None:
    """`Retry-After` is as long as the first request has run, up to the grace's end: a fixed
    second had a client whose gateway died mid-request ask sixty times (a walkthrough)."""
    key = {"Idempotency-Key": f"running-{uuid.uuid4().hex}"}
    body = {"text": f"An essay still running {uuid.uuid4().hex}.", "use_cache": False}
    first = await stack.api.post("/v1/scores", json=body, headers=key)
    assert first.status_code == 202, first.text
    await queued_commands(stack.amqp_url)
    started = datetime.now(UTC) - timedelta(seconds=ran_s)
    await stack.submissions.update_one(
        {"_id": first.json()["task_id"]}, {"$set": {"state": "accepting", "created_at": started}}
    )

    replay = await stack.api.post("/v1/scores", json=body, headers=key)

    assert replay.status_code == 409, replay.text
    assert replay.json()["type"].endswith("/request-in-progress")
    # The clock moves between the write and the answer: a second more at most.
    assert int(replay.headers["Retry-After"]) in (told_s, told_s + 1)


async def test_a_key_used_with_a_blank_rubric_before_it_named_none_is_replayed(
    stack: Stack,
) -> None:
    """A blank rubric names none now, but the request's hash covers it as sent: a key used
    before that change, its hash made of the rubric as sent, was a 409 conflict with its
    own replay, and an interrupted batch could not be completed by its replay (a review)."""
    key = {"Idempotency-Key": f"blank-rubric-{uuid.uuid4().hex}"}
    body = {"text": f"An essay {uuid.uuid4().hex}.", "rubric": "   ", "use_cache": False}
    first = await stack.api.post("/v1/scores", json=body, headers=key)
    assert first.status_code == 202, first.text
    await queued_commands(stack.amqp_url)
    as_before = ScoreSubmission.model_validate(body).model_dump(mode="json") | {"rubric": "   "}
    stored = await stack.submissions.find_one({"_id": first.json()["task_id"]})
    assert stored is not None
    assert stored["request_hash"] == request_hash(as_before)

    replay = await stack.api.post("/v1/scores", json=body, headers=key)

    assert replay.status_code == 200, replay.text
    assert replay.json()["task_id"] == first.json()["task_id"]
