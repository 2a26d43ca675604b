"""The re-score fan-out: walk the catalogue in pages and request a re-score of every stale task.

The cron only dispatches the work (seed 2, "check a million subscriptions"): it reads 1,000
catalogue entries at a time by keyset pagination on `_id` (never skip/offset), publishes one
`RescoreTask` per entry due a re-score with the page's publisher confirms in flight together,
then marks those entries requested and moves the run's checkpoint past the page. A page is
bounded by the entries it reads, not by the stale ones it finds (`Catalogue.scan_page`): the
checkpoint moves past a page that held none, and the run ends when a page reaches the end of
the catalogue. A run resumes from its checkpoint, so a crash re-publishes at most the page it
was on and never skips one. A run walks at most `max_pages` pages per delivery and then
continues in a new message, so no delivery stays unacknowledged for long.

A task the result cache answered (the catalogue's `cached`) is requested marked
`answered_from_cache` and reaches the gateway `CACHED_RESCORES_AFTER` later
(`services.scheduler.messaging`, counted against the backlog meanwhile): by then the task
its text was scored for has been scored again unless the scorers' backlog is longer, and
the gateway answers it from the cache without a model call. Not one leaving the horizon
within that wait (and `SENT_LATER_MARGIN`): it would reach the gateway after its submission
expired ("unknown task", never re-scored), so it goes with the others, to the scorer.

Only tasks first completed within `horizon` are due (`FANOUT_HORIZON_S`, the gateway's
`IDEMPOTENCY_TTL_S`): the gateway re-scores a task from its submission, kept that long from
when the task was due (at or before its first completion; a re-score does not extend it),
so a request for an older one was answered "unknown task" after two round trips to the
gateway's database, and counted against `FANOUT_MAX_BACKLOG` meanwhile.

A delivery also stops taking pages once its time for them is spent (`JobRun.work_until`,
half its database deadline `SCHEDULER_JOB_DB_TIMEOUT_S`, which covers the broker's waits
too): the page in hand then has the other half. Walking `max_pages` whatever the time, a
delivery behind a slow broker began a page past its deadline, failed on a healthy database,
and was counted a failed attempt.

A failure after this delivery moved the checkpoint (no room downstream, `DownstreamFull`; the
broker or the database away; the deadline) ends the delivery as a continuation rather than
a failure: the run goes on in a new slice at attempt 1, so a run that moves in every delivery
is never given up for the failures between (only a delivery that moves nothing is counted),
and its wait for room lasts up to `DOWNSTREAM_FULL_MAX_WAIT` from its last progress
(`services.scheduler.runs`), not from its firing, so a large re-score that keeps moving
behind a slow scorer is not given up. Where the run stands is then known without a read
(`Checkpoint.past_page`): after the deadline every database call fails.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from services.scheduler.catalogue import Catalogue, CompletedTask, ScannedPage
from services.scheduler.checkpoints import Checkpoint, Checkpoints
from services.scheduler.errors import DownstreamFull, PermanentJobError
from services.scheduler.jobs import Clock, JobOutcome, JobRun
from services.scheduler.messaging import CACHED_RESCORES_AFTER
from shared.contracts import RescoreTask

log = logging.getLogger("scorebox.scheduler.fanout")

PublishPage = Callable[[Sequence[RescoreTask]], Awaitable[None]]
# Out of its 10-minute wait, a request sent after the others may wait again: behind the
# score and re-score requests the fan-out's bound admits, and down the gateway's retries
# while the score queue is full. One leaving the horizon within the wait and this much more
# is sent with the others (about one in 20 of the cache's copies, with the default horizon).
SENT_LATER_MARGIN = timedelta(hours=1)


async def fan_out_rescores(
    run: JobRun,
    *,
    catalogue: Catalogue,
    checkpoints: Checkpoints,
    publish_page: PublishPage,
    rubric_version: str | None,
    page_size: int,
    max_pages: int,
    horizon: timedelta,
    clock: Clock,
) -> JobOutcome:
    if rubric_version is None:
        raise PermanentJobError("RUBRIC_VERSION is not set: no current rubric version to compare")
    position = await checkpoints.start_or_resume(
        run.run_id, job=run.job, rubric_version=rubric_version, now=clock()
    )
    if position.finished_at is not None:
        return JobOutcome(summary=position.summary())
    walk = _PageWalk(
        run=run,
        catalogue=catalogue,
        checkpoints=checkpoints,
        publish_page=publish_page,
        page_size=page_size,
        horizon=horizon,
        clock=clock,
    )
    moved = False  # whether this delivery moved the checkpoint
    for taken in range(max_pages):
        if taken and run.out_of_time(clock()):
            log.info("fan-out %s continues in a new delivery: its time is spent", run.run_id)
            break
        try:
            page = await walk.request_rescores(position)
            if page.last_id is not None and page.scanned:
                position = await walk.advance(position, last_id=page.last_id, page=page)
                moved = True
            if page.scanned < page_size:  # the end of the catalogue
                return await walk.finish()
        except PermanentJobError:
            raise
        except Exception as error:
            if not moved:
                raise
            _log_continuing_after(run, error)
            break
    return JobOutcome(summary=position.summary(), more=True)


def _log_continuing_after(run: JobRun, error: Exception) -> None:
    """Progress, then a failure (no room downstream, the broker or the database away, the
    deadline): the run goes on in a new slice, at attempt 1, whose wait for room counts from
    now. That slice's first page meets the trouble again or not; failing before it moves,
    it is counted (or waits for room) as any delivery that made no progress."""
    level = logging.INFO if isinstance(error, DownstreamFull) else logging.WARNING
    log.log(level, "fan-out %s continues after some progress: %r", run.run_id, error)


@dataclass(frozen=True, kw_only=True)
class _PageWalk:
    """The steps of one delivery of a fan-out, page by page."""

    run: JobRun
    catalogue: Catalogue
    checkpoints: Checkpoints
    publish_page: PublishPage
    page_size: int
    horizon: timedelta
    clock: Clock

    async def request_rescores(self, position: Checkpoint) -> ScannedPage:
        """Read the page after `position`, request a re-score of its entries due one (the
        version the run started with), and mark them requested."""
        version = position.rubric_version
        completed_since = self.clock() - self.horizon
        page = await self.catalogue.scan_page(
            after=position.last_id,
            current_version=version,
            completed_since=completed_since,
            limit=self.page_size,
        )
        if page.due:
            await self.publish_page(
                [
                    RescoreTask.for_task(
                        task_id=task.task_id,
                        tenant_id=task.tenant_id,
                        rubric_version=version,
                        previous_rubric_version=task.rubric_version,
                        model=task.model,
                        run_id=self.run.run_id,
                        generation=task.generation,
                        answered_from_cache=_sent_later(task, completed_since=completed_since),
                    )
                    for task in page.due
                ]
            )
            await self.catalogue.mark_rescore_requested(
                [task.task_id for task in page.due], version
            )
        return page

    async def advance(self, position: Checkpoint, *, last_id: str, page: ScannedPage) -> Checkpoint:
        """Move the checkpoint past `page`, which ends at `last_id`; where the run stands then."""
        published, scanned = len(page.due), page.scanned
        await self.checkpoints.advance(
            self.run.run_id,
            last_id=last_id,
            published=published,
            scanned=scanned,
            now=self.clock(),
        )
        return position.past_page(last_id=last_id, published=published, scanned=scanned)

    async def finish(self) -> JobOutcome:
        finished = await self.checkpoints.finish(self.run.run_id, now=self.clock())
        log.info("fan-out %s finished: %s", self.run.run_id, finished.summary())
        return JobOutcome(summary=finished.summary())


def _sent_later(task: CompletedTask, *, completed_since: datetime) -> bool:
    """Whether the task's request is sent after the others (`answered_from_cache`): one the
    cache answered, unless it leaves the horizon (first completed before `completed_since`)
    within that wait and `SENT_LATER_MARGIN`."""
    counted_from = task.horizon_counts_from
    return (
        task.cached and counted_from >= completed_since + CACHED_RESCORES_AFTER + SENT_LATER_MARGIN
    )
