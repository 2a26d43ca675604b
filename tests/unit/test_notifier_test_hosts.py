"""`WEBHOOK_TEST_HOST_ADDRESSES`: a test-only table of names the notifier answers before DNS.

Off by default; each entry is `name=address`: a name under a reserved test TLD (`.test`,
`.example`, `.invalid`) mapped to a loopback address (127.0.0.0/8, ::1); a name must also be
in `WEBHOOK_ALLOWED_TEST_HOSTS` (the one setting that grants the exemption) and be one the
gateway accepts in a callback URL; anything else stops the notifier at start.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import pytest
from pydantic import ValidationError

from services.notifier.errors import UnsafeDestination
from services.notifier.settings import NotifierSettings, parse_test_host_addresses
from services.notifier.ssrf import TestHostAddresses, WebhookGuard
from shared.webhook_urls import IPAddress

NAME = "receiver.scorebox.test"
ALLOWED = frozenset({NAME})


def _settings(**env: str) -> NotifierSettings:
    return NotifierSettings.model_validate(env)


def test_off_by_default() -> None:
    assert _settings().test_host_table == {}


def test_a_mapping_of_an_allowed_name_is_read() -> None:
    settings = _settings(
        WEBHOOK_ALLOWED_TEST_HOSTS=f"{NAME},127.0.0.1",
        WEBHOOK_TEST_HOST_ADDRESSES=f" {NAME.upper()} = 127.0.0.1 ,{NAME}=::1,{NAME}=127.0.0.1",
    )

    assert settings.test_host_table == {
        NAME: (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
    }


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (f"{NAME}", "is not name=address"),
        (f"{NAME}=", "is not name=address"),
        ("=127.0.0.1", "is not name=address"),
        (f"{NAME}=localhost", "is not an IP address"),
        (f"{NAME}=127.1", "is not an IP address"),
        ("127.0.0.1=127.0.0.1", "is an address; map a host name"),
        ("[::1]=127.0.0.1", "is an address; map a host name"),
        ("receiver.localhost=127.0.0.1", "the gateway refuses callback URLs"),
        ("receiver=127.0.0.1", "the gateway refuses callback URLs"),
        ("other.scorebox.test=127.0.0.1", "not in WEBHOOK_ALLOWED_TEST_HOSTS"),
        # Only reserved test names, only loopback addresses (found in review: any name could
        # be mapped to any address, a real domain's webhooks sent to another machine).
        ("example.com=127.0.0.1", "is not under a reserved test TLD"),
        ("scorebox.test.com=127.0.0.1", "is not under a reserved test TLD"),
        ("receiver.testing=127.0.0.1", "is not under a reserved test TLD"),
        (f"{NAME}=10.0.0.5", "is not a loopback address"),
        (f"{NAME}=93.184.215.14", "is not a loopback address"),
        (f"{NAME}=0.0.0.0", "is not a loopback address"),
        (f"{NAME}=::ffff:127.0.0.1", "is not a loopback address"),
        (f"{NAME}=::1%1", "is not a loopback address"),
        (f"{NAME}=fe80::1", "is not a loopback address"),
    ],
)
def test_refused_entries_name_what_is_wrong(raw: str, says: str) -> None:
    allowed = ALLOWED | {"127.0.0.1", "::1", "example.com", "scorebox.test.com"}
    with pytest.raises(ValueError, match="WEBHOOK_TEST_HOST_ADDRESSES") as refused:
        parse_test_host_addresses(raw, allowed=allowed | {"receiver.testing"})

    assert says in str(refused.value)


def test_every_reserved_test_tld_maps_to_any_loopback_address() -> None:
    names = ("a.scorebox.test", "b.example", "c.invalid", "d.scorebox.test.")
    raw = ",".join(f"{name}={address}" for name in names for address in ("127.9.8.7", "::1"))

    table = parse_test_host_addresses(raw, allowed=frozenset(names))

    loopback = (ipaddress.ip_address("127.9.8.7"), ipaddress.ip_address("::1"))
    assert table == dict.fromkeys(names, loopback)


def test_the_notifier_refuses_to_start_with_a_real_name_or_another_address() -> None:
    with pytest.raises(ValidationError, match="is not under a reserved test TLD"):
        _settings(
            WEBHOOK_ALLOWED_TEST_HOSTS="hooks.example.com",
            WEBHOOK_TEST_HOST_ADDRESSES="hooks.example.com=127.0.0.1",
        )
    with pytest.raises(ValidationError, match="is not a loopback address"):
        _settings(
            WEBHOOK_ALLOWED_TEST_HOSTS=NAME, WEBHOOK_TEST_HOST_ADDRESSES=f"{NAME}=192.168.1.10"
        )


def test_the_notifier_refuses_to_start_with_a_name_not_also_allowed() -> None:
    """The mapping alone grants no exemption: the settings are refused, not half applied."""
    with pytest.raises(ValidationError, match="not in WEBHOOK_ALLOWED_TEST_HOSTS"):
        _settings(WEBHOOK_TEST_HOST_ADDRESSES=f"{NAME}=127.0.0.1")
    with pytest.raises(ValidationError, match="not in WEBHOOK_ALLOWED_TEST_HOSTS"):
        # the address allowed is not the name allowed
        _settings(
            WEBHOOK_ALLOWED_TEST_HOSTS="127.0.0.1",
            WEBHOOK_TEST_HOST_ADDRESSES=f"{NAME}=127.0.0.1",
        )


class Dns:
    """The resolver behind the table: records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        self.asked.append(host)
        return [ipaddress.ip_address("93.184.215.14")]


async def test_the_table_answers_its_names_before_dns_and_dns_the_others() -> None:
    dns = Dns()
    table = parse_test_host_addresses(f"{NAME}=127.0.0.1", allowed=ALLOWED)
    guard = WebhookGuard(TestHostAddresses(table, dns), allowed_test_hosts=ALLOWED)

    local = await guard.vet(f"https://{NAME}:8443/hooks")
    public = await guard.vet("https://example.com/hooks")

    assert local.addresses == (ipaddress.ip_address("127.0.0.1"),)
    assert public.addresses == (ipaddress.ip_address("93.184.215.14"),)
    assert dns.asked == ["example.com"]


async def test_a_mapped_name_the_guard_does_not_exempt_is_still_refused() -> None:
    """The table answers lookups only; the guard judges the answer as any other."""
    table = {NAME: (ipaddress.ip_address("127.0.0.1"),)}
    guard = WebhookGuard(TestHostAddresses(table, Dns()))

    with pytest.raises(UnsafeDestination, match="non-public"):
        await guard.vet(f"https://{NAME}/hooks")
