"""A re-scored task's new generation replaces what its earlier one showed, even when the new
generation's `task.accepted` never reached the projection (it is sent best effort, after the
command's confirm): its attempt's events carry no result, and the task must not show the
earlier rubric's result next to a new status; nor may a DLQ replay's start show the
dead-lettered generation's error (within a generation the latest error stays)."""

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


def _fields(
    command: ScoreText, generation: int, phase: Phase, *, attempt: int = 1
) -> dict[str, Any]:
    return {
        "task_id": command.task_id,
        "tenant_id": command.tenant_id,
        "sequence": event_sequence(generation=generation, attempt=attempt, phase=phase),
        "generation": generation,
        "attempt": attempt,
        "submitted_at": command.submitted_at,
    }


async def _completed_at_generation_0(tasks: AsyncCollection[Document]) -> ScoreText:
    command = ScoreText(task_id=new_id(), tenant_id="acme", text="Scored, then re-scored.")
    result = ScoreResult(score=7, comment="Under the old rubric.", model="m")
    for event in (
        accepted_event(command),
        TaskCompleted(**_fields(command, 0, Phase.TERMINAL), result=result),
    ):
        assert await apply_projected(
            event, writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow()
        )
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

    assert await apply_projected(
        event_of(command), writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow()
    )

    view = await _view(tasks, command)
    assert (view.status, view.result) == (status, None)


DEAD = TaskError(code="model_timeout", message="Timed out, every attempt.", retryable=True)
TRANSIENT = TaskError(code="model_rate_limited", message="Rate limited.", retryable=True)


async def _apply(tasks: AsyncCollection[Document], *events: TaskEvent) -> None:
    for event in events:
        assert await apply_projected(
            event, writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow()
        )


async def _dead_lettered_at_generation_0(tasks: AsyncCollection[Document]) -> ScoreText:
    """Failed for good at generation 0 and dead-lettered: an admin may replay it."""
    command = ScoreText(task_id=new_id(), tenant_id="acme", text="Failed, then replayed.")
    failed = TaskFailed(**_fields(command, 0, Phase.TERMINAL), error=DEAD, dead_lettered=True)
    await _apply(tasks, accepted_event(command), failed)
    error = (await _view(tasks, command)).error
    assert error is not None
    assert error.dead_lettered
    return command


@pytest.mark.parametrize("attempt", [1, 2], ids=["first-attempt", "attempt-2-before-retrying"])
async def test_the_replayed_generation_started_without_its_acceptance_shows_no_earlier_error(
    tasks: AsyncCollection[Document], attempt: int
) -> None:
    """The replay's `task.accepted` (best effort) was lost: the task read `processing` with
    the dead-lettered generation's error until the replay's outcome. Attempt 2: its attempt
    1's `task.retrying` is not applied yet (overtaken), so only the generation tells."""
    command = await _dead_lettered_at_generation_0(tasks)

    await _apply(tasks, TaskStarted(**_fields(command, 1, Phase.STARTED, attempt=attempt)))

    view = await _view(tasks, command)
    assert (view.status, view.attempts, view.result, view.error) == (
        TaskStatus.PROCESSING,
        attempt,
        None,
        None,
    )


async def test_a_later_attempt_started_keeps_its_generations_latest_error(
    tasks: AsyncCollection[Document],
) -> None:
    """Within a generation a poll shows the latest error: attempt 2's start keeps the error
    attempt 1 retried after (the replayed generation's own, not the dead-lettered one's)."""
    command = await _dead_lettered_at_generation_0(tasks)
    due = utcnow() + timedelta(minutes=1)
    await _apply(
        tasks,
        TaskStarted(**_fields(command, 1, Phase.STARTED)),
        TaskRetrying(**_fields(command, 1, Phase.RETRYING), error=TRANSIENT, next_attempt_at=due),
        TaskStarted(**_fields(command, 1, Phase.STARTED, attempt=2)),
    )

    view = await _view(tasks, command)
    assert (view.status, view.attempts) == (TaskStatus.PROCESSING, 2)
    assert view.error is not None
    assert (view.error.code, view.error.dead_lettered) == (TRANSIENT.code, False)


async def test_a_retry_applied_after_the_next_attempts_start_still_shows_its_error(
    tasks: AsyncCollection[Document],
) -> None:
    """The same two events in the other order (attempt 1's `task.retrying` redelivered late,
    or replayed from the projection's DLQ): the running attempt 2 shows attempt 1's error
    all the same."""
    command = await _accepted(tasks, "Started, then its retry.")
    await _apply(tasks, TaskStarted(**_fields(command, 0, Phase.STARTED, attempt=2)))

    assert not await _apply_late_retry(tasks, command, attempt=1)

    view = await _view(tasks, command)
    assert (view.status, view.attempts) == (TaskStatus.PROCESSING, 2)
    assert view.error is not None
    assert (view.error.code, view.error.dead_lettered) == (TRANSIENT.code, False)


async def test_a_late_retry_of_an_attempt_before_the_last_shows_no_error(
    tasks: AsyncCollection[Document],
) -> None:
    """Attempt 3 running, attempt 2's retry not come: attempt 1's late retry is not the
    latest error, and the view shows none."""
    command = await _accepted(tasks, "Started a third time, the first retry late.")
    await _apply(tasks, TaskStarted(**_fields(command, 0, Phase.STARTED, attempt=3)))

    assert not await _apply_late_retry(tasks, command, attempt=1)

    view = await _view(tasks, command)
    assert (view.status, view.attempts, view.error) == (TaskStatus.PROCESSING, 3, None)


async def test_a_late_retry_of_the_attempt_before_replaces_an_older_attempts_error(
    tasks: AsyncCollection[Document],
) -> None:
    """Attempt 1's retry applied, attempt 3 started (attempt 2 quick: no start of its own)
    keeping attempt 1's error, then attempt 2's retry late: the view showed attempt 1's
    error while attempt 3 ran, where the events in order show attempt 2's (review)."""
    command = await _accepted(tasks, "Retried twice, the second retry late.")
    first = TaskError(code="provider_unavailable", message="First.", retryable=True)
    second = TaskError(code="rate_limited", message="Second.", retryable=True)
    due = utcnow() + timedelta(minutes=1)
    await _apply(
        tasks,
        TaskRetrying(**_fields(command, 0, Phase.RETRYING), error=first, next_attempt_at=due),
        TaskStarted(**_fields(command, 0, Phase.STARTED, attempt=3)),
    )
    late = TaskRetrying(
        **_fields(command, 0, Phase.RETRYING, attempt=2), error=second, next_attempt_at=due
    )

    assert not await apply_projected(
        late, writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow()
    )

    view = await _view(tasks, command)
    assert (view.status, view.attempts) == (TaskStatus.PROCESSING, 3)
    assert view.error is not None
    assert view.error.code == second.code


async def _accepted(tasks: AsyncCollection[Document], text: str) -> ScoreText:
    command = ScoreText(task_id=new_id(), tenant_id="acme", text=text)
    await _apply(tasks, accepted_event(command))
    return command


async def _apply_late_retry(
    tasks: AsyncCollection[Document], command: ScoreText, *, attempt: int
) -> bool:
    due = utcnow() + timedelta(minutes=1)
    retry = TaskRetrying(
        **_fields(command, 0, Phase.RETRYING, attempt=attempt),
        error=TRANSIENT,
        next_attempt_at=due,
    )
    return await apply_projected(retry, writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow())


async def test_an_earlier_generations_late_acceptance_keeps_the_newer_ones_description(
    tasks: AsyncCollection[Document],
) -> None:
    """A late `task.accepted` sets its rubric, model, metadata and batch on the task (a later
    event of its generation overtook it); one of an earlier generation, arriving after a
    re-score was accepted, overwrote the re-score's with the old rubric's."""
    original = ScoreText(
        task_id=new_id(),
        tenant_id="acme",
        text="Scored, then re-scored under a new rubric.",
        rubric="v1",
        model="model-a",
        metadata={"run": "original"},
    )
    rescore = original.model_copy(
        update={"generation": 1, "rubric": "v2", "model": "model-b", "metadata": {"run": "re"}}
    )
    # The original acceptance (best effort) was held up: its generation's outcome and the
    # re-score's acceptance reached the projection first.
    result = ScoreResult(score=7, comment="Under the old rubric.", model="model-a")
    completed = TaskCompleted(**_fields(original, 0, Phase.TERMINAL), result=result)
    await _apply(tasks, completed, accepted_event(rescore))

    stale = await apply_projected(
        accepted_event(original), writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow()
    )

    assert not stale
    document = await tasks.find_one({"_id": original.task_id})
    assert document is not None
    assert (document["rubric"], document["model"], document["metadata"]) == (
        "v2",
        "model-b",
        {"run": "re"},
    )


async def test_a_late_acceptance_of_the_tasks_own_generation_still_describes_it(
    tasks: AsyncCollection[Document],
) -> None:
    """Overtaken by its own generation's start, the acceptance's description still lands."""
    scheduled = utcnow().replace(microsecond=0) + timedelta(minutes=5)  # BSON keeps ms
    command = ScoreText(
        task_id=new_id(),
        tenant_id="acme",
        text="Started first.",
        rubric="v1",
        model="m",
        not_before=scheduled,
    )
    await _apply(tasks, TaskStarted(**_fields(command, 0, Phase.STARTED)))

    stale = await apply_projected(
        accepted_event(command), writes=GroupWriter(tasks), finished_ttl=TTL, now=utcnow()
    )

    assert not stale
    document = await tasks.find_one({"_id": command.task_id})
    assert document is not None
    assert (document["rubric"], document["model"]) == ("v1", "m")
    # The scheduled time too: a view's `not_before` depended on the order events came in.
    view = await find_task(command.task_id, tenant_id="acme", tasks=tasks, now=utcnow())
    assert view is not None
    assert view.not_before == scheduled
