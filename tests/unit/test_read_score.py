"""`read_score`'s look for a result-cache hit's completion (`tests/integration/test_cached_reads.py`
has the whole path): only for a young task at its acceptance, and the gateway's database away,
the status service's view is the answer, as it was before the look existed (found in review)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import cast

from services.gateway.errors import DatabaseUnavailable
from services.gateway.submissions import Submissions
from services.gateway.submit import read_score
from shared.contracts import ScoreResult, TaskStatus, TaskView

T0 = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)
RESULT = ScoreResult(score=6.5, comment="From the cache.", model="m", cached=True)


class Status:
    def __init__(self, view: TaskView) -> None:
        self.view = view

    async def find(self, task_id: str, *, tenant_id: str) -> TaskView | None:
        return self.view


class CachedResults:
    """The one read `read_score` makes of the submissions here, counted."""

    def __init__(self, answer: ScoreResult | Exception | None) -> None:
        self.answer = answer
        self.reads = 0

    async def cached_result(self, task_id: str, *, tenant_id: str) -> ScoreResult | None:
        self.reads += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _queued(created_at: datetime) -> TaskView:
    return TaskView(
        task_id="t1",
        status=TaskStatus.QUEUED,
        attempts=0,
        created_at=created_at,
        updated_at=created_at,
        sequence=0,
    )


async def _read(view: TaskView, submissions: CachedResults, *, now: datetime) -> TaskView | None:
    return await read_score(
        "t1",
        tenant_id="a",
        status=Status(view),
        submissions=cast(Submissions, submissions),
        clock=lambda: now,
        window=timedelta(seconds=300),
    )


async def test_a_young_acceptance_answered_from_the_cache_reads_completed() -> None:
    submissions = CachedResults(RESULT)
    view = await _read(_queued(T0), submissions, now=T0 + timedelta(seconds=5))
    assert view is not None
    assert (view.status, view.result, view.sequence) == (TaskStatus.COMPLETED, RESULT, 90)


async def test_an_older_one_reads_nothing_more() -> None:
    submissions = CachedResults(RESULT)
    view = await _read(_queued(T0), submissions, now=T0 + timedelta(seconds=301))
    assert view == _queued(T0)
    assert submissions.reads == 0


async def test_the_gateways_database_away_the_status_view_answers() -> None:
    submissions = CachedResults(DatabaseUnavailable("timed out"))
    view = await _read(_queued(T0), submissions, now=T0 + timedelta(seconds=5))
    assert view == _queued(T0)
    assert submissions.reads == 1
