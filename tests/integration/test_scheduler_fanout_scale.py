"""Measure the re-score fan-out: time per 1,000-item page and the peak depth of
`scorebox.rescore-requests`, while a consumer drains it as fast as it can.

Size: `SCHEDULER_FANOUT_ITEMS`; by default small enough for the regular suite (10,000 on a
real MongoDB, 1,000 on the stand-in, whose writes slow down as a collection grows). The
measurement itself, with `-s` to see the figures (from the repository root):

    SCHEDULER_FANOUT_ITEMS=100000 .venv/bin/pytest -s <this file>

(on the stand-in, use the few thousand it seeds in about a minute). Figures are printed, never
asserted (no timing assertions); what is asserted is that every stale task was requested once.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from pymongo import AsyncMongoClient

from services.scheduler.catalogue import Catalogue, ScannedPage
from services.scheduler.checkpoints import Checkpoints
from services.scheduler.jobs import JobRun
from services.scheduler.jobs.fanout import fan_out_rescores
from services.scheduler.messaging import SchedulerBus
from services.scheduler.settings import SchedulerSettings
from shared.contracts import RescoreTask, utcnow
from shared.runtime import make_broker
from shared.topology import RESCORE_REQUESTS, declare_topology
from tests.support import eventually

PAGE_SIZE = 1000
SEED_CHUNK = 250  # short writes: the stand-in slows down as the collection grows


def _items(mongo: Any) -> int:
    if configured := os.environ.get("SCHEDULER_FANOUT_ITEMS"):
        return int(configured)
    return 1_000 if mongo.is_standin else 10_000


class TimedCatalogue(Catalogue):
    """The real catalogue, noting when each page is asked for (page time = gap between asks)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.asked: list[float] = []

    async def scan_page(
        self, *, after: str | None, current_version: str, completed_since: datetime, limit: int
    ) -> ScannedPage:
        self.asked.append(time.perf_counter())
        return await super().scan_page(
            after=after,
            current_version=current_version,
            completed_since=completed_since,
            limit=limit,
        )


class Drain:
    """Consumes the queue (ack at once) and samples its depth; records the peak."""

    def __init__(self, amqp_url: str) -> None:
        self.amqp_url = amqp_url
        self.task_ids: set[str] = set()
        self.received = 0
        self.peak = 0

    async def run(self, stop: asyncio.Event) -> None:
        connection = await aio_pika.connect(self.amqp_url, timeout=10)
        async with connection:
            consuming = await connection.channel()
            await consuming.set_qos(prefetch_count=1000)
            queue = await consuming.get_queue(RESCORE_REQUESTS.name, ensure=True)
            probing = await connection.channel()
            probe = await probing.get_queue(RESCORE_REQUESTS.name, ensure=True)

            async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                self.received += 1
                self.task_ids.add(RescoreTask.model_validate_json(message.body).task_id)

            tag = await queue.consume(on_message, no_ack=True)
            while not stop.is_set():
                declared = await probe.declare(timeout=5)
                self.peak = max(self.peak, int(declared.message_count or 0))
                await asyncio.sleep(0.02)  # sampling period of the depth probe
            await queue.cancel(tag)


async def _seed(catalogue_collection: Any, count: int) -> float:
    started = time.perf_counter()
    completed_at = datetime(2030, 1, 1, tzinfo=UTC)
    for start in range(0, count, SEED_CHUNK):
        await catalogue_collection.insert_many(
            [
                {
                    "_id": f"task-{i:08d}",
                    "tenant_id": "acme",
                    "generation": 0,
                    "completed_at": completed_at,
                    "model": "m",
                    "rubric_version": None,
                }
                for i in range(start, min(count, start + SEED_CHUNK))
            ],
            ordered=False,
        )
    return time.perf_counter() - started


def _report(lines: Sequence[str], capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print()
        for line in lines:
            print(f"[fan-out measurement] {line}")


async def test_fanout_scale(
    amqp_url: str, mongo: Any, db_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    items = _items(mongo)
    settings = SchedulerSettings.model_validate(
        {"RABBITMQ_URL": amqp_url, "MONGO_URL": mongo.url, "MONGO_DB_PREFIX": db_prefix}
    )
    database = settings.database_name("scheduler")
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    broker = make_broker(settings)
    try:
        seed_s = await _seed(client[database]["completed_tasks"], items)
        async with broker:
            await broker.connect()
            await declare_topology(broker)
            catalogue = TimedCatalogue(client, database)
            bus = SchedulerBus(broker, timeout_s=60, clock=utcnow)
            publish_times: list[float] = []

            async def publish_page(page: Sequence[RescoreTask]) -> None:
                started = time.perf_counter()
                await bus.publish_rescore_page(page)
                publish_times.append(time.perf_counter() - started)

            drain, stop = Drain(amqp_url), asyncio.Event()
            draining = asyncio.create_task(drain.run(stop))
            run = JobRun(uuid.uuid4().hex, "rescore-fanout", utcnow(), utcnow(), True, 1)
            started = time.perf_counter()
            outcome = await fan_out_rescores(
                run,
                catalogue=catalogue,
                checkpoints=Checkpoints(client, database),
                publish_page=publish_page,
                rubric_version="v2",
                page_size=PAGE_SIZE,
                max_pages=items // PAGE_SIZE + 2,
                horizon=timedelta(days=1),
                clock=utcnow,
            )
            total_s = time.perf_counter() - started

            async def drained() -> bool:
                return drain.received >= items

            await eventually(drained, timeout_s=120, what="every request consumed")
            stop.set()
            await draining
    finally:
        await client.close()

    assert outcome.summary["published"] == items
    assert outcome.more is False
    assert drain.task_ids == {f"task-{i:08d}" for i in range(items)}
    page_times = [b - a for a, b in zip(catalogue.asked, catalogue.asked[1:], strict=False)]
    _report(
        [
            f"database: {'mongoeco stand-in' if mongo.is_standin else 'MongoDB'}; "
            f"items: {items}; page size: {PAGE_SIZE}; pages: {len(page_times)}",
            f"seeding the catalogue: {seed_s:.1f} s ({items / seed_s:.0f} inserts/s)",
            f"fan-out total: {total_s:.2f} s ({items / total_s:.0f} messages/s)",
            f"per page: mean {statistics.mean(page_times) * 1000:.0f} ms, "
            f"median {statistics.median(page_times) * 1000:.0f} ms, "
            f"max {max(page_times) * 1000:.0f} ms "
            f"(of which publishing 1,000 with confirms: mean "
            f"{statistics.mean(publish_times) * 1000:.0f} ms)",
            f"peak depth of {RESCORE_REQUESTS.name}: {drain.peak} "
            f"(a consumer acking at once was draining it)",
            f"extrapolated to 100,000 items at this page time: "
            f"{statistics.mean(page_times) * 100:.0f} s",
        ],
        capsys,
    )
