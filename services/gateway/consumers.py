"""The gateway's broker adapters: events it keeps state from, and its background outbox."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from pydantic import ValidationError

from services.gateway.api import GatewayDeps
from services.gateway.batches import Batches
from services.gateway.errors import DatabaseUnavailable, Unavailable
from services.gateway.limits import OUTCOME_RETRY_DELAY_S
from services.gateway.refusals import write_off
from services.gateway.submit import (
    OutcomeProgress,
    Publisher,
    counting,
    settle_outcome,
    sweep_outbox,
)
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import parse_task_event
from shared.runtime import keep_trying
from shared.topology import GATEWAY_TASK_OUTCOMES

log = logging.getLogger("scorebox.gateway")


def subscribe_task_outcomes(
    broker: ScoreboxBroker, deps: GatewayDeps, *, retry_delay_s: float = OUTCOME_RETRY_DELAY_S
) -> None:
    """On `task.completed` or `task.failed`: release the task's in-flight slot; for a
    completion also note the task's generation and fill the result cache."""

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
            first_delay_s=retry_delay_s,
        )
        await message.ack()


async def keep_outbox_swept(deps: GatewayDeps, publisher: Publisher, batches: Batches) -> None:
    """Write off refused requests, then send interrupted submissions; at start-up and then
    periodically. A pass that fails otherwise than on an unavailable database or broker (a
    stored document that no longer reads, say) is logged and the next one runs all the same:
    it used to end this task silently, and with it every later write-off and sweep of the
    process."""
    grace = timedelta(seconds=deps.settings.outbox_grace_s)
    while True:
        try:
            written = await write_off(
                deps.refusals,
                submissions=deps.submissions,
                batches=batches,
                in_flight=counting(deps.in_flight),
                now=deps.clock(),
            )
            if written:
                log.info("wrote off %d refused request(s)", written)
        except Unavailable as error:
            log.warning("writing off refused requests postponed: %r", error)
        except Exception:  # logged; the next pass tries again
            log.exception("writing off refused requests failed; tried again next pass")
        try:
            sent = await sweep_outbox(
                submissions=deps.submissions,
                publisher=publisher,
                clock=deps.clock,
                grace=grace,
                refusals=deps.refusals,
            )
            if sent:
                log.info("outbox sweep sent %d interrupted submission(s)", sent)
        except Unavailable as error:
            log.warning("outbox sweep postponed: %r", error)
        except Exception:  # logged; the next pass tries again
            log.exception("outbox sweep failed; tried again next pass")
        await asyncio.sleep(deps.settings.outbox_interval_s)
