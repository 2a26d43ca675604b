"""A scorer keeps time by the database's clock: one whose wall clock was stepped ahead while it
ran (NTP stepped it, a VM resumed; checked only at the start) read another replica's live
claim as expired, took it over and called the model again (a re-read: two calls for one
task, the first one's completion fenced out). `score_text` on the real database, the model
over the fake model server's HTTP."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from faststream.rabbit import RabbitBroker, RabbitQueue
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.scorer.consumer import BrokerActions
from services.scorer.decisions import Finish
from services.scorer.scoring import score_text
from services.scorer.settings import ScorerSettings
from shared import clock_offset
from shared.clock_offset import DatabaseClock, measure_clock
from shared.contracts import ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import SCORE_REQUESTS, WAIT_TIERS, declare_topology, wait_queue
from tests.integration.scorer_parts import attempts_store, fake_model, scorer_deps
from tests.support import eventually

pytestmark = pytest.mark.integration

LEASE = timedelta(seconds=60)
STEP = timedelta(hours=1)  # past any lease


async def test_a_scorer_whose_wall_clock_steps_ahead_takes_over_no_live_claim(
    fake_llm: FakeLLM, mongo: Any, db_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        stepped = await _database_clock_then_a_step(client, monkeypatch)
    finally:
        await client.close()
    marker = f"step{uuid.uuid4().hex[:10]}"
    command = ScoreText(task_id=new_id(), text=f"Some text. [[fake:slow]] [[id:{marker}]]")
    async with (
        attempts_store(mongo.url, db_prefix) as attempts,
        fake_model(fake_llm, timeout_s=30) as model,
    ):
        calling = scorer_deps(attempts=attempts, model=model, lease=LEASE, owner="calling")
        stepped_replica = scorer_deps(
            attempts=attempts, model=model, lease=LEASE, owner="stepped", clock=stepped
        )
        first = asyncio.create_task(score_text(command, deps=calling))

        async def claimed() -> bool:
            held = await attempts.find(command.task_id)
            return held is not None and held.get("state") == "running"

        await eventually(claimed, what="the first replica's claim")
        # A copy of the command (the outbox sweep's, a repeated publish) at the other replica.
        copy = await score_text(command, deps=stepped_replica, redelivered=False)
        outcome = await first
    assert isinstance(outcome, Finish), outcome
    assert not isinstance(copy, Finish), copy
    assert fake_llm.stats()["by_id"].get(marker) == 1


async def _database_clock_then_a_step(
    client: AsyncMongoClient[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> Callable[[], datetime]:
    """A clock as a service keeps it, measured against the database, then this machine's
    wall clock stepped ahead by `STEP` (as the clock reads it)."""
    clock = DatabaseClock()
    clock.anchor(await measure_clock(client, ticks=clock.ticks))
    monkeypatch.setattr(clock_offset, "wall_clock", lambda: utcnow() + STEP)
    return clock


async def test_a_command_not_yet_due_on_the_scorers_clock_waits_whatever_the_wall_clock_says(
    amqp_url: str,
) -> None:
    """The scorer judged a command due on its clock (the database's), and sent one not yet
    due down the ladder by the wall clock: a wall clock ahead sent it straight back, and the
    scorer put it off again, round after round (a re-read: 1,709 rounds in 2 s). Here the
    scorer's clock is an hour behind the wall clock, and the command is due in 20 minutes on
    it: it waits in the 10-minute tier, not in the score queue."""

    def behind() -> datetime:
        return utcnow() - STEP

    [ten_minutes] = [tier for tier in WAIT_TIERS if tier[0] == "10m"]
    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        actions = BrokerActions(broker=broker, timeout_s=10, clock=behind)
        due = behind() + timedelta(minutes=20)
        command = ScoreText(task_id=new_id(), text="Not due yet.", not_before=due)
        await actions.resend(command, headers={})

        async def waiting() -> bool:
            return await _ready(broker, wait_queue(*ten_minutes).name) == 1

        await eventually(waiting, what="the command in the 10-minute tier")
        assert await _ready(broker, SCORE_REQUESTS.name) == 0


async def _ready(broker: RabbitBroker, name: str) -> int:
    queue = await broker.declare_queue(RabbitQueue(name, declare=False))
    return int((await queue.declare(timeout=10)).message_count or 0)
