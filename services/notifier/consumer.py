"""The notifier's broker adapters: decode → handler → carry out the decision → ack.

`scorebox.notifications` (task events):
- recorded, deliveries enqueued (each confirmed by the broker): ack.
- unreadable (poison): copied to the DLQ with the validation error, then ack.
- MongoDB unavailable (a transient error, `shared.database_errors`): the event is sent
  through the wait ladder to come back in a few seconds (only to this queue, through
  `scorebox.due`; `database_retry_wait`), then ack.
- the handler crashed, a write the database refuses for good included (sent through the
  ladder uncounted, it came back for ever): returned as failed (`Delivery.requeue_failed`);
  the queue's delivery limit dead-letters a message that keeps crashing.

`scorebox.webhook-deliveries` (`DeliverWebhook`): see `deliveries.py` for the decisions (a
redelivery whose attempt another process holds is kept unacknowledged until its lease ends);
`Send` is published down the wait ladder when not yet due (a delivery whose destination has
`WEBHOOK_CONCURRENCY_PER_HOST` POSTs of this process in flight, or its tenant
`WEBHOOK_CONCURRENCY_PER_TENANT`, is sent again a second later this way, unclaimed and not
counted as an attempt), `GiveUp` is copied to the DLQ with
the reason in `x-scorebox-error`; a delivery its receiver refused (3xx, 4xx, an unsafe
destination) is recorded failed and acked, not dead-lettered; MongoDB unavailable (a
transient error) re-sends the command a little later. At the queue's delivery limit
(`x-delivery-count`), nothing is sent: the attempt's recorded decision is carried out, or
the delivery is recorded failed and dead-lettered with the reason (RabbitMQ would
dead-letter it unexplained if it came back once more), the database waited out with the
delivery held. A permanent database error is a crash (returned as failed, counted by the
delivery limit): re-sent uncounted, or held at the limit, it never ended.

A dead letter of this queue moved back to it (`is_moved_back_letter`: ours, with its reason
in `x-scorebox-error`, or RabbitMQ's, its `x-death` from this queue) is tried again first
(`try_moved_back_letter_again`), whatever delivery counts it carries (those of the copy
it was made of); the database away then is waited out with the letter held, as a copy sent
later would no longer be one.

Every publish awaits its confirm; one the broker does not confirm (away, blocked by an alarm,
a full queue) is tried again while the delivery is held (`keep_publishing`), then the
delivery is acked; a copy to the DLQ only for `LETTER_DEADLINE_S`, after which the delivery
is returned as failed instead, not acked (`keep_dead_lettering`), and a given-up delivery's
letter is not noted.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from faststream.rabbit import RabbitBroker
from pydantic import ValidationError
from pymongo.errors import PyMongoError

from services.notifier.deliveries import (
    NOT_YET_DUE,
    DeliveryDecision,
    DeliveryDeps,
    Done,
    GiveUp,
    Hold,
    Send,
    at_delivery_limit,
    deliver_once,
    try_moved_back_letter_again,
)
from services.notifier.notifications import NotificationDeps, notify_about_task_event
from shared.bus import publish_delayed
from shared.consumers import Delivery, Handler, ScoreboxBroker, consume
from shared.contracts import Contract, DeliverWebhook, new_id, parse_task_event
from shared.database_errors import transient_database_error
from shared.failed_deliveries import return_failed
from shared.runtime import HOLD_POLL_S, keep_dead_lettering, keep_publishing, wait_for_claim
from shared.topology import (
    ERROR_HEADER,
    EVENTS,
    NOTIFICATIONS,
    TASKS,
    WAIT_TIERS,
    WEBHOOK_DELIVERIES,
    WorkQueue,
    carried_deliveries,
    deliveries_lost,
    x_deaths,
)

log = logging.getLogger("scorebox.notifier")
Clock = Callable[[], datetime]
DATABASE_RETRY_DELAY = timedelta(seconds=5)
_TIERS = frozenset(tier for tier, _ in WAIT_TIERS)
# Why RabbitMQ dead-letters a message of a work queue (`x-death`): its delivery limit, or a
# reject without requeue. A retry's wait on the ladder dies too ("expired"), in a wait queue.
_BROKER_LETTER_REASONS = frozenset({"delivery_limit", "rejected"})


def database_retry_wait() -> timedelta:
    """How long an event or delivery the database failed waits before it comes back:
    DATABASE_RETRY_DELAY, give or take half. Without jitter, everything held through a
    MongoDB outage came back in lockstep, and hit the database again all at once."""
    return DATABASE_RETRY_DELAY * random.uniform(0.5, 1.5)  # noqa: S311 - jitter, not crypto


def event_key(routing_key: str) -> str:
    """The event's routing key, without the wait tier it carries after a trip down the ladder."""
    head, _, rest = routing_key.partition(".")
    return rest if head in _TIERS and rest else routing_key


async def send_delivery(
    broker: RabbitBroker,
    delivery: DeliverWebhook,
    *,
    timeout: float,
    now: datetime,
    headers: Mapping[str, Any] | None = None,
) -> None:
    """Publish a delivery command now, or down the wait ladder until its `not_before` (by
    `now`, the clock the delivery is judged due by), trying again until the broker confirms
    it."""
    await keep_publishing(
        lambda: publish_delayed(
            broker,
            delivery,
            exchange=TASKS,
            routing_key=DeliverWebhook.routing_key,
            not_before=delivery.not_before,
            timeout=timeout,
            now=now,
            headers=headers,
        ),
        what=f"webhook delivery {delivery.delivery_id}",
    )


async def _dead_letter(
    broker: RabbitBroker, queue: WorkQueue, message: Delivery, reason: str, timeout: float
) -> bool:
    """Copy the delivery to the DLQ; True when the caller is to ack it, False when the broker
    refused the copy until `LETTER_DEADLINE_S` and it was returned as failed instead."""
    return await keep_dead_lettering(broker, queue, message, error=reason, timeout=timeout)


def subscribe_notifications(
    broker: ScoreboxBroker, deps: NotificationDeps, *, timeout_s: float, clock: Clock
) -> None:
    @consume(broker, NOTIFICATIONS.queue)
    async def when_task_event_notify(message: Delivery) -> None:
        routing_key = event_key(message.routing_key)
        try:
            event = parse_task_event(routing_key, message.body)
        except (KeyError, ValidationError) as error:
            log.warning("dead-lettering an unreadable %r event: %s", routing_key, error)
            reason = f"unreadable event {routing_key!r}: {error}"
            if await _dead_letter(broker, NOTIFICATIONS, message, reason, timeout_s):
                await message.ack()
            return
        try:
            await notify_about_task_event(event, deps=deps)
        except Exception as error:
            if not transient_database_error(error):
                log.exception("notifying about %s of %s crashed", routing_key, event.task_id)
                await return_failed(broker, NOTIFICATIONS, message, error=error, timeout=timeout_s)
                return
            log.warning("MongoDB unavailable for %s of %s: %r", routing_key, event.task_id, error)
            await _come_back_later(broker, event, routing_key, clock=clock, timeout_s=timeout_s)
        await message.ack()


async def _come_back_later(
    broker: RabbitBroker, event: Contract, routing_key: str, *, clock: Clock, timeout_s: float
) -> None:
    # Through the ladder into `scorebox.due`, where only the notifications queue is bound to
    # task event keys: the other consumers of `scorebox.events` do not see the event again.
    later = clock() + database_retry_wait()
    await keep_publishing(
        lambda: publish_delayed(
            broker,
            event,
            exchange=EVENTS,
            routing_key=routing_key,
            not_before=later,
            timeout=timeout_s,
            now=clock(),
            through_ladder=True,  # a retry of the publish may find it due: still not to all
        ),
        what=f"{routing_key} for a later try",
    )


def is_moved_back_letter(headers: Mapping[str, Any]) -> bool:
    """Whether a webhook delivery is a dead letter of its queue moved back to it: one of ours
    (its reason in `ERROR_HEADER`, which no delivery sent otherwise carries), or one of
    RabbitMQ's from this queue (`x-death`)."""
    if ERROR_HEADER in headers:
        return True
    return any(
        death.get("queue") == WEBHOOK_DELIVERIES.name
        and death.get("reason") in _BROKER_LETTER_REASONS
        for death in x_deaths(headers)
    )


def subscribe_deliveries(
    broker: ScoreboxBroker, deps: DeliveryDeps, *, timeout_s: float
) -> Handler:
    """Consume the webhook deliveries; the handler registered is returned (a test calls it
    as the queue's consumer would)."""

    @consume(broker, WEBHOOK_DELIVERIES.queue)
    async def when_webhook_due_deliver(message: Delivery) -> None:
        try:
            delivery = DeliverWebhook.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("dead-lettering an unreadable webhook.deliver: %s", error)
            reason = f"unreadable webhook.deliver: {error}"
            if await _dead_letter(broker, WEBHOOK_DELIVERIES, message, reason, timeout_s):
                await message.ack()
            return
        deliveries = deliveries_lost(message.headers)
        # Handed out before, as this message or as the copy it was sent again for (its
        # deliveries carried): either way a consumer lost it, and the attempt may still be
        # held by that consumer's shielded try. A put-off redelivery's copy taken for a fresh
        # one was dropped where that try still held the attempt, and when the try then
        # crashed, nothing was left to see the attempt through (found in review).
        redelivered = message.redelivered or deliveries > 0
        moved_back = is_moved_back_letter(message.headers)
        limit_reason = None
        if deliveries >= WEBHOOK_DELIVERIES.delivery_limit:
            limit_reason = (
                f"delivered {deliveries + 1} times: its handler crashed or its consumer died or "
                f"lost its connection holding it {deliveries} times "
                f"(delivery limit {WEBHOOK_DELIVERIES.delivery_limit})"
            )
            log.warning("webhook %s at its delivery limit: %s", delivery.delivery_id, limit_reason)
        # Losing the broker connection cancels this handler, possibly mid-POST. Each try and
        # the carrying out of what it decided are shielded together: they complete, and the
        # redelivery (which waits for the attempt held here, then finds it decided) sends
        # nothing again; only the ack is lost. The waits between tries are not shielded: a
        # cancelled handler stops waiting.
        while isinstance(
            settled := await asyncio.shield(
                _try_and_carry_out(
                    broker,
                    delivery,
                    message,
                    deps,
                    redelivered=redelivered,
                    limit_reason=limit_reason,
                    moved_back=moved_back,
                    timeout_s=timeout_s,
                )
            ),
            Hold,
        ):
            # One at its delivery limit is held on, for as long as the stop's grace lasts: it
            # makes no POST, and left unsettled it came back past the limit for the broker to
            # dead-letter without a reason.
            hands_on = limit_reason is None
            if not await _still_held(broker, settled, deps.clock, hands_on=hands_on):
                # Handed on: a copy of its attempt (`copy_headers`), due when it was to try
                # again, and this one acked.
                later = delivery.model_copy(
                    update={"not_before": settled.until, "message_id": new_id()}
                )
                handed_on = Send(later, "held at a stop")
                settled = await _carry_out(
                    broker, handed_on, delivery, message, clock=deps.clock, timeout_s=timeout_s
                )
                break
            redelivered = True
        if settled is None:
            return  # given up, its dead letter refused: returned as failed already
        if settled:
            await message.ack()
        else:
            await message.requeue_failed()

    return when_webhook_due_deliver


async def _still_held(broker: ScoreboxBroker, held: Hold, clock: Clock, *, hands_on: bool) -> bool:
    """Wait for `held`'s turn to try again; False, for a delivery that `hands_on`, when the
    service is stopping (before the wait or during it): a try then could claim the attempt
    and POST with seconds of the stop's grace left, cut off before its outcome was recorded,
    and the next replica, once the lease of this dead process ended, POSTed it again (found
    in review). It is handed on instead: a copy of its attempt, due when it was to try again
    (its lost deliveries carried), and an ack."""
    if hands_on and broker.stopping:
        return False
    await wait_for_claim(held.until, clock)
    return not (hands_on and broker.stopping)


def copy_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """What a copy of this very message (the same attempt, sent again: put off, not yet due,
    held at a stop) takes along: the deliveries lost so far, and a moved-back letter's reason
    (`ERROR_HEADER`, `MOVED_BACK_REASON` for one of RabbitMQ's), so that the copy is still
    read as a letter: a copy without it, met by the record given up since, was dropped, and
    the operator's move-back came to nothing (found in review)."""
    carried = carried_deliveries(headers)
    if is_moved_back_letter(headers):
        carried[ERROR_HEADER] = str(headers.get(ERROR_HEADER, MOVED_BACK_REASON))
    return carried


# A letter of RabbitMQ's own (an `x-death`) names no reason of ours: its copy says this.
MOVED_BACK_REASON = "a dead letter of RabbitMQ's, moved back"


async def _try_and_carry_out(
    broker: RabbitBroker,
    delivery: DeliverWebhook,
    message: Delivery,
    deps: DeliveryDeps,
    *,
    redelivered: bool,
    limit_reason: str | None,
    moved_back: bool,
    timeout_s: float,
) -> bool | Hold | None:
    """One try, its decision carried out; Hold to wait and try again, False when it
    crashed, None when it gave the delivery up and the broker refused its dead letter (the
    delivery returned as failed already, `keep_dead_lettering`). With `limit_reason` (the
    message is at its delivery limit), no POST: the attempt's recorded decision, or giving
    it up (`at_delivery_limit`). A letter `moved_back` is first tried again as a fresh
    round (`try_moved_back_letter_again`)."""
    decision: DeliveryDecision
    try:
        tried = await _try(
            delivery,
            deps,
            redelivered=redelivered,
            limit_reason=limit_reason,
            moved_back=moved_back,
        )
        if isinstance(tried, Hold):
            return tried
        decision = tried
    except Exception as error:
        if not transient_database_error(error):
            log.exception("delivering %s crashed", delivery.delivery_id)
            return False
        if limit_reason is not None or moved_back:
            # Waited out, the delivery held: a copy sent later would start its delivery count
            # again, and taken for "nothing decided" it would drop a decided retry; a copy of
            # a letter moved back would lack the letter's headers, and be dropped as given up.
            log.warning(
                "MongoDB unavailable for delivery %s (%s), held: %r",
                delivery.delivery_id,
                "at its delivery limit" if limit_reason is not None else "moved back",
                error,
            )
            return Hold(deps.clock() + timedelta(seconds=HOLD_POLL_S))
        log.warning("MongoDB unavailable for delivery %s: %r", delivery.delivery_id, error)
        later = deps.clock() + database_retry_wait()
        update = {"not_before": later, "message_id": new_id()}
        decision = Send(delivery.model_copy(update=update), "database unavailable")
    if not await _carry_out(
        broker, decision, delivery, message, clock=deps.clock, timeout_s=timeout_s
    ):
        return None  # not noted as lettered: a copy that comes back letters it again
    if isinstance(decision, GiveUp):
        await _note_lettered(delivery, deps)
    return True


async def _try(
    delivery: DeliverWebhook,
    deps: DeliveryDeps,
    *,
    redelivered: bool,
    limit_reason: str | None,
    moved_back: bool,
) -> DeliveryDecision | Hold:
    if moved_back and (tried_again := await try_moved_back_letter_again(delivery, deps)):
        return tried_again
    if limit_reason is None:
        return await deliver_once(delivery, deps, redelivered)
    return await at_delivery_limit(delivery, deps, reason=limit_reason)


async def _note_lettered(delivery: DeliverWebhook, deps: DeliveryDeps) -> None:
    """Every copy of a given-up attempt dead-lettered it again, a fresh duplicate too (the
    enqueue race, a copy put off, a replayed retry): one alert per copy for one delivery
    (found in review). Noted once the letter is confirmed; should the note fail, a later
    copy letters it again, as every copy did."""
    try:
        await deps.ledger.mark_lettered(delivery, now=deps.clock())
    except PyMongoError as error:
        log.warning("could not note %s as dead-lettered: %r", delivery.delivery_id, error)


async def _carry_out(
    broker: RabbitBroker,
    decision: DeliveryDecision,
    delivery: DeliverWebhook,
    message: Delivery,
    *,
    clock: Clock,
    timeout_s: float,
) -> bool:
    """Carry a decision out: True, or False when a give-up's dead letter was refused and the
    delivery returned as failed instead."""
    match decision:
        case Done(reason=reason):
            log.info("webhook %s (%s): %s", delivery.delivery_id, delivery.event_type, reason)
        case Send(command=command, reason=reason):
            # A hop down the wait ladder at DEBUG: a line every few seconds per delivery
            # waiting to be retried (found in a walkthrough: 62 lines for 4 deliveries).
            level = logging.DEBUG if reason == NOT_YET_DUE else logging.INFO
            log.log(
                level, "webhook %s attempt %d: %s", delivery.delivery_id, delivery.attempt, reason
            )
            # A copy of this attempt (put off, the database away) carries the deliveries lost
            # so far; a next attempt is a new message.
            same = command.attempt == delivery.attempt
            carried = copy_headers(message.headers) if same else None
            await send_delivery(broker, command, timeout=timeout_s, now=clock(), headers=carried)
        case GiveUp(reason=reason):
            log.warning("webhook %s dead-lettered: %s", delivery.delivery_id, reason)
            return await _dead_letter(broker, WEBHOOK_DELIVERIES, message, reason, timeout_s)
    return True
