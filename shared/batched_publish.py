"""Completions published together: group commit for the scorer's outcomes.

Each delivery an event reaches costs the broker a quorum-queue round and every consumer a
decode and an acknowledgement, and a completion reaches three queues (the status
projection, the gateway's outcomes, the usage meter). `EventBatcher` sends completions
without a callback as one message per round trip: idle, a completion goes out at once, alone
and exactly as `publish_event` sends it; while a publish awaits its confirm, the completions
that arrive queue, and go out together (up to `max_batch`) once it is confirmed, as one
batch (`shared.event_batches`). No timer: a completion that finishes while a publish is in
flight waits for that confirm (one broker round trip at most) before its own; none waits
when nothing is in flight. The queue and its sender are `shared.coalescing.Coalescer`'s, as
the database's group writes are.

Only callback-less completions are batched: they route alike (`task.completed`, no callback
header) to the same queues. Every other event (a failure, a completion with a callback, a
retry, a start) is published alone at once, as before. Each caller awaits its own event's
confirm: a batch's failure fails every caller in it, and each caller's retry
(`keep_publishing`) sends its event again, alone or in a later batch; a batch that may have
been queued before its confirm was lost is then delivered twice, which every consumer of
events takes as a no-op. A caller cancelled while its event waits does not take it back: the
event is the attempt's recorded outcome, and goes out with the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

from shared.bus import message_headers, publish_event, send_raw
from shared.coalescing import Coalescer, Queued, settle
from shared.consumers import ScoreboxBroker
from shared.contracts import TaskCompleted, TaskEvent, new_id
from shared.event_batches import BATCH_HEADER, OneEvent, encode_batch
from shared.topology import EVENTS

if TYPE_CHECKING:
    from faststream.rabbit import RabbitBroker


def batchable(event: TaskEvent) -> TypeGuard[TaskCompleted]:
    """A completion the notifier does not take: it routes as every other such one does.
    One whose producer did not say (`has_callback` None) is not: the notifier looks it up."""
    return isinstance(event, TaskCompleted) and event.has_callback is False


class EventBatcher:
    """Publishes task events, callback-less completions together (see the module)."""

    def __init__(self, broker: RabbitBroker, *, timeout: float, max_batch: int) -> None:
        self._broker = broker
        self._timeout = timeout
        self._completions = (
            _Completions(broker, timeout=timeout, max_batch=max_batch) if max_batch > 1 else None
        )

    async def publish(self, event: TaskEvent) -> None:
        """Publish `event` and await its confirm (`shared.bus` errors when not confirmed)."""
        if self._completions is not None and batchable(event):
            await self._completions.submit(event)
        else:
            await publish_event(self._broker, event, timeout=self._timeout)


class _Completions(Coalescer[TaskCompleted, None]):
    """One publish at a time; what queued meanwhile goes out in the next (`Coalescer`)."""

    def __init__(self, broker: RabbitBroker, *, timeout: float, max_batch: int) -> None:
        super().__init__(max_batch=max_batch)
        self._broker = broker
        self._timeout = timeout

    async def _send(self, batch: list[Queued[TaskCompleted, None]]) -> None:
        events = [queued.op for queued in batch]
        if len(events) == 1:
            await publish_event(self._broker, events[0], timeout=self._timeout)
        else:
            await self._send_batch(events)
        for queued in batch:
            settle(queued, None)

    async def _send_batch(self, events: list[TaskCompleted]) -> None:
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
