"""Housekeeping reports dead letters before it deletes anything."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import UTC, datetime, timedelta

import pytest

from services.scheduler.catalogue import Catalogue
from services.scheduler.checkpoints import Checkpoints
from services.scheduler.config import HousekeepingConfig
from services.scheduler.firings import Firings
from services.scheduler.jobs import JobRun
from services.scheduler.jobs.housekeeping import keep_house
from services.scheduler.usage_store import UsageRecords
from shared.contracts import DeadLetterAlert, HousekeepingRequested
from shared.topology import SCORE_REQUESTS, WorkQueue

NOW = datetime(2030, 1, 1, tzinfo=UTC)


class NoFirings(Firings):
    def __init__(self) -> None:  # no database behind it
        pass

    async def last_scheduled_ids(self, jobs: Sequence[str], *, not_after: datetime) -> list[str]:
        return []

    async def delete_finished_before(self, cutoff: datetime, *, keep: Sequence[str]) -> int:
        return 0

    async def abandon_silent(
        self, *, silent_since: datetime, now: datetime, reason: str, scheduled: Collection[str]
    ) -> int:
        return 0


class NoCheckpoints(Checkpoints):
    def __init__(self) -> None:  # no database behind it
        pass

    async def delete_finished_before(self, cutoff: datetime) -> int:
        return 0


class TooManyRecords(UsageRecords):
    """A day of raw usage records too big to delete within the job's deadline."""

    def __init__(self) -> None:  # no database behind it
        pass

    async def delete_rolled_up_before(self, day: str) -> int:
        raise TimeoutError("operation exceeded time limit")


async def _depth(queue: WorkQueue) -> tuple[int, float | None]:
    return 3, 60.0


async def test_dead_letters_are_reported_even_when_deleting_fails() -> None:
    """The deletes ran first: while one kept failing (a day of records past the deadline),
    every run failed before its report, and no dead-letter alert went out."""
    announced: list[HousekeepingRequested | DeadLetterAlert] = []

    async def announce(event: HousekeepingRequested | DeadLetterAlert) -> None:
        announced.append(event)

    run = JobRun("run-1", "housekeeping", NOW, NOW, manual=False, attempt=1)
    with pytest.raises(TimeoutError):
        await keep_house(
            run,
            firings=NoFirings(),
            records=TooManyRecords(),
            catalogue=Catalogue.__new__(Catalogue),
            checkpoints=NoCheckpoints(),
            job_names=["housekeeping"],
            scheduled_jobs=["housekeeping"],
            work_queues=[SCORE_REQUESTS],
            probe=_depth,
            announce=announce,
            config=HousekeepingConfig(dead_letter_threshold=1),
            usage_retention=timedelta(days=90),
            catalogue_retention=timedelta(days=2),
            stale_after=timedelta(hours=1),
            clock=lambda: NOW,
        )
    assert [type(event) for event in announced] == [DeadLetterAlert]
