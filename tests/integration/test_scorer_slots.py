"""Model slots: a scorer holds twice as many deliveries as it calls the model for, so that a
call's database and broker round trips leave no slot idle; the deliveries waiting for a slot
hold no claim, and at stop they start no call: a first delivery is sent again, a redelivery
left unacknowledged (its delivery count kept).

In process, on the real broker and database, against the fake model."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from services.scorer.app import create_app as create_scorer
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from shared.bus import publish_command
from shared.contracts import ScoreText, new_id
from shared.runtime import make_broker
from shared.topology import SCORE_REQUESTS, declare_topology
from tests.support import eventually, running, stack_env

Message = aio_pika.abc.AbstractIncomingMessage
SLOTS = 2
# Long enough for every check made while the first calls are in flight, on a loaded machine;
# lowered once they are made.
LATENCY_MS = 8000
QUICK_MS = 50
WAIT_S = 60.0


def _settings(amqp_url: str, mongo: Any, db_prefix: str, llm: FakeLLM) -> dict[str, str]:
    return stack_env(
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        llm_url=llm.url,
        api_key="unused",
        llm_timeout_s=10,
        SCORER_CONCURRENCY=str(SLOTS),
        BROKER_TIMEOUT_S="2",
    )


def _commands(count: int) -> dict[str, ScoreText]:
    commands = {}
    for _ in range(count):
        marker = f"q{uuid.uuid4().hex[:12]}"
        commands[marker] = ScoreText(task_id=new_id(), text=f"Waits for a slot [[id:{marker}]].")
    return commands


async def _publish(settings: ScorerSettings, commands: list[ScoreText]) -> None:
    publisher = make_broker(settings)
    async with publisher:
        await publisher.connect()
        await declare_topology(publisher)
        for command in commands:
            await publish_command(publisher, command, timeout=10)


@asynccontextmanager
async def _queue(amqp_url: str) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        yield await connection.channel()
    finally:
        await connection.close()


async def _ready(channel: aio_pika.abc.AbstractChannel) -> int:
    """Messages of the score queue not delivered to any consumer."""
    queue = await channel.declare_queue(SCORE_REQUESTS.queue.name, passive=True)
    count = queue.declaration_result.message_count
    assert count is not None
    return count


async def _claims(
    mongo: Any, settings: ScorerSettings, commands: dict[str, ScoreText]
) -> dict[str, str]:
    """The state of each claim on `commands`' tasks, by task id."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url)
    task_ids = [command.task_id for command in commands.values()]
    try:
        attempts = client[settings.database_name("scorer")]["attempts"]
        found = attempts.find({"_id": {"$in": task_ids}})
        return {str(doc["_id"]): str(doc["state"]) async for doc in found}
    finally:
        await client.close()


async def test_deliveries_beyond_the_slots_wait_in_hand_unclaimed(
    amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    llm = await start_fake_llm(FakeLLMConfig(latency_ms=LATENCY_MS))
    env = _settings(amqp_url, mongo, db_prefix, llm)
    settings = ScorerSettings.model_validate(env)
    commands = _commands(3 * SLOTS)
    await _publish(settings, list(commands.values()))
    try:
        async with (
            running(create_scorer(settings, ModelSettings.model_validate(env))),
            _queue(amqp_url) as channel,
        ):
            await _stats_until(llm, lambda stats: stats["in_flight"] == SLOTS)
            # Twice the slots in hand: only the rest is still queued at the broker.
            await eventually(
                lambda: _is(_ready(channel), len(commands) - 2 * SLOTS),
                what="twice the slots in hand",
            )
            claims = await _claims(mongo, settings, commands)
            assert list(claims.values()) == ["running"] * SLOTS, claims
            llm.config.latency_ms = QUICK_MS
            await _stats_until(llm, lambda stats: stats["calls"] >= len(commands))
            await eventually(lambda: _all_decided(mongo, settings, commands), what="all decided")
        stats = llm.stats()
    finally:
        await llm.stop()
    assert stats["max_in_flight"] == SLOTS
    assert {marker: stats["by_id"].get(marker) for marker in commands} == dict.fromkeys(commands, 1)


async def test_at_stop_the_deliveries_waiting_for_a_slot_are_sent_again_uncalled(
    amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    llm = await start_fake_llm(FakeLLMConfig(latency_ms=LATENCY_MS))
    env = _settings(amqp_url, mongo, db_prefix, llm)
    settings = ScorerSettings.model_validate(env)
    model_settings = ModelSettings.model_validate(env)
    commands = _commands(2 * SLOTS)
    await _publish(settings, list(commands.values()))
    try:
        async with _queue(amqp_url) as channel:
            async with running(create_scorer(settings, model_settings)):
                await _stats_until(llm, lambda stats: stats["in_flight"] == SLOTS)
                await eventually(lambda: _is(_ready(channel), 0), what="all in hand")
            # Stopped while SLOTS calls were in flight and SLOTS deliveries waited.
            called = {m for m, n in llm.stats()["by_id"].items() if n and m in commands}
            waiting = set(commands) - called
            assert len(called) == SLOTS, called
            claims = await _claims(mongo, settings, commands)
            assert set(claims) == {commands[m].task_id for m in called}, claims
            assert set(claims.values()) == {"decided"}, claims
            async with _queue(amqp_url) as peek:
                sent_again = await _taken(peek)
                # Fresh copies (acked, published again), not the deliveries handed back.
                assert [m.redelivered for m in sent_again] == [False] * SLOTS
                assert [m.headers.get("x-delivery-count", 0) for m in sent_again] == [0] * SLOTS
                assert {m.correlation_id for m in sent_again} == {
                    commands[m].task_id for m in waiting
                }
            llm.config.latency_ms = QUICK_MS
            async with running(create_scorer(settings, model_settings)):
                await eventually(
                    lambda: _all_decided(mongo, settings, commands), what="all decided"
                )
        stats = llm.stats()
    finally:
        await llm.stop()
    assert {marker: stats["by_id"].get(marker) for marker in waiting} == dict.fromkeys(waiting, 1)
    assert {marker: stats["by_id"].get(marker) for marker in called} == dict.fromkeys(called, 1)


async def test_at_stop_a_redelivery_waiting_for_a_slot_keeps_its_delivery_count(
    amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    """A fresh copy would start the count again at zero, and the count is what stops a
    message that kills every consumer it reaches."""
    llm = await start_fake_llm(FakeLLMConfig(latency_ms=LATENCY_MS))
    env = _settings(amqp_url, mongo, db_prefix, llm)
    settings = ScorerSettings.model_validate(env)
    model_settings = ModelSettings.model_validate(env)
    commands = _commands(2 * SLOTS)
    await _publish(settings, list(commands.values()))
    try:
        async with _queue(amqp_url) as channel:
            async with _queue(amqp_url) as dying:
                assert len(await _taken(dying)) == len(commands)
            # Its channel closed holding them: each comes back with one delivery counted.
            async with running(create_scorer(settings, model_settings)):
                await _stats_until(llm, lambda stats: stats["in_flight"] == SLOTS)
                await eventually(lambda: _is(_ready(channel), 0), what="all in hand")
            called = {m for m, n in llm.stats()["by_id"].items() if n and m in commands}
            waiting = {commands[m].task_id for m in set(commands) - called}
            assert len(waiting) == SLOTS, called
            async with _queue(amqp_url) as peek:
                left = await _taken(peek)
                assert {m.correlation_id for m in left} == waiting
                assert [m.headers.get("x-delivery-count") for m in left] == [2] * SLOTS
        llm.config.latency_ms = QUICK_MS
        async with running(create_scorer(settings, model_settings)):
            await eventually(lambda: _all_decided(mongo, settings, commands), what="all decided")
        stats = llm.stats()
    finally:
        await llm.stop()
    assert {marker: stats["by_id"].get(marker) for marker in commands} == dict.fromkeys(commands, 1)


async def _stats_until(llm: FakeLLM, condition: Callable[[dict[str, Any]], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        await llm.wait_for_stats(condition)


async def _taken(
    channel: aio_pika.abc.AbstractChannel,
) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message of the score queue, taken unacknowledged (returned when the channel
    closes)."""
    queue = await channel.declare_queue(SCORE_REQUESTS.queue.name, passive=True)
    taken = []
    while (message := await queue.get(no_ack=False, fail=False, timeout=10)) is not None:
        taken.append(message)
    return taken


async def _is(count: Any, expected: int) -> bool:
    return bool(await count == expected)


async def _all_decided(
    mongo: Any, settings: ScorerSettings, commands: dict[str, ScoreText]
) -> bool:
    claims = await _claims(mongo, settings, commands)
    return len(claims) == len(commands) and set(claims.values()) == {"decided"}
