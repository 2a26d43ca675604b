"""The hourly usage rollup: fold raw usage records into `usage_daily`, idempotently, a
bounded slice at a time.

One execution (one slice of a run):

1. Read the `_id`s and (tenant, day) pairs of at most `batch` (`USAGE_ROLLUP_BATCH`)
   records not yet rolled up, the first in (tenant, day, `_id`) order, and the one record
   after them. A record stored after this read is left for the next slice or run.
2. When that record is of the batch's last day (the day goes on past the batch), note that
   day owed a recount (`owe`, a new token): its records are marked in step 5 and counted by
   the slice that reads the day's last pending record, not here.
3. Read the debts of the batch's other days (their tokens), and, in the run's last slice
   (the batch not full), every day owed a recount.
4. Recompute each of those days' totals from all of its raw records (every record read in
   step 1 among them, and every record marked under a token read in step 3) and `$set` the
   daily row, unless the stored row counts more requests.
5. Mark rolled up, by `_id`, the records read in step 1 not yet marked: each was stored
   before step 4 read its day, so it is counted in its day's row (this execution's, or one
   recomputed later from more records), or its day is owed a recount (step 2). Never by a
   query that could match records stored since, which this execution did not count.
6. Settle the debts read in step 3 whose token is unchanged (`settle`): a day owed again
   since (another slice's step 2) stays owed.
7. Say `more` when step 1 found a full batch: the job framework runs the next slice of the
   run as a continuation (`runs.Continue`, a message of its own), until a slice finds fewer.
   The run's result (kept on the firing) is its last slice's summary.

Two executions at once (a duplicate delivery of a slice, a run by hand beside the hourly one)
read the same or overlapping batches, and each counts and marks what it read: work done
twice, nothing marked uncounted, and each moves on. (The rollup used to tag the records with
a tag of each execution's own, mark those still carrying it, and take over any other's tags:
in slices, two executions kept re-tagging each other's batch between tagging and marking, and
neither ever marked anything.) A slice that dies before step 5 leaves its records pending:
its retry, or the next run, reads them again and recomputes the same rows. One that dies
later leaves each of its days counted or owed a recount, which a later slice settles (the one
that reads the day's last pending record, or a run's last). Running it twice gives the same
totals. A pair whose day is older than the raw-record retention cannot be recomputed in full
(housekeeping deleted its older records), so it is left as it is and only marked, and a debt
of such a day is forgotten.

Why the run's last slice recounts every owed day: a day is settled by the slice that reads
its last pending record, but that slice may be another execution's, which read the debts
before this one noted its own (step 2) and cannot settle it; nothing pending is left of the
day to bring a later slice to it. Such leftovers are rare (races, a slice that died after
step 5), and each is recounted once by the end of the run that follows.

Slices, because a delivery's database work runs under `SCHEDULER_JOB_DB_TIMEOUT_S`: after a
long outage of the scheduler (or on a huge day) one `update_many` over every pending record
(millions) never finished within it, every retry failed alike, and the rollup never moved. A
slice's read and marking are bounded by the batch; its recomputation is not (one indexed
aggregation per pair, over all of that day's raw records).

What that costs: each day is recomputed in full once, by the slice that holds its last
pending record. In (tenant, day) order a slice takes whole days one after another; only its
last day may go on into the next slice, which recounts it. A day of n pending records spans
about n / batch slices, and all but the last of them only read and mark its records: about
2n record reads in all. When each slice recomputed every day it touched, a day of a million
records was read 50 times at 20,000 a slice: n² / batch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta

from pymongo.errors import PyMongoError

from services.scheduler.jobs import Clock, JobOutcome, JobRun
from services.scheduler.metering import day_of
from services.scheduler.usage_store import DailyUsageStore, TenantDay, UsageRecords
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
    more = len(pending.ids) >= batch
    horizon = day_of(clock() - retention)
    recomputable = [pair for pair in pending.days if pair.day >= horizon]
    if too_old := [pair for pair in pending.days if pair.day < horizon]:
        log.warning(
            "usage rollup: %d (tenant, day) pair(s) older than %s got late records and are "
            "not recomputed (their raw records are past retention)",
            len(too_old),
            horizon,
        )
    continued = pending.continued if pending.continued in recomputable else None
    if continued is not None:
        await records.owe(continued, now=clock())
    finished = [pair for pair in recomputable if pair != continued]
    owed = await records.owed(finished) if more else await records.all_owed()
    if forgotten := sorted(pair for pair in owed if pair.day < horizon):
        log.warning(
            "usage rollup: %d (tenant, day) pair(s) owed a recount are older than %s and are "
            "not recomputed (their raw records are past retention)",
            len(forgotten),
            horizon,
        )
    recount = sorted({*finished, *(pair for pair in owed if pair.day >= horizon)})
    rows = await records.totals(recount)
    await daily.save(rows, now=clock())
    marked = await records.mark_rolled_up(pending.ids, by=execution)
    await _settled(records, owed, run)
    summary = {
        # The records this slice took (the name the rollup's results have always used).
        "tagged": len(pending.ids),
        "rolled_up": marked,
        "days": len(rows),
        "too_old": len(too_old),
    }
    note = " (a full batch: more to come)" if more else ""
    if continued is not None:
        note = f" (a full batch ending inside {continued.tenant_id} {continued.day}: more to come)"
    log.info("usage rollup %s, slice %d: %s%s", run.run_id, run.slice, summary, note)
    return JobOutcome(summary=summary, more=more)


async def _settled(records: UsageRecords, owed: Mapping[TenantDay, str], run: JobRun) -> None:
    """Forget the debts recounted, best effort: a failure leaves them owed, and a later slice
    recounts those days again, harmlessly. Raised, it failed a slice whose records were
    marked already: its retry found none pending and the run reported nothing rolled up
    (found by a walkthrough)."""
    try:
        await records.settle(owed)
    except PyMongoError as error:
        log.warning(
            "usage rollup %s, slice %d: %d recounted day(s) stay owed a recount: %r",
            run.run_id,
            run.slice,
            len(owed),
            error,
        )
