"""Raw usage records and their daily rollup, in the scheduler's own database.

    usage_records {_id: "<task_id>:<generation>", task_id, generation, tenant_id, api_key_id,
                   model, prompt_tokens, completion_tokens, cost_nanos | null, cached,
                   day: "YYYY-MM-DD" (UTC), completed_at, recorded_at,
                   rolled_up: bool, rollup_run}
    usage_daily   {_id: "<tenant_id>|<day>", tenant_id, day, requests, prompt_tokens,
                   completion_tokens, cost_nanos, priced_requests, rolled_up_at}
    usage_owed_days {_id: "<tenant_id>|<day>", tenant_id, day, token, since}

A daily row is always recomputed in full from the raw records of its (tenant, day) and
written with `$set`, never incremented: recomputing it again gives the same row. Raw records
only accumulate (within the retention a row is recomputed in), so of two roll-ups running at
once the one that counted more requests saw more records: a row is written only over one
that counts no more requests than it, and a roll-up that read its totals before the other's
records arrived cannot overwrite the other's row with them.

The roll-up reads pending records a bounded batch at a time (`pending_batch`), in
(tenant, day, `_id`) order, through `pending_by_tenant_day`: a partial index of the records
not yet rolled up, so it holds only the backlog, and answers the read from its keys alone
(the filter, the order and the fields read). It marks rolled up the records it read, by
`_id` (`mark_rolled_up`); `rollup_run` names the execution that marked a record.

A (tenant, day) is owed a recount (`usage_owed_days`) while records of it may be marked rolled
up that its row does not count: a slice that ends inside a day marks that day's records
without recounting it, and leaves the recount to the slice that reads its last pending
record (`jobs.usage`). The debt is noted (`owe`, with a new `token`) before any of those
records is marked, so after they were stored; a recount that read the token before reading
the day's records counts them all, and settles the debt (`settle`) only if the token is still
the one it read: a day owed again meanwhile stays owed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from pymongo import ASCENDING, AsyncMongoClient, DeleteOne, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, DuplicateKeyError

from shared.contracts import new_id
from shared.group_writes import DUPLICATE_KEY, GroupWriter
from shared.indexes import drop_retired_indexes

Document = dict[str, Any]
# (tenant, day) pairs recomputed per aggregation; keeps each `$or` small.
TOTALS_CHUNK = 500
# Daily rows written per `bulk_write`.
SAVE_CHUNK = 500
# The index of the records not yet rolled up (`pending_batch`), in the order they are read.
PENDING_INDEX = "pending_by_tenant_day"
PENDING_ORDER = [("tenant_id", ASCENDING), ("day", ASCENDING), ("_id", ASCENDING)]
# Served the roll-up's tags (`rollup_run`), which it no longer queries.
RETIRED_INDEXES = ("rolled_up_1_rollup_run_1",)


@dataclass(frozen=True)
class UsageRecord:
    task_id: str
    generation: int
    tenant_id: str
    api_key_id: str | None
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_nanos: int | None
    cached: bool
    day: str
    completed_at: datetime
    recorded_at: datetime

    @property
    def record_id(self) -> str:
        return f"{self.task_id}:{self.generation}"


@dataclass(frozen=True, order=True)
class TenantDay:
    tenant_id: str
    day: str


@dataclass(frozen=True)
class PendingBatch:
    """Records not yet rolled up, as read: their `_id`s and their (tenant, day) pairs;
    `continued`, the last of those pairs when the pending record read after the batch is
    of it too (the day goes on past the batch)."""

    ids: list[str]
    days: list[TenantDay]
    continued: TenantDay | None = None


@dataclass(frozen=True)
class DailyUsage:
    tenant_id: str
    day: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_nanos: int
    priced_requests: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def unpriced_requests(self) -> int:
        return self.requests - self.priced_requests


class UsageRecords:
    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._collection: AsyncCollection[Document] = client[database]["usage_records"]
        self._owed: AsyncCollection[Document] = client[database]["usage_owed_days"]
        self._writes = GroupWriter(self._collection)

    async def ensure_indexes(self) -> None:
        await drop_retired_indexes(self._collection, *RETIRED_INDEXES)
        await self._collection.create_index([("tenant_id", ASCENDING), ("day", ASCENDING)])
        await self._collection.create_index([("day", ASCENDING)])
        # Only the pending records (a record leaves it once rolled up): `rolled_up` first, so
        # the read's filter is answered from the index too.
        await self._collection.create_index(
            [("rolled_up", ASCENDING), *PENDING_ORDER],
            name=PENDING_INDEX,
            partialFilterExpression={"rolled_up": False},
        )

    async def record(self, record: UsageRecord) -> None:
        """Store `record` unless it exists (a redelivery)."""
        # Its fields, shallow: `asdict` deep-copies every value, none of which is mutable
        # (docs/architecture.md, "Performance").
        fields = dict(vars(record))
        await self._writes.update_one(
            {"_id": record.record_id},
            {"$setOnInsert": {**fields, "rolled_up": False, "rollup_run": None}},
            upsert=True,
        )

    async def pending_batch(self, limit: int) -> PendingBatch:
        """Up to `limit` records not yet rolled up, the first in (tenant, day, `_id`) order
        (read from `PENDING_INDEX` alone), and whether their last day goes on past them (one
        more record read: the next one)."""
        if limit < 1:
            raise ValueError(f"a batch holds at least one record, not {limit}")
        cursor = (
            self._collection.find(
                {"rolled_up": False}, projection={"_id": True, "tenant_id": True, "day": True}
            )
            .sort(PENDING_ORDER)
            .limit(limit + 1)
        )
        read = [
            (document["_id"], TenantDay(tenant_id=document["tenant_id"], day=document["day"]))
            async for document in cursor
        ]
        batch, after = read[:limit], read[limit:]
        continued = batch[-1][1] if after and after[0][1] == batch[-1][1] else None
        return PendingBatch(
            ids=[record_id for record_id, _ in batch],
            days=sorted({pair for _, pair in batch}),
            continued=continued,
        )

    async def totals(self, days: Sequence[TenantDay]) -> list[DailyUsage]:
        """Each (tenant, day)'s totals over all of its raw records."""
        found: list[DailyUsage] = []
        for start in range(0, len(days), TOTALS_CHUNK):
            chunk = days[start : start + TOTALS_CHUNK]
            found.extend(await self._totals_of(chunk))
        return sorted(found, key=lambda usage: (usage.tenant_id, usage.day))

    async def _totals_of(self, days: Sequence[TenantDay]) -> list[DailyUsage]:
        match = {"$or": [{"tenant_id": d.tenant_id, "day": d.day} for d in days]}
        cursor = await self._collection.aggregate(
            [
                {"$match": match},
                {
                    "$group": {
                        "_id": {"tenant_id": "$tenant_id", "day": "$day"},
                        "requests": {"$sum": 1},
                        "prompt_tokens": {"$sum": "$prompt_tokens"},
                        "completion_tokens": {"$sum": "$completion_tokens"},
                        "cost_nanos": {"$sum": "$cost_nanos"},
                        "priced_requests": {
                            "$sum": {
                                "$cond": [
                                    {"$eq": [{"$ifNull": ["$cost_nanos", None]}, None]},
                                    0,
                                    1,
                                ]
                            }
                        },
                    }
                },
            ]
        )
        return [
            DailyUsage(
                tenant_id=group["_id"]["tenant_id"],
                day=group["_id"]["day"],
                requests=int(group["requests"]),
                prompt_tokens=int(group["prompt_tokens"]),
                completion_tokens=int(group["completion_tokens"]),
                cost_nanos=int(group["cost_nanos"]),
                priced_requests=int(group["priced_requests"]),
            )
            async for group in cursor
        ]

    async def mark_rolled_up(self, ids: Sequence[str], *, by: str) -> int:
        """Mark the records `ids` rolled up (by the execution `by`), those not yet marked."""
        if not ids:
            return 0
        result = await self._collection.update_many(
            {"_id": {"$in": list(ids)}, "rolled_up": False},
            {"$set": {"rolled_up": True, "rollup_run": by}},
        )
        return result.modified_count

    async def owe(self, day: TenantDay, *, now: datetime) -> None:
        """Note that `day` is owed a recount, with a new token, before marking rolled up
        records of it that its row may not count."""
        key = {"_id": _daily_id(day.tenant_id, day.day)}
        update = {
            "$set": {"tenant_id": day.tenant_id, "day": day.day, "token": new_id(), "since": now}
        }
        try:
            await self._owed.update_one(key, update, upsert=True)
        except DuplicateKeyError:  # another execution's first debt of the day, inserted since
            await self._owed.update_one(key, update, upsert=True)

    async def owed(self, days: Sequence[TenantDay]) -> dict[TenantDay, str]:
        """Those of `days` owed a recount, each with its token (by `_id`)."""
        if not days:
            return {}
        ids = sorted({_daily_id(day.tenant_id, day.day) for day in days})
        return await self._owed_where({"_id": {"$in": ids}})

    async def all_owed(self) -> dict[TenantDay, str]:
        """Every day owed a recount, each with its token (in `_id` order, by the `_id` index)."""
        return await self._owed_where({})

    async def _owed_where(self, query: Document) -> dict[TenantDay, str]:
        cursor = self._owed.find(
            query, projection={"_id": False, "tenant_id": True, "day": True, "token": True}
        ).sort("_id", ASCENDING)
        return {
            TenantDay(tenant_id=document["tenant_id"], day=document["day"]): document["token"]
            async for document in cursor
        }

    async def settle(self, owed: Mapping[TenantDay, str]) -> int:
        """Forget the debts of `owed` (read before the recount of their days) whose token is
        unchanged: a day owed again since then stays owed. Returns the debts forgotten."""
        deletes = [
            DeleteOne({"_id": _daily_id(day.tenant_id, day.day), "token": token})
            for day, token in sorted(owed.items())
        ]
        settled = 0
        for start in range(0, len(deletes), SAVE_CHUNK):
            result = await self._owed.bulk_write(deletes[start : start + SAVE_CHUNK], ordered=False)
            settled += result.deleted_count
        return settled

    async def delete_rolled_up_before(self, day: str) -> int:
        result = await self._collection.delete_many({"day": {"$lt": day}, "rolled_up": True})
        return result.deleted_count


def _daily_id(tenant_id: str, day: str) -> str:
    return f"{tenant_id}|{day}"


class DailyUsageStore:
    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._collection: AsyncCollection[Document] = client[database]["usage_daily"]

    async def ensure_indexes(self) -> None:
        await self._collection.create_index([("tenant_id", ASCENDING), ("day", ASCENDING)])

    async def save(self, rows: Iterable[DailyUsage], *, now: datetime) -> int:
        """Replace each row's totals (`$set`, upsert) unless the stored row counts more
        requests (recomputed from more records meanwhile); idempotent. Returns the rows set.

        Written `SAVE_CHUNK` rows per round trip in the caller's own task, so the rollup's
        deadline (`pymongo.timeout`, `SCHEDULER_JOB_DB_TIMEOUT_S`) bounds them. Through a
        `GroupWriter` the round trips ran in a context of their own, every row within the
        client's `MONGO_TIMEOUT_S` of being queued: with all of a run's rows queued at once,
        the rows of a busy day failed unsent."""
        pending = list(rows)
        saved = 0
        for start in range(0, len(pending), SAVE_CHUNK):
            saved += await self._save_chunk(pending[start : start + SAVE_CHUNK], now=now)
        return saved

    async def _save_chunk(self, rows: Sequence[DailyUsage], *, now: datetime) -> int:
        """As `GroupWriter.guarded_upsert`, one round trip for all: a row whose upsert collides
        on `_id` is either refused by its guard (the stored row counts more requests) or
        lost a race with another roll-up's first insert of it; a second try tells the two
        apart, the row existing by then."""
        upserts = [
            UpdateOne(
                {"_id": _daily_id(row.tenant_id, row.day), "requests": {"$lte": row.requests}},
                {"$set": {**asdict(row), "rolled_up_at": now}},
                upsert=True,
            )
            for row in rows
        ]
        collided = await self._upsert(upserts)
        if collided:
            collided = await self._upsert([upserts[index] for index in collided])
        return len(upserts) - len(collided)

    async def _upsert(self, upserts: Sequence[UpdateOne]) -> list[int]:
        """The indexes (in `upserts`) of the upserts whose insert collided on `_id`; any other
        failure raises (the rollup is retried, and recomputes the same rows)."""
        if not upserts:
            return []
        try:
            await self._collection.bulk_write(list(upserts), ordered=False)
        except BulkWriteError as error:
            details = error.details
            failures = details.get("writeErrors", [])
            if details.get("writeConcernErrors") or any(
                failure.get("code") != DUPLICATE_KEY for failure in failures
            ):
                raise
            return sorted(int(failure["index"]) for failure in failures)
        return []

    async def read(self, tenant_id: str, *, first_day: str, last_day: str) -> list[DailyUsage]:
        cursor = self._collection.find(
            {"tenant_id": tenant_id, "day": {"$gte": first_day, "$lte": last_day}},
            projection={"_id": False, "rolled_up_at": False},
        ).sort("day", ASCENDING)
        return [DailyUsage(**document) async for document in cursor]
