"""The gateway's broker adapters: events it keeps state from, and its background outbox."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from datetime import timedelta

from pydantic import ValidationError

from services.gateway.api import GatewayDeps
from services.gateway.batch_expiry import hold_unsent_batches
from services.gateway.batches import Batches
from services.gateway.errors import DatabaseUnavailable, Unavailable, database_away
from services.gateway.limits import OUTCOME_RETRY_DELAY_S
from services.gateway.refusals import write_off
from services.gateway.submit import (
    HeldBatches,
    OutcomeProgress,
    Publisher,
    counting,
    settle_outcome,
    sweep_outbox,
)
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import parse_task_event
from shared.failed_deliveries import return_failed
from shared.runtime import keep_trying
from shared.topology import GATEWAY_TASK_OUTCOMES

log = logging.getLogger("scorebox.gateway")


def subscribe_task_outcomes(
    broker: ScoreboxBroker,
    deps: GatewayDeps,
    *,
    broker_timeout_s: float,
    retry_delay_s: float = OUTCOME_RETRY_DELAY_S,
) -> None:
    """On `task.completed` or `task.failed`: release the task's in-flight slot and note the
    generation that finished (one write); for a completion also note the task's generation
    and fill the result cache.

    A database that is away is waited out with the delivery held; an operation it refuses
    for good (`database_away`) returns the delivery as failed, dead-lettered with the reason at
    its queue's delivery limit (`return_failed`): waited out, it held the delivery for ever."""

    @consume(broker, GATEWAY_TASK_OUTCOMES.queue)
    async def take_task_outcome(message: Delivery) -> None:
        routing_key = message.routing_key
        try:
            event = parse_task_event(routing_key, message.body)
        except (KeyError, ValidationError) as error:
            log.warning("dead-lettering an unreadable %r outcome: %s", routing_key, error)
            await message.reject(requeue=False)
            return
        progress = OutcomeProgress()
        try:
            await keep_trying(
                lambda: settle_outcome(
                    event,
                    submissions=deps.submissions,
                    in_flight=deps.in_flight,
                    cache=deps.cache,
                    now=deps.clock(),
                    progress=progress,
                ),
                what=f"settling the outcome of {event.task_id}",
                retry_on=(DatabaseUnavailable,),
                retry_if=database_away,
                first_delay_s=retry_delay_s,
            )
        except DatabaseUnavailable as error:
            log.exception(
                "the database refused the outcome of %s; returned as failed", event.task_id
            )
            await return_failed(
                broker,
                GATEWAY_TASK_OUTCOMES,
                message,
                error=error.__cause__ or error,
                timeout=broker_timeout_s,
            )
            return
        await message.ack()


async def keep_outbox_swept(deps: GatewayDeps, publisher: Publisher, batches: Batches) -> None:
    """Write off refused requests, send interrupted submissions, then hold the batches that
    still have items to send; at start-up and then periodically. A step that fails otherwise
    than on an unavailable database or broker (a stored document that no longer reads, say)
    is logged and the next one runs all the same: it used to end this task silently, and
    with it every later write-off and sweep of the process."""
    settings = deps.settings
    grace = timedelta(seconds=settings.outbox_grace_s)
    retention = timedelta(seconds=settings.idempotency_ttl_s)
    held_for_replays = HeldBatches()
    while True:
        await write_off_refused(deps, batches)
        sent = await _step(
            "outbox sweep",
            sweep_outbox(
                submissions=deps.submissions,
                publisher=publisher,
                clock=deps.clock,
                grace=grace,
                refusals=deps.refusals,
                retention=retention,
                batches=batches,
                held=held_for_replays,
            ),
        )
        if sent:
            log.info("outbox sweep sent %d interrupted submission(s)", sent)
        held = await _step(
            "holding batches with unsent items",
            hold_unsent_batches(
                batches=batches,
                submissions=deps.submissions,
                now=deps.clock(),
                retention=retention,
                in_progress_for=grace,
            ),
        )
        if held:
            log.info("held %d batch(es) with items still to send", held)
        await asyncio.sleep(settings.outbox_interval_s)


async def write_off_refused(deps: GatewayDeps, batches: Batches) -> int:
    """Write off the requests refused since the last pass (`refusals.write_off`); how many."""
    written = await _step(
        "writing off refused requests",
        write_off(
            deps.refusals,
            submissions=deps.submissions,
            batches=batches,
            in_flight=counting(deps.in_flight),
            now=deps.clock(),
        ),
    )
    if written:
        log.info("wrote off %d refused request(s)", written)
    return written


async def write_off_before_stopping(
    deps: GatewayDeps, batches: Batches, *, within_s: float
) -> None:
    """The stop's last write-off, bounded by `within_s`: the refusals are kept in memory
    only, and a refusal not written off leaves its submission to be sent by any replica's
    sweep, a request answered 503 then scored (twice, when its client sent it again without
    an `Idempotency-Key`)."""
    try:
        async with asyncio.timeout(within_s):
            await write_off_refused(deps, batches)
    except TimeoutError:
        pass
    if left := deps.refusals.pending():
        task_ids = [task_id for refusal in left for task_id in refusal.task_ids]
        log.warning(
            "stopping with %d refused request(s) not written off: the outbox sweep may send "
            "their %d task(s) (%s%s)",
            len(left),
            len(task_ids),
            ", ".join(task_ids[:10]),
            ", ..." if len(task_ids) > 10 else "",
        )


async def _step(what: str, step: Awaitable[int]) -> int:
    """One step of a sweep pass; what it counted, or 0 when it failed (logged)."""
    try:
        return await step
    except Unavailable as error:
        log.warning("%s postponed: %r", what, error)
    except Exception:  # logged; the next pass tries again
        log.exception("%s failed; tried again next pass", what)
    return 0
