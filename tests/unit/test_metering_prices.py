"""Usage metering prices a task by the model name the provider answered with, which for
OpenAI is a dated snapshot of the name asked for (`gpt-4o-mini` -> `gpt-4o-mini-2024-07-18`)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from services.scheduler.config import Price
from services.scheduler.metering import (
    UNKNOWN_MODEL,
    Extras,
    failed_usage_record_of,
    price_of,
    usage_record_of,
)
from shared.contracts import ScoreResult, TaskCompleted, TaskError, TaskFailed, Usage

MINI = Price(prompt_per_1k=Decimal("0.00015"), completion_per_1k=Decimal("0.0006"))
FOUR_O = Price(prompt_per_1k=Decimal("0.0025"), completion_per_1k=Decimal("0.01"))
SNAPSHOT = Price(prompt_per_1k=Decimal("0.001"), completion_per_1k=Decimal("0.002"))
PRICES = {"gpt-4o": FOUR_O, "gpt-4o-mini": MINI, "gpt-4": SNAPSHOT}
NOW = datetime(2025, 3, 1, 12, tzinfo=UTC)
# 1,000 prompt and 100 completion tokens at MINI: 0.00015 + 0.00006 = 0.00021 units.
MINI_COST_NANOS = 150_000 + 60_000


@pytest.mark.parametrize(
    ("model", "price"),
    [
        ("gpt-4o-mini", MINI),  # exact
        ("gpt-4o-mini-2024-07-18", MINI),  # dated: the undated name's price
        ("gpt-4o-2024-08-06", FOUR_O),
        ("gpt-4-0613", SNAPSHOT),  # OpenAI's older month-day snapshot
        ("claude-3-haiku", None),  # not configured
        ("gpt-4o-mini-2024-07", None),  # not a date
        ("gpt-4o-audio-preview-2024-12-17", None),  # `gpt-4o-audio-preview` is not priced
        (UNKNOWN_MODEL, None),
    ],
)
def test_price_of(model: str, price: Price | None) -> None:
    assert price_of(model, PRICES) is price


def test_a_dated_name_takes_its_own_price_over_the_undated_one() -> None:
    own = Price(prompt_per_1k=Decimal(1), completion_per_1k=Decimal(1))
    prices = {"gpt-4o-mini": MINI, "gpt-4o-mini-2024-07-18": own}
    assert price_of("gpt-4o-mini-2024-07-18", prices) is own
    assert price_of("gpt-4o-mini-2025-01-01", prices) is MINI


def test_the_whole_undated_name_is_priced_never_a_shorter_one() -> None:
    """`gpt-4o-mini-...` is never billed as `gpt-4o`, whichever of the two is configured."""
    assert price_of("gpt-4o-mini-2024-07-18", {"gpt-4o": FOUR_O, "gpt-4o-mini": MINI}) is MINI
    assert price_of("gpt-4o-mini-2024-07-18", {"gpt-4o-mini": MINI, "gpt-4o": FOUR_O}) is MINI
    assert price_of("gpt-4o-mini-2024-07-18", {"gpt-4o": FOUR_O}) is None


def _completed(model: str) -> TaskCompleted:
    return TaskCompleted(
        task_id="t1",
        tenant_id="acme",
        sequence=1,
        generation=1,
        submitted_at=NOW,
        occurred_at=NOW,
        result=ScoreResult(
            score=7,
            comment="ok",
            model=model,
            usage=Usage(prompt_tokens=1000, completion_tokens=100),
        ),
    )


def _failed(model: str | None) -> TaskFailed:
    return TaskFailed(
        task_id="t1",
        tenant_id="acme",
        sequence=1,
        generation=1,
        submitted_at=NOW,
        occurred_at=NOW,
        error=TaskError(code="unusable_output", message="not JSON", retryable=False),
        dead_lettered=False,
        usage=Usage(prompt_tokens=1000, completion_tokens=100),
        model=model,
    )


def test_a_completion_answered_by_a_dated_model_is_priced() -> None:
    record = usage_record_of(
        _completed("gpt-4o-mini-2024-07-18"), extras=Extras(), prices=PRICES, recorded_at=NOW
    )
    assert record.model == "gpt-4o-mini-2024-07-18"  # the record keeps the answered name
    assert record.cost_nanos == MINI_COST_NANOS


def test_a_failure_answered_by_a_dated_model_is_priced() -> None:
    record = failed_usage_record_of(
        _failed("gpt-4o-mini-2024-07-18"), extras=Extras(), prices=PRICES, recorded_at=NOW
    )
    assert record.model == "gpt-4o-mini-2024-07-18"
    assert record.cost_nanos == MINI_COST_NANOS


@pytest.mark.parametrize("model", ["claude-3-haiku-2024-03-07", None])
def test_unpriced_models_still_have_no_cost(model: str | None) -> None:
    completed = usage_record_of(
        _completed(model or "claude-3-haiku"), extras=Extras(), prices=PRICES, recorded_at=NOW
    )
    failed = failed_usage_record_of(_failed(model), extras=Extras(), prices=PRICES, recorded_at=NOW)
    assert completed.cost_nanos is None
    assert failed.cost_nanos is None
    assert failed.model == (model or UNKNOWN_MODEL)
