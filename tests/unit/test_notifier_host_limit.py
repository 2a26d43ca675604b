"""The notifier's bounds per destination and per tenant: their slots, the reserve kept for
idle tenants, what one destination is, their settings; and the lease of a delivery's
claim."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import pytest
from pydantic import ValidationError

from services.notifier.hosts import BUSY, RESERVE, Slots, TenantSlots, destination_of
from services.notifier.settings import NotifierSettings
from services.notifier.ssrf import WebhookGuard
from shared.webhook_urls import IPAddress


class NoDns:
    """Where a destination is read, nothing is resolved."""

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        raise AssertionError(f"resolved {host}")


GUARD = WebhookGuard(NoDns())


def test_a_destination_gets_its_bound_of_slots_and_no_more() -> None:
    hosts = Slots(2)
    with (
        hosts.taking("https://a.example:443") as first,
        hosts.taking("https://a.example:443") as second,
    ):
        with hosts.taking("https://a.example:443") as third:
            assert (first, second, third) == (True, True, False)
            assert hosts.in_flight("https://a.example:443") == 2
        with hosts.taking("https://b.example:443") as elsewhere:
            assert elsewhere
    assert hosts.in_flight("https://a.example:443") == 0


def test_a_slot_is_given_back_when_its_block_fails() -> None:
    hosts = Slots(1)
    with pytest.raises(RuntimeError), hosts.taking("https://a.example:443"):
        raise RuntimeError("the POST crashed")
    with hosts.taking("https://a.example:443") as again:
        assert again


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Slots(0)


def _take(slots: Slots, stack: ExitStack, *keys: str) -> list[bool]:
    return [stack.enter_context(slots.taking(key)) for key in keys]


def test_a_tenant_holding_a_slot_is_refused_the_reserve_a_tenant_holding_none_is_not() -> None:
    """4 slots shared (WEBHOOK_CONCURRENCY), bound 2: two hanging tenants at their bound
    held every one, and a third tenant's webhook waited for one of their timeouts."""
    tenants = TenantSlots(2, shared=4)
    with ExitStack() as stack:
        assert _take(tenants, stack, "a", "a", "c") == [True, True, True]
        assert (tenants.refusal("a"), tenants.refusal("c")) == (BUSY, None)
        assert _take(tenants, stack, "c") == [True]  # the last shared slot
        assert tenants.total == 4
        assert tenants.refusal("c") == BUSY
        assert _take(tenants, stack, "b", "d") == [True, True]  # the reserve: none in flight
        assert (tenants.refusal("b"), tenants.refusal("d")) == (RESERVE, RESERVE)
        assert _take(tenants, stack, "b") == [False]
        assert tenants.total == 6
    assert tenants.total == 0


def test_only_the_reserve_is_refused_a_tenant_under_its_bound() -> None:
    tenants = TenantSlots(3, shared=4)
    with ExitStack() as stack:
        _take(tenants, stack, "a", "a", "c", "d")
        assert (tenants.refusal("a"), tenants.refusal("c")) == (RESERVE, RESERVE)
        assert _take(tenants, stack, "c") == [False]
        assert tenants.in_flight("c") == 1
    with ExitStack() as stack:  # given back: shared again
        assert _take(tenants, stack, "c", "c", "c") == [True] * 3


def test_a_lone_tenant_gets_its_deliveries_through_with_a_concurrency_of_1() -> None:
    settings = _settings(WEBHOOK_CONCURRENCY="1")
    assert (settings.per_tenant, settings.deliveries_in_hand) == (1, 2)
    tenants = TenantSlots(settings.per_tenant, shared=settings.concurrency)
    for _ in range(3):  # one after another, each through
        with ExitStack() as stack:
            assert _take(tenants, stack, "a", "a", "b") == [True, False, True]


def test_a_tenant_bound_above_the_shared_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="shared"):
        TenantSlots(5, shared=4)


@pytest.mark.parametrize(
    ("concurrency", "reserve"), [("1", 1), ("3", 1), ("4", 1), ("8", 2), ("32", 8), ("1024", 256)]
)
def test_the_reserve_is_a_quarter_of_the_concurrency_at_least_1_and_held_too(
    concurrency: str, reserve: int
) -> None:
    settings = _settings(WEBHOOK_CONCURRENCY=concurrency)
    assert settings.tenant_reserve == reserve
    assert settings.deliveries_in_hand == settings.concurrency + reserve


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/a",
        "HTTPS://Hooks.Example.COM/b?x=1",
        "https://hooks.example.com:443/c",
        "https://hooks.example.com./d",
    ],
)
def test_one_destination_is_scheme_host_and_port(url: str) -> None:
    assert destination_of(url, GUARD) == "https://hooks.example.com:443"


def test_another_port_is_another_destination() -> None:
    assert destination_of("https://hooks.example.com:8443/a", GUARD) == (
        "https://hooks.example.com:8443"
    )
    assert destination_of("https://[2606:4700::1]/a", GUARD) == "https://[2606:4700::1]:443"


@pytest.mark.parametrize(
    "url",
    [
        "http://hooks.example.com/a",
        # urlsplit cannot read these: a ValueError crashed the delivery's handler.
        "https://[hooks.example.com]/a",
        "https://[::1/a",
        "https://hooks.example.com:443\uff03@evil/a",
    ],
)
def test_a_url_the_guard_refuses_counts_against_itself(url: str) -> None:
    assert destination_of(url, GUARD) == url


def _settings(**env: str) -> NotifierSettings:
    return NotifierSettings.model_validate(env)


def test_the_bound_defaults_to_8_and_never_above_the_concurrency() -> None:
    assert _settings().per_host == 8
    assert _settings(WEBHOOK_CONCURRENCY="4").per_host == 4
    assert _settings(WEBHOOK_CONCURRENCY="4", WEBHOOK_CONCURRENCY_PER_HOST="4").per_host == 4
    assert _settings(WEBHOOK_CONCURRENCY_PER_HOST="1").per_host == 1


@pytest.mark.parametrize(
    "env",
    [
        {"WEBHOOK_CONCURRENCY_PER_HOST": "0"},
        {"WEBHOOK_CONCURRENCY": "4", "WEBHOOK_CONCURRENCY_PER_HOST": "5"},
        {"WEBHOOK_CONCURRENCY_PER_HOST": "33"},
    ],
)
def test_a_bound_below_one_or_above_the_concurrency_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ValidationError, match=r"WEBHOOK_CONCURRENCY_PER_HOST|greater than"):
        _settings(**env)


def test_the_tenant_bound_defaults_to_half_the_concurrency() -> None:
    assert _settings().per_tenant == 16
    assert _settings(WEBHOOK_CONCURRENCY="4").per_tenant == 2
    assert _settings(WEBHOOK_CONCURRENCY="1").per_tenant == 1
    assert _settings(WEBHOOK_CONCURRENCY="4", WEBHOOK_CONCURRENCY_PER_TENANT="4").per_tenant == 4
    assert _settings(WEBHOOK_CONCURRENCY_PER_TENANT="1").per_tenant == 1


@pytest.mark.parametrize(
    "env",
    [
        {"WEBHOOK_CONCURRENCY_PER_TENANT": "0"},
        {"WEBHOOK_CONCURRENCY": "4", "WEBHOOK_CONCURRENCY_PER_TENANT": "5"},
        {"WEBHOOK_CONCURRENCY_PER_TENANT": "33"},
    ],
)
def test_a_tenant_bound_below_one_or_above_the_concurrency_is_refused(
    env: dict[str, str],
) -> None:
    with pytest.raises(ValidationError, match=r"WEBHOOK_CONCURRENCY_PER_TENANT|greater than"):
        _settings(**env)


def test_a_claims_lease_covers_the_post_and_the_database_calls_around_it() -> None:
    """DNS check + request, then the claim's write, the keyring read and the recording of
    the outcome, each up to MONGO_TIMEOUT_S, and 30 s to spare."""
    settings = _settings(
        WEBHOOK_DNS_TIMEOUT_S="5",
        WEBHOOK_TIMEOUT_S="10",
        MONGO_TIMEOUT_S="20",
        MAX_CLOCK_OFFSET_S="7",
    )
    assert settings.post_s == 15
    # And twice the clocks' offset: a replica whose clock runs ahead read a live lease ended.
    assert settings.lease_s == 15 + 3 * 20 + 2 * 7 + 30


def test_timeouts_that_hold_a_redelivery_past_the_consumer_timeout_are_refused() -> None:
    """Each was bounded alone: 600 s of DNS and 600 s of request held a redelivery (another
    replica's lease waited out, then its own POST) about 2,500 s, past the broker's 30
    minutes, and the channel both consumers share was closed (review)."""
    assert _settings(WEBHOOK_DNS_TIMEOUT_S="300", WEBHOOK_TIMEOUT_S="300")
    with pytest.raises(ValidationError, match="consumer timeout"):
        _settings(WEBHOOK_DNS_TIMEOUT_S="600", WEBHOOK_TIMEOUT_S="600")


def test_delivery_records_that_could_expire_while_their_delivery_retries_are_refused() -> None:
    """Nothing checked it: with a long back-off and many attempts, a record expired while its
    delivery retried, and a duplicate copy of a sent attempt could post it again."""
    assert _settings(WEBHOOK_MAX_ATTEMPTS="8", WEBHOOK_RETRY_CAP_S="3600")
    with pytest.raises(ValidationError, match="WEBHOOK_DELIVERY_RETENTION_S"):
        _settings(WEBHOOK_MAX_ATTEMPTS="50", WEBHOOK_RETRY_CAP_S="86400")
    with pytest.raises(ValidationError, match="WEBHOOK_DELIVERY_RETENTION_S"):
        _settings(WEBHOOK_DELIVERY_RETENTION_S="3600")
