"""A bound on the webhooks in flight to one destination, so one slow receiver cannot take
every delivery slot of a notifier.

`WEBHOOK_CONCURRENCY` deliveries run at once per notifier process. A receiver that answers
only at the timeout, or hangs until it, would otherwise fill them all, and every other
tenant's webhooks would wait behind it (head-of-line blocking). At most
`WEBHOOK_CONCURRENCY_PER_HOST` of them go to one destination at once: the scheme, host and
port of the URL, as the SSRF guard reads them (so `HTTPS://Example.com` and
`https://example.com:443/other` are one destination). A slot covers the claim, the DNS
check, the POST and the recording of its outcome. A delivery whose destination has no slot
free holds nothing and waits for nothing: `deliveries.py` defers it down the wait ladder, its
attempt neither claimed nor counted.

The count is this process's own, kept in memory: each notifier replica bounds its own
deliveries, so N replicas allow up to N times the bound to one destination at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.notifier.errors import UnsafeDestination
from services.notifier.ssrf import WebhookGuard

DEFAULT_PER_HOST = 8


class HostSlots:
    """The POSTs this process has in flight, per destination, at most `per_host` each."""

    def __init__(self, per_host: int = DEFAULT_PER_HOST) -> None:
        if per_host < 1:
            raise ValueError(f"per_host must be at least 1, not {per_host}")
        self.per_host = per_host
        self._in_flight: dict[str, int] = {}

    def in_flight(self, destination: str) -> int:
        return self._in_flight.get(destination, 0)

    @contextmanager
    def taking(self, destination: str) -> Iterator[bool]:
        """Hold one of `destination`'s slots while the block runs. Yields False, holding
        nothing, when all its slots are taken."""
        taken = self.in_flight(destination)
        if taken >= self.per_host:
            yield False
            return
        self._in_flight[destination] = taken + 1
        try:
            yield True
        finally:
            self._give_back(destination)

    def _give_back(self, destination: str) -> None:
        left = self._in_flight[destination] - 1
        if left:
            self._in_flight[destination] = left
        else:
            del self._in_flight[destination]  # forget destinations with nothing in flight


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
