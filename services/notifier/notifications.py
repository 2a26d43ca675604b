"""Turning task events into webhook deliveries: the notification consumer's handlers.

- `task.accepted` with a `callback_url`: remember it; deliver any outcome that overtook it.
- `task.completed` / `task.failed`: keep the outcome with its task and deliver it to the
  task's callback when one is known; a `task.failed` also goes to the tenant's failure-alert
  URL, when the tenant registered one (seed 1 §6.2: the failure alert rides this path).

A delivery's id (its `webhook-id`) is derived from what it reports (purpose, task, event and
sequence), so duplicate events, replays and the accepted/outcome race all map onto the same
ledger record, which lets exactly one copy through (`enqueue_delivery`).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from services.notifier.ledger import DeliveryState, Ledger
from services.notifier.registry import Callback, Callbacks, FailureAlerts, TaskOutcome
from shared.contracts import (
    DeliverWebhook,
    TaskAccepted,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    WebhookPurpose,
    rfc3339,
)

Clock = Callable[[], datetime]
Enqueue = Callable[[DeliverWebhook], Awaitable[None]]


@dataclass(frozen=True)
class NotificationDeps:
    callbacks: Callbacks
    alerts: FailureAlerts
    ledger: Ledger
    enqueue: Enqueue  # publishes a delivery command, confirmed by the broker
    clock: Clock
    max_attempts: int
    callback_retention: timedelta
    unclaimed_outcome_ttl: timedelta


def delivery_id(purpose: WebhookPurpose, event: TaskOutcome) -> str:
    """The `webhook-id` of reporting `event` for `purpose`: stable across copies of it."""
    key = f"scorebox:{purpose.value}:{event.task_id}:{event.routing_key}:{event.sequence}"
    return "msg_" + uuid.uuid5(uuid.NAMESPACE_URL, key).hex


def webhook_payload(event: TaskOutcome, purpose: WebhookPurpose) -> dict[str, Any]:
    """The Standard Webhooks body: `type`, `timestamp`, `data` (what a poll would show)."""
    result = event.result.model_dump(mode="json") if isinstance(event, TaskCompleted) else None
    error = None
    if isinstance(event, TaskFailed):
        error = {**event.error.model_dump(mode="json"), "dead_lettered": event.dead_lettered}
    return {
        "type": event.routing_key,
        "timestamp": rfc3339(event.occurred_at),
        "data": {
            "task_id": event.task_id,
            "status": event.status.value,
            "purpose": purpose.value,
            "attempts": event.attempt,
            # A re-score or a dead-letter replay runs the task again as its next generation,
            # and its outcome is POSTed too: the newer one has the higher sequence.
            "generation": event.generation,
            "sequence": event.sequence,
            "submitted_at": rfc3339(event.submitted_at),
            "finished_at": rfc3339(event.occurred_at),
            "result": result,
            "error": error,
            "status_url": f"/v1/scores/{event.task_id}",
        },
    }


def _delivery(
    event: TaskOutcome, *, purpose: WebhookPurpose, url: str, tenant_id: str, max_attempts: int
) -> DeliverWebhook:
    return DeliverWebhook(
        task_id=event.task_id,
        tenant_id=tenant_id,
        delivery_id=delivery_id(purpose, event),
        purpose=purpose,
        url=url,
        event_type=event.routing_key,
        payload=webhook_payload(event, purpose),
        max_attempts=max_attempts,
    )


async def when_task_accepted_remember_callback(
    event: TaskAccepted, *, deps: NotificationDeps
) -> list[DeliverWebhook]:
    """For outcomes of older producers, which do not carry the callback URL. New deployments
    do not route `task.accepted` to the notifier; one upgraded from an earlier version keeps
    that binding until an operator removes it, and is served here. A later generation's
    acceptance (a re-score, a DLQ replay) tells nothing new: the first one gave the URL."""
    if not event.callback_url or event.generation > 0:
        return []
    callback = Callback(task_id=event.task_id, tenant_id=event.tenant_id, url=event.callback_url)
    earlier = await deps.callbacks.register(
        callback, now=deps.clock(), retention=deps.callback_retention
    )
    return [_callback_delivery(callback, outcome, deps) for outcome in earlier]


async def when_task_finished_notify(
    event: TaskOutcome, *, deps: NotificationDeps
) -> list[DeliverWebhook]:
    deliveries = []
    callback = await _callback_of(event, deps)
    if callback is not None:
        deliveries.append(_callback_delivery(callback, event, deps))
    if isinstance(event, TaskFailed):
        alert_url = await deps.alerts.url_of(event.tenant_id)
        if alert_url is not None:
            deliveries.append(
                _delivery(
                    event,
                    purpose=WebhookPurpose.FAILURE_ALERT,
                    url=alert_url,
                    tenant_id=event.tenant_id,
                    max_attempts=deps.max_attempts,
                )
            )
    return deliveries


async def _callback_of(event: TaskOutcome, deps: NotificationDeps) -> Callback | None:
    if event.has_callback is None:
        # An event of an older producer: the URL came with `task.accepted`, which may arrive
        # after the outcome, so the outcome is kept with the task until it does.
        return await deps.callbacks.record_outcome(
            event, now=deps.clock(), unclaimed_ttl=deps.unclaimed_outcome_ttl
        )
    if event.has_callback and event.callback_url:
        return Callback(task_id=event.task_id, tenant_id=event.tenant_id, url=event.callback_url)
    return None


def _callback_delivery(
    callback: Callback, event: TaskOutcome, deps: NotificationDeps
) -> DeliverWebhook:
    return _delivery(
        event,
        purpose=WebhookPurpose.CALLBACK,
        url=callback.url,
        tenant_id=callback.tenant_id,
        max_attempts=deps.max_attempts,
    )


async def enqueue_delivery(delivery: DeliverWebhook, *, deps: NotificationDeps) -> bool:
    """Send a delivery on its way unless an earlier copy already did; True when sent."""
    record = await deps.ledger.register(delivery, now=deps.clock())
    if record.state is not DeliveryState.PENDING:
        return False
    # Two copies racing between `register` and `mark_queued` both publish; the delivery
    # consumer's claim lets one of them send.
    await deps.enqueue(delivery)
    await deps.ledger.mark_queued(delivery.delivery_id, now=deps.clock())
    return True


async def notify_about_task_event(event: TaskEvent, *, deps: NotificationDeps) -> int:
    """Record the event and enqueue the deliveries it calls for; returns how many were sent."""
    match event:
        case TaskAccepted():
            deliveries = await when_task_accepted_remember_callback(event, deps=deps)
        case TaskCompleted() | TaskFailed():
            deliveries = await when_task_finished_notify(event, deps=deps)
        case _:
            return 0
    sent = 0
    for delivery in deliveries:
        sent += await enqueue_delivery(delivery, deps=deps)
    return sent
