"""A batch's progress (`find_batch`): its counts and a page of its items come from one
aggregation, whichever the page, so the two always agree; a page that does not hold the
whole batch counts the whole batch all the same."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from pymongo.asynchronous.collection import AsyncCollection

from devtools.infra import Endpoint
from services.status.projection import apply_projected, find_batch
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
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
READS = ("find", "aggregate", "getMore")


@pytest.fixture
def reads() -> CommandCounter:
    return CommandCounter(*READS)


@pytest.fixture
async def tasks(mongo: Endpoint, reads: CommandCounter) -> AsyncIterator[AsyncCollection[Document]]:
    async with scratch_collection(mongo.url, reads, prefix="batch_progress") as docs:
        yield docs


async def _batch_of(tasks: AsyncCollection[Document], *, size: int, completed: int) -> str:
    """A batch of `size` accepted tasks, the first `completed` of them completed."""
    batch_id = new_id()
    writes = GroupWriter(tasks)
    for index in range(size):
        command = ScoreText(
            task_id=new_id(), tenant_id="acme", text="t", batch_id=batch_id, batch_index=index
        )
        await apply_projected(
            accepted_event(command), writes=writes, finished_ttl=TTL, history_limit=50, now=utcnow()
        )
        if index < completed:
            done = TaskCompleted(
                task_id=command.task_id,
                tenant_id="acme",
                sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
                submitted_at=command.submitted_at,
                result=ScoreResult(score=5, comment="ok", model="m"),
            )
            await apply_projected(
                done, writes=writes, finished_ttl=TTL, history_limit=50, now=utcnow()
            )
    return batch_id


@pytest.mark.parametrize(("after", "limit"), [(-1, 10), (-1, 2), (0, 1)])
async def test_a_batch_is_read_and_counted_in_one_query(
    tasks: AsyncCollection[Document], reads: CommandCounter, after: int, limit: int
) -> None:
    """Counts and items from one read, whether the page holds the whole batch or not."""
    batch_id = await _batch_of(tasks, size=3, completed=2)
    reads.sent = 0
    batch = await find_batch(
        batch_id, tenant_id="acme", after=after, limit=limit, tasks=tasks, now=utcnow()
    )
    assert reads.sent == 1
    assert batch.counts == {TaskStatus.COMPLETED: 2, TaskStatus.QUEUED: 1}


async def test_a_batch_within_its_first_page_is_listed_in_order(
    tasks: AsyncCollection[Document],
) -> None:
    batch_id = await _batch_of(tasks, size=3, completed=2)
    batch = await find_batch(
        batch_id, tenant_id="acme", after=-1, limit=10, tasks=tasks, now=utcnow()
    )
    assert batch.counts == {TaskStatus.COMPLETED: 2, TaskStatus.QUEUED: 1}
    assert [item.status for item in batch.items] == [
        TaskStatus.COMPLETED,
        TaskStatus.COMPLETED,
        TaskStatus.QUEUED,
    ]


@pytest.mark.parametrize(("after", "limit"), [(-1, 2), (0, 10)])
async def test_a_batch_beyond_its_page_is_counted_whole(
    tasks: AsyncCollection[Document], after: int, limit: int
) -> None:
    """A page that may not hold the whole batch (it is full, or not the first) counts every
    known task of the batch, not the page's."""
    batch_id = await _batch_of(tasks, size=3, completed=2)
    batch = await find_batch(
        batch_id, tenant_id="acme", after=after, limit=limit, tasks=tasks, now=utcnow()
    )
    assert batch.counts == {TaskStatus.COMPLETED: 2, TaskStatus.QUEUED: 1}
    assert [item.batch_index for item in batch.items] == list(range(after + 1, 3))[:limit]
