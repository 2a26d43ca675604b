"""`scorebox_scorer_cancellations_total{outcome}`: the whole scorer on the real broker, sent
`score.cancel` commands, counts each by what became of it, on its `/metrics`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.fake_llm import FakeLLMConfig, start_fake_llm
from services.scorer.settings import ScorerSettings
from shared.bus import publish_cancel
from shared.contracts import CancelTask, new_id, utcnow
from shared.runtime import make_broker
from tests.integration.in_process import scorer_over
from tests.support import eventually, running

CANCELLATIONS = "scorebox_scorer_cancellations_total"


@pytest.fixture(scope="module")
async def scorer(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    llm = await start_fake_llm(FakeLLMConfig())  # never called: cancellations only
    setup = scorer_over(llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix)
    try:
        async with running(setup.app()) as client:
            yield client
    finally:
        await llm.stop()


async def _cancellations(scorer: httpx.AsyncClient) -> dict[str, float]:
    answer = await scorer.get("/metrics")
    assert answer.status_code == 200, answer.text
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
        if sample.name == CANCELLATIONS
    }


async def _sent(amqp_url: str, cancel: CancelTask) -> None:
    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await publish_cancel(broker, cancel, timeout=10)


async def test_cancellations_are_counted_by_outcome(
    scorer: httpx.AsyncClient, amqp_url: str
) -> None:
    before = await _cancellations(scorer)
    assert before == {"cancelled": before["cancelled"], "too_late": before["too_late"]}
    task_id = new_id()
    newer = CancelTask(task_id=task_id, generation=1, submitted_at=utcnow())

    async def counted(cancelled: float, too_late: float) -> bool:
        now = await _cancellations(scorer)
        return now == {
            "cancelled": before["cancelled"] + cancelled,
            "too_late": before["too_late"] + too_late,
        }

    # Never claimed: its generation 1 is decided as cancelled.
    await _sent(amqp_url, newer)
    await eventually(lambda: counted(1, 0), what="one cancellation counted as cancelled")

    # Generation 0 of the same task: superseded by generation 1, too late.
    await _sent(amqp_url, newer.model_copy(update={"generation": 0, "message_id": new_id()}))
    await eventually(lambda: counted(1, 1), what="one cancellation counted as too late")
