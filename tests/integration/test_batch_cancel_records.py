"""The batch cancellations a scorer stores as it hears them (`BatchCancelRecords`), on the
test database: one record per batch whoever writes it, the latest cancellation kept, and
none read once expired, whether or not the TTL monitor has passed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from services.scorer.batch_cancels import (
    BatchCancelRecords,
    CancelledBatches,
    recall_cancelled_batches,
)
from shared.contracts import BatchCancelling, ScoreText, new_id, utcnow

pytestmark = pytest.mark.integration

KEEP = timedelta(seconds=60)


@pytest.fixture
def heard_at() -> datetime:
    """Now, to the millisecond a stored date keeps: the TTL monitor would take the records
    of an earlier time away before they are read."""
    now = utcnow()
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


@pytest.fixture
async def records(mongo: Any) -> AsyncIterator[BatchCancelRecords]:
    """On a database of this test's own: `recent` reads every record in it."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        mongo.url, tz_aware=True, timeoutMS=10_000
    )
    try:
        stored = BatchCancelRecords(client, f"t{new_id()[:10]}_scorer", keep_s=KEEP.total_seconds())
        await stored.ensure_indexes()
        yield stored
    finally:
        await client.close()


def _announcement(
    batch_id: str, generations: dict[str, int], *, requested_at: datetime
) -> BatchCancelling:
    return BatchCancelling(
        task_id=new_id(), batch_id=batch_id, requested_at=requested_at, generations=generations
    )


async def test_every_replica_hearing_it_writes_the_same_one_record(
    records: BatchCancelRecords, heard_at: datetime
) -> None:
    announcement = _announcement("b1", {"a": 0, "b": 3}, requested_at=heard_at)
    await records.record(announcement, heard_at=heard_at)
    await records.record(announcement, heard_at=heard_at + timedelta(seconds=1))

    [stored] = await records.recent(now=heard_at)
    assert stored.event == announcement
    assert stored.heard_at == heard_at + timedelta(seconds=1)


async def test_an_earlier_cancellation_written_late_does_not_replace_a_later_one(
    records: BatchCancelRecords, heard_at: datetime
) -> None:
    """Two cancellations of a batch (one after a replay), a replica writing them in the
    other order than its peer did."""
    earlier = _announcement("b1", {"a": 0}, requested_at=heard_at)
    later = _announcement("b1", {"a": 1}, requested_at=heard_at + timedelta(seconds=5))
    await records.record(later, heard_at=heard_at + timedelta(seconds=5))
    await records.record(earlier, heard_at=heard_at + timedelta(seconds=6))

    [stored] = await records.recent(now=heard_at)
    assert stored.event == later


async def test_a_record_past_its_time_is_not_read(
    records: BatchCancelRecords, heard_at: datetime
) -> None:
    await records.record(_announcement("old", {"a": 0}, requested_at=heard_at), heard_at=heard_at)
    await records.record(
        _announcement("new", {"b": 0}, requested_at=heard_at),
        heard_at=heard_at + timedelta(seconds=30),
    )

    recent = await records.recent(now=heard_at + KEEP)
    assert [stored.event.batch_id for stored in recent] == ["new"]


async def test_the_latest_heard_are_read_up_to_the_most_kept_oldest_first(
    records: BatchCancelRecords, heard_at: datetime
) -> None:
    for second, batch_id in enumerate(("b1", "b2", "b3")):
        announcement = _announcement(batch_id, {f"{batch_id}-a": 0}, requested_at=heard_at)
        await records.record(announcement, heard_at=heard_at + timedelta(seconds=second))

    recent = await records.recent(now=heard_at, limit=2)
    assert [stored.event.batch_id for stored in recent] == ["b2", "b3"]


async def test_a_replica_starting_recalls_the_records_as_they_were_heard(
    records: BatchCancelRecords, heard_at: datetime
) -> None:
    await records.record(_announcement("b1", {"a": 0}, requested_at=heard_at), heard_at=heard_at)
    now = heard_at + timedelta(seconds=30)
    batches = CancelledBatches(clock=lambda: now, keep_s=KEEP.total_seconds())

    await recall_cancelled_batches(batches, records, now=now)

    item = ScoreText(task_id="a", text="x", batch_id="b1")
    assert batches.requested_at(item) == heard_at
    assert batches.requested_at(item.model_copy(update={"tenant_id": "t2"})) is None
