"""A fan-out delivery within its database deadline, on the database (the stand-in or MongoDB).

`SCHEDULER_JOB_DB_TIMEOUT_S` (`pymongo.timeout` around the handler) is one deadline for the
whole delivery, the broker's waits included. A delivery walked `FANOUT_PAGES_PER_DELIVERY`
pages whatever the time: behind a slow broker it began a page past the deadline, that page's
next database call failed on a healthy database, and the failure counted as an attempt
although the checkpoint had moved, so a run that moved in every delivery was given up.

Here the deadline is played on the test's clock (`ClockDeadline`: every database call of a
delivery made after it fails with `ExecutionTimeout`, as `pymongo.timeout` makes it fail),
and a slow broker moves that clock: nothing waits, nothing depends on the machine's speed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import ExecutionTimeout

from services.scheduler.catalogue import Catalogue, ScannedPage
from services.scheduler.checkpoints import Checkpoint, Checkpoints
from services.scheduler.errors import TransientJobError
from services.scheduler.firings import Firings, FiringState
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.jobs.fanout import fan_out_rescores
from services.scheduler.runs import (
    Continue,
    Finished,
    Retry,
    RetryPolicy,
    RunDecision,
    run_cron_job,
)
from shared.contracts import RescoreTask, RunCronJob
from tests.unit.test_scheduler_dispatch import Clock

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
VERSION = "v2"
JOB = "rescore-fanout"
DB_TIMEOUT_S = 60.0  # SCHEDULER_JOB_DB_TIMEOUT_S, on the test's clock
PAGE_CONFIRMED_IN = timedelta(seconds=20)  # a slow broker, well within its own timeout
Mongo = AsyncMongoClient[dict[str, Any]]


class ClockDeadline:
    """`pymongo.timeout` on the test's clock: a database call made more than `seconds` after
    the delivery began fails with `ExecutionTimeout`, as on MongoDB (None: no deadline)."""

    def __init__(self, clock: Clock, seconds: float | None) -> None:
        self._clock = clock
        self._limit = None if seconds is None else timedelta(seconds=seconds)
        self._began = clock.now
        self.met = 0  # database calls refused for the deadline

    def begin(self) -> None:
        self._began = self._clock.now

    def check(self) -> None:
        if self._limit is not None and self._clock.now - self._began > self._limit:
            self.met += 1
            raise ExecutionTimeout("operation exceeded time limit", 50)


class CatalogueOnTheClock(Catalogue):
    def __init__(self, client: Mongo, database: str, deadline: ClockDeadline) -> None:
        super().__init__(client, database)
        self._deadline = deadline

    async def scan_page(
        self, *, after: str | None, current_version: str, completed_since: datetime, limit: int
    ) -> ScannedPage:
        self._deadline.check()
        return await super().scan_page(
            after=after,
            current_version=current_version,
            completed_since=completed_since,
            limit=limit,
        )

    async def mark_rescore_requested(self, task_ids: Sequence[str], version: str) -> None:
        self._deadline.check()
        await super().mark_rescore_requested(task_ids, version)


class CheckpointsOnTheClock(Checkpoints):
    def __init__(self, client: Mongo, database: str, deadline: ClockDeadline) -> None:
        super().__init__(client, database)
        self._deadline = deadline

    async def start_or_resume(
        self, run_id: str, *, job: str, rubric_version: str, now: datetime
    ) -> Checkpoint:
        self._deadline.check()
        return await super().start_or_resume(
            run_id, job=job, rubric_version=rubric_version, now=now
        )

    async def advance(
        self, run_id: str, *, last_id: str, published: int, scanned: int, now: datetime
    ) -> None:
        self._deadline.check()
        await super().advance(
            run_id, last_id=last_id, published=published, scanned=scanned, now=now
        )

    async def finish(self, run_id: str, *, now: datetime) -> Checkpoint:
        self._deadline.check()
        return await super().finish(run_id, now=now)

    async def find(self, run_id: str) -> Checkpoint | None:
        self._deadline.check()
        return await super().find(run_id)


class SlowBroker:
    """Confirms each page `PAGE_CONFIRMED_IN` after it is sent (the test's clock moves); with
    `failing_every`, every n-th page is not confirmed at all."""

    def __init__(self, clock: Clock, *, failing_every: int | None = None) -> None:
        self._clock = clock
        self._failing_every = failing_every
        self._sent = 0
        self.pages: list[list[str]] = []

    async def __call__(self, page: Sequence[RescoreTask]) -> None:
        self._sent += 1
        self._clock.now += PAGE_CONFIRMED_IN
        if self._failing_every and self._sent % self._failing_every == 0:
            raise TransientJobError("the broker did not confirm the page in time")
        self.pages.append([task.task_id for task in page])

    @property
    def task_ids(self) -> list[str]:
        return [task_id for page in self.pages for task_id in page]


@pytest.fixture
async def database(mongo: Any, db_prefix: str) -> AsyncIterator[tuple[Mongo, str]]:
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        yield client, f"{db_prefix}{uuid.uuid4().hex[:6]}_scheduler"
    finally:
        await client.close()


async def _seed(client: Mongo, database: str, count: int) -> list[str]:
    task_ids = [f"task-{i:04d}" for i in range(count)]
    await client[database]["completed_tasks"].insert_many(
        [
            {
                "_id": task_id,
                "tenant_id": "acme",
                "generation": 0,
                "completed_at": NOW - timedelta(hours=1),
                "model": "m",
                "rubric_version": None,
            }
            for task_id in task_ids
        ]
    )
    return task_ids


def _fanout(
    client: Mongo, name: str, deadline: ClockDeadline, broker: SlowBroker, clock: Clock
) -> partial[Any]:
    return partial(
        fan_out_rescores,
        catalogue=CatalogueOnTheClock(client, name, deadline),
        checkpoints=CheckpointsOnTheClock(client, name, deadline),
        publish_page=broker,
        rubric_version=VERSION,
        page_size=2,
        max_pages=50,
        horizon=timedelta(days=1),
        clock=clock,
    )


async def _firings(client: Mongo, database: str) -> Firings:
    """The scheduler's firings, in the test's database."""
    firings = Firings(client, database)
    await firings.ensure_indexes()
    return firings


class Deliveries:
    """Runs one firing of the fan-out delivery after delivery, as the job consumer does."""

    def __init__(
        self, fanout: partial[Any], deadline: ClockDeadline, clock: Clock, firings: Firings
    ) -> None:
        self._fanout = fanout
        self._deadline = deadline
        self._clock = clock
        self.firings = firings
        self.decisions: list[RunDecision] = []

    async def _handler(self, run: JobRun) -> JobOutcome:
        self._deadline.begin()
        outcome: JobOutcome = await self._fanout(run)
        return outcome

    async def run_to_its_end(
        self, *, retry: RetryPolicy, db_timeout_s: float | None, limit: int = 100
    ) -> RunDecision:
        firing = await self.firings.claim(JOB, NOW, now=NOW, owner="t")
        assert firing is not None
        command = RunCronJob(task_id=firing.run_id, job=JOB, scheduled_for=NOW, fired_at=NOW)
        for _ in range(limit):
            decision = await run_cron_job(
                command,
                handlers={JOB: self._handler},
                firings=self.firings,
                retry=retry,
                clock=self._clock,
                db_timeout_s=db_timeout_s,
            )
            self.decisions.append(decision)
            if not isinstance(decision, (Continue, Retry)):
                return decision
            command = decision.command
            self._clock.now = max(self._clock.now, command.not_before or self._clock.now)
            self._clock.now += timedelta(seconds=1)
        pytest.fail(f"the run did not end in {limit} deliveries")

    @property
    def kinds(self) -> list[str]:
        return [type(decision).__name__ for decision in self.decisions]


RETRY = RetryPolicy(max_attempts=4, base=timedelta(seconds=5), cap=timedelta(seconds=600))


async def test_a_delivery_behind_a_slow_broker_stops_taking_pages_before_its_deadline(
    database: tuple[Mongo, str],
) -> None:
    """Pages confirmed in 20 s under a 60 s deadline: a delivery takes pages for half the
    deadline (two pages, 40 s) and continues in a new one. It walked on to its third page,
    failed its next database call on the deadline, and the run was given up after four
    deliveries, each of which had moved the checkpoint."""
    client, name = database
    task_ids = await _seed(client, name, 30)
    clock = Clock(NOW)
    deadline = ClockDeadline(clock, DB_TIMEOUT_S)
    broker = SlowBroker(clock)
    deliveries = Deliveries(
        _fanout(client, name, deadline, broker, clock),
        deadline,
        clock,
        await _firings(client, name),
    )

    ended = await deliveries.run_to_its_end(retry=RETRY, db_timeout_s=DB_TIMEOUT_S)

    assert isinstance(ended, Finished), deliveries.kinds
    assert deadline.met == 0
    assert set(deliveries.kinds[:-1]) == {"Continue"}, deliveries.kinds
    assert len(deliveries.decisions) == len(task_ids) // 4 + 1  # two pages of two a delivery
    assert broker.task_ids == task_ids


async def test_a_delivery_that_fails_after_moving_the_checkpoint_ends_as_a_continuation(
    database: tuple[Mongo, str],
) -> None:
    """Every third page is not confirmed: each delivery moves the checkpoint two pages, then
    fails. Counted as failed attempts, those failures gave the run up after `max_attempts`
    deliveries although every one of them moved it on."""
    client, name = database
    task_ids = await _seed(client, name, 30)
    clock = Clock(NOW)
    deadline = ClockDeadline(clock, None)
    broker = SlowBroker(clock, failing_every=3)
    deliveries = Deliveries(
        _fanout(client, name, deadline, broker, clock),
        deadline,
        clock,
        await _firings(client, name),
    )

    ended = await deliveries.run_to_its_end(retry=RETRY, db_timeout_s=None)

    assert isinstance(ended, Finished), deliveries.kinds
    assert "Retry" not in deliveries.kinds
    assert broker.task_ids == task_ids  # each once, in order
    latest = await deliveries.firings.latest(JOB)
    assert latest is not None
    assert latest.state is FiringState.SUCCEEDED


async def test_a_delivery_that_fails_before_moving_anything_is_a_counted_attempt(
    database: tuple[Mongo, str],
) -> None:
    client, name = database
    await _seed(client, name, 6)
    clock = Clock(NOW)
    deadline = ClockDeadline(clock, None)
    broker = SlowBroker(clock, failing_every=1)  # no page is ever confirmed
    deliveries = Deliveries(
        _fanout(client, name, deadline, broker, clock),
        deadline,
        clock,
        await _firings(client, name),
    )

    ended = await deliveries.run_to_its_end(retry=RETRY, db_timeout_s=None)

    assert deliveries.kinds == ["Retry", "Retry", "Retry", "GiveUp"]
    assert ended == deliveries.decisions[-1]
    assert broker.pages == []


async def test_a_delivery_takes_its_first_page_however_late_it_starts(
    database: tuple[Mongo, str],
) -> None:
    """A delivery whose time for pages is spent before its first page still takes that page:
    every delivery moves the run on."""
    client, name = database
    task_ids = await _seed(client, name, 6)
    clock = Clock(NOW)
    deadline = ClockDeadline(clock, None)
    broker = SlowBroker(clock)
    fanout = _fanout(client, name, deadline, broker, clock)
    late = JobRun("late", JOB, NOW, NOW, True, 1, work_until=NOW - timedelta(seconds=1))

    outcome: JobOutcome = await fanout(late)

    assert outcome.more is True
    assert outcome.summary["pages"] == 1
    assert broker.task_ids == task_ids[:2]
