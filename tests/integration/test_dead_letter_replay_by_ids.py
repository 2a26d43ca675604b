"""A dead-letter replay by ids, on the real broker: the ids are matched as a set. They were
looked up in the request's list, once per letter walked, so 10,000 ids against 10,000
letters held the gateway's event loop for seconds. The work is counted (equality tests
made against the ids), not timed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import pytest
from faststream.rabbit import RabbitBroker
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.gateway.deadletters import DeadLetterQueue
from services.gateway.publisher import TaskPublisher
from services.gateway.submissions import Submissions
from shared.contracts import utcnow
from shared.topology import SCORE_REQUESTS, declare_topology

LETTERS = 20
IDS = 10_000  # what a replay request may name
TIMEOUT_S = 5.0


@dataclass
class Tally:
    equality_tests: int = 0


def counted_ids(count: int, tally: Tally) -> list[str]:
    """`count` ids that no letter carries, each counting the equality tests made on it."""

    class CountedId(str):
        __hash__ = str.__hash__

        def __eq__(self, other: object) -> bool:
            tally.equality_tests += 1
            return super().__eq__(other)

    return [CountedId(f"unknown-{index}") for index in range(count)]


@pytest.fixture
async def dead_letters(
    amqp_url: str, mongo: Endpoint, db_prefix: str
) -> AsyncIterator[DeadLetterQueue]:
    """The gateway's dead-letter queue of score requests, holding `LETTERS` letters."""
    broker = RabbitBroker(amqp_url)
    await broker.connect()
    await declare_topology(broker)
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        for index in range(LETTERS):
            message = aio_pika.Message(b"{}", message_id=f"m{index}", correlation_id=f"t{index}")
            await channel.default_exchange.publish(
                message, routing_key=SCORE_REQUESTS.dead_letter_routing_key, timeout=TIMEOUT_S
            )
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    yield DeadLetterQueue(
        broker,
        TaskPublisher(broker, clock=utcnow, timeout_s=TIMEOUT_S),
        Submissions(client, f"{db_prefix}_gateway"),
        utcnow,
        timeout_s=TIMEOUT_S,
    )
    await client.close()
    await broker.stop()


async def test_a_replay_matches_its_ids_as_a_set(dead_letters: DeadLetterQueue) -> None:
    assert len((await dead_letters.letters()).letters) == LETTERS
    tally = Tally()
    ids = counted_ids(IDS, tally)

    replay = await dead_letters.replay(ids)

    # In a list: each letter's message id and task id against every id, 400,000 tests.
    assert tally.equality_tests <= 2 * LETTERS
    assert replay.replayed == []
    assert len(replay.not_found) == IDS
    assert len((await dead_letters.letters()).letters) == LETTERS  # all given back
