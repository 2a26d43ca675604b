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

Only tasks completed within `horizon` are due (`FANOUT_HORIZON_S`, the gateway's
`IDEMPOTENCY_TTL_S`): the gateway re-scores a task from its submission, kept that long from
when the task was due, so a request for an older one was answered "unknown task" after two
round trips to the gateway's database, and counted against `FANOUT_MAX_BACKLOG` meanwhile.

No room downstream (`DownstreamFull`) after this delivery moved the checkpoint ends the
delivery as a continuation rather than a failure: its run waits for room for up to
`DOWNSTREAM_FULL_MAX_WAIT` from its last progress (`services.scheduler.runs`), not from its
firing, so a large re-score that keeps moving behind a slow scorer is not given up.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta

from services.scheduler.catalogue import Catalogue
from services.scheduler.checkpoints import Checkpoints
from services.scheduler.errors import DownstreamFull, PermanentJobError
from services.scheduler.jobs import Clock, JobOutcome, JobRun
from shared.contracts import RescoreTask

log = logging.getLogger("scorebox.scheduler.fanout")

PublishPage = Callable[[Sequence[RescoreTask]], Awaitable[None]]


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
    checkpoint = await checkpoints.start_or_resume(
        run.run_id, job=run.job, rubric_version=rubric_version, now=clock()
    )
    if checkpoint.finished_at is not None:
        return JobOutcome(summary=checkpoint.summary())
    version = checkpoint.rubric_version  # the version the run started with
    last_id = checkpoint.last_id
    moved = False  # whether this delivery moved the checkpoint
    for _ in range(max_pages):
        page = await catalogue.scan_page(
            after=last_id,
            current_version=version,
            completed_since=clock() - horizon,
            limit=page_size,
        )
        if page.due:
            try:
                await publish_page(
                    [
                        RescoreTask.for_task(
                            task_id=task.task_id,
                            tenant_id=task.tenant_id,
                            rubric_version=version,
                            previous_rubric_version=task.rubric_version,
                            model=task.model,
                            run_id=run.run_id,
                        )
                        for task in page.due
                    ]
                )
            except DownstreamFull as error:
                if not moved:
                    raise
                # Progress, then no room: the run goes on in a new slice, whose wait for
                # room counts from now (it waits in its first delivery, right away).
                log.info("fan-out %s continues after some progress: %s", run.run_id, error)
                return await _to_be_continued(run, checkpoints)
            await catalogue.mark_rescore_requested([task.task_id for task in page.due], version)
        if page.last_id is not None and page.scanned:
            last_id = page.last_id
            await checkpoints.advance(
                run.run_id,
                last_id=last_id,
                published=len(page.due),
                scanned=page.scanned,
                now=clock(),
            )
            moved = True
        if page.scanned < page_size:  # the end of the catalogue
            finished = await checkpoints.finish(run.run_id, now=clock())
            log.info("fan-out %s finished: %s", run.run_id, finished.summary())
            return JobOutcome(summary=finished.summary())
    return await _to_be_continued(run, checkpoints)


async def _to_be_continued(run: JobRun, checkpoints: Checkpoints) -> JobOutcome:
    current = await checkpoints.find(run.run_id)
    summary = current.summary() if current is not None else {}
    return JobOutcome(summary=summary, more=True)
