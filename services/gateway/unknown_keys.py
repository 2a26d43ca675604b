"""A budget of unknown API keys per client address, spent before the key store is read.

Every key id the gateway has not cached costs one database read, and a well-formed key is
easy to make up: without a bound, one client could have the gateway read MongoDB as fast as
it can send requests. Each address gets `per_minute` lookups that find no key, refilled
evenly over a minute (a token bucket); spent, its requests naming a key id this replica has
not seen to exist are answered 429 without a read until a token is back. The token is taken
before the read and given back when the key exists or the read fails, so requests sent
together cannot all pass a check made before any of their reads ended.

Keys seen to exist stay readable whatever the address has spent (`Authenticator` keeps
their ids, read at start-up and learnt since): a reverse proxy that does not forward the
client's address (uvicorn trusts `X-Forwarded-For` only from `FORWARDED_ALLOW_IPS`) shows
every client as one address, and one client flooding made-up keys through it must not lock
the others out. IPv6 addresses count by their /64, which one host usually holds whole.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_ADDRESSES = 10_000
IPV6_HOST_PREFIX = 64
# A request with no client address (uvicorn on a Unix socket) counts as this one address.
UNKNOWN_ADDRESS = "unknown"


@dataclass
class _Bucket:
    tokens: float
    updated: float


class UnknownKeyBudget:
    """Per client address, how many lookups that find no key it may still cause.

    Per process (each gateway replica counts its own); at most `max_addresses` addresses are
    remembered, the least recently seen dropped first (a dropped one starts afresh)."""

    def __init__(
        self,
        per_minute: int,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        max_addresses: int = MAX_ADDRESSES,
    ) -> None:
        self.per_minute = per_minute
        self._capacity = float(per_minute)
        self._refill_per_s = per_minute / 60.0
        self._monotonic = monotonic
        self._max_addresses = max_addresses
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._capacity > 0

    def take(self, address: str) -> int | None:
        """Take a token for a lookup `address` is about to cause: None when taken, else the
        seconds until one is back (nothing taken)."""
        if not self.enabled:
            return None
        bucket = self._bucket(address_key(address))
        if bucket.tokens < 1.0:
            return max(1, math.ceil((1.0 - bucket.tokens) / self._refill_per_s))
        bucket.tokens -= 1.0
        return None

    def give_back(self, address: str) -> None:
        """The lookup a token was taken for found a key, or failed: it costs nothing."""
        if not self.enabled:
            return
        bucket = self._bucket(address_key(address))
        bucket.tokens = min(self._capacity, bucket.tokens + 1.0)

    def _bucket(self, key: str) -> _Bucket:
        bucket = self._buckets.get(key)
        now = self._monotonic()
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self._capacity, now)
            while len(self._buckets) > self._max_addresses:
                self._buckets.popitem(last=False)
            return bucket
        elapsed = max(0.0, now - bucket.updated)
        bucket.tokens = min(self._capacity, bucket.tokens + elapsed * self._refill_per_s)
        bucket.updated = now
        self._buckets.move_to_end(key)
        return bucket


def address_key(address: str) -> str:
    """What an address is counted as: itself, or its /64 for IPv6 (an IPv4-mapped IPv6
    address as the IPv4 one); anything that is no IP address (`UNKNOWN_ADDRESS`) as it is."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, IPV6_HOST_PREFIX), strict=False))
    return str(parsed)
