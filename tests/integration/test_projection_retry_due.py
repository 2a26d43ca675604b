"""A retry's next attempt put off by a pause of the model calls: its `task.retrying`, told again
under the same sequence with a later `next_attempt_at`, moves the task's due time later, and
nothing moves it back or past a later state.

The status read the first time, long past, for as long as the pause held the attempt (a
review): a client polling could not tell when the next attempt would come. The projection
runs on the test database (MongoDB or the stand-in)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from pymongo.asynchronous.collection import AsyncCollection

from devtools.infra import Endpoint
from services.status.projection import apply_projected, find_history, find_task
from shared.contracts import (
    Phase,
    ScoreText,
    TaskError,
    TaskEvent,
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

pytestmark = pytest.mark.integration

Document = dict[str, Any]
Tasks = AsyncCollection[Document]
TTL = timedelta(hours=1)
RATE_LIMITED = TaskError(code="model_rate_limited", message="Rate limited.", retryable=True)


@pytest.fixture
async def tasks(mongo: Endpoint) -> AsyncIterator[Tasks]:
    async with scratch_collection(mongo.url, CommandCounter(), prefix="retry_due") as docs:
        yield docs


def _fields(command: ScoreText, phase: Phase, *, attempt: int) -> dict[str, Any]:
    return {
        "task_id": command.task_id,
        "tenant_id": command.tenant_id,
        "sequence": event_sequence(generation=0, attempt=attempt, phase=phase),
        "attempt": attempt,
        "submitted_at": command.submitted_at,
    }


def _retrying(command: ScoreText, due: datetime, *, attempt: int = 1) -> TaskRetrying:
    return TaskRetrying(
        **_fields(command, Phase.RETRYING, attempt=attempt),
        error=RATE_LIMITED,
        next_attempt_at=due,
    )


def _told_again(retrying: TaskRetrying, due: datetime) -> TaskRetrying:
    """As the scorer tells it when a pause puts the attempt off (`scoring._retry_due_later`)."""
    return retrying.model_copy(update={"next_attempt_at": due, "message_id": new_id()})


async def _apply(tasks: Tasks, *events: TaskEvent) -> None:
    for event in events:
        await apply_projected(event, writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow())


async def _view(tasks: Tasks, command: ScoreText) -> TaskView:
    view = await find_task(command.task_id, tenant_id=command.tenant_id, tasks=tasks, now=utcnow())
    assert view is not None
    return view


async def _expires_at(tasks: Tasks, command: ScoreText) -> datetime:
    document = await tasks.find_one({"_id": command.task_id})
    assert document is not None
    expires_at: datetime = document["expires_at"]
    return expires_at


def _in(**delta: float) -> datetime:
    """A time `delta` from now, to the millisecond (as the database keeps it)."""
    at = utcnow() + timedelta(**delta)
    return at.replace(microsecond=at.microsecond // 1000 * 1000)


def _command() -> ScoreText:
    return ScoreText(task_id=new_id(), tenant_id="acme", text="Retried during a pause.")


async def test_a_retry_told_again_with_a_later_time_moves_the_next_attempt_later(
    tasks: Tasks,
) -> None:
    command = _command()
    first = _retrying(command, _in(seconds=2))
    await _apply(tasks, accepted_event(command), first)
    expires_before = await _expires_at(tasks, command)

    later = _in(minutes=10)
    await _apply(tasks, _told_again(first, later))

    view = await _view(tasks, command)
    # It read the first time, long past while the pause held the attempt.
    assert view.next_attempt_at == later
    assert (view.status, view.attempts, view.sequence) == (TaskStatus.RETRYING, 1, first.sequence)
    assert view.error is not None
    assert view.error.code == "model_rate_limited"
    # Kept as long past the later time as past the first one.
    assert await _expires_at(tasks, command) > expires_before
    # No change of state: the history holds the retry once, as first told.
    history = await find_history(
        command.task_id, tenant_id=command.tenant_id, after=-1, tasks=tasks, now=utcnow()
    )
    assert history is not None
    retries = [change for change in history.changes if change.status is TaskStatus.RETRYING]
    assert [change.next_attempt_at for change in retries] == [first.next_attempt_at]


async def test_an_earlier_telling_redelivered_late_never_moves_the_time_back(
    tasks: Tasks,
) -> None:
    command = _command()
    first = _retrying(command, _in(seconds=2))
    once = _told_again(first, _in(minutes=1))
    twice = _told_again(first, _in(minutes=2))

    await _apply(tasks, accepted_event(command), first, twice, once, first)

    assert (await _view(tasks, command)).next_attempt_at == twice.next_attempt_at


async def test_a_retry_told_again_before_its_first_telling_arrives_keeps_the_later_time(
    tasks: Tasks,
) -> None:
    command = _command()
    first = _retrying(command, _in(seconds=2))
    later = _told_again(first, _in(minutes=5))

    await _apply(tasks, accepted_event(command), later, first)

    view = await _view(tasks, command)
    assert (view.status, view.next_attempt_at) == (TaskStatus.RETRYING, later.next_attempt_at)


async def test_a_retry_told_again_after_its_attempt_started_changes_nothing(
    tasks: Tasks,
) -> None:
    """The attempt put off came back and started (or a later retry stands): the telling
    belongs to a state the task has left, and brings no due time back."""
    command = _command()
    first = _retrying(command, _in(seconds=2))
    started = TaskStarted(**_fields(command, Phase.STARTED, attempt=2))
    second = _retrying(command, _in(seconds=4), attempt=2)

    await _apply(tasks, accepted_event(command), first, started)
    await _apply(tasks, _told_again(first, _in(minutes=5)))
    view = await _view(tasks, command)
    assert (view.status, view.next_attempt_at) == (TaskStatus.PROCESSING, None)

    await _apply(tasks, second, _told_again(first, _in(minutes=6)))
    view = await _view(tasks, command)
    assert (view.status, view.next_attempt_at) == (TaskStatus.RETRYING, second.next_attempt_at)
