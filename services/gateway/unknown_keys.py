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

The replica's lookups that find no key are bounded too, all addresses together
(`replica_per_minute`): past it, a key id not seen to exist is refused from every address
until a token is back, while the keys seen to exist keep working.
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


class _Bucket:
    """A token bucket of `per_minute` tokens, refilled evenly over a minute; a zero one
    bounds nothing."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self._capacity = float(per_minute)
        self._refill_per_s = per_minute / 60.0
        self._tokens = self._capacity
        self._updated = now

    def left(self, now: float) -> float:
        elapsed = max(0.0, now - self._updated)
        self._tokens = min(self._capacity, self._tokens + elapsed * self._refill_per_s)
        self._updated = now
        return self._tokens if self.per_minute else math.inf

    def until_one_s(self) -> int:
        """The seconds until a token is back, at least 1 (read after `left`)."""
        return max(1, math.ceil((1.0 - self._tokens) / self._refill_per_s))

    def take(self) -> None:
        if self.per_minute:
            self._tokens -= 1.0

    def give_back(self, now: float) -> None:
        self._tokens = min(self._capacity, self.left(now) + 1.0)


@dataclass(frozen=True)
class Spent:
    """A budget is spent: `retry_after_s` until a token is back, and whose budget it was,
    of `per_minute` tokens."""

    retry_after_s: int
    per_minute: int
    replica_wide: bool


class UnknownKeyBudget:
    """Per client address, how many lookups that find no key it may still cause; and how
    many this replica may make in all (`replica_per_minute`).

    Per process (each gateway replica counts its own); at most `max_addresses` addresses are
    remembered, the least recently seen dropped first (a dropped one starts afresh). So
    past that many addresses (an IPv6 /48 holds 65,536 /64s) the addresses' budgets bound
    nothing, and the replica's does: without it, many addresses each within their own
    budget had the replica read MongoDB without a ceiling (a review)."""

    def __init__(
        self,
        per_minute: int,
        *,
        replica_per_minute: int = 0,
        monotonic: Callable[[], float] = time.monotonic,
        max_addresses: int = MAX_ADDRESSES,
    ) -> None:
        self.per_minute = per_minute
        self._monotonic = monotonic
        self._max_addresses = max_addresses
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._replica = _Bucket(replica_per_minute, monotonic())

    @property
    def enabled(self) -> bool:
        return self.per_minute > 0 or self._replica.per_minute > 0

    def take(self, address: str) -> Spent | None:
        """Take a token for a lookup `address` is about to cause, from its budget and the
        replica's: None when taken, else the spent budget whose token is back last, and
        when (nothing taken from either)."""
        if not self.enabled:
            return None
        now = self._monotonic()
        own = self._bucket(address_key(address), now)
        spent = [
            Spent(bucket.until_one_s(), bucket.per_minute, replica_wide=bucket is self._replica)
            for bucket in (own, self._replica)
            if bucket.left(now) < 1.0
        ]
        if spent:
            return max(spent, key=lambda each: each.retry_after_s)
        own.take()
        self._replica.take()
        return None

    def give_back(self, address: str) -> None:
        """The lookup a token was taken for found a key, or failed: it costs nothing."""
        if not self.enabled:
            return
        now = self._monotonic()
        self._bucket(address_key(address), now).give_back(now)
        self._replica.give_back(now)

    def _bucket(self, key: str, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.per_minute, now)
            while len(self._buckets) > self._max_addresses:
                self._buckets.popitem(last=False)
            return bucket
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
