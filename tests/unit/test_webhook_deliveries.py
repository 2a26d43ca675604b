"""Delivery rules without I/O: what each answer means, back-off, ids, payloads, URL fields."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from services.gateway.schemas import ScoreSubmission
from services.gateway.webhooks_api import FailureAlert
from services.notifier.consumer import event_key
from services.notifier.deliveries import RetryPolicy, judge_answer
from services.notifier.errors import DeliveryRejected, ReceiverUnavailable
from services.notifier.notifications import delivery_id, webhook_payload
from services.notifier.sender import ReceiverAnswer
from shared.contracts import (
    ScoreResult,
    TaskCompleted,
    TaskError,
    TaskFailed,
    WebhookPurpose,
)
from shared.http import parse_retry_after

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_2xx_is_delivered(status: int) -> None:
    judge_answer(ReceiverAnswer(status=status), now=NOW)


@pytest.mark.parametrize("status", [301, 302, 307, 308, 400, 401, 403, 404, 410, 413, 422])
def test_redirects_and_most_4xx_are_permanent(status: int) -> None:
    with pytest.raises(DeliveryRejected, match=str(status)):
        judge_answer(ReceiverAnswer(status=status, excerpt="go away"), now=NOW)


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_408_429_and_5xx_are_retried(status: int) -> None:
    with pytest.raises(ReceiverUnavailable) as raised:
        judge_answer(ReceiverAnswer(status=status, retry_after="7"), now=NOW)
    assert raised.value.retry_after_s == 7.0


@pytest.mark.parametrize("status", [0, 99, 101, 103, 199, 600, 999])
def test_a_status_outside_2xx_to_5xx_is_retried_as_a_5xx(status: int) -> None:
    """No usable answer, but the receiver's: retried, and ending as a 5xx does, never taken
    for its refusal (a final 101 gave the webhook up at once; a review)."""
    with pytest.raises(ReceiverUnavailable, match=str(status)):
        judge_answer(ReceiverAnswer(status=status), now=NOW)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("120", 120.0),
        (" 0 ", 0.0),
        ("Sun, 01 Mar 2026 12:01:30 GMT", 90.0),
        ("Sun, 01 Mar 2026 11:00:00 GMT", 0.0),
        ("Sun, 01 Mar 2026 12:01:30 -0000", 90.0),  # no zone: an HTTP-date is GMT
        ("1.5", 1.5),
        ("soon", None),
        ("-5", None),
        ("inf", None),
        (None, None),
        # A year past datetime's raised OverflowError after the POST: redelivered, re-POSTed.
        ("Mon, 01 Jan 99999999999999999999 00:00:00 GMT", None),
    ],
)
def test_retry_after_in_seconds_or_as_a_date(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value, now=NOW) == seconds


def test_back_off_doubles_with_jitter_up_to_the_cap() -> None:
    policy = RetryPolicy(base_s=10, cap_s=100)
    rng = random.Random(7)

    for attempt, ceiling in [(1, 10), (2, 20), (3, 40), (4, 80), (5, 100), (9, 100)]:
        for _ in range(20):
            delay = policy.delay(attempt, retry_after_s=None, rng=rng).total_seconds()
            assert ceiling / 2 <= delay < ceiling


def test_retry_after_wins_up_to_the_cap() -> None:
    policy = RetryPolicy(base_s=10, cap_s=100)
    rng = random.Random(7)

    assert policy.delay(1, retry_after_s=55, rng=rng) == timedelta(seconds=55)
    assert policy.delay(1, retry_after_s=5_000, rng=rng) == timedelta(seconds=100)


def test_a_shorter_retry_after_does_not_undercut_the_back_off() -> None:
    """`Retry-After: 0` (or a date already past) spent all attempts within seconds."""
    policy = RetryPolicy(base_s=30, cap_s=3600)
    rng = random.Random(7)

    for hint in (0.0, 1.0, None):
        assert policy.delay(1, retry_after_s=hint, rng=rng) >= timedelta(seconds=15)


def _completed(sequence: int = 190) -> TaskCompleted:
    return TaskCompleted(
        task_id="t1",
        sequence=sequence,
        attempt=1,
        submitted_at=NOW - timedelta(seconds=3),
        occurred_at=NOW,
        result=ScoreResult(score=7.5, comment="clear", model="fake-judge-1"),
    )


def _failed() -> TaskFailed:
    return TaskFailed(
        task_id="t1",
        sequence=490,
        attempt=4,
        submitted_at=NOW - timedelta(seconds=30),
        occurred_at=NOW,
        error=TaskError(code="model_unavailable", message="503", retryable=True),
        dead_lettered=True,
    )


def test_delivery_ids_are_stable_per_purpose_event_and_sequence() -> None:
    callback = delivery_id(WebhookPurpose.CALLBACK, _completed())

    assert callback == delivery_id(WebhookPurpose.CALLBACK, _completed())
    assert callback.startswith("msg_")
    assert callback != delivery_id(WebhookPurpose.FAILURE_ALERT, _completed())
    assert callback != delivery_id(WebhookPurpose.CALLBACK, _completed(sequence=1_000_190))


def test_payload_of_a_completed_task() -> None:
    payload = webhook_payload(_completed(), WebhookPurpose.CALLBACK)

    assert payload["type"] == "task.completed"
    # RFC 3339 in UTC with `Z`, to the microsecond, as every answer of the API writes times.
    assert payload["timestamp"] == "2026-03-01T12:00:00.000000Z"
    data = payload["data"]
    assert data["task_id"] == "t1"
    assert data["status"] == "completed"
    assert (data["submitted_at"], data["finished_at"]) == (
        "2026-03-01T11:59:57.000000Z",
        "2026-03-01T12:00:00.000000Z",
    )
    assert data["purpose"] == "callback"
    assert data["result"]["score"] == 7.5
    assert data["error"] is None
    assert data["status_url"] == "/v1/scores/t1"


def test_a_payload_says_which_run_of_the_task_it_reports() -> None:
    """A re-score or a dead-letter replay POSTs its outcome too, possibly before the earlier
    one's retried delivery: without the generation and sequence a receiver could not tell
    which is newer."""
    again = _completed(sequence=1_000_190).model_copy(update={"generation": 1})
    first, second = (
        webhook_payload(e, WebhookPurpose.CALLBACK)["data"] for e in (_completed(), again)
    )
    assert (first["generation"], first["sequence"]) == (0, 190)
    assert (second["generation"], second["sequence"]) == (1, 1_000_190)


def test_payload_of_a_failed_task() -> None:
    payload = webhook_payload(_failed(), WebhookPurpose.FAILURE_ALERT)

    assert payload["type"] == "task.failed"
    assert payload["data"]["purpose"] == "failure_alert"
    assert payload["data"]["result"] is None
    assert payload["data"]["error"] == {
        "code": "model_unavailable",
        "message": "503",
        "retryable": True,
        "dead_lettered": True,
    }
    assert payload["data"]["attempts"] == 4


@pytest.mark.parametrize(
    ("routing_key", "event"),
    [
        ("task.completed", "task.completed"),
        ("5s.task.completed", "task.completed"),
        ("1h.task.accepted", "task.accepted"),
        ("weird.task.failed", "weird.task.failed"),
    ],
)
def test_events_back_from_the_wait_ladder_keep_their_key(routing_key: str, event: str) -> None:
    assert event_key(routing_key) == event


def test_a_submission_accepts_a_public_https_callback_url() -> None:
    submission = ScoreSubmission.model_validate(
        {"text": "hello", "callback_url": "https://example.com/hook"}
    )

    assert submission.callback_url == "https://example.com/hook"


@pytest.mark.parametrize(
    "url", ["http://example.com/hook", "https://10.0.0.1/", "https://localhost/", "x" * 3000]
)
def test_an_unsafe_callback_url_names_the_field(url: str) -> None:
    with pytest.raises(ValidationError) as raised:
        ScoreSubmission.model_validate({"text": "hello", "callback_url": url})

    assert [error["loc"] for error in raised.value.errors()] == [("callback_url",)]


def test_a_failure_alert_url_is_checked_the_same_way() -> None:
    assert FailureAlert(url="https://example.com/alerts").url == "https://example.com/alerts"
    with pytest.raises(ValidationError):
        FailureAlert(url="https://169.254.169.254/")
