"""What the status projection reads from its queue: task events as they are, a command sent
now as its task's acceptance, nothing from a retry's command."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from services.status.projection import projected_event
from shared.contracts import (
    Phase,
    ScoreText,
    TaskAccepted,
    TaskStarted,
    TaskStatus,
    event_sequence,
)

SUBMITTED = datetime(2026, 1, 1, tzinfo=UTC)
QUEUED = SUBMITTED + timedelta(hours=5)  # a re-score's generation is queued later


def _command(**fields: object) -> ScoreText:
    return ScoreText.model_validate(
        {
            "task_id": "t1",
            "tenant_id": "acme",
            "text": "An essay.",
            "rubric": "clarity",
            "model": "judge",
            "metadata": {"course": "b1"},
            "submitted_at": SUBMITTED,
            "occurred_at": QUEUED,
            "api_key_id": "k1",
            "batch_id": "b1",
            "batch_index": 3,
            "callback_url": "https://example.com/hook",
            **fields,
        }
    )


def test_a_command_sent_now_is_its_tasks_acceptance() -> None:
    command = _command(generation=2)
    event = projected_event(ScoreText.routing_key, command.model_dump_json().encode())
    assert isinstance(event, TaskAccepted)
    assert event.status is TaskStatus.QUEUED
    assert event.sequence == event_sequence(generation=2, attempt=0, phase=Phase.ACCEPTED)
    assert (event.task_id, event.tenant_id, event.generation) == ("t1", "acme", 2)
    assert (event.submitted_at, event.occurred_at) == (SUBMITTED, QUEUED)
    assert (event.rubric, event.model, event.metadata) == ("clarity", "judge", {"course": "b1"})
    assert (event.batch_id, event.batch_index, event.api_key_id) == ("b1", 3, "k1")
    assert event.callback_url == "https://example.com/hook"
    assert event.not_before is None


def test_a_retrys_command_tells_nothing_new() -> None:
    retry = _command(attempt=2, not_before=QUEUED)
    assert projected_event(ScoreText.routing_key, retry.model_dump_json().encode()) is None


def test_task_events_are_read_as_they_are() -> None:
    started = TaskStarted(task_id="t1", sequence=11, attempt=1, submitted_at=SUBMITTED)
    event = projected_event(TaskStarted.routing_key, started.model_dump_json().encode())
    assert event == started


def test_unreadable_deliveries_raise_for_the_dead_letter_queue() -> None:
    with pytest.raises(ValidationError):
        projected_event(ScoreText.routing_key, b'{"task_id": "t1"}')
    with pytest.raises(KeyError):
        projected_event("task.unknown", b"{}")
