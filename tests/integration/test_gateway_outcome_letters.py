"""The gateway's outcome consumer takes a letter of its own moved back to its queue (through
the default exchange, under the queue's name) as the outcome it was: before, it read an
event of type `scorebox.gateway-task-outcomes` and rejected it, RabbitMQ dead-lettering it
once more."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any, cast

import aio_pika
import pytest
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from services.gateway.api import GatewayDeps
from services.gateway.consumers import subscribe_task_outcomes
from services.gateway.submissions import FINISHED_GENERATION, Submissions
from shared.bus import publish_event
from shared.consumers import ScoreboxBroker
from shared.contracts import utcnow
from shared.group_writes import GroupWriter
from shared.topology import GATEWAY_TASK_OUTCOMES, ROUTING_KEY_HEADER
from tests.integration.test_failed_deliveries import (
    TIMEOUT_S,
    _completion,
    _dead_letter,
    _submitted,
    _topology_broker,
)
from tests.integration.test_projection_dead_letters import MendableCollection, move_back
from tests.support import eventually

pytestmark = pytest.mark.integration

Json = dict[str, Any]


@pytest.fixture
async def database(mongo: Any, db_prefix: str) -> AsyncIterator[Any]:
    client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
    yield client[f"{db_prefix}_outcome_letters"]
    await client.close()


def _outcomes(database: Any, writes: MendableCollection) -> Callable[[ScoreboxBroker], None]:
    def subscribe(broker: ScoreboxBroker) -> None:
        submissions = Submissions(database.client, database.name)
        submissions._writes = GroupWriter(cast("AsyncCollection[Json]", writes))
        deps = SimpleNamespace(submissions=submissions, in_flight=None, cache=None, clock=utcnow)
        subscribe_task_outcomes(broker, cast(GatewayDeps, deps), broker_timeout_s=TIMEOUT_S)

    return subscribe


async def test_an_outcome_letter_moved_back_once_the_cause_is_mended_is_settled(
    amqp_url: str, database: Any
) -> None:
    submissions = database["submissions"]
    mendable = MendableCollection(submissions, refusal="Document failed validation")
    event = _completion()
    await _submitted(submissions, event.task_id)
    async with _topology_broker(amqp_url, consuming=_outcomes(database, mendable)) as broker:
        await publish_event(broker, event, timeout=TIMEOUT_S)
        letter = await _dead_letter(amqp_url, GATEWAY_TASK_OUTCOMES, event.task_id)
        assert letter.headers[ROUTING_KEY_HEADER] == event.routing_key

        mendable.refusal = None
        await move_back(amqp_url, letter, GATEWAY_TASK_OUTCOMES.name)

        async def noted() -> bool:
            document = await submissions.find_one({"_id": event.task_id})
            return document is not None and document.get(FINISHED_GENERATION) == event.generation

        await eventually(noted, timeout_s=20, what="the moved-back outcome settled")
    assert await _letters_left(amqp_url) == 0  # not dead-lettered again


async def _letters_left(amqp_url: str) -> int:
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        dlq = await channel.declare_queue(
            GATEWAY_TASK_OUTCOMES.dead_letter_routing_key, passive=True, timeout=TIMEOUT_S
        )
        count = dlq.declaration_result.message_count
        assert count is not None
        return count
