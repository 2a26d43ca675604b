"""A provider-wide rate limit (every call answered 429 for a while) spends no task's attempts.

It used to: each 429 cost an attempt, came back at once, and the slot took the next delivery,
so every task consumed while the limit lasted was failed and dead-lettered within seconds,
though the provider answered normally right after. Now a 429 pauses the process's model
calls (`services/scorer/throttle.py`), and an attempt a rate limit ended is not counted
against `max_attempts` while the scorer's `RATE_LIMIT_RETRIES` last.

`score_text` runs on the real database and calls the fake model server over HTTP; the fake
answers the next N calls 429 whatever their task (`rate_limited_calls`). A retry's next
attempt is taken at once here (its `not_before` cleared), as the wait ladder would hand it
back when due."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.scorer.attempts import Attempts
from services.scorer.decisions import Decision, Defer, Finish, Retry
from services.scorer.model import build_model
from services.scorer.model.http_client import make_http_client
from services.scorer.model.settings import ModelSettings
from services.scorer.scoring import RetryPolicy, ScorerDeps, score_text
from services.scorer.slots import ModelSlots
from services.scorer.throttle import ModelThrottle
from shared.contracts import ScoreText, TaskCompleted, TaskEvent, TaskFailed, new_id, utcnow

pytestmark = pytest.mark.integration

Deps = Callable[..., ScorerDeps]


@pytest.fixture
async def make_deps(fake_llm: FakeLLM, mongo: Any, db_prefix: str) -> AsyncIterator[Deps]:
    settings = ModelSettings.model_validate(
        {
            "LLM_PROVIDER": "openai",
            "LLM_BASE_URL": fake_llm.url,
            "LLM_API_KEY": "test-key",
            "LLM_MODEL": "fake-judge-1",
            "LLM_TIMEOUT_S": "5",
        }
    )
    http = make_http_client(settings, concurrency=4)
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    attempts = Attempts(client, f"{db_prefix}_scorer", retention=timedelta(hours=1))
    await attempts.ensure_indexes()

    async def announce(event: TaskEvent) -> None:
        pass

    def deps(*, rate_limit_retries: int = 20, hold_s: float = 30) -> ScorerDeps:
        return ScorerDeps(
            attempts=attempts,
            model=build_model(settings, http),
            announce=announce,
            clock=utcnow,
            lease=timedelta(seconds=30),
            retry_policy=RetryPolicy(
                base_s=0.01, cap_s=0.05, rate_limit_retries=rate_limit_retries
            ),
            rng=random.Random(0),
            owner="test",
            model_slots=ModelSlots(4),
            throttle=ModelThrottle(hold_s=hold_s, base_s=0.02, rng=random.Random(0)),
        )

    yield deps
    await http.aclose()
    await client.close()


async def _until_decided(command: ScoreText, deps: ScorerDeps) -> tuple[Finish, ScoreText]:
    """Each retry's next attempt, taken at once, until the task ends; its last command."""
    for _ in range(50):
        decision: Decision = await score_text(command, deps=deps)
        if isinstance(decision, Finish):
            return decision, command
        assert isinstance(decision, Retry), decision
        command = decision.next_command.model_copy(update={"not_before": None})
    raise AssertionError("the task never ended")


async def test_a_rate_limit_spends_none_of_the_tasks_attempts(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    fake_llm.config.rate_limited_calls = 3
    command = ScoreText(task_id=new_id(), text="An essay.", max_attempts=2)

    finish, last = await _until_decided(command, make_deps())

    assert isinstance(finish.event, TaskCompleted)  # it used to fail at its second 429
    assert (last.attempt, last.rate_limited_retries) == (4, 3)
    assert fake_llm.stats()["status_counts"] == {"429": 3, "200": 1}


async def test_rate_limited_attempts_count_again_once_their_budget_is_spent(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    fake_llm.config.rate_limited_calls = 100
    command = ScoreText(task_id=new_id(), text="An essay.", max_attempts=2)

    finish, last = await _until_decided(command, make_deps(rate_limit_retries=1))

    # One free attempt, then max_attempts counted ones: three calls, then dead-lettered.
    assert isinstance(finish.event, TaskFailed)
    assert finish.event.dead_lettered
    assert finish.event.error.code == "model_rate_limited"
    assert (last.attempt, last.rate_limited_retries) == (3, 1)
    assert fake_llm.stats()["status_counts"] == {"429": 3}


async def test_a_pause_beyond_the_hold_puts_deliveries_off_without_calling(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    """`Retry-After: 120`, deliveries may wait 30 s in hand: the next one is sent down the
    wait ladder until the pause ends, and the provider sees no call of it."""
    fake_llm.config.rate_limited_calls = 1
    fake_llm.config.rate_limit_retry_s = 120
    deps = make_deps(hold_s=30)
    started = utcnow()

    retried = await score_text(ScoreText(task_id=new_id(), text="First."), deps=deps)
    put_off = await score_text(ScoreText(task_id=new_id(), text="Second."), deps=deps)

    assert isinstance(retried, Retry)
    assert retried.next_command.not_before is not None
    assert retried.next_command.not_before >= started + timedelta(seconds=119)
    assert isinstance(put_off, Defer)
    assert put_off.command.not_before is not None
    assert put_off.command.not_before >= started + timedelta(seconds=119)
    assert put_off.command.attempt == 1  # no attempt spent
    assert fake_llm.stats()["calls"] == 1
