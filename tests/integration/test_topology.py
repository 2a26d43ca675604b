"""`declare_topology` on the real broker: idempotent, and it removes retired queues."""

from __future__ import annotations

import aio_pika
import aiormq
import pytest

from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import GATEWAY_TASK_OUTCOMES, RETIRED_QUEUES, declare_topology

pytestmark = pytest.mark.integration


async def queue_exists(amqp_url: str, name: str) -> bool:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, passive=True, timeout=10)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True
    finally:
        await connection.close()


async def test_retired_queues_are_deleted_and_declaring_twice_is_harmless(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        for name in RETIRED_QUEUES:
            await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        await connection.close()
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    try:
        await declare_topology(broker)
        await declare_topology(broker)
    finally:
        await broker.stop()

    for name in RETIRED_QUEUES:
        assert not await queue_exists(amqp_url, name), name
    assert await queue_exists(amqp_url, GATEWAY_TASK_OUTCOMES.name)
