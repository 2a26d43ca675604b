"""Composition root of the scheduler: its clock loop, job consumer, usage meter and routes.

    dispatcher (every SCHEDULER_TICK_S) --RunCronJob--> scorebox.cron-jobs --> job consumer
        usage-rollup    raw usage records -> usage_daily
        rescore-fanout  catalogue of completed tasks -> RescoreTask x N (scorebox.tasks)
        housekeeping    own expired records; HousekeepingRequested; DLQ report
    scorebox.usage-meter (task.completed) --> usage records + catalogue

Everything the scheduler stores lives in its own database (`<prefix>_scheduler`).

At stop the jobs in hand get until half of `BROKER_TIMEOUT_S` from the stop's start to end;
the rest are cut short and their deliveries handed back as fresh copies
(`in_hand.CronRunsInHand`) within the other half, so a stop still takes `BROKER_TIMEOUT_S`
and adds nothing to a run's delivery count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from functools import partial
from typing import Protocol

from fastapi import FastAPI

from services.scheduler.api import cron_dead_letter_routes, cron_routes, usage_routes
from services.scheduler.catalogue import Catalogue
from services.scheduler.checkpoints import Checkpoints
from services.scheduler.config import SchedulerConfig, catalogue_retention, load_config
from services.scheduler.consumer import CronJobRunner, UsageMeter, subscribe_scheduler
from services.scheduler.dead_letters import CronDeadLetters
from services.scheduler.dispatcher import Dispatcher, fire_by_hand, fire_replay, keep_dispatching
from services.scheduler.errors import ConfigurationError
from services.scheduler.firings import Firing, Firings
from services.scheduler.jobs import Clock, JobHandler
from services.scheduler.jobs.fanout import fan_out_rescores
from services.scheduler.jobs.housekeeping import keep_house
from services.scheduler.jobs.usage import roll_up_usage
from services.scheduler.messaging import SchedulerBus
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.runs import RetryPolicy
from services.scheduler.schedule import JobCatalog
from services.scheduler.settings import SchedulerSettings
from services.scheduler.usage_store import DailyUsageStore, UsageRecords
from shared.clock_offset import DatabaseClock
from shared.consumers import ScoreboxBroker
from shared.contracts import RunCronJob, new_id
from shared.dead_letters import DeadLetterWalker
from shared.http import (
    warn_if_internal_routes_open,
)
from shared.runtime import (
    MongoClient,
    clock_watch_of,
    make_broker,
    make_mongo,
    prepare_service_database,
    start_broker,
)
from shared.service_app import internal_service_app
from shared.topology import CRON_JOBS, WORK_QUEUES

log = logging.getLogger("scorebox.scheduler")

USAGE_ROLLUP = "usage-rollup"
RESCORE_FANOUT = "rescore-fanout"
HOUSEKEEPING = "housekeeping"
# The share of the stop's grace (`BROKER_TIMEOUT_S`) the jobs in hand get to end; the rest is
# for handing back those cut short (one confirmed publish each), their acks and the closes.
RUNS_SHARE_OF_STOP = 0.5
# By when, as a share of the stop's grace, their copies must be confirmed: the deliveries in
# hand must be settled before the broker's stop gives up on them.
HAND_BACK_SHARE = 0.9


def jobs_unable_to_run(settings: SchedulerSettings) -> dict[str, str]:
    """Why jobs, by name, cannot run with these settings: refused to start when enabled, and
    refused when run by hand or replayed, not failed into the cron DLQ."""
    if settings.rubric_version is None:
        return {RESCORE_FANOUT: "RUBRIC_VERSION is not set (no current rubric version)"}
    return {}


async def _cut_short_runs(runner: CronJobRunner, *, stopping: float, stop_s: float) -> None:
    """The runs still in hand at a stop get their share of its grace, then are handed back."""
    if cut_short := await runner.in_hand.cut_short_by(
        stopping + stop_s * RUNS_SHARE_OF_STOP, hand_back_by=stopping + stop_s * HAND_BACK_SHARE
    ):
        log.warning("stopping: %d cron runs cut short and handed back", cut_short)


class _Indexed(Protocol):
    async def ensure_indexes(self) -> None: ...


async def _ensure_indexes(stores: Sequence[_Indexed]) -> None:
    for store in stores:
        await store.ensure_indexes()


def create_app(
    settings: SchedulerSettings,
    *,
    config: SchedulerConfig | None = None,
    broker: ScoreboxBroker | None = None,
    mongo: MongoClient | None = None,
    clock: Clock | None = None,
    handlers: Mapping[str, JobHandler] | None = None,
) -> FastAPI:
    """Wire the scheduler: broker + database + jobs + HTTP app, opened and closed in lifespan.

    `config` defaults to the file at `SCHEDULER_CONFIG` with the process environment's
    overrides; `handlers` adds or replaces job handlers by job name (tests).
    """
    clock = clock or DatabaseClock()  # the time its records are judged by
    config = config or load_config(settings.config_path, os.environ)
    broker = broker or make_broker(settings, name="scheduler")
    mongo = mongo or make_mongo(settings)
    database = settings.database_name("scheduler")
    firings = Firings(mongo, database)
    records = UsageRecords(mongo, database)
    daily = DailyUsageStore(mongo, database)
    catalogue = Catalogue(mongo, database)
    checkpoints = Checkpoints(mongo, database)
    bus = SchedulerBus(
        broker,
        timeout_s=settings.broker_timeout_s,
        clock=clock,
        max_backlog=settings.fanout_max_backlog,
    )
    jobs = JobCatalog.from_config(config.jobs, cannot_run=jobs_unable_to_run(settings))
    if blocked := {job.name: job.cannot_run for job in jobs.enabled if job.cannot_run}:
        raise ConfigurationError(f"enabled cron jobs that cannot run: {blocked}")
    usage_retention = timedelta(days=config.usage.raw_retention_days)
    owner = f"{socket.gethostname()}:{os.getpid()}:{new_id()[:6]}"
    stale_after = timedelta(seconds=settings.run_stale_s)

    job_handlers: dict[str, JobHandler] = {
        USAGE_ROLLUP: partial(
            roll_up_usage,
            records=records,
            daily=daily,
            retention=usage_retention,
            clock=clock,
            batch=settings.usage_rollup_batch,
        ),
        RESCORE_FANOUT: partial(
            fan_out_rescores,
            catalogue=catalogue,
            checkpoints=checkpoints,
            publish_page=bus.publish_rescore_page,
            rubric_version=settings.rubric_version,
            page_size=settings.fanout_page_size,
            max_pages=settings.fanout_pages_per_delivery,
            horizon=timedelta(seconds=settings.fanout_horizon_s),
            clock=clock,
        ),
        HOUSEKEEPING: partial(
            keep_house,
            firings=firings,
            records=records,
            catalogue=catalogue,
            checkpoints=checkpoints,
            job_names=jobs.names,
            scheduled_jobs=[job.name for job in jobs.enabled],
            work_queues=WORK_QUEUES,
            probe=bus.dead_letter_depth,
            announce=bus.announce,
            config=config.housekeeping,
            usage_retention=usage_retention,
            catalogue_retention=catalogue_retention(
                config.housekeeping, horizon=timedelta(seconds=settings.fanout_horizon_s)
            ),
            stale_after=timedelta(seconds=settings.run_stale_s),
            clock=clock,
        ),
        **(handlers or {}),
    }
    if missing := [name for name in jobs.names if name not in job_handlers]:
        raise ConfigurationError(f"configured cron jobs without a handler: {missing}")

    dispatcher = Dispatcher(
        jobs,
        firings=firings,
        publish=bus.publish_run,
        clock=clock,
        grace=timedelta(seconds=settings.grace_s),
        redispatch_after=timedelta(seconds=settings.redispatch_after_s),
        owner=owner,
        stale_after=stale_after,
    )
    runner = CronJobRunner(
        handlers=job_handlers,
        firings=firings,
        retry=RetryPolicy(
            max_attempts=settings.job_max_attempts,
            base=timedelta(seconds=settings.job_retry_base_s),
            cap=timedelta(seconds=settings.job_retry_cap_s),
        ),
        bus=bus,
        clock=clock,
        job_db_timeout_s=settings.job_db_timeout_s,
        metrics=SchedulerMetrics(broker.metrics.registry),
    )
    meter = UsageMeter(
        records=records,
        catalogue=catalogue,
        prices=config.prices,
        bus=bus,
        clock=clock,
        max_attempts=settings.meter_max_attempts,
        retry_after=timedelta(seconds=settings.meter_retry_s),
    )
    subscribe_scheduler(
        broker,
        runner=runner,
        meter=meter,
        job_concurrency=settings.job_concurrency,
        meter_prefetch=settings.meter_prefetch,
        broker_timeout_s=settings.broker_timeout_s,
    )

    async def trigger(name: str) -> Firing:
        return await fire_by_hand(
            name,
            jobs=jobs,
            firings=firings,
            publish=bus.publish_run,
            clock=clock,
            owner=owner,
            stale_after=stale_after,
        )

    async def replay(dead: RunCronJob) -> tuple[Firing, bool]:
        return await fire_replay(
            dead,
            jobs=jobs,
            firings=firings,
            publish=bus.publish_run,
            clock=clock,
            owner=owner,
            stale_after=stale_after,
        )

    dead_letters = CronDeadLetters(
        DeadLetterWalker(broker, CRON_JOBS, timeout_s=settings.broker_timeout_s),
        jobs=jobs,
        replay_run=replay,
        clock=clock,
    )

    clock_watch = clock_watch_of(mongo, settings, broker.metrics, service="scheduler", clock=clock)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        warn_if_internal_routes_open(settings.internal_api_key, "scheduler")
        await prepare_service_database(
            mongo,
            settings,
            partial(_ensure_indexes, (firings, records, daily, catalogue, checkpoints)),
            service="scheduler",
            clock_watch=clock_watch,
        )
        await start_broker(broker, settings)
        ticking = asyncio.create_task(keep_dispatching(dispatcher, interval_s=settings.tick_s))
        clock_watch.start()
        yield
        stopping = asyncio.get_running_loop().time()
        ticking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticking
        await broker.stop_consuming()
        await _cut_short_runs(runner, stopping=stopping, stop_s=settings.broker_timeout_s)
        await broker.stop(begun_at=stopping)
        await clock_watch.stop()
        await mongo.close()

    app = internal_service_app(
        "Scorebox scheduler",
        service="scheduler",
        settings=settings,
        broker=broker,
        mongo=mongo,
        lifespan=lifespan,
        admin_key=settings.admin_api_key,
    )
    app.state.dispatcher = dispatcher
    app.include_router(
        cron_routes(
            jobs=jobs,
            firings=firings,
            trigger=trigger,
            clock=clock,
            admin_key=settings.admin_api_key,
        )
    )
    app.include_router(
        cron_dead_letter_routes(dead_letters=dead_letters, admin_key=settings.admin_api_key)
    )
    app.include_router(
        usage_routes(
            daily=daily, currency=config.usage.currency, internal_key=settings.internal_api_key
        )
    )
    return app
