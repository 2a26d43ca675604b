"""A scheduler stopped during a cron run hands the run back without counting a delivery.

At stop, a run's delivery had `BROKER_TIMEOUT_S` to end and was then left unsettled: the
quorum queue counted its return as a crash, and five stops during a long slice (a rolling
deploy each) failed the run "delivered 5 times without being settled" and dead-lettered
it. Now the jobs in hand get half of it, and those still running are cut short and their
deliveries handed back as fresh copies with their counts carried, then acked.
"""

from __future__ import annotations

import asyncio

from services.scheduler.config import parse_config
from services.scheduler.firings import Firing, Firings, FiringState
from services.scheduler.jobs import JobOutcome, JobRun
from shared.topology import CRON_JOBS
from tests.integration import test_scheduler
from tests.integration.test_scheduler import Env, scheduler
from tests.support import drain, eventually

mongo_client = test_scheduler.mongo_client  # fixtures
topology = test_scheduler.topology
env = test_scheduler.env

JOB = "rollup"
# The job is only run by hand here: the schedulers fire nothing of their own.
CONSUMING = parse_config({"jobs": {JOB: {"cron": "5 * * * *", "enabled": False}}}, {})
QUICK_STOP = {"BROKER_TIMEOUT_S": 3}  # the jobs in hand get 1.5 s at stop


class Slow:
    """A job handler that starts and never ends by itself (a long slice)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def __call__(self, run: JobRun) -> JobOutcome:
        self.started.set()
        await asyncio.Event().wait()
        return JobOutcome()


async def _ended(firings: Firings, run_id: str) -> Firing:
    async def final() -> Firing | None:
        firing = await firings.find(run_id)
        return firing if firing is not None and firing.state.is_final else None

    return await eventually(final, what=f"run {run_id} ended")


async def test_stopping_during_a_run_hands_it_back_without_counting_a_delivery(env: Env) -> None:
    """As many stops during the run as the queue's delivery limit, had each counted."""
    await drain(env.amqp_url, CRON_JOBS.name)
    firings = Firings(env.mongo, env.database)
    run_id = ""
    for life in range(CRON_JOBS.delivery_limit):
        slow = Slow()
        async with scheduler(env, CONSUMING, handlers={JOB: slow}, **QUICK_STOP) as (api, _):
            if life == 0:
                answer = await api.post(f"/admin/v1/cron/jobs/{JOB}/run")
                assert answer.status_code == 202
                run_id = answer.json()["run_id"]
            await asyncio.wait_for(slow.started.wait(), timeout=30)

    calls: list[JobRun] = []

    async def finishing(run: JobRun) -> JobOutcome:
        calls.append(run)
        return JobOutcome(summary={"done": True})

    async with scheduler(env, CONSUMING, handlers={JOB: finishing}, **QUICK_STOP):
        firing = await _ended(firings, run_id)
    assert firing.state is FiringState.SUCCEEDED, firing.error
    assert [run.run_id for run in calls] == [run_id]
