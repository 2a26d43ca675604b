"""A purge of a DLQ takes its turn after the walks of its replica, on the real broker.

A walk (a listing, a show, a replay, a drop) holds every letter of the queue, up to its
bound, until it ends, and RabbitMQ's `queue.purge` skips held letters: a purge during one
answered 200 with what it could reach, nothing, and the letters came back when the walk
ended. It now waits for the walk to end, then removes them."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest
from faststream.rabbit import RabbitBroker

from shared.contracts import new_id
from shared.dead_letters import DeadLetterWalker
from shared.topology import CRON_JOBS
from tests.integration import test_dead_letter_drop as gateway_dlq
from tests.support import eventually

pytestmark = pytest.mark.integration

broker = gateway_dlq.broker  # fixtures

LETTERS = 4
TIMEOUT_S = 5.0


async def _dead_letters(amqp_url: str, count: int) -> None:
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        for n in range(count):
            await channel.default_exchange.publish(
                aio_pika.Message(f"letter {n}".encode(), message_id=new_id()),
                routing_key=CRON_JOBS.dead_letter_routing_key,
                timeout=TIMEOUT_S,
            )


def _waiting_for_its_turn(walker: DeadLetterWalker) -> bool:
    # asyncio.Lock keeps its waiters there; nothing public tells that a task waits on one.
    return bool(walker._walking._waiters)


async def test_a_purge_during_a_walk_waits_for_it_and_removes_every_letter(
    amqp_url: str, broker: RabbitBroker
) -> None:
    await _dead_letters(amqp_url, LETTERS)
    walker = DeadLetterWalker(broker, CRON_JOBS, timeout_s=TIMEOUT_S)

    async with walker.walk() as held:
        assert len(held) == LETTERS
        purge = asyncio.create_task(walker.purge())

        async def ran_or_waits() -> bool:
            return purge.done() or _waiting_for_its_turn(walker)

        await eventually(ran_or_waits, what="the purge ran or waited for its turn")
    assert await purge == LETTERS
    async with walker.walk() as held:
        assert list(held) == []
