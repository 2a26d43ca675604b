"""A cron run given up owes its dead letter until the broker confirmed it.

The write that records a give-up (`finish(FAILED, letter_owed=True)`) marks the letter owed;
the consumer clears it once the letter is written (`letter_written`). A give-up whose write
was applied but its answer lost (a connection reset: a transient error) was "MongoDB
unavailable around the run": sent again as a fresh copy, which found the run ended and was
dropped, the run failed for good with no dead letter (nothing to replay, no DLQ alert; found
in review). Now any delivery of a run failed with its letter owed, on any replica and by any
path (due or early, job known or not, at the delivery limit), is dead-lettered with the
recorded reason; a run that succeeded, or was given up with its letter written, or by an
earlier build (no flag), still has its deliveries dropped. In memory (`FakeFirings`), the
dead letters counted where the consumer publishes them.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pymongo.errors import AutoReconnect

import shared.runtime as runtime
from services.scheduler.consumer import CronJobRunner
from services.scheduler.errors import PermanentJobError
from services.scheduler.firings import FiringState
from services.scheduler.jobs import JobHandler, JobOutcome, JobRun
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.runs import (
    Defer,
    Drop,
    GiveUp,
    RetryPolicy,
    RunDecision,
    give_up_at_delivery_limit,
    run_cron_job,
)
from shared.contracts import RunCronJob
from tests.support import HandedDelivery, sample
from tests.unit.test_scheduler_dispatch import Clock, FakeFirings

JOB = "rollup"
NOW = datetime(2030, 1, 1, 10, 5, tzinfo=UTC)
POLICY = RetryPolicy(3, timedelta(seconds=1), timedelta(seconds=10))
REASON = "PermanentJobError: configuration missing"


class AnswerLostOnce(FakeFirings):
    """Records the run's end, then loses the answer once (a connection reset after the write
    applied: a transient error, which the runner meets by sending the run again)."""

    lost = False

    async def finish(self, run_id: str, **kwargs: Any) -> bool:
        applied = await super().finish(run_id, **kwargs)
        if not self.lost:
            self.lost = True
            raise AutoReconnect("connection reset after the write")
        return applied


class AppliedButAnsweredFalse(FakeFirings):
    """A retried write: the first try applied, the retry found the run ended (False)."""

    async def finish(self, run_id: str, **kwargs: Any) -> bool:
        await super().finish(run_id, **kwargs)
        return False


class LetterNotRecorded(FakeFirings):
    """The database away when the letter is recorded written."""

    async def letter_written(self, run_id: str) -> None:
        raise AutoReconnect("the database is away")


class Sent:
    broker: Any = object()
    timeout_s = 1.0

    def __init__(self) -> None:
        self.commands: list[RunCronJob] = []

    async def publish_run(self, command: RunCronJob, *, headers: Any = None) -> None:
        self.commands.append(command)


@pytest.fixture
def letters(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The reasons of the dead letters the consumer writes (each confirmed at once)."""
    written: list[str] = []

    async def publish_dead_letter(broker: Any, work_queue: Any, **kwargs: Any) -> None:
        written.append(kwargs["error"])

    monkeypatch.setattr(runtime, "publish_dead_letter", publish_dead_letter)
    return written


async def _misconfigured(run: JobRun) -> JobOutcome:
    raise PermanentJobError("configuration missing")


async def _never_run(run: JobRun) -> JobOutcome:
    raise AssertionError("the job of a run that has ended was run")


def _replica(
    firings: FakeFirings, sent: Sent, clock: Clock, metrics: SchedulerMetrics | None = None
) -> CronJobRunner:
    return CronJobRunner(
        handlers={JOB: _misconfigured},
        firings=firings,
        retry=POLICY,
        bus=sent,  # type: ignore[arg-type]
        clock=clock,
        job_db_timeout_s=10,
        metrics=metrics or SchedulerMetrics(CollectorRegistry()),
    )


def _delivery(command: RunCronJob) -> HandedDelivery:
    return HandedDelivery(command.model_dump_json().encode(), message_id=command.message_id)


async def _claimed(firings: FakeFirings) -> RunCronJob:
    firing = await firings.claim(JOB, NOW, now=NOW, owner="a")
    assert firing is not None
    return RunCronJob(task_id=firing.run_id, job=JOB, scheduled_for=NOW, fired_at=NOW, step=0)


@pytest.mark.parametrize("after", [timedelta(0), POLICY.base], ids=["early", "due"])
async def test_a_give_up_whose_failed_mark_lost_its_answer_is_dead_lettered_by_its_copy(
    letters: list[str], after: timedelta
) -> None:
    """The copy sent again is dead-lettered by another replica, before its time or once due,
    and the letter is recorded written."""
    firings, sent = AnswerLostOnce(), Sent()
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)  # both replicas' counts together
    command = await _claimed(firings)

    assert await _replica(firings, sent, Clock(NOW), metrics).on_message(_delivery(command))
    [again] = sent.commands  # "MongoDB unavailable around the run": sent again, uncounted
    assert (letters, firings.by_id[command.run_id].letter_owed) == ([], True)
    other = _replica(firings, Sent(), Clock(NOW + after), metrics)
    assert await other.on_message(_delivery(again))

    firing = firings.by_id[command.run_id]
    assert (firing.state, firing.error) == (FiringState.FAILED, REASON)
    assert letters == [REASON]
    assert not firing.letter_owed
    # One run given up, one letter: one give-up (found in review: the copy counted none).
    assert sample(registry, "scorebox_cron_runs_total", job=JOB, result="gave_up") == 1


async def test_a_letter_whose_record_failed_stays_owed_and_the_delivery_is_acked(
    letters: list[str],
) -> None:
    """The letter written, the delivery is settled; a later copy may write a second one."""
    firings = LetterNotRecorded()
    command = await _claimed(firings)

    assert await _replica(firings, Sent(), Clock(NOW)).on_message(_delivery(command))

    assert letters == [REASON]
    assert firings.by_id[command.run_id].owes_letter


async def _given_up(firings: FakeFirings, *, owed: bool, written: bool = False) -> RunCronJob:
    command = await _claimed(firings)
    await firings.begin(command.run_id, attempt=1, now=NOW)
    await firings.finish(
        command.run_id, state=FiringState.FAILED, now=NOW, error=REASON, letter_owed=owed
    )
    if written:
        await firings.letter_written(command.run_id)
    return command


async def _succeeded(firings: FakeFirings) -> RunCronJob:
    command = await _claimed(firings)
    await firings.begin(command.run_id, attempt=1, now=NOW)
    await firings.finish(command.run_id, state=FiringState.SUCCEEDED, now=NOW, result={})
    return command


async def _decisions(command: RunCronJob, firings: FakeFirings) -> dict[str, RunDecision]:
    """The decision on a copy of `command`, by every path a delivery may take."""

    async def run(handlers: dict[str, JobHandler], copy: RunCronJob) -> RunDecision:
        return await run_cron_job(
            copy, handlers=handlers, firings=firings, retry=POLICY, clock=Clock(NOW)
        )

    early = command.model_copy(update={"not_before": NOW + timedelta(minutes=1)})
    return {
        "due": await run({JOB: _never_run}, command),
        "early": await run({JOB: _never_run}, early),
        "job unknown": await run({}, command),
        "at the delivery limit": await give_up_at_delivery_limit(
            command, deliveries=5, limit=5, firings=firings, clock=Clock(NOW)
        ),
    }


async def test_every_delivery_of_a_run_whose_letter_is_owed_is_dead_lettered() -> None:
    """With the reason its give-up recorded, whatever the path (its letter refused, say)."""
    firings = FakeFirings()
    command = await _given_up(firings, owed=True)

    decisions = await _decisions(command, firings)

    assert decisions == dict.fromkeys(decisions, GiveUp(REASON))


@pytest.mark.parametrize(
    "ended",
    [
        _succeeded,
        lambda firings: _given_up(firings, owed=True, written=True),
        lambda firings: _given_up(firings, owed=False),  # by an earlier build: no flag
    ],
    ids=["succeeded", "given up, its letter written", "given up by an earlier build"],
)
async def test_a_delivery_of_a_run_ended_owing_no_letter_is_dropped(ended: Any) -> None:
    firings = FakeFirings()
    command = await ended(firings)

    decisions = await _decisions(command, firings)

    assert {path: type(decision) for path, decision in decisions.items()} == {
        "due": Drop,
        "early": Defer,  # down the ladder, as before: dropped once due
        "job unknown": Drop,
        "at the delivery limit": Drop,
    }


async def test_a_give_up_at_the_delivery_limit_whose_write_was_retried_is_still_ours() -> None:
    """The write applied, its retry answered "ended already": the letter is owed, ours."""
    firings = AppliedButAnsweredFalse()
    command = await _claimed(firings)
    await firings.begin(command.run_id, attempt=1, now=NOW)

    decision = await give_up_at_delivery_limit(
        command, deliveries=5, limit=5, firings=firings, clock=Clock(NOW)
    )

    assert isinstance(decision, GiveUp)
    assert "delivery limit 5 reached" in decision.reason
    assert firings.by_id[command.run_id].owes_letter
