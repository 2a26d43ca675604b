"""A run waiting for room downstream is given up after `DOWNSTREAM_FULL_MAX_WAIT` without
progress, counted from its last progress, not from its firing. In memory (the firing store
of `test_scheduler_dispatch`), with an injected clock: no broker, no database, no sleeping."""

from __future__ import annotations

from datetime import timedelta

from services.scheduler.errors import DownstreamFull
from services.scheduler.firings import FiringState
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.runs import (
    DOWNSTREAM_FULL_MAX_WAIT,
    Continue,
    GiveUp,
    Retry,
    RetryPolicy,
    RunDecision,
    run_cron_job,
)
from shared.contracts import RunCronJob
from tests.unit.test_scheduler_dispatch import START, Clock, FakeFirings

JOB = "rescore-fanout"
POLICY = RetryPolicy(max_attempts=3, base=timedelta(seconds=5), cap=timedelta(minutes=10))


class SlowScorer:
    """A fan-out behind a slow scorer: while `drains`, each delivery after a back-off moves
    the run on (a page fits, then none: to be continued) and the next finds no room."""

    def __init__(self) -> None:
        self.drains = True
        self.room = False

    async def __call__(self, run: JobRun) -> JobOutcome:
        if self.room:
            self.room = False
            return JobOutcome(summary={}, more=True)
        raise DownstreamFull("the scorers' backlog is full")


async def _deliver(
    command: RunCronJob, job: SlowScorer, firings: FakeFirings, clock: Clock
) -> RunDecision:
    return await run_cron_job(
        command, handlers={JOB: job}, firings=firings, retry=POLICY, clock=clock
    )


async def _fired(firings: FakeFirings) -> RunCronJob:
    firing = await firings.claim(JOB, START, now=START, owner="a")
    assert firing is not None
    return RunCronJob(task_id=firing.run_id, job=JOB, scheduled_for=START, fired_at=START)


async def test_a_run_that_keeps_moving_waits_for_room_past_the_cap_from_its_firing() -> None:
    firings, clock, job = FakeFirings(), Clock(START), SlowScorer()
    command = await _fired(firings)
    last_progress = START
    while clock.now - START < 2 * DOWNSTREAM_FULL_MAX_WAIT:
        decision = await _deliver(command, job, firings, clock)
        match decision:
            case Continue(command=following):
                assert following.occurred_at == clock.now  # stamped with its progress
                last_progress = clock.now
            case Retry(command=following):
                assert following.attempt == 1
                assert following.occurred_at == command.occurred_at  # the slice's, kept
                assert following.not_before is not None
                clock.now = following.not_before
                job.room = job.drains
            case _:
                raise AssertionError(f"{decision!r} {clock.now - START} after the firing")
        command = following
    assert firings.by_id[command.run_id].state is FiringState.RETRYING

    # The scorers stop: the run is given up 6 hours after its last progress, not before.
    job.drains = job.room = False
    while True:
        decision = await _deliver(command, job, firings, clock)
        if not isinstance(decision, Retry):
            break
        assert clock.now - last_progress < DOWNSTREAM_FULL_MAX_WAIT
        assert decision.command.not_before is not None
        clock.now = decision.command.not_before
        command = decision.command
    assert isinstance(decision, GiveUp)
    assert clock.now - last_progress >= DOWNSTREAM_FULL_MAX_WAIT
    assert "since it last made progress" in decision.reason
    assert firings.by_id[command.run_id].state is FiringState.FAILED


async def test_a_first_slice_without_progress_is_given_up_after_the_cap_from_its_firing() -> None:
    firings, clock, job = FakeFirings(), Clock(START), SlowScorer()
    job.drains = False
    command = await _fired(firings)
    clock.now = START + DOWNSTREAM_FULL_MAX_WAIT - timedelta(seconds=1)
    waiting = await _deliver(command, job, firings, clock)
    assert isinstance(waiting, Retry)
    assert waiting.command.not_before is not None
    clock.now = waiting.command.not_before
    assert isinstance(await _deliver(waiting.command, job, firings, clock), GiveUp)
