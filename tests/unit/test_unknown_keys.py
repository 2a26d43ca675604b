"""The budget of unknown API keys per client address (`services/gateway/unknown_keys.py`)."""

from __future__ import annotations

import pytest

from services.gateway.unknown_keys import Spent, UnknownKeyBudget, address_key


class Ticker:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _spend(budget: UnknownKeyBudget, address: str, times: int) -> None:
    for _ in range(times):
        assert budget.take(address) is None


def _retry_after(budget: UnknownKeyBudget, address: str) -> int:
    spent = budget.take(address)
    assert spent is not None
    return spent.retry_after_s


def test_an_address_has_a_minute_of_budget_refilled_evenly() -> None:
    ticker = Ticker()
    budget = UnknownKeyBudget(6, monotonic=ticker)
    _spend(budget, "192.0.2.1", 6)
    assert _retry_after(budget, "192.0.2.1") == 10  # one back every 60 / 6 s
    ticker.now += 4
    assert _retry_after(budget, "192.0.2.1") == 6
    ticker.now += 6
    _spend(budget, "192.0.2.1", 1)
    assert _retry_after(budget, "192.0.2.1") == 10
    ticker.now += 3600  # refilled to the minute's budget, not beyond
    _spend(budget, "192.0.2.1", 6)
    assert _retry_after(budget, "192.0.2.1") == 10


def test_a_token_given_back_is_there_again_up_to_the_budget() -> None:
    budget = UnknownKeyBudget(2, monotonic=Ticker())
    _spend(budget, "192.0.2.1", 2)
    budget.give_back("192.0.2.1")
    _spend(budget, "192.0.2.1", 1)
    assert budget.take("192.0.2.1") is not None
    for _ in range(5):
        budget.give_back("192.0.2.2")
    _spend(budget, "192.0.2.2", 2)
    assert budget.take("192.0.2.2") is not None


def test_a_zero_budget_bounds_nothing() -> None:
    budget = UnknownKeyBudget(0, monotonic=Ticker())
    _spend(budget, "192.0.2.1", 100)
    assert not budget.enabled


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
    _spend(budget, one, 1)
    assert budget.take(other) is not None


def test_neighbouring_64s_and_non_addresses_count_apart() -> None:
    assert address_key("2001:db8:1:2::1") != address_key("2001:db8:1:3::1")
    assert address_key("unknown") == "unknown"


def test_the_addresses_remembered_stay_bounded_dropping_the_least_recent() -> None:
    budget = UnknownKeyBudget(1, monotonic=Ticker(), max_addresses=3)
    for last in range(1, 5):
        _spend(budget, f"192.0.2.{last}", 1)
    assert len(budget._buckets) == 3
    assert budget.take("192.0.2.4") is not None
    assert budget.take("192.0.2.1") is None  # forgotten: starts afresh


def test_the_replica_bounds_all_addresses_together() -> None:
    """Each address within its own budget: the replica's lookups still have a ceiling, and a
    refusal takes nothing from the address's own budget."""
    ticker = Ticker()
    budget = UnknownKeyBudget(2, replica_per_minute=3, monotonic=ticker)
    _spend(budget, "192.0.2.1", 2)
    _spend(budget, "192.0.2.2", 1)
    assert budget.take("192.0.2.2") == Spent(retry_after_s=20, per_minute=3, replica_wide=True)
    assert budget.take("192.0.2.3") == Spent(retry_after_s=20, per_minute=3, replica_wide=True)
    ticker.now += 20  # one token back for the replica; 2/3 of one for each address
    _spend(budget, "192.0.2.2", 1)  # its second token, not taken by the refusals


def test_both_budgets_spent_the_later_one_is_told() -> None:
    budget = UnknownKeyBudget(1, replica_per_minute=2, monotonic=Ticker())
    _spend(budget, "192.0.2.1", 1)  # its own spent: back in 60 s
    _spend(budget, "192.0.2.2", 1)  # the replica's spent: back in 30 s
    assert budget.take("192.0.2.1") == Spent(retry_after_s=60, per_minute=1, replica_wide=False)
    assert budget.take("192.0.2.3") == Spent(retry_after_s=30, per_minute=2, replica_wide=True)
    ticker = Ticker()
    sooner = UnknownKeyBudget(2, replica_per_minute=3, monotonic=ticker)
    _spend(sooner, "192.0.2.1", 2)
    ticker.now += 29  # its own nearly back; the replica's spent by another address now
    _spend(sooner, "192.0.2.2", 2)
    spent = sooner.take("192.0.2.1")
    assert spent is not None
    assert spent.replica_wide
    assert spent.retry_after_s > 2


def test_a_token_given_back_returns_to_the_replica_too() -> None:
    budget = UnknownKeyBudget(5, replica_per_minute=1, monotonic=Ticker())
    _spend(budget, "192.0.2.1", 1)
    budget.give_back("192.0.2.1")
    _spend(budget, "192.0.2.2", 1)


def test_the_replicas_budget_holds_past_the_addresses_remembered() -> None:
    """Each address forgotten starts afresh: alone, the addresses' budgets bounded nothing
    for a client with more addresses than are remembered."""
    budget = UnknownKeyBudget(1, replica_per_minute=4, monotonic=Ticker(), max_addresses=2)
    taken = sum(budget.take(f"192.0.2.{last}") is None for last in range(1, 100))
    assert taken == 4


def test_a_replica_budget_alone_bounds_every_address() -> None:
    budget = UnknownKeyBudget(0, replica_per_minute=2, monotonic=Ticker())
    assert budget.enabled
    _spend(budget, "192.0.2.1", 2)
    assert budget.take("192.0.2.1") is not None
