"""A delivery whose hold on its cron run may be another's stops its job: taken over (its
renewal finds the hold gone: dropped, the other carries the run on), or about to lapse while
its renewals fail (a copy would take it the moment it lapses: sent again, for perhaps nobody
else holds it). It went on running, and two deliveries ran the run at once. On the real
database (MongoDB or the stand-in) and broker, what the delivery sends read from the broker;
the renewals' failures are played."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import aio_pika
import pytest
from faststream.rabbit import RabbitBroker
from prometheus_client import CollectorRegistry
from pymongo.errors import AutoReconnect

from services.scheduler.consumer import CronJobRunner
from services.scheduler.dispatcher import run_command_for
from services.scheduler.firings import Firing, Firings
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.messaging import SchedulerBus
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.runs import RetryPolicy
from shared.contracts import RunCronJob, new_id
from shared.topology import CRON, DELAY
from tests.integration import test_scheduler
from tests.integration.test_scheduler import Env, MovableClock
from tests.support import HandedDelivery, watching

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


class Published:
    """What `watching_runs` caught."""

    def __init__(self, queue: aio_pika.abc.AbstractQueue) -> None:
        self._queue = queue

    async def commands(self) -> list[RunCronJob]:
        """Those published so far (each confirmed publish is in the queue by then)."""
        found = []
        while (message := await self._queue.get(no_ack=True, fail=False, timeout=10)) is not None:
            found.append(RunCronJob.model_validate_json(message.body))
        return found


@asynccontextmanager
async def watching_runs(amqp_url: str) -> AsyncIterator[Published]:
    """Every `cron.run` published while the block lasts, sent now (`scorebox.cron`) or down
    the wait ladder (`scorebox.delay`): a queue of its own, bound to both."""
    key = RunCronJob.routing_key
    async with watching(amqp_url, (CRON.name, key), (DELAY.name, f"*.{key}")) as queue:
        yield Published(queue)


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


def _runner(
    firings: Firings, job: Stoppable, clock: MovableClock, broker: RabbitBroker
) -> CronJobRunner:
    return CronJobRunner(
        handlers={JOB: job},
        firings=firings,
        retry=RETRY,
        bus=SchedulerBus(broker, timeout_s=10, clock=clock),
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
    env: Env, task_broker: RabbitBroker, store: type[Firings]
) -> None:
    firings = store(env.mongo, env.database)
    firing = await _claimed(firings)
    clock = MovableClock(NOW)
    job = Stoppable()
    body = run_command_for(firing).model_dump_json().encode()
    runner = _runner(firings, job, clock, task_broker)
    async with watching_runs(env.amqp_url) as published:
        handling = asyncio.create_task(runner.on_message(HandedDelivery(body)))
        await asyncio.wait_for(job.started.wait(), timeout=30)

        if store is Firings:  # another delivery took the hold (its lease lapsed, say)
            taken = {"$set": {"hold.by": new_id(), "hold.message_id": new_id()}}
            await env.collection("firings").update_one({"_id": firing.run_id}, taken)
        else:  # renewals failing, its hold about to lapse
            clock.now = NOW + LEASE

        await asyncio.wait_for(job.cancelled.wait(), timeout=30)
        await asyncio.wait_for(handling, timeout=30)
        sent = await published.commands()
    if store is Firings:
        assert sent == []  # dropped: the delivery that took the hold carries it on
    else:
        [again] = sent  # nobody else may hold it: sent again, its step kept
        assert (again.run_id, again.step) == (firing.run_id, 0)
