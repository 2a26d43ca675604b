"""What a scorer replica keeps of the batch cancellations it hears (`CancelledBatches`): an
item named at its generation, for its tenant, while the announcement is fresh; what it
recalls of their records at start (`recall`), and what it keeps when its database is away
as it hears one."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from pymongo import AsyncMongoClient

from services.scorer.batch_cancels import (
    BatchCancelRecords,
    CancelledBatches,
    recall_again,
    subscribe_batch_cancels,
)
from services.scorer.metrics import ScorerMetrics
from shared.contracts import BatchCancelling, ScoreText, new_id
from tests.support import HandedDelivery, HandlerOnly, closed_port

REQUESTED_AT = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = REQUESTED_AT

    def __call__(self) -> datetime:
        return self.now


def _announcement(
    batch_id: str, generations: dict[str, int], tenant_id: str = "t1"
) -> BatchCancelling:
    return BatchCancelling(
        task_id=new_id(),
        tenant_id=tenant_id,
        batch_id=batch_id,
        requested_at=REQUESTED_AT,
        generations=generations,
    )


def _item(
    task_id: str, batch_id: str | None, *, generation: int = 0, tenant_id: str = "t1"
) -> ScoreText:
    return ScoreText(
        task_id=task_id, tenant_id=tenant_id, text="x", batch_id=batch_id, generation=generation
    )


def test_an_item_named_at_its_generation_is_cancelled_as_of_the_request() -> None:
    batches = CancelledBatches(clock=Clock())
    batches.hear(_announcement("b1", {"a": 0, "b": 2}))

    assert batches.requested_at(_item("a", "b1")) == REQUESTED_AT
    assert batches.requested_at(_item("b", "b1", generation=2)) == REQUESTED_AT


def test_anything_else_is_not() -> None:
    batches = CancelledBatches(clock=Clock())
    batches.hear(_announcement("b1", {"a": 0}))

    assert batches.requested_at(_item("a", "b1", generation=1)) is None  # a replay since
    assert batches.requested_at(_item("c", "b1")) is None  # finished when cancelled
    assert batches.requested_at(_item("a", "b2")) is None
    assert batches.requested_at(_item("a", None)) is None
    assert batches.requested_at(_item("a", "b1", tenant_id="t2")) is None


def test_an_announcement_is_forgotten_once_older_than_it_is_kept() -> None:
    clock = Clock()
    batches = CancelledBatches(clock=clock, keep_s=60)
    batches.hear(_announcement("b1", {"a": 0}))
    clock.now += timedelta(seconds=30)
    batches.hear(_announcement("b2", {"x": 0}))

    clock.now += timedelta(seconds=31)
    assert batches.requested_at(_item("a", "b1")) is None
    assert batches.requested_at(_item("x", "b2")) == REQUESTED_AT
    assert len(batches) == 1


def test_the_oldest_announcement_goes_first_past_the_most_kept() -> None:
    batches = CancelledBatches(clock=Clock(), max_batches=2)
    for batch_id in ("b1", "b2", "b3"):
        batches.hear(_announcement(batch_id, {f"{batch_id}-item": 0}))

    assert batches.requested_at(_item("b1-item", "b1")) is None
    assert batches.requested_at(_item("b2-item", "b2")) == REQUESTED_AT
    assert batches.requested_at(_item("b3-item", "b3")) == REQUESTED_AT


def test_heard_again_it_counts_as_new() -> None:
    batches = CancelledBatches(clock=Clock(), max_batches=2)
    batches.hear(_announcement("b1", {"a": 0}))
    batches.hear(_announcement("b2", {"b": 0}))
    batches.hear(_announcement("b1", {"a": 1}))  # cancelled again, after a replay
    batches.hear(_announcement("b3", {"c": 0}))

    assert batches.requested_at(_item("a", "b1", generation=1)) == REQUESTED_AT
    assert batches.requested_at(_item("b", "b2")) is None


def test_a_recalled_announcement_is_kept_for_what_is_left_of_its_time() -> None:
    """Recalled at start, it is as old as its record says, not heard anew: a restart does not
    keep a batch's cancellation past `KEEP_S` from when it was heard."""
    clock = Clock()
    batches = CancelledBatches(clock=clock, keep_s=60)
    clock.now += timedelta(seconds=50)
    batches.recall(_announcement("b1", {"a": 0}), REQUESTED_AT)
    batches.recall(_announcement("b2", {"x": 0}), REQUESTED_AT - timedelta(seconds=11))

    assert batches.requested_at(_item("a", "b1")) == REQUESTED_AT
    assert batches.requested_at(_item("x", "b2")) is None  # heard 61 s ago: not kept
    clock.now += timedelta(seconds=11)
    assert batches.requested_at(_item("a", "b1")) is None


def test_a_record_does_not_replace_a_later_cancellation_of_the_batch() -> None:
    clock = Clock()
    batches = CancelledBatches(clock=clock)
    later = _announcement("b1", {"a": 1})  # cancelled again, after a replay
    later = later.model_copy(update={"requested_at": REQUESTED_AT + timedelta(seconds=5)})
    batches.hear(later)
    batches.recall(_announcement("b1", {"a": 0}), REQUESTED_AT)

    assert batches.requested_at(_item("a", "b1", generation=1)) == later.requested_at
    assert batches.requested_at(_item("a", "b1")) is None


def test_an_earlier_cancellation_heard_after_a_later_one_leaves_it() -> None:
    """Two cancellations of a batch (the second after a replay) heard out of order: the
    earlier replaced the later in memory, and the later generation's items went uncancelled
    here, though the records and `recall` kept the later (a review)."""
    batches = CancelledBatches(clock=Clock())
    later = _announcement("b1", {"a": 1})
    later = later.model_copy(update={"requested_at": REQUESTED_AT + timedelta(seconds=5)})
    batches.hear(later)
    batches.hear(_announcement("b1", {"a": 0}))

    assert batches.requested_at(_item("a", "b1", generation=1)) == later.requested_at


async def test_reading_the_records_again_after_the_start_is_best_effort(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second reading, once the replica's queue is bound, may meet a database gone
    away since the first: it is logged, and the start goes on with what the first read."""
    unreachable: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        f"mongodb://127.0.0.1:{closed_port()}", tz_aware=True, timeoutMS=200
    )
    batches = CancelledBatches(clock=Clock())
    batches.hear(_announcement("b1", {"a": 0}))
    records = BatchCancelRecords(unreachable, "t_scorer")
    try:
        with caplog.at_level(logging.WARNING, logger="scorebox.scorer.batch_cancels"):
            await recall_again(batches, records, now=REQUESTED_AT)
    finally:
        await unreachable.close()

    assert batches.requested_at(_item("a", "b1")) == REQUESTED_AT
    assert "not read again after the start" in caplog.text


def test_one_recalled_behind_a_newer_one_still_expires_on_its_own_time() -> None:
    clock = Clock()
    batches = CancelledBatches(clock=clock, keep_s=60)
    batches.hear(_announcement("b2", {"x": 0}))  # heard now
    batches.recall(_announcement("b1", {"a": 0}), REQUESTED_AT - timedelta(seconds=30))

    clock.now += timedelta(seconds=31)
    assert batches.requested_at(_item("a", "b1")) is None
    assert batches.requested_at(_item("x", "b2")) == REQUESTED_AT


async def test_an_announcement_heard_while_the_database_is_away_is_kept_in_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its record not written (the write times out), the consumer logs it and goes on: the
    replica cancels the batch's items as before; only one started later misses it."""
    unreachable: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        f"mongodb://127.0.0.1:{closed_port()}", tz_aware=True, timeoutMS=200
    )
    batches = CancelledBatches(clock=Clock())
    records = BatchCancelRecords(unreachable, "t_scorer")
    broker = HandlerOnly()
    subscribe_batch_cancels(broker, batches, records, ScorerMetrics(), replica="r1")  # type: ignore[arg-type]
    announcement = _announcement("b1", {"a": 0})
    try:
        with caplog.at_level(logging.WARNING, logger="scorebox.scorer.batch_cancels"):
            await broker.handler(HandedDelivery(announcement.model_dump_json().encode()))
    finally:
        await unreachable.close()

    assert batches.requested_at(_item("a", "b1")) == REQUESTED_AT
    assert "batch b1's cancellation not stored" in caplog.text


def test_a_record_recalled_again_is_not_counted_again() -> None:
    """The second reading at start logged every record a second time, as if recalled anew
    (a walkthrough): it counts those it keeps."""
    batches = CancelledBatches(clock=Clock())
    announcement = _announcement("b1", {"a": 0})

    assert batches.recall(announcement, REQUESTED_AT)
    assert not batches.recall(announcement, REQUESTED_AT)
