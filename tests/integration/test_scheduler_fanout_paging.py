"""The re-score fan-out's pages, on the database (the stand-in or MongoDB), without a broker.

- A page is bounded by the catalogue entries it reads, not by the stale ones it finds: where
  stale tasks are sparse (the daily run, after a full pass) a page asked for the next 1,000
  stale entries read the whole catalogue in one query, beyond any deadline, and the run never
  got past it. Now each read names only an `_id` range and a limit, and the checkpoint moves
  past a page that held no stale task.
- Only tasks completed within the horizon (`FANOUT_HORIZON_S`, the gateway's
  `IDEMPOTENCY_TTL_S`) are requested: the gateway answers older ones "unknown task".
- Behind a slow scorer, a run that keeps moving is not given up 6 hours after it fired: it
  waits for room for 6 hours from its last progress (`services.scheduler.runs`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import pytest
from pymongo import AsyncMongoClient, monitoring

from services.scheduler.catalogue import Catalogue, CompletedTask
from services.scheduler.checkpoints import Checkpoints
from services.scheduler.errors import DownstreamFull
from services.scheduler.firings import Firings
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.jobs.fanout import SENT_LATER_MARGIN, fan_out_rescores
from services.scheduler.messaging import CACHED_RESCORES_AFTER
from services.scheduler.runs import (
    DOWNSTREAM_FULL_MAX_WAIT,
    Continue,
    Finished,
    Retry,
    RetryPolicy,
    run_cron_job,
)
from shared.contracts import RescoreTask, RunCronJob
from tests.unit.test_scheduler_dispatch import Clock

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
HORIZON = timedelta(days=1)
VERSION = "v2"
JOB = "rescore-fanout"
Mongo = AsyncMongoClient[dict[str, Any]]


class CatalogueReads(monitoring.CommandListener):
    """The `find` commands sent to the catalogue."""

    def __init__(self) -> None:
        self.finds: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "find" and event.command.get("find") == "completed_tasks":
            self.finds.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


class NotedCheckpoints(Checkpoints):
    """The real checkpoints, noting each page the run moved past."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pages: list[tuple[str, int, int]] = []  # (last_id, published, scanned)

    async def advance(
        self, run_id: str, *, last_id: str, published: int, scanned: int, now: datetime
    ) -> None:
        self.pages.append((last_id, published, scanned))
        await super().advance(
            run_id, last_id=last_id, published=published, scanned=scanned, now=now
        )


class Published:
    """Records the pages; with `room`, refuses a page (`DownstreamFull`) once it is spent."""

    def __init__(self, room: int | None = None) -> None:
        self.pages: list[list[str]] = []
        self.sent_later: list[str] = []  # marked `answered_from_cache`
        self.room = room

    async def __call__(self, page: Sequence[RescoreTask]) -> None:
        if self.room is not None:
            if self.room <= 0:
                raise DownstreamFull("the scorers' backlog is full")
            self.room -= 1
        self.pages.append([task.task_id for task in page])
        self.sent_later += [task.task_id for task in page if task.answered_from_cache]

    @property
    def task_ids(self) -> list[str]:
        return [task_id for page in self.pages for task_id in page]


@pytest.fixture
async def database(mongo: Any, db_prefix: str) -> AsyncIterator[tuple[Mongo, str, CatalogueReads]]:
    reads = CatalogueReads()
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True, event_listeners=[reads])
    try:
        yield client, f"{db_prefix}{uuid.uuid4().hex[:6]}_scheduler", reads
    finally:
        await client.close()


async def _seed(
    client: Mongo, database: str, rows: Sequence[tuple[str, str | None, datetime]]
) -> None:
    await client[database]["completed_tasks"].insert_many(
        [
            {
                "_id": task_id,
                "tenant_id": "acme",
                "generation": 0,
                "completed_at": completed_at,
                "model": "m",
                "rubric_version": version,
            }
            for task_id, version, completed_at in rows
        ]
    )


def _delivery(
    client: Mongo,
    database: str,
    checkpoints: Checkpoints,
    published: Published,
    *,
    page_size: int,
    max_pages: int,
    clock: Clock,
) -> partial[Any]:
    return partial(
        fan_out_rescores,
        catalogue=Catalogue(client, database),
        checkpoints=checkpoints,
        publish_page=published,
        rubric_version=VERSION,
        page_size=page_size,
        max_pages=max_pages,
        horizon=HORIZON,
        clock=clock,
    )


async def _run_to_the_end(handler: partial[Any], run: JobRun) -> list[JobOutcome]:
    outcomes = [await handler(run)]
    while outcomes[-1].more:
        outcomes.append(await handler(run))
    return outcomes


async def test_sparse_stale_tasks_are_paged_by_the_entries_read(
    database: tuple[Mongo, str, CatalogueReads],
) -> None:
    client, name, reads = database
    page_size, count = 20, 500
    rows = [
        (f"task-{i:05d}", None if i % 50 == 7 else VERSION, NOW - timedelta(hours=1))
        for i in range(count)
    ]
    await _seed(client, name, rows)
    stale = [task_id for task_id, version, _ in rows if version is None]
    checkpoints, published = NotedCheckpoints(client, name), Published()
    fanout = _delivery(
        client, name, checkpoints, published, page_size=page_size, max_pages=3, clock=Clock(NOW)
    )
    run = JobRun("sparse", JOB, NOW, NOW, True, 1)
    reads.finds.clear()

    first = await fanout(run)

    # Three pages of 20 entries read: two stale tasks among them, not three pages of stale ones.
    assert first.more is True
    assert first.summary["last_id"] == "task-00059"
    assert first.summary["scanned"] == 3 * page_size
    assert published.task_ids == ["task-00007", "task-00057"]
    # The page without a stale task moved the run on all the same.
    assert checkpoints.pages[1] == ("task-00039", 0, page_size)

    outcomes = [first, *await _run_to_the_end(fanout, run)]

    assert outcomes[-1].more is False
    assert published.task_ids == stale  # every stale task once, in order
    final = await checkpoints.find("sparse")
    assert final is not None
    assert final.finished_at is not None
    assert (final.published, final.scanned, final.pages) == (len(stale), count, count // page_size)
    # Each read names an `_id` range and a limit, nothing else: the server reads at most a
    # page of the `_id` index whatever it finds.
    assert len(reads.finds) == count // page_size + 1  # the last one found the end
    for find in reads.finds:
        assert set(find.get("filter", {})) <= {"_id"}, find
        assert find["limit"] == page_size, find
    marked = await client[name]["completed_tasks"].count_documents(
        {"rescore_requested_for": VERSION}
    )
    assert marked == len(stale)

    # Requested once per version: a later run reads everything again and requests nothing.
    again = await _run_to_the_end(fanout, JobRun("daily", JOB, NOW, NOW, False, 1))
    assert again[-1].summary["published"] == 0
    assert again[-1].summary["scanned"] == count
    assert published.task_ids == stale


async def test_a_catalogue_without_stale_tasks_is_walked_to_its_end(
    database: tuple[Mongo, str, CatalogueReads],
) -> None:
    """The run ends when a page reaches the end of the catalogue, even if no page ever held
    a stale task (it used to end only on a page shorter than a page of stale tasks)."""
    client, name, _ = database
    rows = [(f"task-{i:05d}", VERSION, NOW) for i in range(45)]
    await _seed(client, name, rows)
    checkpoints, published = NotedCheckpoints(client, name), Published()
    fanout = _delivery(
        client, name, checkpoints, published, page_size=10, max_pages=2, clock=Clock(NOW)
    )

    outcomes = await _run_to_the_end(fanout, JobRun("current", JOB, NOW, NOW, True, 1))

    assert len(outcomes) == 3  # 10 + 10, 10 + 10, then 5: the end
    assert outcomes[-1].summary["finished"] is True
    assert outcomes[-1].summary["last_id"] == "task-00044"
    assert published.pages == []
    assert [scanned for _, _, scanned in checkpoints.pages] == [10, 10, 10, 10, 5]


async def test_tasks_completed_before_the_horizon_are_not_requested(
    database: tuple[Mongo, str, CatalogueReads],
) -> None:
    """The gateway keeps a submission `IDEMPOTENCY_TTL_S` from when the task was due, at or
    before its completion: a task completed before the horizon is one the gateway no longer
    knows, and each request for it was answered "unknown task" after two round trips to its
    database, counted against `FANOUT_MAX_BACKLOG` meanwhile."""
    client, name, _ = database
    ages = {
        "a-year-old": timedelta(days=364),
        "b-two-days-old": timedelta(days=2),
        "c-a-day-and-a-minute-old": timedelta(days=1, minutes=1),
        "d-a-day-old": timedelta(days=1),
        "e-an-hour-old": timedelta(hours=1),
    }
    await _seed(client, name, [(task_id, None, NOW - age) for task_id, age in ages.items()])
    checkpoints, published = NotedCheckpoints(client, name), Published()
    fanout = _delivery(
        client, name, checkpoints, published, page_size=2, max_pages=10, clock=Clock(NOW)
    )

    outcomes = await _run_to_the_end(fanout, JobRun("horizon", JOB, NOW, NOW, True, 1))

    assert published.task_ids == ["d-a-day-old", "e-an-hour-old"]
    assert outcomes[-1].summary["published"] == 2
    assert outcomes[-1].summary["scanned"] == len(ages)
    requested = client[name]["completed_tasks"].find({"rescore_requested_for": VERSION})
    assert [document["_id"] async for document in requested] == ["d-a-day-old", "e-an-hour-old"]


async def test_a_task_the_cache_answered_leaving_the_horizon_in_its_wait_goes_now(
    database: tuple[Mongo, str, CatalogueReads],
) -> None:
    """The request of a task the cache answered is sent 10 minutes after the others: one
    leaving the horizon meanwhile reached the gateway after its submission expired, "unknown
    task", and was never re-scored. One leaving within the wait and `SENT_LATER_MARGIN` (it
    may wait again, behind the backlog) goes with the others, to the scorer; the horizon
    counts from a task's first completion, a re-score's being later."""
    client, name, _ = database
    leaves_in = CACHED_RESCORES_AFTER + SENT_LATER_MARGIN
    first_completed = {
        "a-leaving-within-the-wait-and-margin": NOW - HORIZON + leaves_in - timedelta(minutes=1),
        "b-leaving-after-them": NOW - HORIZON + leaves_in + timedelta(minutes=1),
        "c-re-scored-an-hour-ago-leaving-soon": NOW - HORIZON + timedelta(minutes=5),
    }
    await _insert(
        client,
        name,
        [
            {
                "_id": task_id,
                "cached": True,
                "completed_at": NOW - timedelta(hours=1) if task_id.startswith("c") else first,
                "first_completed_at": first,
            }
            for task_id, first in first_completed.items()
        ],
    )
    published = Published()

    await _run_to_the_end(_fan_out(client, name, published), JobRun("w", JOB, NOW, NOW, True, 1))

    assert published.task_ids == list(first_completed)
    assert published.sent_later == ["b-leaving-after-them"]


async def test_a_re_scored_task_leaves_the_horizon_with_its_submission(
    database: tuple[Mongo, str, CatalogueReads],
) -> None:
    """The gateway keeps a submission from when its task was due, at or before its first
    completion, and a re-score does not extend it: counted from the latest generation's
    completion, a task re-scored late in its life was requested for up to a day after the
    gateway had let it go. An entry recorded before the first completion was kept counts
    from its completion."""
    client, name, _ = database
    await _insert(
        client,
        name,
        [
            {
                "_id": "a-re-scored-first-completed-before-the-horizon",
                "completed_at": NOW - timedelta(hours=1),
                "first_completed_at": NOW - HORIZON - timedelta(minutes=1),
            },
            {
                "_id": "b-re-scored-first-completed-within-it",
                "completed_at": NOW - timedelta(hours=1),
                "first_completed_at": NOW - HORIZON + timedelta(minutes=1),
            },
            {"_id": "c-recorded-by-an-earlier-build", "completed_at": NOW - timedelta(hours=1)},
        ],
    )
    published = Published()

    await _run_to_the_end(_fan_out(client, name, published), JobRun("h", JOB, NOW, NOW, True, 1))

    assert published.task_ids == [
        "b-re-scored-first-completed-within-it",
        "c-recorded-by-an-earlier-build",
    ]


async def test_the_catalogue_keeps_a_task_s_first_completion(
    database: tuple[Mongo, str, CatalogueReads],
) -> None:
    """Whatever the order its generations' events arrive in (an older one recorded after a
    newer one is refused, but its completion still counts), and for an entry an earlier
    build recorded (its `completed_at` the first). Every value is stored as given: a model
    named like a field path (`$…`) is no path in the update pipeline."""
    client, name, _ = database
    catalogue = Catalogue(client, name)
    first, rescored = NOW - timedelta(hours=20), NOW - timedelta(hours=1)

    def generation(n: int, task_id: str) -> CompletedTask:
        return CompletedTask(task_id, "acme", n, (first, rescored)[n], "$model", None, True)

    assert await catalogue.record(generation(0, "in-order"))
    assert await catalogue.record(generation(1, "in-order"))
    assert await catalogue.record(generation(1, "out-of-order"))
    assert not await catalogue.record(generation(0, "out-of-order"))
    await _insert(client, name, [{"_id": "earlier-build", "completed_at": first}])
    assert await catalogue.record(generation(1, "earlier-build"))

    entries = [d async for d in client[name]["completed_tasks"].find().sort("_id")]
    assert [e["_id"] for e in entries] == ["earlier-build", "in-order", "out-of-order"]
    for entry in entries:
        assert (entry["generation"], entry["completed_at"]) == (1, rescored)
        assert (entry["first_completed_at"], entry["model"]) == (first, "$model")


async def _insert(client: Mongo, database: str, entries: Sequence[dict[str, Any]]) -> None:
    """Catalogue entries of stale tasks: each `entries` item over the defaults."""
    defaults = {"tenant_id": "acme", "generation": 0, "model": "m", "rubric_version": None}
    await client[database]["completed_tasks"].insert_many([defaults | entry for entry in entries])


def _fan_out(client: Mongo, database: str, published: Published) -> partial[Any]:
    checkpoints = NotedCheckpoints(client, database)
    return _delivery(
        client, database, checkpoints, published, page_size=10, max_pages=10, clock=Clock(NOW)
    )


async def test_no_room_after_progress_continues_the_run_and_none_at_all_waits(
    database: tuple[Mongo, str, CatalogueReads],
) -> None:
    client, name, _ = database
    await _seed(client, name, [(f"task-{i:05d}", None, NOW) for i in range(10)])
    checkpoints, published = NotedCheckpoints(client, name), Published(room=2)
    fanout = _delivery(
        client, name, checkpoints, published, page_size=2, max_pages=50, clock=Clock(NOW)
    )
    run = JobRun("full", JOB, NOW, NOW, True, 1)

    moved = await fanout(run)  # two pages, then no room: progress, to be continued
    assert moved.more is True
    assert moved.summary["last_id"] == "task-00003"
    with pytest.raises(DownstreamFull):  # no room and no progress: the run waits
        await fanout(run)
    published.room = None
    await _run_to_the_end(fanout, run)
    assert published.task_ids == [f"task-{i:05d}" for i in range(10)]


async def test_a_rescore_that_keeps_moving_behind_a_slow_scorer_is_not_given_up(
    database: tuple[Mongo, str, CatalogueReads],
) -> None:
    """The scorers make room for one page per back-off (10 minutes): the run takes longer
    than `DOWNSTREAM_FULL_MAX_WAIT` from its firing, moving all the while. Counted from the
    firing, it was given up 6 hours after it fired, two thirds of the way through."""
    client, name, _ = database
    pages = 54  # 9 hours of back-offs
    await _seed(client, name, [(f"task-{i:05d}", None, NOW) for i in range(pages)])
    clock = Clock(NOW)
    checkpoints, published = NotedCheckpoints(client, name), Published(room=1)
    fanout = _delivery(client, name, checkpoints, published, page_size=1, max_pages=50, clock=clock)
    policy = RetryPolicy(max_attempts=4, base=timedelta(seconds=5), cap=timedelta(minutes=10))
    firings = Firings(client, name)
    await firings.ensure_indexes()
    firing = await firings.claim(JOB, NOW, now=NOW, owner="a")
    assert firing is not None
    command = RunCronJob(task_id=firing.run_id, job=JOB, scheduled_for=NOW, fired_at=NOW)

    for _ in range(4 * pages):
        decision = await run_cron_job(
            command, handlers={JOB: fanout}, firings=firings, retry=policy, clock=clock
        )
        match decision:
            case Continue(command=following):
                command = following
            case Retry(command=following):
                assert following.not_before is not None
                clock.now = following.not_before  # the back-off passes; a page drains
                published.room = 1
                command = following
            case Finished():
                break
            case _:
                pytest.fail(f"the run ended as {decision!r} at {clock.now - NOW} after firing")

    assert isinstance(decision, Finished)
    assert clock.now - NOW > DOWNSTREAM_FULL_MAX_WAIT
    assert published.task_ids == [f"task-{i:05d}" for i in range(pages)]
