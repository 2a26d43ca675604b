"""The micro-benchmarks behind `python -m bench.micro` still run against the real broker and
the fake model: each way measures a positive CPU time. Sizes are cut down; the numbers here
mean nothing, only that every way works (an API change once broke one unnoticed)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import ModuleType

import pytest

from bench import delivery_cost, model_call_cost, publish_cost
from devtools.fake_llm import FakeLLM

Way = Callable[[str], Awaitable[float]]

BROKER_WAYS: list[tuple[ModuleType, str, Way]] = [
    (delivery_cost, "DELIVERIES", delivery_cost.through_faststream),
    (delivery_cost, "DELIVERIES", delivery_cost.through_scorebox),
    (delivery_cost, "DELIVERIES", delivery_cost.bare_aio_pika),
    (publish_cost, "MESSAGES", publish_cost.through_faststream),
    (publish_cost, "MESSAGES", publish_cost.bare_aio_pika),
]
MODEL_WAYS: list[Way] = [
    model_call_cost.through_the_adapter,
    model_call_cost.httpx_on_aiohttp,
    model_call_cost.httpx_own_pool,
    model_call_cost.bare_aiohttp,
]


def _name(way: Way) -> str:
    return f"{way.__module__.rsplit('.', 1)[-1]}.{way.__name__}"


@pytest.mark.parametrize(
    ("module", "size", "way"), BROKER_WAYS, ids=[_name(way) for _, _, way in BROKER_WAYS]
)
async def test_every_broker_way_measures(
    amqp_url: str, module: ModuleType, size: str, way: Way, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(module, size, 100)
    assert await way(amqp_url) > 0


@pytest.mark.parametrize("way", MODEL_WAYS, ids=[_name(way) for way in MODEL_WAYS])
async def test_every_model_call_way_gets_answers(
    fake_llm: FakeLLM, way: Way, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_call_cost, "CALLS", 50)
    assert await way(fake_llm.url) > 0
