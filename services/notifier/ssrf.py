"""The SSRF guard: which URLs and addresses a webhook may be delivered to.

A delivery goes out only when its URL is an absolute `https://` URL (at most 2,048
characters, no credentials) whose host is a public IP literal or a domain name that is not
local by definition, and when EVERY address that name resolves to is public: not private,
loopback, link-local (169.254.169.254, the cloud metadata service, included), multicast,
reserved or unspecified, IPv4-mapped and other IPv4-embedding IPv6 forms unwrapped. The
caller then connects only to the addresses checked here (`Destination.addresses`), so a DNS
answer that changes between the check and the connection (rebinding) cannot redirect it.

The URL and address rules are `shared.webhook_urls`, the same the gateway applies when it
accepts a URL; this module adds the DNS step.

`allowed_test_hosts` (WEBHOOK_ALLOWED_TEST_HOSTS) exempts named hosts or addresses, for a
local test receiver only; `TestHostAddresses` (WEBHOOK_TEST_HOST_ADDRESSES) answers the
lookups of such names from a table before DNS, so a receiver on 127.0.0.1 can be reached
under a public-looking name (`WEBHOOKS=local make run`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiodns

from services.notifier.errors import NoSuchHost, ResolutionFailed, UnsafeDestination
from shared.webhook_urls import (
    IPAddress,
    UnsafeWebhookUrl,
    is_public_address,
    parse_ip_literal,
    webhook_host_and_port,
)

# The c-ares errors that are a name server's answer about the name itself, the URL's doing
# and not our resolver's: the name does not exist (NXDOMAIN), or it exists without an address
# (NOERROR and an empty answer, "NODATA": an apex with only MX or TXT records, a hooks
# subdomain whose A record was removed).
NAME_SERVER_ANSWERS = {
    aiodns.error.ARES_ENOTFOUND: "does not exist",
    aiodns.error.ARES_ENODATA: "has no address",
}


class Resolver(Protocol):
    """The addresses of a host. Raises `NoSuchHost` when DNS answered that the name does
    not exist or has no address, `ResolutionFailed` when it gave no answer; may return no
    address, which counts as "has no address"."""

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]: ...


# Each of a lookup's two tries is given this share of `WEBHOOK_DNS_TIMEOUT_S`.
DNS_TRY_SHARE = 0.3


class CaresResolver:
    """Host lookups through c-ares (`aiodns`), bounded by a timeout, on the event loop.

    The system resolver (`getaddrinfo`) blocks a thread per lookup, and a lookup given up at
    the timeout kept its thread until the C library's own timeout (10 to 30 s): callbacks to many
    distinct names under one unanswering name server could hold every thread of the pool,
    and every other host's lookup then timed out. A c-ares query is a pending entry on one
    socket, given up by c-ares itself within the same timeout; abandoned ones hold no thread, and
    any number of them leave other lookups their answer. c-ares reads the system's
    `resolv.conf` and hosts file. `nameservers` replaces the system's (tests)."""

    def __init__(self, *, timeout_s: float, nameservers: Sequence[str] = ()) -> None:
        self._timeout_s = timeout_s
        self._nameservers = list(nameservers)
        self._dns: aiodns.DNSResolver | None = None  # made on the loop, at the first lookup

    async def close(self) -> None:
        if self._dns is not None:
            await self._dns.close()

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        if self._dns is None:
            # Two tries within the budget: one try of the whole of it lost the A answer when
            # the AAAA query went unanswered (c-ares answers with what it has only at its own
            # timeout, which the outer one, as long and started first, always beat), and one
            # lost datagram failed the lookup. Even if c-ares doubles the second try's
            # timeout, both end before the outer bound.
            self._dns = aiodns.DNSResolver(
                self._nameservers or None, timeout=self._timeout_s * DNS_TRY_SHARE, tries=2
            )
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = await self._dns.getaddrinfo(host, port=port, type=socket.SOCK_STREAM)
        except TimeoutError as error:
            raise ResolutionFailed(f"no DNS answer for {host} within {self._timeout_s}s") from error
        except aiodns.error.DNSError as error:
            raise _lookup_error(host, error) from error
        # An IPv6 link-local answer may carry a zone (`fe80::1%eth0`); the address decides.
        return _unique(
            ipaddress.ip_address(node.addr[0].decode().split("%", 1)[0]) for node in answer.nodes
        )


class TestHostAddresses:
    """TEST ONLY: names answered from a table (WEBHOOK_TEST_HOST_ADDRESSES), others by
    `fallback`. The guard still judges every answer: a table name passes only as a name of
    WEBHOOK_ALLOWED_TEST_HOSTS, which the settings require of each (with a name under a
    reserved test TLD and a loopback address: `parse_test_host_addresses`)."""

    __test__ = False  # not a pytest class, whatever its name

    def __init__(self, table: Mapping[str, Sequence[IPAddress]], fallback: Resolver) -> None:
        self._table = {name.lower(): tuple(addresses) for name, addresses in table.items()}
        self._fallback = fallback

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        addresses = self._table.get(host.lower())
        if addresses is not None:
            return list(addresses)
        return await self._fallback.resolve(host, port)


def _lookup_error(host: str, error: aiodns.error.DNSError) -> ResolutionFailed:
    """`NoSuchHost` when the name server answered for good that the name does not exist or
    has no address (`NAME_SERVER_ANSWERS`); `ResolutionFailed` for any other error (SERVFAIL,
    REFUSED, a connection error), which may be our resolver's."""
    code = error.args[0] if error.args else None
    answer = NAME_SERVER_ANSWERS.get(code)
    if answer is not None:
        return NoSuchHost(f"{host} {answer}: {_reason(error)}")
    return ResolutionFailed(f"{host} did not resolve: {_reason(error)}")


def _reason(error: aiodns.error.DNSError) -> str:
    return str(error.args[1]) if len(error.args) > 1 else str(error)


def _unique(addresses: Iterable[IPAddress]) -> list[IPAddress]:
    return list(dict.fromkeys(addresses))


@dataclass(frozen=True)
class Destination:
    """Where one delivery may connect: the URL's host and port, and the checked addresses."""

    url: str
    host: str
    port: int
    addresses: tuple[IPAddress, ...]


class WebhookGuard:
    """Checks a URL statically (`check`) and, at delivery time, its addresses (`vet`)."""

    def __init__(
        self, resolver: Resolver, *, allowed_test_hosts: frozenset[str] = frozenset()
    ) -> None:
        self._resolver = resolver
        self._allowed = allowed_test_hosts

    def check(self, url: str) -> tuple[str, int]:
        """The URL's host and port, when the URL itself may receive webhooks."""
        try:
            return webhook_host_and_port(url, exempt_hosts=self._allowed)
        except UnsafeWebhookUrl as error:
            raise UnsafeDestination(str(error)) from error

    async def vet(self, url: str) -> Destination:
        """Check the URL, resolve its host, and refuse it when any address is not public."""
        host, port = self.check(url)
        literal = parse_ip_literal(host)
        addresses = [literal] if literal is not None else await self._resolver.resolve(host, port)
        if not addresses:  # an answer about the name, as NODATA is: the URL's doing
            raise NoSuchHost(f"{host} has no address")
        refused = [a for a in addresses if not self._permitted(host, a)]
        if refused:
            listed = ", ".join(str(a) for a in refused)
            raise UnsafeDestination(f"{host} resolves to non-public address(es): {listed}")
        return Destination(url=url, host=host, port=port, addresses=tuple(addresses))

    def _permitted(self, host: str, address: IPAddress) -> bool:
        return is_public_address(address) or host in self._allowed or str(address) in self._allowed
