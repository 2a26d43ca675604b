"""A task's outcome that reaches the projection late is readable for `FINISHED_TASK_TTL_S` from
then. The projection's consumers wait out a database outage or a backlog, holding their
deliveries; an outcome applied more than the TTL after it happened was given an expiry
already past, and a task read as `processing` until then went straight to 404, which clients
take for a lost task and submit again (found in review)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any, cast

import pytest
from pymongo.asynchronous.collection import AsyncCollection

from devtools.infra import Endpoint
from services.status.app import subscribe_projection
from services.status.projection import apply_projected, find_history, find_task
from services.status.settings import StatusSettings
from shared.consumers import ScoreboxBroker
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskStarted,
    TaskStatus,
    accepted_event,
    event_sequence,
    new_id,
    utcnow,
)
from shared.group_writes import GroupWriter
from tests.support import CommandCounter, HandedDelivery, HandlerOnly, scratch_collection

Document = dict[str, Any]
TTL = timedelta(hours=1)  # FINISHED_TASK_TTL_S's default
HANDLER_DEADLINE_S = 30.0


@pytest.fixture
async def tasks(mongo: Endpoint) -> AsyncIterator[AsyncCollection[Document]]:
    async with scratch_collection(mongo.url, CommandCounter(), prefix="lagging") as docs:
        yield docs


async def test_an_outcome_applied_after_a_long_lag_is_readable_for_the_ttl_from_then(
    tasks: AsyncCollection[Document],
) -> None:
    writes = GroupWriter(tasks)
    submitted = utcnow() - timedelta(minutes=70)
    command = ScoreText(
        task_id=new_id(), tenant_id="acme", text="x", submitted_at=submitted, occurred_at=submitted
    )
    started = TaskStarted(
        task_id=command.task_id,
        tenant_id="acme",
        attempt=1,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.STARTED),
        submitted_at=submitted,
        occurred_at=submitted + timedelta(seconds=2),
    )
    completed = TaskCompleted(  # scored 65 minutes ago, applied only now
        task_id=command.task_id,
        tenant_id="acme",
        attempt=1,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        submitted_at=submitted,
        occurred_at=utcnow() - timedelta(minutes=65),
        result=ScoreResult(score=7, comment="Fine.", model="m"),
    )
    for event in (accepted_event(command), started):
        await apply_projected(event, writes=writes, finished_ttl=TTL, now=utcnow())
    before = await find_task(command.task_id, tenant_id="acme", tasks=tasks, now=utcnow())
    assert before is not None
    assert before.status is TaskStatus.PROCESSING

    applied_at = utcnow()
    await apply_projected(completed, writes=writes, finished_ttl=TTL, now=applied_at)

    soon = applied_at + TTL - timedelta(seconds=1)
    after = await find_task(command.task_id, tenant_id="acme", tasks=tasks, now=soon)
    assert after is not None, "the completed task read 404 as soon as it was applied"
    assert after.status is TaskStatus.COMPLETED
    history = await find_history(command.task_id, tenant_id="acme", after=-1, tasks=tasks, now=soon)
    assert history is not None
    gone = await find_task(
        command.task_id, tenant_id="acme", tasks=tasks, now=applied_at + TTL + timedelta(seconds=1)
    )
    assert gone is None  # and it still expires, a TTL after it was applied


async def test_the_projection_dates_a_late_outcome_by_the_services_clock(
    tasks: AsyncCollection[Document],
) -> None:
    # The service's clock (the database's, `DatabaseClock`) is what its reads and MongoDB's
    # TTL monitor judge expiry by; here it runs two hours ahead of this machine's.
    ahead = timedelta(hours=2)
    broker = HandlerOnly()
    subscribe_projection(
        cast(ScoreboxBroker, broker),
        GroupWriter(tasks),
        StatusSettings(),
        clock=lambda: utcnow() + ahead,
    )
    completed = TaskCompleted(
        task_id=new_id(),
        tenant_id="acme",
        attempt=1,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        submitted_at=utcnow() - timedelta(minutes=5),
        occurred_at=utcnow() - timedelta(minutes=4),
        result=ScoreResult(score=7, comment="Fine.", model="m"),
    )
    delivery = HandedDelivery(
        completed.model_dump_json().encode(), routing_key=TaskCompleted.routing_key
    )
    async with asyncio.timeout(HANDLER_DEADLINE_S):
        await broker.handler(delivery)

    late_in_its_ttl = utcnow() + ahead + TTL - timedelta(minutes=1)
    view = await find_task(completed.task_id, tenant_id="acme", tasks=tasks, now=late_in_its_ttl)
    assert view is not None, "the outcome's expiry was dated by another clock than the service's"
    assert view.status is TaskStatus.COMPLETED
