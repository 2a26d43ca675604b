"""Usage metering math: costs in exact nano-units, UTC days, tolerant reading, query ranges."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from services.scheduler.api import DailyUsageView, _totals, usage_range
from services.scheduler.config import Price
from services.scheduler.metering import (
    Extras,
    completed_task_of,
    cost_nanos,
    day_of,
    usage_record_of,
)
from services.scheduler.usage_store import DailyUsage
from shared.contracts import ScoreResult, TaskCompleted, Usage
from shared.http import Problem

MINI = Price(prompt_per_1k=Decimal("0.00015"), completion_per_1k=Decimal("0.0006"))


@pytest.mark.parametrize(
    ("prompt", "completion", "price", "nanos"),
    [
        (1000, 0, MINI, 150_000),  # 0.00015 USD
        (0, 1000, MINI, 600_000),
        (1234, 567, MINI, 185_100 + 340_200),
        (1, 0, MINI, 150),  # one token is 150 nano-dollars: exact, no rounding
        (1, 1, Price(prompt_per_1k=Decimal("0.0000375"), completion_per_1k=Decimal(0)), 38),
        (0, 0, MINI, 0),
        (500, 500, None, None),  # no configured price: no cost
    ],
)
def test_cost_nanos(prompt: int, completion: int, price: Price | None, nanos: int | None) -> None:
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion)
    assert cost_nanos(usage, price) == nanos


def test_costs_sum_exactly() -> None:
    one = cost_nanos(Usage(prompt_tokens=333, completion_tokens=77), MINI)
    assert one is not None
    assert sum([one] * 1_000_000) == cost_nanos(
        Usage(prompt_tokens=333_000_000, completion_tokens=77_000_000), MINI
    )


@pytest.mark.parametrize(
    ("instant", "day"),
    [
        (datetime(2025, 1, 31, 23, 59, 59, tzinfo=UTC), "2025-01-31"),
        (datetime(2025, 2, 1, 7, 0, tzinfo=timezone(timedelta(hours=8))), "2025-01-31"),
        (datetime(2025, 2, 1, 8, 0, tzinfo=timezone(timedelta(hours=8))), "2025-02-01"),
    ],
)
def test_usage_days_are_utc_days(instant: datetime, day: str) -> None:
    assert day_of(instant) == day


def _completed(**result: object) -> TaskCompleted:
    now = datetime(2025, 3, 1, 12, tzinfo=UTC)
    return TaskCompleted(
        task_id="t1",
        tenant_id="acme",
        sequence=1,
        generation=2,
        submitted_at=now,
        occurred_at=now,
        result=ScoreResult(
            score=7,
            comment="ok",
            model=str(result.get("model", "gpt-4o-mini")),
            usage=Usage(prompt_tokens=1000, completion_tokens=100),
            cached=bool(result.get("cached", False)),
        ),
    )


def test_usage_record_of_a_completed_task() -> None:
    recorded_at = datetime(2025, 3, 1, 12, 0, 5, tzinfo=UTC)
    record = usage_record_of(
        _completed(), extras=Extras(), prices={"gpt-4o-mini": MINI}, recorded_at=recorded_at
    )
    assert record.record_id == "t1:2"
    assert (record.tenant_id, record.model, record.day) == ("acme", "gpt-4o-mini", "2025-03-01")
    assert (record.prompt_tokens, record.completion_tokens) == (1000, 100)
    assert record.cost_nanos == 150_000 + 60_000
    unpriced = usage_record_of(
        _completed(model="other"), extras=Extras(), prices={}, recorded_at=recorded_at
    )
    assert unpriced.cost_nanos is None


def test_a_result_cache_hit_is_a_request_without_tokens_or_cost() -> None:
    """A cache hit carries the usage of the call that made its result, and was billed as if
    it had made that call again."""
    recorded_at = datetime(2025, 3, 1, 12, 0, 5, tzinfo=UTC)
    record = usage_record_of(
        _completed(cached=True),
        extras=Extras(),
        prices={"gpt-4o-mini": MINI},
        recorded_at=recorded_at,
    )
    assert record.cached
    assert (record.prompt_tokens, record.completion_tokens, record.cost_nanos) == (0, 0, 0)
    # Of a model without a price too: it cost nothing, which is known (it read "unpriced").
    unpriced = usage_record_of(
        _completed(cached=True, model="other"), extras=Extras(), prices={}, recorded_at=recorded_at
    )
    assert unpriced.cost_nanos == 0


def test_extras_are_read_tolerantly() -> None:
    assert Extras.of({}) == Extras()
    assert Extras.of({"result": {"prompt_version": "judge-2025-1"}}).prompt_version == (
        "judge-2025-1"
    )
    assert Extras.of({"prompt_version": 3}).prompt_version == "3"
    assert Extras.of({"result": "garbage", "api_key_id": "k1"}) == Extras(api_key_id="k1")
    task = completed_task_of(_completed(), extras=Extras(prompt_version="judge-2025-1"))
    assert (task.task_id, task.generation, task.rubric_version) == ("t1", 2, "judge-2025-1")
    assert not task.cached


def test_the_catalogue_notes_a_result_the_cache_answered() -> None:
    """The fan-out sends its re-score after the others, for the cache to answer it."""
    task = completed_task_of(_completed(cached=True), extras=Extras(prompt_version="v1"))
    assert task.cached


@pytest.mark.parametrize(
    ("first", "last", "detail"),
    [
        ("2025-02-01", "2025-01-31", "must not be before"),
        ("2025-13-01", "2025-12-31", "YYYY-MM-DD"),
        ("yesterday", "2025-01-01", "YYYY-MM-DD"),
        # ISO 8601's other forms, which `date.fromisoformat` takes.
        ("2025-W01-1", "2025-01-31", "YYYY-MM-DD"),
        ("2025-01-01", "20250131", "YYYY-MM-DD"),
        ("2025-001", "2025-01-31", "YYYY-MM-DD"),
        ("2025-01-01", "2025-01-3\u0661", "YYYY-MM-DD"),  # an Arabic-Indic digit
        ("2025-02-30", "2025-03-01", "YYYY-MM-DD"),
        ("2024-01-01", "2025-01-01", "at most 366 days"),
    ],
)
def test_bad_usage_ranges_are_422(first: str, last: str, detail: str) -> None:
    with pytest.raises(Problem, match=detail) as raised:
        usage_range(first, last)
    assert raised.value.status == 422


def test_good_usage_range() -> None:
    assert usage_range("2025-01-01", "2025-01-01")[0].isoformat() == "2025-01-01"
    assert usage_range("2024-01-01", "2024-12-31")[1].isoformat() == "2024-12-31"


def test_daily_view_reports_cost_only_when_priced() -> None:
    row = DailyUsage("acme", "2025-03-01", 3, 3000, 300, 630_000, priced_requests=3)
    view = DailyUsageView.of(row)
    assert (view.total_tokens, view.cost, view.unpriced_requests) == (3300, 0.00063, 0)
    unpriced = DailyUsageView.of(DailyUsage("acme", "2025-03-01", 2, 10, 1, 0, priced_requests=0))
    assert unpriced.cost is None
    assert unpriced.unpriced_requests == 2


def test_the_cost_is_unknown_only_when_requests_had_no_price() -> None:
    """A period without requests costs 0 (it was null, read as unknown); requests none of
    which had a price cost null; priced ones their sum, unpriced ones counted apart."""
    assert _totals([]).cost == 0
    unpriced = DailyUsage("acme", "2025-01-02", 2, 10, 1, 0, priced_requests=0)
    assert _totals([unpriced]).cost is None
    assert DailyUsageView.of(unpriced).cost is None
    priced = DailyUsage("acme", "2025-01-03", 1, 10, 1, 1_500_000, priced_requests=1)
    both = _totals([unpriced, priced])
    assert (both.cost, both.unpriced_requests) == (0.0015, 2)
