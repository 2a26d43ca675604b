"""`shared.group_reads.GroupReader` against MongoDB (or the labelled stand-in): concurrent
point reads share round trips, and each caller gets its own document."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import InvalidOperation

from devtools.infra import Endpoint
from shared.group_reads import GroupReader
from tests.support import CommandCounter, scratch_collection

pytestmark = pytest.mark.integration

Document = dict[str, Any]


@pytest.fixture
async def commands() -> CommandCounter:
    return CommandCounter("find")


@pytest.fixture
async def collection(
    mongo: Endpoint, commands: CommandCounter
) -> AsyncIterator[AsyncCollection[Document]]:
    async with scratch_collection(mongo.url, commands, prefix="group_reads") as collection:
        yield collection


async def test_concurrent_reads_share_round_trips_and_each_gets_its_document(
    collection: AsyncCollection[Document], commands: CommandCounter
) -> None:
    await collection.insert_many([{"_id": f"t{i}", "n": i} for i in range(200)])
    reader = GroupReader(collection)
    commands.sent = 0

    found = await asyncio.gather(*(reader.find_by_id(f"t{i}") for i in range(200)))

    assert found == [{"_id": f"t{i}", "n": i} for i in range(200)]
    assert commands.sent < 200 / 4, f"{commands.sent} find commands for 200 concurrent reads"


async def test_missing_and_repeated_ids(collection: AsyncCollection[Document]) -> None:
    await collection.insert_one({"_id": "here"})
    reader = GroupReader(collection)

    found = await asyncio.gather(
        reader.find_by_id("here"), reader.find_by_id("gone"), reader.find_by_id("here")
    )

    assert list(found) == [{"_id": "here"}, None, {"_id": "here"}]


async def test_a_lone_read_is_sent_at_once_and_sees_earlier_writes(
    collection: AsyncCollection[Document], commands: CommandCounter
) -> None:
    reader = GroupReader(collection)
    assert await reader.find_by_id("later") is None

    await collection.insert_one({"_id": "later", "v": 1})

    assert await reader.find_by_id("later") == {"_id": "later", "v": 1}
    assert commands.sent == 2


async def test_a_failed_round_trip_fails_every_read_of_it(mongo: Endpoint) -> None:
    client: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, tz_aware=True)
    reader = GroupReader(client["closed"]["docs"])
    await client.close()  # every command now fails before it is sent

    outcomes = await asyncio.gather(
        *(reader.find_by_id(f"doc{i}") for i in range(5)), return_exceptions=True
    )

    assert all(isinstance(outcome, InvalidOperation) for outcome in outcomes), outcomes


async def test_a_projection_limits_the_fields_read(collection: AsyncCollection[Document]) -> None:
    await collection.insert_one({"_id": "big", "keep": 1, "text": "x" * 10_000})
    reader = GroupReader(collection, projection={"keep": 1})

    assert await reader.find_by_id("big") == {"_id": "big", "keep": 1}
