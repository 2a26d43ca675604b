"""The gateway's own records on the test database, without the gateway around them, and its
real publisher on the test's broker (the `task_broker` or `stalled_broker` fixture),
remembering what it sent."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from faststream.rabbit import RabbitBroker
from pymongo import AsyncMongoClient

from services.gateway.batches import Batches
from services.gateway.publisher import TaskPublisher
from services.gateway.submissions import Submissions
from shared.contracts import ScoreResult, ScoreText, new_id, utcnow

PUBLISH_TIMEOUT_S = 10.0  # the broker here answers in milliseconds
UNCONFIRMED_AFTER_S = 0.5  # a stalled broker's publishes are given up that soon


@dataclass
class GatewayRecords:
    name: str  # the database's
    raw: Any  # the database, reached directly
    submissions: Submissions
    batches: Batches
    broker: RabbitBroker  # the test's broker (`task_broker`), for a `Recorded` publisher


@asynccontextmanager
async def gateway_records(
    mongo_url: str, db_prefix: str, broker: RabbitBroker
) -> AsyncIterator[GatewayRecords]:
    """A database of its own, with the gateway's indexes, for one test."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_url, tz_aware=True)
    database = f"{db_prefix}_{new_id()[:8]}_gateway"
    submissions, batches = Submissions(client, database), Batches(client, database)
    try:
        await submissions.ensure_indexes()
        await batches.ensure_indexes()
        yield GatewayRecords(database, client[database], submissions, batches, broker)
    finally:
        await client.close()


class Recorded(TaskPublisher):
    """The gateway's publisher on `broker`, remembering the task ids of the commands it sent
    (confirmed or not: `send` returned) and of the cached results it announced."""

    def __init__(self, broker: RabbitBroker, *, timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
        super().__init__(broker, clock=utcnow, timeout_s=timeout_s)
        self.sent: list[str] = []
        self.announced: list[str] = []

    async def send(self, command: ScoreText) -> bool:
        confirmed = await super().send(command)
        self.sent.append(command.task_id)
        return confirmed

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        confirmed = await super().send_many(commands)
        self.sent.extend(command.task_id for command in commands)
        return confirmed

    async def withdraw(self, commands: Sequence[ScoreText]) -> None:
        raise AssertionError("nothing is withdrawn here")

    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> bool:
        confirmed = await super().announce_cached(command, result)
        self.announced.append(command.task_id)
        return confirmed


class Unconfirmed(Recorded):
    """The publisher on a `stalled_broker`: it takes the commands without confirming them."""

    def __init__(self, stalled_broker: RabbitBroker) -> None:
        super().__init__(stalled_broker, timeout_s=UNCONFIRMED_AFTER_S)
