"""A manual run the broker refused: answered 503 with `Retry-After` once withdrawn, and 202
`claimed` when it could not be withdrawn (the dispatcher publishes it later: refused, it
invited a retry, and a second run). Before, both answered 503, the first without saying when
to ask again. The broker refuses the run for real (its queue unbound from the exchange)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, override

import aio_pika
import httpx
from fastapi import FastAPI
from pydantic import SecretStr

from services.scheduler.api import cron_routes
from services.scheduler.config import parse_config
from services.scheduler.dispatcher import fire_by_hand
from services.scheduler.firings import Firings, FiringState
from services.scheduler.messaging import SchedulerBus
from services.scheduler.schedule import JobCatalog
from shared.contracts import RunCronJob
from shared.http import install_problem_handlers
from shared.runtime import make_broker
from shared.topology import CRON, CRON_JOBS
from tests.integration import test_scheduler
from tests.integration.test_scheduler import ADMIN_KEY, Env

mongo_client = test_scheduler.mongo_client  # fixtures
topology = test_scheduler.topology
env = test_scheduler.env

JOB = "rollup"
CONSUMING = parse_config({"jobs": {JOB: {"cron": "5 * * * *", "enabled": False}}}, {})


@asynccontextmanager
async def real_bus(env: Env) -> AsyncIterator[SchedulerBus]:
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        yield SchedulerBus(broker, 10, env.clock)


@asynccontextmanager
async def cron_runs_unroutable(amqp_url: str) -> AsyncIterator[None]:
    """The cron queue unbound from the cron exchange: the broker returns a run published."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(CRON_JOBS.name, ensure=False)
        await queue.unbind(CRON.name, routing_key=RunCronJob.routing_key)
        try:
            yield
        finally:
            await queue.bind(CRON.name, routing_key=RunCronJob.routing_key)


class Unforgetting(Firings):
    """The firings, with the database failing a withdrawal."""

    @override
    async def forget_unpublished(self, run_id: str) -> bool:
        raise ConnectionError("the database did not answer")


Trigger = Callable[[str], Awaitable[Any]]


@asynccontextmanager
async def cron_api(env: Env, firings: Firings) -> AsyncIterator[httpx.AsyncClient]:
    await firings.ensure_indexes()
    jobs = JobCatalog.from_config(CONSUMING.jobs)
    async with real_bus(env) as bus:
        trigger: Trigger = partial(
            fire_by_hand,
            jobs=jobs,
            firings=firings,
            publish=bus.publish_run,
            clock=env.clock,
            owner="a",
        )
        app = FastAPI()
        install_problem_handlers(app)
        app.include_router(
            cron_routes(
                jobs=jobs,
                firings=firings,
                trigger=trigger,
                clock=env.clock,
                admin_key=SecretStr(ADMIN_KEY),
            )
        )
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://scheduler.test",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        ) as client:
            yield client


async def test_a_manual_run_the_broker_refused_says_when_to_ask_again(env: Env) -> None:
    firings = Firings(env.mongo, env.database)
    async with cron_api(env, firings) as api, cron_runs_unroutable(env.amqp_url):
        answer = await api.post(f"/admin/v1/cron/jobs/{JOB}/run")
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "5"
    assert await firings.latest(JOB) is None  # withdrawn: nothing runs


async def test_a_refused_manual_run_that_could_not_be_withdrawn_is_accepted(env: Env) -> None:
    """It is published again by the dispatcher: a client asking again would run it twice."""
    firings = Unforgetting(env.mongo, env.database)
    async with cron_api(env, firings) as api, cron_runs_unroutable(env.amqp_url):
        answer = await api.post(f"/admin/v1/cron/jobs/{JOB}/run")
    assert answer.status_code == 202
    body = answer.json()
    assert body["state"] == "claimed"
    kept = await firings.find(body["run_id"])
    assert kept is not None
    assert kept.state is FiringState.CLAIMED


class ForgetsThenLosesTheAnswer(Firings):
    """The firings, a withdrawal applied on the server and its answer lost."""

    @override
    async def forget_unpublished(self, run_id: str) -> bool:
        await super().forget_unpublished(run_id)
        raise ConnectionError("the connection was reset before the answer")


async def test_a_withdrawal_applied_with_its_answer_lost_is_answered_refused(env: Env) -> None:
    """Answered 202 `claimed`, that run was never published: nothing was left to run it."""
    firings = ForgetsThenLosesTheAnswer(env.mongo, env.database)
    async with cron_api(env, firings) as api, cron_runs_unroutable(env.amqp_url):
        answer = await api.post(f"/admin/v1/cron/jobs/{JOB}/run")
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "5"
    assert await firings.latest(JOB) is None


class Partitioned(Firings):
    """The firings in a partition once the run is claimed: neither withdrawn nor read."""

    @override
    async def forget_unpublished(self, run_id: str) -> bool:
        raise ConnectionError("the database is away")

    @override
    async def find(self, run_id: str) -> Any:
        raise ConnectionError("the database is away")


async def test_a_refused_manual_run_neither_withdrawn_nor_read_is_not_to_be_retried(
    env: Env,
) -> None:
    """It may still run (its claim stands, and the dispatcher publishes it): answered 503
    with `Retry-After`, a client following it ran an `allow` job twice (found in review)."""
    firings = Partitioned(env.mongo, env.database)
    async with cron_api(env, firings) as api, cron_runs_unroutable(env.amqp_url):
        answer = await api.post(f"/admin/v1/cron/jobs/{JOB}/run")
    assert answer.status_code == 503
    assert "Retry-After" not in answer.headers
    problem = answer.json()
    assert problem["type"].endswith("/run-outcome-unknown")
    assert "may still run later" in problem["detail"]
    latest = await Firings(env.mongo, env.database).latest(JOB)
    assert latest is not None
    assert answer.headers["Location"] == f"/admin/v1/cron/runs/{latest.run_id}"
