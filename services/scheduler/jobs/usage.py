"""The hourly usage rollup: fold raw usage records into `usage_daily`, idempotently, a
bounded slice at a time.

One execution (one slice of a run):

1. Read the `_id`s and (tenant, day) pairs of at most `batch` (`USAGE_ROLLUP_BATCH`)
   records not yet rolled up, the first in (tenant, day, `_id`) order. A record stored after
   this read is left for the next slice or run.
2. Recompute each of those pairs' totals from all of its raw records (every record read in
   step 1 among them) and `$set` the daily row, unless the stored row counts more requests.
3. Mark rolled up, by `_id`, the records read in step 1 not yet marked: each was stored
   before step 2 read its day, so it is counted in its day's row (this execution's, or one
   recomputed later from more records). Never by a query that could match records stored
   since, which this execution did not count.
4. Say `more` when step 1 found a full batch: the job framework runs the next slice of the
   run as a continuation (`runs.Continue`), until a slice finds fewer. The run's result (kept
   on the firing) is its last slice's summary.

Two executions at once (a duplicate delivery of a slice, a run by hand beside the hourly one)
read the same or overlapping batches, and each counts and marks what it read: work done
twice, nothing marked uncounted, and each moves on. (The rollup used to tag the records with
a tag of each execution's own, mark those still carrying it, and take over any other's tags:
in slices, two executions kept re-tagging each other's batch between tagging and marking, and
neither ever marked anything.) A slice that dies anywhere leaves its records pending; its
retry, or the next run, reads them again and recomputes the same rows. Running it twice gives
the same totals. A pair whose day is older than the raw-record retention cannot be recomputed
in full (housekeeping deleted its older records), so it is left as it is and only marked.

Slices, because a delivery's database work runs under `SCHEDULER_JOB_DB_TIMEOUT_S`: after a
long outage of the scheduler (or on a huge day) one `update_many` over every pending record
(millions) never finished within it, every retry failed alike, and the rollup never moved. A
slice's read and marking are bounded by the batch; its recomputation is not (one indexed
aggregation per pair, over all of that day's raw records).

What that costs: each slice recomputes its days in full, so a slice that dies leaves nothing
half-counted. In (tenant, day) order a slice takes whole days one after another; only its
first and last day may also be in a neighbouring slice, and be recomputed once more. A day of
n pending records, though, spans about n / batch slices, and each reads all of the day's
records stored by then: up to n² / batch records read in all (all of them stored already, as
after an outage) instead of n. A day of a million records at 20,000 a slice: 50 aggregations
of that day, each over a million records. A smaller batch makes each slice quicker and a big
day dearer.
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
    batch: int,
) -> JobOutcome:
    """One slice of the rollup: at most `batch` records; `more` when there may be others."""
    execution = f"{run.run_id}/{new_id()[:12]}"
    pending = await records.pending_batch(batch)
    horizon = day_of(clock() - retention)
    recomputable = [pair for pair in pending.days if pair.day >= horizon]
    if too_old := [pair for pair in pending.days if pair.day < horizon]:
        log.warning(
            "usage rollup: %d (tenant, day) pair(s) older than %s got late records and are "
            "not recomputed (their raw records are past retention)",
            len(too_old),
            horizon,
        )
    rows = await records.totals(recomputable)
    await daily.save(rows, now=clock())
    marked = await records.mark_rolled_up(pending.ids, by=execution)
    more = len(pending.ids) >= batch
    summary = {
        # The records this slice took (the name the rollup's results have always used).
        "tagged": len(pending.ids),
        "rolled_up": marked,
        "days": len(rows),
        "too_old": len(too_old),
    }
    log.info(
        "usage rollup %s, slice %d: %s%s",
        run.run_id,
        run.slice,
        summary,
        " (a full batch: more to come)" if more else "",
    )
    return JobOutcome(summary=summary, more=more)
