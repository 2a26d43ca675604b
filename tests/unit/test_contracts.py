"""Contracts: ordering of events, tolerant reading, wire shape."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest
from pydantic import ValidationError

from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    TaskAccepted,
    TaskCompleted,
    TaskError,
    TaskRetrying,
    TaskStarted,
    event_sequence,
    parse_task_event,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_sequence_orders_phase_then_attempt_then_generation() -> None:
    order = [
        event_sequence(generation=0, attempt=0, phase=Phase.ACCEPTED),
        event_sequence(generation=0, attempt=1, phase=Phase.STARTED),
        event_sequence(generation=0, attempt=1, phase=Phase.RETRYING),
        event_sequence(generation=0, attempt=2, phase=Phase.STARTED),
        event_sequence(generation=0, attempt=2, phase=Phase.TERMINAL),
        event_sequence(generation=1, attempt=0, phase=Phase.ACCEPTED),
        event_sequence(generation=1, attempt=1, phase=Phase.TERMINAL),
    ]
    assert order == sorted(order)
    assert len(set(order)) == len(order)


def test_correlation_id_is_the_task_id_on_the_wire() -> None:
    command = ScoreText(task_id="t1", text="hello")
    wire = command.model_dump(mode="json")
    assert wire["correlation_id"] == "t1"
    assert wire["schema_version"] == 2
    assert wire["tenant_id"] == "default"
    assert ScoreText.model_validate_json(command.model_dump_json()) == command


def test_readers_ignore_unknown_fields() -> None:
    body = b'{"task_id": "t1", "text": "x", "added_in_a_later_version": 1}'
    assert ScoreText.model_validate_json(body).task_id == "t1"


def test_event_is_decoded_by_its_routing_key() -> None:
    started = TaskStarted(task_id="t1", sequence=11, attempt=1, submitted_at=NOW)
    decoded = parse_task_event("task.started", started.model_dump_json().encode())
    assert isinstance(decoded, TaskStarted)
    assert decoded.sequence == 11
    with pytest.raises(KeyError):
        parse_task_event("task.unknown", b"{}")


@pytest.mark.parametrize("score", [-0.1, 10.01, 42])
def test_out_of_range_scores_are_refused_not_clamped(score: float) -> None:
    with pytest.raises(ValidationError):
        ScoreResult(score=score, comment="c", model="m")


def test_contracts_are_frozen() -> None:
    event = TaskAccepted(task_id="t1", sequence=0, submitted_at=NOW)
    with pytest.raises(ValidationError):
        event.task_id = "t2"  # type: ignore[misc]


def test_usage_total_is_derived() -> None:
    completed = TaskCompleted(
        task_id="t1",
        sequence=190,
        submitted_at=NOW,
        result=ScoreResult.model_validate(
            {
                "score": 5,
                "comment": "c",
                "model": "m",
                "usage": {"prompt_tokens": 3, "completion_tokens": 4},
            }
        ),
    )
    assert completed.result.usage.total_tokens == 7


def test_a_time_without_an_offset_is_read_as_utc() -> None:
    """Compared with the aware times of a consumer, it raised `TypeError` and was held."""
    command = ScoreText(task_id="t1", text="hi").model_dump(mode="json")
    command["not_before"] = "2030-01-01T00:00:00"
    read = ScoreText.model_validate(command)
    assert read.not_before == datetime(2030, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("field", ["occurred_at", "next_attempt_at", "submitted_at"])
def test_a_time_past_the_year_9000_is_refused(field: str) -> None:
    """A retention added to it left `datetime`'s range (`OverflowError`, the delivery held)."""
    retrying = TaskRetrying(
        task_id="t1",
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.RETRYING),
        attempt=1,
        submitted_at=datetime(2030, 1, 1, tzinfo=UTC),
        error=TaskError(code="model_unavailable", message="down", retryable=True),
        next_attempt_at=datetime(2030, 1, 1, tzinfo=UTC),
    ).model_dump(mode="json")
    with pytest.raises(ValidationError, match="9000"):
        parse_task_event("task.retrying", orjson.dumps(retrying | {field: "9999-12-30T00:00:00Z"}))
