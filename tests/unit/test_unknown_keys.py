"""The budget of unknown API keys per client address (`services/gateway/unknown_keys.py`)."""

from __future__ import annotations

import pytest

from services.gateway.unknown_keys import UnknownKeyBudget, address_key


class Ticker:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_an_address_has_a_minute_of_budget_refilled_evenly() -> None:
    ticker = Ticker()
    budget = UnknownKeyBudget(6, monotonic=ticker)
    for _ in range(6):
        assert budget.retry_after_s("192.0.2.1") is None
        budget.spend("192.0.2.1")
    assert budget.retry_after_s("192.0.2.1") == 10  # one back every 60 / 6 s
    ticker.now += 4
    assert budget.retry_after_s("192.0.2.1") == 6
    ticker.now += 6
    assert budget.retry_after_s("192.0.2.1") is None
    budget.spend("192.0.2.1")
    assert budget.retry_after_s("192.0.2.1") == 10
    ticker.now += 3600  # refilled to the minute's budget, not beyond
    for _ in range(6):
        budget.spend("192.0.2.1")
    assert budget.retry_after_s("192.0.2.1") == 10


def test_a_zero_budget_bounds_nothing() -> None:
    budget = UnknownKeyBudget(0, monotonic=Ticker())
    for _ in range(100):
        budget.spend("192.0.2.1")
    assert not budget.enabled
    assert budget.retry_after_s("192.0.2.1") is None


def test_no_address_is_never_counted() -> None:
    budget = UnknownKeyBudget(1, monotonic=Ticker())
    budget.spend(None)
    budget.spend(None)
    assert budget.retry_after_s(None) is None


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:ffff"),
        ("::ffff:192.0.2.1", "192.0.2.1"),
        ("2001:DB8::1", "2001:db8::1"),
    ],
)
def test_an_ipv6_host_counts_by_its_64(one: str, other: str) -> None:
    assert address_key(one) == address_key(other)
    budget = UnknownKeyBudget(1, monotonic=Ticker())
    budget.spend(one)
    assert budget.retry_after_s(other) is not None


def test_neighbouring_64s_and_non_addresses_count_apart() -> None:
    assert address_key("2001:db8:1:2::1") != address_key("2001:db8:1:3::1")
    assert address_key("testclient") == "testclient"


def test_the_addresses_remembered_stay_bounded_dropping_the_least_recent() -> None:
    budget = UnknownKeyBudget(1, monotonic=Ticker(), max_addresses=3)
    for last in range(1, 5):
        budget.spend(f"192.0.2.{last}")
    assert budget.retry_after_s("192.0.2.1") is None  # forgotten: starts afresh
    assert budget.retry_after_s("192.0.2.4") is not None
    assert len(budget._buckets) == 3
