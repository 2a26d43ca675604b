"""`make run` and the test stacks declare the topology once before the services start
(`devtools.stack.declare_topology_first`): services declaring a fresh vhost's quorum queues
at once met RabbitMQ 3.10's race between one's declaration and another's consume, and a
service ended its start (CI)."""

from __future__ import annotations

import aio_pika
import pytest

from devtools.stack import declare_topology_first
from shared.topology import SCORE_REQUESTS

pytestmark = pytest.mark.integration


async def test_the_topology_is_declared_before_any_service_starts(amqp_url: str) -> None:
    assert declare_topology_first(amqp_url)

    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(SCORE_REQUESTS.name, passive=True, timeout=10)
        assert declared.declaration_result.message_count == 0


def test_a_broker_out_of_reach_leaves_it_to_the_services() -> None:
    """Best effort: a stack started while the broker is away (a fault test) starts its
    services all the same, which wait for it themselves."""
    assert not declare_topology_first("amqp://guest:guest@127.0.0.1:1/", timeout_s=2.0)
