"""The scheduler's catalogue of completed tasks, built from `task.completed` events.

    completed_tasks {_id: task_id, tenant_id, generation, completed_at, model,
                     rubric_version | null, rescore_requested_for}

It is what the re-score fan-out walks (keyset pagination on `_id`). A task is stale when it
was scored with another rubric version than the current one, or an unknown one (today's
events do not carry the version). Versions are opaque labels (the scorer's are strings such
as `judge-2025-1`), so "older" means "not the current one". `rescore_requested_for` records
the version a re-score was last requested for, so each task is requested at most once per
version even though its new result may again arrive without a version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pymongo import ASCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from shared.group_writes import GroupWriter

Document = dict[str, Any]
MARK_CHUNK = 250


@dataclass(frozen=True)
class CompletedTask:
    task_id: str
    tenant_id: str
    generation: int
    completed_at: datetime
    model: str | None
    rubric_version: str | None


class Catalogue:
    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._collection: AsyncCollection[Document] = client[database]["completed_tasks"]
        self._writes = GroupWriter(self._collection)

    async def ensure_indexes(self) -> None:
        await self._collection.create_index([("completed_at", ASCENDING)])

    async def record(self, task: CompletedTask) -> bool:
        """Keep the latest generation of a task; False for an older (or same) one."""
        return await self._writes.guarded_upsert(
            {"_id": task.task_id, "generation": {"$lte": task.generation}},
            {
                "$set": {
                    "tenant_id": task.tenant_id,
                    "generation": task.generation,
                    "completed_at": task.completed_at,
                    "model": task.model,
                    "rubric_version": task.rubric_version,
                }
            },
        )

    async def stale_page(
        self, *, after: str | None, current_version: str, limit: int
    ) -> list[CompletedTask]:
        """The next `limit` stale tasks with `_id > after`, in `_id` order."""
        query: Document = {
            "rubric_version": {"$ne": current_version},
            "rescore_requested_for": {"$ne": current_version},
        }
        if after is not None:
            query["_id"] = {"$gt": after}
        cursor = self._collection.find(query).sort("_id", ASCENDING).limit(limit)
        return [
            CompletedTask(
                task_id=document["_id"],
                tenant_id=document["tenant_id"],
                generation=document.get("generation", 0),
                completed_at=document["completed_at"],
                model=document.get("model"),
                rubric_version=document.get("rubric_version"),
            )
            async for document in cursor
        ]

    async def mark_rescore_requested(self, task_ids: Sequence[str], version: str) -> None:
        # In chunks, so that no single write runs long on a slow server (each is bounded by
        # MONGO_TIMEOUT_S); on MongoDB a chunk of ids by `_id` costs milliseconds.
        for start in range(0, len(task_ids), MARK_CHUNK):
            chunk = list(task_ids[start : start + MARK_CHUNK])
            await self._collection.update_many(
                {"_id": {"$in": chunk}}, {"$set": {"rescore_requested_for": version}}
            )

    async def delete_completed_before(self, cutoff: datetime) -> int:
        result = await self._collection.delete_many({"completed_at": {"$lt": cutoff}})
        return result.deleted_count
