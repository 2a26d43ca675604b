"""Missed-firing policies and run back-off: pure functions of an injected `now`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from services.scheduler.config import MissedFirings
from services.scheduler.runs import RetryPolicy
from services.scheduler.schedule import MISSED_COUNT_CAP, FiringPlan, ScheduledJob, plan_firings

GRACE = timedelta(seconds=60)


def at(text: str) -> datetime:
    return datetime.fromisoformat(f"2025-01-01T{text}").replace(tzinfo=UTC)


def hourly(missed: MissedFirings) -> ScheduledJob:
    return ScheduledJob("job", "5 * * * *", "UTC", missed, enabled=True)


PLANS = [
    # (policy, last recorded fire time, now, expected plan)
    pytest.param(MissedFirings.COALESCE, at("10:05"), at("10:59"), FiringPlan(), id="none-due"),
    pytest.param(
        MissedFirings.COALESCE,
        at("10:05"),
        at("11:05:00.3"),
        FiringPlan(run=at("11:05")),
        id="on-time",
    ),
    pytest.param(
        MissedFirings.SKIP,
        at("10:05"),
        at("11:05:59"),
        FiringPlan(run=at("11:05")),
        id="skip-within-grace-runs",
    ),
    pytest.param(
        MissedFirings.COALESCE,
        at("10:05"),
        at("11:30"),
        FiringPlan(run=at("11:05")),
        id="coalesce-late-runs",
    ),
    pytest.param(
        MissedFirings.SKIP,
        at("10:05"),
        at("11:30"),
        FiringPlan(skip=at("11:05"), missed=1),
        id="skip-late-skips",
    ),
    pytest.param(
        MissedFirings.COALESCE,
        at("05:05"),
        at("10:30"),
        FiringPlan(run=at("10:05"), missed=4),
        id="coalesce-five-missed-runs-latest-once",
    ),
    pytest.param(
        MissedFirings.SKIP,
        at("05:05"),
        at("10:30"),
        FiringPlan(skip=at("10:05"), missed=5),
        id="skip-five-missed-runs-none",
    ),
    pytest.param(
        MissedFirings.SKIP,
        at("05:05"),
        at("10:05:30"),
        FiringPlan(run=at("10:05"), missed=4),
        id="skip-runs-the-on-time-one-only",
    ),
    # No history: nothing to catch up, only a fire time within the grace is due.
    pytest.param(
        MissedFirings.COALESCE,
        None,
        at("10:05:30"),
        FiringPlan(run=at("10:05")),
        id="first-start-on-time",
    ),
    pytest.param(MissedFirings.COALESCE, None, at("10:30"), FiringPlan(), id="first-start-late"),
]


@pytest.mark.parametrize(("policy", "last", "now", "expected"), PLANS)
def test_plan_firings(
    policy: MissedFirings, last: datetime | None, now: datetime, expected: FiringPlan
) -> None:
    assert plan_firings(hourly(policy), last=last, now=now, grace=GRACE) == expected


def test_a_very_long_outage_still_finds_the_latest_fire_time() -> None:
    every_minute = ScheduledJob("job", "* * * * *", "UTC", MissedFirings.COALESCE, enabled=True)
    last = at("00:00")
    now = last + timedelta(days=3, seconds=30)
    plan = plan_firings(every_minute, last=last, now=now, grace=GRACE)
    assert plan.run == now.replace(second=0)
    assert plan.missed == MISSED_COUNT_CAP  # saturated, not exact


def test_plan_in_a_time_zone() -> None:
    shanghai = ScheduledJob("job", "0 3 * * *", "Asia/Shanghai", MissedFirings.SKIP, enabled=True)
    now = datetime(2025, 6, 1, 19, 0, 10, tzinfo=UTC)  # 03:00:10 in Shanghai
    plan = plan_firings(shanghai, last=now - timedelta(days=1), now=now, grace=GRACE)
    assert plan == FiringPlan(run=datetime(2025, 6, 1, 19, tzinfo=UTC))


@pytest.mark.parametrize(
    ("attempt", "seconds"), [(1, 5), (2, 10), (3, 20), (4, 40), (7, 300), (20, 300)]
)
def test_retry_back_off_doubles_and_is_capped(attempt: int, seconds: int) -> None:
    policy = RetryPolicy(max_attempts=4, base=timedelta(seconds=5), cap=timedelta(seconds=300))
    assert policy.delay(attempt) == timedelta(seconds=seconds)


@pytest.mark.parametrize("attempt", [45, 64, 1_000, 1_000_000])
def test_retry_back_off_of_a_late_attempt_is_the_cap(attempt: int) -> None:
    """`base * 2**(attempt - 1)` overflowed `timedelta` from attempt 45 of a 5 s base,
    before the cap was applied: the run's decision raised instead of retrying."""
    policy = RetryPolicy(max_attempts=4, base=timedelta(seconds=5), cap=timedelta(seconds=600))
    assert policy.delay(attempt) == policy.cap


@pytest.mark.parametrize(
    ("base", "cap"),
    [
        (timedelta(microseconds=1), timedelta(days=365)),
        (timedelta(seconds=5), timedelta(seconds=5)),
        (timedelta(seconds=600), timedelta(seconds=5)),  # a cap below the base
        (timedelta(seconds=3), timedelta(seconds=1000)),
    ],
)
def test_retry_back_off_never_passes_its_cap(base: timedelta, cap: timedelta) -> None:
    policy = RetryPolicy(max_attempts=4, base=base, cap=cap)
    delays = [policy.delay(attempt) for attempt in range(1, 200)]
    assert delays == sorted(delays)
    assert max(delays) == delays[-1] == cap
