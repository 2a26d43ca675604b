"""What tenants asked to be told: callback URLs per task and failure-alert URLs per tenant.

Callbacks are event-carried state: `task.accepted` brings a task's `callback_url`. Events of
one task can arrive in any order (the gateway announces the acceptance after sending the
command, a cached result is announced together with its acceptance, and the broker orders
nothing across publishers), so a terminal event is kept with the task whatever it finds:
whichever of acceptance and outcome is recorded second sees the other and triggers the
delivery. Both are single-document atomic updates, so one of them always does; when both do,
the delivery id makes the second a duplicate the delivery ledger drops. An outcome that no
acceptance claims is forgotten after `WEBHOOK_UNCLAIMED_OUTCOME_TTL_S`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pymongo import ASCENDING, AsyncMongoClient, ReturnDocument

from shared.contracts import TaskCompleted, TaskFailed, parse_task_event

Document = dict[str, Any]
TaskOutcome = TaskCompleted | TaskFailed


@dataclass(frozen=True)
class Callback:
    """A task's callback URL, as registered by the tenant that submitted it."""

    task_id: str
    tenant_id: str
    url: str


def _outcome_key(event: TaskOutcome) -> str:
    return f"{event.status.value}_{event.sequence}"


def _loaded_outcome(stored: Document) -> TaskOutcome:
    event = parse_task_event(stored["routing_key"], stored["body"].encode())
    assert isinstance(event, TaskCompleted | TaskFailed)
    return event


class Callbacks:
    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._tasks = client[database]["task_callbacks"]

    async def ensure_indexes(self) -> None:
        await self._tasks.create_index([("expires_at", ASCENDING)], expireAfterSeconds=0)

    async def register(
        self, callback: Callback, *, now: datetime, retention: timedelta
    ) -> list[TaskOutcome]:
        """Remember a task's callback URL; returns the outcomes that arrived before it."""
        document = await self._tasks.find_one_and_update(
            {"_id": callback.task_id},
            {
                "$set": {
                    "tenant_id": callback.tenant_id,
                    "callback_url": callback.url,
                    "expires_at": now + retention,
                }
            },
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )
        assert document is not None
        outcomes = document.get("outcomes") or {}
        return [_loaded_outcome(stored) for stored in outcomes.values()]

    async def record_outcome(
        self, event: TaskOutcome, *, now: datetime, unclaimed_ttl: timedelta
    ) -> Callback | None:
        """Keep a terminal event with its task; returns the task's callback when known."""
        stored = {"routing_key": event.routing_key, "body": event.model_dump_json()}
        document = await self._tasks.find_one_and_update(
            {"_id": event.task_id},
            {
                "$set": {f"outcomes.{_outcome_key(event)}": stored},
                "$setOnInsert": {"tenant_id": event.tenant_id, "expires_at": now + unclaimed_ttl},
            },
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )
        assert document is not None
        url = document.get("callback_url")
        if not url:
            return None
        return Callback(task_id=event.task_id, tenant_id=document["tenant_id"], url=url)


class FailureAlerts:
    """Per tenant, the URL that receives every `task.failed` of that tenant: read when a task
    fails, and again at every attempt of its delivery (a change applies to retries)."""

    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._alerts = client[database]["failure_alerts"]

    async def url_of(self, tenant_id: str) -> str | None:
        document = await self._alerts.find_one({"_id": tenant_id})
        return None if document is None else str(document["url"])

    async def register(self, tenant_id: str, url: str, *, now: datetime) -> None:
        await self._alerts.update_one(
            {"_id": tenant_id}, {"$set": {"url": url, "updated_at": now}}, upsert=True
        )

    async def remove(self, tenant_id: str) -> bool:
        """Forget the tenant's failure-alert URL; False when there was none."""
        result = await self._alerts.delete_one({"_id": tenant_id})
        return result.deleted_count == 1
