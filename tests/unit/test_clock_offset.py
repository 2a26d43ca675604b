"""A service's clock checked against its database's at start-up (`shared/clock_offset.py`)."""

from __future__ import annotations

import logging

import pytest

from shared.clock_offset import ClockOffsetTooLarge, check_clock_offset


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
