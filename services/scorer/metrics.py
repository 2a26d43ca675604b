"""The scorer's own metric families (`shared.metrics` has those every service records)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.scorer.decisions import Decision, Defer, Drop, Finish, Hold, Retry
from shared.contracts import TaskCompleted
from shared.metrics import DURATION_BUCKETS

CANCELLED, TOO_LATE = "cancelled", "too_late"
CANCEL_OUTCOMES = (CANCELLED, TOO_LATE)


class ScorerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry or CollectorRegistry()
        self.model_calls = Counter(
            "scorebox_model_calls",
            "Model calls by outcome (completed; transient: retried if attempts are left; "
            "permanent: the task fails) and error code.",
            ["outcome", "code"],
            registry=registry,
        )
        self.model_call_seconds = Histogram(
            "scorebox_model_call_seconds",
            "Duration of a model call, retries of an unusable answer included, by outcome.",
            ["outcome"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.decisions = Counter(
            "scorebox_scorer_decisions",
            "What became of a delivery of score.requested: completed, failed, retry, defer "
            "(sent down the wait ladder: not due, or claimed elsewhere; or sent again at stop "
            "before a model slot), hold (a redelivery held while another claim lasts), drop (a "
            "duplicate or superseded), dead_lettered (given up: unreadable, its retries spent, "
            "or at the crash or delivery limit; the task fails), letter_refused (given up so, "
            "but the broker refused the DLQ copy: returned to its queue as failed, for RabbitMQ "
            "to dead-letter at its delivery limit), resent (a database or scorer failure, "
            "tried again later; or at the delivery limit, handed back at stop). "
            "Per delivery: a redelivery that replays a recorded decision counts it again.",
            ["decision"],
            registry=registry,
        )
        self.slots_busy = Gauge(
            "scorebox_model_slots_busy",
            "Model slots held (claiming or calling the model); at most SCORER_CONCURRENCY.",
            registry=registry,
        )

        self.model_calls_paused = Gauge(
            "scorebox_model_calls_paused",
            "1 while the provider's rate limit (429), or an outage (calls of several texts in "
            "a row found it unavailable), pauses this scorer's model calls.",
            registry=registry,
        )
        self.rate_limit_pauses = Counter(
            "scorebox_model_rate_limit_pauses",
            "Pauses of this scorer's model calls begun while none lasted (a 429), and outages "
            "taken for one (the provider found unavailable by the calls of several texts in a "
            "row, or by its first call and a check), a pause lasting included.",
            registry=registry,
        )
        self.provider_checks = Counter(
            "scorebox_model_provider_checks",
            "Calls of the provider that are no text's, made as an outage's probe when only "
            "texts (or tenants) seen failing wait, or to confirm a starting replica's first "
            "call found it unavailable, by what they found: answered (the outage is over, or "
            "was none), rate_limited, unavailable.",
            ["found"],
            registry=registry,
        )
        self.shared_pauses = Counter(
            "scorebox_model_rate_limit_pauses_shared",
            "Rate-limit pauses of another scorer replica (same provider and API key) that "
            "paused or lengthened this one's.",
            registry=registry,
        )
        self.batch_cancels_heard = Counter(
            "scorebox_scorer_batch_cancels_heard",
            "Batch cancellations announced by the gateway (batch.cancelling) that this "
            "replica holds, to cancel the batch's items at delivery.",
            registry=registry,
        )
        self.cancelled_at_delivery = Counter(
            "scorebox_scorer_cancelled_at_delivery",
            "Deliveries of score.requested cancelled when they arrived, their batch's "
            "cancellation heard, the item's own score.cancel not recorded yet.",
            registry=registry,
        )

        self.cancellations = Counter(
            "scorebox_scorer_cancellations",
            "Deliveries of score.cancel by outcome: cancelled (the generation is decided as "
            "failed, cancelled; a repeated cancel finding its cancellation recorded counts "
            "again), too_late (its model call had started, it had finished, or a newer "
            "generation exists). Unreadable ones and those not recorded are not counted.",
            ["outcome"],
            registry=registry,
        )
        for outcome in CANCEL_OUTCOMES:  # both series exported from the start, at 0
            self.cancellations.labels(outcome)

    def count_cancellation(self, outcome: str) -> None:
        self.cancellations.labels(outcome).inc()

    def count_decision(self, decision: Decision, *, lettered: bool | None = None) -> None:
        """`lettered`: for a give-up that dead-letters, whether its letter is in the DLQ."""
        if lettered is not None:
            self.count_dead_lettered(lettered)
        else:
            self.decisions.labels(decision_label(decision)).inc()

    def count_dead_lettered(self, lettered: bool) -> None:
        """A delivery given up: `lettered` once its copy is in the DLQ; else the broker
        refused the copy and it went back to its queue as failed, for RabbitMQ to
        dead-letter it at the delivery limit (without the reason)."""
        self.decisions.labels("dead_lettered" if lettered else "letter_refused").inc()

    def count_resent(self) -> None:
        self.decisions.labels("resent").inc()


def decision_label(decision: Decision) -> str:
    match decision:
        case Finish(event=event):
            return "completed" if isinstance(event, TaskCompleted) else "failed"
        case Retry():
            return "retry"
        case Defer():
            return "defer"
        case Hold():
            return "hold"
        case Drop():
            return "drop"
