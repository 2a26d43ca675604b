"""The micro-benchmarks behind `python -m bench.micro` still run against the real broker and
the fake model: each way measures a positive CPU time. Sizes are cut down; the numbers here
mean nothing, only that every way works (an API change once broke one unnoticed)."""

from __future__ import annotations

import pytest

from bench import delivery_cost, model_call_cost, publish_cost
from devtools.fake_llm import FakeLLM


@pytest.mark.parametrize(
    "way",
    [delivery_cost.through_faststream, delivery_cost.through_scorebox, delivery_cost.bare_aio_pika],
)
async def test_every_delivery_way_drains_its_queue(
    amqp_url: str, way: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delivery_cost, "DELIVERIES", 100)
    assert callable(way)
    assert await way(amqp_url) > 0


@pytest.mark.parametrize("way", [publish_cost.through_faststream, publish_cost.bare_aio_pika])
async def test_every_publish_way_is_confirmed(
    amqp_url: str, way: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish_cost, "MESSAGES", 100)
    assert callable(way)
    assert await way(amqp_url) > 0


@pytest.mark.parametrize(
    "way",
    [
        model_call_cost.through_the_adapter,
        model_call_cost.httpx_on_aiohttp,
        model_call_cost.httpx_own_pool,
        model_call_cost.bare_aiohttp,
    ],
)
async def test_every_model_call_way_gets_answers(
    fake_llm: FakeLLM, way: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_call_cost, "CALLS", 50)
    assert callable(way)
    assert await way(fake_llm.url) > 0
