"""When the gateway answers a read from its own record: while the status service may not
have heard of the task (`recently_due`)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from services.gateway.submissions import Submission, SubmissionState, recently_due

NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)
WINDOW = timedelta(minutes=5)


def _delayed(*, submitted_ago: timedelta, finished: int | None) -> Submission:
    return Submission(
        task_id="t-1",
        tenant_id="acme",
        state=SubmissionState.ACCEPTED,
        request_hash="h",
        created_at=NOW - submitted_ago,
        not_before=NOW + timedelta(days=2),
        command=None,
        finished_generation=finished,
    )


def test_a_delayed_task_is_answered_from_its_record_until_it_is_due() -> None:
    assert recently_due(
        _delayed(submitted_ago=timedelta(hours=2), finished=None), now=NOW, window=WINDOW
    )


def test_a_delayed_task_that_finished_early_is_not_kept_open_by_its_due_time() -> None:
    """Cancelled a minute after its submission, two days ahead of its time: once the
    projection's copy expired, the task read `scheduled` (then `queued`) until due."""
    cancelled = _delayed(submitted_ago=timedelta(hours=2), finished=0)
    assert not recently_due(cancelled, now=NOW, window=WINDOW)


def test_a_young_task_that_finished_is_still_answered_from_its_record() -> None:
    """Read-your-writes right after the 202 holds whatever the task's state."""
    assert recently_due(
        _delayed(submitted_ago=timedelta(minutes=1), finished=0), now=NOW, window=WINDOW
    )


def test_a_newer_generation_not_yet_finished_keeps_its_due_time() -> None:
    rescored = replace(_delayed(submitted_ago=timedelta(hours=2), finished=0), generation=1)
    assert recently_due(rescored, now=NOW, window=WINDOW)
