"""The notifier's own metric families (`shared.metrics` has those every service records)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from shared.metrics import DURATION_BUCKETS


class NotifierMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry or CollectorRegistry()
        self.attempts = Counter(
            "scorebox_webhook_attempts",
            "Webhook attempts made, by purpose (callback, failure_alert) and outcome "
            "(delivered: a 2xx; unavailable: the receiver did not answer or answered 5xx, "
            "408 or 429, retried while attempts are left; rejected: given up at once, "
            "refused by the receiver or by the address check before any request was sent). "
            "Deliveries given up are scorebox_webhook_deliveries_failed.",
            ["purpose", "outcome"],
            registry=registry,
        )
        self.failed = Counter(
            "scorebox_webhook_deliveries_failed",
            "Webhook deliveries given up, by purpose and why (rejected: the receiver refused "
            "it; receiver_failing: it answered 5xx, 408 or 429 to the last of every attempt, or "
            "DNS answered its host has no address (NXDOMAIN, NODATA); "
            "dead_lettered: no answer to the last attempt, or at the delivery limit).",
            ["purpose", "reason"],
            registry=registry,
        )
        self.deferred = Counter(
            "scorebox_webhook_deferred",
            "Webhook deliveries put off without an attempt, by why (host_busy: this notifier "
            "had WEBHOOK_CONCURRENCY_PER_HOST POSTs in flight to its destination; "
            "host_share_busy: its tenant held its share of them; tenant_busy: "
            "WEBHOOK_CONCURRENCY_PER_TENANT of its tenant; tenant_reserve: its tenant had a "
            "POST in flight and only the reserve kept for idle tenants was free; "
            "lease_short: its claim had too little of its lease left for a POST). Counted "
            "each time a copy is sent down the wait ladder (a redelivery's copy carrying its "
            "delivery count); a redelivery whose attempt was already decided carries that "
            "decision out instead and is not counted.",
            ["reason"],
            registry=registry,
        )
        self.post_seconds = Histogram(
            "scorebox_webhook_attempt_seconds",
            "Duration of a webhook attempt: vetting its address, signing and the POST.",
            ["purpose"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )

    def count_attempt(self, purpose: str, outcome: str, seconds: float) -> None:
        self.attempts.labels(purpose, outcome).inc()
        self.post_seconds.labels(purpose).observe(seconds)
