"""Indexes no query uses are dropped from deployments that created them (`shared.indexes`),
against MongoDB or the labelled stand-in."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from pymongo import ASCENDING, AsyncMongoClient
from pymongo.asynchronous.database import AsyncDatabase

from devtools.infra import Endpoint
from services.gateway.batches import (
    HOLD_CHECK_AT,
    NEWEST_BATCHES,
    NEWEST_FIRST,
    Batches,
    ListPosition,
    newest_batches_query,
)
from services.gateway.submissions import SENT_AT, Submissions, unsent_in_batch_query
from services.scorer.attempts import Attempts
from services.status.projection import ensure_indexes as ensure_projection_indexes
from shared.contracts import utcnow
from shared.indexes import drop_retired_indexes, string_key

pytestmark = pytest.mark.integration

Document = dict[str, Any]


@pytest.fixture
async def client(mongo: Endpoint) -> AsyncIterator[AsyncMongoClient[Document]]:
    client: AsyncMongoClient[Document] = AsyncMongoClient(
        mongo.url, tz_aware=True, serverSelectionTimeoutMS=10_000
    )
    yield client
    await client.close()


@pytest.fixture
async def database(client: AsyncMongoClient[Document]) -> AsyncIterator[AsyncDatabase[Document]]:
    name = f"indexes_{uuid.uuid4().hex[:8]}"
    yield client[name]
    await client.drop_database(name)


async def _names(database: AsyncDatabase[Document], collection: str) -> set[str]:
    return {index["name"] async for index in await database[collection].list_indexes()}


async def test_a_retired_index_is_dropped_and_a_missing_one_is_fine(
    database: AsyncDatabase[Document],
) -> None:
    collection = database["things"]
    await collection.create_index([("a", ASCENDING)])
    await collection.create_index([("b", ASCENDING)])

    await drop_retired_indexes(collection, "a_1", "never_was_1")
    await drop_retired_indexes(database["no_such_collection"], "a_1")

    assert await _names(database, "things") == {"_id_", "b_1"}


async def test_the_projection_drops_its_unused_creation_time_index(
    database: AsyncDatabase[Document],
) -> None:
    tasks = database["tasks"]
    await tasks.create_index([("tenant_id", ASCENDING), ("created_at", ASCENDING)])

    await ensure_projection_indexes(tasks, now=utcnow())
    await ensure_projection_indexes(tasks, now=utcnow())  # start-up runs it every time

    assert await _names(database, "tasks") == {"_id_", "expires_at_1", "batch_items"}


async def test_the_scorer_drops_its_unused_lease_index(
    client: AsyncMongoClient[Document], database: AsyncDatabase[Document]
) -> None:
    await database["attempts"].create_index([("lease_until", ASCENDING)])
    attempts = Attempts(client, database.name, retention=timedelta(days=1))

    await attempts.ensure_indexes()
    await attempts.ensure_indexes()

    assert await _names(database, "attempts") == {"_id_", "updated_at_1"}


async def test_a_changed_attempts_retention_changes_the_index_instead_of_stopping_the_start(
    client: AsyncMongoClient[Document], database: AsyncDatabase[Document]
) -> None:
    """The retention is the TTL index's option, and the same index with another option is
    refused: a scorer started with a new `ATTEMPTS_RETENTION_S` never became ready."""
    await Attempts(client, database.name, retention=timedelta(days=7)).ensure_indexes()

    await Attempts(client, database.name, retention=timedelta(days=1)).ensure_indexes()

    indexes = {index["name"]: index async for index in await database["attempts"].list_indexes()}
    assert indexes["updated_at_1"]["expireAfterSeconds"] == 86_400


async def test_batch_and_key_lookups_use_their_partial_indexes(
    mongo: Endpoint, database: AsyncDatabase[Document]
) -> None:
    """An equality to a string does not imply the `$type: "string"` filter of a partial
    index to MongoDB's planner; the lookups repeat it (`shared.indexes.string_key`), or a
    batch's progress and every Idempotency-Key lookup scanned their collection. Only
    MongoDB plans queries: the stand-in answers explain with nothing to check."""
    if mongo.is_standin:
        pytest.skip("the stand-in (mongoeco) does not plan queries; needs MONGO_URL=MongoDB")
    tasks = database["tasks"]
    await ensure_projection_indexes(tasks, now=utcnow())
    await tasks.insert_one({"_id": "t1", "tenant_id": "a", "batch_id": "b1", "batch_index": 0})
    query = {"tenant_id": "a", "batch_id": string_key("b1")}
    plan = await tasks.find(query).sort("batch_index", ASCENDING).explain()
    assert "IXSCAN" in str(plan["queryPlanner"]["winningPlan"]), plan["queryPlanner"]


async def test_the_batch_hold_reads_use_their_indexes(
    mongo: Endpoint, client: AsyncMongoClient[Document], database: AsyncDatabase[Document]
) -> None:
    """The outbox sweep's look at batches near their expiry, and at whether they have unsent
    items (`services/gateway/batch_expiry.py`), run every pass: neither may scan."""
    if mongo.is_standin:
        pytest.skip("the stand-in (mongoeco) does not plan queries; needs MONGO_URL=MongoDB")
    await Submissions(client, database.name).ensure_indexes()
    await Batches(client, database.name).ensure_indexes()
    await database["submissions"].insert_one({"_id": "t1", "batch_id": "b1", "state": "accepting"})
    await database["batches"].insert_one({"_id": "b1", HOLD_CHECK_AT: utcnow()})
    unsent = database["submissions"].find(
        {"batch_id": {"$in": ["b1"], "$type": "string"}, "state": {"$in": ["accepting"]}}
    )
    due = database["batches"].find({HOLD_CHECK_AT: {"$lte": utcnow()}}).sort(HOLD_CHECK_AT)
    for cursor in (unsent, due):
        plan = await cursor.explain()
        assert "IXSCAN" in str(plan["queryPlanner"]["winningPlan"]), plan["queryPlanner"]


async def test_an_old_batchs_unsent_and_just_swept_items_are_read_through_indexes(
    mongo: Endpoint, client: AsyncMongoClient[Document], database: AsyncDatabase[Document]
) -> None:
    """Each branch of the read (`unsent_in_batch`) on an index of its own: the one of the
    swept holds only what the outbox sweep sent, and a batch holds up to 1,000 items."""
    if mongo.is_standin:
        pytest.skip("the stand-in (mongoeco) does not plan queries; needs MONGO_URL=MongoDB")
    await Submissions(client, database.name).ensure_indexes()
    now = utcnow()
    await database["submissions"].insert_many(
        [
            {"_id": "t1", "batch_id": "b1", "state": "accepting"},
            {"_id": "t2", "batch_id": "b1", "state": "accepted", SENT_AT: now},
            {"_id": "t3", "batch_id": "b1", "state": "accepted"},
        ]
    )
    query = unsent_in_batch_query("b1", sent_since=now - timedelta(minutes=5))
    plan = await database["submissions"].find(query).explain()
    winning = str(plan["queryPlanner"]["winningPlan"])
    assert "COLLSCAN" not in winning, plan["queryPlanner"]
    assert "batch_swept" in winning, plan["queryPlanner"]


async def test_the_gateway_creates_the_index_of_a_tenants_batches_newest_first(
    client: AsyncMongoClient[Document], database: AsyncDatabase[Document]
) -> None:
    """`GET /v1/batches` reads from it (`Batches.newest`)."""
    await Batches(client, database.name).ensure_indexes()
    await Batches(client, database.name).ensure_indexes()  # start-up runs it every time

    indexes = {index["name"]: index async for index in await database["batches"].list_indexes()}
    assert dict(indexes[NEWEST_BATCHES]["key"]) == {"tenant_id": 1, "created_at": -1, "_id": -1}


@pytest.mark.parametrize("first_page", [True, False])
async def test_the_batch_listing_reads_its_index_in_order(
    mongo: Endpoint,
    client: AsyncMongoClient[Document],
    database: AsyncDatabase[Document],
    first_page: bool,
) -> None:
    """A tenant's batches, newest first, past a page's last (`$or` on the time and the id):
    read from `batches_by_tenant_newest` in its order, neither scanned nor sorted in memory."""
    if mongo.is_standin:
        pytest.skip("the stand-in (mongoeco) does not plan queries; needs MONGO_URL=MongoDB")
    await Batches(client, database.name).ensure_indexes()
    now = utcnow()
    await database["batches"].insert_many(
        [
            {"_id": f"b{i}", "tenant_id": "a", "idempotency_key": f"k{i}", "state": "accepted"}
            | {"created_at": now, "expires_at": now + timedelta(days=1), "members": []}
            for i in range(3)
        ]
    )
    after = None if first_page else ListPosition(now, "b2")
    query = newest_batches_query("a", now=now, after=after)
    plan = await database["batches"].find(query).sort(list(NEWEST_FIRST.items())).explain()
    winning = str(plan["queryPlanner"]["winningPlan"])
    assert NEWEST_BATCHES in winning, plan["queryPlanner"]
    assert "COLLSCAN" not in winning, plan["queryPlanner"]
    assert "'stage': 'SORT'" not in winning, plan["queryPlanner"]
