"""Completions published together: group commit for the scorer's outcomes.

Each delivery an event reaches costs the broker a quorum-queue round and every consumer a
decode and an acknowledgement, and a completion reaches three queues (the status
projection, the gateway's outcomes, the usage meter). `EventBatcher` sends completions
without a callback as one message per round trip: idle, a completion goes out at once, alone
and exactly as `publish_event` sends it; while a publish awaits its confirm, the completions
that arrive queue, and go out together (up to `max_batch`) once it is confirmed, as one
batch (`shared.event_batches`). No timer, so no latency is added when nothing queues.

Only callback-less completions are batched: they route alike (`task.completed`, no callback
header) to the same queues. Every other event (a failure, a completion with a callback, a
retry, a start) is published alone at once, as before. Each caller awaits its own event's
confirm: a batch's failure fails every caller in it, and each caller's retry
(`keep_publishing`) sends its event again, alone or in a later batch; a batch that may have
been queued before its confirm was lost is then delivered twice, which every consumer of
events takes as a no-op. A caller cancelled before its batch went out sends nothing.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from shared.bus import PublishUnconfirmed, message_headers, publish_event, send_raw
from shared.consumers import ScoreboxBroker
from shared.contracts import TaskCompleted, TaskEvent, new_id
from shared.event_batches import BATCH_HEADER, OneEvent, encode_batch
from shared.topology import EVENTS

if TYPE_CHECKING:
    from faststream.rabbit import RabbitBroker


_Queued = tuple[TaskCompleted, "asyncio.Future[None]"]


def batchable(event: TaskEvent) -> bool:
    """A completion the notifier does not take: it routes as every other such one does.
    One whose producer did not say (`has_callback` None) is not: the notifier looks it up."""
    return isinstance(event, TaskCompleted) and event.has_callback is False


class EventBatcher:
    """Publishes task events, callback-less completions together (see the module)."""

    def __init__(self, broker: RabbitBroker, *, timeout: float, max_batch: int) -> None:
        self._broker = broker
        self._timeout = timeout
        self._max_batch = max_batch
        self._queued: list[_Queued] = []
        self._sender: asyncio.Task[None] | None = None

    async def publish(self, event: TaskEvent) -> None:
        """Publish `event` and await its confirm (`shared.bus` errors when not confirmed)."""
        if self._max_batch == 1 or not isinstance(event, TaskCompleted) or not batchable(event):
            await publish_event(self._broker, event, timeout=self._timeout)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._queued.append((event, waiter))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_queued())
        await waiter

    async def _send_queued(self) -> None:
        try:
            while self._queued:
                taken = self._queued[: self._max_batch]
                del self._queued[: self._max_batch]
                waiting = [(event, waiter) for event, waiter in taken if not waiter.done()]
                if waiting:
                    await self._send_settling(waiting)
        finally:
            self._sender = None

    async def _send_settling(self, waiting: list[_Queued]) -> None:
        try:
            await self._send([event for event, _ in waiting])
        except BaseException as error:
            failure = (
                error if isinstance(error, Exception) else PublishUnconfirmed("publisher stopped")
            )
            for _, waiter in waiting:
                if not waiter.done():
                    waiter.set_exception(failure)
            if not isinstance(error, Exception):
                raise
            return
        for _, waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    async def _send(self, events: list[TaskCompleted]) -> None:
        if len(events) == 1:
            await publish_event(self._broker, events[0], timeout=self._timeout)
            return
        body, parts = encode_batch(
            [
                OneEvent(e.model_dump_json().encode(), e.message_id, e.task_id, e.tenant_id)
                for e in events
            ]
        )
        headers = message_headers(events[0])
        del headers["x-tenant-id"]  # each part's own (`shared.event_batches`)
        headers[BATCH_HEADER] = parts
        await send_raw(
            self._broker,
            body,
            exchange=EVENTS,
            routing_key=TaskCompleted.routing_key,
            timeout=self._timeout,
            message_id=new_id(),
            correlation_id=None,
            headers=headers,
        )
        if isinstance(self._broker, ScoreboxBroker):
            self._broker.metrics.events_per_batch.observe(len(events))
