"""The scheduler's own metric families (`shared.metrics` has those every service records)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from services.scheduler.runs import Continue, Defer, Drop, Finished, GiveUp, Retry, RunDecision

UNKNOWN_JOB = "(unknown)"


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.runs = Counter(
            "scorebox_cron_runs",
            "Deliveries of cron runs by job and what came of them: finished, continued "
            "(the next slice sent), retry, deferred (not yet due), gave_up (dead-lettered: "
            "failed for good, or its delivery at the queue's delivery limit; counted by the "
            "delivery whose letter the broker confirmed, which may be a later one the run "
            "still owed it to), letter_refused (given up, the DLQ copy refused: the run "
            "owes its letter), dropped (a duplicate, or a run already final).",
            ["job", "result"],
            registry=registry or CollectorRegistry(),
        )

    def count_run(self, job: str, decision: RunDecision, *, lettered: bool = True) -> None:
        """`lettered`: False for a give-up whose dead letter the broker refused (the run
        still owes it; the delivery that writes it counts `gave_up`)."""
        refused = isinstance(decision, GiveUp) and not lettered
        self.runs.labels(job, "letter_refused" if refused else run_result(decision)).inc()


_RESULTS: dict[type, str] = {
    Finished: "finished",
    Continue: "continued",
    Retry: "retry",
    Defer: "deferred",
    GiveUp: "gave_up",
    Drop: "dropped",
}


def run_result(decision: RunDecision) -> str:
    return _RESULTS[type(decision)]
