"""A provider's rate limit met by one scorer replica pauses the others too, before they spend
calls of their own on it (`services/scorer/shared_pauses.py`).

Two scorers run in process on the real broker and database against the fake model, which
answers its next call 429 with a `Retry-After` longer than a delivery may be held, so the
delivery is put off down the wait ladder and no probe ends the pause while the test looks."""

from __future__ import annotations

from typing import Any

import aio_pika
import httpx
import pytest

from devtools.fake_llm import FakeLLM
from shared.bus import publish_command
from shared.contracts import ModelCallsPaused, ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import OPS_LOG, declare_topology
from tests.integration.in_process import scorer_over
from tests.support import eventually, metric_sum, running

pytestmark = pytest.mark.integration

RETRY_AFTER_S = 120  # beyond the hold (RATE_LIMIT_HOLD_S, 30 s by default)


async def _metric(scorer: httpx.AsyncClient, name: str) -> float:
    answer = await scorer.get("/metrics")
    assert answer.status_code == 200, answer.text
    return metric_sum(answer.text, name)


async def _both_paused(scorers: list[httpx.AsyncClient]) -> bool:
    return all([await _metric(s, "scorebox_model_calls_paused") == 1 for s in scorers])


async def _ops_log_pauses(amqp_url: str) -> list[ModelCallsPaused]:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(OPS_LOG.name, passive=True)
        found = []
        while (message := await queue.get(fail=False, timeout=10)) is not None:
            if message.routing_key == ModelCallsPaused.routing_key:
                found.append(ModelCallsPaused.model_validate_json(message.body))
        return found
    finally:
        await connection.close()


async def test_a_429_answered_to_one_scorer_pauses_the_other_without_a_call_of_its_own(
    fake_llm: FakeLLM, amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    fake_llm.config.rate_limited_calls = 1
    fake_llm.config.rate_limit_retry_s = RETRY_AFTER_S
    setup = scorer_over(fake_llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix)
    command = ScoreText(task_id=new_id(), text="Met by a rate limit.")

    async with running(setup.app()) as one, running(setup.app()) as two:
        publisher = make_broker(setup.settings)
        async with publisher:
            await publisher.connect()
            await declare_topology(publisher)
            await publish_command(publisher, command, now=utcnow(), timeout=10)
        await eventually(lambda: _both_paused([one, two]), what="both scorers paused")

        own = [await _metric(s, "scorebox_model_rate_limit_pauses_total") for s in (one, two)]
        heard = [
            await _metric(s, "scorebox_model_rate_limit_pauses_shared_total") for s in (one, two)
        ]
    # One was answered 429 and paused; the other paused on its word alone, calling nothing.
    assert sorted(zip(own, heard, strict=True)) == [(0, 1), (1, 0)]
    assert fake_llm.stats()["status_counts"] == {"429": 1}

    [announced] = await _ops_log_pauses(amqp_url)  # the operators' record of it
    assert announced.pause_s == pytest.approx(RETRY_AFTER_S, abs=1)
    assert announced.provider.startswith(f"{fake_llm.url.rstrip('/')} key:")
