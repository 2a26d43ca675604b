"""A write whose deadline passes while its round trip is still waiting for a server (the
database down) is told it was never sent, as PyMongo tells the round trip's last member:
callers act on the difference (the gateway writes off, and releases the slots of, only the
refusals that may have been written). With its round trip bounded by its latest member's
deadline, every earlier member was failed as "maybe written" during an outage: the gateway
noted a refusal for nearly every request, and would have released slots never taken (found
in review). A round trip whose command has started still says "maybe written"."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo.errors import PyMongoError, ServerSelectionTimeoutError

from devtools.infra import Endpoint
from services.gateway.counters import BoundedCounters
from services.gateway.errors import DatabaseUnavailable
from services.gateway.refusals import may_have_been_written
from shared.coalescing import NotSentInTime, TimedOutInFlight, commands_watched
from shared.group_writes import GroupWriter
from shared.runtime import make_mongo
from shared.settings import ServiceSettings
from tests.faults.slow_link import SlowLink

WRITES = 30
ARRIVAL_GAP_S = 0.02  # requests arriving over the timeout, not all at once


def _settings(mongo_url: str, timeout_s: float) -> ServiceSettings:
    return ServiceSettings.model_validate({"MONGO_URL": mongo_url, "MONGO_TIMEOUT_S": timeout_s})


async def _errors(write: Callable[[int], Awaitable[object]]) -> list[PyMongoError]:
    async def arriving(index: int) -> PyMongoError | None:
        await asyncio.sleep(index * ARRIVAL_GAP_S)
        try:
            await write(index)
        except PyMongoError as error:
            return error
        return None

    outcomes = await asyncio.gather(*(arriving(index) for index in range(WRITES)))
    return [error for error in outcomes if error is not None]


def _maybe_written(error: PyMongoError) -> bool:
    refused = DatabaseUnavailable("database away")
    refused.__cause__ = error
    return may_have_been_written(refused)


async def test_writes_during_an_outage_are_told_they_were_never_sent() -> None:
    # The first write's round trip waits its whole 2 s for a server while all the others
    # queue, so the next round trip carries them all, each failed by its own deadline.
    client = make_mongo(_settings("mongodb://127.0.0.1:1/?directConnection=true", 2.0))
    assert commands_watched(client)
    collection: Any = client["scorebox_outage"]["submissions"]
    writes, counters = GroupWriter(collection), BoundedCounters(collection)
    try:
        inserts = await _errors(lambda index: writes.insert_one({"_id": index}))
        slots = await _errors(lambda index: counters.add("tenant", 1, ceiling=100))
    finally:
        await client.close()
    for errors in (inserts, slots):
        assert len(errors) == WRITES
        assert all(isinstance(error, ServerSelectionTimeoutError) for error in errors), errors
        assert not any(_maybe_written(error) for error in errors)
        # Failed by their own deadline while a later one's round trip waited for a server.
        assert any(isinstance(error, NotSentInTime) for error in errors), errors


async def test_a_write_whose_command_started_may_have_been_written(
    mongo: Endpoint, database_link: SlowLink
) -> None:
    """Slow replies, the server reachable: each round trip's command starts at once, so a
    member failed by its deadline may have been written, a slot's too (its command is sent by
    a `GroupWriter` of the counters' own, whose start counts for them)."""
    client = make_mongo(_settings(database_link.url_through(mongo.url), 0.5))
    collection: Any = client["scorebox_outage"]["slow"]
    writes, counters = GroupWriter(collection), BoundedCounters(collection)
    await writes.insert_one({"_id": "warm"})  # connected before the replies slow down
    database_link.reply_delay_s = 0.3
    try:
        inserts = await _errors(lambda index: writes.insert_one({"_id": index}))
        slots = await _errors(lambda index: counters.add(f"tenant-{index}", 1, ceiling=9))
    finally:
        database_link.reply_delay_s = 0.0
        await client.close()
    for errors in (inserts, slots):
        assert not any(isinstance(error, NotSentInTime) for error in errors), errors
        in_flight = [error for error in errors if isinstance(error, TimedOutInFlight)]
        assert in_flight, errors
        assert all(_maybe_written(error) for error in in_flight)
