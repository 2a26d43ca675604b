"""Contracts: ordering of events, tolerant reading, wire shape."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ValidationError

from shared import contracts
from shared.contracts import (
    MAX_ATTEMPT,
    MAX_ATTEMPT_BUDGET,
    MAX_INT64,
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


def _contract_models() -> list[type[BaseModel]]:
    return [
        model
        for model in vars(contracts).values()
        if isinstance(model, type)
        and issubclass(model, BaseModel)
        and model.__module__ == contracts.__name__
    ]


def _unbounded_integers(schema: Any, path: str = "") -> list[str]:
    """The integer nodes of a JSON schema with no maximum that BSON's int64 holds."""
    found: list[str] = []
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and schema.get("maximum", math.inf) > MAX_INT64:
            found.append(path)
        for key, value in schema.items():
            found += _unbounded_integers(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            found += _unbounded_integers(value, f"{path}/{index}")
    return found


@pytest.mark.parametrize("model", _contract_models(), ids=lambda model: model.__name__)
def test_every_integer_of_a_contract_fits_in_int64(model: type[BaseModel]) -> None:
    """A larger one passed validation, then failed every write of it with an error no
    consumer expected (`InvalidDocument`), and the delivery was held."""
    assert _unbounded_integers(model.model_json_schema(mode="validation")) == []


@pytest.mark.parametrize("number", ["Infinity", "NaN", "-Infinity"])
def test_a_float_that_is_no_number_is_refused(number: str) -> None:
    """`Infinity` passed `ge=0` and left a reader's JSON answer unserialisable."""
    body = ScoreResult(score=5, comment="c", model="m").model_dump_json()
    with pytest.raises(ValidationError):
        ScoreResult.model_validate_json(body.replace('"latency_ms":0.0', f'"latency_ms":{number}'))


def test_an_attempt_never_numbers_its_events_as_the_next_generation() -> None:
    last = event_sequence(generation=3, attempt=MAX_ATTEMPT, phase=Phase.TERMINAL)
    assert last < event_sequence(generation=4, attempt=0, phase=Phase.ACCEPTED)
    with pytest.raises(ValidationError):
        ScoreText(task_id="t1", text="x", attempt=MAX_ATTEMPT + 1)


def test_a_retry_the_scorer_builds_from_any_valid_command_is_valid() -> None:
    """Its attempt is at most the command's budgets plus one."""
    most = ScoreText(
        task_id="t1",
        text="x",
        max_attempts=MAX_ATTEMPT_BUDGET,
        rate_limited_retries=MAX_ATTEMPT_BUDGET,
        attempt=MAX_ATTEMPT_BUDGET * 2,
    )
    retry = ScoreText.model_validate(most.model_dump() | {"attempt": most.attempt + 1})
    assert retry.attempt == MAX_ATTEMPT_BUDGET * 2 + 1
    with pytest.raises(ValidationError):
        ScoreText(task_id="t1", text="x", max_attempts=MAX_ATTEMPT_BUDGET + 1)


@pytest.mark.parametrize(
    ("instant", "written"),
    [
        (datetime(2030, 1, 1, 10, 0, tzinfo=UTC), "2030-01-01T10:00:00.000000Z"),
        (datetime(2030, 1, 1, 10, 0, 0, 537000, tzinfo=UTC), "2030-01-01T10:00:00.537000Z"),
        (datetime(2030, 1, 1, 10, 0, 0, 1), "2030-01-01T10:00:00.000001Z"),  # noqa: DTZ001 - no offset: UTC
        (
            datetime(2030, 1, 1, 11, 30, tzinfo=timezone(timedelta(hours=1, minutes=30))),
            "2030-01-01T10:00:00.000000Z",
        ),
    ],
)
def test_every_time_is_written_in_one_shape(instant: datetime, written: str) -> None:
    """RFC 3339, UTC, to the microsecond, `Z`: a whole second kept no fraction, and the keys'
    and webhooks' times read `+00:00` (three shapes in one API)."""

    class Answer(BaseModel):
        at: contracts.Instant

    assert contracts.rfc3339(instant) == written
    assert orjson.loads(Answer(at=instant).model_dump_json()) == {"at": written}
    assert Answer.model_json_schema(mode="serialization")["properties"]["at"]["format"] == (
        "date-time"
    )
