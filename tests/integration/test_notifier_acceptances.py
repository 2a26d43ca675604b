"""The notifier's handling of `task.accepted` (served where an upgraded deployment kept that
binding), on the real database: the first acceptance of a task gives its callback URL; a
later generation's (a re-score, a DLQ replay, announced since they bypass the projection's
copy of the command) tells nothing new and changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from services.notifier.ledger import Ledger
from services.notifier.notifications import NotificationDeps, notify_about_task_event
from services.notifier.registry import Callbacks, FailureAlerts
from shared.contracts import DeliverWebhook, TaskAccepted, new_id, utcnow

Mongo = AsyncMongoClient[dict[str, Any]]


@pytest.fixture
async def notifier_db(mongo: Any, db_prefix: str) -> AsyncIterator[tuple[Mongo, str]]:
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    yield client, f"{db_prefix}_notifier"
    await client.close()


def _deps(client: Mongo, database: str, enqueued: list[DeliverWebhook]) -> NotificationDeps:
    async def enqueue(delivery: DeliverWebhook) -> None:
        enqueued.append(delivery)

    return NotificationDeps(
        callbacks=Callbacks(client, database),
        alerts=FailureAlerts(client, database),
        ledger=Ledger(client, database, retention=timedelta(hours=1)),
        enqueue=enqueue,
        clock=utcnow,
        max_attempts=3,
        callback_retention=timedelta(hours=1),
        unclaimed_outcome_ttl=timedelta(hours=1),
    )


def _accepted(task_id: str, generation: int, url: str) -> TaskAccepted:
    now = utcnow()
    return TaskAccepted(
        task_id=task_id,
        sequence=generation * 1_000_000,
        generation=generation,
        submitted_at=now,
        occurred_at=now,
        callback_url=url,
    )


@pytest.mark.parametrize(("generation", "remembered"), [(0, True), (1, False)])
async def test_only_a_tasks_first_acceptance_gives_its_callback(
    notifier_db: tuple[Mongo, str], generation: int, remembered: bool
) -> None:
    client, database = notifier_db
    enqueued: list[DeliverWebhook] = []
    task_id = new_id()

    await notify_about_task_event(
        _accepted(task_id, generation, "https://hooks.example/x"),
        deps=_deps(client, database, enqueued),
    )

    stored = await client[database]["task_callbacks"].find_one({"_id": task_id})
    assert (stored is not None) is remembered
    assert enqueued == []
