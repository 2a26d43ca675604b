"""Runs of one job do not overlap unless the job allows it (`services.scheduler.overlap`):
the in-memory firings (with their lease index) and an injected clock; no broker, no sleeping.
`tests/integration/test_scheduler_overlap.py` runs it on the real database, two replicas."""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from typing import cast

import pytest

from services.scheduler.config import Concurrency, MissedFirings, parse_config
from services.scheduler.dead_letters import CronDeadLetters
from services.scheduler.dispatcher import fire_by_hand, fire_replay
from services.scheduler.errors import ConfigurationError, RunInProgress
from services.scheduler.firings import FiringState
from services.scheduler.schedule import JobCatalog, ScheduledJob
from services.scheduler.settings import SchedulerSettings
from shared.contracts import RunCronJob, rfc3339
from shared.dead_letters import DeadLetterWalker
from tests.unit.test_dead_letter_replay_lookups import HeldLetters, Letter
from tests.unit.test_scheduler_dispatch import (
    ON_TIME,
    Clock,
    FakeFirings,
    Published,
    _dispatcher,
    _jobs,
)

STALE = timedelta(hours=1)
HOUR = timedelta(hours=1)


async def _running_since_ten(firings: FakeFirings, clock: Clock, published: Published) -> str:
    """The 10:05 run of the hourly job, started and not ended (a chain of slices)."""
    clock.now = ON_TIME
    await _dispatcher(firings, published, clock, _jobs()).tick()
    (command,) = published.commands
    await firings.begin(command.run_id, attempt=1, now=clock.now)
    return command.run_id


async def test_a_fire_time_during_a_run_is_skipped_as_an_overlap_and_the_next_one_runs() -> None:
    firings, published, clock = FakeFirings(), Published(), Clock(ON_TIME)
    running = await _running_since_ten(firings, clock, published)
    replicas = [_dispatcher(firings, published, clock, _jobs(), owner) for owner in "ab"]
    clock.now = ON_TIME + HOUR - timedelta(minutes=1)
    await firings.begin(running, attempt=1, now=clock.now)  # its next slice: alive

    clock.now = ON_TIME + HOUR  # 11:05
    for replica in replicas:
        await replica.tick()

    assert len(published.commands) == 1
    (skipped,) = firings.of("rollup", FiringState.SKIPPED)
    assert skipped.scheduled_for.hour == 11
    assert (skipped.error or "").startswith(f"overlap: run {running} of this job is in progress")
    await firings.finish(running, state=FiringState.SUCCEEDED, now=clock.now)
    clock.now += HOUR  # 12:05
    await replicas[0].tick()
    assert [c.scheduled_for.hour for c in published.commands] == [10, 12]


async def test_a_run_that_keeps_making_progress_is_never_taken_for_dead() -> None:
    firings, published, clock = FakeFirings(), Published(), Clock(ON_TIME)
    running = await _running_since_ten(firings, clock, published)
    dispatcher = _dispatcher(firings, published, clock, _jobs())
    for _ in range(5):  # five hours of slices, each starting within the stale limit
        clock.now += HOUR
        await firings.retrying(running, error="x", next_attempt_at=clock.now, now=clock.now)
        await dispatcher.tick()
    assert len(published.commands) == 1
    assert firings.by_id[running].state is FiringState.RETRYING


async def test_a_run_silent_past_the_stale_limit_is_abandoned_for_the_next_fire_time() -> None:
    firings, published, clock = FakeFirings(), Published(), Clock(ON_TIME)
    running = await _running_since_ten(firings, clock, published)
    dispatcher = _dispatcher(firings, published, clock, _jobs())
    clock.now = ON_TIME + 2 * HOUR  # 12:05, silent for two hours

    await dispatcher.tick()

    assert [c.scheduled_for.hour for c in published.commands] == [10, 12]
    abandoned = firings.by_id[running]
    assert abandoned.state is FiringState.FAILED
    assert (abandoned.error or "").startswith("abandoned: no sign of progress since")
    assert f"since {rfc3339(ON_TIME)} (longer" in (abandoned.error or "")


async def test_a_manual_run_during_a_run_is_refused_and_allowed_after_it() -> None:
    firings, published, clock = FakeFirings(), Published(), Clock(ON_TIME)
    running = await _running_since_ten(firings, clock, published)
    by_hand = partial(
        fire_by_hand, "rollup", jobs=_jobs(), firings=firings, publish=published, clock=clock
    )
    with pytest.raises(RunInProgress) as refused:
        await by_hand(owner="a")
    assert refused.value.run_id == running
    assert len(firings.of("rollup")) == 1  # nothing kept of the refused run

    await firings.finish(running, state=FiringState.SUCCEEDED, now=clock.now)
    assert (await by_hand(owner="a")).manual


async def _claimed_by_hand(firings: FakeFirings, clock: Clock) -> str:
    """A run by hand of the hourly job, claimed a moment before its 10:05 fire time and not
    yet published (its publish under way, or refused by the broker)."""
    claimed = await firings.claim(
        "rollup",
        clock.now - timedelta(seconds=1),
        now=clock.now - timedelta(seconds=1),
        owner="by-hand",
        manual=True,
        exclusive=True,
    )
    assert claimed is not None
    return claimed.run_id


async def test_a_fire_time_behind_a_run_by_hand_being_published_runs_if_it_is_withdrawn() -> None:
    """The fire time found the lease held by a run by hand whose publish the broker then
    refused: recorded skipped as an overlap, and the run withdrawn, nothing ran for that
    fire time (a walkthrough)."""
    firings, published, clock = FakeFirings(), Published(), Clock(ON_TIME)
    dispatcher = _dispatcher(firings, published, clock, _jobs())
    by_hand = await _claimed_by_hand(firings, clock)

    await dispatcher.tick()
    assert firings.of("rollup", FiringState.SKIPPED) == []
    assert published.commands == []

    assert await firings.forget_unpublished(by_hand)  # the broker refused it: withdrawn
    clock.now += timedelta(seconds=1)
    await dispatcher.tick()
    assert [c.scheduled_for.hour for c in published.commands] == [10]


async def test_a_fire_time_behind_a_run_by_hand_that_went_ahead_is_skipped_as_an_overlap() -> None:
    firings, published, clock = FakeFirings(), Published(), Clock(ON_TIME)
    dispatcher = _dispatcher(firings, published, clock, _jobs())
    by_hand = await _claimed_by_hand(firings, clock)
    await dispatcher.tick()

    await firings.mark_dispatched(by_hand, now=clock.now)
    clock.now += timedelta(seconds=1)
    await dispatcher.tick()
    (skipped,) = firings.of("rollup", FiringState.SKIPPED)
    assert (skipped.error or "").startswith(f"overlap: run {by_hand} of this job")
    assert published.commands == []


async def test_a_job_that_allows_overlap_runs_every_firing() -> None:
    firings, published, clock = FakeFirings(), Published(), Clock(ON_TIME)
    jobs = _jobs(concurrency=Concurrency.ALLOW)
    await _dispatcher(firings, published, clock, jobs).tick()
    clock.now += HOUR
    await _dispatcher(firings, published, clock, jobs).tick()
    await fire_by_hand(
        "rollup", jobs=jobs, firings=firings, publish=published, clock=clock, owner="a"
    )
    assert len(published.commands) == 3


async def test_a_replay_beside_a_run_in_progress_keeps_its_letter() -> None:
    firings, published, clock = FakeFirings(), Published(), Clock(ON_TIME)
    jobs = _jobs()
    letters = []
    for run_id in ("dead-1", "dead-2"):
        dead = RunCronJob(task_id=run_id, job="rollup", scheduled_for=ON_TIME, fired_at=ON_TIME)
        letters.append(Letter(body=dead.model_dump_json().encode(), message_id=f"m-{run_id}"))
    held = HeldLetters(letters)
    dead_letters = CronDeadLetters(
        cast(DeadLetterWalker, held),
        jobs=jobs,
        replay_run=partial(
            fire_replay, jobs=jobs, firings=firings, publish=published, clock=clock, owner="a"
        ),
        clock=clock,
    )

    replay = await dead_letters.replay(None)

    assert [letter.dead_run_id for letter in replay.replayed] == ["dead-1"]
    assert replay.skipped_in_progress == ["dead-2"]
    assert [letter.message_id for letter in held.removed] == ["m-dead-1"]


def test_the_concurrency_policy_is_forbid_unless_configured() -> None:
    config = parse_config(
        {"jobs": {"a": {"cron": "5 * * * *"}, "b": {"cron": "5 * * * *", "concurrency": "allow"}}},
        {"CRON_A_CONCURRENCY": "Allow"},
    )
    assert [job.concurrency for job in config.jobs.values()] == [Concurrency.ALLOW] * 2
    default = parse_config({"jobs": {"a": {"cron": "5 * * * *"}}}, {})
    assert default.jobs["a"].concurrency is Concurrency.FORBID
    assert ScheduledJob.from_config("a", default.jobs["a"]).forbids_overlap
    with pytest.raises(ConfigurationError):
        parse_config({"jobs": {"a": {"cron": "5 * * * *", "concurrency": "replace"}}}, {})


def test_a_stale_limit_a_live_run_can_reach_is_refused() -> None:
    """A live run writes its heartbeat at least every consumer timeout (1800 s) plus the
    longest back-off: a shorter limit would abandon it and start its job beside it."""
    with pytest.raises(ValueError, match="SCHEDULER_RUN_STALE_S"):
        SchedulerSettings.model_validate(
            {"SCHEDULER_RUN_STALE_S": "2000", "SCHEDULER_RETRY_CAP_S": "600"}
        )
    assert SchedulerSettings.model_validate({}).run_stale_s == 3600


def test_the_catalog_keeps_each_jobs_policy() -> None:
    jobs = JobCatalog(
        [
            ScheduledJob(
                "x", "5 * * * *", "UTC", MissedFirings.SKIP, True, concurrency=Concurrency.ALLOW
            )
        ]
    )
    assert not jobs.get("x").forbids_overlap
