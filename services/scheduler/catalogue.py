"""The scheduler's catalogue of completed tasks, built from `task.completed` events.

    completed_tasks {_id: task_id, tenant_id, generation, completed_at, first_completed_at,
                     model, rubric_version | null, cached, rescore_requested_for}

It is what the re-score fan-out walks (keyset pagination on `_id`). A task is stale when it
was scored with another rubric version than the current one, or an unknown one (today's
events do not carry the version). Versions are opaque labels (the scorer's are strings such
as `judge-2025-1`), so "older" means "not the current one". `rescore_requested_for` records
the version a re-score was last requested for, so each task is requested at most once per
version even though its new result may again arrive without a version.

A page is the next `limit` entries in `_id` order, filtered afterwards (`scan_page`): bounded
by the entries it reads, not by the stale ones it finds. Asked for the next `limit` stale
entries (`_id > after` with the staleness filter, sorted by `_id`), MongoDB could only walk
the `_id` index and test each entry, so where stale entries were sparse (the daily run after
a full pass) one page read the whole catalogue, beyond any deadline, and the run never got
past it. A page is also due only for tasks the gateway still knows: those first completed
within the horizon (`FANOUT_HORIZON_S`, the gateway's `IDEMPOTENCY_TTL_S`); an older one
would be answered "unknown task" after two round trips to the gateway's database. The
gateway keeps a submission from when its task was due, at or before its first completion,
and a re-score does not extend it: counted from the latest generation's completion, as first
built, the horizon let a task re-scored late in its life be requested for up to a day
after the gateway had let it go (the re-read in session 57). An entry recorded before
`first_completed_at` was kept counts from `completed_at`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pymongo import ASCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from shared.group_writes import GroupWriter

Document = dict[str, Any]
MARK_CHUNK = 250
# Entries one housekeeping delete removes at most (by `_id`, found through `completed_at`).
DELETE_CHUNK = 10_000


@dataclass(frozen=True)
class CompletedTask:
    task_id: str
    tenant_id: str
    generation: int
    completed_at: datetime
    model: str | None
    rubric_version: str | None
    cached: bool = False  # its result came from the result cache
    # Its first generation's completion (`completed_at` where none was recorded, or for an
    # entry being recorded): the horizon counts from it.
    first_completed_at: datetime | None = None

    @property
    def horizon_counts_from(self) -> datetime:
        return self.first_completed_at or self.completed_at


@dataclass(frozen=True)
class ScannedPage:
    """A page of the catalogue: `scanned` entries read in `_id` order, the last of them
    `last_id` (`after` when none was left), and those of them `due` a re-score."""

    due: list[CompletedTask]
    scanned: int
    last_id: str | None


def _is_due(document: Document, current_version: str, completed_since: datetime) -> bool:
    # As MongoDB's `$ne` reads them, a field absent or null differs from the version.
    if document.get("rubric_version") == current_version:
        return False
    if document.get("rescore_requested_for") == current_version:
        return False
    completed_at = _aware(document.get("completed_at"))
    if completed_at is None:
        return False
    first_completed_at = _aware(document.get("first_completed_at")) or completed_at
    return first_completed_at >= completed_since


def _aware(value: object) -> datetime | None:
    """A date of a document, aware; None for anything else. A client without `tz_aware`
    reads BSON dates (UTC) naive."""
    if not isinstance(value, datetime):
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _recorded_fields(task: CompletedTask) -> Document:
    """The fields `record` sets, as an update pipeline's stage: every value a literal (a
    string starting with `$` would be read as a field), and the first completion the
    earliest of the one kept, the entry's `completed_at` where an earlier build kept none,
    and this one."""
    earliest_kept = {"$ifNull": ["$first_completed_at", "$completed_at"]}
    fields = {
        "tenant_id": task.tenant_id,
        "generation": task.generation,
        "completed_at": task.completed_at,
        "model": task.model,
        "rubric_version": task.rubric_version,
        "cached": task.cached,
    }
    return {name: {"$literal": value} for name, value in fields.items()} | {
        "first_completed_at": {"$min": [earliest_kept, {"$literal": task.completed_at}]}
    }


def _completed_task(document: Document) -> CompletedTask:
    completed_at = _aware(document["completed_at"])
    assert completed_at is not None  # `_is_due` read it first
    return CompletedTask(
        task_id=document["_id"],
        tenant_id=document["tenant_id"],
        generation=document.get("generation", 0),
        completed_at=completed_at,
        first_completed_at=_aware(document.get("first_completed_at")),
        model=document.get("model"),
        rubric_version=document.get("rubric_version"),
        cached=bool(document.get("cached")),
    )


class Catalogue:
    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._collection: AsyncCollection[Document] = client[database]["completed_tasks"]
        self._writes = GroupWriter(self._collection)

    async def ensure_indexes(self) -> None:
        await self._collection.create_index([("completed_at", ASCENDING)])

    async def record(self, task: CompletedTask) -> bool:
        """Keep the latest generation of a task, and its earliest completion seen; False for
        an older generation (its completion still lowers the first one: events may arrive
        out of order)."""
        recorded = await self._writes.guarded_upsert(
            {"_id": task.task_id, "generation": {"$lte": task.generation}},
            [{"$set": _recorded_fields(task)}],
        )
        if not recorded:
            await self._collection.update_one(
                {"_id": task.task_id}, {"$min": {"first_completed_at": task.completed_at}}
            )
        return recorded

    async def scan_page(
        self, *, after: str | None, current_version: str, completed_since: datetime, limit: int
    ) -> ScannedPage:
        """The next `limit` entries with `_id > after` in `_id` order, and which of them are
        due a re-score: stale for `current_version` and completed at or after
        `completed_since`.

        The query names nothing but the `_id` range, so the server reads at most `limit`
        entries of the `_id` index whatever it finds; the filter runs here. (With the filter
        in the query, a page had to read on until it found `limit` stale entries.)
        """
        query: Document = {} if after is None else {"_id": {"$gt": after}}
        cursor = self._collection.find(query).sort("_id", ASCENDING).limit(limit)
        scanned, last_id, due = 0, after, []
        async for document in cursor:
            scanned += 1
            last_id = document["_id"]
            if _is_due(document, current_version, completed_since):
                due.append(_completed_task(document))
        return ScannedPage(due=due, scanned=scanned, last_id=last_id)

    async def mark_rescore_requested(self, task_ids: Sequence[str], version: str) -> None:
        # In chunks, so that no single write runs long on a slow server (each is bounded by
        # MONGO_TIMEOUT_S); on MongoDB a chunk of ids by `_id` costs milliseconds.
        for start in range(0, len(task_ids), MARK_CHUNK):
            chunk = list(task_ids[start : start + MARK_CHUNK])
            await self._collection.update_many(
                {"_id": {"$in": chunk}}, {"$set": {"rescore_requested_for": version}}
            )

    async def delete_completed_before(
        self, cutoff: datetime, *, stop: Callable[[], bool], chunk: int = DELETE_CHUNK
    ) -> int:
        """Delete the entries completed before `cutoff`, `chunk` at a time, until none is
        left or `stop` says so (the rest is the next run's); how many. One delete of them
        all outlasted the job's deadline where a year of entries was due at once (upgrading
        from the year's retention), and each housekeeping run failed until dead-lettered
        (re-read of the retention's change)."""
        deleted = 0
        expired = {"completed_at": {"$lt": cutoff}}
        while True:
            found = self._collection.find(expired, {"_id": 1}).limit(chunk)
            ids = [document["_id"] async for document in found]
            if ids:
                result = await self._collection.delete_many({"_id": {"$in": ids}, **expired})
                deleted += result.deleted_count
            if len(ids) < chunk or stop():
                return deleted
