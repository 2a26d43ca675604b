"""What the scorer sends again itself (a copy turned away at a stop, a retry's next attempt)
goes to the score queue alone: the status projection has had the task from its first
command, and a copy reaching it after the task's record had expired recorded the task
afresh, `queued` for seven days, a cancelled one among them (review of cancellation)."""

from __future__ import annotations

import aio_pika
import pytest

from services.scorer.consumer import BrokerActions
from services.scorer.decisions import Retry
from shared.bus import publish_command
from shared.contracts import (
    Phase,
    ScoreText,
    TaskError,
    TaskRetrying,
    event_sequence,
    new_id,
    utcnow,
)
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import SCORE_REQUESTS, STATUS_PROJECTION, declare_topology
from tests.support import HandedDelivery, eventually

pytestmark = pytest.mark.integration


async def _depths(amqp_url: str) -> tuple[int, int]:
    """(messages ready in the score queue, in the status projection's queue)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        depths = []
        for queue in (SCORE_REQUESTS.queue, STATUS_PROJECTION.queue):
            declared = await channel.declare_queue(queue.name, passive=True, timeout=10)
            depths.append(declared.declaration_result.message_count or 0)
        return depths[0], depths[1]


async def _emptied(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        for queue in (SCORE_REQUESTS.queue, STATUS_PROJECTION.queue):
            await (await channel.get_queue(queue.name)).purge(timeout=10)


async def test_a_command_the_scorer_sends_again_reaches_the_scorer_alone(amqp_url: str) -> None:
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    try:
        await declare_topology(broker)
        await _emptied(amqp_url)
        command = ScoreText(
            task_id=new_id(), tenant_id="t", text="Sent again.", submitted_at=utcnow()
        )
        await publish_command(
            broker, command, now=utcnow(), timeout=10
        )  # the gateway's: both take it

        async def both_have_the_first() -> tuple[int, int] | None:
            depths = await _depths(amqp_url)
            return depths if depths == (1, 1) else None

        await eventually(both_have_the_first, what="the first command in both queues")
        actions = BrokerActions(broker=broker, timeout_s=10, clock=utcnow)
        await actions.resend(command.model_copy(update={"message_id": new_id()}), headers={})

        async def the_copy_queued() -> tuple[int, int] | None:
            depths = await _depths(amqp_url)
            return depths if depths[0] == 2 else None

        assert await eventually(the_copy_queued, what="the copy in the score queue") == (2, 1)
        retrying = TaskRetrying(
            task_id=command.task_id,
            tenant_id=command.tenant_id,
            sequence=event_sequence(generation=0, attempt=1, phase=Phase.RETRYING),
            attempt=1,
            submitted_at=command.submitted_at,
            error=TaskError(code="model_unavailable", message="down", retryable=True),
            next_attempt_at=utcnow(),
        )
        following = command.model_copy(update={"attempt": 2, "message_id": new_id()})
        retry = Retry(event=retrying, next_command=following)
        await actions.carry_out(retry, HandedDelivery(command.model_dump_json().encode()))

        async def the_next_attempt_queued() -> tuple[int, int] | None:
            depths = await _depths(amqp_url)
            return depths if depths[0] == 3 and depths[1] >= 2 else None

        # The projection takes the `task.retrying`, not the next attempt's command.
        await eventually(the_next_attempt_queued, what="the next attempt and its event")
        assert await _depths(amqp_url) == (3, 2)
    finally:
        await broker.stop()
