"""The scorer's consumer of `score.cancel`: record a client's cancellation as the decision of
the task's next attempt unless its model call has started (`Attempts.cancel`), publish its
`task.failed` (confirmed), then ack.

- unreadable body: copied to the DLQ with the validation error, then ack; returned as
  failed instead when the broker refuses the copy for `LETTER_DEADLINE_S`;
- MongoDB away (a transient error): the write is tried again, backing off, while the delivery
  is held (`keep_trying`); a write it refuses for good, or a task whose document changed under
  every try (`CancelContended`), is returned as failed (`requeue_failed`), for the queue's
  delivery limit to dead-letter;
- too late (the model call under way, the generation finished, a newer one stored, or the
  generation re-scores a completed one, whose completion stands): logged, acked; the task
  ends as its attempt decides;
- the event not confirmed: published again until it is, the delivery held (`keep_publishing`).

Each cancellation recorded (or found recorded) and each too late is counted
(`scorebox_scorer_cancellations_total{outcome}`), the first before its event is published.
  A cancellation found recorded already (a repeated cancel) publishes its event again:
  every consumer of outcomes takes a repeat as a no-op.

The score path needs nothing of its own: the generation's next command collides with the
recorded decision and carries the failure out again instead of calling the model, or, once
this consumer noted the failure published (`Attempts.note_cancellation_published`), drops
itself (a delayed task's command, when due).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from faststream.rabbit import RabbitBroker
from pydantic import ValidationError
from pymongo.errors import PyMongoError

from services.scorer.attempts import Attempts, CancelContended, Cancelled, CancelResult
from services.scorer.decisions import Finish
from services.scorer.metrics import CANCELLED, TOO_LATE, ScorerMetrics
from shared.bus import BROKER_ERRORS, publish_event
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import CancelTask
from shared.dead_letters import own_channel
from shared.failed_deliveries import return_failed
from shared.runtime import keep_dead_lettering, keep_publishing, keep_trying_database
from shared.topology import TASK_CANCELS

log = logging.getLogger("scorebox.scorer")
# Cancellations are a read, a write and a publish each, sharing round trips when they come
# together. A batch's come together, up to 1,000, and race its items' scoring: with 8 in hand
# they went at the pace of the scoring, each found too late (found in a walkthrough).
CANCEL_PREFETCH = 64


@dataclass(frozen=True)
class TaskCancels:
    attempts: Attempts
    broker: RabbitBroker
    clock: Callable[[], datetime]
    timeout_s: float
    metrics: ScorerMetrics = field(default_factory=ScorerMetrics)

    async def on_message(self, message: Delivery) -> None:
        try:
            cancel = CancelTask.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("dead-lettering an unreadable score.cancel: %s", error)
            if await keep_dead_lettering(
                self.broker,
                TASK_CANCELS,
                message,
                error=f"unreadable score.cancel: {error}",
                timeout=self.timeout_s,
            ):
                await message.ack()  # else returned as failed: the broker refused the copy
            return
        try:
            outcome = await self._recorded(cancel)
        except (PyMongoError, CancelContended) as error:  # `_recorded` waits out an outage
            log.exception("the cancellation of %s was not recorded", cancel.task_id)
            await return_failed(
                self.broker, TASK_CANCELS, message, error=error, timeout=self.timeout_s
            )
            return
        if isinstance(outcome, Cancelled):
            self.metrics.count_cancellation(CANCELLED)
            event = outcome.decision.event
            log.info("%s cancelled (generation %d)", cancel.task_id, cancel.generation)
            await keep_publishing(
                lambda: publish_event(self.broker, event, timeout=self.timeout_s),
                what=f"the cancellation of {cancel.task_id}",
            )
            await self._note_published(cancel, outcome.decision)
        else:
            self.metrics.count_cancellation(TOO_LATE)
            # Counted; one line each at INFO was a thousand lines for a batch's cancel.
            log.debug("cancellation of %s too late: %s", cancel.task_id, outcome.reason)
        await message.ack()

    async def _note_published(self, cancel: CancelTask, decision: Finish) -> None:
        """Best effort: unnoted, the command's next delivery publishes the failure again,
        which every consumer of outcomes takes as a repeat."""
        try:
            await self.attempts.note_cancellation_published(cancel, decision)
        except PyMongoError as error:
            log.debug("the cancellation of %s not noted as published: %r", cancel.task_id, error)

    async def _recorded(self, cancel: CancelTask) -> CancelResult:
        return await keep_trying_database(
            lambda: self.attempts.cancel(cancel, now=self.clock()),
            what=f"recording the cancellation of {cancel.task_id}",
        )


# How long a starting scorer lets the cancellations queued before it consumes its work.
CANCELS_FIRST_S = 15.0
# How often it looks whether they are handled.
LOOK_EVERY_S = 0.05


async def cancels_handled_first(
    broker: ScoreboxBroker, *, within_s: float, timeout_s: float
) -> None:
    """Wait, up to `within_s`, for the cancellations queued to be handled before this
    scorer consumes `score.requested` (its `starts_after`). A scorer starting with both
    queues full (every replica was down while clients cancelled) handed its first
    deliveries to claims at once, and each cancellation that came after its claim found
    the call under way: 16 of 60 tasks cancelled while the scorers were down were scored
    (a walkthrough). Best effort: a cancellation sent as the wait ends still races."""
    if not await queue_settled(
        broker, TASK_CANCELS.queue.name, within_s=within_s, timeout_s=timeout_s
    ):
        log.warning(
            "scoring starts with cancellations still queued after %.0f s: those arriving "
            "after their task's claim are too late",
            within_s,
        )


async def queue_settled(
    broker: ScoreboxBroker, queue_name: str, *, within_s: float, timeout_s: float
) -> bool:
    """Whether this process's consumer of `queue_name` has nothing left, within `within_s`:
    no message ready in the queue and none in its handlers, at two looks `LOOK_EVERY_S`
    apart (one on its way to this process shows in neither). Each look is a passive
    declaration on a channel of its own (`own_channel`, as the DLQ looks are), bounded by
    what is left of the wait and by `timeout_s`; one that fails counts as not settled. A
    first version raised out of the scorer's start when the connection dropped, looked on
    the consumer's own channel (aiormq closed it at a look's timeout, and the cancels in
    hand came back counted), and kept its channel, whose robust copy of the queue answered
    every look after the first with the first one's count (reviews)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    quiet_looks = 0
    while (left := deadline - loop.time()) > 0:
        ready = await _ready(broker, queue_name, within_s=min(left, timeout_s))
        quiet = ready == 0 and broker.in_handlers(queue_name) == 0
        quiet_looks = quiet_looks + 1 if quiet else 0
        if quiet_looks == 2:
            return True
        await asyncio.sleep(min(LOOK_EVERY_S, max(0.0, deadline - loop.time())))
    return False


async def _ready(broker: ScoreboxBroker, queue_name: str, *, within_s: float) -> int | None:
    """The messages ready in the queue; None when the look failed or took `within_s`."""
    try:
        async with own_channel(broker, timeout_s=within_s, what=queue_name) as channel:
            async with asyncio.timeout(within_s):
                queue = await channel.get_queue(queue_name, ensure=False)  # passive
                declared = await queue.declare(timeout=within_s)
    except (*BROKER_ERRORS, RuntimeError) as error:  # aiormq: a channel of a closed connection
        log.debug("a look at %s failed: %r", queue_name, error)
        return None
    return int(declared.message_count or 0)


def subscribe_cancels(broker: ScoreboxBroker, cancels: TaskCancels) -> None:
    """Consume `scorebox.task-cancels`, `CANCEL_PREFETCH` deliveries at a time."""

    @consume(broker, TASK_CANCELS.queue, prefetch=CANCEL_PREFETCH)
    async def on_task_cancel(message: Delivery) -> None:
        await cancels.on_message(message)
