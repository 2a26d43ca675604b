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
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.scorer.decisions import Finish
from services.scorer.scoring import score_text
from shared import clock_offset
from shared.clock_offset import DatabaseClock, clock_offset_s
from shared.contracts import ScoreText, new_id, utcnow
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
    clock.anchor(await clock_offset_s(client))
    monkeypatch.setattr(clock_offset, "wall_clock", lambda: utcnow() + STEP)
    return clock
