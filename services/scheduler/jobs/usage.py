"""The hourly usage rollup: fold raw usage records into `usage_daily`, idempotently.

1. Tag every record not yet rolled up with a tag of this execution's own (a record stored
   after this step is left for the next run). Of the run's id alone: a duplicate delivery of
   the run, executing at the same time, tagged the records stored meanwhile with the same
   tag, and this execution then marked them rolled up without having counted them.
2. Find the (tenant, day) pairs among the tagged records.
3. Recompute each pair's totals from all of its raw records and `$set` the daily row.
4. Mark the records still carrying this execution's tag rolled up (another execution that
   tagged them since counts them).

A run that dies anywhere leaves its records untagged-or-pending; the next run takes them
over and recomputes the same rows. Running it twice gives the same totals. A pair whose day
is older than the raw-record retention cannot be recomputed in full (housekeeping deleted
its older records), so it is left as it is and only marked.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from services.scheduler.jobs import Clock, JobOutcome, JobRun
from services.scheduler.metering import day_of
from services.scheduler.usage_store import DailyUsageStore, UsageRecords
from shared.contracts import new_id

log = logging.getLogger("scorebox.scheduler.usage")


async def roll_up_usage(
    run: JobRun,
    *,
    records: UsageRecords,
    daily: DailyUsageStore,
    retention: timedelta,
    clock: Clock,
) -> JobOutcome:
    tag = f"{run.run_id}/{new_id()[:12]}"
    tagged = await records.claim_pending(tag)
    days = await records.claimed_days(tag)
    horizon = day_of(clock() - retention)
    recomputable = [pair for pair in days if pair.day >= horizon]
    if too_old := [pair for pair in days if pair.day < horizon]:
        log.warning(
            "usage rollup: %d (tenant, day) pair(s) older than %s got late records and are "
            "not recomputed (their raw records are past retention)",
            len(too_old),
            horizon,
        )
    rows = await records.totals(recomputable)
    await daily.save(rows, now=clock())
    marked = await records.mark_rolled_up(tag)
    return JobOutcome(
        summary={"tagged": tagged, "rolled_up": marked, "days": len(rows), "too_old": len(too_old)}
    )
