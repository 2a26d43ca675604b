"""Cron schedule math: tables across time zones and DST edges (no clock, no I/O)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from services.scheduler.cron import (
    latest_fire_time,
    next_fire_time,
    next_fire_times,
    validate_spec,
    zone,
)
from services.scheduler.errors import ConfigurationError


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


NEXT_FIRE_TIMES = [
    pytest.param(
        "5 * * * *",
        "UTC",
        "2025-01-01T10:04:59",
        ["2025-01-01T10:05", "2025-01-01T11:05", "2025-01-01T12:05"],
        id="hourly-utc",
    ),
    pytest.param(
        "5 * * * *",
        "UTC",
        "2025-01-01T10:05:00",
        ["2025-01-01T11:05", "2025-01-01T12:05"],
        id="after-is-exclusive",
    ),
    pytest.param(
        "*/10 * * * *",
        "UTC",
        "2025-01-01T23:55:00",
        ["2025-01-02T00:00", "2025-01-02T00:10"],
        id="every-10m-over-midnight",
    ),
    # Asia/Shanghai: UTC+8 all year, 03:00 local is 19:00 UTC the day before.
    pytest.param(
        "0 3 * * *",
        "Asia/Shanghai",
        "2025-03-29T12:00:00",
        ["2025-03-29T19:00", "2025-03-30T19:00", "2025-03-31T19:00"],
        id="shanghai-daily-no-dst",
    ),
    # Europe/Berlin, spring forward 2025-03-30 02:00 CET -> 03:00 CEST: 02:30 does not exist
    # that day and fires at 03:00 CEST (01:00 UTC), once.
    pytest.param(
        "30 2 * * *",
        "Europe/Berlin",
        "2025-03-28T12:00:00",
        ["2025-03-29T01:30", "2025-03-30T01:00", "2025-03-31T00:30"],
        id="berlin-spring-forward-shifted",
    ),
    # What the hour field matches draws the line, not how it is written: a step that leaves
    # hours out shifts (02:30 to 03:00 CEST), a range of every hour does not (a review).
    pytest.param(
        "30 */2 * * *",
        "Europe/Berlin",
        "2025-03-29T23:00:00",
        ["2025-03-29T23:30", "2025-03-30T01:00", "2025-03-30T02:30"],
        id="berlin-spring-forward-step-shifted",
    ),
    pytest.param(
        "30 0-23 * * *",
        "Europe/Berlin",
        "2025-03-29T23:00:00",
        ["2025-03-29T23:30", "2025-03-30T00:30", "2025-03-30T01:30"],
        id="berlin-spring-forward-every-hour-range",
    ),
    # ...and an hourly job simply has no 02:00 that day.
    pytest.param(
        "0 * * * *",
        "Europe/Berlin",
        "2025-03-29T23:30:00",
        ["2025-03-30T00:00", "2025-03-30T01:00", "2025-03-30T02:00"],
        id="berlin-spring-forward-hourly",
    ),
    # Europe/Berlin, fall back 2025-10-26 03:00 CEST -> 02:00 CET: 02:30 happens twice and
    # fires at each occurrence (00:30 and 01:30 UTC).
    pytest.param(
        "30 2 * * *",
        "Europe/Berlin",
        "2025-10-24T12:00:00",
        ["2025-10-25T00:30", "2025-10-26T00:30", "2025-10-26T01:30", "2025-10-27T01:30"],
        id="berlin-fall-back-twice",
    ),
    pytest.param(
        "0 * * * *",
        "Europe/Berlin",
        "2025-10-25T23:30:00",
        ["2025-10-26T00:00", "2025-10-26T01:00", "2025-10-26T02:00"],
        id="berlin-fall-back-hourly",
    ),
    # America/New_York, spring forward 2025-03-09 02:00 EST -> 03:00 EDT.
    pytest.param(
        "30 2 * * *",
        "America/New_York",
        "2025-03-08T12:00:00",
        ["2025-03-09T07:00", "2025-03-10T06:30"],
        id="new-york-spring-forward",
    ),
    # America/New_York, fall back 2025-11-02 02:00 EDT -> 01:00 EST: 01:30 twice.
    pytest.param(
        "30 1 * * *",
        "America/New_York",
        "2025-11-01T12:00:00",
        ["2025-11-02T05:30", "2025-11-02T06:30", "2025-11-03T06:30"],
        id="new-york-fall-back-twice",
    ),
    # Australia/Lord_Howe, spring forward by 30 minutes 2026-10-04 02:00 +10:30 -> 02:30 +11
    # (15:30 UTC): as in Berlin, a time in the gap of a job naming its hours fires at the
    # gap's end, once; one of every hour has none there (no 02:00, no 02:20; a review
    # read the rule as shifting those too).
    pytest.param(
        "10 1-3 * * *",
        "Australia/Lord_Howe",
        "2026-10-03T14:00:00",
        ["2026-10-03T14:40", "2026-10-03T15:30", "2026-10-03T16:10"],
        id="lord-howe-half-hour-spring-forward-shifted",
    ),
    pytest.param(
        "*/20 * * * *",
        "Australia/Lord_Howe",
        "2026-10-03T15:00:00",
        ["2026-10-03T15:10", "2026-10-03T15:40", "2026-10-03T16:00"],
        id="lord-howe-half-hour-spring-forward-every-hour",
    ),
    # Australia/Lord_Howe, fall back by 30 minutes 2025-04-06 02:00 +11 -> 01:30 +10:30
    # (15:00 UTC): 01:40 happens twice and fires twice. croniter, started before the fall-back,
    # stepped over the second one (found in review).
    pytest.param(
        "*/20 * * * *",
        "Australia/Lord_Howe",
        "2025-04-05T14:30:00",
        ["2025-04-05T14:40", "2025-04-05T15:10", "2025-04-05T15:30"],
        id="lord-howe-half-hour-fall-back",
    ),
    pytest.param(
        "*/20 * * * *",
        "Australia/Lord_Howe",
        "2025-04-05T14:40:00",
        ["2025-04-05T15:10", "2025-04-05T15:30"],
        id="lord-howe-from-the-last-fire-before-the-fall-back",
    ),
]


@pytest.mark.parametrize(("spec", "tz", "after", "expected"), NEXT_FIRE_TIMES)
def test_next_fire_times(spec: str, tz: str, after: str, expected: list[str]) -> None:
    start = utc(after)
    wanted = [utc(item) for item in expected]
    found = next_fire_times(spec, tz, start, wanted[-1])
    assert found == wanted
    assert all(t.tzinfo is not None and t.utcoffset() == timedelta(0) for t in found)
    assert next_fire_time(spec, tz, start) == wanted[0]


def test_window_is_after_exclusive_until_inclusive_and_limited() -> None:
    after, until = utc("2025-01-01T10:00:00"), utc("2025-01-01T11:00:00")
    found = next_fire_times("*/15 * * * *", "UTC", after, until)
    assert found == [utc(f"2025-01-01T{t}") for t in ("10:15", "10:30", "10:45", "11:00")]
    assert next_fire_times("*/15 * * * *", "UTC", after, until, limit=2) == found[:2]
    assert next_fire_times("*/15 * * * *", "UTC", after, after) == []


@pytest.mark.parametrize(
    ("spec", "tz", "at", "expected"),
    [
        ("5 * * * *", "UTC", "2025-01-01T10:05:00", "2025-01-01T10:05:00"),  # inclusive
        ("5 * * * *", "UTC", "2025-01-01T10:04:59", "2025-01-01T09:05:00"),
        ("0 3 * * *", "Asia/Shanghai", "2025-06-01T18:59:59", "2025-05-31T19:00:00"),
        ("30 2 * * *", "Europe/Berlin", "2025-10-26T12:00:00", "2025-10-26T01:30:00"),
        ("*/20 * * * *", "Australia/Lord_Howe", "2025-04-05T15:20:00", "2025-04-05T15:10:00"),
    ],
)
def test_latest_fire_time(spec: str, tz: str, at: str, expected: str) -> None:
    assert latest_fire_time(spec, tz, utc(at)) == utc(expected)


@pytest.mark.parametrize(
    ("spec", "after"),
    [("0 0 30 2 *", "2025-01-01T00:00:00"), ("0 0 1 1 * 0 2026", "2026-01-01T00:00:00")],
)
def test_a_schedule_without_a_later_date_has_no_next_fire_time(spec: str, after: str) -> None:
    start = utc(after)
    assert next_fire_time(spec, "UTC", start) is None
    assert next_fire_times(spec, "UTC", start, start + timedelta(days=3 * 366)) == []


def test_a_schedule_fires_up_to_its_last_date() -> None:
    spec, start = "0 0 1 1 * 0 2026", utc("2025-12-31T00:00:00")
    assert next_fire_times(spec, "UTC", start, utc("2030-01-01T00:00:00")) == [
        utc("2026-01-01T00:00:00")
    ]


def test_instants_in_other_offsets_are_the_same_instants() -> None:
    shanghai_noon = datetime(2025, 1, 1, 12, tzinfo=timezone(timedelta(hours=8)))
    assert next_fire_time("5 * * * *", "UTC", shanghai_noon) == utc("2025-01-01T04:05:00")


def test_naive_instants_are_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        next_fire_time("5 * * * *", "UTC", datetime(2025, 1, 1))  # noqa: DTZ001


@pytest.mark.parametrize("spec", ["61 * * * *", "* * *", "every hour", ""])
def test_invalid_expressions_are_configuration_errors(spec: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid cron expression"):
        validate_spec(spec)


@pytest.mark.parametrize("spec", ["5 * * * *", "@hourly", "*/10 * * * *", "0 3 * * 1-5"])
def test_valid_expressions(spec: str) -> None:
    assert validate_spec(spec) == spec


@pytest.mark.parametrize(
    "spec", ["R * * * *", "0 R(0-5) * * *", "r/15 * * * *", "* * * * * R", "H * * * *"]
)
def test_random_and_hashed_fields_are_refused(spec: str) -> None:
    """croniter accepts `R`: each iterator draws its own minute, so the dispatcher's plan, its
    next due time and every replica disagreed, and the job fired several times an hour (or
    never). `H` needs a hash id nothing here gives; refused with the same reason."""
    with pytest.raises(ConfigurationError, match="random or hashed fields"):
        validate_spec(spec)


@pytest.mark.parametrize("spec", ["0 0 * MAR THU", "0 12 * JAN,FEB MON#2", "0 0 * * SUN"])
def test_names_with_an_r_or_an_h_are_not_random_fields(spec: str) -> None:
    assert validate_spec(spec) == spec


def test_unknown_zone_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="unknown time zone"):
        zone("Mars/Olympus_Mons")
