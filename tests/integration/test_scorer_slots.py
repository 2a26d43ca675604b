"""Model slots: a scorer holds twice as many deliveries as it calls the model for, so that a
call's database and broker round trips leave no slot idle; the deliveries waiting for a slot
hold no claim, and at stop they start no call: each is sent again, a redelivery's copy
carrying its delivery count unchanged (a stop is no consumer death).

In process, on the real broker and database, against the fake model."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aio_pika
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from services.scorer.settings import ScorerSettings
from shared.bus import publish_command
from shared.contracts import ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import (
    DELIVERY_COUNT_HEADER,
    EARLIER_DELIVERIES_HEADER,
    SCORE_REQUESTS,
    declare_topology,
    deliveries_lost,
)
from tests.integration.in_process import FakeModelScorer, scorer_over
from tests.support import eventually, running

Message = aio_pika.abc.AbstractIncomingMessage
SLOTS = 2
# Long enough for every check made while the first calls are in flight, on a loaded machine;
# lowered once they are made.
LATENCY_MS = 8000
QUICK_MS = 50
WAIT_S = 60.0


@dataclass
class Scene:
    """A scorer's settings, the fake model it calls, and commands queued for it."""

    amqp_url: str
    mongo: Any
    llm: FakeLLM
    setup: FakeModelScorer
    commands: dict[str, ScoreText]  # by the marker the fake model counts calls under

    def scorer(self) -> Any:
        return running(self.setup.app())

    def calls(self) -> dict[str, int | None]:
        by_id = self.llm.stats()["by_id"]
        return {marker: by_id.get(marker) for marker in self.commands}

    def task_ids(self, markers: set[str]) -> set[str]:
        return {self.commands[marker].task_id for marker in markers}


@asynccontextmanager
async def _scene(amqp_url: str, mongo: Any, db_prefix: str, count: int) -> AsyncIterator[Scene]:
    llm = await start_fake_llm(FakeLLMConfig(latency_ms=LATENCY_MS))
    setup = scorer_over(
        llm,
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        SCORER_CONCURRENCY=str(SLOTS),
        BROKER_TIMEOUT_S="2",
    )
    commands = {}
    for _ in range(count):
        marker = f"q{uuid.uuid4().hex[:12]}"
        commands[marker] = ScoreText(task_id=new_id(), text=f"Waits for a slot [[id:{marker}]].")
    await _publish(setup.settings, list(commands.values()))
    try:
        yield Scene(amqp_url, mongo, llm, setup, commands)
    finally:
        await llm.stop()


async def _publish(settings: ScorerSettings, commands: list[ScoreText]) -> None:
    publisher = make_broker(settings)
    async with publisher:
        await publisher.connect()
        await declare_topology(publisher)
        for command in commands:
            await publish_command(publisher, command, now=utcnow(), timeout=10)


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


async def _claims(scene: Scene) -> dict[str, str]:
    """The state of each claim on the scene's tasks, by task id."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(scene.mongo.url)
    try:
        attempts = client[scene.setup.settings.database_name("scorer")]["attempts"]
        found = attempts.find({"_id": {"$in": list(scene.task_ids(set(scene.commands)))}})
        return {str(doc["_id"]): str(doc["state"]) async for doc in found}
    finally:
        await client.close()


async def _stopped_with_calls_in_flight(scene: Scene) -> set[str]:
    """Run a scorer until it holds every command, SLOTS of them in model calls, and stop it;
    the markers of the commands it called the model for."""
    async with _queue(scene.amqp_url) as channel, scene.scorer():
        await _stats_until(scene.llm, lambda stats: stats["in_flight"] == SLOTS)
        await eventually(lambda: _is(_ready(channel), 0), what="all in hand")
    called = {marker for marker, calls in scene.calls().items() if calls}
    assert len(called) == SLOTS, called
    return called


async def _scored_by_a_new_scorer(scene: Scene) -> None:
    scene.llm.config.latency_ms = QUICK_MS
    async with scene.scorer():
        await eventually(lambda: _all_decided(scene), what="all decided")


async def test_deliveries_beyond_the_slots_wait_in_hand_unclaimed(
    amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    async with (
        _scene(amqp_url, mongo, db_prefix, 3 * SLOTS) as scene,
        _queue(amqp_url) as channel,
    ):
        async with scene.scorer():
            await _stats_until(scene.llm, lambda stats: stats["in_flight"] == SLOTS)
            # Twice the slots in hand: only the rest is still queued at the broker.
            await eventually(
                lambda: _is(_ready(channel), len(scene.commands) - 2 * SLOTS),
                what="twice the slots in hand",
            )
            claims = await _claims(scene)
            assert list(claims.values()) == ["running"] * SLOTS, claims
            scene.llm.config.latency_ms = QUICK_MS
            await eventually(lambda: _all_decided(scene), what="all decided")
        assert scene.llm.stats()["max_in_flight"] == SLOTS
        assert scene.calls() == dict.fromkeys(scene.commands, 1)


async def test_at_stop_the_deliveries_waiting_for_a_slot_are_sent_again_uncalled(
    amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    async with _scene(amqp_url, mongo, db_prefix, 2 * SLOTS) as scene:
        called = await _stopped_with_calls_in_flight(scene)
        claims = await _claims(scene)
        assert set(claims) == scene.task_ids(called), claims
        assert set(claims.values()) == {"decided"}, claims
        async with _queue(amqp_url) as peek:
            sent_again = await _taken(peek)
            # Fresh copies (acked, published again), not the deliveries handed back.
            assert [m.redelivered for m in sent_again] == [False] * SLOTS
            assert [m.headers.get("x-delivery-count", 0) for m in sent_again] == [0] * SLOTS
            assert {m.correlation_id for m in sent_again} == scene.task_ids(
                set(scene.commands) - called
            )
        await _scored_by_a_new_scorer(scene)
        assert scene.calls() == dict.fromkeys(scene.commands, 1)


async def test_at_stop_a_redelivery_waiting_for_a_slot_keeps_its_delivery_count(
    amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    """The count is what stops a message that kills every consumer it reaches, and a stop
    kills none. Left unacknowledged, the redelivery came back one count higher (1, then 2)
    with every stop, and through a rolling deploy reached the limit: failed as poison. Its
    fresh copy now carries the count (`x-scorebox-earlier-deliveries`), unchanged."""
    async with _scene(amqp_url, mongo, db_prefix, 2 * SLOTS) as scene:
        async with _queue(amqp_url) as dying:
            assert len(await _taken(dying)) == len(scene.commands)
        # Its channel closed holding them: each comes back with one delivery counted.
        called = await _stopped_with_calls_in_flight(scene)
        async with _queue(amqp_url) as peek:
            left = await _taken(peek)
            assert {m.correlation_id for m in left} == scene.task_ids(set(scene.commands) - called)
            assert [m.redelivered for m in left] == [False] * SLOTS  # fresh copies, acked
            assert [m.headers.get(DELIVERY_COUNT_HEADER, 0) for m in left] == [0] * SLOTS
            assert [m.headers.get(EARLIER_DELIVERIES_HEADER) for m in left] == [1] * SLOTS
            assert [deliveries_lost(m.headers) for m in left] == [1] * SLOTS
        await _scored_by_a_new_scorer(scene)
        assert scene.calls() == dict.fromkeys(scene.commands, 1)


async def _stats_until(llm: FakeLLM, condition: Callable[[dict[str, Any]], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        await llm.wait_for_stats(condition)


async def _taken(channel: aio_pika.abc.AbstractChannel) -> list[Message]:
    """Every message of the score queue, taken unacknowledged (returned when the channel
    closes)."""
    queue = await channel.declare_queue(SCORE_REQUESTS.queue.name, passive=True)
    taken = []
    while (message := await queue.get(no_ack=False, fail=False, timeout=10)) is not None:
        taken.append(message)
    return taken


async def _is(count: Any, expected: int) -> bool:
    return bool(await count == expected)


async def _all_decided(scene: Scene) -> bool:
    claims = await _claims(scene)
    return len(claims) == len(scene.commands) and set(claims.values()) == {"decided"}
