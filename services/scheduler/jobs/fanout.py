"""The re-score fan-out: walk the catalogue in pages and request a re-score of every stale task.

The cron only dispatches the work (seed 2, "check a million subscriptions"): it reads 1,000
catalogue entries at a time by keyset pagination on `_id` (never skip/offset), publishes one
`RescoreTask` per entry with the page's publisher confirms in flight together, then marks the
entries requested and moves the run's checkpoint past the page. A run resumes from its
checkpoint, so a crash re-publishes at most the page it was on and never skips one. A run
walks at most `max_pages` pages per delivery and then continues in a new message, so no
delivery stays unacknowledged for long.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from services.scheduler.catalogue import Catalogue
from services.scheduler.checkpoints import Checkpoints
from services.scheduler.errors import PermanentJobError
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
    for _ in range(max_pages):
        page = await catalogue.stale_page(after=last_id, current_version=version, limit=page_size)
        if page:
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
                    for task in page
                ]
            )
            await catalogue.mark_rescore_requested([task.task_id for task in page], version)
            last_id = page[-1].task_id
            await checkpoints.advance(run.run_id, last_id=last_id, published=len(page), now=clock())
        if len(page) < page_size:
            finished = await checkpoints.finish(run.run_id, now=clock())
            log.info("fan-out %s finished: %s", run.run_id, finished.summary())
            return JobOutcome(summary=finished.summary())
    current = await checkpoints.find(run.run_id)
    summary = current.summary() if current is not None else {}
    return JobOutcome(summary=summary, more=True)
