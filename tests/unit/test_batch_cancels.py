"""What a scorer replica keeps of the batch cancellations it hears (`CancelledBatches`): an
item named at its generation, for its tenant, while the announcement is fresh."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from services.scorer.batch_cancels import CancelledBatches
from shared.contracts import BatchCancelling, ScoreText, new_id

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
