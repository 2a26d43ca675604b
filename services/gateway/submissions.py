"""The gateway's own records: one submission per task, its idempotency key, its outbox state.

A submission is inserted as `accepting` with the command it will publish, and turns
`accepted` once the broker confirmed the command, or `unconfirmed` when the command was
written but not confirmed (the client is answered 202 all the same: it may be queued). One
still `accepting` after a grace period was interrupted (process died between insert and
publish); the outbox sweep sends it then, and every `unconfirmed` one too (the sweep reads
`state` only). Publishing twice is harmless: the scorer claims each task once. A submission
refused after all turns `abandoned`, a tombstone (`abandon`, `services/gateway/refusals.py`).

The command (and so the text) is kept after acceptance, until the submission expires
(`IDEMPOTENCY_TTL_S` after the task is due), so that the task can be scored again
(`services/gateway/rescore.py`). A submission not sent yet (`accepting`, `unconfirmed`) has no
`expires_at`, so the TTL index never removes it (an outage longer than the retention deleted
accepted tasks before the sweep sent them): the expiry it will have waits in
`expires_once_sent` and becomes its `expires_at` when it leaves those states (sent, or written
off as a tombstone). Records of earlier builds carry `expires_at` while unsent: the sweep keeps
theirs from firing (`interrupted`).
A re-score bumps the submission's `generation` (absent: 0) once per rubric version, recorded
in `rescored_for`; `rescore` describes the latest one and whether its command was sent.
`finished_generation` is the highest generation whose outcome the gateway applied (absent:
none), written with the outcome's other changes (`note_outcome`): a cancellation of a
generation at or below it is refused (`services/gateway/cancels.py`).
`sent_at` is when the outbox sweep sent a submission (absent: sent by its own request, right
after `created_at`, or by an earlier build): the status service may not have heard of the task
for a while after, however old it is (`recently_due`, `unsent_in_batch`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Final

import orjson
from pydantic import TypeAdapter
from pymongo import ASCENDING, AsyncMongoClient, ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, DuplicateKeyError, PyMongoError

from services.gateway.errors import DatabaseUnavailable
from shared.contracts import ScoreResult, ScoreText, utcnow
from shared.group_reads import GroupReader
from shared.group_writes import DUPLICATE_KEY, GroupWriter
from shared.indexes import string_key

Document = dict[str, Any]
# Documents per write of a batch's submissions.
BATCH_WRITE_CHUNK = 200
# How long a tombstone of a refused submission outlives a late insert it must block.
TOMBSTONE_TTL = timedelta(days=1)
# Where an unsent submission keeps the `expires_at` it takes once sent (due + retention): the
# TTL index reads `expires_at` only, so nothing removes the submission while it is unsent.
EXPIRY_ONCE_SENT: Final = "expires_once_sent"
# An unsent record of an earlier build (it carries `expires_at`) expiring within this is held
# for twice as long by each outbox pass: never removed while a sweep runs at least daily, and
# still expiring should a replica of the earlier build mark it sent (it sets `state` only).
LEGACY_UNSENT_HOLD = timedelta(days=1)
# When the outbox sweep sent a submission (`Submission.sent_at`).
SENT_AT: Final = "sent_at"


class SubmissionState(StrEnum):
    ACCEPTING = "accepting"  # recorded; the request has not been answered (or was cut short)
    UNCONFIRMED = "unconfirmed"  # answered 202; its command is not known to be queued
    ACCEPTED = "accepted"
    # Refused after all (`services/gateway/refusals.py`): never sent; kept only so that a late
    # insert of the same task fails on its `_id`.
    ABANDONED = "abandoned"


# What the outbox sweep sends again.
_UNSENT: Final = [SubmissionState.ACCEPTING.value, SubmissionState.UNCONFIRMED.value]
_ABANDONED: Final = SubmissionState.ABANDONED.value
# A tombstone replaces a record that is still (or not yet) `accepting`.
_ABANDONABLE: Final = [SubmissionState.ACCEPTING.value, _ABANDONED]


@dataclass(frozen=True)
class Submission:
    task_id: str
    tenant_id: str
    state: SubmissionState
    request_hash: str
    created_at: datetime
    not_before: datetime | None
    command: ScoreText | None
    # The result a result-cache hit answered with: a poll the status service cannot answer
    # yet shows it too (read-your-writes), not `queued`.
    cached_result: ScoreResult | None = None
    # The latest generation handed out (re-scores, DLQ replays; absent: 0), or that of the
    # command when higher.
    generation: int = 0
    # The highest generation whose outcome (`task.completed` or `task.failed`) the gateway
    # applied (`note_outcome`); None before any. A cancellation of a generation at or below it
    # is refused, whatever the status service says or the scorer still remembers.
    finished_generation: int | None = None
    # The highest generation that completed (`task.completed` applied); None before any. A
    # newer generation over a completion that is the latest outcome is a re-score, which the
    # scorer never cancels (the completion stands).
    completed_generation: int | None = None
    # When the outbox sweep sent it; None when its request did (or an earlier build's sweep).
    sent_at: datetime | None = None
    # While unsent: the expiry it gets once sent, as set at its insert (None once sent, or
    # for an earlier build's record).
    expires_once_sent: datetime | None = None


@dataclass(frozen=True)
class CancelTarget:
    """What a cancellation of a task's latest generation needs of its submission, its text
    left out (`services/gateway/cancels.py`): a batch's are read together (`cancel_targets`),
    up to 1,000 items whose texts can hold 50,000 characters each."""

    task_id: str
    tenant_id: str
    generation: int
    finished_generation: int | None
    answered_from_cache: bool
    submitted_at: datetime
    api_key_id: str | None
    callback_url: str | None
    not_before: datetime | None
    completed_generation: int | None = None

    @classmethod
    def of(cls, submission: Submission) -> CancelTarget:
        """A submission of an earlier build without its command: no key, no callback, and
        submitted when recorded."""
        command = submission.command
        return cls(
            task_id=submission.task_id,
            tenant_id=submission.tenant_id,
            generation=submission.generation,
            finished_generation=submission.finished_generation,
            answered_from_cache=submission.cached_result is not None,
            submitted_at=command.submitted_at if command else submission.created_at,
            api_key_id=command.api_key_id if command else None,
            callback_url=command.callback_url if command else None,
            not_before=submission.not_before,
            completed_generation=submission.completed_generation,
        )


def request_hash(payload: Document) -> str:
    """A stable hash of a validated request (key order does not matter)."""
    return hashlib.sha256(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)).hexdigest()


class KeyTaken(Exception):
    """The tenant's idempotency key already names a submission."""


@dataclass(frozen=True)
class RescoreAnswer:
    """How a claimed re-score is answered, decided once per claim: with a result of the
    result cache (`cached`), or by the scorer (None)."""

    cached: ScoreResult | None = None


# A claim's answer, stored with it (`rescore.answer`).
RESCORE_ANSWER: Final = "rescore.answer"


@dataclass(frozen=True)
class RescoreClaim:
    """A re-score to send: the command as submitted, and the generation to score it as."""

    command: ScoreText
    generation: int
    resumed: bool  # True: claimed earlier, but its command may not have been sent
    request_id: str | None = None  # the request that took the claim
    cache_key: str | None = None  # the submission's result-cache key
    answer: RescoreAnswer | None = None  # decided by an earlier try of the claim


class RescoreRefused(StrEnum):
    """Why a re-score request changes nothing."""

    UNKNOWN_TASK = "unknown_task"  # expired, never existed, or another tenant's
    TEXT_NOT_KEPT = "text_not_kept"  # accepted before texts were kept
    # This rubric version was requested before (or is being sent by another delivery now).
    ALREADY_REQUESTED = "already_requested"


class ReplayRefused(StrEnum):
    """Why a DLQ replay of a dead letter sends nothing."""

    # A generation above the letter's was handed out since, by something other than a
    # replay of this letter (a re-score): the letter is stale.
    SUPERSEDED = "superseded"
    # A re-score's claim above the letter's generation is being sent at this moment (its
    # command not confirmed yet, its request not given up): replayed beside it, the task was
    # scored twice. Kept: once the claim is sent the letter is superseded; given up, the
    # letter replays above it.
    RESCORE_BEING_SENT = "rescore-being-sent"


NO_GENERATION: Final = 0
# The highest generation whose outcome the gateway applied (`Submission.finished_generation`).
FINISHED_GENERATION: Final = "finished_generation"
# The highest generation that completed (`Submission.completed_generation`).
COMPLETED_GENERATION: Final = "completed_generation"
# What `cancel_targets` reads of a submission: the fields of `CancelTarget`, never the text.
CANCEL_FIELDS: Final = {
    "tenant_id": True,
    "generation": True,
    FINISHED_GENERATION: True,
    COMPLETED_GENERATION: True,
    "cached_result": True,
    "created_at": True,
    "not_before": True,
    "command.generation": True,
    "command.submitted_at": True,
    "command.api_key_id": True,
    "command.callback_url": True,
}
# Set on a submission while it counts against its tenant's in-flight limit
# (`services/gateway/limits.py`); removed once its outcome released the slot.
IN_FLIGHT_MARK: Final = "in_flight"
# Submissions uncounted by one write (`Submissions.uncount`).
UNCOUNT_CHUNK: Final = 500
# The model a submission's `cache_key` names, recorded with it (`Owner.cache_model`).
CACHE_MODEL: Final = "cache_model"
# What `Submissions.insert_batch` records of one item: its command, request hash, cache key
# and the model that key names.
type BatchRow = tuple[ScoreText, str, str, str]
LEGACY_IN_FLIGHT_MARKERS: Final = "in_flight_tasks"


@dataclass(frozen=True)
class BatchSize:
    """How many items a batch holds, and when it was made (`Batches.unsent_sizes`)."""

    items: int
    created_at: datetime


@dataclass(frozen=True)
class Owner:
    """What a task's outcome needs of its submission."""

    tenant_id: str
    cache_key: str | None
    counted: bool  # marked as counted in flight, not yet released
    # The model its cache key names (`scoring_model`); None when recorded without it (a
    # submission of an earlier build).
    cache_model: str | None = None


class Submissions:
    """Repository of submissions; every database failure surfaces as `DatabaseUnavailable`."""

    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._collection: AsyncCollection[Document] = client[database]["submissions"]
        # Single-document writes of concurrent requests and events share round trips.
        self._writes = GroupWriter(self._collection)
        self._owners = GroupReader(
            self._collection,
            projection={"tenant_id": 1, "cache_key": 1, CACHE_MODEL: 1, IN_FLIGHT_MARK: 1},
        )

    async def ensure_indexes(self) -> None:
        await self._collection.create_index(
            [("tenant_id", ASCENDING), ("idempotency_key", ASCENDING)],
            unique=True,
            partialFilterExpression={"idempotency_key": {"$type": "string"}},
            name="idempotency_key_per_tenant",
        )
        await self._collection.create_index([("state", ASCENDING), ("created_at", ASCENDING)])
        await self._collection.create_index([("expires_at", ASCENDING)], expireAfterSeconds=0)
        await self._collection.create_index(
            [("batch_id", ASCENDING), ("state", ASCENDING)],
            partialFilterExpression={"batch_id": {"$type": "string"}},
            name="batch_submissions",
        )
        await self._collection.create_index(  # small: only what the outbox sweep sent
            [("batch_id", ASCENDING), (SENT_AT, ASCENDING)],
            partialFilterExpression={"batch_id": {"$type": "string"}, SENT_AT: {"$type": "date"}},
            name="batch_swept",
        )
        await self._adopt_legacy_in_flight_markers()

    async def _adopt_legacy_in_flight_markers(self) -> None:
        """Builds before the mark lived on submissions kept one marker per counted task in
        `in_flight_tasks`: mark those submissions, so that their outcomes still release
        their slots, then drop the collection. Run at start-up; does nothing once done."""
        legacy = self._collection.database[LEGACY_IN_FLIGHT_MARKERS]
        task_ids = [document["_id"] async for document in legacy.find({}, {"_id": 1})]
        for start in range(0, len(task_ids), BATCH_WRITE_CHUNK):
            await self._collection.update_many(
                {"_id": {"$in": task_ids[start : start + BATCH_WRITE_CHUNK]}},
                {"$set": {IN_FLIGHT_MARK: True}},
            )
        if task_ids:
            await legacy.drop()

    async def insert(
        self,
        command: ScoreText,
        *,
        request_hash: str,
        idempotency_key: str | None,
        retention: timedelta,
        cache_key: str,
        cache_model: str | None = None,
        state: SubmissionState = SubmissionState.ACCEPTING,
        counted: bool = False,
        cached_result: ScoreResult | None = None,
    ) -> None:
        """Record a new submission (`accepting` unless told), marked as counted in flight
        when it will be, with the result it is answered with from the result cache;
        `KeyTaken` for a used key. `cache_model` is the model `cache_key` names: only a
        completion by that model fills the cache (`settle_outcome`)."""
        document = _new_document(
            command,
            request_hash=request_hash,
            retention=retention,
            cache_key=cache_key,
            cache_model=cache_model,
        )
        if counted:
            document[IN_FLIGHT_MARK] = True
        if cached_result is not None:
            document["cached_result"] = cached_result.model_dump(mode="json")
        document["state"] = state.value
        if state.value not in _UNSENT:  # recorded as sent (or decided) at once
            document["expires_at"] = document.pop(EXPIRY_ONCE_SENT)
        if idempotency_key is not None:
            document["idempotency_key"] = idempotency_key
        try:
            await self._writes.insert_one(document)
        except DuplicateKeyError as error:
            raise KeyTaken(idempotency_key) from error
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def insert_batch(
        self,
        commands: list[BatchRow],
        *,
        retention: timedelta,
        counted: bool = False,
    ) -> None:
        """Record a batch's submissions, `accepting`, with `insert_many` in chunks (each
        write stays well within `MONGO_TIMEOUT_S`; a failure part-way leaves some recorded,
        which `discard_batch` removes). A task already recorded is left as it is: its id is
        the batch's own, so only a replay completing the interrupted batch wrote it.

        `commands` holds (command, request hash, cache key, the model the key names); every
        command carries `batch_id`.
        With `counted`, each is marked as counted in flight.
        """
        documents = [
            _new_document(
                command, request_hash=digest, retention=retention, cache_key=key, cache_model=model
            )
            for command, digest, key, model in commands
        ]
        if counted:
            for document in documents:
                document[IN_FLIGHT_MARK] = True
        for start in range(0, len(documents), BATCH_WRITE_CHUNK):
            await self._insert_new(documents[start : start + BATCH_WRITE_CHUNK])

    async def _insert_new(self, documents: list[Document]) -> None:
        try:
            await self._collection.insert_many(documents, ordered=False)
        except BulkWriteError as error:
            if not _only_duplicate_ids(error):
                raise DatabaseUnavailable(str(error)) from error
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def mark_batch_accepted(self, batch_id: str, task_ids: list[str]) -> None:
        for start in range(0, len(task_ids), BATCH_WRITE_CHUNK):
            await self._update_many(
                {
                    "_id": {"$in": task_ids[start : start + BATCH_WRITE_CHUNK]},
                    "batch_id": string_key(batch_id),
                    "state": SubmissionState.ACCEPTING.value,
                },
                _sent(None),
            )

    async def mark_batch_unconfirmed(self, batch_id: str) -> None:
        """The batch was answered 202 though not every command was confirmed."""
        await self._update_many(
            {"batch_id": string_key(batch_id), "state": SubmissionState.ACCEPTING.value},
            {"$set": {"state": SubmissionState.UNCONFIRMED.value}},
        )

    async def discard_batch(self, batch_id: str) -> None:
        """Forget a batch's submissions whose commands never reached the broker."""
        try:
            await self._collection.delete_many(
                {"batch_id": string_key(batch_id), "state": SubmissionState.ACCEPTING.value}
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def abandon(self, task_ids: tuple[str, ...], *, now: datetime) -> set[str]:
        """Turn refused submissions into tombstones, whether or not their inserts landed yet
        (`services/gateway/refusals.py`): never sent, idempotency key freed, text dropped.
        One upsert each, through the group writer (its round trips carry up to 500). The
        ids of those kept instead (sent after all, or left to the sweep by a replay)."""
        outcomes = await asyncio.gather(
            *(self._abandon(task_id, now) for task_id in task_ids), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, PyMongoError):
                raise DatabaseUnavailable(str(outcome)) from outcome
            if isinstance(outcome, BaseException):
                raise outcome
        return {task_id for task_id, made in zip(task_ids, outcomes, strict=True) if not made}

    async def _abandon(self, task_id: str, now: datetime) -> bool:
        # False: a record in another state, sent after all, which stays. The guarded upsert
        # tries twice: its insert also collides with the late insert landing at that moment.
        return await self._writes.guarded_upsert(*_tombstone(task_id, now))

    async def mark_accepted(
        self, task_id: str, *, sent_at: datetime | None = None, retention: timedelta | None = None
    ) -> None:
        """The command reached the broker; it stays recorded for re-scoring, and expires
        `retention` after the task was due (its `expires_once_sent` becomes `expires_at`;
        a record marked before, or of an earlier build, keeps the `expires_at` it has).
        The outbox sweep gives `sent_at` and `retention`: a record it sends is kept at least
        `retention` from then; a request, which sends right after it recorded the
        submission, has `created_at` say when."""
        if sent_at is None or retention is None:
            await self._update({"_id": task_id}, _sent(sent_at))
            return
        # Only a record still unsent: one a refusal wrote off (or deleted) after the send
        # stays as the refusal left it, never turned back into `accepted`.
        unsent = {"_id": task_id, "state": {"$in": _UNSENT}}
        try:  # a pipeline, which group commit does not take; the sweep's pace is its own
            await self._collection.update_one(unsent, _swept(sent_at, retention))
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def leave_to_the_sweep(self, task_id: str) -> bool:
        """A submission left `accepting` past the outbox grace, which a replay of its key
        answers as accepted: `unconfirmed` from now, which no refusal's write-off makes a
        tombstone (another replica's may still be pending). False when it is `accepting` no
        more (written off, or sent, meanwhile)."""
        try:
            result = await self._collection.update_one(
                {"_id": task_id, "state": SubmissionState.ACCEPTING.value},
                {"$set": {"state": SubmissionState.UNCONFIRMED.value}},
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return result.matched_count == 1

    async def mark_unconfirmed(self, task_id: str) -> None:
        """The command was written but not confirmed, and the client answered 202: a replay
        of its request is answered as accepted, and the outbox sweep sends it again."""
        await self._update(
            {"_id": task_id, "state": SubmissionState.ACCEPTING.value},
            {"$set": {"state": SubmissionState.UNCONFIRMED.value}},
        )

    async def claim_rescore(
        self,
        task_id: str,
        *,
        tenant_id: str,
        rubric_version: str,
        request_id: str,
        now: datetime,
        may_resume: bool = False,
        generation: int | None = None,
    ) -> RescoreClaim | RescoreRefused:
        """Take the next generation of a submission for `rubric_version`: while `generation`
        (the one the fan-out found completed) is its latest, or, for a request that names
        none (an earlier scheduler's), once per version. Once per version, a version
        switched back to (A, then B, then A again) was refused as a duplicate and never
        scored again, though the fan-out counted it sent (a walkthrough).

        With `may_resume` (a retried or redelivered request), a claim whose command was not
        recorded as sent (`finish_rescore`) is handed out again with the same generation, so
        the request resumes instead of being dropped; without it, that claim is a duplicate
        in progress.
        """
        latest: Document = (
            {"rescored_for": {"$ne": rubric_version}}
            if generation is None
            else _latest_done_at(generation, now)
        )
        claimable = {
            "_id": task_id,
            "tenant_id": tenant_id,
            "command": {"$type": "object"},
            **latest,
            # No `expires_at`: not sent yet, so kept however old (its text with it).
            "$or": [{"expires_at": {"$gt": now}}, {"expires_at": {"$exists": False}}],
        }
        update = _claim_next_generation(rubric_version, request_id=request_id, now=now)
        try:
            claimed = await self._collection.find_one_and_update(
                claimable, update, return_document=ReturnDocument.AFTER
            )
            if claimed is not None:
                return _rescore_claim(claimed, resumed=False)
            current = await self._collection.find_one({"_id": task_id, "tenant_id": tenant_id})
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        if current is not None and _expired(current, now):
            # Past its retention, not yet removed (the TTL monitor runs about once a minute,
            # later under load): its text is no longer ours to send to the model.
            return RescoreRefused.TEXT_NOT_KEPT
        return _earlier_rescore(
            current,
            rubric_version,
            may_resume=may_resume,
            request_id=None if generation is None else request_id,
        )

    async def replay_generation(
        self, task_id: str, *, of: int, now: datetime | None = None
    ) -> int | ReplayRefused | None:
        """The generation a DLQ replay of generation `of` runs as: `of` + 1, taken from the
        submission the first time (a re-score racing the replay takes the one after), and
        the same for every later copy of that dead letter (the DLQ may hold two; both must
        reach the scorer as one attempt); above a re-score's claim given up unsent, as the
        claim's generation + 1. `SUPERSEDED` when a generation above `of` was sent by
        anything but a replay of this letter (a re-score): replayed, the stale letter scored
        the task once more. `RESCORE_BEING_SENT` while a re-score's claim above it is being
        sent (its request tried within `RESCORE_ORPHANED_AFTER`; one quiet for longer is
        taken for given up). None when the submission is gone (past its retention): nothing
        else hands its generations out."""
        now = utcnow() if now is None else now
        replay = f"replays.g{of}"
        try:
            given = _replayed_as(await self._replays(task_id), of)
            if given is not None:
                return given
            # One write finds none above `of` sent, takes the next generation and names it the
            # replay's: in two writes, two copies replayed at once each took a generation (the
            # stored one, which a cancel targets, never ran), and a re-score claiming one
            # between a check and the take was scored again by the stale letter.
            taken = await self._collection.find_one_and_update(
                {"_id": task_id, replay: {"$exists": False}, **_none_handed_out_above(of, now)},
                [
                    {"$set": {"generation": {"$add": [{"$max": [_GENERATION, of]}, 1]}}},
                    {"$set": {replay: "$generation"}},
                ],
                projection={"generation": True},
                return_document=ReturnDocument.AFTER,
            )
            if taken is not None:
                return int(taken["generation"])
            return _not_taken(await self._replays(task_id), of, now)
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def _replays(self, task_id: str) -> Document | None:
        return await self._collection.find_one(
            {"_id": task_id}, projection={"replays": True, "rescore": True, "generation": True}
        )

    async def note_rescore_tried(self, task_id: str, *, request_id: str, now: datetime) -> None:
        """The request of an unsent claim tries to send it again (a retry, a redelivery): a
        DLQ replay keeps the task's letters while it does (`RESCORE_ORPHANED_AFTER`)."""
        await self._update(
            {"_id": task_id, "rescore.request_id": request_id, "rescore.sent": {"$ne": True}},
            {"$set": {"rescore.tried_at": now}},
        )

    async def answer_rescore(
        self, task_id: str, *, generation: int, answer: RescoreAnswer
    ) -> RescoreAnswer:
        """Record how the claim of `generation` is answered, unless a try of it recorded an
        answer already: the answer recorded, which every later try of the claim repeats
        (`answer` when the claim has moved on, and nothing is recorded). Decided again at a
        retry, a claim announced from the cache, its confirm lost, and then sent to the
        scorer, had its generation both answered and scored."""
        stored = {
            "cached": None if answer.cached is None else answer.cached.model_dump(mode="json")
        }
        try:
            claimed = await self._collection.find_one_and_update(
                {"_id": task_id, "rescore.generation": generation},
                [
                    {
                        "$set": {
                            RESCORE_ANSWER: {
                                "$ifNull": [f"${RESCORE_ANSWER}", {"$literal": stored}]
                            }
                        }
                    }
                ],
                projection={RESCORE_ANSWER: True},
                return_document=ReturnDocument.AFTER,
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        if claimed is None:
            return answer
        return _answer_of(claimed["rescore"]["answer"])

    async def finish_rescore(self, task_id: str, *, rubric_version: str, now: datetime) -> None:
        """The re-score's command reached the broker: a duplicate request is now ignored."""
        await self._update(
            {"_id": task_id, "rescore.rubric_version": rubric_version},
            {"$set": {"rescore.sent": True, "rescore.sent_at": now}},
        )

    async def discard(self, task_id: str) -> None:
        """Forget a submission whose command never reached the broker."""
        try:
            await self._writes.delete_one(
                {"_id": task_id, "state": SubmissionState.ACCEPTING.value}
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def owner(self, task_id: str) -> Owner | None:
        """Who a task belongs to, for its outcome; None when there is no submission."""
        try:
            document = await self._owners.find_by_id(task_id)
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        if document is None:
            return None
        return Owner(
            tenant_id=document["tenant_id"],
            cache_key=document.get("cache_key"),
            counted=bool(document.get(IN_FLIGHT_MARK)),
            cache_model=document.get(CACHE_MODEL),
        )

    async def note_outcome(
        self,
        task_id: str,
        *,
        generation: int | None,
        finished: int | None,
        uncount: bool,
        completed: int | None = None,
    ) -> None:
        """After an outcome: remember the highest generation the task reached when given (a
        DLQ replay bumps it too, so a later re-score takes the one after it), the highest
        generation that finished (`finished`: the outcome's, for `cancel_task`) and that
        completed (`completed`), and remove the in-flight mark once its slot is released
        (`uncount`). One write for all."""
        update: Document = {}
        highest: Document = {}
        if generation is not None:
            highest["generation"] = generation
        if finished is not None:
            highest[FINISHED_GENERATION] = finished
        if completed is not None:
            highest[COMPLETED_GENERATION] = completed
        if highest:
            update["$max"] = highest
        if uncount:
            update["$unset"] = {IN_FLIGHT_MARK: ""}
        if update:
            await self._update({"_id": task_id}, update)

    async def uncount(self, task_ids: Collection[str]) -> None:
        """Remove the in-flight mark of these submissions, whose slots their refusal released
        (or never took) though they were kept (a replay accepted their batch or left them to
        the sweep, or the sweep sent them): their outcomes then release nothing."""
        ordered = sorted(task_ids)
        for start in range(0, len(ordered), UNCOUNT_CHUNK):
            await self._update_many(
                {"_id": {"$in": ordered[start : start + UNCOUNT_CHUNK]}},
                {"$unset": {IN_FLIGHT_MARK: ""}},
            )

    async def find(self, task_id: str, *, tenant_id: str) -> Submission | None:
        return await self._find_one(
            {"_id": task_id, "tenant_id": tenant_id, "state": {"$ne": _ABANDONED}}
        )

    async def cached_result(self, task_id: str, *, tenant_id: str) -> ScoreResult | None:
        """The result-cache hit that answered the task, if one did: one read by `_id` of that
        field alone (never the text)."""
        try:
            document = await self._collection.find_one(
                {
                    "_id": task_id,
                    "tenant_id": tenant_id,
                    "state": {"$ne": _ABANDONED},
                    "cached_result": {"$exists": True},
                },
                projection={"cached_result": 1},
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return None if document is None else ScoreResult.model_validate(document["cached_result"])

    async def find_by_key(self, idempotency_key: str, *, tenant_id: str) -> Submission | None:
        return await self._find_one(
            {"tenant_id": tenant_id, "idempotency_key": string_key(idempotency_key)}
        )

    async def interrupted(
        self,
        *,
        older_than: datetime,
        limit: int = 500,
        now: datetime | None = None,
        excluding_batches: Collection[str] = (),
    ) -> list[Submission]:
        """Submissions left `accepting` or `unconfirmed` before `older_than`: the outbox to
        send, less the items of `excluding_batches` (held by the sweep). Unsent records of an
        earlier build whose `expires_at` comes within `LEGACY_UNSENT_HOLD` of `now`
        (default: the time now) are held first, so that the TTL index never removes one
        before it is sent."""
        query: Document = {"state": {"$in": _UNSENT}, "created_at": {"$lt": older_than}}
        if excluding_batches:
            query["batch_id"] = {"$nin": sorted(excluding_batches)}
        try:
            await self.hold_legacy_unsent(now=utcnow() if now is None else now)
            cursor = self._collection.find(query).sort("created_at", ASCENDING).limit(limit)
            return [_submission_of(document) async for document in cursor]
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def still_unsent(self, task_ids: Sequence[str]) -> frozenset[str]:
        """Which of `task_ids` are still `accepting` or `unconfirmed` (not deleted, sent or
        abandoned since the outbox sweep listed them). One read on `_id`, ids only."""
        query = {"_id": {"$in": list(task_ids)}, "state": {"$in": _UNSENT}}
        try:
            cursor = self._collection.find(query, projection={"_id": 1})
            return frozenset([document["_id"] async for document in cursor])
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def hold_legacy_unsent(self, *, now: datetime) -> int:
        """Push the `expires_at` of unsent records written by earlier builds (which set it at
        insert, due + retention) to `now + 2 * LEGACY_UNSENT_HOLD` when it comes within
        `LEGACY_UNSENT_HOLD`; how many were held. One write on the `state` index, usually
        matching nothing (records of this build have no `expires_at` while unsent).

        Held rather than removed: a replica of the earlier build, during a rolling upgrade,
        marks a record sent by its `state` alone, and one without `expires_at` would then be
        kept for ever."""
        try:
            result = await self._collection.update_many(
                {
                    "state": {"$in": _UNSENT},
                    "expires_at": {"$lt": now + LEGACY_UNSENT_HOLD},
                },
                {"$set": {"expires_at": now + 2 * LEGACY_UNSENT_HOLD}},
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return result.modified_count

    async def unsent_in_batch(self, batch_id: str, *, sent_since: datetime) -> frozenset[str]:
        """Task ids of a batch's submissions not known to be queued yet (`accepting` or
        `unconfirmed`, which the outbox sweep sends) or sent by the sweep at `sent_since` or
        later: tasks the status service may not have heard of however old the batch
        (`read_batch`). One read, each branch on an index (`batch_submissions`,
        `batch_swept`; their partial filters repeated, see `string_key`)."""
        query = unsent_in_batch_query(batch_id, sent_since=sent_since)
        try:
            cursor = self._collection.find(query, projection={"_id": 1})
            return frozenset([document["_id"] async for document in cursor])
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def recorded_per_batch(self, batch_ids: Sequence[str]) -> dict[str, int]:
        """How many submissions each of these batches has recorded (tombstones included): one
        aggregation on the `batch_submissions` index (its partial filter repeated)."""
        if not batch_ids:
            return {}
        pipeline: list[Document] = [
            {"$match": {"batch_id": {"$in": list(batch_ids), "$type": "string"}}},
            {"$group": {"_id": "$batch_id", "recorded": {"$sum": 1}}},
        ]
        try:
            cursor = await self._collection.aggregate(pipeline)
            return {document["_id"]: document["recorded"] async for document in cursor}
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def batches_with_unsent(self, batch_ids: Sequence[str]) -> frozenset[str]:
        """Which of these batches have a submission not known to be queued yet. One `distinct`
        on the `batch_submissions` index (its partial filter repeated, see `string_key`)."""
        query = {
            "batch_id": {"$in": list(batch_ids), "$type": "string"},
            "state": {"$in": _UNSENT},
        }
        try:
            found = await self._collection.distinct("batch_id", query)
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return frozenset(found)

    async def cancel_targets(
        self, batch_id: str, *, tenant_id: str, expected: int
    ) -> list[CancelTarget]:
        """What cancelling a batch's items needs of their submissions (tombstones left out):
        one read on the `batch_submissions` index, `CANCEL_FIELDS` only, its answer in one
        reply for the `expected` items (a batch's are small without their texts)."""
        query = {
            "batch_id": string_key(batch_id),
            "tenant_id": tenant_id,
            "state": {"$ne": _ABANDONED},
        }
        try:
            cursor = self._collection.find(query, projection=CANCEL_FIELDS).batch_size(
                max(expected, 1)
            )
            return [_cancel_target_of(document) async for document in cursor]
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def _find_one(self, query: Document) -> Submission | None:
        try:
            document = await self._collection.find_one(query)
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return None if document is None else _submission_of(document)

    async def _update(self, query: Document, update: Document) -> None:
        try:
            await self._writes.update_one(query, update)
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def _update_many(self, query: Document, update: Document) -> None:
        try:
            await self._collection.update_many(query, update)
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error


def _new_document(
    command: ScoreText,
    *,
    request_hash: str,
    retention: timedelta,
    cache_key: str,
    cache_model: str | None,
) -> Document:
    document: Document = {
        "_id": command.task_id,
        "tenant_id": command.tenant_id,
        "state": SubmissionState.ACCEPTING.value,
        "cache_key": cache_key,
        "request_hash": request_hash,
        "created_at": command.submitted_at,
        "not_before": command.not_before,
        # Not `expires_at`: unsent, it must not expire (`mark_accepted` moves it there).
        EXPIRY_ONCE_SENT: _due(command) + retention,
        "command": command.model_dump(mode="json"),
    }
    if cache_model is not None:
        document[CACHE_MODEL] = cache_model
    if command.batch_id is not None:
        document["batch_id"] = command.batch_id
    return document


def _sent(sent_at: datetime | None) -> Document:
    """The update of a submission whose command reached the broker: it expires from now on,
    when recorded at insert (a `$rename` of a missing field changes nothing: marked before,
    or written by an earlier build, which set `expires_at` at insert)."""
    sent: Document = {"state": SubmissionState.ACCEPTED.value}
    if sent_at is not None:
        sent[SENT_AT] = sent_at
    return {"$set": sent, "$rename": {EXPIRY_ONCE_SENT: "expires_at"}}


def _swept(sent_at: datetime, retention: timedelta) -> list[Document]:
    """`_sent` for a record the outbox sweep sent, kept at least `retention` from `sent_at`:
    sent after an outage longer than its retention, it expired the moment it was sent, and
    with it the task's reads (404) and its Idempotency-Key (a resubmission scored it twice)."""
    recorded_expiry = {"$ifNull": [f"${EXPIRY_ONCE_SENT}", "$expires_at"]}
    return [
        {
            "$set": {
                "state": SubmissionState.ACCEPTED.value,
                SENT_AT: sent_at,
                "expires_at": {"$max": [recorded_expiry, sent_at + retention]},
            }
        },
        {"$unset": EXPIRY_ONCE_SENT},
    ]


def unsent_in_batch_query(batch_id: str, *, sent_since: datetime) -> Document:
    batch = string_key(batch_id)
    return {
        "$or": [
            {"batch_id": batch, "state": {"$in": _UNSENT}},
            {"batch_id": batch, SENT_AT: {"$gte": sent_since, "$type": "date"}},
        ]
    }


def recently_due(submission: Submission, *, now: datetime, window: timedelta) -> bool:
    """Whether the status service may not have heard of the task yet: submitted, due (a
    delayed task reaches the projection with its first attempt when its announcement was
    lost), or sent by the outbox sweep, within `window`. From the submission alone, a task
    delayed past the window answered 404 until it ran, and one the sweep sent after a broker
    alarm longer than the window answered 404 until the projection caught up. A task whose
    command is not known to be queued yet (left `unconfirmed` by a broker alarm, or
    `accepting`, for the outbox sweep) has not reached the projection either, however old: it
    read as 404 (a client resubmitting then had its text scored twice)."""
    if submission.state in (SubmissionState.ACCEPTING, SubmissionState.UNCONFIRMED):
        return True
    # A task whose latest generation finished will not become due: a delayed task cancelled
    # days ahead of its time read `scheduled` until then once the projection's copy expired.
    finished = submission.finished_generation is not None and (
        submission.finished_generation >= submission.generation
    )
    due = None if finished else submission.not_before
    times = (submission.created_at, due, submission.sent_at)
    return max(time for time in times if time is not None) >= now - window


def _due(command: ScoreText) -> datetime:
    """When the task may run. Its record is kept for the retention from then, not from its
    submission: a task delayed beyond the retention keeps its record, and with it the
    in-flight mark its outcome releases, until it has run."""
    if command.not_before is None:
        return command.submitted_at
    return max(command.submitted_at, command.not_before)


def _only_duplicate_ids(error: BulkWriteError) -> bool:
    """Whether an unordered insert failed only on documents already there (the rest landed)."""
    details = error.details
    return not details.get("writeConcernErrors") and all(
        failure.get("code") == DUPLICATE_KEY for failure in details.get("writeErrors", ())
    )


def _tombstone(task_id: str, now: datetime) -> tuple[Document, Document]:
    """The filter and update of a submission refused after all: upserted, so that it holds
    before or after its insert; a record already sent (another state) makes the upsert
    collide on `_id`. It expires `TOMBSTONE_TTL` from now at the earliest (`$max`: a record
    of an earlier build keeps a later `expires_at`; an `accepting` one of this build had
    none, and would otherwise be kept for ever)."""
    return (
        {"_id": task_id, "state": {"$in": _ABANDONABLE}},
        {
            "$set": {"state": _ABANDONED},
            "$unset": {
                "command": "",
                "idempotency_key": "",
                IN_FLIGHT_MARK: "",
                EXPIRY_ONCE_SENT: "",
            },
            "$setOnInsert": {"created_at": now},
            "$max": {"expires_at": now + TOMBSTONE_TTL},
        },
    )


def _claim_next_generation(
    rubric_version: str, *, request_id: str, now: datetime
) -> list[Document]:
    """The update of a re-score claim: the next generation (a claim's given up unsent is
    taken again, `_handed_out`), recorded with the claim in the same write (an update
    pipeline, so `rescore.generation` can be computed from the generation it takes). A
    resumed claim runs as the generation it took, not as one a DLQ replay took from the
    submission meanwhile; as two writes, a claim whose second write
    failed fell back to the submission's generation, and a replay raising it in between
    had the re-score sent as the replay's generation, which the scorer dropped as a
    duplicate. `$literal` keeps the values from being read as field paths or operators;
    `rescored_for` is appended to, as `$addToSet` would (the claim's filter ensures the
    version is not in it yet)."""
    claim = {
        "rubric_version": rubric_version,
        "request_id": request_id,
        "requested_at": now,
        "sent": False,
    }
    return [
        {
            "$set": {
                "generation": {"$add": [_handed_out(now), 1]},
                "rescored_for": {
                    "$concatArrays": [
                        {"$ifNull": ["$rescored_for", []]},
                        [{"$literal": rubric_version}],
                    ]
                },
                "rescore": {"$literal": claim},
            }
        },
        {"$set": {"rescore.generation": "$generation"}},
    ]


def _rescore_claim(document: Document, *, resumed: bool) -> RescoreClaim:
    claimed_as = (document.get("rescore") or {}).get("generation")
    if claimed_as is None:  # a claim of an earlier build, which kept no generation of its own
        claimed_as = document.get("generation", NO_GENERATION)
    answer = (document.get("rescore") or {}).get("answer")
    return RescoreClaim(
        command=ScoreText.model_validate(document["command"]),
        generation=int(claimed_as),
        resumed=resumed,
        request_id=(document.get("rescore") or {}).get("request_id"),
        cache_key=document.get("cache_key"),
        answer=None if answer is None else _answer_of(answer),
    )


def _answer_of(stored: Document) -> RescoreAnswer:
    cached = stored.get("cached")
    return RescoreAnswer(None if cached is None else ScoreResult.model_validate(cached))


def _expired(document: Document, now: datetime) -> bool:
    expires_at = document.get("expires_at")
    return expires_at is not None and expires_at <= now


def _earlier_rescore(
    document: Document | None,
    rubric_version: str,
    *,
    may_resume: bool,
    request_id: str | None = None,
) -> RescoreClaim | RescoreRefused:
    """Why `claim_rescore` matched nothing, or the unsent claim to resume: with
    `request_id` (a request naming its generation, whose message id is its own), only the
    claim that request took."""
    if document is None:
        return RescoreRefused.UNKNOWN_TASK
    if not isinstance(document.get("command"), dict):
        return RescoreRefused.TEXT_NOT_KEPT
    latest = document.get("rescore") or {}
    own = request_id is None or latest.get("request_id") == request_id
    unsent = own and latest.get("rubric_version") == rubric_version and not latest.get("sent")
    if unsent and may_resume:
        return _rescore_claim(document, resumed=True)
    return RescoreRefused.ALREADY_REQUESTED


def _submission_of(document: Document) -> Submission:
    command = document.get("command")
    generation = max(
        int(document.get("generation", NO_GENERATION)),
        int(command.get("generation", NO_GENERATION)) if command else NO_GENERATION,
    )
    finished = document.get(FINISHED_GENERATION)
    return Submission(
        task_id=document["_id"],
        tenant_id=document["tenant_id"],
        state=SubmissionState(document["state"]),
        request_hash=document["request_hash"],
        created_at=document["created_at"],
        not_before=document.get("not_before"),
        command=ScoreText.model_validate(command) if command else None,
        cached_result=ScoreResult.model_validate(cached)
        if (cached := document.get("cached_result"))
        else None,
        generation=generation,
        finished_generation=None if finished is None else int(finished),
        completed_generation=_optional_int(document.get(COMPLETED_GENERATION)),
        sent_at=document.get(SENT_AT),
        expires_once_sent=document.get(EXPIRY_ONCE_SENT),
    )


_WHEN: Final = TypeAdapter(datetime)


def _cancel_target_of(document: Document) -> CancelTarget:
    """`CancelTarget.of` for a document read with `CANCEL_FIELDS` (`_submission_of`'s rules)."""
    command = document.get("command") or {}
    finished = document.get(FINISHED_GENERATION)
    return CancelTarget(
        task_id=document["_id"],
        tenant_id=document["tenant_id"],
        generation=max(
            int(document.get("generation", NO_GENERATION)),
            int(command.get("generation", NO_GENERATION)),
        ),
        finished_generation=None if finished is None else int(finished),
        answered_from_cache=bool(document.get("cached_result")),
        submitted_at=_WHEN.validate_python(command["submitted_at"])
        if "submitted_at" in command
        else document["created_at"],
        api_key_id=command.get("api_key_id"),
        callback_url=command.get("callback_url"),
        not_before=document.get("not_before"),
        completed_generation=_optional_int(document.get(COMPLETED_GENERATION)),
    )


_GENERATION: Final = {"$ifNull": ["$generation", NO_GENERATION]}
# A re-score's claim whose request has not tried to send it for this long has none that will
# (dead-lettered for a crash or the database's refusal). A live request tries at least every
# `services.gateway.rescore.RETRY_DELAYS_S[-1]` (10 min).
RESCORE_ORPHANED_AFTER: Final = timedelta(hours=1)
_RESCORE_LAST_TRIED: Final = {"$max": ["$rescore.requested_at", "$rescore.tried_at"]}


def _handed_out(now: datetime) -> Document:
    """The highest generation handed out to anything still able to send it (an aggregation
    expression). A re-score's claim on top never sent does not count when its request was
    given up to its DLQ (by an earlier build: `rescore.given_up`; this one gives none up,
    `services.gateway.rescore`) or has not tried to send it for `RESCORE_ORPHANED_AFTER`:
    the next claim takes its generation again, and a DLQ replay runs above it. One still
    being sent counts (review): replayed above it, the letter's generation was scored
    beside the claim's."""
    unsendable_on_top = {
        "$and": [
            {"$ne": ["$rescore.sent", True]},
            {"$eq": ["$rescore.generation", _GENERATION]},
            {
                "$or": [
                    {"$eq": ["$rescore.given_up", True]},
                    {"$lt": [_RESCORE_LAST_TRIED, now - RESCORE_ORPHANED_AFTER]},
                ]
            },
        ]
    }
    return {"$cond": [unsendable_on_top, {"$subtract": [_GENERATION, 1]}, _GENERATION]}


def _latest_done_at(generation: int, now: datetime) -> Document:
    """A filter: `generation` (a completed one) is the task's latest outcome, and no later
    generation is running: it is the latest handed out (`_handed_out`), or every later one
    finished without completing (a re-score that failed). A duplicate of a request, or a late
    one of an earlier run, finds the next generation taken and running (or completed)."""
    completed = {"$ifNull": [f"${COMPLETED_GENERATION}", NO_GENERATION]}
    finished = {"$ifNull": [f"${FINISHED_GENERATION}", NO_GENERATION - 1]}
    handed_out = _handed_out(now)
    return {
        "$expr": {
            "$and": [
                {"$lte": [completed, generation]},
                {"$or": [{"$eq": [handed_out, generation]}, {"$gte": [finished, handed_out]}]},
            ]
        }
    }


def _none_handed_out_above(generation: int, now: datetime) -> Document:
    """A filter: no generation above `generation` handed out to anything still able to send
    it (`_handed_out`)."""
    return {"$expr": {"$lte": [_handed_out(now), generation]}}


def _rescore_being_sent(submission: Document, above: int, now: datetime) -> bool:
    """A re-score's claim above generation `above` is on top, neither sent nor given up, and
    its request tried to send it within `RESCORE_ORPHANED_AFTER`."""
    rescore = submission.get("rescore") or {}
    on_top = submission.get("generation", NO_GENERATION)
    tried = [at for at in (rescore.get("requested_at"), rescore.get("tried_at")) if at]
    return (
        rescore.get("sent") is not True
        and rescore.get("given_up") is not True
        and rescore.get("generation") == on_top
        and on_top > above
        and bool(tried)
        and max(tried) >= now - RESCORE_ORPHANED_AFTER
    )


def _replayed_as(submission: Document | None, of: int) -> int | None:
    """The generation a replay of generation `of` took, if one did."""
    return _optional_int(((submission or {}).get("replays") or {}).get(f"g{of}"))


def _not_taken(submission: Document | None, of: int, now: datetime) -> int | ReplayRefused | None:
    """Why a replay's take of generation `of` matched nothing: the submission is gone (None),
    a copy of the letter replayed at the same moment took it first (its generation wins), a
    re-score's claim above it is being sent, or a later generation superseded the letter."""
    if submission is None:
        return None
    given = _replayed_as(submission, of)
    if given is not None:
        return given
    if _rescore_being_sent(submission, of, now):
        return ReplayRefused.RESCORE_BEING_SENT
    return ReplayRefused.SUPERSEDED


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
