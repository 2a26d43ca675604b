"""The gateway's own records on the test database, without the gateway around them, and a
publisher that confirms whatever it is given."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from pymongo import AsyncMongoClient

from services.gateway.batches import Batches
from services.gateway.submissions import Submissions
from shared.contracts import ScoreResult, ScoreText, new_id


@dataclass
class GatewayRecords:
    name: str  # the database's
    raw: Any  # the database, reached directly
    submissions: Submissions
    batches: Batches


@asynccontextmanager
async def gateway_records(mongo_url: str, db_prefix: str) -> AsyncIterator[GatewayRecords]:
    """A database of its own, with the gateway's indexes, for one test."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_url, tz_aware=True)
    database = f"{db_prefix}_{new_id()[:8]}_gateway"
    submissions, batches = Submissions(client, database), Batches(client, database)
    try:
        await submissions.ensure_indexes()
        await batches.ensure_indexes()
        yield GatewayRecords(database, client[database], submissions, batches)
    finally:
        await client.close()


@dataclass
class Recorded:
    """A publisher that confirms every command and remembers the task ids it sent."""

    sent: list[str] = field(default_factory=list)
    announced: list[str] = field(default_factory=list)  # result-cache hits announced

    async def send(self, command: ScoreText) -> bool:
        self.sent.append(command.task_id)
        return True

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        self.sent.extend(command.task_id for command in commands)
        return True

    async def withdraw(self, commands: Sequence[ScoreText]) -> None:
        raise AssertionError("nothing is withdrawn here")

    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> bool:
        self.announced.append(command.task_id)
        return True


class Unconfirmed(Recorded):
    """A broker that takes the commands without confirming them (a memory alarm)."""

    async def send(self, command: ScoreText) -> bool:
        await super().send(command)
        return False

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        await super().send_many(commands)
        return False
