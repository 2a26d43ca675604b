"""A re-scored task's new generation replaces what its earlier one showed, even when the new
generation's `task.accepted` never reached the projection (it is sent best effort, after the
command's confirm): its attempt's events carry no result, and the task must not show the
earlier rubric's result next to a new status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from pymongo.asynchronous.collection import AsyncCollection

from devtools.infra import Endpoint
from services.status.projection import apply_projected, find_task
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskError,
    TaskEvent,
    TaskFailed,
    TaskRetrying,
    TaskStarted,
    TaskStatus,
    TaskView,
    accepted_event,
    event_sequence,
    new_id,
    utcnow,
)
from shared.group_writes import GroupWriter
from tests.support import CommandCounter, scratch_collection

Document = dict[str, Any]
TTL = timedelta(hours=1)
ERROR = TaskError(code="unusable_output", message="Not JSON.", retryable=False)


@pytest.fixture
async def tasks(mongo: Endpoint) -> AsyncIterator[AsyncCollection[Document]]:
    async with scratch_collection(mongo.url, CommandCounter(), prefix="generations") as docs:
        yield docs


def _fields(command: ScoreText, generation: int, phase: Phase) -> dict[str, Any]:
    return {
        "task_id": command.task_id,
        "tenant_id": command.tenant_id,
        "sequence": event_sequence(generation=generation, attempt=1, phase=phase),
        "generation": generation,
        "attempt": 1,
        "submitted_at": command.submitted_at,
    }


async def _completed_at_generation_0(tasks: AsyncCollection[Document]) -> ScoreText:
    command = ScoreText(task_id=new_id(), tenant_id="acme", text="Scored, then re-scored.")
    result = ScoreResult(score=7, comment="Under the old rubric.", model="m")
    for event in (
        accepted_event(command),
        TaskCompleted(**_fields(command, 0, Phase.TERMINAL), result=result),
    ):
        assert await apply_projected(event, writes=GroupWriter(tasks), finished_ttl=TTL)
    return command


async def _view(tasks: AsyncCollection[Document], command: ScoreText) -> TaskView:
    view = await find_task(command.task_id, tenant_id=command.tenant_id, tasks=tasks, now=utcnow())
    assert view is not None
    return view


def _started(command: ScoreText) -> TaskEvent:
    return TaskStarted(**_fields(command, 1, Phase.STARTED))


def _retrying(command: ScoreText) -> TaskEvent:
    due = utcnow() + timedelta(minutes=1)
    return TaskRetrying(**_fields(command, 1, Phase.RETRYING), error=ERROR, next_attempt_at=due)


def _failed(command: ScoreText) -> TaskEvent:
    return TaskFailed(**_fields(command, 1, Phase.TERMINAL), error=ERROR, dead_lettered=False)


@pytest.mark.parametrize(
    ("event_of", "status"),
    [
        (_started, TaskStatus.PROCESSING),
        (_retrying, TaskStatus.RETRYING),
        (_failed, TaskStatus.FAILED),
    ],
    ids=["started", "retrying", "failed"],
)
async def test_the_next_generation_without_its_acceptance_shows_no_earlier_result(
    tasks: AsyncCollection[Document], event_of: Any, status: TaskStatus
) -> None:
    command = await _completed_at_generation_0(tasks)
    assert (await _view(tasks, command)).result is not None

    assert await apply_projected(event_of(command), writes=GroupWriter(tasks), finished_ttl=TTL)

    view = await _view(tasks, command)
    assert (view.status, view.result) == (status, None)
