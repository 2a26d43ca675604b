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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import bson
from bson.codec_options import CodecOptions
from bson.errors import InvalidDocument
from pymongo import DeleteOne, InsertOne, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import (
    BulkWriteError,
    DuplicateKeyError,
    PyMongoError,
    WriteConcernError,
    WriteError,
    WTimeoutError,
)

from shared.coalescing import Coalescer, Queued, fail, server_watch, settle

Document = dict[str, Any]
WriteOp = InsertOne[Document] | UpdateOne | DeleteOne
DUPLICATE_KEY = 11000
MAX_BATCH = 500
# What pymongo raises while encoding a write, before sending it.
ENCODING_ERRORS = (InvalidDocument, OverflowError, UnicodeEncodeError)
# A batch this size goes out as one message (MongoDB's maxMessageSizeBytes is 48,000,000).
MAX_ONE_MESSAGE_BYTES = 32_000_000
# The order pymongo sends an unordered bulk write's kinds of write in (`gen_unordered`).
_RUN_ORDER: dict[type, int] = {InsertOne: 0, UpdateOne: 1, DeleteOne: 2}


class WriteOutcomeUnknown(PyMongoError):
    """The write was sent in a round trip that failed part-way: it may have been applied."""


def _run_of(queued: Queued[Write, bool]) -> int:
    return _RUN_ORDER[type(queued.op.op)]


MAX_DOCUMENT_BYTES = 16 * 1024 * 1024


# An update document, or an update pipeline: its stages.
Update = Mapping[str, Any] | Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Write:
    """A write and the documents it sends (to tell, should encoding fail, which write did)."""

    op: WriteOp
    parts: tuple[Mapping[str, Any], ...]


def _encoded_size(write: Write, options: CodecOptions[Any]) -> int | None:
    """The write's size in BSON (encoded as its collection encodes), None when it cannot be
    encoded or sent (a document over MongoDB's 16 MiB)."""
    try:
        sizes = [len(bson.encode(part, codec_options=options)) for part in write.parts]
    except ENCODING_ERRORS:
        return None
    return None if max(sizes) > MAX_DOCUMENT_BYTES else sum(sizes)


class GroupWriter(Coalescer[Write, bool]):
    """Single-document writes to `collection`, coalesced into `bulk_write`s. An update
    answers whether its upsert inserted the document."""

    def __init__(self, collection: AsyncCollection[Document], *, max_batch: int = MAX_BATCH):
        client = collection.database.client
        super().__init__(
            max_batch=max_batch,
            deadline_s=client.options.timeout,
            server=server_watch(client),
        )
        self.collection = collection

    async def update_one(
        self, filter: Mapping[str, Any], update: Update, *, upsert: bool = False
    ) -> bool:
        """True when the upsert inserted the document (none matched `filter`); `update` an
        update document or an update pipeline (its stages)."""
        parts = (update,) if isinstance(update, Mapping) else tuple(update)
        return await self.submit(Write(UpdateOne(filter, update, upsert=upsert), (filter, *parts)))

    async def guarded_upsert(self, filter: Mapping[str, Any], update: Update) -> bool:
        """Upsert `update` where `filter` (`_id` and a guard) matches; False when the document
        exists and the guard refuses it.

        A refused guard shows as the upsert's insert colliding on `_id`. So does a race with
        another process's first insert of the document (both found nothing): MongoDB retries
        such an upsert by itself only when the filter is all equalities, which a guard such
        as `{sequence: {$lt: n}}` is not. A second try tells the two apart: the document
        exists by then, so it matches unless the guard refuses it.
        """
        for _ in range(2):
            try:
                await self.update_one(filter, update, upsert=True)
            except DuplicateKeyError:
                continue
            return True
        return False

    async def insert_one(self, document: Document) -> None:
        await self.submit(Write(InsertOne(document), (document,)))

    async def delete_one(self, filter: Mapping[str, Any]) -> None:
        await self.submit(Write(DeleteOne(filter), (filter,)))

    async def _send(self, batch: list[Queued[Write, bool]]) -> None:
        try:
            await self._bulk_write(batch)
        except ENCODING_ERRORS as error:
            await self._send_encodable(batch, error)

    async def _send_encodable(self, batch: list[Queued[Write, bool]], error: Exception) -> None:
        """A write the client cannot encode (an integer beyond 64 bits, an unknown type, a
        document over 16 MB) failed its batch: fail that write alone and send the others
        again, so one bad write never fails its neighbours.

        An unordered bulk goes out as one command per kind of write, inserts, then updates,
        then deletes, each encoded as it is sent: the kinds before the bad write's were sent,
        and may have been applied. Those are not sent again (an insert would collide with
        itself, an update apply twice); they fail as `WriteOutcomeUnknown`, which their
        callers treat like any write whose answer was lost. pymongo also splits a batch
        over `MAX_ONE_MESSAGE_BYTES` into several messages and may have sent the first ones;
        then all fail that way.
        """
        options = self.collection.codec_options
        sizes = [_encoded_size(queued.op, options) for queued in batch]
        unencodable = [queued for queued, size in zip(batch, sizes, strict=True) if size is None]
        for queued in unencodable:
            fail(queued, InvalidDocument(f"cannot encode this write: {error}"))
        # Without a culprit found, or over one message, any of it may have been sent.
        first_unsent = min((_run_of(queued) for queued in unencodable), default=len(_RUN_ORDER))
        if sum(size or 0 for size in sizes) > MAX_ONE_MESSAGE_BYTES:
            first_unsent = len(_RUN_ORDER)
        again = []
        for queued, size in zip(batch, sizes, strict=True):
            if size is None:
                continue
            if _run_of(queued) < first_unsent:
                fail(queued, WriteOutcomeUnknown(f"sent with a write that failed: {error}"))
            else:
                again.append(queued)
        if again:
            await self._bulk_write(again)

    async def _bulk_write(self, batch: list[Queued[Write, bool]]) -> None:
        try:
            result = await self.collection.bulk_write(
                [queued.op.op for queued in batch], ordered=False
            )
        except BulkWriteError as error:
            failures = _failures_by_index(error.details, size=len(batch))
            upserted = {each["index"] for each in error.details.get("upserted", [])}
            for index, queued in enumerate(batch):
                failure = failures.get(index)
                if failure is None:
                    settle(queued, index in upserted)
                else:
                    fail(queued, failure)
        else:
            upserted = set(result.upserted_ids or {})
            for index, queued in enumerate(batch):
                settle(queued, index in upserted)


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
        # As pymongo raises it: a replication timeout is a `WTimeoutError`, which callers
        # take for a passing outage (`timeout`), not a refusal.
        timed_out = (first.get("errInfo") or {}).get("wtimeout")
        concern_error = WTimeoutError if timed_out else WriteConcernError
        shared = concern_error(first.get("errmsg", ""), first.get("code"), first)
        for index in range(size):
            failures.setdefault(index, shared)
    return failures
