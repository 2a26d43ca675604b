"""The SSRF guard: one table of URLs for the gateway's submit-time check and the notifier's
delivery-time check (the two must agree), and the notifier's address vetting."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Sequence

import pytest

from services.notifier.errors import NoSuchHost, ResolutionFailed, UnsafeDestination
from services.notifier.sender import PinnedResolver
from services.notifier.ssrf import CaresResolver, Destination, WebhookGuard
from shared import webhook_urls as gateway_rules
from shared.webhook_urls import IPAddress
from tests.fake_dns import fake_name_server
from tests.support import eventually

SAFE_URLS = [
    "https://example.com/hook",
    "https://hooks.example.com:8443/a/b?c=d",
    "https://EXAMPLE.com/upper-case-host",
    "https://example.com./trailing-dot",
    "https://93.184.215.14/public-ipv4",
    "https://[2606:4700:4700::1111]/public-ipv6",
    "https://[2606:4700:4700::1111]:8443/public-ipv6-port",
    "https://xn--bcher-kva.example/punycode",
    "https://receiver.scorebox.test/test-tld",
]

UNSAFE_URLS = [
    pytest.param("http://example.com/hook", id="plain-http"),
    pytest.param("ftp://example.com/", id="other-scheme"),
    pytest.param("//example.com/hook", id="scheme-relative"),
    pytest.param("example.com/hook", id="no-scheme"),
    pytest.param("https:///path-only", id="no-host"),
    pytest.param("https://user:pw@example.com/", id="credentials"),
    pytest.param("https://user@example.com/", id="user-only"),
    # After `]` only `:port`: `urlsplit` read the address and ignored the rest, the HTTP
    # client refused the URL, and each such callback ended in the operators' DLQ (review).
    pytest.param("https://[2606:4700::1]x/hook", id="text-after-bracket"),
    pytest.param("https://[::ffff:8.8.8.8]`x//?`<", id="junk-after-bracket"),
    pytest.param("https://[2606:4700::1]]/hook", id="two-brackets"),
    pytest.param("https://example.com:0/", id="port-zero"),
    pytest.param("https://example.com:99999/", id="port-out-of-range"),
    pytest.param("https://example.com/ spaced", id="whitespace"),
    pytest.param("https://example.com\\@evil.com/", id="backslash"),
    pytest.param("https://example.com/" + "a" * 2048, id="too-long"),
    pytest.param("https://127.0.0.1/", id="loopback-v4"),
    pytest.param("https://127.8.9.10/", id="loopback-v4-range"),
    pytest.param("https://10.0.0.1/", id="private-10"),
    pytest.param("https://172.16.5.4/", id="private-172"),
    pytest.param("https://192.168.1.1/", id="private-192"),
    pytest.param("https://100.64.0.1/", id="shared-cgnat"),
    pytest.param("https://169.254.169.254/latest/meta-data/", id="cloud-metadata"),
    pytest.param("https://0.0.0.0/", id="unspecified-v4"),
    pytest.param("https://224.0.0.1/", id="multicast-v4"),
    pytest.param("https://240.0.0.1/", id="reserved-v4"),
    pytest.param("https://255.255.255.255/", id="broadcast"),
    pytest.param("https://[::1]/", id="loopback-v6"),
    pytest.param("https://[::]/", id="unspecified-v6"),
    pytest.param("https://[fe80::1]/", id="link-local-v6"),
    pytest.param("https://[fe80::1%25eth0]/", id="zone-id"),
    pytest.param("https://[fc00::1]/", id="unique-local-v6"),
    pytest.param("https://[ff02::1]/", id="multicast-v6"),
    pytest.param("https://[::ffff:127.0.0.1]/", id="mapped-loopback"),
    pytest.param("https://[::ffff:169.254.169.254]/", id="mapped-metadata"),
    pytest.param("https://[::ffff:a00:1]/", id="mapped-private-hex"),
    pytest.param("https://[::127.0.0.1]/", id="ipv4-compatible"),
    pytest.param("https://[64:ff9b::a00:1]/", id="nat64-private"),
    pytest.param("https://[2002:a00:1::]/", id="6to4-private"),
    pytest.param("https://2130706433/", id="decimal-ipv4"),
    pytest.param("https://0x7f000001/", id="hex-ipv4"),
    pytest.param("https://0177.0.0.1/", id="octal-ipv4"),
    pytest.param("https://0x7f.0.0.1/", id="hex-dotted-ipv4"),
    pytest.param("https://127.1/", id="short-ipv4"),
    pytest.param("https://1.2.3.4./", id="dotted-ipv4-trailing-dot"),
    pytest.param("https://localhost/", id="localhost"),
    pytest.param("https://LOCALHOST./", id="localhost-fqdn"),
    pytest.param("https://api.localhost/", id="localhost-subdomain"),
    pytest.param("https://printer.local/", id="mdns"),
    pytest.param("https://metadata.google.internal/", id="internal-suffix"),
    pytest.param("https://metadata/", id="single-label"),
    pytest.param("https://1.0.0.127.in-addr.arpa/", id="reverse-dns-name"),
    pytest.param("https://bücher.example/", id="non-ascii-host"),
    pytest.param("https://-bad-.example/", id="bad-label"),
    # urlsplit refuses these with a plain ValueError, which passed every caller's catch.
    pytest.param("https://[example.com]/", id="bracketed-name"),
    pytest.param("https://[::1/", id="unclosed-bracket"),
    pytest.param("https://example.com:443\uff03@evil/", id="netloc-changed-by-nfkc"),
]


def _gateway_check(url: str) -> None:
    gateway_rules.validate_webhook_url(url)


def _notifier_check(url: str) -> None:
    WebhookGuard(FakeResolver({})).check(url)


CHECKERS: list[tuple[Callable[[str], None], type[Exception]]] = [
    (_gateway_check, gateway_rules.UnsafeWebhookUrl),
    (_notifier_check, UnsafeDestination),
]
CHECKER_IDS = ["gateway", "notifier"]


class FakeResolver:
    """A resolver answering from a table; counts its lookups."""

    def __init__(self, answers: dict[str, Sequence[str]]) -> None:
        self.answers = answers
        self.lookups: list[str] = []

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        self.lookups.append(host)
        if host not in self.answers:
            raise ResolutionFailed(f"{host} did not resolve")
        return [ipaddress.ip_address(a) for a in self.answers[host]]


@pytest.mark.parametrize(("check", "error"), CHECKERS, ids=CHECKER_IDS)
@pytest.mark.parametrize("url", SAFE_URLS)
def test_public_https_urls_are_accepted(
    check: Callable[[str], None], error: type[Exception], url: str
) -> None:
    check(url)


@pytest.mark.parametrize(("check", "error"), CHECKERS, ids=CHECKER_IDS)
@pytest.mark.parametrize("url", UNSAFE_URLS)
def test_unsafe_urls_are_refused(
    check: Callable[[str], None], error: type[Exception], url: str
) -> None:
    with pytest.raises(error):
        check(url)


ADDRESSES = [
    ("8.8.8.8", True),
    ("93.184.215.14", True),
    ("2606:4700:4700::1111", True),
    ("::ffff:8.8.8.8", True),
    ("127.0.0.1", False),
    ("10.1.2.3", False),
    ("172.31.255.255", False),
    ("192.168.0.1", False),
    ("169.254.169.254", False),
    ("100.100.100.200", False),
    ("0.0.0.0", False),
    ("192.0.2.1", False),
    ("198.18.0.1", False),
    ("224.0.0.251", False),
    ("::1", False),
    ("::", False),
    ("fe80::1", False),
    ("fd00:ec2::254", False),
    ("ff02::1", False),
    ("::ffff:10.0.0.1", False),
    ("::ffff:169.254.169.254", False),
    ("::10.0.0.1", False),
    ("64:ff9b::7f00:1", False),
    ("64:ff9b::808:808", True),  # NAT64, well-known prefix: 8.8.8.8
    ("64:ff9b:1:a00:0:100:808:808", False),  # local-use NAT64: 10.0.0.1 under a /48
    ("64:ff9b:1::808:808", False),
    ("fec0::1", False),  # site-local, deprecated: `is_global` says global
    ("2002:7f00:1::", False),
    ("2001:db8::1", False),
]


@pytest.mark.parametrize(("address", "public"), ADDRESSES)
def test_address_classification(address: str, public: bool) -> None:
    """One rule for both services: the gateway's check of a webhook URL and the notifier's
    `WebhookGuard` both use `shared.webhook_urls.is_public_address`."""
    assert gateway_rules.is_public_address(ipaddress.ip_address(address)) is public


async def test_a_name_resolving_only_to_public_addresses_is_pinned_to_them() -> None:
    resolver = FakeResolver({"hooks.example.com": ["93.184.215.14", "2606:4700::1"]})
    guard = WebhookGuard(resolver)

    destination = await guard.vet("https://hooks.example.com:8443/x")

    assert destination.host == "hooks.example.com"
    assert destination.port == 8443
    assert [str(a) for a in destination.addresses] == ["93.184.215.14", "2606:4700::1"]


@pytest.mark.parametrize(
    "answers",
    [
        ["10.0.0.5"],
        ["93.184.215.14", "127.0.0.1"],
        ["169.254.169.254"],
        ["::ffff:192.168.1.1"],
        ["2606:4700::1", "fe80::1"],
    ],
)
async def test_a_name_with_any_non_public_address_is_refused(answers: list[str]) -> None:
    guard = WebhookGuard(FakeResolver({"rebind.example.com": answers}))

    with pytest.raises(UnsafeDestination, match="non-public"):
        await guard.vet("https://rebind.example.com/hook")


async def test_an_ip_literal_is_not_resolved() -> None:
    resolver = FakeResolver({})

    destination = await WebhookGuard(resolver).vet("https://93.184.215.14/hook")

    assert [str(a) for a in destination.addresses] == ["93.184.215.14"]
    assert resolver.lookups == []


async def test_an_unsafe_url_is_refused_before_any_lookup() -> None:
    resolver = FakeResolver({"localhost": ["127.0.0.1"]})

    with pytest.raises(UnsafeDestination):
        await WebhookGuard(resolver).vet("https://localhost/hook")
    assert resolver.lookups == []


async def test_resolution_failures_are_transient() -> None:
    guard = WebhookGuard(FakeResolver({}))

    with pytest.raises(ResolutionFailed) as failed:
        await guard.vet("https://nowhere.example.com/hook")
    assert not isinstance(failed.value, NoSuchHost)  # no answer may be our resolver's


async def test_a_name_resolving_to_no_address_is_the_names_doing() -> None:
    """An empty answer is DNS's word on the name, as NODATA is: not our resolver failing."""
    guard = WebhookGuard(FakeResolver({"empty.example.com": []}))

    with pytest.raises(NoSuchHost, match=r"empty\.example\.com has no address"):
        await guard.vet("https://empty.example.com/hook")


async def test_allowed_test_hosts_exempt_only_what_they_name() -> None:
    resolver = FakeResolver({"receiver.scorebox.test": ["127.0.0.1"], "other.test": ["10.0.0.1"]})
    guard = WebhookGuard(resolver, allowed_test_hosts=frozenset({"127.0.0.1"}))

    by_name = await guard.vet("https://receiver.scorebox.test:9443/hook")
    literal = await guard.vet("https://127.0.0.1:9443/hook")

    assert [str(a) for a in by_name.addresses] == ["127.0.0.1"]
    assert [str(a) for a in literal.addresses] == ["127.0.0.1"]
    with pytest.raises(UnsafeDestination):
        await guard.vet("https://other.test/hook")
    with pytest.raises(UnsafeDestination):
        await guard.vet("http://127.0.0.1/hook")


async def test_the_resolver_answers_localhost_offline() -> None:
    resolver = CaresResolver(timeout_s=5)
    try:
        addresses = await resolver.resolve("localhost", 443)
    finally:
        await resolver.close()

    assert addresses
    assert all(address.is_loopback for address in addresses)


# The timeout of a resolver whose fake name server answers: never reached on a busy machine.
ANSWERED_WITHIN_S = 5.0


async def test_a_name_server_answer_is_read_and_a_missing_name_fails() -> None:
    async with fake_name_server({"good.test": "127.0.0.7"}) as (_, address):
        # Answers are given a timeout no busy machine reaches; the silence a short one.
        resolver = CaresResolver(timeout_s=ANSWERED_WITHIN_S, nameservers=[address])
        unanswered = CaresResolver(timeout_s=0.5, nameservers=[address])
        try:
            assert [str(a) for a in await resolver.resolve("good.test", 443)] == ["127.0.0.7"]
            with pytest.raises(ResolutionFailed, match=r"no DNS answer for gone\.test") as silent:
                await unanswered.resolve("gone.test", 443)
            # No answer may be our resolver's fault; "no such name" is the URL's.
            assert not isinstance(silent.value, NoSuchHost)
            with pytest.raises(NoSuchHost, match=r"missing\.nx does not exist"):
                await resolver.resolve("missing.nx", 443)
        finally:
            await resolver.close()
            await unanswered.close()


async def test_a_name_without_an_address_is_the_name_servers_answer() -> None:
    """NOERROR with an empty answer (NODATA: the name exists, say with only MX records) is
    the name server's word on the name, as NXDOMAIN is: the URL's doing. It was taken for our
    resolver failing, and each task's callback was dead-lettered into the operators' DLQ."""
    async with fake_name_server({}) as (_, address):
        resolver = CaresResolver(timeout_s=ANSWERED_WITHIN_S, nameservers=[address])
        try:
            with pytest.raises(NoSuchHost, match=r"apex\.example\.nodata has no address"):
                await resolver.resolve("apex.example.nodata", 443)
        finally:
            await resolver.close()


@pytest.mark.parametrize("host", ["hooks.example.servfail", "hooks.example.refused"])
async def test_a_name_server_failing_or_refusing_may_be_our_resolvers_doing(host: str) -> None:
    async with fake_name_server({}) as (_, address):
        resolver = CaresResolver(timeout_s=ANSWERED_WITHIN_S, nameservers=[address])
        try:
            with pytest.raises(ResolutionFailed, match="did not resolve") as failed:
                await resolver.resolve(host, 443)
        finally:
            await resolver.close()

    assert not isinstance(failed.value, NoSuchHost)


async def test_many_lookups_stuck_on_one_name_server_leave_others_their_answer() -> None:
    """Lookups ran on a pool of threads (at first the loop's shared one, libuv's four under
    uvloop; later one of 64): lookups of names under one unanswering name server held a
    thread each until the C library's own timeout, and every other host's lookup then timed
    out. Here 300 of them are pending, and at least 128 reached the name server (twice the
    threads the pool had), when another name is looked up."""
    stuck_count = 300
    async with fake_name_server({"good.test": "127.0.0.7"}) as (server, address):
        resolver = CaresResolver(timeout_s=10, nameservers=[address])
        try:
            stuck = [
                asyncio.ensure_future(resolver.resolve(f"stuck{n}.test", 443))
                for n in range(stuck_count)
            ]

            async def stuck_asked() -> bool:
                return len(set(server.unanswered)) >= 128

            await eventually(stuck_asked, what="the stuck lookups at the name server")
            addresses = await resolver.resolve("good.test", 443)
            assert [str(a) for a in addresses] == ["127.0.0.7"]
            assert not any(lookup.done() for lookup in stuck)  # still waiting, all of them
        finally:
            for lookup in stuck:
                lookup.cancel()
            await resolver.close()


async def test_the_pinned_resolver_answers_only_the_checked_addresses() -> None:
    destination = Destination(
        url="https://hooks.example.com/x",
        host="hooks.example.com",
        port=443,
        addresses=(ipaddress.ip_address("93.184.215.14"), ipaddress.ip_address("2606:4700::1")),
    )
    resolver = PinnedResolver(destination)

    answers = await resolver.resolve("hooks.example.com", 443)

    assert [(a["host"], a["family"]) for a in answers] == [
        ("93.184.215.14", socket.AF_INET),
        ("2606:4700::1", socket.AF_INET6),
    ]
    assert all(a["hostname"] == "hooks.example.com" for a in answers)
    with pytest.raises(OSError, match="not the checked destination"):
        await resolver.resolve("evil.example.com", 443)
