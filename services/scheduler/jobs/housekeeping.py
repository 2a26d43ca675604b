"""Housekeeping: expire the scheduler's own records, ask the other services to clean up
theirs, and report dead letters.

- Own records: final firings older than the retention (each job's latest scheduled firing is
  kept: it is the schedule's cursor), raw usage records already rolled up and past their
  retention, finished fan-out checkpoints, catalogue entries of long-completed tasks. Runs of
  jobs that allow overlapping runs and have been silent longer than `SCHEDULER_RUN_STALE_S`
  are recorded failed first (a leased run is taken over by its job's next run instead).
- Other services' records (idempotency keys, leases) live in their databases and expire
  there by TTL indexes; this job never touches another database. It publishes
  `HousekeepingRequested` (`ops.housekeeping`) that a service may act on.
- Dead letters: the depth of every work queue's DLQ (a passive declare) and the age of its
  oldest dead letter (the head, read and returned unacknowledged: see
  `SchedulerBus.dead_letter_depth`). At or above the threshold: a warning in the log and a
  `DeadLetterAlert` (`ops.alert.dead-letters`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta

from services.scheduler.catalogue import Catalogue
from services.scheduler.checkpoints import Checkpoints
from services.scheduler.config import HousekeepingConfig
from services.scheduler.firings import Firings
from services.scheduler.jobs import Clock, JobOutcome, JobRun
from services.scheduler.metering import day_of
from services.scheduler.usage_store import UsageRecords
from shared.contracts import DeadLetterAlert, DeadLetterDepth, HousekeepingRequested
from shared.topology import WorkQueue

log = logging.getLogger("scorebox.scheduler.housekeeping")

DepthProbe = Callable[[WorkQueue], Awaitable[tuple[int, float | None]]]
Announce = Callable[[HousekeepingRequested | DeadLetterAlert], Awaitable[None]]


async def dead_letter_report(
    work_queues: Sequence[WorkQueue], *, probe: DepthProbe, threshold: int
) -> list[DeadLetterDepth]:
    report = []
    for work_queue in work_queues:
        depth, oldest_age_s = await probe(work_queue)
        report.append(
            DeadLetterDepth(
                queue=work_queue.name,
                dead_letter_queue=work_queue.dead_letter_routing_key,
                depth=depth,
                threshold=threshold,
                oldest_age_s=oldest_age_s,
            )
        )
    return report


async def keep_house(
    run: JobRun,
    *,
    firings: Firings,
    records: UsageRecords,
    catalogue: Catalogue,
    checkpoints: Checkpoints,
    job_names: Sequence[str],
    scheduled_jobs: Sequence[str],
    work_queues: Sequence[WorkQueue],
    probe: DepthProbe,
    announce: Announce,
    config: HousekeepingConfig,
    usage_retention: timedelta,
    catalogue_retention: timedelta,
    stale_after: timedelta,
    clock: Clock,
) -> JobOutcome:
    now = clock()
    # The report first: a delete that fails (a day of records too big for the deadline) fails
    # the run, and with the report after it no alert went out while that lasted.
    report = await dead_letter_report(
        work_queues, probe=probe, threshold=config.dead_letter_threshold
    )
    over = [entry for entry in report if entry.depth >= entry.threshold]
    if over:
        log.warning(
            "dead letters waiting: %s",
            ", ".join(f"{entry.dead_letter_queue}={entry.depth}" for entry in over),
        )
        await announce(DeadLetterAlert(task_id=run.run_id, queues=over))
    abandoned = await firings.abandon_silent(
        silent_since=now - stale_after,
        now=now,
        reason=f"abandoned: no sign of progress for longer than SCHEDULER_RUN_STALE_S "
        f"({stale_after.total_seconds():g} s); its message was lost",
        scheduled=scheduled_jobs,
    )
    firing_cutoff = now - timedelta(days=config.firing_retention_days)
    cursors = await firings.last_scheduled_ids(job_names, not_after=now)
    deleted = {
        "firings": await firings.delete_finished_before(firing_cutoff, keep=cursors),
        "fanout_checkpoints": await checkpoints.delete_finished_before(firing_cutoff),
        "usage_records": await records.delete_rolled_up_before(day_of(now - usage_retention)),
        "completed_tasks": await catalogue.delete_completed_before(
            now - catalogue_retention, stop=lambda: run.out_of_time(clock())
        ),
    }
    await announce(HousekeepingRequested(task_id=run.run_id, scheduled_for=run.scheduled_for))
    return JobOutcome(
        summary={
            "abandoned_runs": abandoned,
            "deleted": deleted,
            "dead_letters": [
                {"queue": entry.dead_letter_queue, "depth": entry.depth} for entry in report
            ],
            "alerted": [entry.dead_letter_queue for entry in over],
        }
    )
