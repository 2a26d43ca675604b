"""`services.gateway.counters` against MongoDB (or the labelled stand-in): concurrent changes
to one counter become one update, and the counter still never passes its ceiling, never
goes below zero, and counts each release once."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import InvalidOperation

from devtools.infra import Endpoint
from services.gateway.counters import BoundedCounters, GuardedReleases
from services.gateway.errors import DatabaseUnavailable
from services.gateway.refusals import RELEASE_CHUNK, Refusal, release_slots
from tests.support import CommandCounter, scratch_collection

pytestmark = pytest.mark.integration

Document = dict[str, Any]
REMEMBERED = 16


@pytest.fixture
async def commands() -> CommandCounter:
    return CommandCounter("update")


@pytest.fixture
async def collection(
    mongo: Endpoint, commands: CommandCounter
) -> AsyncIterator[AsyncCollection[Document]]:
    async with scratch_collection(mongo.url, commands, prefix="counters") as collection:
        yield collection


async def _count(collection: AsyncCollection[Document], counter_id: str) -> int:
    document = await collection.find_one({"_id": counter_id})
    return int(document["count"]) if document else 0


async def test_concurrent_increments_of_one_counter_are_one_update(
    collection: AsyncCollection[Document], commands: CommandCounter
) -> None:
    counters = BoundedCounters(collection)

    added = await asyncio.gather(*(counters.add("key", 1, ceiling=1_000) for _ in range(100)))

    assert added == [True] * 100
    assert await _count(collection, "key") == 100
    # The first goes alone (nothing was in flight); the other 99 queued behind it.
    assert commands.statements <= 4, f"{commands.statements} updates for 100 increments"


async def test_the_ceiling_holds_and_a_merge_refuses_nothing_that_fits_alone(
    collection: AsyncCollection[Document],
) -> None:
    counters = BoundedCounters(collection)
    amounts = [random.Random(seed).randint(1, 9) for seed in range(120)]

    added = await asyncio.gather(*(counters.add("tenant", n, ceiling=200) for n in amounts))

    count = await _count(collection, "tenant")
    assert count == sum(n for n, ok in zip(amounts, added, strict=True) if ok)
    assert count <= 200
    refused = [n for n, ok in zip(amounts, added, strict=True) if not ok]
    assert refused, "the amounts sum past the ceiling, so some must be refused"
    # The count only grows: whatever was refused did not fit even at the end.
    assert all(n > 200 - count for n in refused), (count, refused)


async def test_counters_of_one_round_trip_stay_apart_and_fields_are_set_on_insert(
    collection: AsyncCollection[Document],
) -> None:
    counters = BoundedCounters(collection)
    await collection.insert_one({"_id": "old", "count": 1, "expires_at": "kept"})

    await asyncio.gather(
        *(counters.add("new", 1, ceiling=50, on_insert={"expires_at": "set"}) for _ in range(7)),
        *(counters.add("old", 2, ceiling=50, on_insert={"expires_at": "set"}) for _ in range(5)),
    )

    assert await collection.find_one({"_id": "new"}) == {
        "_id": "new",
        "count": 7,
        "expires_at": "set",
    }
    assert await collection.find_one({"_id": "old"}) == {
        "_id": "old",
        "count": 11,
        "expires_at": "kept",
    }


async def test_an_amount_over_the_ceiling_is_refused_without_a_write(
    collection: AsyncCollection[Document], commands: CommandCounter
) -> None:
    assert not await BoundedCounters(collection).add("key", 3, ceiling=2)
    assert commands.sent == 0


async def test_concurrent_releases_are_one_update_each_counted_once(
    collection: AsyncCollection[Document], commands: CommandCounter
) -> None:
    await collection.insert_one({"_id": "tenant", "count": 40, "recent_releases": []})
    releases = GuardedReleases(collection, remembered=REMEMBERED)

    await asyncio.gather(*(releases.release("tenant", f"task{i}") for i in range(12)))

    document = await collection.find_one({"_id": "tenant"}) or {}
    assert document["count"] == 28
    assert sorted(document["recent_releases"]) == sorted(f"task{i}" for i in range(12))
    assert commands.statements <= 3, f"{commands.statements} updates for 12 releases"


async def test_a_release_seen_before_or_twice_at_once_counts_once(
    collection: AsyncCollection[Document],
) -> None:
    await collection.insert_one({"_id": "tenant", "count": 10, "recent_releases": ["seen"]})
    releases = GuardedReleases(collection, remembered=REMEMBERED)
    first = asyncio.create_task(releases.release("tenant", "first"))
    await asyncio.sleep(0)  # `first` is in flight: the others queue up as one round trip

    await asyncio.gather(
        first,
        releases.release("tenant", "seen"),
        releases.release("tenant", "a"),
        releases.release("tenant", "b"),
    )
    assert await _count(collection, "tenant") == 7

    await asyncio.gather(*(releases.release("tenant", task) for task in ("c", "c", "a", "d")))
    assert await _count(collection, "tenant") == 5


async def test_releases_never_take_the_count_below_zero(
    collection: AsyncCollection[Document],
) -> None:
    """An under-count (a crash between a marked submission and its counter) meets more
    releases than the count holds: the count stops at zero."""
    await collection.insert_one({"_id": "tenant", "count": 2, "recent_releases": []})
    releases = GuardedReleases(collection, remembered=REMEMBERED)

    await asyncio.gather(*(releases.release("tenant", f"task{i}") for i in range(6)))

    assert await _count(collection, "tenant") == 0


async def test_recent_releases_stay_bounded(collection: AsyncCollection[Document]) -> None:
    await collection.insert_one({"_id": "tenant", "count": 100, "recent_releases": []})
    releases = GuardedReleases(collection, remembered=REMEMBERED)

    await asyncio.gather(*(releases.release("tenant", f"task{i}") for i in range(50)))

    document = await collection.find_one({"_id": "tenant"}) or {}
    assert document["count"] == 50
    assert len(document["recent_releases"]) == REMEMBERED


async def test_a_failed_round_trip_fails_every_caller(mongo: Endpoint) -> None:
    client: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, tz_aware=True)
    collection = client["closed"]["counters"]
    counters = BoundedCounters(collection)
    releases = GuardedReleases(collection, remembered=REMEMBERED)
    await client.close()  # every command now fails before it is sent

    outcomes = await asyncio.gather(
        *(counters.add("key", 1, ceiling=10) for _ in range(4)),
        *(releases.release("tenant", f"task{i}") for i in range(4)),
        return_exceptions=True,
    )

    assert all(isinstance(outcome, InvalidOperation) for outcome in outcomes), outcomes


async def test_a_change_is_bounded_by_the_clients_timeout_queueing_included(
    mongo: Endpoint,
) -> None:
    """As a `GroupWriter`'s writes are: a change queued behind stalled round trips past the
    client's timeout is never sent (`QueuedPastDeadline`) rather than applied long after its
    request gave up on it. Without a deadline it waited for every earlier round trip."""
    client: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, timeoutMS=1500)
    try:
        collection = client["counters_deadline"]["counts"]
        assert BoundedCounters(collection).deadline_s == 1.5
        assert GuardedReleases(collection, remembered=64).deadline_s == 1.5
    finally:
        await client.close()


async def test_a_refused_batchs_slots_are_released_a_chunk_per_round_trip(
    collection: AsyncCollection[Document], commands: CommandCounter
) -> None:
    """One at a time, a refused batch of 1,000 items released its slots in 1,000 round
    trips and outlasted the outbox grace period on a slow database (another replica's sweep
    then sent the items it was about to answer 503 for)."""
    await collection.insert_one({"_id": "tenant", "count": 1_000, "recent_releases": []})
    releases = GuardedReleases(collection, remembered=RELEASE_CHUNK)
    refusal = Refusal("tenant", tuple(f"task{i}" for i in range(1_000)), counted=True)

    await release_slots(refusal, releases)

    assert await _count(collection, "tenant") == 0
    assert refusal.released.count == 1_000
    assert refusal.to_release() == ()
    # 16 chunks of 64, each one update (or two: the first may go alone).
    assert commands.statements <= 32, f"{commands.statements} updates for 1,000 releases"


async def test_a_chunk_that_failed_part_way_releases_only_what_failed_next_time(
    collection: AsyncCollection[Document],
) -> None:
    """Tried again whole, after two other releases of the tenant, a chunk of 64 counted its
    done releases twice: the counter remembers only its last 64 (found in review)."""
    await collection.insert_one({"_id": "tenant", "count": 1_000, "recent_releases": []})
    releases = GuardedReleases(collection, remembered=RELEASE_CHUNK)

    class FailsOnce:
        failed = False

        async def release(self, tenant: str, task: str) -> None:
            if task == "t63" and not self.failed:
                self.failed = True
                raise DatabaseUnavailable("timed out")
            await releases.release(tenant, task)

    refusal = Refusal("tenant", tuple(f"t{i}" for i in range(64)), counted=True)
    releaser = FailsOnce()
    with pytest.raises(DatabaseUnavailable):
        await release_slots(refusal, releaser)
    await releases.release("tenant", "other1")  # two other tasks' outcomes
    await releases.release("tenant", "other2")

    await release_slots(refusal, releaser)

    assert await _count(collection, "tenant") == 1_000 - 64 - 2
    assert refusal.to_release() == ()
