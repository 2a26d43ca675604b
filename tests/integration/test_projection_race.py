"""Two status replicas may apply the first two events of one task at once: both upserts
find no document, one inserts it and the other's insert collides on `_id`, though its
event is the newer one. MongoDB does not retry such an upsert itself (its filter holds
`sequence: {$lt: n}`, not only equalities), so the projection must tell this collision from
a stale event's. On the real database (MongoDB or the stand-in), through the projection's
own write path; the race itself is set up by `LosesTheFirstInsert`, which lets the rival's
event reach the database first and then reports the collision as MongoDB does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any

import pytest
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError

from devtools.infra import Endpoint
from services.status.projection import Projected, apply_projected, find_task
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    ScoreWithdrawn,
    TaskCompleted,
    TaskStatus,
    accepted_event,
    event_sequence,
    new_id,
    utcnow,
)
from shared.group_writes import DUPLICATE_KEY, GroupWriter, Update
from tests.support import CommandCounter, scratch_collection

Document = dict[str, Any]
TTL = timedelta(hours=1)


class LosesTheFirstInsert(GroupWriter):
    """A replica whose first upsert lost the race to `rival`: it found no document, the
    rival's insert landed, and its own insert then collided on `_id`."""

    def __init__(self, tasks: AsyncCollection[Document], rival: Callable[[], Awaitable[None]]):
        super().__init__(tasks)
        self._rival: Callable[[], Awaitable[None]] | None = rival

    async def update_one(
        self, filter: Mapping[str, Any], update: Update, *, upsert: bool = False
    ) -> bool:
        rival, self._rival = self._rival, None
        if rival is not None and upsert:
            await rival()
            raise DuplicateKeyError("E11000 duplicate key error", code=DUPLICATE_KEY)
        return await super().update_one(filter, update, upsert=upsert)


@pytest.fixture
async def tasks(mongo: Endpoint) -> AsyncIterator[AsyncCollection[Document]]:
    async with scratch_collection(mongo.url, CommandCounter(), prefix="projection_race") as docs:
        yield docs


def _command() -> ScoreText:
    return ScoreText(task_id=new_id(), tenant_id="acme", text="Two replicas, one task.")


def _completed(command: ScoreText) -> TaskCompleted:
    return TaskCompleted(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        submitted_at=command.submitted_at,
        result=ScoreResult(score=7, comment="Fine.", model="m"),
    )


async def _apply_racing(
    tasks: AsyncCollection[Document], message: Projected, rival: Projected
) -> bool:
    async def rival_replica() -> None:
        await apply_projected(rival, writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow())

    writes = LosesTheFirstInsert(tasks, rival_replica)
    return await apply_projected(message, writes=writes, finished_ttl=TTL, now=utcnow())


async def _status(tasks: AsyncCollection[Document], command: ScoreText) -> TaskStatus | None:
    view = await find_task(command.task_id, tenant_id=command.tenant_id, tasks=tasks, now=utcnow())
    return None if view is None else view.status


async def test_a_completion_that_loses_the_first_insert_is_applied(
    tasks: AsyncCollection[Document],
) -> None:
    command = _command()
    applied = await _apply_racing(tasks, _completed(command), accepted_event(command))
    assert applied
    assert await _status(tasks, command) == TaskStatus.COMPLETED


async def test_a_withdrawal_that_loses_the_first_insert_hides_the_task(
    tasks: AsyncCollection[Document],
) -> None:
    command = _command()
    withdrawal = ScoreWithdrawn(task_id=command.task_id, tenant_id=command.tenant_id)
    applied = await _apply_racing(tasks, withdrawal, accepted_event(command))
    assert applied
    assert await _status(tasks, command) is None


async def test_a_stale_event_that_collides_stays_stale(
    tasks: AsyncCollection[Document],
) -> None:
    command = _command()
    applied = await _apply_racing(tasks, accepted_event(command), _completed(command))
    assert not applied
    assert await _status(tasks, command) == TaskStatus.COMPLETED
