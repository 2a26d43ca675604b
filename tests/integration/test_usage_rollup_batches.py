"""The usage rollup works through a backlog a bounded batch at a time: one execution takes at
most `USAGE_ROLLUP_BATCH` pending records and says `more` when it found a full batch, and the
slices of a run, taken until one says no more, write exactly the daily totals of the records
(as one execution over all of them did), also with a duplicate execution racing them, and
with two chains of slices at once (which, when each execution tagged its batch and took over
the other's tags, kept re-tagging each other's batch and never marked anything).

Tagging every pending record in one `update_many` never finished within the job's database
deadline after a long outage of the scheduler (millions of records), and every retry failed
alike: the rollup never progressed.

`roll_up_usage` runs here on the real database (MongoDB or the stand-in), each test in a
database of its own (a claim reads every pending record of the database); the last test runs
it through the whole scheduler, on the real broker, the slices continued by the job
framework.

A day of more pending records than a batch spans several slices and is recomputed once, by
the slice that reads its last pending record (each slice recomputed the days it touched:
n² / batch record reads for a day of n records), also with a duplicate chain of slices, a
slice that dies or a run given up on the way, and another execution that takes the day's
last records before this one notes it owed a recount. The query plans of every command of a
roll-up are checked on MongoDB (skipped on the stand-in, which does not plan queries)."""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
from pymongo import AsyncMongoClient, monitoring
from pymongo.errors import AutoReconnect

from devtools.infra import Endpoint
from services.scheduler.app import USAGE_ROLLUP, create_app
from services.scheduler.config import parse_config
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.jobs.usage import roll_up_usage
from services.scheduler.settings import SchedulerSettings
from services.scheduler.usage_store import (
    DailyUsage,
    DailyUsageStore,
    TenantDay,
    UsageRecord,
    UsageRecords,
)
from shared.contracts import new_id
from tests.support import advancing_clock, run_cron_job_by_hand, running

if TYPE_CHECKING:
    from services.scheduler.usage_store import PendingBatch

PENDING_INDEX = "pending_by_tenant_day"

NOW = datetime(2030, 1, 10, 10, 31, 30, tzinfo=UTC)  # far from the rollup's fire time
BATCH = 50
# Records per (tenant, day): 180 in all, over three tenants and six days; some days end
# inside a batch, some span two or three.
BACKLOG = {
    ("acme", "2030-01-05"): 40,
    ("acme", "2030-01-06"): 7,
    ("acme", "2030-01-07"): 23,
    ("acme", "2030-01-09"): 10,
    ("beta", "2030-01-05"): 25,
    ("beta", "2030-01-06"): 5,
    ("beta", "2030-01-08"): 30,
    ("gamma", "2030-01-01"): 1,
    ("gamma", "2030-01-09"): 39,
}
MAX_SLICES = 20  # far more than any backlog here needs
ADMIN_KEY = "usage-batches-admin-key"
Mongo = AsyncMongoClient[dict[str, Any]]


@dataclass
class Stores:
    client: Mongo
    database: str
    daily: DailyUsageStore
    stored: list[UsageRecord]

    def records(self) -> UsageRecords:
        return UsageRecords(self.client, self.database)

    async def store_records(self, made: Sequence[UsageRecord]) -> None:
        self.stored.extend(made)
        records = self.records()
        await asyncio.gather(*(records.record(record) for record in made))

    async def store(self, backlog: dict[tuple[str, str], int]) -> None:
        records = self.records()
        made = [
            _record(tenant, day, len(self.stored) + index)
            for (tenant, day), count in backlog.items()
            for index in range(count)
        ]
        self.stored.extend(made)
        await asyncio.gather(*(records.record(record) for record in made))

    async def roll_up(
        self, run: JobRun, records: UsageRecords | None = None, *, batch: int = BATCH
    ) -> JobOutcome:
        return await roll_up_usage(
            run,
            records=records or self.records(),
            daily=self.daily,
            retention=timedelta(days=30),
            clock=lambda: NOW,
            batch=batch,
        )

    async def roll_up_to_the_end(
        self, run: JobRun, *, batch: int = BATCH, records: UsageRecords | None = None
    ) -> list[JobOutcome]:
        """The slices of `run` from its `run.slice`, as the job framework runs them: the next
        one while the last said `more`."""
        outcomes = [await self.roll_up(run, records, batch=batch)]
        while outcomes[-1].more:
            assert len(outcomes) < MAX_SLICES, [outcome.summary for outcome in outcomes]
            outcomes.append(
                await self.roll_up(_next_slice(run, len(outcomes)), records, batch=batch),
            )
        return outcomes

    async def rows(self) -> dict[TenantDay, DailyUsage]:
        found: dict[TenantDay, DailyUsage] = {}
        for tenant in {tenant for tenant, _ in BACKLOG}:
            for row in await self.daily.read(tenant, first_day="2030-01-01", last_day="2030-01-31"):
                found[TenantDay(row.tenant_id, row.day)] = row
        return found

    def expected_rows(self) -> dict[TenantDay, DailyUsage]:
        """The rows of all the records stored, summed here (what one execution over them all
        writes)."""
        by_day: dict[TenantDay, list[UsageRecord]] = defaultdict(list)
        for record in self.stored:
            by_day[TenantDay(record.tenant_id, record.day)].append(record)
        return {
            pair: DailyUsage(
                tenant_id=pair.tenant_id,
                day=pair.day,
                requests=len(records),
                prompt_tokens=sum(record.prompt_tokens for record in records),
                completion_tokens=sum(record.completion_tokens for record in records),
                cost_nanos=sum(record.cost_nanos or 0 for record in records),
                priced_requests=sum(record.cost_nanos is not None for record in records),
            )
            for pair, records in by_day.items()
        }

    async def rolled_up_ids(self) -> set[str]:
        usage = self.client[self.database]["usage_records"]
        return {
            document["_id"]
            async for document in usage.find({"rolled_up": True}, projection={"_id": True})
        }

    async def pending(self) -> int:
        usage = self.client[self.database]["usage_records"]
        return await usage.count_documents({"rolled_up": False})

    async def debts(self) -> int:
        """The (tenant, day) pairs owed a recount."""
        return await self.client[self.database]["usage_owed_days"].count_documents({})


def _record(tenant: str, day: str, number: int, *, task_id: str | None = None) -> UsageRecord:
    at = datetime.fromisoformat(f"{day}T12:00:00+00:00")
    return UsageRecord(
        task_id=task_id or new_id(),
        generation=number % 2,
        tenant_id=tenant,
        api_key_id=None,
        model="m",
        prompt_tokens=100 + number,
        completion_tokens=1 + number % 13,
        cost_nanos=None if number % 7 == 0 else 1_000 * number + 17,
        cached=False,
        day=day,
        completed_at=at,
        recorded_at=at,
    )


def _run() -> JobRun:
    return JobRun(
        run_id=new_id(),
        job=USAGE_ROLLUP,
        scheduled_for=NOW,
        fired_at=NOW,
        manual=False,
        attempt=1,
    )


def _next_slice(run: JobRun, number: int) -> JobRun:
    return JobRun(
        run_id=run.run_id,
        job=run.job,
        scheduled_for=run.scheduled_for,
        fired_at=run.fired_at,
        manual=run.manual,
        attempt=1,
        slice=run.slice + number,
    )


@pytest.fixture
async def stores(mongo: Endpoint, db_prefix: str) -> AsyncIterator[Stores]:
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    database = f"{db_prefix}{uuid.uuid4().hex[:6]}_scheduler"
    stores = Stores(client, database, DailyUsageStore(client, database), [])
    await stores.records().ensure_indexes()
    await stores.daily.ensure_indexes()
    try:
        yield stores
    finally:
        await client.drop_database(database)
        await client.close()


@pytest.mark.parametrize(
    ("batch", "tagged"),
    [
        (BATCH, [50, 50, 50, 30]),
        (60, [60, 60, 60, 0]),  # a full last batch: the next slice finds none left
        (1000, [180]),  # the whole backlog at once, as before batches
    ],
)
async def test_a_backlog_is_rolled_up_a_batch_at_a_time_to_the_exact_totals(
    stores: Stores, batch: int, tagged: list[int]
) -> None:
    await stores.store(BACKLOG)
    run = _run()

    first = await stores.roll_up(run, batch=batch)
    assert first.summary["tagged"] == first.summary["rolled_up"] == min(batch, 180)
    assert len(await stores.rolled_up_ids()) == min(batch, 180)
    assert first.more is (batch <= 180)

    rest = await stores.roll_up_to_the_end(_next_slice(run, 1), batch=batch) if first.more else []
    outcomes = [first, *rest]
    assert [outcome.summary["tagged"] for outcome in outcomes] == tagged
    assert [outcome.summary["rolled_up"] for outcome in outcomes] == tagged
    assert [outcome.more for outcome in outcomes] == [True] * (len(tagged) - 1) + [False]
    assert await stores.rows() == stores.expected_rows()
    assert await stores.pending() == 0

    # Again: nothing pending, nothing changes.
    again = await stores.roll_up(_run(), batch=batch)
    assert (again.more, again.summary["tagged"]) == (False, 0)
    assert await stores.rows() == stores.expected_rows()


async def test_a_slice_takes_the_pending_records_day_by_day(stores: Stores) -> None:
    """In (tenant, day) order, so a slice finishes the days it starts but its last: taken at
    random, the first 50 of these 180 records touch about every one of the nine days, and
    every slice recomputes them all. The last, which goes on past the batch, is counted by
    the slice that reads the rest of it."""
    await stores.store(BACKLOG)
    run = _run()

    first = await stores.roll_up(run)

    in_order = sorted(
        stores.stored, key=lambda record: (record.tenant_id, record.day, record.record_id)
    )
    days = {(record.tenant_id, record.day) for record in in_order[:BATCH]}
    assert days == {("acme", "2030-01-05"), ("acme", "2030-01-06"), ("acme", "2030-01-07")}
    assert await stores.rolled_up_ids() == {record.record_id for record in in_order[:BATCH]}
    assert first.summary["days"] == 2
    # The days it finished are final already; the one it did not is left to the next slice.
    rows, expected = await stores.rows(), stores.expected_rows()
    for pair in (TenantDay("acme", "2030-01-05"), TenantDay("acme", "2030-01-06")):
        assert rows[pair] == expected[pair]
    assert TenantDay("acme", "2030-01-07") not in rows

    second = await stores.roll_up(_next_slice(run, 1))
    rows = await stores.rows()
    assert rows[TenantDay("acme", "2030-01-07")] == expected[TenantDay("acme", "2030-01-07")]
    assert second.summary["days"] == 2  # acme's 01-07 and 01-09; beta's 01-05 goes on


class PausesAfterTotals(UsageRecords):
    """The first execution: `meanwhile` runs once it has read its totals, before it saves."""

    def __init__(self, stores: Stores, meanwhile: Callable[[], Awaitable[None]]) -> None:
        super().__init__(stores.client, stores.database)
        self._meanwhile: Callable[[], Awaitable[None]] | None = meanwhile

    async def totals(self, days: Sequence[TenantDay]) -> list[DailyUsage]:
        found = await super().totals(days)
        meanwhile, self._meanwhile = self._meanwhile, None
        if meanwhile is not None:
            await meanwhile()
        return found


class PausesAfterReading(UsageRecords):
    """The duplicate execution: reads its batch, then waits for `go` before counting."""

    def __init__(self, stores: Stores, go: asyncio.Event) -> None:
        super().__init__(stores.client, stores.database)
        self.read = asyncio.Event()
        self._go = go

    async def pending_batch(self, limit: int) -> PendingBatch:
        batch = await super().pending_batch(limit)
        self.read.set()
        return batch

    async def totals(self, days: Sequence[TenantDay]) -> list[DailyUsage]:
        await self._go.wait()
        return await super().totals(days)


# Stored while the first execution of a slice holds its totals: in a day it counted, and in
# days after its batch.
LATE = {("acme", "2030-01-05"): 3, ("acme", "2030-01-07"): 2, ("gamma", "2030-01-10"): 4}


async def test_a_duplicate_slice_running_inside_another_takes_its_records_over(
    stores: Stores,
) -> None:
    """The duplicate (a redelivery of the slice) runs to the end while the first holds
    totals read before more records arrived: it counts and marks the first's batch too, and
    the first overwrites none of its rows with the fewer records it counted."""
    await stores.store(BACKLOG)
    run = _run()
    duplicates: list[list[JobOutcome]] = []

    async def late_records_and_a_duplicate() -> None:
        await stores.store(LATE)
        duplicates.append(await stores.roll_up_to_the_end(run))

    first = await stores.roll_up(run, PausesAfterTotals(stores, late_records_and_a_duplicate))
    assert first.summary["rolled_up"] == 0  # all of its batch counted and marked since
    if first.more:
        await stores.roll_up_to_the_end(_next_slice(run, 1))

    assert sum(outcome.summary["rolled_up"] for outcome in duplicates[0]) == 180 + 9
    assert await stores.rows() == stores.expected_rows()
    assert await stores.pending() == 0


async def test_a_duplicate_slice_marks_only_what_it_read_before_counting(stores: Stores) -> None:
    """The duplicate reads its batch (the late records among it) while the first holds its
    totals, and counts it only once the first has finished: the first must not mark the late
    records, which it did not count; each marks what it read."""
    await stores.store(BACKLOG)
    run = _run()
    first_done = asyncio.Event()
    duplicate = PausesAfterReading(stores, first_done)
    later: list[asyncio.Task[JobOutcome]] = []

    async def late_records_and_a_duplicate() -> None:
        await stores.store(LATE)
        later.append(asyncio.create_task(stores.roll_up(run, duplicate)))
        await duplicate.read.wait()

    first = await stores.roll_up(run, PausesAfterTotals(stores, late_records_and_a_duplicate))
    assert await stores.pending() == 180 + 9 - BATCH  # the late ones among them
    first_done.set()
    second = await later[0]
    assert first.summary["rolled_up"] == BATCH
    # The duplicate read 43 + 7 records of the first two days: all but the 3 late ones of the
    # first day were marked by the first.
    assert second.summary["rolled_up"] == 3
    # Both go on, one after the other, as their continuations would.
    for outcome in (first, second):
        if outcome.more:
            await stores.roll_up_to_the_end(_next_slice(run, 1))

    assert await stores.rows() == stores.expected_rows()
    assert await stores.pending() == 0


async def test_two_runs_of_slices_at_once_end_with_the_exact_totals(stores: Stores) -> None:
    """A duplicate delivery that went on as a run of its own: both take slices at once
    (each interleaving with the other's at every database round trip)."""
    await stores.store(BACKLOG)
    run = _run()

    chains = await asyncio.gather(stores.roll_up_to_the_end(run), stores.roll_up_to_the_end(run))

    assert sum(outcome.summary["rolled_up"] for chain in chains for outcome in chain) == 180
    assert await stores.rows() == stores.expected_rows()
    assert await stores.pending() == 0


async def test_the_pending_records_have_an_index_of_their_own(stores: Stores) -> None:
    """A slice's read is served in its order by a partial index of the pending records alone;
    the index of the tags the rollup no longer uses is dropped from deployments that have it
    (it cost every marking a key rewrite)."""
    usage = stores.client[stores.database]["usage_records"]
    await usage.create_index([("rolled_up", 1), ("rollup_run", 1)])  # as an older release did

    await stores.records().ensure_indexes()
    await stores.records().ensure_indexes()  # start-up runs it every time

    indexes = {index["name"]: index async for index in await usage.list_indexes()}
    assert "rolled_up_1_rollup_run_1" not in indexes
    pending = indexes[PENDING_INDEX]
    assert list(pending["key"].items()) == [
        ("rolled_up", 1),
        ("tenant_id", 1),
        ("day", 1),
        ("_id", 1),
    ]
    assert dict(pending["partialFilterExpression"]) == {"rolled_up": False}


# --- a day of many batches ---------------------------------------------------------------------

# 72 records: a day of 64 between two small ones. In slices of 10 the big day spans seven
# (3 + 7 of it, five of 10, 7 + 3 of beta's day, which goes on into an eighth, of 2).
SPREAD = {("acme", "2030-01-05"): 3, ("acme", "2030-01-06"): 64, ("beta", "2030-01-05"): 5}
SMALL_BATCH = 10
BIG_DAY = TenantDay("acme", "2030-01-06")


class CountsRecounts(UsageRecords):
    """Counts the raw records its recounts read: `totals` reads every record of each day it
    is given (the aggregation matches them all), as many as the rows it returns count."""

    def __init__(self, stores: Stores) -> None:
        super().__init__(stores.client, stores.database)
        self.read = 0
        self.recounts: Counter[TenantDay] = Counter()

    async def totals(self, days: Sequence[TenantDay]) -> list[DailyUsage]:
        found = await super().totals(days)
        self.read += sum(row.requests for row in found)
        self.recounts.update(TenantDay(row.tenant_id, row.day) for row in found)
        return found


class DiesMarking(CountsRecounts):
    """A slice that dies once it has saved its rows, before it marks its records."""

    async def mark_rolled_up(self, ids: Sequence[str], *, by: str) -> int:
        raise RuntimeError("the scheduler died between saving the rows and marking")


async def test_a_day_of_many_batches_is_recomputed_once(stores: Stores) -> None:
    """A day spanning several slices is recomputed once, by the slice that reads its last
    pending record: each record is read once by the recounts, not once per slice its day
    spans (7 x 64 here; a day of a million records 50 times at 20,000 a slice)."""
    await stores.store(SPREAD)
    records = CountsRecounts(stores)

    outcomes = await stores.roll_up_to_the_end(_run(), batch=SMALL_BATCH, records=records)

    assert [outcome.summary["tagged"] for outcome in outcomes] == [10] * 7 + [2]
    assert records.recounts == dict.fromkeys(stores.expected_rows(), 1)
    assert records.read == len(stores.stored) == 72
    assert await stores.rows() == stores.expected_rows()
    assert (await stores.pending(), await stores.debts()) == (0, 0)


async def test_two_chains_of_slices_over_a_big_day_read_it_a_bounded_number_of_times(
    stores: Stores,
) -> None:
    """A duplicate chain of slices (interleaving at every round trip): each chain recounts a
    day at most twice (when it reads its last pending record, and at its end for a day left
    owed), whatever the interleaving; every slice touching the big day recounted it, at
    least 7 x 64 reads."""
    await stores.store(SPREAD)
    records = CountsRecounts(stores)
    run = _run()

    await asyncio.gather(
        stores.roll_up_to_the_end(run, batch=SMALL_BATCH, records=records),
        stores.roll_up_to_the_end(run, batch=SMALL_BATCH, records=records),
    )

    assert records.read <= 2 * 2 * len(stores.stored), records.recounts
    assert await stores.rows() == stores.expected_rows()
    assert (await stores.pending(), await stores.debts()) == (0, 0)


async def test_a_run_given_up_inside_a_day_leaves_it_to_the_next_run(stores: Stores) -> None:
    """The first two slices end inside the day and mark 20 of its 25 records without
    counting them; the run goes no further (given up, its continuation lost). The next run
    reads the other 5 and counts the day once, with all 25."""
    await stores.store({(BIG_DAY.tenant_id, BIG_DAY.day): 25})
    records = CountsRecounts(stores)
    run = _run()

    given_up = [
        await stores.roll_up(run, records, batch=SMALL_BATCH),
        await stores.roll_up(_next_slice(run, 1), records, batch=SMALL_BATCH),
    ]
    assert [outcome.more for outcome in given_up] == [True, True]
    assert (await stores.pending(), len(await stores.rolled_up_ids())) == (5, 20)
    assert await stores.rows() == {}  # the 20 are owed a recount, in no row yet

    again = await stores.roll_up_to_the_end(_run(), batch=SMALL_BATCH, records=records)

    assert [outcome.summary["days"] for outcome in again] == [1]
    assert records.read == 25
    assert await stores.rows() == stores.expected_rows()
    assert (await stores.pending(), await stores.debts()) == (0, 0)


async def test_a_slice_that_dies_between_saving_and_marking_counts_the_day_once(
    stores: Stores,
) -> None:
    """The slice that reads the day's last records dies once it saved the day's row, before
    marking them: its retry reads them again and writes the same row (not added to it). The
    day is read twice in all by the recounts, not once per slice it spans."""
    await stores.store({(BIG_DAY.tenant_id, BIG_DAY.day): 25})
    records, dies = CountsRecounts(stores), DiesMarking(stores)
    run = _run()
    for number in (0, 1):
        assert (await stores.roll_up(_next_slice(run, number), records, batch=SMALL_BATCH)).more
    with pytest.raises(RuntimeError, match="died"):
        await stores.roll_up(_next_slice(run, 2), dies, batch=SMALL_BATCH)
    assert await stores.rows() == stores.expected_rows()  # saved, all 25
    assert await stores.pending() == 5

    retry = await stores.roll_up(_next_slice(run, 2), records, batch=SMALL_BATCH)

    assert (retry.more, retry.summary["rolled_up"]) == (False, 5)
    assert records.read + dies.read == 2 * 25
    assert await stores.rows() == stores.expected_rows()
    assert (await stores.pending(), await stores.debts()) == (0, 0)


async def test_a_day_another_execution_finished_first_is_recounted_at_the_run_end(
    stores: Stores,
) -> None:
    """The hourly run's last slice reads the day's records a and c, and recounts the day.
    Before it saves, b arrives (between them in `_id` order) and a run by hand takes a
    slice of two, a and b: the day goes on past it (c), so it notes the day owed a recount
    and marks them without counting it. The hourly slice saves its totals (a, c), marks c,
    and cannot settle a debt noted after it read the debts. Nothing of the day is pending
    any more to bring a slice to it: the run by hand's last slice recounts it."""
    day = (BIG_DAY.tenant_id, BIG_DAY.day)
    await stores.store_records([_record(*day, 0, task_id="a"), _record(*day, 1, task_id="c")])
    by_hand = _run()
    slices: list[JobOutcome] = []

    async def a_record_and_a_slice_of_two() -> None:
        await stores.store_records([_record(*day, 2, task_id="b")])
        slices.append(await stores.roll_up(by_hand, batch=2))

    hourly = await stores.roll_up(_run(), PausesAfterTotals(stores, a_record_and_a_slice_of_two))

    assert (slices[0].more, slices[0].summary["days"]) == (True, 0)  # the day goes on: c
    assert (hourly.more, hourly.summary["rolled_up"]) == (False, 1)  # c
    assert await stores.pending() == 0
    assert (await stores.rows())[BIG_DAY].requests == 2  # b is marked and in no row

    slices.extend(await stores.roll_up_to_the_end(_next_slice(by_hand, 1), batch=2))

    assert [outcome.summary["days"] for outcome in slices] == [0, 1]
    assert await stores.rows() == stores.expected_rows()
    assert await stores.debts() == 0


async def test_a_day_owed_again_during_a_recount_stays_owed(stores: Stores) -> None:
    """A run's slice of one takes a, the day going on (c): the day is owed a recount. Its
    next slice reads c and e, reads that debt and recounts the day (a, c, e). Before it
    saves, b arrives and another run's slice of one takes it, the day going on (c, not
    marked yet): it notes the day owed again and marks b. The recount settles only the debt
    it read, not the one noted since (b is in no row, and nothing of the day is pending):
    the other run's last slice recounts the day."""
    day = (BIG_DAY.tenant_id, BIG_DAY.day)
    await stores.store_records([_record(*day, n, task_id=t) for n, t in enumerate("ace")])
    run, other = _run(), _run()
    first = await stores.roll_up(run, batch=1)
    others: list[JobOutcome] = []

    async def a_record_and_another_slice_of_one() -> None:
        await stores.store_records([_record(*day, 3, task_id="b")])
        others.append(await stores.roll_up(other, batch=1))

    recount = await stores.roll_up(
        _next_slice(run, 1), PausesAfterTotals(stores, a_record_and_another_slice_of_one)
    )

    assert [outcome.summary["days"] for outcome in (first, others[0])] == [0, 0]
    assert (recount.more, recount.summary["days"]) == (False, 1)
    assert await stores.pending() == 0
    assert (await stores.rows())[BIG_DAY].requests == 3  # a, c, e; b is marked and owed

    others.extend(await stores.roll_up_to_the_end(_next_slice(other, 1), batch=1))

    assert await stores.rows() == stores.expected_rows()
    assert await stores.debts() == 0


class Commands(monitoring.CommandListener):
    """The commands MongoDB can explain that the client sends: (database, command)."""

    EXPLAINABLE = frozenset({"find", "aggregate", "update", "delete"})

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in self.EXPLAINABLE:
            self.seen.append((event.database_name, copy.deepcopy(dict(event.command))))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


# A command's fields that are not part of the query: the session's, the deadline, concerns.
NOT_THE_QUERY = frozenset(
    {
        "lsid",
        "$db",
        "$clusterTime",
        "$readPreference",
        "txnNumber",
        "maxTimeMS",
        "writeConcern",
        "readConcern",
        "apiVersion",
        "apiStrict",
        "apiDeprecationErrors",
    }
)
ROLLUP_COLLECTIONS = frozenset({"usage_records", "usage_daily", "usage_owed_days"})


def _explainable(command: dict[str, Any]) -> list[dict[str, Any]]:
    """`command` as commands `explain` takes: a write of one statement each."""
    name = next(iter(command))
    query = {key: value for key, value in command.items() if key not in NOT_THE_QUERY}
    statements = {"update": "updates", "delete": "deletes"}.get(name)
    if statements is None:
        return [query]
    rest = {key: value for key, value in query.items() if key != statements}
    return [{**rest, statements: [statement]} for statement in query[statements]]


def _winning_plan(explained: Any, *, inside: bool = False) -> list[tuple[str, str | None]]:
    """The (stage, index name) of every stage of the winning plans in `explained`."""
    found: list[tuple[str, str | None]] = []
    if isinstance(explained, dict):
        if inside and isinstance(explained.get("stage"), str):
            found.append((explained["stage"], explained.get("indexName")))
        for key, value in explained.items():
            if key != "rejectedPlans":
                found += _winning_plan(value, inside=inside or key == "winningPlan")
    elif isinstance(explained, list):
        for item in explained:
            found += _winning_plan(item, inside=inside)
    return found


async def test_every_query_of_a_roll_up_is_answered_from_an_index(
    mongo: Endpoint, stores: Stores
) -> None:
    """Every command a roll-up sends (the pending reads, the debts noted, read and settled,
    the recounts, the rows, the marking), explained by MongoDB: none scans its collection,
    and the pending read is answered from `PENDING_INDEX` alone. A day of many batches
    recounted in every slice it spans was the cost of slices; a scan of all records per
    slice would be worse."""
    if mongo.is_standin:
        pytest.skip("the stand-in (mongoeco) does not plan queries; needs MONGO_URL=MongoDB")
    await stores.store(SPREAD)
    commands = Commands()
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True, event_listeners=[commands])
    try:
        run, records = _run(), UsageRecords(client, stores.database)
        daily = DailyUsageStore(client, stores.database)
        outcomes = [JobOutcome(more=True)]
        while outcomes[-1].more:
            assert len(outcomes) <= MAX_SLICES
            outcomes.append(
                await roll_up_usage(
                    _next_slice(run, len(outcomes) - 1),
                    records=records,
                    daily=daily,
                    retention=timedelta(days=30),
                    clock=lambda: NOW,
                    batch=SMALL_BATCH,
                )
            )
        assert await stores.rows() == stores.expected_rows()

        database = client[stores.database]
        sent = [command for name, command in commands.seen if name == stores.database]
        kinds = {(command[next(iter(command))], next(iter(command))) for command in sent}
        assert kinds >= {
            ("usage_records", "find"),
            ("usage_records", "aggregate"),
            ("usage_records", "update"),
            ("usage_daily", "update"),
            ("usage_owed_days", "update"),
            ("usage_owed_days", "find"),
            ("usage_owed_days", "delete"),
        }, kinds
        for command in sent:
            if command[next(iter(command))] not in ROLLUP_COLLECTIONS:
                continue
            for query in _explainable(command):
                explained = await database.command({"explain": query, "verbosity": "queryPlanner"})
                plan = _winning_plan(explained)
                stages = {stage for stage, _ in plan}
                assert plan, explained
                assert "COLLSCAN" not in stages, (query, explained)
                if query.get("find") == "usage_records" and query["filter"] == {"rolled_up": False}:
                    assert PENDING_INDEX in {index for _, index in plan}, explained
                    assert "FETCH" not in stages, explained  # from the index's keys alone
    finally:
        await client.close()


async def test_the_scheduler_rolls_a_backlog_up_in_slices_of_usage_rollup_batch(
    amqp_url: str, mongo: Endpoint, db_prefix: str
) -> None:
    """`USAGE_ROLLUP_BATCH` reaches the job, and the job framework runs its slices (each a
    delivery of its own) until the last: the run's result is that slice's."""
    prefix = f"{db_prefix}{uuid.uuid4().hex[:6]}"
    settings = SchedulerSettings.model_validate(
        {
            "RABBITMQ_URL": amqp_url,
            "MONGO_URL": mongo.url,
            "MONGO_DB_PREFIX": prefix,
            "ADMIN_API_KEY": ADMIN_KEY,
            "USAGE_ROLLUP_BATCH": "2",
        }
    )
    config = parse_config({"jobs": {USAGE_ROLLUP: {"cron": "0 3 * * *", "enabled": False}}}, {})
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    database = settings.database_name("scheduler")
    stores = Stores(client, database, DailyUsageStore(client, database), [])
    try:
        # 5 records: slices of 2, 2 and 1.
        await stores.store({("acme", "2030-01-05"): 3, ("acme", "2030-01-06"): 2})
        app = create_app(settings, config=config, clock=advancing_clock(NOW))
        async with running(app) as api:
            api.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
            run = await run_cron_job_by_hand(api, USAGE_ROLLUP)
        assert run["state"] == "succeeded", run
        assert run["result"] == {"tagged": 1, "rolled_up": 1, "days": 1, "too_old": 0}
        assert await stores.rows() == stores.expected_rows()
        assert await stores.pending() == 0
    finally:
        await client.drop_database(database)
        await client.close()


class FailsSettling(CountsRecounts):
    """A slice whose database fails as it forgets the debts it recounted, after marking."""

    async def settle(self, owed: Mapping[TenantDay, str]) -> int:
        raise AutoReconnect("connection closed")


async def test_a_slice_whose_debts_are_not_forgotten_reports_what_it_rolled_up(
    stores: Stores,
) -> None:
    """The debts' deletion failed after the records were marked: the slice failed, its retry
    found nothing pending, and the run reported `rolled_up: 0` (a walkthrough: 4,286 records
    rolled up). The slice now reports them; the debt it leaves is settled by a later run."""
    await stores.store({(BIG_DAY.tenant_id, BIG_DAY.day): 25})
    run = _run()
    first = await stores.roll_up(run, batch=SMALL_BATCH)
    assert first.more  # the day goes on past the slice: owed a recount

    outcomes = await stores.roll_up_to_the_end(
        _next_slice(run, 1), batch=SMALL_BATCH, records=FailsSettling(stores)
    )

    assert sum(outcome.summary["rolled_up"] for outcome in [first, *outcomes]) == 25
    assert await stores.rows() == stores.expected_rows()
    assert (await stores.pending(), await stores.debts()) == (0, 1)
    await stores.roll_up_to_the_end(_run(), batch=SMALL_BATCH)
    assert await stores.debts() == 0
