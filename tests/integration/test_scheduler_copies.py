"""Copies of a cron run's message run it once: the rest wait while it runs, and are dropped
once the run has passed their step (`services.scheduler.firings`, holds).

A publish the broker confirms too late (a memory alarm blocking the connection, a slow link)
is sent again: the dispatcher re-publishes a claim still `claimed` every
`SCHEDULER_REDISPATCH_S`, and `keep_publishing` re-sends a next slice or retry until one send
is confirmed. Every copy that reached the queue ran the job, all at once, even for a job that
forbids overlapping runs, and each copy of a next slice started a chain of its own. Here the
copies really reach RabbitMQ (`LateConfirms` publishes each, then reports it unconfirmed, as
`PublishUnconfirmed` says such a message may be queued) and a real scheduler consumes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, override

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.config import parse_config
from services.scheduler.consumer import CronJobRunner
from services.scheduler.dispatcher import Dispatcher, run_command_for
from services.scheduler.firings import Firing, Firings, FiringState
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.messaging import SchedulerBus
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.runs import RetryPolicy
from services.scheduler.schedule import JobCatalog
from shared.bus import PublishUnconfirmed
from shared.contracts import RunCronJob
from shared.runtime import make_broker
from shared.topology import CRON_JOBS
from tests.integration import test_scheduler
from tests.integration.test_scheduler import Env, MovableClock, scheduler
from tests.support import HandedDelivery, drain, eventually

mongo_client = test_scheduler.mongo_client  # fixtures
topology = test_scheduler.topology
env = test_scheduler.env

JOB = "rollup"
FIVE_PAST = datetime(2030, 1, 1, 10, 5, 0, 300_000, tzinfo=UTC)
RETRY = RetryPolicy(max_attempts=3, base=timedelta(seconds=1), cap=timedelta(seconds=10))
# The job's configuration for the schedulers that consume the copies: they fire nothing.
CONSUMING = parse_config({"jobs": {JOB: {"cron": "5 * * * *", "enabled": False}}}, {})


class LateConfirms:
    """Publishes on the real broker, then reports the first `late` sends unconfirmed (their
    confirm came after the publish timeout): each of them is queued all the same."""

    def __init__(self, bus: SchedulerBus, *, late: int | None = None) -> None:
        self._bus = bus
        self._late = late  # None: every send
        self.sent: list[RunCronJob] = []

    async def publish_run(self, command: RunCronJob, *, headers: Any = None) -> None:
        await self._bus.publish_run(command, headers=headers)
        self.sent.append(command)
        if self._late is None or len(self.sent) <= self._late:
            raise PublishUnconfirmed("no confirm within the publish timeout")


class LateConfirmingBus(SchedulerBus):
    """The scheduler's bus whose run publishes are confirmed late `late` times first."""

    late: LateConfirms

    @override
    async def publish_run(self, command: RunCronJob, *, headers: Any = None) -> None:
        await self.late.publish_run(command, headers=headers)


@asynccontextmanager
async def real_bus(env: Env, clock: MovableClock) -> AsyncIterator[SchedulerBus]:
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        yield SchedulerBus(broker, 10, clock)


class Gate:
    """A job handler that records the slices it starts and holds each until released."""

    def __init__(self, *, more_until_slice: int = 0) -> None:
        self.started: list[JobRun] = []
        self.released = asyncio.Event()
        self._more_until_slice = more_until_slice

    async def __call__(self, run: JobRun) -> JobOutcome:
        self.started.append(run)
        await self.released.wait()
        return JobOutcome(summary={}, more=run.slice < self._more_until_slice)


class Running(MovableClock):
    """A clock that goes on from `now` at the pace of real time: a copy waiting for the run
    is due again a few seconds later."""

    def __init__(self, now: datetime) -> None:
        super().__init__(now)
        self._started = time.monotonic()

    def __call__(self) -> datetime:
        return self.now + timedelta(seconds=time.monotonic() - self._started)


async def runs_counted(api: httpx.AsyncClient, result: str) -> int:
    exposition = (await api.get("/metrics")).text
    return sum(
        int(sample.value)
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "scorebox_cron_runs_total"
        and sample.labels == {"job": JOB, "result": result}
    )


async def others_waited(api: httpx.AsyncClient, gate: Gate, copies: int) -> None:
    """Wait until one copy has started the job and every other one has waited at least once."""

    async def waited() -> bool:
        return bool(gate.started) and await runs_counted(api, "deferred") >= copies - 1

    await eventually(waited, what=f"{copies - 1} copies waiting")


async def others_dropped(api: httpx.AsyncClient, copies: int) -> None:
    async def dropped() -> bool:
        return await runs_counted(api, "dropped") >= copies - 1

    await eventually(dropped, what=f"{copies - 1} copies dropped")


async def succeeded(firings: Firings, run_id: str) -> None:
    async def ended() -> Firing | None:
        firing = await firings.find(run_id)
        return firing if firing is not None and firing.state.is_final else None

    firing = await eventually(ended, what=f"run {run_id} ended")
    assert firing.state is FiringState.SUCCEEDED, firing.error


async def test_copies_of_a_firing_re_published_while_unconfirmed_run_it_once(env: Env) -> None:
    await drain(env.amqp_url, CRON_JOBS.name)
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    jobs = JobCatalog.from_config(parse_config({"jobs": {JOB: {"cron": "5 * * * *"}}}, {}).jobs)
    clock = MovableClock(FIVE_PAST)
    async with real_bus(env, clock) as bus:
        late = LateConfirms(bus)
        dispatcher = Dispatcher(
            jobs,
            firings=firings,
            publish=late.publish_run,
            clock=clock,
            grace=timedelta(seconds=60),
            redispatch_after=timedelta(seconds=30),
            owner="blocked-replica",
        )
        for _ in range(4):  # the claim's publish, then a re-publish every 30 s
            with contextlib.suppress(PublishUnconfirmed):  # a re-publish's error ends its tick
                await dispatcher.tick()
            clock.now += timedelta(seconds=31)
    assert len(late.sent) == 4
    assert len({command.run_id for command in late.sent}) == 1

    env.clock = Running(clock.now)  # the consuming replica's clock
    gate = Gate()
    async with scheduler(env, CONSUMING, handlers={JOB: gate}) as (api, _):
        await others_waited(api, gate, copies=4)
        assert len(gate.started) == 1, "one run of a `forbid` job ran once per copy, at once"
        gate.released.set()
        await succeeded(firings, late.sent[0].run_id)
        await others_dropped(api, copies=4)
    assert len(gate.started) == 1


async def test_a_next_slice_re_sent_while_unconfirmed_continues_the_run_once(env: Env) -> None:
    await drain(env.amqp_url, CRON_JOBS.name)
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    env.clock = Running(FIVE_PAST)
    firing = await firings.claim(JOB, FIVE_PAST, now=env.clock(), owner="a", exclusive=True)
    assert firing is not None
    first_slice = Gate(more_until_slice=1)
    first_slice.released.set()
    async with real_bus(env, env.clock) as bus:
        late_bus = LateConfirmingBus(bus.broker, bus.timeout_s, env.clock)
        late_bus.late = LateConfirms(bus, late=2)  # two sends time out, the third is confirmed
        runner = CronJobRunner(
            handlers={JOB: first_slice},
            firings=firings,
            retry=RETRY,
            bus=late_bus,
            clock=env.clock,
            job_db_timeout_s=30,
            metrics=SchedulerMetrics(CollectorRegistry()),
        )
        delivery = HandedDelivery(run_command_for(firing).model_dump_json().encode())
        await runner.on_message(delivery)
    copies = late_bus.late.sent
    assert [command.slice for command in copies] == [1, 1, 1]

    later_slices = Gate()
    async with scheduler(env, CONSUMING, handlers={JOB: later_slices}) as (api, _):
        await others_waited(api, later_slices, copies=3)
        assert [run.slice for run in later_slices.started] == [1], "one chain per copy"
        later_slices.released.set()
        await succeeded(firings, firing.run_id)
        await others_dropped(api, copies=3)
    assert [run.slice for run in later_slices.started] == [1]
