"""Batches: many texts in one request, their progress in one read (no HTTP, no broker here).

Accepting a batch (`submit_batch`), all or nothing:
1. every item was validated before this runs (one invalid item fails the whole request);
2. the batch record and one submission per item are recorded as `accepting` (one insert each);
3. its tasks are admitted against the tenant's in-flight limit, all or none (`LimitExceeded`:
   429, the batch is discarded);
4. every `score.requested` is published with its confirm in flight together (one round); the
   status projection takes each item, batch and position included, from its command;
5. submissions and batch are marked `accepted` (one update each).
If the broker took none of step 4's commands, the slots are released, the batch and then its
submissions discarded (both stay if a replay of the request accepted the batch meanwhile), and
`BrokerUnavailable` raised: the client sees 503 and nothing was kept. Records that cannot be
removed then (the database failing too), and those of a batch whose insert failed without an
answer (it may land yet), are written off in the background (`services/gateway/refusals.py`),
so the outbox sweep never sends a refused batch. If some
commands may have reached their queue but not all were confirmed, the batch is accepted (a
replay of the request answers it) and its submissions marked `unconfirmed` for the outbox
sweep, which sends each command again. A process that dies between 2 and 5 leaves submissions
`accepting`, which the outbox sweep sends later. If it died before recording them all, a
replay of the request (same `Idempotency-Key`) after the grace period records the missing ones
from its own items before it answers the batch as accepted (`_complete_interrupted`). A replay
the database fails never refuses the batch, which is its first request's (perhaps answered 202
and sent already): it answers `ReplayUnfinished` (409, retry with the same key).

Batches do not consult the result cache (one lookup per item would dominate the request);
their results still fill it.

Reading a batch (`read_batch`): the gateway's record says which tasks belong to it and in
which order (the request's); the status service owns their progress (counts per status and a
page of items, by `batch_index`). Tasks the status service has not heard of yet read as
`queued` while the batch is young (read-your-writes, like `read_score`), while their
submissions are not sent yet (`accepting`, `unconfirmed`) or were sent by the outbox sweep
within the same window, and as `expired` otherwise (their results outlived
`FINISHED_TASK_TTL_S`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Final, NoReturn, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pymongo import ASCENDING, DESCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError, PyMongoError

from services.gateway.cache import cache_key, scoring_model
from services.gateway.errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    IdempotencyConflict,
    ReplayUnfinished,
    RequestInProgress,
    in_progress_retry_after,
)
from services.gateway.limits import LimitExceeded
from services.gateway.refusals import Refusal, Refusals, may_have_been_written, release_slots
from services.gateway.schemas import (
    BLANK_TEXT,
    EXPIRED,
    ModelName,
    Rubric,
    checked_metadata,
    named_rubric,
)
from services.gateway.submissions import (
    BATCH_WRITE_CHUNK,
    TOMBSTONE_TTL,
    BatchRow,
    BatchSize,
    KeyTaken,
    Submissions,
    SubmissionState,
    request_hash,
)
from services.gateway.submit import (
    InFlightGate,
    counting,
    incomplete_batch_held_until,
    refuse_before_recording,
)
from shared.contracts import (
    MAX_BATCH_ITEMS,
    BatchItemProgress,
    BatchProgress,
    ScoreResult,
    ScoreText,
    TaskFailure,
    TaskStatus,
    new_id,
)
from shared.group_writes import GroupWriter
from shared.indexes import string_key
from shared.text import is_blank

log = logging.getLogger("scorebox.gateway.batches")
Clock = Callable[[], datetime]
Document = dict[str, Any]
# While a batch may still have items to send, its record carries the time at which the outbox
# sweep next looks at it, `hold_lead` before it would expire (`services/gateway/batch_expiry.py`).
HOLD_CHECK_AT: Final = "hold_check_at"
# Set on a batch whose items the outbox sweep sends (`Batches.outlive_sends`): no refusal
# of its request deletes or tombstones it any more.
SWEPT: Final = "swept"
# False from a batch's insert until its request has recorded every item, then True
# (`Batches.mark_recorded`): the outbox sweep refuses a batch still False, left incomplete
# by a request that died (`Batches.abandon_unrecorded`), and one of the two writes finds the
# other's done. Records of earlier builds have none: never refused so (a slow request of
# such a build, during a rolling upgrade, would publish a batch refused under it).
RECORDED: Final = "recorded"
HOLD_LEAD: Final = timedelta(hours=1)
# The index `GET /v1/batches` reads a tenant's batches from, newest first; `_id` breaks ties
# of a millisecond, so that a page ends at one batch and the next starts right after it.
NEWEST_BATCHES: Final = "batches_by_tenant_newest"
NEWEST_FIRST: Final = {"created_at": DESCENDING, "_id": DESCENDING}

MAX_TEXT_CHARS_CONTEXT = "max_text_chars"


# --- Requests ------------------------------------------------------------------------------------


class BatchItem(BaseModel):
    """One text of a batch: like a single submission, with an optional `client_id`."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(
        description="The text to score: more than whitespace and control characters (see "
        "MAX_TEXT_CHARS)."
    )
    client_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="Your own id for the item, unique within the batch; echoed in the results.",
    )
    rubric: Rubric = Field(default=None, description="Batch's if unset or blank.")
    model: ModelName | None = Field(default=None, description="Batch's if unset.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Kept with the task.")

    @field_validator("text")
    @classmethod
    def _text_fits(cls, text: str, info: ValidationInfo) -> str:
        if is_blank(text):
            raise ValueError(BLANK_TEXT)
        limit = (info.context or {}).get(MAX_TEXT_CHARS_CONTEXT)
        if limit is not None and len(text) > limit:
            raise ValueError(f"text has {len(text)} characters; the limit is {limit}")
        return text

    @field_validator("metadata")
    @classmethod
    def _metadata_safe(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        return checked_metadata(metadata)


class BatchSubmission(BaseModel):
    """`POST /v1/batches`: up to 1,000 texts, with a rubric and model for all of them."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "rubric": "clarity and argument",
                    "items": [
                        {"client_id": "doc-1", "text": "Queues decouple a slow call."},
                        {"client_id": "doc-2", "text": "Polling is simple.", "metadata": {"p": 2}},
                    ],
                }
            ]
        },
    )

    items: list[BatchItem] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)
    rubric: Rubric = Field(default=None, description="Default of items.")
    model: ModelName | None = Field(default=None, description="Default of items.")

    def duplicate_client_id(self) -> tuple[int, str] | None:
        """(index, client id) of the first item that repeats an earlier item's client id."""
        seen: set[str] = set()
        for index, item in enumerate(self.items):
            if item.client_id is not None:
                if item.client_id in seen:
                    return index, item.client_id
                seen.add(item.client_id)
        return None


# --- The gateway's record of a batch -------------------------------------------------------------


class BatchState:
    ACCEPTING = SubmissionState.ACCEPTING.value
    ACCEPTED = SubmissionState.ACCEPTED.value
    ABANDONED = SubmissionState.ABANDONED.value  # refused after all: a tombstone


@dataclass(frozen=True)
class BatchMember:
    task_id: str
    client_id: str | None


@dataclass(frozen=True)
class BatchRecord:
    batch_id: str
    tenant_id: str
    state: str
    request_hash: str
    created_at: datetime
    members: tuple[BatchMember, ...]
    # When it expires as stored (None: not read from the store, or not set).
    expires_at: datetime | None = None
    # Its request noted every item recorded (`RECORDED`); None on records of earlier builds.
    recorded: bool | None = False
    # The outbox sweep sends its items (`SWEPT`).
    swept: bool = False
    # It was submitted under an Idempotency-Key, which a replay may complete it with.
    keyed: bool = False

    @property
    def left_unrecorded(self) -> bool:
        """Whether its request has not noted every item recorded and the outbox sweep sent
        none: a request still recording it, or one that died part-way, which a replay may
        complete until the batch is refused (`incomplete_batch_held_until`)."""
        return self.state == BatchState.ACCEPTING and self.recorded is False and not self.swept

    def item_retention(self, retention: timedelta) -> timedelta:
        """The retention to record this batch's items with: `retention`, but never past the
        record's own expiry, which the outbox sweep takes an item's insert-time expiry for
        (`_record_cannot_have_expired`): a replay's items recorded under a retention raised
        since outlived their record, and were written off once it had expired."""
        if self.expires_at is None:
            return retention
        return max(timedelta(0), min(retention, self.expires_at - self.created_at))


class Batches:
    """Repository of batch records; every database failure surfaces as `DatabaseUnavailable`."""

    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._collection: AsyncCollection[Document] = client[database]["batches"]
        self._writes = GroupWriter(self._collection)

    async def ensure_indexes(self) -> None:
        await self._collection.create_index(
            [("tenant_id", ASCENDING), ("idempotency_key", ASCENDING)],
            unique=True,
            partialFilterExpression={"idempotency_key": {"$type": "string"}},
            name="idempotency_key_per_tenant",
        )
        await self._collection.create_index([("expires_at", ASCENDING)], expireAfterSeconds=0)
        await self._collection.create_index(
            [(HOLD_CHECK_AT, ASCENDING)], sparse=True, name="batch_hold_check"
        )
        await self._collection.create_index(
            [("tenant_id", ASCENDING), *NEWEST_FIRST.items()], name=NEWEST_BATCHES
        )

    async def insert(
        self,
        record: BatchRecord,
        *,
        idempotency_key: str | None,
        retention: timedelta,
        unrecorded_look_at: datetime | None = None,
    ) -> None:
        """Record a new batch as `accepting`; `KeyTaken` for a used idempotency key. Its
        expiry look (`hold_unsent_batches`) comes at `unrecorded_look_at` (the end of the
        wait for a replay of a request that died before recording every item), unless its
        request notes every item recorded (`mark_recorded`), which moves the look to its
        usual time."""
        look_at = usual_hold_check(record.created_at, retention)
        if unrecorded_look_at is not None:
            look_at = min(look_at, unrecorded_look_at)
        document: Document = {
            "_id": record.batch_id,
            "tenant_id": record.tenant_id,
            "state": record.state,
            "request_hash": record.request_hash,
            "created_at": record.created_at,
            "expires_at": record.created_at + retention,
            HOLD_CHECK_AT: look_at,
            "members": [
                {"task_id": member.task_id, "client_id": member.client_id}
                for member in record.members
            ],
            RECORDED: False,
        }
        if idempotency_key is not None:
            document["idempotency_key"] = idempotency_key
        try:
            await self._collection.insert_one(document)
        except DuplicateKeyError as error:
            raise KeyTaken(idempotency_key) from error
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def mark_accepted(self, batch_id: str) -> bool:
        """Accept the batch; False when it was written off (a tombstone is never accepted)."""
        try:
            result = await self._collection.update_one(
                {"_id": batch_id, "state": {"$in": [BatchState.ACCEPTING, BatchState.ACCEPTED]}},
                {"$set": {"state": BatchState.ACCEPTED}},
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return result.matched_count == 1

    async def mark_recorded(self, batch_id: str, *, look_at: datetime) -> str | None:
        """Note that the batch's request recorded every item, its expiry look moved to
        `look_at` (its usual time, never earlier: `insert`); the batch's state then, None
        when the outbox sweep refused it meanwhile as left incomplete (`abandon_unrecorded`).
        A batch a replay of the request accepted meanwhile (`_complete_interrupted`) is
        noted too, and answers `accepted` (refused instead, its items were tombstoned under
        a batch answered 200; a review)."""
        try:
            found = await self._collection.find_one_and_update(
                {"_id": batch_id, "state": {"$in": [BatchState.ACCEPTING, BatchState.ACCEPTED]}},
                {"$set": {RECORDED: True}, "$max": {HOLD_CHECK_AT: look_at}},
                projection={"state": 1},
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return None if found is None else str(found["state"])

    async def abandon_unrecorded(self, batch_id: str, *, now: datetime) -> bool:
        """Turn a batch whose request died before recording every item into a tombstone,
        its key freed; False when it was recorded whole, accepted (a replay completed it) or
        swept meanwhile: it stays."""
        try:
            result = await self._collection.update_one(
                {
                    "_id": batch_id,
                    "state": BatchState.ACCEPTING,
                    SWEPT: {"$ne": True},
                    RECORDED: False,
                },
                {
                    "$set": {"state": BatchState.ABANDONED, "expires_at": now + TOMBSTONE_TTL},
                    "$unset": {"idempotency_key": "", "members": "", HOLD_CHECK_AT: ""},
                },
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return result.modified_count == 1

    async def discard(self, batch_id: str) -> bool:
        """Delete a refused batch's record while it is `accepting` and the outbox sweep has
        sent none of its items (`outlive_sends`); False otherwise (a replay of its request
        accepted it meanwhile, or its items are being scored: it stays, and so do its
        submissions)."""
        try:
            result = await self._collection.delete_one(
                {"_id": batch_id, "state": BatchState.ACCEPTING, SWEPT: {"$ne": True}}
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return result.deleted_count == 1

    async def abandon(self, batch_id: str, *, now: datetime) -> bool:
        """Turn a refused batch's record into a tombstone, whether or not its insert landed
        yet (`services/gateway/refusals.py`): the idempotency key is freed. False when the
        batch was accepted after all (a replay of its request completed it, or the outbox
        sweep sent its items): it stays."""
        try:
            return await self._writes.guarded_upsert(
                {
                    "_id": batch_id,
                    "state": {"$in": [BatchState.ACCEPTING, BatchState.ABANDONED]},
                    SWEPT: {"$ne": True},
                },
                {
                    "$set": {"state": BatchState.ABANDONED},
                    "$unset": {"idempotency_key": "", "members": "", HOLD_CHECK_AT: ""},
                    "$setOnInsert": {"created_at": now, "expires_at": now + TOMBSTONE_TTL},
                },
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def refused(self, batch_id: str) -> bool:
        """Whether the batch was refused after all: a tombstone, or discarded (no record)."""
        try:
            kept = await self._collection.find_one(
                {"_id": batch_id, "state": {"$ne": BatchState.ABANDONED}}, projection={"_id": 1}
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return kept is None

    async def due_for_hold_check(self, *, now: datetime, limit: int) -> list[BatchRecord]:
        """Batches whose expiry comes within their hold lead and that may still have items to
        send, the most urgent first (`hold_unsent_batches`). One read on `batch_hold_check`;
        members are not read."""
        try:
            cursor = (
                self._collection.find({HOLD_CHECK_AT: {"$lte": now}}, projection={"members": 0})
                .sort(HOLD_CHECK_AT, ASCENDING)
                .limit(limit)
            )
            return [_record_of(document, members=()) async for document in cursor]
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def hold(self, batch_ids: Sequence[str], *, now: datetime, retention: timedelta) -> None:
        """Let these batches live `retention` from now (never less than they had), and look at
        them again their hold lead before that."""
        if not batch_ids:
            return
        try:
            await self._collection.update_many(
                {"_id": {"$in": list(batch_ids)}, HOLD_CHECK_AT: {"$exists": True}},
                {
                    "$max": {"expires_at": now + retention},
                    "$set": {HOLD_CHECK_AT: now + retention - hold_lead(retention)},
                },
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def hold_for_replay(
        self, batch_id: str, *, until: datetime, retention: timedelta
    ) -> None:
        """A batch waiting for a replay of its request until `until`: looked at again then,
        and kept at least its hold lead past it."""
        try:
            await self._collection.update_one(
                {"_id": batch_id, HOLD_CHECK_AT: {"$exists": True}},
                {
                    "$set": {HOLD_CHECK_AT: until},
                    "$max": {"expires_at": until + hold_lead(retention)},
                },
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def outlive_sends(
        self, batch_ids: Sequence[str], *, sent_at: datetime, retention: timedelta
    ) -> None:
        """The outbox sweep sends items of these batches by `sent_at` (written before a
        chunk's sends, `sent_at` a little ahead): let each live at least `retention` from
        then, as those items do (`$max`, never shortened), with its look its hold lead before
        that. One write for all of them (a chunk of the sweep's sends).
        Without it, a batch whose last items the sweep sent just before its look was settled
        there and expired about an hour after the send, its items perhaps still queued behind
        the outage's backlog: 404 reads, and a free key (a replay scored every item twice).
        A batch already settled gets a look again (`$max` on a missing field sets it), which
        settles it once more if it has nothing left to send; tombstones are left alone.
        Each is marked `swept` too: a refusal of it still running elsewhere (its request
        outlasted the grace) then keeps it, and its items, rather than deleting the record
        of items being scored and freeing the key for a replay that scored them twice
        (found in review). Its state stays `accepting`: a replay still completes it
        (`_complete_interrupted`) should its first request have died before recording
        every item."""
        if not batch_ids:
            return
        expires_at = sent_at + retention
        try:
            await self._collection.update_many(
                {
                    "_id": {"$in": list(batch_ids)},
                    "state": {"$in": [BatchState.ACCEPTING, BatchState.ACCEPTED]},
                },
                {
                    "$max": {
                        "expires_at": expires_at,
                        HOLD_CHECK_AT: expires_at - hold_lead(retention),
                    },
                    "$set": {SWEPT: True},
                },
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def states(self, batch_ids: Sequence[str]) -> dict[str, str]:
        """The state of each of these batches that has a record (a tombstone's included): one
        `$in` read on `_id`, states only. The outbox sweep writes off the unsent items of a
        batch that was refused (`sweep_outbox`)."""
        if not batch_ids:
            return {}
        try:
            cursor = self._collection.find(
                {"_id": {"$in": list(batch_ids)}}, projection={"state": 1}
            )
            return {document["_id"]: document["state"] async for document in cursor}
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def unsent_sizes(self, batch_ids: Sequence[str]) -> dict[str, BatchSize]:
        """How many items each of these batches holds, and when it was made, for those still
        `accepting`, not noted recorded whole (`RECORDED`), none of whose items the outbox
        sweep has sent: the ones whose request may have died before it recorded them all
        (`sweep_outbox`). One `$in` read on `_id`."""
        if not batch_ids:
            return {}
        pipeline: list[Document] = [
            {
                "$match": {
                    "_id": {"$in": list(batch_ids)},
                    "state": BatchState.ACCEPTING,
                    SWEPT: {"$ne": True},
                    RECORDED: False,
                }
            },
            {"$project": {"created_at": 1, "items": {"$size": {"$ifNull": ["$members", []]}}}},
        ]
        try:
            cursor = await self._collection.aggregate(pipeline)
            return {
                document["_id"]: BatchSize(document["items"], document["created_at"])
                async for document in cursor
            }
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def settle(self, batch_ids: Sequence[str]) -> None:
        """These batches have every item sent: they expire when their record says."""
        if not batch_ids:
            return
        try:
            await self._collection.update_many(
                {"_id": {"$in": list(batch_ids)}}, {"$unset": {HOLD_CHECK_AT: ""}}
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def newest(
        self, tenant_id: str, *, now: datetime, after: ListPosition | None, limit: int
    ) -> list[ListedBatch]:
        """Up to `limit` of a tenant's batches, newest first, past `after` (the last one a
        page listed): one read on `batches_by_tenant_newest`, each batch's item count taken
        by the database (a batch holds up to 1,000 members, none of which is sent here)."""
        pipeline: list[Document] = [
            {"$match": newest_batches_query(tenant_id, now=now, after=after)},
            {"$sort": NEWEST_FIRST},
            {"$limit": limit},
            {"$project": {"created_at": 1, "total": {"$size": "$members"}}},
        ]
        try:
            cursor = await self._collection.aggregate(pipeline)
            return [
                ListedBatch(document["_id"], document["created_at"], document["total"])
                async for document in cursor
            ]
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def find(self, batch_id: str, *, tenant_id: str) -> BatchRecord | None:
        return await self._find_one({"_id": batch_id, "tenant_id": tenant_id})

    async def find_by_key(self, idempotency_key: str, *, tenant_id: str) -> BatchRecord | None:
        return await self._find_one(
            {"tenant_id": tenant_id, "idempotency_key": string_key(idempotency_key)}
        )

    async def _find_one(self, query: Document) -> BatchRecord | None:
        try:
            document = await self._collection.find_one(
                {**query, "state": {"$ne": BatchState.ABANDONED}}
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        if document is None:
            return None
        return _record_of(
            document,
            members=tuple(
                BatchMember(task_id=member["task_id"], client_id=member.get("client_id"))
                for member in document["members"]
            ),
        )


@dataclass(frozen=True)
class ListPosition:
    """Where a page of a tenant's batches ended: its last batch's creation time and id."""

    created_at: datetime
    batch_id: str


@dataclass(frozen=True)
class ListedBatch:
    batch_id: str
    created_at: datetime
    total: int  # its items

    @property
    def position(self) -> ListPosition:
        return ListPosition(self.created_at, self.batch_id)


def newest_batches_query(tenant_id: str, *, now: datetime, after: ListPosition | None) -> Document:
    """The batches of a tenant a listing shows, past `after` in its order (`NEWEST_FIRST`):
    tombstones and batches past their expiry (which the TTL monitor may not have removed
    yet) left out; a batch still being accepted is in."""
    query: Document = {
        "tenant_id": tenant_id,
        "state": {"$ne": BatchState.ABANDONED},
        "expires_at": {"$gt": now},
    }
    if after is not None:
        query["$or"] = [
            {"created_at": {"$lt": after.created_at}},
            {"created_at": after.created_at, "_id": {"$lt": after.batch_id}},
        ]
    return query


def _record_of(document: Document, *, members: tuple[BatchMember, ...]) -> BatchRecord:
    return BatchRecord(
        batch_id=document["_id"],
        tenant_id=document["tenant_id"],
        state=document["state"],
        request_hash=document["request_hash"],
        created_at=document["created_at"],
        members=members,
        expires_at=document.get("expires_at"),
        recorded=document.get(RECORDED),
        swept=document.get(SWEPT) is True,
        keyed="idempotency_key" in document,
    )


def hold_lead(retention: timedelta) -> timedelta:
    """How long before a batch's expiry the sweep looks whether it must be held."""
    return min(HOLD_LEAD, retention / 2)


def usual_hold_check(created_at: datetime, retention: timedelta) -> datetime:
    """When the expiry look of a batch created at `created_at` comes, its request having
    recorded every item: its hold lead before its expiry."""
    return created_at + retention - hold_lead(retention)


# --- Accepting a batch ---------------------------------------------------------------------------


class BatchPublisher(Protocol):
    async def send_many(self, commands: Sequence[ScoreText]) -> bool: ...
    async def withdraw(self, commands: Sequence[ScoreText]) -> None: ...


@dataclass(frozen=True)
class BatchPolicy:
    max_attempts: int
    retention: timedelta
    # A batch still `accepting` after this long was interrupted; the outbox sweep sends it.
    in_progress_for: timedelta
    default_model: str = ""  # what scores an item naming no model (its cache key)


@dataclass(frozen=True)
class BatchSubmitted:
    record: BatchRecord
    created: bool  # False: an earlier request with the same Idempotency-Key


async def submit_batch(
    submission: BatchSubmission,
    *,
    tenant_id: str,
    api_key_id: str | None,
    idempotency_key: str | None,
    batches: Batches,
    submissions: Submissions,
    publisher: BatchPublisher,
    policy: BatchPolicy,
    clock: Clock,
    refusals: Refusals,
    in_flight: InFlightGate | None = None,
) -> BatchSubmitted:
    """Record the batch, publish all its commands in one confirm round, answer once confirmed.

    A refused batch (429, 503) keeps nothing; what cannot be removed at once is written off
    later (`refusals`)."""
    now = clock()
    batch_id = new_id()
    gate = counting(in_flight)
    commands = _commands(
        submission,
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        batch_id=batch_id,
        task_ids=[new_id() for _ in submission.items],
        submitted_at=now,
        max_attempts=policy.max_attempts,
    )
    record = BatchRecord(
        batch_id=batch_id,
        tenant_id=tenant_id,
        state=BatchState.ACCEPTING,
        request_hash=request_hash(submission.model_dump(mode="json")),
        created_at=now,
        members=tuple(
            BatchMember(command.task_id, item.client_id)
            for command, item in zip(commands, submission.items, strict=True)
        ),
    )
    refusal = Refusal(tenant_id, tuple(c.task_id for c in commands), batch_id=batch_id)
    await refuse_before_recording(
        gate,
        tenant_id,
        len(commands),
        idempotency_key=idempotency_key,
        earlier=lambda key: batches.find_by_key(key, tenant_id=tenant_id),
    )
    try:
        await batches.insert(
            record,
            idempotency_key=idempotency_key,
            retention=policy.retention,
            unrecorded_look_at=incomplete_batch_held_until(now, grace=policy.in_progress_for),
        )
    except KeyTaken:
        assert idempotency_key is not None
        earlier = await _earlier_batch(idempotency_key, record, batches, policy, now)
        if earlier.state == BatchState.ACCEPTING:
            await _complete_interrupted(
                earlier,
                submission,
                api_key_id,
                idempotency_key=idempotency_key,
                batches=batches,
                submissions=submissions,
                policy=policy,
                refusals=refusals,
                now=now,
            )
        return BatchSubmitted(earlier, created=False)
    except DatabaseUnavailable as error:
        if may_have_been_written(error):
            refusals.note(replace(refusal, task_ids=()))  # its insert may land yet
        raise
    # The sweep of this process keeps off the items while their request runs here: it sends
    # what an interrupted request left, and this one may yet refuse what it recorded
    # (withdrawing, releasing and deleting take round trips that may outlast its grace).
    with refusals.holding(refusal.task_ids):
        return await _record_and_send(
            record,
            commands,
            submission,
            batches=batches,
            submissions=submissions,
            publisher=publisher,
            policy=policy,
            refusal=refusal,
            refusals=refusals,
            gate=gate,
            clock=clock,
        )


async def _record_and_send(
    record: BatchRecord,
    commands: Sequence[ScoreText],
    submission: BatchSubmission,
    *,
    batches: Batches,
    submissions: Submissions,
    publisher: BatchPublisher,
    policy: BatchPolicy,
    refusal: Refusal,
    refusals: Refusals,
    gate: InFlightGate | None,
    clock: Clock,
) -> BatchSubmitted:
    """Record the items of a batch whose record is in, send them, and mark them accepted; a
    refusal undoes what was recorded (what the database does not take now is written off)."""
    batch_id, tenant_id = record.batch_id, record.tenant_id
    try:
        await submissions.insert_batch(
            _rows(commands, submission, policy.default_model),
            retention=policy.retention,
            counted=gate is not None,
        )
        state = await batches.mark_recorded(
            batch_id, look_at=usual_hold_check(record.created_at, policy.retention)
        )
    except DatabaseUnavailable:
        # Some of its submissions may be recorded (earlier chunks), now or later.
        refusals.note(refusal)
        raise
    if state is None:
        await _refused_as_interrupted(
            refusal, submissions=submissions, refusals=refusals, now=clock()
        )
    if state == BatchState.ACCEPTED:
        return await _accepted_by_a_replay(record, refusal, submissions=submissions)
    counted = False  # from the first acquire on, slots may be counted: release them on failure
    try:
        if gate is not None:
            counted = True
            await gate.acquire(tenant_id, len(commands))
        confirmed = await _send_or_withdraw(publisher, commands)
    except LimitExceeded:
        await _discard(refusal, batches=batches, submissions=submissions, refusals=refusals)
        raise
    except (BrokerUnavailable, DatabaseUnavailable) as error:
        if isinstance(error, DatabaseUnavailable) and not may_have_been_written(error):
            counted = False  # the acquire was never sent: no slot to give back
        await _give_up(
            replace(refusal, counted=counted),
            batches=batches,
            submissions=submissions,
            in_flight=gate,
            refusals=refusals,
        )
        raise
    try:
        if confirmed:
            await submissions.mark_batch_accepted(batch_id, [c.task_id for c in commands])
        else:
            # Some commands may be queued, not all are known to be: the outbox sweep sends
            # each again (the scorer claims each task once).
            log.warning("batch %s partly unconfirmed; the outbox sweep re-sends it", batch_id)
            await submissions.mark_batch_unconfirmed(batch_id)
        await batches.mark_accepted(batch_id)
    except DatabaseUnavailable:
        log.warning("batch %s left `accepting`; the outbox sweep re-sends it", batch_id)
    return BatchSubmitted(record, created=True)


async def _accepted_by_a_replay(
    record: BatchRecord, refusal: Refusal, *, submissions: Submissions
) -> BatchSubmitted:
    """A request so slow that its client's replay completed and accepted its batch meanwhile
    (`_complete_interrupted`): answered as the replay was, the earlier batch, whose items
    the outbox sweep sends. It counts nothing: the items the replay recorded carry no
    in-flight mark, so slots taken for them were never released (a review); the marks of
    its own items go too, as `_discard` does for a batch a replay kept."""
    log.warning("batch %s was accepted by a replay while its request recorded it", record.batch_id)
    try:
        await submissions.uncount(refusal.task_ids)
    except DatabaseUnavailable:
        # Its outcomes then release slots never taken: the count errs low, never holds one.
        log.warning("batch %s: in-flight marks left; the count may err low", record.batch_id)
    return BatchSubmitted(record, created=False)


async def _refused_as_interrupted(
    refusal: Refusal, *, submissions: Submissions, refusals: Refusals, now: datetime
) -> NoReturn:
    """A request that recorded its batch's items so slowly that the outbox sweep took it for
    dead and refused the batch (`sweep_outbox`): its items go too, nothing was kept."""
    log.warning("batch %s was refused while its request recorded it", refusal.batch_id)
    try:
        await submissions.abandon(refusal.task_ids, now=now)
    except DatabaseUnavailable:
        refusals.note(refusal)
    raise DatabaseUnavailable(f"batch {refusal.batch_id} was refused; nothing was kept")


async def _send_or_withdraw(publisher: BatchPublisher, commands: Sequence[ScoreText]) -> bool:
    try:
        return await publisher.send_many(commands)
    except BrokerUnavailable:
        await publisher.withdraw(commands)
        raise


async def _give_up(
    refusal: Refusal,
    *,
    batches: Batches,
    submissions: Submissions,
    in_flight: InFlightGate | None,
    refusals: Refusals,
) -> None:
    """Undo a batch's acceptance: release its slots, then forget it. What the database does
    not take now is written off later (`services/gateway/refusals.py`); meanwhile the sweep
    keeps off its items (held by `submit_batch` while it runs, by the refusal after)."""
    if refusal.counted and in_flight is not None:
        try:
            await release_slots(refusal, in_flight)
        except DatabaseUnavailable:
            log.warning("batch %s: slots not released; written off later", refusal.batch_id)
            refusals.note(refusal)  # with what was released: not released again
            return
    await _discard(refusal, batches=batches, submissions=submissions, refusals=refusals)


async def _discard(
    refusal: Refusal, *, batches: Batches, submissions: Submissions, refusals: Refusals
) -> None:
    """Forget a refused batch whose records are all written (nothing counted any more).

    The batch goes first, as in `write_off`: releasing a large batch's slots may outlast the
    outbox grace period, and a replay of its request (on another replica, say) may have
    completed and accepted it meanwhile, answering 200; its submissions then stay, to be sent.
    Deleting them first left a batch answered 200 whose items were never scored. Both callers
    come after the batch's insert was acknowledged, and only this refusal would make it a
    tombstone: a record not deleted here is one a replay accepted, never one whose insert
    is yet to land. A process that dies between the two deletes leaves its items
    `accepting` without a batch (the refusal was in memory only): the outbox sweep writes
    such items off instead of sending them (`sweep_outbox`), since the client, told
    nothing, may retry with its key, which now creates the batch again."""
    assert refusal.batch_id is not None
    try:
        if not await batches.discard(refusal.batch_id):
            log.warning(
                "batch %s kept: accepted by a replay, or sent by the outbox sweep, meanwhile",
                refusal.batch_id,
            )
            # Its items are scored, and each outcome would release a slot this refusal has
            # released, or never took (a 429, an acquire never sent).
            await submissions.uncount(refusal.task_ids)
            return
        await submissions.discard_batch(refusal.batch_id)
    except DatabaseUnavailable:
        log.warning("batch %s not discarded; written off later", refusal.batch_id)
        refusals.note(replace(refusal, counted=False))


def _commands(
    submission: BatchSubmission,
    *,
    tenant_id: str,
    api_key_id: str | None,
    batch_id: str,
    task_ids: Sequence[str],
    submitted_at: datetime,
    max_attempts: int,
) -> list[ScoreText]:
    """One command per item, in the request's order, the batch's defaults applied."""
    return [
        ScoreText(
            task_id=task_id,
            tenant_id=tenant_id,
            text=item.text,
            # A blank rubric names none, as the scorer reads it: the batch's applies.
            rubric=named_rubric(item.rubric) or named_rubric(submission.rubric),
            model=item.model if item.model is not None else submission.model,
            metadata=item.metadata,
            max_attempts=max_attempts,
            submitted_at=submitted_at,
            occurred_at=submitted_at,
            api_key_id=api_key_id,
            batch_id=batch_id,
            batch_index=index,
        )
        for index, (task_id, item) in enumerate(zip(task_ids, submission.items, strict=True))
    ]


def _rows(
    commands: Sequence[ScoreText], submission: BatchSubmission, default_model: str
) -> list[BatchRow]:
    """What `Submissions.insert_batch` records of each command."""
    return [
        _row(command, request_hash(item.model_dump(mode="json")), default_model)
        for command, item in zip(commands, submission.items, strict=True)
    ]


def _row(command: ScoreText, digest: str, default_model: str) -> BatchRow:
    model = scoring_model(command.model, default_model)
    return command, digest, cache_key(command.text, command.rubric, model), model


async def _earlier_batch(
    idempotency_key: str, attempt: BatchRecord, batches: Batches, policy: BatchPolicy, now: datetime
) -> BatchRecord:
    try:
        earlier = await batches.find_by_key(idempotency_key, tenant_id=attempt.tenant_id)
    except DatabaseUnavailable as error:
        raise ReplayUnfinished(idempotency_key) from error  # the key names a batch: kept
    if earlier is None:
        raise RequestInProgress(idempotency_key)  # discarded just now: the client may retry
    # Another body first: a misused key is told so at once, not "retry shortly" for as long
    # as the first request runs (found in review).
    if earlier.request_hash != attempt.request_hash:
        raise IdempotencyConflict(idempotency_key)
    in_progress = earlier.state == BatchState.ACCEPTING
    until = earlier.created_at + policy.in_progress_for
    if in_progress and until > now:
        retry_after_s = in_progress_retry_after(earlier.created_at, until=until, now=now)
        raise RequestInProgress(idempotency_key, retry_after_s=retry_after_s)
    return earlier


async def _complete_interrupted(
    earlier: BatchRecord,
    submission: BatchSubmission,
    api_key_id: str | None,
    *,
    idempotency_key: str,
    batches: Batches,
    submissions: Submissions,
    policy: BatchPolicy,
    refusals: Refusals,
    now: datetime,
) -> None:
    """Finish recording a batch whose request stopped part-way (its process died) before a
    replay answers it as accepted: the process may have died before it recorded every
    submission, and a task without one would never be sent. The replay carries the same
    items (its request hash is the batch's), so the missing submissions are recorded from it
    under the batch's task ids, dated as the batch so that the next outbox sweep sends them
    with those already recorded. They are not counted in flight: no slot was taken for them.

    The batch is the first request's, which may have been answered 202 and sent (only its
    marks lost): a replay the database fails is answered `ReplayUnfinished` (retry with the
    same key) and leaves the batch as it is, for the outbox sweep or a later replay. What it
    may have recorded is written off only if the batch's own request refused it; a replay
    whose only write was never sent (no server selected) recorded nothing, and notes nothing.
    """
    commands = _commands(
        submission,
        tenant_id=earlier.tenant_id,
        api_key_id=api_key_id,
        batch_id=earlier.batch_id,
        task_ids=[member.task_id for member in earlier.members],
        submitted_at=earlier.created_at,
        max_attempts=policy.max_attempts,
    )
    task_ids = tuple(command.task_id for command in commands)
    refusal = Refusal(earlier.tenant_id, task_ids, batch_id=earlier.batch_id, owns_batch=False)
    recorded = False  # whether its submissions' insert completed
    # The sweep of this process keeps off the items while the replay runs, as it does for a
    # first request (`_record_and_send`): recorded dated as the batch, they are due for it at
    # once, and a sweep between the insert and the mark sent them though the batch's
    # write-off then had the replay answer 503 "nothing was kept".
    with refusals.holding(task_ids):
        try:
            await submissions.insert_batch(
                _rows(commands, submission, policy.default_model),
                retention=earlier.item_retention(policy.retention),
            )
            recorded = True
            accepted = await batches.mark_accepted(earlier.batch_id)
        except DatabaseUnavailable as error:
            # Not a refusal of the batch: its request may have been answered 202 and sent.
            # What this replay recorded is written off only if that request refused the
            # batch after all (its write-off may be pending); otherwise the outbox sweep
            # sends it. An insert in one chunk that was never sent recorded nothing, now or
            # later: nothing to note. One in several chunks may have recorded earlier chunks
            # before a later one failed.
            log.warning(
                "batch %s: its replay failed on the database; left as it was", earlier.batch_id
            )
            if recorded or len(commands) > BATCH_WRITE_CHUNK or may_have_been_written(error):
                refusals.note(refusal)
            raise ReplayUnfinished(idempotency_key) from error
        if not accepted:
            # Its refusal was written off meanwhile, without knowing of the submissions
            # recorded here (a refusal whose batch insert timed out names none): they are
            # forgotten too, or the outbox sweep would send what the client is told was not
            # kept.
            try:
                await submissions.abandon(task_ids, now=now)
            except DatabaseUnavailable:
                refusals.note(refusal)
            raise DatabaseUnavailable(f"batch {earlier.batch_id} was refused; nothing was kept")
    log.warning("batch %s was interrupted; its replay completed its records", earlier.batch_id)


# --- Reading a batch -----------------------------------------------------------------------------


class BatchStatusReader(Protocol):
    async def batch(
        self, batch_id: str, *, tenant_id: str, after: int, limit: int
    ) -> BatchProgress: ...


class UnsentItems(Protocol):
    """Which of a batch's tasks are not sent yet, or were sent by the outbox sweep at
    `sent_since` or later (`Submissions.unsent_in_batch`)."""

    async def unsent_in_batch(self, batch_id: str, *, sent_since: datetime) -> frozenset[str]: ...


@dataclass(frozen=True)
class BatchPageItem:
    index: int
    client_id: str | None
    task_id: str
    status: str
    attempts: int = 0
    result: ScoreResult | None = None
    error: TaskFailure | None = None


class Acceptance:
    """Where a batch stands as a whole (`acceptance_of`)."""

    ACCEPTED = "accepted"
    # Its request may still be recording or sending its items.
    ACCEPTING = "accepting"
    # Its request died before recording every item: a replay with its Idempotency-Key may
    # complete it until `refused_at`; then it is refused whole, none of its items scored.
    INCOMPLETE = "incomplete"


@dataclass(frozen=True)
class BatchPage:
    batch_id: str
    total: int
    created_at: datetime
    counts: dict[str, int]
    items: list[BatchPageItem]
    next_cursor: int | None
    acceptance: str = Acceptance.ACCEPTED
    refused_at: datetime | None = None  # an `incomplete` batch's, unless a replay completes it


def acceptance_of(
    record: BatchRecord, *, now: datetime, grace: timedelta
) -> tuple[str, datetime | None]:
    """Where the batch stands as a whole, and when an incomplete one is refused. Its items
    read `queued` in each case: a batch its request died in read as a thousand tasks queued
    for ten minutes, then was gone, none of them scored (a walkthrough)."""
    if record.state != BatchState.ACCEPTING or record.swept:
        return Acceptance.ACCEPTED, None
    if now - record.created_at <= grace:
        return Acceptance.ACCEPTING, None
    if record.left_unrecorded:
        return Acceptance.INCOMPLETE, incomplete_batch_held_until(record.created_at, grace=grace)
    return Acceptance.ACCEPTED, None  # recorded whole: the outbox sweep sends what is unsent


async def read_batch(
    batch_id: str,
    *,
    tenant_id: str,
    start: int,
    limit: int,
    batches: Batches,
    status: BatchStatusReader,
    submissions: UnsentItems,
    clock: Clock,
    window: timedelta,
    grace: timedelta,
) -> BatchPage | None:
    """Counts per status and the items `start`..`start+limit` of a tenant's batch.

    Items the status service has not heard of read `queued` while the batch is young
    (read-your-writes), and later too while their submissions are not sent yet (`accepting`
    or `unconfirmed`: a broker alarm, a crashed gateway, the outbox sweep to come) or the
    sweep sent them within the window (the status service may read their copies behind an
    alarm's backlog), as a single task does (`recently_due`); the others read `expired`. An
    item not sent yet, or just sent, read `expired` once the batch was older than the window,
    and a client resubmitting it had it scored twice. So do all of them while the batch is
    held for a replay of its request, which died before recording every item
    (`held_for_replay`): its items never recorded read `expired`, as if scored, from the
    window's end to its refusal (a review)."""
    record = await batches.find(batch_id, tenant_id=tenant_id)
    if record is None:
        return None
    total = len(record.members)
    end = min(start + limit, total)
    progress = await status.batch(batch_id, tenant_id=tenant_id, after=start - 1, limit=limit)
    known: dict[int, BatchItemProgress] = {
        item.batch_index: item for item in progress.items if start <= item.batch_index < end
    }
    unheard = max(total - sum(progress.counts.values()), 0)
    page = record.members[start:end]
    not_heard = [
        member for index, member in enumerate(page, start) if not _heard(member, known.get(index))
    ]
    now = clock()
    since = now - window
    young = record.created_at >= since or held_for_replay(record, now=now, grace=grace)
    # Read after the status service answered: an item the sweep sends in between is in it.
    pending: frozenset[str] = frozenset()
    if not young and (unheard or not_heard):
        pending = await submissions.unsent_in_batch(batch_id, sent_since=since)
    counts = {state.value: progress.counts.get(state, 0) for state in TaskStatus}
    waiting = unheard if young else _waiting(page, not_heard, unheard=unheard, pending=pending)
    counts[TaskStatus.QUEUED.value] += waiting
    counts[EXPIRED] = unheard - waiting
    items = []
    for index, member in enumerate(page, start):
        unheard_as = TaskStatus.QUEUED.value if young or member.task_id in pending else EXPIRED
        items.append(_page_item(index, member, known.get(index), unheard_as))
    acceptance, refused_at = acceptance_of(record, now=now, grace=grace)
    return BatchPage(
        batch_id=batch_id,
        total=total,
        created_at=record.created_at,
        counts=counts,
        items=items,
        next_cursor=end if end < total else None,
        acceptance=acceptance,
        refused_at=refused_at,
    )


def held_for_replay(record: BatchRecord, *, now: datetime, grace: timedelta) -> bool:
    """Whether the batch's request has not noted every item recorded and a replay of it may
    still complete it (the outbox sweep and the expiry look refuse it after that)."""
    return record.left_unrecorded and now < incomplete_batch_held_until(
        record.created_at, grace=grace
    )


def _waiting(
    page: Sequence[BatchMember],
    not_heard: Sequence[BatchMember],
    *,
    unheard: int,
    pending: frozenset[str],
) -> int:
    """How many of an old batch's `unheard` tasks are `pending` (not sent yet, or just sent),
    given the `page`'s tasks the status service has `not_heard` of: exact on the page; past
    it, the status service's counts do not say which tasks it heard of, and a pending one may
    be among them (a command written whose confirm was lost), so the count errs towards
    `queued`, which tells no client to resubmit."""
    here = {member.task_id for member in page}
    waiting_here = sum(member.task_id in pending for member in not_heard)
    unheard_elsewhere = max(unheard - len(not_heard), 0)
    return min(waiting_here + min(unheard_elsewhere, len(pending - here)), unheard)


def _heard(member: BatchMember, progress: BatchItemProgress | None) -> bool:
    return progress is not None and progress.task_id == member.task_id


def _page_item(
    index: int, member: BatchMember, progress: BatchItemProgress | None, unheard: str
) -> BatchPageItem:
    if progress is None or not _heard(member, progress):
        return BatchPageItem(index, member.client_id, member.task_id, unheard)
    return BatchPageItem(
        index=index,
        client_id=member.client_id,
        task_id=member.task_id,
        status=progress.status.value,
        attempts=progress.attempts,
        result=progress.result,
        error=progress.error,
    )
