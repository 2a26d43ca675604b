"""Runs of one job do not overlap (`concurrency = "forbid"`, the default): a fire time that
comes while a run of its job is in progress is recorded as skipped ("overlap"), a manual run
is refused with 409, and a run silent for longer than `SCHEDULER_RUN_STALE_S` is abandoned
so that it cannot hold its job for ever. Two replicas, the real broker and database."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import httpx

from services.scheduler.config import parse_config
from services.scheduler.firings import Firing, Firings, FiringState
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.overlap import Claim, Overlap, claim_unless_overlapping
from services.scheduler.schedule import ScheduledJob
from tests.integration import test_scheduler
from tests.integration.test_scheduler import Env, firing_state, scheduler, ticked
from tests.support import eventually

mongo_client = test_scheduler.mongo_client  # fixtures
topology = test_scheduler.topology
env = test_scheduler.env

TEN_FIVE = datetime(2030, 1, 1, 10, 5, 0, 300_000, tzinfo=UTC)
HOURLY = parse_config({"jobs": {"rollup": {"cron": "5 * * * *"}}}, {})
STALE_S = 7200


class FirstRunHeld:
    """A job whose first run is still going (a chain of slices past the hour) until released."""

    def __init__(self) -> None:
        self.runs: list[JobRun] = []
        self.release = asyncio.Event()

    async def __call__(self, run: JobRun) -> JobOutcome:
        self.runs.append(run)
        if len(self.runs) == 1:
            await self.release.wait()
        return JobOutcome(summary={"calls": len(self.runs)})

    def run_ids(self) -> list[str]:
        return list(dict.fromkeys(run.run_id for run in self.runs))


async def _rollup(api: httpx.AsyncClient) -> dict[str, object]:
    answer = await api.get("/admin/v1/cron/jobs")
    (job,) = [job for job in answer.json()["jobs"] if job["name"] == "rollup"]
    return dict(job)


async def test_an_hourly_run_that_outlasts_the_hour_is_not_started_twice(env: Env) -> None:
    env.clock.now = TEN_FIVE
    job = FirstRunHeld()
    settings = {"SCHEDULER_RUN_STALE_S": STALE_S}
    async with (
        scheduler(env, HOURLY, handlers={"rollup": job}, **settings) as (api, first),
        scheduler(env, HOURLY, handlers={"rollup": job}, **settings) as (_, second),
    ):

        async def started() -> bool:
            return len(job.runs) == 1

        await eventually(started, what="the 10:05 run started")
        env.clock.now = TEN_FIVE + timedelta(hours=1)  # 11:05, the 10:05 run still going

        async def skipped() -> dict[str, object] | None:
            last = (await _rollup(api))["last_firing"]
            return last if isinstance(last, dict) and last["state"] == "skipped" else None

        overlap = await eventually(skipped, what="the 11:05 fire time skipped")
        assert str(overlap["error"]).startswith(f"overlap: run {job.run_ids()[0]} ")
        refused = await api.post("/admin/v1/cron/jobs/rollup/run")
        assert refused.status_code == 409
        assert refused.json()["run_id"] == job.run_ids()[0]
        await ticked([first, second], max(first.ticks, second.ticks) + 5)
        assert len(job.runs) == 1

        job.release.set()
        await firing_state(api, job.run_ids()[0], "succeeded")
        env.clock.now = TEN_FIVE + timedelta(hours=2)  # 12:05: nothing in progress

        async def ran_again() -> bool:
            return len(job.run_ids()) == 2

        await eventually(ran_again, what="the 12:05 run")
        assert job.runs[1].scheduled_for == datetime(2030, 1, 1, 12, 5, tzinfo=UTC)


async def test_a_run_silent_past_the_stale_limit_no_longer_holds_its_job(env: Env) -> None:
    env.clock.now = TEN_FIVE
    job = FirstRunHeld()
    async with scheduler(env, HOURLY, handlers={"rollup": job}, SCHEDULER_RUN_STALE_S=STALE_S) as (
        api,
        _,
    ):

        async def started() -> bool:
            return len(job.runs) == 1

        await eventually(started, what="the 10:05 run started")
        env.clock.now = TEN_FIVE + timedelta(hours=3)  # silent for 3 hours: taken for dead

        async def replaced() -> bool:
            return len(job.run_ids()) == 2

        await eventually(replaced, what="a run in place of the silent one")
        dead = await firing_state(api, job.run_ids()[0], "failed")
        assert str(dead["error"]).startswith("abandoned: no sign of progress since")
        await firing_state(api, job.run_ids()[1], "succeeded")
        job.release.set()


async def test_two_replicas_claiming_two_runs_of_a_job_at_once_start_one(env: Env) -> None:
    """The lease is a unique index, not a read and a write: no window lets both through."""
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    rollup = ScheduledJob.from_config("rollup", HOURLY.jobs["rollup"])
    at = datetime(2030, 1, 1, 10, 5, tzinfo=UTC)
    claims = [
        Claim(rollup, at, owner="a"),
        Claim(rollup, at + timedelta(milliseconds=1), owner="b", manual=True),
        Claim(rollup, at + timedelta(milliseconds=2), owner="c", manual=True),
    ]

    outcomes = await asyncio.gather(
        *(
            claim_unless_overlapping(
                claim,
                firings=firings,
                clock=lambda: at,
                stale_after=timedelta(seconds=STALE_S),
            )
            for claim in claims
        )
    )

    started = [outcome for outcome in outcomes if isinstance(outcome, Firing)]
    refused = [outcome for outcome in outcomes if isinstance(outcome, Overlap)]
    assert (len(started), len(refused)) == (1, 2)
    assert {overlap.holder.run_id for overlap in refused} == {started[0].run_id}


async def test_housekeeping_ends_silent_runs_of_jobs_that_allow_overlapping_runs(env: Env) -> None:
    """Such a run holds no lease, so no next run of its job takes it over: one whose message
    was lost stayed `dispatched` or `running` for good, and the cleanup of firings, which
    deletes final ones only, kept it (found in review)."""
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    at = datetime(2030, 1, 1, 10, 5, tzinfo=UTC)
    step = timedelta(milliseconds=1)

    async def dispatched(job: str, fire_time: datetime, *, now: datetime, leased: bool) -> str:
        firing = await firings.claim(job, fire_time, now=now, owner="a", exclusive=leased)
        assert firing is not None
        await firings.mark_dispatched(firing.run_id, now=now)
        return firing.run_id

    silent = await dispatched("burst", at, now=at, leased=False)
    leased = await dispatched("rollup", at, now=at, leased=True)  # its job's next run's to end
    # A leased run of a job taken out of the schedule: no next run ends it, and it held the
    # job's lease for good (review of the scheduler).
    unscheduled = await dispatched("retired", at, now=at, leased=True)
    lively = await dispatched("burst", at + step, now=at + timedelta(hours=2), leased=False)
    claimed = await firings.claim("burst", at + 2 * step, now=at, owner="a")  # the dispatcher's
    assert claimed is not None

    abandoned = await firings.abandon_silent(
        silent_since=at + timedelta(hours=1),
        now=at + timedelta(hours=2),
        reason="abandoned",
        scheduled=["burst", "rollup"],
    )

    assert abandoned == 2
    states = {
        run_id: (await firings.find(run_id)).state  # type: ignore[union-attr]
        for run_id in (silent, leased, unscheduled, lively, claimed.run_id)
    }
    assert states == {
        silent: FiringState.FAILED,
        leased: FiringState.DISPATCHED,
        unscheduled: FiringState.FAILED,
        lively: FiringState.DISPATCHED,
        claimed.run_id: FiringState.CLAIMED,
    }
    assert await firings.active_run("retired") is None
