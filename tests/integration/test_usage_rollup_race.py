"""Two executions of the usage roll-up at once (a duplicate delivery of one run, a run by
hand beside the hourly one) count every record: none is marked rolled up without being in
its day's row, and no row is overwritten by totals read from fewer records.

`roll_up_usage` runs here twice on the real database (MongoDB or the stand-in); the second
runs inside the first, at the moment the interleaving names, through `UsageRecords`
subclasses that pause the first execution there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.scheduler.jobs import JobRun
from services.scheduler.jobs.usage import roll_up_usage
from services.scheduler.usage_store import (
    DailyUsage,
    DailyUsageStore,
    PendingBatch,
    TenantDay,
    UsageRecord,
    UsageRecords,
)
from shared.contracts import new_id

NOW = datetime(2030, 1, 10, 10, 5, tzinfo=UTC)
DAY = "2030-01-09"
BATCH = 1000  # more than the records here: one slice each
Mongo = AsyncMongoClient[dict[str, Any]]


@dataclass
class Stores:
    client: Mongo
    database: str
    daily: DailyUsageStore
    tenant: str

    def records(self) -> UsageRecords:
        return UsageRecords(self.client, self.database)

    async def store_record(self) -> None:
        at = datetime.fromisoformat(f"{DAY}T12:00:00+00:00")
        await self.records().record(
            UsageRecord(
                task_id=new_id(),
                generation=0,
                tenant_id=self.tenant,
                api_key_id=None,
                model="m",
                prompt_tokens=10,
                completion_tokens=1,
                cost_nanos=None,
                cached=False,
                day=DAY,
                completed_at=at,
                recorded_at=at,
            )
        )

    async def roll_up(self, run: JobRun, records: UsageRecords | None = None) -> None:
        await roll_up_usage(
            run,
            records=records or self.records(),
            daily=self.daily,
            retention=timedelta(days=30),
            clock=lambda: NOW,
            batch=BATCH,
        )

    async def requests_in_the_row(self) -> int:
        rows = await self.daily.read(self.tenant, first_day=DAY, last_day=DAY)
        return rows[0].requests if rows else 0

    async def pending(self) -> int:
        usage = self.client[self.database]["usage_records"]
        return await usage.count_documents({"tenant_id": self.tenant, "rolled_up": False})


@pytest.fixture
async def stores(mongo: Endpoint, db_prefix: str) -> AsyncIterator[Stores]:
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    database = f"{db_prefix}_scheduler"
    yield Stores(client, database, DailyUsageStore(client, database), f"t-{new_id()[:8]}")
    await client.close()


def _run() -> JobRun:
    return JobRun(
        run_id=new_id(),
        job="usage-rollup",
        scheduled_for=NOW,
        fired_at=NOW,
        manual=False,
        attempt=1,
    )


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
    """The second execution: reads its batch of pending records, then waits for `go`."""

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


async def test_a_row_is_not_overwritten_by_totals_read_from_fewer_records(
    stores: Stores,
) -> None:
    """The second execution, started after a record arrived, runs whole while the first
    holds the totals it read before that record."""
    run = _run()
    await stores.store_record()

    async def another_record_and_execution() -> None:
        await stores.store_record()
        await stores.roll_up(run)

    await stores.roll_up(run, PausesAfterTotals(stores, another_record_and_execution))

    assert await stores.requests_in_the_row() == 2
    assert await stores.pending() == 0


async def test_a_record_read_by_another_execution_is_left_to_it(stores: Stores) -> None:
    """The second execution reads a record that arrived after the first read its totals, and
    counts it after the first has finished: the first must not mark it rolled up."""
    run = _run()
    await stores.store_record()
    first_done = asyncio.Event()
    second = PausesAfterReading(stores, first_done)
    later: list[asyncio.Task[None]] = []

    async def another_record_and_execution() -> None:
        await stores.store_record()
        later.append(asyncio.create_task(stores.roll_up(run, second)))
        await second.read.wait()

    await stores.roll_up(run, PausesAfterTotals(stores, another_record_and_execution))
    assert await stores.pending() == 1  # the first marked only the record it counted
    first_done.set()
    await later[0]

    assert await stores.requests_in_the_row() == 2
    assert await stores.pending() == 0
