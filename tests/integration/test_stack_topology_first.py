"""`make run` and the test stacks declare the topology once before the services start
(`devtools.stack.declare_topology_first`): services declaring a fresh vhost's quorum queues
at once met RabbitMQ 3.10's race between one's declaration and another's consume, and a
service ended its start (CI)."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest

from devtools.stack import declare_topology_first
from shared.topology import SCORE_REQUESTS

pytestmark = pytest.mark.integration

HANG_GUARD_S = 120.0


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


async def test_a_broker_that_never_answers_does_not_hold_the_start() -> None:
    """One that accepts the connection and says nothing held the start for good: aio-pika's
    robust connection went on trying after the deadline's cancellation (a review)."""
    held: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, never answered

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(HANG_GUARD_S):  # a hang guard, far above the bound
            declared = await asyncio.to_thread(
                declare_topology_first, f"amqp://guest:guest@127.0.0.1:{port}/", timeout_s=2.0
            )
    finally:
        for writer in held:
            writer.close()
        server.close()
    assert not declared
