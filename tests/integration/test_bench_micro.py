"""The micro-benchmarks behind `python -m bench.micro` still run against the real broker and
the fake model: each way measures a positive CPU time. Sizes are cut down; the numbers here
mean nothing, only that every way works (an API change once broke one unnoticed)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import ModuleType

import pytest

from bench import delivery_cost, micro, model_call_cost, publish_cost, receive_path
from bench.infra import local_broker_pid
from devtools.fake_llm import FakeLLM
from devtools.infra import Endpoint
from tests.support import CommandCounter, scratch_collection

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
    model_call_cost.the_client_alone,
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


async def test_document_size_measures_every_size(
    mongo: Endpoint, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(micro, "SIZED_DOCUMENTS", 20)
    async with scratch_collection(mongo.url, CommandCounter(), prefix="micro") as collection:
        await micro.document_size(collection)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(micro.DOCUMENT_TEXT_SIZES)
    assert all("µs per $set" in line for line in lines)


async def test_delivery_cost_prints_the_brokers_share_with_a_local_node(
    amqp_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    broker_pid = local_broker_pid()
    if broker_pid is None:
        pytest.skip("no local RabbitMQ node to read the CPU of")
    monkeypatch.setattr(delivery_cost, "DELIVERIES", 100)
    monkeypatch.setattr(delivery_cost, "ROUNDS", 1)
    await delivery_cost.delivery_cost(amqp_url, broker_pid)
    printed = capsys.readouterr().out
    assert "consumer CPU per delivery" in printed
    assert "broker CPU per delivery" in printed


async def test_the_receive_path_measures_both_ways_and_puts_pymongos_back(
    mongo: Endpoint, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = receive_path.pool.async_receive_message
    monkeypatch.setattr(receive_path, "WRITES", 50)
    monkeypatch.setattr(receive_path, "ROUNDS", 1)
    async with scratch_collection(mongo.url, CommandCounter(), prefix="micro") as collection:
        await receive_path.receive_path(collection)
        # The last writes went through the direct read: they landed, and it read their replies.
        written = await collection.find_one({"_id": "receive-path"})
    assert written is not None
    assert written["n"] == receive_path.WRITES - 1
    assert receive_path.pool.async_receive_message is shipped
    assert "its reply read directly" in capsys.readouterr().out


def test_text_preparation_measures_a_short_and_a_long_essay(
    capsys: pytest.CaptureFixture[str],
) -> None:
    micro.text_preparation(texts=3)
    lines = capsys.readouterr().out.splitlines()
    sizes = [
        int(line.split("about ")[1].split(" characters")[0].replace(",", "")) for line in lines
    ]
    assert len(sizes) == 2
    assert sizes[1] > 5 * sizes[0]


def test_body_checks_measure_each_body_refused_or_not(capsys: pytest.CaptureFixture[str]) -> None:
    micro.body_checks([("good", b'{"text": "a"}'), ("refused", b'{"text": "a", "text": "b"}')])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["good", "refused"]
    assert all("the repeated-key check takes" in line for line in lines)
