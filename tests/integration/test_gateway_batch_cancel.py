"""`POST /v1/batches/{batch_id}/cancel`: the gateway and the status service in-process against
the real broker and database (no scorer), set up as `test_gateway_cancel`: what it answers,
the `score.cancel` it sends per item, and the one read of the items' submissions."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractQueue
from pymongo import AsyncMongoClient, monitoring

from services.gateway import publisher
from services.gateway.keys import ApiKeys
from services.gateway.submissions import CancelTarget, Submissions
from shared.bus import publish_cancel
from shared.contracts import (
    BatchCancelling,
    CancelTask,
    ScoreText,
    TaskCompleted,
    new_id,
    utcnow,
)
from shared.topology import SCORER_BATCH_CANCELS_BINDING, Binding
from tests.integration import test_gateway_cancel as single
from tests.integration.test_gateway_cancel import (
    Stack,
    _assert_problem,
    _finished_generation_noted,
    _published,
    _sent_cancels,
    _terminal,
)
from tests.support import queued_commands

stack = single.stack  # the fixture


async def _batch(stack: Stack, size: int = 3) -> tuple[str, list[str]]:
    items = [{"text": f"Item {i} of a batch to cancel.", "client_id": f"c{i}"} for i in range(size)]
    response = await stack.api.post("/v1/batches", json={"items": items})
    assert response.status_code == 202, response.text
    body = response.json()
    await queued_commands(stack.amqp_url)  # no scorer here: left out of the score queue
    return body["batch_id"], [item["task_id"] for item in body["items"]]


async def _command(stack: Stack, task_id: str) -> ScoreText:
    recorded = await stack.submissions.find_one({"_id": task_id})
    return ScoreText.model_validate(recorded["command"])


async def test_the_items_not_known_finished_are_each_sent_a_cancel(stack: Stack) -> None:
    batch_id, (first, done, last) = await _batch(stack)
    command = await _command(stack, done)
    await _published(stack, _terminal(TaskCompleted, done, submitted_at=command.submitted_at))
    await _finished_generation_noted(stack, done, 0)
    await _sent_cancels(stack.amqp_url)
    # A body, which the route does not take: refused, nothing cancelled.
    with_body = await stack.api.post(
        f"/v1/batches/{batch_id}/cancel",
        content=b"{bad",
        headers={"Content-Type": "application/json"},
    )
    assert with_body.status_code == 422, with_body.text
    assert await _sent_cancels(stack.amqp_url) == []

    response = await stack.api.post(f"/v1/batches/{batch_id}/cancel")

    assert response.status_code == 202, response.text
    assert response.headers["Location"] == f"/v1/batches/{batch_id}"
    assert response.json() == {
        "batch_id": batch_id,
        "cancelling": 2,
        "already_finished": 1,
        "status_url": f"/v1/batches/{batch_id}",
    }
    sent = {cancel.task_id: cancel for cancel in await _sent_cancels(stack.amqp_url)}
    assert set(sent) == {first, last}
    for task_id, cancel in sent.items():
        command = await _command(stack, task_id)
        assert (cancel.tenant_id, cancel.generation) == ("default", 0)
        assert cancel.submitted_at == command.submitted_at
        assert cancel.api_key_id == command.api_key_id
        assert cancel.api_key_id is not None
        assert (cancel.callback_url, cancel.not_before) == (None, None)

    # A re-score took generation 1 of the completed item since: the scorer never cancels a
    # re-score of a completed task (the completion stands), so it still counts as finished.
    await stack.submissions.update_one({"_id": done}, {"$set": {"generation": 1}})
    again = await stack.api.post(f"/v1/batches/{batch_id}/cancel")
    assert again.status_code == 202, again.text
    assert (again.json()["cancelling"], again.json()["already_finished"]) == (2, 1)
    resent = {cancel.task_id: cancel.generation for cancel in await _sent_cancels(stack.amqp_url)}
    assert resent == {first: 0, last: 0}


async def test_the_cancels_go_last_item_first(stack: Stack) -> None:
    """The items are queued, and scored, in their order: cancels sent in that order trailed
    the scoring, each finding its item just scored (found in a walkthrough: 934 of 1,000 too
    late). From the last item they meet it."""
    batch_id, items = await _batch(stack, size=12)
    await _sent_cancels(stack.amqp_url)

    response = await stack.api.post(f"/v1/batches/{batch_id}/cancel")

    assert response.status_code == 202, response.text
    sent = [cancel.task_id for cancel in await _sent_cancels(stack.amqp_url)]
    assert sent == items[::-1]


async def test_the_scorers_are_told_of_the_cancellation_with_each_open_items_generation(
    stack: Stack,
) -> None:
    """`batch.cancelling` names the items sent a cancel, at the generation each cancel names,
    so a scorer cancels them at delivery (`services/scorer/batch_cancels.py`); it is
    published in the same round as the cancels."""
    batch_id, (first, done, last) = await _batch(stack)
    command = await _command(stack, done)
    await _published(stack, _terminal(TaskCompleted, done, submitted_at=command.submitted_at))
    await _finished_generation_noted(stack, done, 0)
    await stack.submissions.update_one({"_id": last}, {"$set": {"generation": 2}})
    await _sent_cancels(stack.amqp_url)

    async with _listening(stack.amqp_url, SCORER_BATCH_CANCELS_BINDING) as heard:
        response = await stack.api.post(f"/v1/batches/{batch_id}/cancel")
        assert response.status_code == 202, response.text
        # Confirmed before the answer: routed to every bound queue by then.
        message = await heard.get(no_ack=True, timeout=10)
        assert await heard.get(no_ack=True, fail=False, timeout=10) is None

    announced = BatchCancelling.model_validate_json(message.body)
    assert (announced.batch_id, announced.tenant_id) == (batch_id, "default")
    assert announced.generations == {first: 0, last: 2}
    sent = {cancel.task_id: cancel for cancel in await _sent_cancels(stack.amqp_url)}
    assert {task_id: cancel.generation for task_id, cancel in sent.items()} == {first: 0, last: 2}
    assert announced.requested_at == sent[first].requested_at


@asynccontextmanager
async def _listening(amqp_url: str, binding: Binding) -> AsyncIterator[AbstractQueue]:
    """A queue of the test's own, bound as the binding says."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(binding.exchange.name, binding.routing_key)
        yield queue


async def test_another_tenants_batch_or_an_unknown_one_is_not_found(stack: Stack) -> None:
    batch_id, _ = await _batch(stack, size=1)
    keys = ApiKeys(stack.mongo, f"{stack.db_prefix}_gateway")
    _, other_key = await keys.create(tenant_id="other", name="test", now=utcnow())
    await _sent_cancels(stack.amqp_url)

    others = await stack.api.post(
        f"/v1/batches/{batch_id}/cancel", headers={"Authorization": f"Bearer {other_key}"}
    )
    unknown = await stack.api.post("/v1/batches/0123456789abcdef/cancel")
    malformed = await stack.api.post("/v1/batches/not%20an%20id/cancel")
    read = await stack.api.get("/v1/batches/0123456789abcdef")

    for response in (others, unknown, malformed, read):
        _assert_problem(response, 404)
    assert others.json()["detail"] == unknown.json()["detail"].replace("0123456789abcdef", batch_id)
    assert unknown.json()["detail"] == read.json()["detail"]  # GET's wording
    assert await _sent_cancels(stack.amqp_url) == []


async def test_a_batch_whose_items_are_still_being_recorded_is_409_and_nothing_is_cancelled(
    stack: Stack,
) -> None:
    """Its request (or its replay) has recorded two of its three items: cancelling those two
    answered 202 and left the third to be sent and scored (a review)."""
    batch_id, (_, _, last) = await _batch(stack)
    batches = stack.mongo[f"{stack.db_prefix}_gateway"]["batches"]
    # Made two minutes ago: its request has died, the batch waits for a replay.
    made = datetime.now(UTC) - timedelta(minutes=2)
    await batches.update_one(
        {"_id": batch_id},
        {"$set": {"state": "accepting", "recorded": False, "created_at": made}},
    )
    await stack.submissions.delete_one({"_id": last})
    await _sent_cancels(stack.amqp_url)

    response = await stack.api.post(f"/v1/batches/{batch_id}/cancel")

    _assert_problem(response, 409)
    body = response.json()
    assert body["type"].endswith("/batch-being-accepted")
    assert "2 of its 3 items recorded" in body["detail"]
    assert "left incomplete by its request" in body["detail"]
    # As long as the request has run, not a fixed second (a client asked 600 times).
    assert 120 <= int(response.headers["Retry-After"]) < 600
    assert await _sent_cancels(stack.amqp_url) == []


async def test_cancels_the_broker_did_not_all_confirm_are_503_and_may_have_been_queued(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id, (refused, *confirmed) = await _batch(stack)
    await _sent_cancels(stack.amqp_url)

    async def one_refused(broker: Any, cancel: CancelTask, *, timeout: float) -> None:
        if cancel.task_id == refused:
            raise TimeoutError("no confirm")
        await publish_cancel(broker, cancel, timeout=timeout)

    monkeypatch.setattr(publisher, "publish_cancel", one_refused)
    response = await stack.api.post(f"/v1/batches/{batch_id}/cancel")

    _assert_problem(response, 503)
    assert response.headers["Retry-After"] == "5"
    detail = response.json()["detail"]
    assert "nothing was kept" not in detail
    assert "may have been queued" in detail
    assert "send it again" in detail
    assert {cancel.task_id for cancel in await _sent_cancels(stack.amqp_url)} == set(confirmed)


class Finds(monitoring.CommandListener):
    """The reads a client sends (`find`, `getMore`), the `batchSize` each asks for, and the
    documents their replies carry."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []
        self.batch_sizes: list[int | None] = []
        self.documents: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in ("find", "getMore"):
            self.sent.append((event.command_name, event.command.get(event.command_name)))
            self.batch_sizes.append(event.command.get("batchSize"))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        cursor = event.reply.get("cursor") or {}
        self.documents += cursor.get("firstBatch", []) + cursor.get("nextBatch", [])

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


LONG_TEXT = "A long essay. " * 3600  # 50,400 characters


async def test_the_items_are_read_in_one_query_without_their_texts(
    mongo: Any, db_prefix: str
) -> None:
    finds = Finds()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        mongo.url, tz_aware=True, event_listeners=[finds]
    )
    database = f"{db_prefix}_batch_cancel_{uuid.uuid4().hex[:8]}"
    submissions = Submissions(client, database)
    batch_id = new_id()
    commands = [
        ScoreText(
            task_id=new_id(),
            tenant_id="acme",
            text=f"{LONG_TEXT} {index}",
            batch_id=batch_id,
            batch_index=index,
            api_key_id="key-1",
            not_before=utcnow() + timedelta(hours=index),
        )
        for index in range(150)  # more than a find's default first batch (101)
    ]
    try:
        await submissions.ensure_indexes()
        await submissions.insert_batch(
            [(command, "h", "k", "m") for command in commands], retention=timedelta(hours=1)
        )
        await client[database]["submissions"].update_one(
            {"_id": commands[0].task_id}, {"$set": {"generation": 2, "finished_generation": 1}}
        )
        finds.sent.clear()
        finds.batch_sizes.clear()
        finds.documents.clear()

        targets = await submissions.cancel_targets(batch_id, tenant_id="acme", expected=150)

        assert finds.sent == [("find", "submissions")]
        # Every item in the first reply: MongoDB's default (101) would need a `getMore` (the
        # stand-in answers a find whole, so the request is checked, not only the round trips).
        [batch_size] = finds.batch_sizes
        assert batch_size is not None
        assert batch_size >= len(commands)
        assert len(finds.documents) == 150
        assert not any("text" in (document.get("command") or {}) for document in finds.documents)
        # Everything a cancellation needs was read: the same as from the whole submission.
        whole = [await submissions.find(c.task_id, tenant_id="acme") for c in commands]
        assert sorted(targets, key=lambda t: t.task_id) == sorted(
            (CancelTarget.of(submission) for submission in whole if submission is not None),
            key=lambda t: t.task_id,
        )
        assert {t.generation for t in targets} == {0, 2}
        assert await submissions.cancel_targets(batch_id, tenant_id="other", expected=150) == []
    finally:
        await client.drop_database(database)
        await client.close()
