"""Group commit for single-document writes: concurrent writes to one collection share one
unordered `bulk_write` round trip.

A write waits only while the previous round trip is in flight, so an idle service writes at
once and a busy one sends everything that queued up meanwhile in one command
(`shared.coalescing`). Each caller still gets its own outcome: the write's own error (a
`DuplicateKeyError` for code 11000, a `WriteError` otherwise) or the batch's (the server
unreachable, a timeout, a write-concern error). The writes of one batch may be applied in
any order, so callers must not depend on the order of concurrent writes to one document —
which concurrent callers never could.

`python -m bench.micro` measures the client CPU per write both ways (docs/architecture.md,
"Performance").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pymongo import DeleteOne, InsertOne, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, DuplicateKeyError, WriteConcernError, WriteError

from shared.coalescing import Coalescer, Queued, fail, settle

Document = dict[str, Any]
WriteOp = InsertOne[Document] | UpdateOne | DeleteOne
DUPLICATE_KEY = 11000
MAX_BATCH = 500


class GroupWriter(Coalescer[WriteOp, None]):
    """Single-document writes to `collection`, coalesced into `bulk_write`s."""

    def __init__(self, collection: AsyncCollection[Document], *, max_batch: int = MAX_BATCH):
        super().__init__(max_batch=max_batch)
        self.collection = collection

    async def update_one(
        self, filter: Mapping[str, Any], update: Mapping[str, Any], *, upsert: bool = False
    ) -> None:
        await self.write(UpdateOne(filter, update, upsert=upsert))

    async def insert_one(self, document: Document) -> None:
        await self.write(InsertOne(document))

    async def delete_one(self, filter: Mapping[str, Any]) -> None:
        await self.write(DeleteOne(filter))

    async def write(self, op: WriteOp) -> None:
        await self.submit(op)

    async def _send(self, batch: list[Queued[WriteOp, None]]) -> None:
        try:
            await self.collection.bulk_write([queued.op for queued in batch], ordered=False)
        except BulkWriteError as error:
            failures = _failures_by_index(error.details, size=len(batch))
            for index, queued in enumerate(batch):
                failure = failures.get(index)
                if failure is None:
                    settle(queued, None)
                else:
                    fail(queued, failure)
        else:
            for queued in batch:
                settle(queued, None)


def _failures_by_index(details: Mapping[str, Any], *, size: int) -> dict[int, Exception]:
    failures: dict[int, Exception] = {}
    for failure in details.get("writeErrors", []):
        kind = DuplicateKeyError if failure.get("code") == DUPLICATE_KEY else WriteError
        failures[failure["index"]] = kind(failure.get("errmsg", ""), failure.get("code"), failure)
    concern = details.get("writeConcernErrors") or []
    if concern:
        # Not known to be durable: every write of the batch without an error of its own
        # fails with it, and its caller (the owner of its retry) writes again.
        first = concern[0]
        shared = WriteConcernError(first.get("errmsg", ""), first.get("code"), first)
        for index in range(size):
            failures.setdefault(index, shared)
    return failures
