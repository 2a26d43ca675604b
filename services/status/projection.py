"""The task projection: what a poll answers, built from `task.*` events.

An event is applied only when its sequence is higher than the one stored (a conditional
upsert: a stale event finds no matching document and its insert collides on `_id`; a
collision is tried once more, since racing another replica's first insert collides too), so
duplicates and out-of-order deliveries never move a task backwards.

Each document also keeps a bounded `history` of state changes (what an SSE stream replays).
The change is pushed in the same conditional update that applies the event; a late event (one
that lost the race to a newer one) still enters the history, in sequence order, by a second
update guarded on its sequence not being there yet, so a duplicate never enters it twice.

A task whose command the broker refused (the client was answered 503) may have reached the
projection all the same, from its copy of the command; the gateway's `score.withdrawn` hides
it again (`apply_withdrawal`).

Batch progress: `task.accepted` (for a task sent now: read from its command) carries
`batch_id`/`batch_index`, kept on the document and indexed, so a batch's counts and a page
of its items, by `batch_index`, are one aggregation.

A retrying task's `task.retrying` may come again under its sequence with a later
`next_attempt_at` (a pause of the model calls put the attempt off): that moves the due time
later, never earlier, while the task still holds the retry (`_due_later`).

A scheduled task reads `queued` once its `not_before` has come (`status_at`, at read time): no
event says so (the command comes off the wait ladder to the scorer only, and a quick attempt
publishes no `task.started`), so it read `scheduled` until its first attempt's outcome, while
the gateway's own record of the submission already read `queued`. The recorded history keeps
its `scheduled` change: no event made the other.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any, Final

from pymongo import ASCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from shared.contracts import (
    BatchItemProgress,
    BatchProgress,
    Phase,
    ScoreText,
    ScoreWithdrawn,
    StateChange,
    TaskAccepted,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskFailure,
    TaskHistory,
    TaskRetrying,
    TaskStarted,
    TaskStatus,
    TaskView,
    accepted_event,
    event_sequence,
    parse_task_event,
)
from shared.group_writes import GroupWriter
from shared.indexes import drop_retired_indexes, string_key

Document = dict[str, Any]
Tasks = AsyncCollection[Document]
DEFAULT_HISTORY_LIMIT = 64
RETIRED_TASKS_INDEX = "tenant_id_1_created_at_1"
# How long a withdrawn task's tombstone outlives it, hidden from reads: a copy of its command
# redelivered within this time (the projection's queue held it while the service was down)
# still finds the tombstone and changes nothing. Withdrawals are rare, so this costs little.
WITHDRAWN_RETENTION: Final = timedelta(days=7)
# How long an unfinished task's document lasts past its last event (past when it is due, for
# a scheduled task or a retry): a task silent that long is taken for gone. Without it, a
# stale event redelivered after a finished task's document expired (a projection hours
# behind, a delivery held past the broker's consumer timeout) brought the task back as
# `queued` or `processing`, for ever.
UNFINISHED_RETENTION: Final = timedelta(days=7)
log = logging.getLogger("scorebox.status")
Projected = TaskEvent | ScoreWithdrawn


def tasks_collection(client: AsyncMongoClient[Document], database: str) -> Tasks:
    return client[database]["tasks"]


async def ensure_indexes(tasks: Tasks, *, now: datetime) -> None:
    # Every task carries `expires_at` (finished: FINISHED_TASK_TTL_S after its end; otherwise
    # UNFINISHED_RETENTION after its last event); MongoDB's TTL monitor removes it after that.
    await tasks.create_index([("expires_at", ASCENDING)], expireAfterSeconds=0)
    await expire_unfinished_of_earlier_builds(tasks, now=now)
    await tasks.create_index(
        [("tenant_id", ASCENDING), ("batch_id", ASCENDING), ("batch_index", ASCENDING)],
        partialFilterExpression={"batch_id": {"$type": "string"}},
        name="batch_items",
    )
    # No query lists a tenant's tasks by creation time; the index only cost every insert.
    await drop_retired_indexes(tasks, RETIRED_TASKS_INDEX)


def _fields_of(
    event: TaskEvent, change: StateChange, *, finished_ttl: timedelta, applied_at: datetime
) -> Document:
    """What an applied (newer) event sets. Within a generation a result exists only once its
    attempt completed, so every other event clears one: it can only be an earlier
    generation's, left when the re-score's `task.accepted` (sent best effort) was lost or
    overtaken, and the task then showed the old rubric's result next to its new status.
    A `task.started` keeps the error of its generation's previous attempt (what it retries
    after); an earlier generation's is cleared where it is applied (`_apply_newer`).

    A finished task is kept `finished_ttl` from its outcome, or from now if the outcome
    reaches the projection later than that: counted from the outcome alone, one applied
    after a long outage or backlog (which the consumers wait out) was already expired, and
    a task read as processing until then went straight to 404 (found in review)."""
    fields: Document = {
        "tenant_id": event.tenant_id,
        "status": change.status.value,
        "sequence": event.sequence,
        "generation": event.generation,
        "attempts": event.attempt,
        "created_at": event.submitted_at,
        "updated_at": event.occurred_at,
        "next_attempt_at": None,
        "expires_at": event.occurred_at + UNFINISHED_RETENTION,
    }
    finished_at = max(event.occurred_at, applied_at)
    match event:
        case TaskAccepted():
            due = max(event.occurred_at, event.not_before or event.occurred_at)
            fields |= {
                "result": None,
                "error": None,
                "expires_at": due + UNFINISHED_RETENTION,
                **_descriptive_fields(event),
            }
        case TaskStarted():
            fields["result"] = None  # an earlier generation's (see below)
        case TaskRetrying():
            due = max(event.occurred_at, event.next_attempt_at)
            fields |= {
                "result": None,
                "error": _failure(event.error.model_dump(), dead_lettered=False),
                "next_attempt_at": event.next_attempt_at,
                "expires_at": due + UNFINISHED_RETENTION,
            }
        case TaskCompleted():
            fields |= {
                "result": event.result.model_dump(mode="json"),
                "error": None,
                "expires_at": finished_at + finished_ttl,
            }
        case TaskFailed():
            fields |= {
                "result": None,
                "error": _failure(event.error.model_dump(), dead_lettered=event.dead_lettered),
                "expires_at": finished_at + finished_ttl,
            }
    return fields


def _descriptive_fields(event: TaskAccepted) -> Document:
    """What only an acceptance tells of its generation, set even when it comes late."""
    return {
        "not_before": event.not_before,
        "rubric": event.rubric,
        "model": event.model,
        "metadata": event.metadata,
        "batch_id": event.batch_id,
        "batch_index": event.batch_index,
    }


def _history_push(change: StateChange, limit: int) -> Document:
    entry = {**change.model_dump(exclude_none=True), "status": change.status.value}
    # Sorted and sliced on every push: a late change lands in order, the oldest fall off.
    return {"$each": [entry], "$sort": {"sequence": ASCENDING}, "$slice": -limit}


def _failure(error: Document, *, dead_lettered: bool) -> Document:
    return {**error, "dead_lettered": dead_lettered}


async def apply_task_event(
    event: TaskEvent,
    *,
    writes: GroupWriter,
    finished_ttl: timedelta,
    history_limit: int = DEFAULT_HISTORY_LIMIT,
    now: datetime,
) -> bool:
    """Apply `event` if it is newer than what the projection holds; True when applied."""
    change = StateChange.of_event(event)
    applied_at = now
    fields = _fields_of(event, change, finished_ttl=finished_ttl, applied_at=applied_at)
    push = _history_push(change, history_limit)
    applied = await _apply_newer(
        writes, event, {"$set": fields, "$push": {"history": push}, "$unset": {"withdrawn": ""}}
    )
    if not applied:
        if isinstance(event, TaskAccepted):
            await _describe_if_same_generation(writes, event)
        if isinstance(event, TaskRetrying):
            await _error_of_the_attempt_before(writes, event)
            await _due_later(writes, event)
        # Stale or duplicate: the state stays, but a change never recorded enters the history.
        await writes.update_one(
            {"_id": event.task_id, "history.sequence": {"$ne": event.sequence}},
            {"$push": {"history": push}},
        )
    return applied


async def _describe_if_same_generation(writes: GroupWriter, event: TaskAccepted) -> None:
    """Set a late acceptance's descriptive fields (rubric, model, metadata, batch, the
    scheduled time) where
    the task still holds the acceptance's generation: a later event of that generation
    overtook it, and they still belong. An earlier generation's acceptance, redelivered
    after a re-score or DLQ replay was accepted, overwrote the newer generation's rubric
    and model (and metadata, and batch) with the old ones; such a one changes nothing now.
    The stored sequence tells the generation (documents of earlier builds may lack the
    `generation` field)."""
    generation_starts = event_sequence(generation=event.generation, attempt=0, phase=Phase.ACCEPTED)
    next_generation_starts = event_sequence(
        generation=event.generation + 1, attempt=0, phase=Phase.ACCEPTED
    )
    same_generation = {"$gte": generation_starts, "$lt": next_generation_starts}
    await writes.update_one(
        {"_id": event.task_id, "sequence": same_generation},
        {"$set": _descriptive_fields(event)},
    )


async def _error_of_the_attempt_before(writes: GroupWriter, event: TaskRetrying) -> None:
    """Set a late retry's error where the task holds the next attempt's start: a start
    keeps the latest error applied before it (`_apply_newer`), so the same events left a
    running task with or without this one by the order they came in (a late redelivery, a
    replay of the projection's DLQ; found in review). Whatever error that start holds is
    replaced: it can only be this retry's, or an earlier attempt's of the generation (a
    quick attempt in between sends no start; found in review), never a later one's."""
    next_start = event_sequence(
        generation=event.generation, attempt=event.attempt + 1, phase=Phase.STARTED
    )
    error = _failure(event.error.model_dump(), dead_lettered=False)
    await writes.update_one(
        {"_id": event.task_id, "sequence": next_start}, {"$set": {"error": error}}
    )


async def _due_later(writes: GroupWriter, event: TaskRetrying) -> None:
    """Move the task's next attempt to the later time a retry told again, where the task
    still holds that very retry (its sequence) and a time before it. The scorer tells it so
    when a pause of the model calls puts the attempt off past the first time
    (`scoring._put_off`): a poll read that time, long past, for as long as the pause lasted.
    Only later, and only on that state: a copy of an earlier telling, redelivered late,
    never moves the time back, and once the attempt has started (or the task moved on) the
    time is gone and stays so. The history keeps the state change as first told: a due
    time put off is no change of state."""
    due = max(event.occurred_at, event.next_attempt_at)
    await writes.update_one(
        {
            "_id": event.task_id,
            "sequence": event.sequence,
            "next_attempt_at": {"$lt": event.next_attempt_at},
        },
        {
            "$set": {"next_attempt_at": event.next_attempt_at},
            "$max": {"expires_at": due + UNFINISHED_RETENTION},
        },
    )


async def _apply_newer(writes: GroupWriter, event: TaskEvent, update: Document) -> bool:
    """Apply `update` (the event's) unless the task holds its sequence or a later one.

    A `task.started` keeps the stored error when the stored state is of its own generation
    (its previous attempt's `task.retrying`: the latest error of a retrying task), and clears
    it when the stored state is of an earlier one: a DLQ replay (or re-score) whose
    `task.accepted` (best effort) was lost or overtaken read `processing` with the earlier
    generation's error (`dead_lettered: true`) until its outcome. No write reads the stored
    generation, so guards tell the two apart: first this generation's (the usual case, one
    round trip), then an earlier one's, clearing the error. Both refused, the task may have
    moved into this generation in between (its acceptance applied by another replica), so
    this generation's guard is tried once more; a sequence only grows, so a third refusal
    means the start is stale. The extra round trips are spent only on a start over an earlier
    generation's state, or on a stale start.
    """
    if not isinstance(event, TaskStarted):
        return await _upsert_if_newer(writes, event.task_id, event.sequence, update)
    start = event_sequence(generation=event.generation, attempt=0, phase=Phase.ACCEPTED)
    this_generation = {"_id": event.task_id, "sequence": {"$gte": start, "$lt": event.sequence}}
    if await writes.guarded_upsert(this_generation, update):
        return True
    cleared = {**update, "$set": {**update["$set"], "error": None}}
    if await _upsert_if_newer(writes, event.task_id, start, cleared):
        return True
    return await writes.guarded_upsert(this_generation, update)


async def _upsert_if_newer(
    writes: GroupWriter, task_id: str, sequence: int, update: Document
) -> bool:
    """Apply `update` to the task unless it holds `sequence` or a later one; True if applied."""
    return await writes.guarded_upsert({"_id": task_id, "sequence": {"$lt": sequence}}, update)


async def apply_withdrawal(withdrawal: ScoreWithdrawn, *, writes: GroupWriter) -> bool:
    """Hide a task whose command the broker refused; True when hidden.

    A tombstone, sequenced above the command's acceptance and marked `withdrawn` (reads skip
    it), takes the task's place for `WITHDRAWN_RETENTION`: a copy of the command that arrives
    later is older and changes nothing. A task some attempt moved on (refused by another
    queue, scored all the same) is newer and stays; its events clear the mark.
    """
    return await _upsert_if_newer(
        writes,
        withdrawal.task_id,
        withdrawal.sequence,
        {
            "$set": {
                "tenant_id": withdrawal.tenant_id,
                "sequence": withdrawal.sequence,
                "updated_at": withdrawal.occurred_at,
                "expires_at": withdrawal.occurred_at + WITHDRAWN_RETENTION,
                "withdrawn": True,
            }
        },
    )


async def apply_projected(
    message: Projected,
    *,
    writes: GroupWriter,
    finished_ttl: timedelta,
    history_limit: int = DEFAULT_HISTORY_LIMIT,
    now: datetime,
) -> bool:
    """Apply a task event or a withdrawal; True when it changed the task."""
    if isinstance(message, ScoreWithdrawn):
        return await apply_withdrawal(message, writes=writes)
    return await apply_task_event(
        message, writes=writes, finished_ttl=finished_ttl, history_limit=history_limit, now=now
    )


async def expire_unfinished_of_earlier_builds(tasks: Tasks, *, now: datetime) -> int:
    """Give `UNFINISHED_RETENTION` from now to the unfinished documents of builds that wrote
    them without an expiry (`expires_at: null`, which the TTL monitor never removes): among
    them the tasks a stale event brought back as `queued` or `processing` for ever, the case
    the retention is for. Idempotent, and cheap once done (the TTL index finds the nulls).
    """
    result = await tasks.update_many(
        {"expires_at": None}, {"$set": {"expires_at": now + UNFINISHED_RETENTION}}
    )
    if result.modified_count:
        log.info("%d unfinished task(s) of an earlier build now expire", result.modified_count)
    return result.modified_count


def readable(now: datetime) -> Document:
    """Not withdrawn, not yet expired (the TTL monitor removes expired documents only
    eventually)."""
    return {
        "withdrawn": {"$ne": True},
        "$or": [{"expires_at": None}, {"expires_at": {"$gt": now}}],
    }


async def find_task(
    task_id: str, *, tenant_id: str, tasks: Tasks, now: datetime
) -> TaskView | None:
    """The task as its tenant sees it; None when unknown, another tenant's, or expired."""
    document = await tasks.find_one(
        {"_id": task_id, "tenant_id": tenant_id, **readable(now)}, projection={"history": 0}
    )
    if document is None:
        return None
    return _view_of(document, now)


async def find_history(
    task_id: str, *, tenant_id: str, after: int, tasks: Tasks, now: datetime
) -> TaskHistory | None:
    """The task's recorded state changes with a sequence above `after`, oldest first."""
    document = await tasks.find_one(
        {"_id": task_id, "tenant_id": tenant_id, **readable(now)},
        projection={"status": 1, "not_before": 1, "sequence": 1, "history": 1},
    )
    if document is None:
        return None
    changes = [
        StateChange.model_validate(entry)
        for entry in document.get("history") or []
        if entry["sequence"] > after
    ]
    return TaskHistory(
        task_id=task_id,
        status=status_at(document, now),
        sequence=document.get("sequence", 0),
        changes=sorted(changes, key=lambda change: change.sequence),
    )


async def find_batch(
    batch_id: str, *, tenant_id: str, after: int, limit: int, tasks: Tasks, now: datetime
) -> BatchProgress:
    """Counts per status of a batch's known tasks, and a page of them by `batch_index`.

    One aggregation: each task is read once and both counted and, when on the page, listed,
    so the counts agree with the items even while the batch's tasks change (two queries could
    see a task change between them: a batch's cancel, read as it ran, answered items
    cancelled that its counts still held queued)."""
    members = {"tenant_id": tenant_id, "batch_id": string_key(batch_id), **readable(now)}
    counted_and_listed = await tasks.aggregate(
        [
            {"$match": members},
            {"$project": dict.fromkeys(BATCH_ITEM_FIELDS, 1)},
            {
                "$facet": {
                    "counts": [{"$group": {"_id": _status_expression(now), "count": {"$sum": 1}}}],
                    "page": [
                        {"$match": {"batch_index": {"$gt": after}}},
                        {"$sort": {"batch_index": ASCENDING}},
                        {"$limit": limit},
                    ],
                }
            },
        ]
    )
    facets = await anext(counted_and_listed)
    return BatchProgress(
        batch_id=batch_id,
        counts={TaskStatus(group["_id"]): group["count"] for group in facets["counts"]},
        items=[_batch_item_of(document, now) for document in facets["page"]],
    )


# What a batch's page and counts read of each task (`_batch_item_of`, `status_at`).
BATCH_ITEM_FIELDS = (
    "batch_index",
    "status",
    "not_before",
    "attempts",
    "updated_at",
    "result",
    "error",
)


def status_at(document: Document, now: datetime) -> TaskStatus:
    """The task's status as of `now`: a scheduled task whose `not_before` has come is queued
    (as the gateway's record of the submission reads), though no event has said so."""
    status = TaskStatus(document["status"])
    not_before: datetime | None = document.get("not_before")
    if status is TaskStatus.SCHEDULED and (not_before is None or not_before <= now):
        return TaskStatus.QUEUED
    return status


def _status_expression(now: datetime) -> Document:
    """`status_at` as an aggregation expression (BSON orders a missing or null `not_before`
    before every date)."""
    due = {"$lte": ["$not_before", now]}
    scheduled = {"$eq": ["$status", TaskStatus.SCHEDULED.value]}
    return {"$cond": [{"$and": [scheduled, due]}, TaskStatus.QUEUED.value, "$status"]}


def _batch_item_of(document: Document, now: datetime) -> BatchItemProgress:
    error = document.get("error")
    return BatchItemProgress(
        task_id=document["_id"],
        batch_index=document["batch_index"],
        status=status_at(document, now),
        attempts=document.get("attempts", 0),
        updated_at=document["updated_at"],
        result=document.get("result"),
        error=TaskFailure.model_validate(error) if error else None,
    )


def _view_of(document: Document, now: datetime) -> TaskView:
    error = document.get("error")
    return TaskView(
        task_id=document["_id"],
        status=status_at(document, now),
        attempts=document.get("attempts", 0),
        created_at=document["created_at"],
        updated_at=document["updated_at"],
        result=document.get("result"),
        error=TaskFailure.model_validate(error) if error else None,
        next_attempt_at=document.get("next_attempt_at"),
        not_before=document.get("not_before"),
        rubric=document.get("rubric"),
        model=document.get("model"),
        metadata=document.get("metadata") or {},
        sequence=document.get("sequence"),
    )


def projected_event(routing_key: str, body: bytes) -> Projected | None:
    """The event a delivery of the projection's queue tells: a task event as it is, a command
    sent now as its task's acceptance (`accepted_event`), nothing for a later attempt's command
    (a retry, which `task.retrying` already told), a withdrawal as it is. Raises `KeyError` or
    `ValidationError`."""
    if routing_key == ScoreWithdrawn.routing_key:
        return ScoreWithdrawn.model_validate_json(body)
    if routing_key == ScoreText.routing_key:
        command = ScoreText.model_validate_json(body)
        return accepted_event(command) if command.attempt == 1 else None
    return parse_task_event(routing_key, body)
