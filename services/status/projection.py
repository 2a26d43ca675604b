"""The task projection: what a poll answers, built from `task.*` events.

An event is applied only when its sequence is higher than the one stored (a conditional
upsert: a stale event finds no matching document and its insert collides on `_id`), so
duplicates and out-of-order deliveries never move a task backwards.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from pymongo import ASCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError

from shared.contracts import (
    TaskAccepted,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskFailure,
    TaskRetrying,
    TaskStatus,
    TaskView,
)

Document = dict[str, Any]
Tasks = AsyncCollection[Document]


def tasks_collection(client: AsyncMongoClient[Document], database: str) -> Tasks:
    return client[database]["tasks"]


async def ensure_indexes(tasks: Tasks) -> None:
    # Finished tasks carry `expires_at`; MongoDB's TTL monitor removes them after it.
    await tasks.create_index([("expires_at", ASCENDING)], expireAfterSeconds=0)
    await tasks.create_index([("tenant_id", ASCENDING), ("created_at", ASCENDING)])


def _status_of(event: TaskEvent) -> TaskStatus:
    if (
        isinstance(event, TaskAccepted)
        and event.not_before
        and event.not_before > event.occurred_at
    ):
        return TaskStatus.SCHEDULED
    return event.status


def _fields_of(event: TaskEvent, *, finished_ttl: timedelta) -> Document:
    fields: Document = {
        "tenant_id": event.tenant_id,
        "status": _status_of(event).value,
        "sequence": event.sequence,
        "generation": event.generation,
        "attempts": event.attempt,
        "created_at": event.submitted_at,
        "updated_at": event.occurred_at,
        "next_attempt_at": None,
        "expires_at": None,
    }
    match event:
        case TaskAccepted():
            fields |= {
                "result": None,
                "error": None,
                "not_before": event.not_before,
                **_descriptive_fields(event),
            }
        case TaskRetrying():
            fields |= {
                "error": _failure(event.error.model_dump(), dead_lettered=False),
                "next_attempt_at": event.next_attempt_at,
            }
        case TaskCompleted():
            fields |= {
                "result": event.result.model_dump(mode="json"),
                "error": None,
                "expires_at": event.occurred_at + finished_ttl,
            }
        case TaskFailed():
            fields |= {
                "error": _failure(event.error.model_dump(), dead_lettered=event.dead_lettered),
                "expires_at": event.occurred_at + finished_ttl,
            }
    return fields


def _descriptive_fields(event: TaskAccepted) -> Document:
    return {"rubric": event.rubric, "model": event.model, "metadata": event.metadata}


def _failure(error: Document, *, dead_lettered: bool) -> Document:
    return {**error, "dead_lettered": dead_lettered}


async def apply_task_event(event: TaskEvent, *, tasks: Tasks, finished_ttl: timedelta) -> bool:
    """Apply `event` if it is newer than what the projection holds; True when applied."""
    fields = _fields_of(event, finished_ttl=finished_ttl)
    try:
        await tasks.update_one(
            {"_id": event.task_id, "sequence": {"$lt": event.sequence}},
            {"$set": fields},
            upsert=True,
        )
    except DuplicateKeyError:
        if isinstance(event, TaskAccepted):
            # A later event overtook the acceptance; its descriptive fields still belong.
            await tasks.update_one({"_id": event.task_id}, {"$set": _descriptive_fields(event)})
        return False
    return True


async def find_task(
    task_id: str, *, tenant_id: str, tasks: Tasks, now: datetime
) -> TaskView | None:
    """The task as its tenant sees it; None when unknown, another tenant's, or expired."""
    document = await tasks.find_one(
        {
            "_id": task_id,
            "tenant_id": tenant_id,
            "$or": [{"expires_at": None}, {"expires_at": {"$gt": now}}],
        }
    )
    if document is None:
        return None
    return _view_of(document)


def _view_of(document: Document) -> TaskView:
    error = document.get("error")
    return TaskView(
        task_id=document["_id"],
        status=TaskStatus(document["status"]),
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
    )
