"""When the scorer announces `task.started`: only for an attempt still running after
`started_after` (zero: every attempt), and a failed announcement never stops the attempt.

`score_text` runs on the real database and calls the fake model server over HTTP; what it
announces is recorded by the `announce` it is given, which is what the scorer's composition
root wires to the broker.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest

from devtools.fake_llm import FakeLLM
from services.scorer.decisions import Finish
from services.scorer.errors import InputRejected
from services.scorer.model import ModelVerdict, ScoringRequest
from services.scorer.scoring import ScorerDeps, score_text
from shared.contracts import (
    ScoreText,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskStarted,
    Usage,
    new_id,
)
from tests.integration.scorer_parts import attempts_store, fake_model, scorer_deps

Deps = Callable[..., ScorerDeps]


@pytest.fixture
async def make_deps(
    fake_llm: FakeLLM, mongo: Any, db_prefix: str
) -> AsyncIterator[Callable[..., ScorerDeps]]:
    async with fake_model(fake_llm) as model, attempts_store(mongo.url, db_prefix) as attempts:

        def deps(*, started_after: timedelta, announce: Any) -> ScorerDeps:
            return scorer_deps(
                attempts=attempts, model=model, started_after=started_after, announce=announce
            )

        yield deps


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

    async def check(self, model: str | None = None) -> None:
        return None


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
