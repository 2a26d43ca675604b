"""Settings of the notifier (environment variables in README)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, model_validator

from shared.settings import BROKER_CONSUMER_TIMEOUT_S, MAX_DURATION_S, AdminApiSettings
from shared.webhook_urls import IPAddress, UnsafeWebhookUrl, check_host_name, parse_ip_literal

# The database calls a claim's holder makes under its lease (`NotifierSettings.lease_s`).
CLAIM_DATABASE_CALLS = 3
# The broker steps within the stop's grace: the consumers' cancel, then the two confirms of
# what a delivery decided.
STOP_BROKER_STEPS_IN_GRACE = 3
# The longest one step of a webhook POST may take (as LLM_TIMEOUT_S): the delivery is held
# unacknowledged meanwhile, and RabbitMQ closes the channel of one held 30 minutes.
MAX_WEBHOOK_TIMEOUT_S = 600.0
# What WEBHOOK_TEST_HOST_ADDRESSES may map (`parse_test_host_addresses`): names under the TLDs
# reserved for testing and examples, which no real domain is under (RFC 2606, RFC 6761;
# `.localhost`, the fourth, the gateway refuses), to the loopback addresses.
TEST_HOST_TLDS = ("test", "example", "invalid")
_IPV4_LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")
_IPV6_LOOPBACK = ipaddress.IPv6Address("::1")


class NotifierSettings(AdminApiSettings):
    port: int = Field(default=8004, validation_alias="NOTIFIER_PORT")
    # Notification events and deliveries in flight per notifier process, and a reserve on
    # top kept for tenants with nothing in flight (`tenant_reserve`, hosts.py).
    concurrency: int = Field(default=32, ge=1, le=1024, validation_alias="WEBHOOK_CONCURRENCY")
    # Of those, POSTs in flight at once to one destination (scheme, host, port) per process,
    # so one slow receiver cannot take every slot (services/notifier/hosts.py). 8 of the
    # default 32: four destinations must all be stuck before a healthy one waits, and a
    # healthy receiver still gets 8 at once per replica. Unset, it is at most `concurrency`.
    concurrency_per_host: int = Field(
        default=8, ge=1, le=1024, validation_alias="WEBHOOK_CONCURRENCY_PER_HOST"
    )
    # And POSTs of one tenant in flight at once per process, whatever their destinations: a
    # tenant whose callback URLs name many ports or host names of one hanging receiver (a
    # wildcard DNS zone) passes the bound per destination. Unset, half of `concurrency`
    # (16 of the default 32). Two such tenants could still take all of `concurrency`: the
    # reserve beyond it is for tenants with nothing in flight.
    concurrency_per_tenant: int | None = Field(
        default=None, ge=1, le=1024, validation_alias="WEBHOOK_CONCURRENCY_PER_TENANT"
    )
    max_attempts: int = Field(default=8, ge=1, le=50, validation_alias="WEBHOOK_MAX_ATTEMPTS")
    # Back-off between attempts: base * 2^(attempt-1), capped, with jitter; Retry-After wins
    # when the receiver sends one (up to the cap).
    retry_base_s: float = Field(
        default=30.0, gt=0, le=MAX_DURATION_S, validation_alias="WEBHOOK_RETRY_BASE_S"
    )
    retry_cap_s: float = Field(
        default=14_400.0, gt=0, le=MAX_DURATION_S, validation_alias="WEBHOOK_RETRY_CAP_S"
    )
    # Timeouts of one delivery: DNS, TCP+TLS connect, the whole request.
    dns_timeout_s: float = Field(
        default=5.0, gt=0, le=MAX_WEBHOOK_TIMEOUT_S, validation_alias="WEBHOOK_DNS_TIMEOUT_S"
    )
    connect_timeout_s: float = Field(
        default=5.0, gt=0, le=MAX_WEBHOOK_TIMEOUT_S, validation_alias="WEBHOOK_CONNECT_TIMEOUT_S"
    )
    timeout_s: float = Field(
        default=10.0, gt=0, le=MAX_WEBHOOK_TIMEOUT_S, validation_alias="WEBHOOK_TIMEOUT_S"
    )
    # How much of a receiver's answer is read (kept as an excerpt for the delivery record).
    max_response_bytes: int = Field(
        default=4_096, ge=0, validation_alias="WEBHOOK_MAX_RESPONSE_BYTES"
    )
    # After a rotation, deliveries are also signed with the previous secret for this long.
    secret_rotation_grace_s: float = Field(
        default=86_400.0,
        ge=0,
        le=MAX_DURATION_S,
        validation_alias="WEBHOOK_SECRET_ROTATION_GRACE_S",
    )
    # How long a callback URL is remembered for its task (covers the longest submit delay).
    callback_retention_s: float = Field(
        default=8 * 86_400.0,
        gt=0,
        le=MAX_DURATION_S,
        validation_alias="WEBHOOK_CALLBACK_RETENTION_S",
    )
    # How long a task outcome waits for a late `task.accepted` that may carry a callback URL.
    unclaimed_outcome_ttl_s: float = Field(
        default=3_600.0, gt=0, le=MAX_DURATION_S, validation_alias="WEBHOOK_UNCLAIMED_OUTCOME_TTL_S"
    )
    # How long a delivery record (its idempotency key) is kept.
    delivery_retention_s: float = Field(
        default=7 * 86_400.0,
        gt=0,
        le=MAX_DURATION_S,
        validation_alias="WEBHOOK_DELIVERY_RETENTION_S",
    )
    # TEST ONLY. Comma-separated host names or IP addresses that webhooks may target although
    # they are not public (a local test receiver on 127.0.0.1). Empty in any real deployment;
    # the notifier logs a warning at start-up when it is set.
    allowed_test_hosts: str = Field(default="", validation_alias="WEBHOOK_ALLOWED_TEST_HOSTS")
    # TEST ONLY. Comma-separated `name=address` pairs the notifier's lookups answer from
    # before DNS (a name given twice: both addresses), so a local receiver can be reached
    # under a public-looking name (`receiver.scorebox.test=127.0.0.1`, as `WEBHOOKS=local
    # make run` sets it). Every name must be under a reserved test TLD (`.test`, `.example`,
    # `.invalid`) and every address a loopback one (127.0.0.0/8, ::1), so no real domain's
    # webhooks can be sent elsewhere and no other machine reached; and every name must also
    # be in WEBHOOK_ALLOWED_TEST_HOSTS: the exemption stays that one variable's to grant.
    # Empty in any real deployment; logged at start-up.
    test_host_addresses: str = Field(default="", validation_alias="WEBHOOK_TEST_HOST_ADDRESSES")
    # A PEM file of CA certificates to trust instead of the system store (a test receiver's
    # self-signed CA). Unset: the system trust store.
    ca_file: Path | None = Field(default=None, validation_alias="WEBHOOK_CA_FILE")

    @model_validator(mode="after")
    def _per_host_within_concurrency(self) -> NotifierSettings:
        if "concurrency_per_host" in self.model_fields_set and (
            self.concurrency_per_host > self.concurrency
        ):
            raise ValueError(
                f"WEBHOOK_CONCURRENCY_PER_HOST ({self.concurrency_per_host}) may not exceed "
                f"WEBHOOK_CONCURRENCY ({self.concurrency})"
            )
        if self.concurrency_per_tenant is not None and (
            self.concurrency_per_tenant > self.concurrency
        ):
            raise ValueError(
                f"WEBHOOK_CONCURRENCY_PER_TENANT ({self.concurrency_per_tenant}) may not exceed "
                f"WEBHOOK_CONCURRENCY ({self.concurrency})"
            )
        return self

    @model_validator(mode="after")
    def _held_within_the_consumer_timeout(self) -> NotifierSettings:
        """A redelivery waits out another replica's lease, then claims and POSTs under its
        own, unacknowledged all along: past RabbitMQ's consumer timeout the broker closes
        the channel both notifier consumers share and takes back every delivery in hand.
        Each timeout alone was bounded, and 600 s of DNS with 600 s of request held a
        redelivery 2,500 s (review of the notifier)."""
        held_s = 2 * self.lease_s
        if held_s >= BROKER_CONSUMER_TIMEOUT_S:
            raise ValueError(
                f"a redelivery could be held {held_s:g} s, past RabbitMQ's consumer timeout "
                f"({BROKER_CONSUMER_TIMEOUT_S:g} s): lower WEBHOOK_DNS_TIMEOUT_S, "
                "WEBHOOK_TIMEOUT_S, MONGO_TIMEOUT_S or MAX_CLOCK_OFFSET_S"
            )
        return self

    @model_validator(mode="after")
    def _test_host_addresses_valid(self) -> NotifierSettings:
        parse_test_host_addresses(self.test_host_addresses, allowed=self.test_hosts)
        return self

    @model_validator(mode="after")
    def _records_outlive_the_retries(self) -> NotifierSettings:
        # A record expiring while its delivery still retries is registered again by the next
        # try, and a duplicate copy of an attempt it had sent could then post it again.
        longest = (self.max_attempts - 1) * self.retry_cap_s
        if self.delivery_retention_s <= longest:
            raise ValueError(
                f"WEBHOOK_DELIVERY_RETENTION_S ({self.delivery_retention_s:g} s) must exceed "
                f"the longest a delivery retries, (WEBHOOK_MAX_ATTEMPTS - 1) x "
                f"WEBHOOK_RETRY_CAP_S ({longest:g} s)"
            )
        return self

    @property
    def per_host(self) -> int:
        """POSTs in flight at once to one destination: the default never above `concurrency`."""
        return min(self.concurrency_per_host, self.concurrency)

    @property
    def per_tenant(self) -> int:
        """POSTs of one tenant in flight at once: by default half of `concurrency`."""
        return self.concurrency_per_tenant or max(1, self.concurrency // 2)

    @property
    def tenant_reserve(self) -> int:
        """Deliveries in hand beyond `concurrency`, kept for tenants with nothing in flight
        (hosts.py): a quarter of it, at least 1."""
        return max(1, self.concurrency // 4)

    @property
    def deliveries_in_hand(self) -> int:
        """The consumers' prefetch: `concurrency` and the reserve for idle tenants."""
        return self.concurrency + self.tenant_reserve

    @property
    def test_hosts(self) -> frozenset[str]:
        return frozenset(
            host.strip().lower().strip("[]")
            for host in self.allowed_test_hosts.split(",")
            if host.strip()
        )

    @property
    def test_host_table(self) -> dict[str, tuple[IPAddress, ...]]:
        """WEBHOOK_TEST_HOST_ADDRESSES as a table: name -> addresses (empty when unset)."""
        return parse_test_host_addresses(self.test_host_addresses, allowed=self.test_hosts)

    @property
    def post_s(self) -> float:
        """The longest one POST takes: its DNS check, then the whole request."""
        return self.dns_timeout_s + self.timeout_s

    @property
    def stop_grace_s(self) -> float:
        """How long the deliveries in hand get to finish at stop: the consumers' cancel,
        which shares the grace (`ScoreboxBroker.stop`), then the POST, the claim holder's
        database calls (as the lease counts them) and two broker timeouts for publishing
        what it decided, each at its bound (60 s by default). Without the database calls, a
        slow database during a deploy cut an answered POST off from its record, and the
        redelivery POSTed it again once the lease ran out (the notifier's re-read, session
        59)."""
        database_s = CLAIM_DATABASE_CALLS * self.mongo_timeout_s
        return self.post_s + database_s + STOP_BROKER_STEPS_IN_GRACE * self.broker_timeout_s

    @property
    def lease_s(self) -> float:
        """How long a claimed delivery is ours before another consumer may take it over.

        The POST, and the database calls of the claim's holder, each up to `MONGO_TIMEOUT_S`:
        the claim's own write (the lease counts from before it), the keyring read before
        the POST and the recording of its outcome, with 30 s to spare, and twice
        `MAX_CLOCK_OFFSET_S`: another replica's clock may run ahead of this one's by that
        much (review of the notifier). A lease that ran out before the POST let a second
        copy claim the attempt and POST it too."""
        return (
            self.post_s
            + CLAIM_DATABASE_CALLS * self.mongo_timeout_s
            + 2 * self.max_clock_offset_s  # a replica whose clock runs ahead reads it ended
            + 30.0
        )


def parse_test_host_addresses(
    raw: str, *, allowed: frozenset[str]
) -> dict[str, tuple[IPAddress, ...]]:
    """`name=address[,name=address...]` as a table; `ValueError` naming the entry otherwise.

    A name must be one the gateway accepts in a callback URL (no IP literal, no local or
    single-label name: the mapping would never be used), be under a reserved test TLD
    (`TEST_HOST_TLDS`: a mapping of a real domain would send its webhooks elsewhere) and be
    in `allowed` (WEBHOOK_ALLOWED_TEST_HOSTS); an address must be a loopback IP literal
    (127.0.0.0/8 or ::1: the table reaches a receiver on this machine, nothing else). Names
    are compared in lower case, as URL hosts are."""
    table: dict[str, tuple[IPAddress, ...]] = {}
    for entry in (part.strip() for part in raw.split(",")):
        if not entry:
            continue
        name, sep, given = (text.strip() for text in entry.partition("="))
        name = name.lower()
        if not sep or not name or not given:
            raise ValueError(
                f"WEBHOOK_TEST_HOST_ADDRESSES: {entry!r} is not name=address "
                "(e.g. receiver.scorebox.test=127.0.0.1)"
            )
        if parse_ip_literal(name.strip("[]")) is not None:
            raise ValueError(
                f"WEBHOOK_TEST_HOST_ADDRESSES: {name!r} is an address; map a host name"
            )
        try:
            check_host_name(name)
        except UnsafeWebhookUrl as error:
            raise ValueError(
                f"WEBHOOK_TEST_HOST_ADDRESSES: {error}; the gateway refuses callback URLs "
                "naming it, so the mapping would never be used"
            ) from None
        if name.removesuffix(".").rpartition(".")[2] not in TEST_HOST_TLDS:
            raise ValueError(
                f"WEBHOOK_TEST_HOST_ADDRESSES: {name!r} is not under a reserved test TLD; map "
                "only names ending in .test, .example or .invalid (tests only)"
            )
        address = parse_ip_literal(given.strip("[]"))
        if address is None:
            raise ValueError(
                f"WEBHOOK_TEST_HOST_ADDRESSES: {given!r} (for {name}) is not an IP address"
            )
        if not _is_loopback(address):
            raise ValueError(
                f"WEBHOOK_TEST_HOST_ADDRESSES: {given!r} (for {name}) is not a loopback "
                "address; map names only to 127.0.0.0/8 or ::1 (tests only)"
            )
        if name not in allowed:
            raise ValueError(
                f"WEBHOOK_TEST_HOST_ADDRESSES maps {name}, which is not in "
                "WEBHOOK_ALLOWED_TEST_HOSTS: add it there too (tests only: the exemption is "
                "that variable's to grant)"
            )
        if address not in table.get(name, ()):
            table[name] = (*table.get(name, ()), address)
    return table


def _is_loopback(address: IPAddress) -> bool:
    """127.0.0.0/8 or ::1 itself: not an IPv4-mapped `::ffff:127.0.0.1` nor a scoped `::1%1`,
    which `is_loopback` takes too."""
    if isinstance(address, ipaddress.IPv4Address):
        return address in _IPV4_LOOPBACK
    return address == _IPV6_LOOPBACK
