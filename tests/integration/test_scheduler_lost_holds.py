"""A delivery whose hold on its cron run may be another's stops its job: taken over (its
renewal finds the hold gone: dropped, the other carries the run on), or about to lapse while
its renewals fail (a copy would take it the moment it lapses: sent again, for perhaps nobody
else holds it). It went on running, and two deliveries ran the run at once. On the real
database (MongoDB or the stand-in); the renewals' failures are played."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pymongo.errors import AutoReconnect

from services.scheduler.consumer import CronJobRunner
from services.scheduler.dispatcher import run_command_for
from services.scheduler.firings import Firing, Firings
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.runs import RetryPolicy
from shared.contracts import RunCronJob, new_id
from tests.integration import test_scheduler
from tests.integration.test_scheduler import Env, MovableClock
from tests.support import HandedDelivery

mongo_client = test_scheduler.mongo_client  # fixtures
topology = test_scheduler.topology
env = test_scheduler.env

JOB = "rollup"
NOW = datetime(2030, 1, 1, 10, 5, tzinfo=UTC)
LEASE = timedelta(seconds=60)
RENEWAL_S = 0.05
RETRY = RetryPolicy(max_attempts=3, base=timedelta(seconds=1), cap=timedelta(seconds=10))


class RenewalsFail(Firings):
    """The firings, every renewal failing as PyMongo fails in an election."""

    async def renew(self, run_id: str, *, handling: str, until: datetime, now: datetime) -> bool:
        raise AutoReconnect("the primary stepped down")


class RenewalsHang(Firings):
    """The firings, every renewal waiting on a database that does not answer (up to the
    client's own timeout, which may be minutes)."""

    async def renew(self, run_id: str, *, handling: str, until: datetime, now: datetime) -> bool:
        await asyncio.Event().wait()
        return True


class Sent:
    def __init__(self) -> None:
        self.commands: list[RunCronJob] = []

    async def publish_run(self, command: RunCronJob, *, headers: Any = None) -> None:
        self.commands.append(command)


class Stoppable:
    """A job that runs until released, and says whether it was cut short."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, run: JobRun) -> JobOutcome:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return JobOutcome()


def _runner(firings: Firings, job: Stoppable, clock: MovableClock, sent: Sent) -> CronJobRunner:
    return CronJobRunner(
        handlers={JOB: job},
        firings=firings,
        retry=RETRY,
        bus=sent,  # type: ignore[arg-type]  # records what would be published
        clock=clock,
        job_db_timeout_s=30,
        metrics=SchedulerMetrics(CollectorRegistry()),
        hold_lease=LEASE,
        hold_renewal_s=RENEWAL_S,
    )


async def _claimed(firings: Firings) -> Firing:
    await firings.ensure_indexes()
    firing = await firings.claim(JOB, NOW, now=NOW, owner="a", exclusive=True)
    assert firing is not None
    return firing


@pytest.mark.parametrize(
    "store",
    [Firings, RenewalsFail, RenewalsHang],
    ids=["taken-over", "renewals-fail", "renewals-hang"],
)
async def test_a_delivery_that_may_have_lost_its_hold_stops_its_job(
    env: Env, store: type[Firings]
) -> None:
    firings = store(env.mongo, env.database)
    firing = await _claimed(firings)
    clock = MovableClock(NOW)
    job = Stoppable()
    body = run_command_for(firing).model_dump_json().encode()
    sent = Sent()
    runner = _runner(firings, job, clock, sent)
    handling = asyncio.create_task(runner.on_message(HandedDelivery(body)))
    await asyncio.wait_for(job.started.wait(), timeout=30)

    if store is Firings:  # another delivery took the hold (its lease lapsed, say)
        taken = {"$set": {"hold.by": new_id(), "hold.message_id": new_id()}}
        await env.collection("firings").update_one({"_id": firing.run_id}, taken)
    else:  # renewals failing, its hold about to lapse
        clock.now = NOW + LEASE

    await asyncio.wait_for(job.cancelled.wait(), timeout=30)
    await asyncio.wait_for(handling, timeout=30)
    if store is Firings:
        assert sent.commands == []  # dropped: the delivery that took the hold carries it on
    else:
        [again] = sent.commands  # nobody else may hold it: sent again, its step kept
        assert (again.run_id, again.step) == (firing.run_id, 0)
