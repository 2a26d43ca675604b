"""The scorer publishes completions that finish together as batches (`SCORER_OUTCOME_BATCH_MAX`),
each task's completion exactly once; with the setting at 1, every completion alone.

In process, on the real broker and database, against the fake model."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from devtools.fake_llm import FakeLLMConfig, start_fake_llm
from shared.bus import publish_command
from shared.contracts import ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import declare_topology
from tests.integration.in_process import scorer_over
from tests.support import completion_ids, eventually, metric_sum, running, watching_completions

pytestmark = pytest.mark.integration

TASKS = 32
TIMEOUT_S = 10.0


async def _batched_events(scorer: httpx.AsyncClient) -> float:
    answer = await scorer.get("/metrics")
    assert answer.status_code == 200, answer.text
    return metric_sum(answer.text, "scorebox_events_per_batch_sum")


# Runs of the scenario at most, for the completions to finish together: on a loaded machine
# (the whole suite in CI) they reached the batcher a few ms apart once, each publish confirmed
# before the next, and none could go out together. Batching never working fails every run.
RUNS = 3


@pytest.mark.parametrize("batch_max", [64, 1])
async def test_completions_finishing_together_are_published_in_batches_each_once(
    amqp_url: str, mongo: Any, db_prefix: str, batch_max: int
) -> None:
    for run in range(RUNS):
        received, batched = await _scored_together(
            amqp_url, mongo, f"{db_prefix}{batch_max}r{run}", batch_max
        )
        if batch_max == 1:
            assert batched == 0
            assert len(received) == TASKS
            return
        if batched > 0:
            assert len(received) < TASKS
            return
    pytest.fail(f"no two completions went out together in {RUNS} runs")


async def _scored_together(
    amqp_url: str, mongo: Any, db_prefix: str, batch_max: int
) -> tuple[list[Any], float]:
    """`TASKS` texts scored at once, each completion published once: the messages that
    carried them, and how many events went out in batches."""
    # Every call answers after the same latency: the completions finish together.
    llm = await start_fake_llm(FakeLLMConfig(latency_ms=300))
    setup = scorer_over(
        llm,
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        SCORER_CONCURRENCY=str(TASKS),
        SCORER_OUTCOME_BATCH_MAX=str(batch_max),
    )
    commands = [
        ScoreText(task_id=new_id(), text=f"Scored together [[id:b{uuid.uuid4().hex[:10]}]].")
        for _ in range(TASKS)
    ]
    try:
        async with running(setup.app()) as scorer, watching_completions(amqp_url) as received:
            publisher = make_broker(setup.settings)
            async with publisher:
                await publisher.connect()
                await declare_topology(publisher)
                await asyncio.gather(
                    *(
                        publish_command(publisher, c, now=utcnow(), timeout=TIMEOUT_S)
                        for c in commands
                    )
                )

            async def all_completed() -> bool:
                return sum(len(completion_ids(message)) for message in received) >= TASKS

            await eventually(all_completed, timeout_s=60, what="every completion")
            batched = await _batched_events(scorer)
    finally:
        await llm.stop()

    published = [task for message in received for task in completion_ids(message)]
    assert sorted(map(str, published)) == sorted(c.task_id for c in commands)  # each once
    return list(received), batched
