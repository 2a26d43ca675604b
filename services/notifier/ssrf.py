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
local test receiver only.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from services.notifier.errors import ResolutionFailed, UnsafeDestination
from shared.webhook_urls import (
    IPAddress,
    UnsafeWebhookUrl,
    is_public_address,
    parse_ip_literal,
    webhook_host_and_port,
)


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]: ...


class SystemResolver:
    """The system resolver (getaddrinfo), bounded by a timeout, on threads of its own.

    A lookup the timeout gives up on keeps its thread until the C library's own timeout
    (10 s and more). On the loop's shared pool (libuv's four threads under uvloop) a few
    lookups of one tenant's unanswering name server made every other host's lookup time out,
    and slowed the database client's lookups too. `lookups` threads: at least the deliveries
    in hand at once, so those alone never fill them."""

    def __init__(self, *, timeout_s: float, lookups: int = 64) -> None:
        self._timeout_s = timeout_s
        self._threads = ThreadPoolExecutor(max_workers=lookups, thread_name_prefix="dns")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        loop = asyncio.get_running_loop()
        lookup = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        try:
            async with asyncio.timeout(self._timeout_s):
                infos = await loop.run_in_executor(self._threads, lookup)
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
        try:
            return webhook_host_and_port(url, exempt_hosts=self._allowed)
        except UnsafeWebhookUrl as error:
            raise UnsafeDestination(str(error)) from error

    async def vet(self, url: str) -> Destination:
        """Check the URL, resolve its host, and refuse it when any address is not public."""
        host, port = self.check(url)
        literal = parse_ip_literal(host)
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
