"""A scheduled task reads `queued` once its start has come. No event says so: its command comes
off the wait ladder to the scorer only, and an attempt quicker than `SCORER_STARTED_AFTER_S`
publishes no `task.started`, so the projection read `scheduled` until the attempt's outcome,
while the gateway's own record of the submission already read `queued`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from pymongo.asynchronous.collection import AsyncCollection

from devtools.infra import Endpoint
from services.status.projection import apply_projected, find_batch, find_history, find_task
from shared.contracts import (
    Phase,
    ScoreText,
    TaskStarted,
    TaskStatus,
    accepted_event,
    event_sequence,
    new_id,
    utcnow,
)
from shared.group_writes import GroupWriter
from tests.support import CommandCounter, scratch_collection

Document = dict[str, Any]
TTL = timedelta(hours=1)
START_IN = timedelta(hours=1)


@pytest.fixture
async def tasks(mongo: Endpoint) -> AsyncIterator[AsyncCollection[Document]]:
    async with scratch_collection(mongo.url, CommandCounter(), prefix="scheduled") as docs:
        yield docs


async def _accepted(
    tasks: AsyncCollection[Document], batch_id: str, index: int, *, start_in: timedelta | None
) -> ScoreText:
    now = utcnow()
    command = ScoreText(
        task_id=new_id(),
        tenant_id="acme",
        text="Later.",
        batch_id=batch_id,
        batch_index=index,
        occurred_at=now,
        not_before=None if start_in is None else now + start_in,
    )
    assert await apply_projected(
        accepted_event(command), writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow()
    )
    return command


async def test_a_scheduled_task_reads_queued_once_its_start_has_come(
    tasks: AsyncCollection[Document],
) -> None:
    batch_id = new_id()
    scheduled = await _accepted(tasks, batch_id, 0, start_in=START_IN)
    started = await _accepted(tasks, batch_id, 1, start_in=START_IN)
    await _accepted(tasks, batch_id, 2, start_in=None)  # sent now: queued from the start
    assert await apply_projected(
        TaskStarted(
            task_id=started.task_id,
            tenant_id="acme",
            attempt=1,
            sequence=event_sequence(generation=0, attempt=1, phase=Phase.STARTED),
            submitted_at=started.submitted_at,
        ),
        writes=GroupWriter(tasks),
        finished_ttl=TTL,
        now=utcnow(),
    )

    async def read(now_in: timedelta) -> Document:
        """The scheduled task as a poll and a history read it `now_in` from now, and its
        batch's counts and item statuses."""
        now = utcnow() + now_in
        view = await find_task(scheduled.task_id, tenant_id="acme", tasks=tasks, now=now)
        history = await find_history(
            scheduled.task_id, tenant_id="acme", after=-1, tasks=tasks, now=now
        )
        batch = await find_batch(
            batch_id, tenant_id="acme", after=-1, limit=10, tasks=tasks, now=now
        )
        # A page shorter than the batch: counted by the aggregation, not from its items.
        counted = await find_batch(
            batch_id, tenant_id="acme", after=-1, limit=2, tasks=tasks, now=now
        )
        assert counted.counts == batch.counts
        assert view is not None
        assert history is not None
        # What was recorded stays: the task was scheduled when it was accepted.
        assert [change.status for change in history.changes] == [TaskStatus.SCHEDULED]
        return {
            "view": view.status,
            "history": history.status,
            "counts": batch.counts,
            "items": [item.status for item in batch.items],
        }

    assert await read(timedelta(0)) == {
        "view": TaskStatus.SCHEDULED,
        "history": TaskStatus.SCHEDULED,
        "counts": {TaskStatus.SCHEDULED: 1, TaskStatus.PROCESSING: 1, TaskStatus.QUEUED: 1},
        "items": [TaskStatus.SCHEDULED, TaskStatus.PROCESSING, TaskStatus.QUEUED],
    }
    assert await read(START_IN + timedelta(seconds=1)) == {
        "view": TaskStatus.QUEUED,
        "history": TaskStatus.QUEUED,
        "counts": {TaskStatus.PROCESSING: 1, TaskStatus.QUEUED: 2},
        "items": [TaskStatus.QUEUED, TaskStatus.PROCESSING, TaskStatus.QUEUED],
    }
