"""A scorer replica starting while the provider is down pauses its model calls after its first
call, not after the calls of `TRIP_AFTER` texts (`ModelThrottle.found_unavailable`).

The other replicas' outage was announced as it began, before this one listened: its start
probe found the provider unavailable, and its 5xx, taken for a text failing on its own, let
every model slot through; each called, and the calls before the third text's were charged to
their tasks. Now a check of the provider confirms the start probe's 5xx, the outage begins at
once (the start's call its own, as the call that begins any outage is), the other deliveries
wait in hand, and the other replicas are told.

The scorer runs whole in process on the real broker and database against the fake model,
down (every call 503) before the scorer starts and until it shows its calls paused. Its tasks
allow one attempt each: a call charged to its task during the outage fails it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from devtools.fake_llm import FakeLLM
from shared.bus import publish_command
from shared.contracts import ScoreText, TaskCompleted, TaskEvent, TaskFailed, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import declare_topology
from tests.integration.in_process import scorer_over
from tests.integration.test_scorer_usage_across_retries import Outcomes, outcomes
from tests.integration.test_shared_pauses import _ops_log_pauses
from tests.support import eventually, metric_sum, running

pytestmark = pytest.mark.integration

# Deliveries in hand at the start, fewer than the model slots (16 by default): each would
# call at once if the start probe's 5xx let them through.
TASKS = 6
DOWN_FOR_S = 3600.0  # until the test brings the provider back


async def _metric(scorer: httpx.AsyncClient, name: str, **labels: str) -> float:
    answer = await scorer.get("/metrics")
    assert answer.status_code == 200, answer.text
    return metric_sum(answer.text, name, **labels)


async def _paused(scorer: httpx.AsyncClient) -> bool:
    return await _metric(scorer, "scorebox_model_calls_paused") == 1


async def _ends(published: Outcomes, task_ids: set[str]) -> dict[str, TaskEvent]:
    """Each task's outcome: completed, or failed."""

    async def all_ended() -> dict[str, TaskEvent] | None:
        await published.read_for(*task_ids)
        ends = {
            task_id: [e for e in published.of(task_id) if isinstance(e, TaskCompleted | TaskFailed)]
            for task_id in task_ids
        }
        return {k: v[0] for k, v in ends.items()} if all(ends.values()) else None

    return await eventually(all_ended, timeout_s=60, what="an outcome of every task")


async def test_a_scorer_starting_into_an_outage_pauses_after_its_first_call(
    fake_llm: FakeLLM, amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    fake_llm.config.unavailable_until = time.monotonic() + DOWN_FOR_S
    setup = scorer_over(fake_llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix)
    commands = [
        ScoreText(
            task_id=new_id(), text=f"Essay {n} [[id:o{uuid.uuid4().hex[:12]}]].", max_attempts=1
        )
        for n in range(TASKS)
    ]

    publisher = make_broker(setup.settings)
    async with publisher:
        await publisher.connect()
        await declare_topology(publisher)
        async with outcomes(amqp_url) as published:
            for command in commands:  # in the queue before the scorer starts
                await publish_command(publisher, command, now=utcnow(), timeout=10)
            async with running(setup.app()) as scorer:
                await eventually(lambda: _paused(scorer), what="the scorer's calls paused")
                during = fake_llm.stats()
                pauses = await _metric(scorer, "scorebox_model_rate_limit_pauses_total")
                checks = await _metric(
                    scorer, "scorebox_model_provider_checks_total", found="unavailable"
                )
                fake_llm.config.unavailable_until = 0.0  # the provider back
                ends = await _ends(published, {command.task_id for command in commands})

    # Paused after one text's call and a check (the pause's probes aside): not a call of
    # each delivery in hand.
    assert during["status_counts"] == {"503": during["calls"]}
    assert during["calls"] < TASKS
    assert checks == 1  # the start's, finding the provider down too
    assert pauses == 1  # one outage, begun and told
    # No task's one attempt was spent on the outage: every one completed.
    assert all(isinstance(event, TaskCompleted) for event in ends.values()), {
        type(event).__name__ for event in ends.values()
    }
    told = [
        pause
        for pause in await _ops_log_pauses(amqp_url)
        if pause.provider.startswith(f"{fake_llm.url.rstrip('/')} key:")
    ]
    assert [pause.outage for pause in told] == [True]  # the other replicas told of an outage
