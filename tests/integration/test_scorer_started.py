"""When the scorer announces `task.started`: only for an attempt still running after
`started_after` (zero: every attempt), and a failed announcement never stops the attempt.

`score_text` runs on the real database and calls the fake model server over HTTP; what it
announces is recorded by the `announce` it is given, which is what the scorer's composition
root wires to the broker.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.scorer.attempts import Attempts
from services.scorer.decisions import Finish
from services.scorer.errors import InputRejected
from services.scorer.model import ModelVerdict, ScoringRequest, build_model
from services.scorer.model.http_client import make_http_client
from services.scorer.model.settings import ModelSettings
from services.scorer.scoring import RetryPolicy, ScorerDeps, score_text
from services.scorer.slots import ModelSlots
from shared.contracts import (
    ScoreText,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskStarted,
    Usage,
    new_id,
    utcnow,
)

Deps = Callable[..., ScorerDeps]


@pytest.fixture
async def make_deps(
    fake_llm: FakeLLM, mongo: Any, db_prefix: str
) -> AsyncIterator[Callable[..., ScorerDeps]]:
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

    def deps(*, started_after: timedelta, announce: Any) -> ScorerDeps:
        return ScorerDeps(
            attempts=attempts,
            model=build_model(settings, http),
            announce=announce,
            clock=utcnow,
            lease=timedelta(seconds=30),
            retry_policy=RetryPolicy(base_s=1, cap_s=2),
            rng=random.Random(0),
            owner="test",
            model_slots=ModelSlots(4),
            started_after=started_after,
        )

    yield deps
    await http.aclose()
    await client.close()


class Announcements:
    def __init__(self) -> None:
        self.events: list[TaskEvent] = []

    async def __call__(self, event: TaskEvent) -> None:
        self.events.append(event)


def _command(text: str) -> tuple[ScoreText, str]:
    marker = f"s{uuid.uuid4().hex[:12]}"
    return ScoreText(task_id=new_id(), text=f"{text} [[id:{marker}]]"), marker


async def test_an_attempt_that_ends_before_the_threshold_announces_nothing(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    announced = Announcements()
    command, marker = _command("A quick essay.")
    decision = await score_text(
        command, deps=make_deps(started_after=timedelta(seconds=30), announce=announced)
    )
    assert isinstance(decision, Finish)
    assert isinstance(decision.event, TaskCompleted)
    assert fake_llm.stats()["by_id"][marker] == 1
    assert announced.events == []


async def test_an_attempt_still_running_at_the_threshold_is_announced(make_deps: Deps) -> None:
    announced = Announcements()
    command, _ = _command("A slow essay [[fake:slow]].")  # the fake answers 2 s late
    decision = await score_text(
        command, deps=make_deps(started_after=timedelta(milliseconds=100), announce=announced)
    )
    assert isinstance(decision, Finish)
    assert isinstance(decision.event, TaskCompleted)
    [started] = announced.events
    assert isinstance(started, TaskStarted)
    assert started.task_id == command.task_id
    assert started.sequence < decision.event.sequence


async def test_a_zero_threshold_announces_every_attempt(make_deps: Deps) -> None:
    announced = Announcements()
    command, _ = _command("Announce me at once.")
    await score_text(command, deps=make_deps(started_after=timedelta(0), announce=announced))
    assert [type(event) for event in announced.events] == [TaskStarted]


async def test_a_failed_announcement_does_not_stop_the_attempt(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    async def broker_down(_: TaskEvent) -> None:
        raise ConnectionError("the broker is down")

    command, marker = _command("Scored all the same.")
    decision = await score_text(
        command, deps=make_deps(started_after=timedelta(0), announce=broker_down)
    )
    assert isinstance(decision, Finish)
    assert isinstance(decision.event, TaskCompleted)
    assert fake_llm.stats()["by_id"][marker] == 1


class RefusingModel:
    """A model that answers with a refusal and reports the tokens it used."""

    name = "refusing-1"

    async def score(self, request: ScoringRequest) -> ModelVerdict:
        raise InputRejected(
            "the model refused the text",
            usage=Usage(prompt_tokens=900, completion_tokens=40),
            model="refusing-1",
        )


async def test_a_refused_text_fails_with_the_tokens_its_answer_used(make_deps: Deps) -> None:
    """Only an unusable answer carried its usage into `task.failed`: a refusal's tokens,
    billed by the provider all the same, went unmetered."""
    deps = make_deps(started_after=timedelta(seconds=30), announce=Announcements())
    command, _ = _command("A text the model refuses.")
    decision = await score_text(command, deps=dataclasses.replace(deps, model=RefusingModel()))
    assert isinstance(decision, Finish)
    assert isinstance(decision.event, TaskFailed)
    assert decision.event.error.code == "input_rejected"
    assert decision.event.usage == Usage(prompt_tokens=900, completion_tokens=40)
    assert decision.event.model == "refusing-1"
