"""A service's clock checked against its database's at start-up (`shared/clock_offset.py`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pymongo import AsyncMongoClient

from shared.clock_offset import ClockOffsetTooLarge, ClockWatch, check_clock_offset
from tests.support import sample

OFFSET = "scorebox_clock_offset_seconds"


@pytest.mark.parametrize(
    ("offset_s", "words"), [(90.0, "90.0 s behind"), (-12.5, "12.5 s ahead of")]
)
def test_an_offset_past_the_maximum_refuses_the_start(offset_s: float, words: str) -> None:
    with pytest.raises(
        ClockOffsetTooLarge, match=f"gateway's clock is {words} the database"
    ) as refused:
        check_clock_offset(offset_s, max_offset_s=10.0, service="gateway")
    assert "MAX_CLOCK_OFFSET_S (10 s)" in str(refused.value)
    assert "NTP" in str(refused.value)


def test_a_smaller_offset_is_a_warning_and_a_tiny_one_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="scorebox.clock"):
        check_clock_offset(0.4, max_offset_s=10.0, service="scorer")
        assert caplog.records == []
        check_clock_offset(-3.0, max_offset_s=10.0, service="scorer")
    assert [record.getMessage() for record in caplog.records] == [
        "scorer's clock is 3.0 s ahead of the database server's (MAX_CLOCK_OFFSET_S: 10 s)"
    ]


def test_no_maximum_checks_nothing() -> None:
    check_clock_offset(86_400.0, max_offset_s=0, service="status")


class Monotonic:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watch(monotonic: Monotonic, registry: CollectorRegistry | None = None) -> ClockWatch:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(connect=False)
    return ClockWatch(
        client,
        max_offset_s=5.0,
        service="scorer",
        registry=CollectorRegistry() if registry is None else registry,
        monotonic=monotonic,
    )


def _logged_once_a_minute(
    watch: ClockWatch,
    monotonic: Monotonic,
    offsets_s: Iterable[float],
    caplog: pytest.LogCaptureFixture,
) -> list[tuple[str, str]]:
    """The lines the watch logs measuring `offsets_s` a minute apart: level, and the words
    before "the database"."""
    with caplog.at_level(logging.INFO, logger="scorebox.clock"):
        for offset_s in offsets_s:
            monotonic.now += 60
            watch.observe(offset_s)
    return [
        (record.levelname, record.getMessage().split(" the database")[0])
        for record in caplog.records
    ]


def test_a_running_services_offset_is_logged_when_it_crosses_a_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    monotonic, registry = Monotonic(), CollectorRegistry()
    watch = _watch(monotonic, registry)
    offsets_s = (0.2, 0.3, 2.0, 2.5, 7.0, 8.0, 2.0, 0.1, 0.1)
    assert _logged_once_a_minute(watch, monotonic, offsets_s, caplog) == [
        ("WARNING", "scorer's clock is 2.0 s behind"),
        ("ERROR", "scorer's clock is 7.0 s behind"),
        ("WARNING", "scorer's clock is 2.0 s behind"),
        ("INFO", "scorer's clock is back within 1 s of"),
    ]
    assert sample(registry, OFFSET) == 0.1


def test_an_offset_past_the_maximum_is_logged_again_every_ten_minutes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    monotonic = Monotonic()
    watch = _watch(monotonic)
    twenty_minutes = [-6.0] * 20
    assert _logged_once_a_minute(watch, monotonic, twenty_minutes, caplog) == [
        ("ERROR", "scorer's clock is 6.0 s ahead of"),
        ("ERROR", "scorer's clock is 6.0 s ahead of"),
    ]


def test_an_offset_hovering_at_a_bound_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Alternating 5.05 and 4.95 s logged five errors and five warnings in ten minutes (a
    review): a level is left downwards only well within its bound."""
    monotonic = Monotonic()
    watch = _watch(monotonic)
    hovering = [5.05, 4.95] * 5
    assert _logged_once_a_minute(watch, monotonic, hovering, caplog) == [
        ("ERROR", "scorer's clock is 5.0 s behind")
    ]


def test_unchecked_the_offset_is_still_exported_and_nothing_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`MAX_CLOCK_OFFSET_S=0` is the way out when the database host's clock alone is off:
    the gauge is what then tells whose clock it is. Until measured it reads NaN, not 0 (in
    step)."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(connect=False)
    registry = CollectorRegistry()
    watch = ClockWatch(client, max_offset_s=0, service="gateway", registry=registry)
    assert math.isnan(sample(registry, OFFSET))
    with caplog.at_level(logging.DEBUG, logger="scorebox.clock"):
        watch.observe(90.0)
    assert sample(registry, OFFSET) == 90.0
    assert caplog.records == []


def test_an_offset_past_the_maximum_again_is_logged_again_and_one_within_it_never_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past it, back in step, past it again within ten minutes: the last line said "back
    within 1 s". Held at its level by the hysteresis, 4.5 s was logged as "more than
    MAX_CLOCK_OFFSET_S (5 s)" ten minutes on (a review)."""
    monotonic = Monotonic()
    watch = _watch(monotonic)
    offsets_s = (7.0, 0.1, 7.0, *[4.5] * 15)
    assert _logged_once_a_minute(watch, monotonic, offsets_s, caplog) == [
        ("ERROR", "scorer's clock is 7.0 s behind"),
        ("INFO", "scorer's clock is back within 1 s of"),
        ("ERROR", "scorer's clock is 7.0 s behind"),
    ]
