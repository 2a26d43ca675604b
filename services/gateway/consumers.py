"""The gateway's broker adapters: events it keeps state from, and its background outbox."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from faststream.rabbit import RabbitBroker
from faststream.rabbit.message import RabbitMessage
from pydantic import ValidationError
from pymongo.errors import PyMongoError

from services.gateway.api import GatewayDeps
from services.gateway.errors import DatabaseUnavailable, Unavailable
from services.gateway.submit import Publisher, remember_result, sweep_outbox
from shared.contracts import TaskCompleted
from shared.runtime import consume, keep_trying
from shared.topology import RESULT_CACHE

log = logging.getLogger("scorebox.gateway")


def subscribe_result_cache(broker: RabbitBroker, deps: GatewayDeps) -> None:
    """Fill the result cache from `task.completed` events, and note each task's generation."""

    @consume(broker, RESULT_CACHE.queue)
    async def remember_completed_result(message: RabbitMessage) -> None:
        try:
            event = TaskCompleted.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("dead-lettering an unreadable task.completed: %s", error)
            await message.reject(requeue=False)
            return
        await keep_trying(
            lambda: deps.submissions.note_generation(event.task_id, event.generation),
            what=f"noting the generation of {event.task_id}",
            retry_on=(PyMongoError, DatabaseUnavailable),
        )
        await keep_trying(
            lambda: remember_result(
                event.task_id,
                event.result,
                submissions=deps.submissions,
                cache=deps.cache,
                now=deps.clock(),
            ),
            what=f"caching the result of {event.task_id}",
            retry_on=(PyMongoError, DatabaseUnavailable),
        )
        await message.ack()


async def keep_outbox_swept(deps: GatewayDeps, publisher: Publisher) -> None:
    """Send interrupted submissions at start-up and then periodically."""
    grace = timedelta(seconds=deps.settings.outbox_grace_s)
    while True:
        try:
            sent = await sweep_outbox(
                submissions=deps.submissions, publisher=publisher, clock=deps.clock, grace=grace
            )
            if sent:
                log.info("outbox sweep sent %d interrupted submission(s)", sent)
        except Unavailable as error:
            log.warning("outbox sweep postponed: %r", error)
        await asyncio.sleep(deps.settings.outbox_interval_s)
