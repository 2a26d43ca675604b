"""`shared.group_writes.GroupWriter` against MongoDB (or the labelled stand-in): concurrent
writes share round trips, and each caller still gets its own write's outcome."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from bson.errors import InvalidDocument
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError, InvalidOperation, WriteError

from devtools.infra import Endpoint
from shared.group_writes import GroupWriter, WriteOutcomeUnknown
from tests.support import CommandCounter, scratch_collection

pytestmark = pytest.mark.integration

Document = dict[str, Any]


@pytest.fixture
async def commands() -> CommandCounter:
    return CommandCounter("update", "insert", "delete")


@pytest.fixture
async def collection(
    mongo: Endpoint, commands: CommandCounter
) -> AsyncIterator[AsyncCollection[Document]]:
    async with scratch_collection(mongo.url, commands, prefix="group_writes") as collection:
        yield collection


async def test_concurrent_writes_share_round_trips_and_all_land(
    collection: AsyncCollection[Document], commands: CommandCounter
) -> None:
    writer = GroupWriter(collection)
    await asyncio.gather(
        *(writer.update_one({"_id": f"t{i}"}, {"$set": {"n": i}}, upsert=True) for i in range(200))
    )

    stored = {doc["_id"]: doc["n"] async for doc in collection.find()}
    assert stored == {f"t{i}": i for i in range(200)}
    assert commands.sent < 200 / 4, f"{commands.sent} write commands for 200 concurrent writes"


async def test_each_write_says_whether_it_inserted_its_document(
    collection: AsyncCollection[Document],
) -> None:
    """A claim that made the task's record need not read what came before it (the scorer's
    `Claimed.made_the_record`); one that matched a record must."""
    await collection.insert_one({"_id": "there", "n": 0})
    writer = GroupWriter(collection)

    inserted = await asyncio.gather(
        writer.update_one({"_id": "there"}, {"$set": {"n": 1}}, upsert=True),
        writer.update_one({"_id": "new"}, {"$set": {"n": 1}}, upsert=True),
        writer.update_one({"_id": "absent"}, {"$set": {"n": 1}}),
    )

    assert list(inserted) == [False, True, False]


async def test_a_lone_write_is_sent_at_once(
    collection: AsyncCollection[Document], commands: CommandCounter
) -> None:
    writer = GroupWriter(collection)

    await writer.insert_one({"_id": "alone"})

    assert commands.sent == 1
    assert await collection.find_one({"_id": "alone"}) == {"_id": "alone"}


async def test_a_guarded_upsert_creates_applies_newer_and_refuses_stale(
    collection: AsyncCollection[Document],
) -> None:
    writer = GroupWriter(collection)

    async def stamp(n: int) -> bool:
        return await writer.guarded_upsert({"_id": "guarded", "n": {"$lt": n}}, {"$set": {"n": n}})

    assert await stamp(1)
    assert await stamp(3)
    assert not await stamp(2)
    assert await collection.find_one({"_id": "guarded"}) == {"_id": "guarded", "n": 3}


async def test_each_caller_gets_its_own_writes_error(
    collection: AsyncCollection[Document],
) -> None:
    await collection.insert_one({"_id": "taken", "sequence": 5})
    writer = GroupWriter(collection)

    outcomes = await asyncio.gather(
        writer.update_one(
            {"_id": "taken", "sequence": {"$lt": 3}}, {"$set": {"sequence": 3}}, upsert=True
        ),
        writer.update_one(
            {"_id": "taken", "sequence": {"$lt": 7}}, {"$set": {"sequence": 7}}, upsert=True
        ),
        writer.insert_one({"_id": "fresh"}),
        writer.update_one({"_id": "fresh-2"}, {"$inc": {"sequence": "not a number"}}, upsert=True),
        writer.update_one({"_id": "fresh-3"}, {"$set": {"sequence": 1}}, upsert=True),
        return_exceptions=True,
    )

    stale, newer, fresh, invalid, upserted = outcomes
    assert isinstance(stale, DuplicateKeyError)
    assert newer is False  # it matched the document: nothing inserted
    assert fresh is None  # an insert answers nothing
    assert upserted is True  # in a round trip that failed for others, its insert is told
    assert isinstance(invalid, WriteError)
    assert not isinstance(invalid, DuplicateKeyError)
    assert await collection.find_one({"_id": "taken"}) == {"_id": "taken", "sequence": 7}
    assert await collection.find_one({"_id": "fresh-2"}) is None


async def test_a_write_the_client_cannot_encode_fails_alone(
    collection: AsyncCollection[Document],
) -> None:
    """One write pymongo cannot encode (here an integer beyond 64 bits) used to fail every
    write that shared its batch; it fails alone, and the others land."""
    writer = GroupWriter(collection)
    first = asyncio.create_task(writer.insert_one({"_id": "first"}))
    await asyncio.sleep(0)  # `first` is in flight: the next writes queue up as one batch
    queued = [
        writer.insert_one({"_id": "too-big", "n": 2**63}),
        writer.update_one({"_id": "set"}, {"$set": {"kind": {1, 2}}}, upsert=True),
        *(writer.insert_one({"_id": f"fine{i}"}) for i in range(5)),
        writer.update_one({"_id": "fine-update"}, {"$set": {"n": 2**63 - 1}}, upsert=True),
    ]
    outcomes = await asyncio.gather(first, *queued, return_exceptions=True)

    too_big, unencodable_type, *fine = outcomes[1:]
    assert isinstance(too_big, InvalidDocument), too_big
    assert isinstance(unencodable_type, InvalidDocument), unencodable_type
    assert fine == [None] * 5 + [True], fine  # the inserts answer nothing; the upsert inserted
    ids = {doc["_id"] async for doc in collection.find()}
    assert ids == {"first", "fine-update", *(f"fine{i}" for i in range(5))}


async def test_a_write_sent_before_the_one_that_cannot_be_encoded_is_not_sent_again(
    collection: AsyncCollection[Document],
) -> None:
    """The inserts go out before the updates: an update that cannot be encoded fails the
    round trip after the inserts were applied. They used to be sent again, and collided
    with themselves: their callers heard `DuplicateKeyError` for their own new documents."""
    writer = GroupWriter(collection)
    first = asyncio.create_task(writer.insert_one({"_id": "in-flight"}))
    await asyncio.sleep(0)  # `first` is in flight: the next writes queue up as one batch
    inserted, bad, deleted = await asyncio.gather(
        writer.insert_one({"_id": "sent-first"}),
        writer.update_one({"_id": "bad"}, {"$set": {"n": 2**64}}, upsert=True),
        writer.delete_one({"_id": "in-flight"}),
        return_exceptions=True,
    )
    await first

    assert isinstance(inserted, WriteOutcomeUnknown), inserted
    assert isinstance(bad, InvalidDocument), bad
    assert deleted is None  # not sent before the failure: sent again, and applied
    assert await collection.find_one({"_id": "sent-first"}) == {"_id": "sent-first"}
    assert await collection.find_one({"_id": "in-flight"}) is None


async def test_a_failed_round_trip_fails_every_write_of_it(mongo: Endpoint) -> None:
    client: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, tz_aware=True)
    writer = GroupWriter(client["closed"]["docs"])
    await client.close()  # every command now fails before it is sent

    outcomes = await asyncio.gather(
        *(writer.insert_one({"_id": f"doc{i}"}) for i in range(5)), return_exceptions=True
    )

    assert all(isinstance(outcome, InvalidOperation) for outcome in outcomes), outcomes


async def test_a_cancelled_caller_does_not_stop_the_others(
    collection: AsyncCollection[Document],
) -> None:
    writer = GroupWriter(collection)
    first = asyncio.create_task(writer.insert_one({"_id": "first"}))
    cancelled = asyncio.create_task(writer.insert_one({"_id": "cancelled"}))
    others = [asyncio.create_task(writer.insert_one({"_id": f"other{i}"})) for i in range(3)]
    # Runs after each task's first step: `cancelled` is queued and waiting when it is cancelled.
    asyncio.get_running_loop().call_soon(cancelled.cancel)

    await asyncio.gather(first, *others)

    assert cancelled.cancelled()
    ids = {doc["_id"] async for doc in collection.find()}
    assert {"first", "other0", "other1", "other2"} <= ids
