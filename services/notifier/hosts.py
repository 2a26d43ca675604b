"""Bounds on the webhooks in flight per destination and per tenant, so one slow receiver, or
one tenant's many, cannot take every delivery slot of a notifier.

`WEBHOOK_CONCURRENCY` deliveries run at once per notifier process. A receiver that answers
only at the timeout, or hangs until it, would otherwise fill them all, and every other
tenant's webhooks would wait behind it (head-of-line blocking). At most
`WEBHOOK_CONCURRENCY_PER_HOST` of them go to one destination at once: the scheme, host and
port of the URL, as the SSRF guard reads them (so `HTTPS://Example.com` and
`https://example.com:443/other` are one destination). That alone is no bound on a tenant
whose callback URLs name many destinations of one hanging receiver (many ports, or the
names of a wildcard DNS zone): at most `WEBHOOK_CONCURRENCY_PER_TENANT` POSTs of one tenant
are in flight at once, whatever their destinations. A slot covers the claim, the DNS check,
the POST and the recording of its outcome. A delivery whose destination or tenant has no
slot free holds nothing and waits for nothing: `deliveries.py` defers it down the wait
ladder, its attempt neither claimed nor counted.

Bounds per tenant alone still let a few tenants share every slot: two tenants with hanging
receivers, each at a bound of half the slots, held them all, and a third tenant's healthy
webhook was not even handed to the notifier (the consumer's prefetch was full) until one
of their POSTs timed out. So the consumer holds `WEBHOOK_CONCURRENCY` deliveries plus a
reserve (a quarter of it, at least 1: `NotifierSettings.tenant_reserve`), and
`TenantSlots` keeps that reserve for tenants with nothing in flight: a tenant already
holding a slot may take another only while fewer than `WEBHOOK_CONCURRENCY` POSTs are in
flight; a tenant holding none may always take one (its bound is at least 1). Busy tenants
never hold more than `WEBHOOK_CONCURRENCY` slots between them, and the reserve goes one
slot per tenant: `reserve` more tenants must get stuck too before a quiet one waits.

A destination's bound alone let one tenant hold all of it: a tenant whose own path on a
host many tenants share (an automation service's hooks) hangs kept every slot of that host
with its many cycling copies, and the other tenants' webhooks to it waited for minutes
(review of the notifier). One tenant holds at most `host_share` of a destination's slots,
the bound less a quarter of it (at least 1): the rest is left to its other tenants, as the
tenants' reserve is to idle tenants (so a destination a single tenant uses runs at most
that many of its POSTs at once).

The counts are this process's own, kept in memory: each notifier replica bounds its own
deliveries, so N replicas allow up to N times a bound at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.notifier.errors import UnsafeDestination
from services.notifier.ssrf import WebhookGuard

DEFAULT_PER_HOST = 8
DEFAULT_PER_TENANT = 16
DEFAULT_CONCURRENCY = 32  # WEBHOOK_CONCURRENCY's default: the slots busy tenants share
# Why a key may take no slot now (`Slots.refusal`).
BUSY = "busy"  # all of its own slots are taken
RESERVE = "reserve"  # only the reserve is left, and the key already holds a slot


class Slots:
    """The POSTs this process has in flight per key (a destination, a tenant), at most
    `bound` each."""

    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError(f"a bound must be at least 1, not {bound}")
        self.bound = bound
        self._in_flight: dict[str, int] = {}
        self._total = 0

    def in_flight(self, key: str) -> int:
        return self._in_flight.get(key, 0)

    @property
    def total(self) -> int:
        """The slots taken, all keys together."""
        return self._total

    def refusal(self, key: str) -> str | None:
        """Why `key` may take no slot now (BUSY, or RESERVE for `TenantSlots`), or None
        when it may."""
        return BUSY if self.in_flight(key) >= self.bound else None

    @contextmanager
    def taking(self, key: str) -> Iterator[bool]:
        """Hold one of `key`'s slots while the block runs. Yields False, holding nothing,
        when `refusal` refuses it one."""
        if self.refusal(key) is not None:
            yield False
            return
        self._in_flight[key] = self.in_flight(key) + 1
        self._total += 1
        try:
            yield True
        finally:
            self._give_back(key)

    def _give_back(self, key: str) -> None:
        self._total -= 1
        left = self._in_flight[key] - 1
        if left:
            self._in_flight[key] = left
        else:
            del self._in_flight[key]  # forget keys with nothing in flight


class TenantSlots(Slots):
    """`Slots` per tenant that keep what the consumer holds beyond `shared` deliveries
    (`WEBHOOK_CONCURRENCY`) for tenants with nothing in flight: a tenant holding a slot
    may take another only while fewer than `shared` are taken, all tenants together; one
    holding none may always take one."""

    def __init__(self, bound: int, *, shared: int) -> None:
        super().__init__(bound)
        if shared < bound:
            raise ValueError(f"the shared slots ({shared}) may not be fewer than a bound")
        self.shared = shared

    def refusal(self, key: str) -> str | None:
        if (busy := super().refusal(key)) is not None:
            return busy
        return RESERVE if self.in_flight(key) and self.total >= self.shared else None


def host_share(per_host: int) -> int:
    """The slots of a destination one tenant may hold: all but a quarter of them (at least
    one left to the others), and always at least one."""
    return max(1, per_host - max(1, per_host // 4))


def share_key(tenant_id: str, destination: str) -> str:
    """The key a tenant's POSTs to one destination count against (`host_share`)."""
    return f"{tenant_id}\x00{destination}"


def destination_of(url: str, guard: WebhookGuard) -> str:
    """The destination a URL's deliveries count against: `https://host:port`.

    A URL the guard refuses is never POSTed (the delivery is refused before any connection)
    and counts against itself."""
    try:
        host, port = guard.check(url)
    except UnsafeDestination:
        return url
    host = host.rstrip(".").lower()
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
