"""Fan-out checkpoints, in the scheduler's own database: where a run of a fan-out stands.

    fanout_checkpoints {_id: run_id, job, rubric_version, last_id, published, scanned, pages,
                        started_at, updated_at, finished_at}

`last_id` is the last catalogue entry a page read, whether or not any of the page's entries
was due a re-score (a page is bounded by the entries it reads, so where stale tasks are
sparse most pages publish nothing, and the run must move past them all the same). It only
moves forward (a conditional update), and only after a page's messages are confirmed by the
broker: a run that dies mid-page publishes that page again when it resumes (consumers are
idempotent) and never skips an item.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from pymongo import ASCENDING, AsyncMongoClient, ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection

Document = dict[str, Any]


@dataclass(frozen=True)
class Checkpoint:
    run_id: str
    rubric_version: str
    last_id: str | None
    published: int
    pages: int
    finished_at: datetime | None
    scanned: int = 0

    @classmethod
    def from_document(cls, document: Document) -> Checkpoint:
        return cls(
            run_id=document["_id"],
            rubric_version=document["rubric_version"],
            last_id=document.get("last_id"),
            published=document.get("published", 0),
            pages=document.get("pages", 0),
            finished_at=document.get("finished_at"),
            scanned=document.get("scanned", 0),
        )

    def past_page(self, *, last_id: str, published: int, scanned: int) -> Checkpoint:
        """Where the run stands once `advance` took it past a page, known without a read:
        a delivery that ends after its database deadline passed can still tell it."""
        return replace(
            self,
            last_id=last_id,
            published=self.published + published,
            scanned=self.scanned + scanned,
            pages=self.pages + 1,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "rubric_version": self.rubric_version,
            "published": self.published,
            "scanned": self.scanned,
            "pages": self.pages,
            "last_id": self.last_id,
            "finished": self.finished_at is not None,
        }


class Checkpoints:
    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._collection: AsyncCollection[Document] = client[database]["fanout_checkpoints"]

    async def ensure_indexes(self) -> None:
        await self._collection.create_index([("finished_at", ASCENDING)])

    async def start_or_resume(
        self, run_id: str, *, job: str, rubric_version: str, now: datetime
    ) -> Checkpoint:
        document = await self._collection.find_one_and_update(
            {"_id": run_id},
            {
                "$setOnInsert": {
                    "job": job,
                    "rubric_version": rubric_version,
                    "last_id": None,
                    "published": 0,
                    "scanned": 0,
                    "pages": 0,
                    "started_at": now,
                    "finished_at": None,
                },
                "$set": {"updated_at": now},
            },
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )
        if document is None:  # an upsert always returns the document
            raise LookupError(f"no checkpoint for run {run_id}")
        return Checkpoint.from_document(document)

    async def advance(
        self, run_id: str, *, last_id: str, published: int, scanned: int, now: datetime
    ) -> None:
        """Past a page: `scanned` entries read up to `last_id`, `published` of them."""
        await self._collection.update_one(
            {"_id": run_id, "$or": [{"last_id": None}, {"last_id": {"$lt": last_id}}]},
            {
                "$set": {"last_id": last_id, "updated_at": now},
                "$inc": {"published": published, "scanned": scanned, "pages": 1},
            },
        )

    async def finish(self, run_id: str, *, now: datetime) -> Checkpoint:
        document = await self._collection.find_one_and_update(
            {"_id": run_id},
            {"$set": {"finished_at": now, "updated_at": now}},
            return_document=ReturnDocument.AFTER,
        )
        if document is None:
            raise LookupError(f"no checkpoint for run {run_id}")
        return Checkpoint.from_document(document)

    async def find(self, run_id: str) -> Checkpoint | None:
        document = await self._collection.find_one({"_id": run_id})
        return None if document is None else Checkpoint.from_document(document)

    async def delete_finished_before(self, cutoff: datetime) -> int:
        """Delete the checkpoints of runs finished before `cutoff`, and of runs given up
        (never finished) whose last step was before it: a run that goes on touches its
        checkpoint at every delivery, at least every `SCHEDULER_RETRY_CAP_S` while it waits
        for room, and is given up after 6 hours of that without progress."""
        result = await self._collection.delete_many(
            {
                "$or": [
                    # `$type`: MongoDB never compares null with a date, but the stand-in
                    # (mongoeco) does, and took every unfinished run for finished long ago.
                    {"finished_at": {"$type": "date", "$lt": cutoff}},
                    {"finished_at": None, "updated_at": {"$lt": cutoff}},
                ]
            }
        )
        return result.deleted_count
