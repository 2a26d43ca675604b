"""Group commit during an outage: a write told it was never sent (PyMongo's
`ServerSelectionTimeoutError`) is never written, and one whose round trip's command may have
started is told it may have been. Callers act on the difference: the gateway writes off, and
releases the slots of, only the refusals that may have been written.

While the client knows no server, a round trip is bounded by its earliest member's deadline,
so every member is told what PyMongo tells it. Bounded by its latest, every earlier member was
failed as "maybe written" during an outage (the gateway noted a refusal for nearly every
request, and would have released slots never taken); then, told "never sent" by a command
listener while the round trip went on, they were written when the database came back before
the latest deadline (both found in review)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo.errors import PyMongoError, ServerSelectionTimeoutError

from devtools.infra import Endpoint
from services.gateway.counters import BoundedCounters
from services.gateway.errors import DatabaseUnavailable
from services.gateway.refusals import may_have_been_written
from shared.coalescing import TimedOutInFlight
from shared.group_writes import GroupWriter
from shared.runtime import make_mongo
from shared.settings import ServiceSettings
from tests.faults.slow_link import SlowLink

WRITES = 30
ARRIVAL_GAP_S = 0.02  # requests arriving over the timeout, not all at once
RETURN_WRITES, RETURN_ARRIVAL_GAP_S, FAILURES_BEFORE_RETURN = 60, 0.05, 3


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
    # queue, so the next round trip carries them all.
    client = make_mongo(_settings("mongodb://127.0.0.1:1/?directConnection=true", 2.0))
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


async def test_a_write_told_it_was_never_sent_is_never_written_when_the_database_returns(
    mongo: Endpoint, database_link: SlowLink
) -> None:
    """The database comes back while a round trip still waits for it. Its members whose
    deadlines had passed were told "never sent" while the round trip, bounded by its latest
    member, went on and sent them once a server answered: the gateway answered 503 "nothing
    was kept" for submissions that then landed (and were scored), and counted in-flight
    slots that nobody would release (found in review)."""
    database_link.down = True
    client = make_mongo(_settings(database_link.url_through(mongo.url), 2.0))
    collection: Any = client["scorebox_outage"]["returns"]
    writes, counters = GroupWriter(collection), BoundedCounters(collection)
    try:
        inserts = await _outcomes_as_the_database_returns(
            database_link, lambda index: writes.insert_one({"_id": f"insert-{index}"})
        )
        database_link.down = True
        slots = await _outcomes_as_the_database_returns(
            database_link, lambda index: counters.add("tenant", 1, ceiling=10_000)
        )
        stored = {document["_id"] async for document in collection.find({}, {"_id": 1})}
        counter = await collection.find_one({"_id": "tenant"})
    finally:
        await client.close()
    never_sent = {index for index, outcome in inserts.items() if _told_never_sent(outcome)}
    assert never_sent, inserts  # the outage was seen
    assert not {f"insert-{index}" for index in never_sent} & stored
    added = sum(outcome is True for outcome in slots.values())
    maybe = sum(outcome is not True and not _told_never_sent(outcome) for outcome in slots.values())
    assert added, slots  # the database was seen back
    assert added <= (counter or {}).get("count", 0) <= added + maybe, slots


async def _outcomes_as_the_database_returns(
    link: SlowLink, write: Callable[[int], Awaitable[object]]
) -> dict[int, object]:
    """Each write's outcome (its result or its error), the writes arriving over more than the
    timeout, the link up again once three have failed."""
    failures = 0

    async def arriving(index: int) -> object:
        nonlocal failures
        await asyncio.sleep(index * RETURN_ARRIVAL_GAP_S)
        try:
            return await write(index)
        except PyMongoError as error:
            failures += 1
            if failures == FAILURES_BEFORE_RETURN:
                link.down = False
            return error

    outcomes = await asyncio.gather(*(arriving(index) for index in range(RETURN_WRITES)))
    return dict(enumerate(outcomes))


def _told_never_sent(outcome: object) -> bool:
    return isinstance(outcome, PyMongoError) and not _maybe_written(outcome)


async def test_a_write_whose_command_started_may_have_been_written(
    mongo: Endpoint, database_link: SlowLink
) -> None:
    """Slow replies, the server reachable: each round trip's command starts at once, so a
    member failed by its deadline may have been written, a slot's too (its command is sent by
    a `GroupWriter` of the counters' own)."""
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
        in_flight = [error for error in errors if isinstance(error, TimedOutInFlight)]
        assert in_flight, errors
        assert all(_maybe_written(error) for error in in_flight)
