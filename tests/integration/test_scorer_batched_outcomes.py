"""The scorer publishes completions that finish together as batches (`SCORER_OUTCOME_BATCH_MAX`),
each task's completion exactly once; with the setting at 1, every completion alone.

In process, on the real broker and database, against the fake model."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractIncomingMessage
from prometheus_client.parser import text_string_to_metric_families

from devtools.fake_llm import FakeLLMConfig, start_fake_llm
from shared.bus import publish_command
from shared.contracts import ScoreText, TaskCompleted, new_id
from shared.event_batches import BATCH_HEADER, split_batch
from shared.runtime import make_broker
from shared.topology import EVENTS, declare_topology
from tests.integration.in_process import scorer_over
from tests.support import eventually, running

pytestmark = pytest.mark.integration

TASKS = 32
TIMEOUT_S = 10.0


@asynccontextmanager
async def _completions(amqp_url: str) -> AsyncIterator[list[AbstractIncomingMessage]]:
    """Every message routed as `task.completed` while the block lasts."""
    connection = await aio_pika.connect(amqp_url, timeout=TIMEOUT_S)
    async with connection:
        channel = await connection.channel()
        events = await channel.get_exchange(EVENTS.name, ensure=False)
        queue = await channel.declare_queue(exclusive=True, timeout=TIMEOUT_S)
        await queue.bind(events, "task.completed", timeout=TIMEOUT_S)
        received: list[AbstractIncomingMessage] = []

        async def keep(message: AbstractIncomingMessage) -> None:
            received.append(message)
            await message.ack()

        await queue.consume(keep)
        yield received


def _tasks_in(message: AbstractIncomingMessage) -> list[str]:
    if BATCH_HEADER not in message.headers:
        return [TaskCompleted.model_validate_json(message.body).task_id]
    parts = split_batch(message.body, dict(message.headers))
    return [TaskCompleted.model_validate_json(part.body).task_id for part in parts]


async def _batched_events(scorer: httpx.AsyncClient) -> float:
    answer = await scorer.get("/metrics")
    assert answer.status_code == 200, answer.text
    return sum(
        sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
        if sample.name == "scorebox_events_per_batch_sum"
    )


@pytest.mark.parametrize("batch_max", [64, 1])
async def test_completions_finishing_together_are_published_in_batches_each_once(
    amqp_url: str, mongo: Any, db_prefix: str, batch_max: int
) -> None:
    # Every call answers after the same latency: the completions finish together.
    llm = await start_fake_llm(FakeLLMConfig(latency_ms=300))
    setup = scorer_over(
        llm,
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=f"{db_prefix}{batch_max}",
        SCORER_CONCURRENCY=str(TASKS),
        SCORER_OUTCOME_BATCH_MAX=str(batch_max),
    )
    commands = [
        ScoreText(task_id=new_id(), text=f"Scored together [[id:b{uuid.uuid4().hex[:10]}]].")
        for _ in range(TASKS)
    ]
    try:
        async with running(setup.app()) as scorer, _completions(amqp_url) as received:
            publisher = make_broker(setup.settings)
            async with publisher:
                await publisher.connect()
                await declare_topology(publisher)
                await asyncio.gather(
                    *(publish_command(publisher, c, timeout=TIMEOUT_S) for c in commands)
                )

            async def all_completed() -> bool:
                return sum(len(_tasks_in(message)) for message in received) >= TASKS

            await eventually(all_completed, timeout_s=60, what="every completion")
            batched = await _batched_events(scorer)
    finally:
        await llm.stop()

    published = [task for message in received for task in _tasks_in(message)]
    assert sorted(published) == sorted(c.task_id for c in commands)  # each once
    if batch_max == 1:
        assert batched == 0
        assert len(received) == TASKS
    else:
        assert batched > 0, "no two completions went out together"
        assert len(received) < TASKS
