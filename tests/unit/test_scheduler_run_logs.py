"""What a failed cron run logs: a database outage a line, anything else its traceback."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from pymongo.errors import AutoReconnect, ExecutionTimeout

from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.runs import Retry, RetryPolicy, run_cron_job
from shared.contracts import RunCronJob
from tests.unit.test_scheduler_dispatch import START, Clock, FakeFirings

JOB = "usage-rollup"
DEADLINE_S = 300.0
POLICY = RetryPolicy(max_attempts=3, base=timedelta(seconds=5), cap=timedelta(minutes=10))


@pytest.mark.parametrize(
    ("error", "level", "traceback"),
    [
        (AutoReconnect("the database stalled"), logging.WARNING, False),
        (ValueError("a bug in the job"), logging.ERROR, True),
    ],
)
async def test_a_run_failed_by_its_database_logs_a_line_and_a_bug_its_traceback(
    caplog: pytest.LogCaptureFixture, error: Exception, level: int, traceback: bool
) -> None:
    """A stand-in stalled under load logged a whole pymongo traceback at ERROR for an
    outage every other path reports in a line (a walkthrough)."""
    firings = FakeFirings()
    firing = await firings.claim(JOB, START, now=START, owner="a")
    assert firing is not None
    command = RunCronJob(task_id=firing.run_id, job=JOB, scheduled_for=START, fired_at=START)

    async def failing(run: JobRun) -> JobOutcome:
        raise error

    with caplog.at_level(logging.WARNING, logger="scorebox"):
        decision = await run_cron_job(
            command, handlers={JOB: failing}, firings=firings, retry=POLICY, clock=Clock(START)
        )

    assert isinstance(decision, Retry)
    [record] = [r for r in caplog.records if "cron job usage-rollup" in r.getMessage()]
    assert record.levelno == level
    assert (record.exc_info is not None) is traceback


async def test_a_run_that_outlasts_its_database_deadline_keeps_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its timeout is a database error too, which read as an outage: the line did not say
    which step ran out (the re-read)."""
    firings, clock = FakeFirings(), Clock(START)
    firing = await firings.claim(JOB, START, now=START, owner="a")
    assert firing is not None
    command = RunCronJob(task_id=firing.run_id, job=JOB, scheduled_for=START, fired_at=START)

    async def slow(run: JobRun) -> JobOutcome:
        clock.now += timedelta(seconds=DEADLINE_S)
        raise ExecutionTimeout("operation exceeded time limit")

    with caplog.at_level(logging.WARNING, logger="scorebox"):
        await run_cron_job(
            command,
            handlers={JOB: slow},
            firings=firings,
            retry=POLICY,
            clock=clock,
            db_timeout_s=DEADLINE_S,
        )

    [record] = [r for r in caplog.records if "cron job usage-rollup" in r.getMessage()]
    assert (record.levelno, record.exc_info is not None) == (logging.ERROR, True)
