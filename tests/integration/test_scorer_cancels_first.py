"""A scorer starting with cancellations queued handles them before it consumes its work.

Every scorer replica was down while a client cancelled its tasks (a restart, a deploy): the
cancels and the tasks' commands waited in their queues. The starting scorer consumed both at
once, its first deliveries claimed their attempts at once, and each cancel that came after
its task's claim found the call under way: 16 of 60 tasks cancelled so were scored (a
walkthrough of `make run`). It now starts `score.requested` once `score.cancel` is settled
(`services/scorer/cancels.py`, `cancels_handled_first`). Real broker, the test database,
the fake model over HTTP.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from services.scorer import decisions
from services.scorer.decisions import is_cancellation
from services.scorer.settings import ScorerSettings
from shared.bus import publish_cancel, publish_command
from shared.contracts import ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import declare_topology
from tests.integration.in_process import scorer_over
from tests.integration.test_scorer_cancel import _cancel_of
from tests.support import eventually, running

TASKS = 60

Document = dict[str, Any]


@pytest.fixture
async def llm() -> AsyncIterator[FakeLLM]:
    server = await start_fake_llm(FakeLLMConfig())
    yield server
    await server.stop()


async def _queued_while_no_scorer_runs(amqp_url: str, commands: list[ScoreText]) -> None:
    """The commands, then a cancel of each, queued with no scorer consuming."""
    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        for command in commands:
            await publish_command(broker, command, now=utcnow(), timeout=10)
        for command in commands:
            await publish_cancel(broker, _cancel_of(command), timeout=10)


async def _decisions(attempts: AsyncCollection[Document], task_ids: list[str]) -> list[Any]:
    held = [doc async for doc in attempts.find({"_id": {"$in": task_ids}, "state": "decided"})]
    return [decisions.load(doc["decision"]) for doc in held]


async def test_cancels_queued_before_the_scorer_starts_are_handled_before_its_work(
    amqp_url: str, mongo: Any, db_prefix: str, llm: FakeLLM
) -> None:
    markers = [f"f{uuid.uuid4().hex[:12]}" for _ in range(TASKS)]
    commands = [
        ScoreText(task_id=new_id(), text=f"An essay cancelled early [[id:{marker}]]")
        for marker in markers
    ]
    await _queued_while_no_scorer_runs(amqp_url, commands)
    setup = scorer_over(llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix)
    client: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, tz_aware=True)
    attempts = client[setup.settings.database_name("scorer")]["attempts"]
    task_ids = [command.task_id for command in commands]
    try:
        async with running(setup.app()):

            async def all_decided() -> list[Any] | None:
                found = await _decisions(attempts, task_ids)
                return found if len(found) == TASKS else None

            decided = await eventually(all_decided, what="every task decided")
    finally:
        await client.close()

    assert all(is_cancellation(decision) for decision in decided)
    by_id = llm.stats()["by_id"]
    assert sum(by_id.get(marker, 0) for marker in markers) == 0
