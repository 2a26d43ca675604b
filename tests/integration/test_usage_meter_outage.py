"""The usage meter waits a database outage out: a `task.completed` that arrives while MongoDB
is unreachable is stored once it is back, however many writes failed meanwhile, instead of
being counted towards `USAGE_METER_MAX_ATTEMPTS` and dead-lettered (an outage of about 45 s
sent every completion of it to a DLQ that nothing replays).

In process, on the real broker and database (MongoDB or the stand-in); the scheduler reaches
the database through `SlowLink`, which this test cuts and restores."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.scheduler.app import create_app as create_scheduler
from services.scheduler.config import parse_config
from services.scheduler.settings import SchedulerSettings
from shared.bus import publish_event
from shared.contracts import ScoreResult, TaskCompleted, Usage, new_id
from shared.runtime import make_broker
from tests.faults.slow_link import SlowLink
from tests.support import advancing_clock, eventually, running

NOW = datetime(2030, 1, 10, 10, 31, 30, tzinfo=UTC)  # far from the rollup's fire time (:05)
FAILED_WRITES = 3  # more than USAGE_METER_MAX_ATTEMPTS below


def _completed(task_id: str) -> TaskCompleted:
    return TaskCompleted(
        task_id=task_id,
        tenant_id="acme",
        sequence=190,
        attempt=1,
        submitted_at=NOW,
        occurred_at=NOW,
        result=ScoreResult(
            score=5,
            comment="ok",
            model="m",
            usage=Usage(prompt_tokens=10, completion_tokens=2),
        ),
    )


async def test_a_completion_during_a_database_outage_is_metered_once_it_is_back(
    amqp_url: str,
    mongo: Endpoint,
    db_prefix: str,
    database_link: SlowLink,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    settings = SchedulerSettings.model_validate(
        {
            "RABBITMQ_URL": amqp_url,
            "MONGO_URL": database_link.mongo_url,
            "MONGO_DB_PREFIX": db_prefix,
            "MONGO_TIMEOUT_S": "0.5",
            "USAGE_METER_MAX_ATTEMPTS": "2",
            "USAGE_METER_RETRY_S": "0.1",
        }
    )
    config = parse_config({"jobs": {"usage-rollup": {"cron": "5 * * * *"}}}, {})
    task_id = new_id()

    def about_it() -> list[logging.LogRecord]:
        return [record for record in caplog.records if task_id in record.getMessage()]

    records: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url)
    scheduler = create_scheduler(settings, config=config, clock=advancing_clock(NOW))
    async with running(scheduler):
        await database_link.cut()
        publisher = make_broker(settings)
        async with publisher:
            await publisher.connect()
            await publish_event(publisher, _completed(task_id), timeout=10)

        async def failed_often() -> bool:
            return len(about_it()) >= FAILED_WRITES

        await eventually(failed_often, what=f"{FAILED_WRITES} failed writes of the usage")
        database_link.down = False

        async def stored() -> bool:
            usage = records[f"{db_prefix}_scheduler"]["usage_records"]
            return await usage.count_documents({"task_id": task_id}) == 1

        await eventually(stored, what="the usage record stored after the outage")
    await records.close()
    assert not [record for record in about_it() if record.levelno >= logging.ERROR]
