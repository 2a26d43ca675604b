"""Tokens a generation was billed reach the outcome of the generation that replaces it,
when it published none.

Generation 0 is retried (an unusable answer, its repair 503: billed, recorded as the
attempt's `spent`); a re-score or a DLQ replay (generation 1) then claims the task. Its
next attempt is superseded and never publishes an outcome, and generation 1's outcome
ignored `spent` tagged 0: those tokens were never metered. A generation that finished
counted them in its outcome already: the next one starts from nothing. `score_text` runs
here on the real database and calls the fake model server over HTTP.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from pymongo.errors import OperationFailure

from devtools.fake_llm import FakeLLM
from services.scorer.attempts import Attempts, Claimed
from services.scorer.consumer import UNSTARTED_RESETS, UNSTARTED_RESETS_HEADER, _at_delivery_limit
from services.scorer.decisions import Defer, Drop, Finish, Retry
from services.scorer.scoring import ScorerDeps, score_text
from services.scorer.settings import ScorerSettings
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskFailed,
    event_sequence,
    new_id,
    utcnow,
)
from shared.runtime import make_broker
from shared.topology import SCORE_REQUESTS, declare_topology
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.test_scorer_own_claims import LEASE, Deps, _calls
from tests.integration.test_scorer_usage_across_retries import (
    PublishingFailures,
    _add,
    _billed,
    _task,
    outcomes,
)
from tests.support import HandedDelivery

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps

RETRIED = "[[fake:malformedx1]][[fake:503x1]]"  # attempt 1 billed, then retried


async def _retried(command: ScoreText, deps: ScorerDeps) -> Retry:
    retry = await score_text(command, deps=deps)
    assert isinstance(retry, Retry)
    assert retry.spent is not None
    assert retry.spent.usage == _billed(command.text, unusable=True)
    return retry


def _due(command: ScoreText) -> ScoreText:
    return command.model_copy(update={"not_before": None, "message_id": new_id()})


def _next_generation(command: ScoreText) -> ScoreText:
    update = {"generation": command.generation + 1, "attempt": 1, "message_id": new_id()}
    return command.model_copy(update=update)


@pytest.mark.parametrize(
    "next_attempt_abandoned", [False, True], ids=["retry-decided", "running-lease-lapsed"]
)
async def test_a_generation_replacing_a_retrying_one_meters_its_tokens(
    make_deps: Deps, attempts: Attempts, next_attempt_abandoned: bool
) -> None:
    command, _ = _task(RETRIED)
    deps = make_deps("scorer-a")
    retry = await _retried(command, deps)
    if next_attempt_abandoned:  # claimed by a scorer that died: its lease ran out
        lapsed = utcnow() - LEASE - timedelta(seconds=1)
        await attempts.claim(retry.next_command, now=lapsed, lease=LEASE, owner="scorer-b")

    rescored = await score_text(_next_generation(command), deps=deps)

    assert isinstance(rescored, Finish)
    assert isinstance(rescored.event, TaskCompleted)
    answered = _billed(command.text, unusable=False)
    assert rescored.event.result.usage == _add(_billed(command.text, unusable=True), answered)
    # Generation 0's next attempt publishes nothing: its tokens had no other way out.
    assert isinstance(await score_text(_due(retry.next_command), deps=deps), Drop)


async def test_a_generation_waits_for_an_older_ones_claim_under_way(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """Generation 0's next attempt is claimed by another scorer, its model call under way:
    generation 1 waits for it as a copy of the same generation would, and calls the model
    once it has decided. Replaced at once, that call went on, billed, its decision refused
    and its tokens never metered (the scheduler's re-read: a re-score the gateway took for
    orphaned, or a DLQ replay, while the attempt ran)."""
    command, marker = _task(RETRIED)
    deps = make_deps("scorer-a")
    retry = await _retried(command, deps)
    under_way = await attempts.claim(
        retry.next_command, now=utcnow(), lease=LEASE, owner="scorer-b"
    )
    assert isinstance(under_way, Claimed)
    calls = _calls(fake_llm, marker)

    waited = await score_text(_next_generation(command), deps=deps)

    assert isinstance(waited, Defer)
    assert waited.command.generation == 1
    assert _calls(fake_llm, marker) == calls  # no second call while the first one runs
    completed = _completed_as(retry.next_command)
    assert await attempts.decide(
        retry.next_command,
        completed,
        now=utcnow(),
        raw_output=None,
        owner="scorer-b",
        claim=under_way,
    )
    rescored = await score_text(_due(waited.command), deps=deps)
    assert isinstance(rescored, Finish)
    assert isinstance(rescored.event, TaskCompleted)
    assert rescored.event.generation == 1


def _completed_as(command: ScoreText) -> Finish:
    return Finish(
        TaskCompleted(
            task_id=command.task_id,
            generation=command.generation,
            attempt=command.attempt,
            sequence=event_sequence(
                generation=command.generation, attempt=command.attempt, phase=Phase.TERMINAL
            ),
            submitted_at=command.submitted_at,
            result=ScoreResult(score=5, comment="ok", model="m"),
        )
    )


async def test_a_generation_replacing_a_finished_one_starts_from_nothing(
    make_deps: Deps,
) -> None:
    command, _ = _task(RETRIED)
    deps = make_deps("scorer-a")
    retry = await _retried(command, deps)
    finished = await score_text(_due(retry.next_command), deps=deps)
    assert isinstance(finished, Finish)
    assert isinstance(finished.event, TaskCompleted)
    answered = _billed(command.text, unusable=False)
    assert finished.event.result.usage == _add(_billed(command.text, unusable=True), answered)

    rescored = await score_text(_next_generation(command), deps=deps)

    assert isinstance(rescored, Finish)
    assert isinstance(rescored.event, TaskCompleted)
    assert rescored.event.result.usage == answered


async def test_a_generation_given_up_before_its_claim_reports_the_replaced_ones_tokens(
    make_deps: Deps, amqp_url: str
) -> None:
    """Generation 1 reached the delivery limit before any scorer claimed it, as often as
    it is sent again for that, generation 0 still retrying: its failure is the task's
    outcome, generation 0's tokens in it."""
    command, _ = _task(RETRIED)
    deps = make_deps("scorer-a")
    await _retried(command, deps)
    rescore = _next_generation(command)
    limit = SCORE_REQUESTS.delivery_limit
    at_limit = HandedDelivery.redelivery(rescore.model_dump_json().encode(), count=limit)
    at_limit.headers[UNSTARTED_RESETS_HEADER] = UNSTARTED_RESETS

    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        async with outcomes(amqp_url) as published:
            actions = PublishingFailures(broker)
            await _at_delivery_limit(rescore, at_limit, deps, actions, limit)
            failed: TaskFailed = await published.next_of(command.task_id, TaskFailed)

    assert len(actions.dead_lettered) == 1
    assert (failed.generation, failed.dead_lettered) == (1, True)
    assert failed.usage == _billed(command.text, unusable=True)


async def test_a_give_up_the_database_would_not_record_bills_earlier_tokens_once(
    make_deps: Deps, attempts: Attempts, amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation 0 retried (billed), its next attempt given up at the delivery limit, the
    give-up refused for good by the database: its failure carries generation 0's tokens,
    and the record still read "no outcome", so the DLQ replay's claim (generation 1) took
    them over and its completion billed them a second time (review of usage)."""
    command, _ = _task(RETRIED)
    deps = make_deps("scorer-a")
    last = _due((await _retried(command, deps)).next_command)

    async def refused(*_args: object, **_kwargs: object) -> bool:
        raise OperationFailure("Document failed validation", code=121)

    monkeypatch.setattr(attempts, "decide", refused)
    limit = SCORE_REQUESTS.delivery_limit
    at_limit = HandedDelivery.redelivery(last.model_dump_json().encode(), count=limit)
    at_limit.headers[UNSTARTED_RESETS_HEADER] = UNSTARTED_RESETS  # given up, not sent again
    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        async with outcomes(amqp_url) as published:
            await _at_delivery_limit(last, at_limit, deps, PublishingFailures(broker), limit)
            failed: TaskFailed = await published.next_of(command.task_id, TaskFailed)
    monkeypatch.undo()
    assert failed.usage == _billed(command.text, unusable=True)

    # The give-up's claim, never decided, holds until its lease ends; the replay comes later.
    later = replace(deps, clock=lambda: utcnow() + LEASE + timedelta(seconds=1))
    replayed = await score_text(_next_generation(command), deps=later)

    assert isinstance(replayed, Finish)
    assert isinstance(replayed.event, TaskCompleted)
    assert replayed.event.result.usage == _billed(command.text, unusable=False)
