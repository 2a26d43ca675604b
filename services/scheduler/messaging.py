"""The scheduler's outbound messages and broker probes; every call has its timeout.

- `publish_run`: a `RunCronJob` to `scorebox.cron` (or down the wait ladder when it is a retry
  not yet due).
- `publish_rescore_page`: one `RescoreTask` per entry of a page, all confirms awaited together;
  those of tasks the result cache answered through the re-score requests' wait queue
  (`CACHED_RESCORES_AFTER`).
- `announce`: an operations event on `scorebox.events` under the event's own routing key.
- `dead_letter_depth`: a DLQ's depth by passive declare (no side effect on the queue).

Each step on the broker is bounded as a whole by `asyncio.timeout` as well: aio-pika's own
`timeout` covers only the round trip (after waiting without end for a lost connection to
come back), and some calls take none (the first passive declare of a queue, a `nack`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

import aiormq
from aio_pika.abc import AbstractIncomingMessage
from faststream.rabbit import RabbitBroker
from pamqp.commands import Basic

from services.scheduler.errors import DownstreamFull, TransientJobError
from services.scheduler.jobs import Clock
from shared.bus import (
    BROKER_ERRORS,
    publish_delayed,
    publish_ops_event,
    publish_through_wait_queue,
)
from shared.contracts import Contract, OpsEvent, RescoreTask, RunCronJob
from shared.dead_letters import dead_lettered_at, own_channel
from shared.topology import (
    CRON,
    RESCORE_REQUESTS,
    RESCORES_WAIT,
    RESCORES_WAIT_TIER,
    SCORE_REQUESTS,
    TASKS,
    USAGE_RETRY_ROUTING_KEY,
    WorkQueue,
)

log = logging.getLogger("scorebox.scheduler.messaging")

# The requests of tasks the result cache answered reach the gateway this much later than the
# others (the TTL of the re-score requests' wait queue, `RESCORES_WAIT`): by then the task
# scored with the same text most often has its new result, and the gateway answers them from
# the cache instead of the model. Sent together, the copies were looked up before that
# result existed, and nearly all missed (session 54).
CACHED_RESCORES_AFTER: Final = timedelta(seconds=RESCORES_WAIT_TIER[1])
# The queues counted against `FANOUT_MAX_BACKLOG`: the requests waiting for the scorers, and
# the re-score requests waiting to come back as such (each one, unless the cache answers
# it). Not counted, the fan-out's bound let a large run put any number of the cache's
# re-scores on the ladder (the re-read of that change).
COUNTED_AS_BACKLOG: Final = (SCORE_REQUESTS.name, RESCORE_REQUESTS.name, RESCORES_WAIT)


@dataclass(frozen=True)
class SchedulerBus:
    broker: RabbitBroker
    timeout_s: float
    clock: Clock
    # Score and re-score requests waiting above which the fan-out publishes no more pages
    # (`FANOUT_MAX_BACKLOG`); None: only a full re-score queue holds it back.
    max_backlog: int | None = None

    async def publish_run(
        self, command: RunCronJob, *, headers: Mapping[str, Any] | None = None
    ) -> None:
        await publish_delayed(
            self.broker,
            command,
            exchange=CRON,
            routing_key=command.routing_key,
            not_before=command.not_before,
            timeout=self.timeout_s,
            now=self.clock(),
            headers=headers,
        )

    async def publish_rescore_page(self, page: Sequence[RescoreTask]) -> None:
        """Publish a page with its confirms in flight together: one round trip per page.

        Raises `DownstreamFull` when the page would take the requests waiting for the scorers
        past `max_backlog`, or when the broker refuses one (a negative confirm: with the
        queue's `reject-publish`, the re-score queue is full), and `TransientJobError` when
        one is unroutable (returned: no queue bound, until the topology is declared again),
        which no wait for room cures: the run's attempts are counted. The
        gateway drains the re-score queue into the score queue as fast as it can, so behind a
        slow scorer it is the score queue that fills: refused there, each request spent its
        retries in minutes and ended in a dead-letter queue, marked as requested, never
        scored, while every client submission met a full queue too."""
        await self._make_sure_of_room(len(page))
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.gather(*(self._publish_rescore(task) for task in page))
        except aiormq.exceptions.DeliveryError as error:
            if refused_for_room(error):
                raise DownstreamFull(
                    f"{RESCORE_REQUESTS.name} refused a re-score request"
                ) from error
            raise TransientJobError(
                f"a re-score request ({RescoreTask.routing_key!r}) reached no queue: {error!r}"
            ) from error

    async def _publish_rescore(self, task: RescoreTask) -> None:
        if task.answered_from_cache:
            await publish_through_wait_queue(
                self.broker,
                task,
                tier=RESCORES_WAIT_TIER[0],
                routing_key=task.routing_key,
                timeout=self.timeout_s,
            )
        else:
            await publish_delayed(
                self.broker,
                task,
                exchange=TASKS,
                routing_key=task.routing_key,
                not_before=None,
                timeout=self.timeout_s,
                now=self.clock(),
            )

    async def announce(self, event: OpsEvent) -> None:
        await publish_ops_event(self.broker, event, timeout=self.timeout_s)

    async def retry_usage_event(
        self, event: Contract, *, not_before: datetime, headers: Mapping[str, Any]
    ) -> None:
        """Send a usage event the meter could not store back to the meter, after a delay."""
        await publish_delayed(
            self.broker,
            event,
            exchange=TASKS,
            routing_key=USAGE_RETRY_ROUTING_KEY,
            not_before=not_before,
            timeout=self.timeout_s,
            now=self.clock(),
            headers=headers,
        )

    async def _make_sure_of_room(self, wanted: int) -> None:
        if self.max_backlog is None:
            return
        waiting = await self._waiting(COUNTED_AS_BACKLOG)
        if waiting + wanted > self.max_backlog:
            raise DownstreamFull(
                f"{waiting} score and re-score requests wait for the scorers, or in "
                f"{RESCORES_WAIT} (FANOUT_MAX_BACKLOG {self.max_backlog})"
            )

    async def _waiting(self, queue_names: Sequence[str]) -> int:
        """The messages ready in these queues, by passive declarations (fresh counts on each
        call) on a channel of the consuming connection (`own_channel`), as the DLQ looks
        go. On the publishing connection's channel, a queue an operator deleted had the
        broker close the channel every publish goes through; and a publishing connection
        blocked by an alarm held the look until the alarm cleared."""
        what = ", ".join(queue_names)
        async with own_channel(self.broker, timeout_s=self.timeout_s, what=what) as channel:
            async with asyncio.timeout(self.timeout_s):
                ready = 0
                for name in queue_names:
                    queue = await channel.get_queue(name, ensure=False)  # a passive declare
                    declared = await queue.declare(timeout=self.timeout_s)
                    ready += int(declared.message_count or 0)
        return ready

    async def dead_letter_depth(self, work_queue: WorkQueue) -> tuple[int, float | None]:
        """(depth, age in seconds of the oldest dead letter) of a work queue's DLQ.

        Both on a channel of the consuming connection (`own_channel`): on the publishing
        one, which a memory or disk alarm blocks once it has published, the depth read waited
        out the alarm, and the report with it, when the letters raised the alarm.

        The head is read with `basic.get` and returned with `nack(requeue=True)`, which
        RabbitMQ 3.x and 4.0 to 4.2 count as a delivery: harmless against the DLQ's own limit
        (`DLQ_DELIVERY_LIMIT`, out of any look's reach). The head is held on a channel of its
        own, closed after the look (`own_channel`): on the shared channel, a return that
        failed, or a head whose `basic.get` answer came late, stayed held, out of every
        dead-letter walk's sight, until that channel closed.
        """
        name = work_queue.dead_letter_routing_key
        async with own_channel(self.broker, timeout_s=self.timeout_s, what=name) as channel:
            async with asyncio.timeout(self.timeout_s):
                queue = await channel.get_queue(name, ensure=False)  # a passive declare:
                declared = await queue.declare(timeout=self.timeout_s)
                depth = int(declared.message_count or 0)
                if depth == 0:
                    return 0, None
                head = await queue.get(no_ack=False, fail=False, timeout=self.timeout_s)
            if head is None:
                return depth, None
            try:
                return depth, _age_s(head, self.clock())
            finally:
                await self._give_back(head, work_queue)

    async def _give_back(self, head: AbstractIncomingMessage, work_queue: WorkQueue) -> None:
        """Return a DLQ's head read for its age, within the broker timeout. Unbounded, a
        `nack` on a stalled channel held the housekeeping run, and every report after it, for
        as long as the stall lasted. A return that fails is left to the broker, which gives
        back what a channel held when the channel closes (the look's own, next): the reading
        stands."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await head.nack(requeue=True)
        except BROKER_ERRORS as error:
            log.warning(
                "the head of %s read for its age is left to the broker to return: %r",
                work_queue.dead_letter_routing_key,
                error,
            )


def refused_for_room(error: aiormq.exceptions.DeliveryError) -> bool:
    """Whether the broker answered the publish with a negative confirm (`basic.nack`): with
    `reject-publish` overflow, a full queue. An unroutable mandatory message comes back as a
    `basic.return` instead (`aiormq.exceptions.PublishError`)."""
    return isinstance(error.frame, Basic.Nack)


def _age_s(message: AbstractIncomingMessage, now: datetime) -> float | None:
    """Since it was dead-lettered (`dead_lettered_at`, as the DLQ listings read it: one of
    ours by its timestamp, though it carries a wait-ladder `x-death` of an earlier retry;
    one RabbitMQ dead-lettered by its `x-death`)."""
    when = dead_lettered_at(message, now)
    if when is None:
        return None
    return max(0.0, (now - when).total_seconds())
