"""A cron job's database work runs under the job's deadline, not the request one.

The scheduler's client bounds every operation by `MONGO_TIMEOUT_S` (`timeoutMS`), meant for
request handling: at production volume the usage rollup's `update_many` and aggregations
outlasted it, every retry failed alike, and `usage_daily` stopped moving. Each job (run by
hand through the whole scheduler, on the real broker and database) must send its commands
with the deadline `SCHEDULER_JOB_DB_TIMEOUT_S` gives (`maxTimeMS`, as the client sends it:
seen here by a command listener), while recording the runs keeps the client's bound.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from pymongo import AsyncMongoClient, monitoring

from devtools.infra import Endpoint
from services.scheduler.app import HOUSEKEEPING, RESCORE_FANOUT, USAGE_ROLLUP, create_app
from services.scheduler.config import parse_config
from services.scheduler.settings import SchedulerSettings
from services.scheduler.usage_store import UsageRecord, UsageRecords
from shared.contracts import new_id
from shared.runtime import make_broker, make_mongo
from shared.topology import RESCORE_REQUESTS, declare_topology
from tests.support import advancing_clock, run_cron_job_by_hand, running

Mongo = AsyncMongoClient[dict[str, Any]]
NOW = datetime(2030, 1, 1, 10, 31, 30, tzinfo=UTC)  # far from every fire time below
ADMIN_KEY = "job-deadline-admin-key"
JOB_DB_TIMEOUT_S = 900
JOB_COLLECTIONS = {"usage_records", "usage_daily", "completed_tasks", "fanout_checkpoints"}
# Commands that carry the operation's deadline (`getMore` never does).
BOUNDED = {"find", "aggregate", "insert", "update", "delete", "findAndModify"}


class Commands(monitoring.CommandListener):
    """Every command the client sends: (database, collection, command name, maxTimeMS,
    whether it updates many documents)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, int | None, bool]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in BOUNDED:
            collection = str(event.command.get(event.command_name))
            limit = event.command.get("maxTimeMS")
            many = any(update.get("multi") for update in event.command.get("updates", ()))
            self.seen.append((event.database_name, collection, event.command_name, limit, many))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.fixture(scope="module")
async def topology(amqp_url: str) -> str:
    broker = make_broker(SchedulerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
    return amqp_url


@pytest.fixture
async def seeded(mongo: Endpoint, db_prefix: str) -> AsyncIterator[str]:
    """A database prefix of this test whose scheduler database holds usage to roll up and
    tasks the fan-out finds stale."""
    prefix = f"{db_prefix}{uuid.uuid4().hex[:6]}"
    database = f"{prefix}_scheduler"
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        records = UsageRecords(client, database)
        for tokens in (10, 20):
            await records.record(
                UsageRecord(
                    task_id=new_id(),
                    generation=0,
                    tenant_id="acme",
                    api_key_id=None,
                    model="m",
                    prompt_tokens=tokens,
                    completion_tokens=1,
                    cost_nanos=None,
                    cached=False,
                    day="2030-01-01",
                    completed_at=NOW - timedelta(hours=1),
                    recorded_at=NOW - timedelta(hours=1),
                )
            )
        await client[database]["completed_tasks"].insert_many(
            [
                {
                    "_id": new_id(),
                    "tenant_id": "acme",
                    "generation": 0,
                    "completed_at": NOW - timedelta(hours=1),  # inside FANOUT_HORIZON_S
                    "model": "m",
                    "rubric_version": None,
                }
                for _ in range(2)
            ]
        )
        yield prefix
    finally:
        await client.close()


async def test_every_job_runs_its_database_work_under_the_job_deadline(
    topology: str, mongo: Endpoint, seeded: str
) -> None:
    settings = SchedulerSettings.model_validate(
        {
            "RABBITMQ_URL": topology,
            "MONGO_URL": mongo.url,
            "MONGO_DB_PREFIX": seeded,
            "ADMIN_API_KEY": ADMIN_KEY,
            "RUBRIC_VERSION": "heuristic-v1",
            "SCHEDULER_JOB_DB_TIMEOUT_S": str(JOB_DB_TIMEOUT_S),
        }
    )
    config = parse_config(
        {
            "jobs": {  # disabled: run by hand only
                job: {"cron": "0 3 * * *", "enabled": False}
                for job in (USAGE_ROLLUP, RESCORE_FANOUT, HOUSEKEEPING)
            }
        },
        {},
    )
    commands = Commands()
    client = make_mongo(settings, event_listeners=[commands])
    app = create_app(settings, config=config, mongo=client, clock=advancing_clock(NOW))
    async with running(app) as api:
        api.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        runs = {job: await run_cron_job_by_hand(api, job) for job in (USAGE_ROLLUP, RESCORE_FANOUT)}
        runs[HOUSEKEEPING] = await run_cron_job_by_hand(api, HOUSEKEEPING)

    assert {job: run["state"] for job, run in runs.items()} == dict.fromkeys(runs, "succeeded")
    assert runs[USAGE_ROLLUP]["result"]["rolled_up"] == 2
    assert runs[RESCORE_FANOUT]["result"]["published"] == 2, runs[RESCORE_FANOUT]
    database = settings.database_name("scheduler")
    request_bound_ms = settings.mongo_timeout_s * 1000
    jobs = [
        (collection, name, limit)
        for db, collection, name, limit, many in commands.seen
        if db == database and (collection in JOB_COLLECTIONS or name == "delete" or many)
    ]
    # Every kind of database work of the three jobs was seen...
    assert {(collection, name) for collection, name, _ in jobs} >= {
        ("usage_records", "update"),  # claim_pending, mark_rolled_up
        ("usage_records", "aggregate"),  # claimed_days, totals
        ("usage_daily", "update"),  # the daily rows
        ("completed_tasks", "find"),  # a page of the catalogue
        ("completed_tasks", "update"),  # marked requested
        ("fanout_checkpoints", "findAndModify"),
        ("usage_records", "delete"),  # housekeeping
        ("firings", "delete"),
        ("firings", "update"),  # silent runs of `allow` jobs abandoned
    }, jobs
    # ...and each carried the job's deadline, not the client's.
    late = [entry for entry in jobs if not request_bound_ms < (entry[2] or 0)]
    assert late == [], late
    assert all((limit or 0) <= JOB_DB_TIMEOUT_S * 1000 for _, _, limit in jobs), jobs
    # Recording the runs (their start, their outcome) kept the client's bound.
    firings = [
        limit
        for db, collection, name, limit, many in commands.seen
        if db == database
        and collection == "firings"
        and name in {"update", "findAndModify"}
        and not many
    ]
    assert firings, commands.seen
    assert all(limit is not None and limit <= request_bound_ms for limit in firings), firings
    await _drained(topology)


async def _drained(amqp_url: str) -> None:
    """The fan-out's re-score requests, taken off their queue (nothing consumes it here)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(RESCORE_REQUESTS.name, ensure=True)
        await queue.purge()
