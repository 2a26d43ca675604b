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
framework."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from pymongo import AsyncMongoClient

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
from tests.support import eventually, running

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

    async def roll_up_to_the_end(self, run: JobRun, *, batch: int = BATCH) -> list[JobOutcome]:
        """The slices of `run` from its `run.slice`, as the job framework runs them: the next
        one while the last said `more`."""
        outcomes = [await self.roll_up(run, batch=batch)]
        while outcomes[-1].more:
            assert len(outcomes) < MAX_SLICES, [outcome.summary for outcome in outcomes]
            outcomes.append(
                await self.roll_up(_next_slice(run, len(outcomes)), batch=batch),
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


def _record(tenant: str, day: str, number: int) -> UsageRecord:
    at = datetime.fromisoformat(f"{day}T12:00:00+00:00")
    return UsageRecord(
        task_id=new_id(),
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
    every slice recomputes them all."""
    await stores.store(BACKLOG)

    first = await stores.roll_up(_run())

    in_order = sorted(
        stores.stored, key=lambda record: (record.tenant_id, record.day, record.record_id)
    )
    days = {(record.tenant_id, record.day) for record in in_order[:BATCH]}
    assert days == {("acme", "2030-01-05"), ("acme", "2030-01-06"), ("acme", "2030-01-07")}
    assert await stores.rolled_up_ids() == {record.record_id for record in in_order[:BATCH]}
    assert first.summary["days"] == 3
    # The days it finished are final already.
    rows, expected = await stores.rows(), stores.expected_rows()
    for pair in (TenantDay("acme", "2030-01-05"), TenantDay("acme", "2030-01-06")):
        assert rows[pair] == expected[pair]


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


async def _run_by_hand(api: httpx.AsyncClient) -> dict[str, Any]:
    accepted = await api.post(f"/admin/v1/cron/jobs/{USAGE_ROLLUP}/run")
    assert accepted.status_code == 202, accepted.text
    run_url = accepted.json()["status_url"]

    async def finished() -> dict[str, Any] | None:
        body: dict[str, Any] = (await api.get(run_url)).json()
        return body if body.get("state") in {"succeeded", "failed"} else None

    return await eventually(finished, what="the usage rollup finished")


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
        app = create_app(settings, config=config, clock=lambda: NOW)
        async with running(app) as api:
            api.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
            run = await _run_by_hand(api)
        assert run["state"] == "succeeded", run
        assert run["result"] == {"tagged": 1, "rolled_up": 1, "days": 1, "too_old": 0}
        assert await stores.rows() == stores.expected_rows()
        assert await stores.pending() == 0
    finally:
        await client.drop_database(database)
        await client.close()
