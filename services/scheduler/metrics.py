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
            "failed for good, or its delivery at the queue's delivery limit), letter_owed (a "
            "delivery of a run given up earlier whose dead letter was refused or not known "
            "written: dead-lettered now), dropped (a duplicate, or a run already final).",
            ["job", "result"],
            registry=registry or CollectorRegistry(),
        )

    def count_run(self, job: str, decision: RunDecision) -> None:
        self.runs.labels(job, run_result(decision)).inc()


_RESULTS: dict[type, str] = {
    Finished: "finished",
    Continue: "continued",
    Retry: "retry",
    Defer: "deferred",
    GiveUp: "gave_up",
    Drop: "dropped",
}


def run_result(decision: RunDecision) -> str:
    if isinstance(decision, GiveUp) and decision.owed:
        return "letter_owed"  # given up earlier, and counted then
    return _RESULTS[type(decision)]
