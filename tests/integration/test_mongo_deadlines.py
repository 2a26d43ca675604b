"""Database operations carry the per-operation deadline to the server (`maxTimeMS`), except a
service's start-up work, which must not abort a long index build (`shared.runtime`)."""

from __future__ import annotations

from typing import Any

from pymongo import ASCENDING
from pymongo.monitoring import (
    CommandFailedEvent,
    CommandListener,
    CommandStartedEvent,
    CommandSucceededEvent,
)

from devtools.infra import Endpoint
from shared.runtime import make_mongo, prepare_database
from shared.settings import ServiceSettings


class Commands(CommandListener):
    """Each command sent: its name and the `maxTimeMS` it carried (None: none)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def started(self, event: CommandStartedEvent) -> None:
        self.sent.append((event.command_name, event.command.get("maxTimeMS")))

    def succeeded(self, event: CommandSucceededEvent) -> None:
        return None

    def failed(self, event: CommandFailedEvent) -> None:
        return None


async def test_only_start_up_work_goes_without_a_deadline(mongo: Endpoint, db_prefix: str) -> None:
    settings = ServiceSettings.model_validate({"MONGO_URL": mongo.url, "MONGO_TIMEOUT_S": "5"})
    commands = Commands()
    client = make_mongo(settings, event_listeners=[commands])
    collection = client[f"{db_prefix}_deadlines"]["things"]
    try:

        async def start_up() -> None:
            await collection.create_index([("kind", ASCENDING)])

        await prepare_database(start_up, deadline_s=30)
        await collection.insert_one({"kind": "after start-up"})
        sent = dict(commands.sent)
        assert sent["createIndexes"] is None
        assert 0 < sent["insert"] <= 5_000
    finally:
        await client.close()
