"""The fan-out's page publish tells a full queue from an unroutable request, on the real
broker (a vhost of this module, with only the queues each test binds).

A negative confirm (`basic.nack`: a full queue with `reject-publish`) is back-pressure,
`DownstreamFull`, which the run waits out without counting attempts. A returned request
(`basic.return`: no queue bound to its routing key) is no lack of room: it was waited out
for up to six hours all the same, attempts not counted, before it became a failure like any
other (`TransientJobError`: retried with back-off, then dead-lettered).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aio_pika
import aiormq
import pytest

from services.scheduler.errors import DownstreamFull, TransientJobError
from services.scheduler.messaging import SchedulerBus
from services.scheduler.settings import SchedulerSettings
from shared.consumers import ScoreboxBroker
from shared.contracts import RescoreTask, ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import TASKS
from tests.support import rescore_request

TIMEOUT_S = 30.0
FULL_QUEUE = "scorebox-test.rescore-always-full"


def _page(size: int) -> list[RescoreTask]:
    return [rescore_request(ScoreText(task_id=new_id(), text="Again.")) for _ in range(size)]


@pytest.fixture
async def broker(amqp_url: str) -> AsyncIterator[ScoreboxBroker]:
    """Connected, with `scorebox.tasks` declared and no queue bound to it."""
    connected = make_broker(SchedulerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with connected:
        await connected.connect()
        await connected.declare_exchange(TASKS)
        yield connected


async def test_an_unroutable_request_is_a_failure_and_not_a_full_queue(
    broker: ScoreboxBroker,
) -> None:
    bus = SchedulerBus(broker, timeout_s=TIMEOUT_S, clock=utcnow)

    with pytest.raises(TransientJobError) as raised:
        await bus.publish_rescore_page(_page(2))

    assert not isinstance(raised.value, DownstreamFull), raised.value
    assert isinstance(raised.value.__cause__, aiormq.exceptions.PublishError)


async def test_a_queue_refusing_the_request_is_a_full_queue(
    amqp_url: str, broker: ScoreboxBroker
) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            FULL_QUEUE,
            exclusive=True,  # RabbitMQ 4.3 refuses transient queues that are not exclusive
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
        await queue.bind(TASKS.name, routing_key=RescoreTask.routing_key)
        try:
            bus = SchedulerBus(broker, timeout_s=TIMEOUT_S, clock=utcnow)
            with pytest.raises(DownstreamFull) as raised:
                await bus.publish_rescore_page(_page(2))
            cause = raised.value.__cause__
            assert isinstance(cause, aiormq.exceptions.DeliveryError)
            assert not isinstance(cause, aiormq.exceptions.PublishError)
        finally:
            await queue.delete(if_unused=False, if_empty=False)
