"""The SSRF guard: which URLs and addresses a webhook may be delivered to.

A delivery goes out only when its URL is an absolute `https://` URL (at most 2,048
characters, no credentials) whose host is a public IP literal or a domain name that is not
local by definition, and when EVERY address that name resolves to is public: not private,
loopback, link-local (169.254.169.254, the cloud metadata service, included), multicast,
reserved or unspecified, IPv4-mapped and other IPv4-embedding IPv6 forms unwrapped. The
caller then connects only to the addresses checked here (`Destination.addresses`), so a DNS
answer that changes between the check and the connection (rebinding) cannot redirect it.

These rules repeat the gateway's submit-time check (`services.gateway.webhooks`), which has
no DNS; the two services share no code beyond contracts, and `tests/unit/test_ssrf.py` runs
one table against both.

`allowed_test_hosts` (WEBHOOK_ALLOWED_TEST_HOSTS) exempts named hosts or addresses, for a
local test receiver only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from services.notifier.errors import ResolutionFailed, UnsafeDestination

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_URL_LENGTH = 2_048
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
_LOCAL_SUFFIXES = ("localhost", "local", "internal", "localdomain", "home.arpa", "arpa")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


def is_public_address(address: IPAddress) -> bool:
    """True for a globally routable unicast address (IPv4-mapped/embedded forms unwrapped)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            return is_public_address(embedded)
        if address in _IPV4_COMPATIBLE:
            return False
    return address.is_global and not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if any(address in network for network in _NAT64):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _parse_ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _check_host_name(host: str) -> None:
    name = host.removesuffix(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise UnsafeDestination(f"{host!r} is not a valid host name")
    if _NUMERIC_LABEL.match(labels[-1]):
        raise UnsafeDestination(f"{host!r} is a numeric address form that is not allowed")
    if len(labels) == 1:
        raise UnsafeDestination(f"{host!r} is a single-label (local) host name")
    if any(name == suffix or name.endswith(f".{suffix}") for suffix in _LOCAL_SUFFIXES):
        raise UnsafeDestination(f"{host!r} is a local host name")


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]: ...


class SystemResolver:
    """The system resolver (getaddrinfo), bounded by a timeout."""

    def __init__(self, *, timeout_s: float) -> None:
        self._timeout_s = timeout_s

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except TimeoutError as error:
            raise ResolutionFailed(f"no DNS answer for {host} within {self._timeout_s}s") from error
        except OSError as error:
            raise ResolutionFailed(f"{host} did not resolve: {error}") from error
        # An IPv6 link-local answer may carry a zone (`fe80::1%eth0`); the address decides.
        return _unique(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos)


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
        if len(url) > MAX_URL_LENGTH:
            raise UnsafeDestination(f"the URL is longer than {MAX_URL_LENGTH} characters")
        if any(ord(char) <= 0x20 or ord(char) == 0x7F or char == "\\" for char in url):
            raise UnsafeDestination("the URL contains whitespace, control characters or '\\'")
        parts = urlsplit(url)
        if parts.scheme.lower() != "https":
            raise UnsafeDestination("the URL must start with https://")
        if "@" in parts.netloc:
            raise UnsafeDestination("the URL may not contain credentials")
        try:
            port = parts.port
        except ValueError as error:
            raise UnsafeDestination("the URL has an invalid port") from error
        host = parts.hostname or ""
        if not host or port == 0:
            raise UnsafeDestination("the URL needs a host (and a non-zero port, if any)")
        if "%" in host:
            raise UnsafeDestination("the URL's host may not carry a zone id or escapes")
        port = port or 443
        if host in self._allowed:
            return host, port
        address = _parse_ip(host)
        if address is None:
            _check_host_name(host)
        elif not is_public_address(address):
            raise UnsafeDestination(f"{host} is not a public address")
        return host, port

    async def vet(self, url: str) -> Destination:
        """Check the URL, resolve its host, and refuse it when any address is not public."""
        host, port = self.check(url)
        literal = _parse_ip(host)
        addresses = [literal] if literal is not None else await self._resolver.resolve(host, port)
        if not addresses:
            raise ResolutionFailed(f"{host} resolved to no address")
        refused = [a for a in addresses if not self._permitted(host, a)]
        if refused:
            listed = ", ".join(str(a) for a in refused)
            raise UnsafeDestination(f"{host} resolves to non-public address(es): {listed}")
        return Destination(url=url, host=host, port=port, addresses=tuple(addresses))

    def _permitted(self, host: str, address: IPAddress) -> bool:
        return is_public_address(address) or host in self._allowed or str(address) in self._allowed
