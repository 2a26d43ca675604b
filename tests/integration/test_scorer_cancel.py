"""A client's cancellation, recorded as the decision of the task's next attempt when nothing has
started its model call (`Attempts.cancel`), and carried out by the score path like any
recorded finish: the generation's next command publishes the failure again and calls no model.

`Attempts.cancel` and `score_text` run on the test database and call the fake model server
over HTTP; the consumer of `score.cancel` is handed its deliveries directly and publishes on
the real broker (its dead letters read from the DLQ); the end-to-end tests run the whole
scorer on the real broker.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, cast, override

import aio_pika
import httpx
import pytest
from bson import Int64
from faststream.rabbit import RabbitBroker
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import AutoReconnect

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from services.scorer.attempts import (
    CANCEL_REQUESTED,
    COMPLETION_STANDS,
    PUBLISHED,
    Attempts,
    Cancelled,
    Claimed,
    TooLate,
)
from services.scorer.cancels import TaskCancels, subscribe_cancels
from services.scorer.decisions import Decision, Drop, Finish, Retry
from services.scorer.model import ModelVerdict, ScoreModel, ScoringRequest
from services.scorer.scoring import ScorerDeps, recorded_decision, score_text
from services.scorer.settings import ScorerSettings
from shared.bus import publish_cancel, publish_command
from shared.consumers import ScoreboxBroker
from shared.contracts import (
    CANCELLED_CODE,
    CancelTask,
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskFailed,
    event_sequence,
    new_id,
    utcnow,
)
from shared.group_writes import GroupWriter
from shared.runtime import make_broker
from shared.topology import DEAD_LETTERED_FROM_HEADER, DLX, ERROR_HEADER, TASK_CANCELS
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.in_process import scorer_over
from tests.integration.test_database_refusals import (
    HANDLER_DEADLINE_S,
    RETURNED_AS_FAILED,
    RefusingCollection,
)
from tests.integration.test_scorer_own_claims import LEASE, Deps
from tests.integration.test_scorer_usage_across_retries import _billed, outcomes
from tests.support import (
    HandedDelivery,
    HandlerOnly,
    drain,
    eventually,
    metric_sum,
    running,
)

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps

RETRIED = "[[fake:malformedx1]][[fake:503x1]]"  # attempt 1 billed, then retried


def _task(faults: str = "") -> tuple[ScoreText, str]:
    marker = f"c{uuid.uuid4().hex[:12]}"
    text = f"An essay to cancel [[id:{marker}]] {faults}"
    return ScoreText(task_id=new_id(), text=text, callback_url="https://example.com/hook"), marker


def _cancel_of(command: ScoreText, *, generation: int | None = None) -> CancelTask:
    return CancelTask(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        generation=command.generation if generation is None else generation,
        submitted_at=command.submitted_at,
        api_key_id=command.api_key_id,
        callback_url=command.callback_url,
        not_before=command.not_before,
    )


def _calls(fake_llm: FakeLLM, marker: str) -> int:
    return int(fake_llm.stats()["by_id"].get(marker, 0))


def _due(command: ScoreText) -> ScoreText:
    return command.model_copy(update={"not_before": None, "message_id": new_id()})


def _cancellation(outcome: object, *, generation: int, attempt: int) -> TaskFailed:
    assert isinstance(outcome, Cancelled), outcome
    event = outcome.decision.event
    assert isinstance(event, TaskFailed)
    assert event.error.code == CANCELLED_CODE
    assert (event.generation, event.attempt, event.dead_lettered) == (generation, attempt, False)
    assert not event.error.retryable
    assert outcome.decision.dead_letter_error is None
    phase = Phase.TERMINAL
    assert event.sequence == event_sequence(generation=generation, attempt=attempt, phase=phase)
    return event


async def _carried_out(command: ScoreText, make_deps: Deps) -> TaskFailed:
    """The command's delivery, once the cancellation is recorded: the failure, no model."""
    decision = await score_text(command, deps=make_deps("scorer-b"))
    assert isinstance(decision, Finish), decision
    assert isinstance(decision.event, TaskFailed)
    assert decision.event.error.code == CANCELLED_CODE
    return decision.event


async def test_a_task_never_claimed_is_cancelled_and_its_command_calls_no_model(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    command, marker = _task()

    cancelled = _cancellation(
        await attempts.cancel(_cancel_of(command), now=utcnow()), generation=0, attempt=1
    )

    assert cancelled.has_callback
    assert cancelled.callback_url == command.callback_url
    assert cancelled.usage.total_tokens == 0
    assert await _carried_out(command, make_deps) == cancelled
    assert _calls(fake_llm, marker) == 0


async def test_a_deferred_task_keeps_its_cancellation_until_a_retention_after_it_is_due(
    attempts: Attempts,
) -> None:
    """The attempts' TTL counts from `updated_at`: a task deferred as long as the retention
    (seven days each by default) found its cancellation expired when its command arrived,
    and was scored."""
    command, _ = _task()
    now = utcnow()
    due = now + timedelta(days=7)

    await attempts.cancel(_cancel_of(command).model_copy(update={"not_before": due}), now=now)
    stored = await attempts.find(command.task_id)

    assert stored is not None
    assert stored["updated_at"] == due.replace(microsecond=due.microsecond // 1000 * 1000)


async def test_a_cancel_repeated_finds_its_own_cancellation_and_publishes_it_again(
    attempts: Attempts,
) -> None:
    command, _ = _task()
    first = await attempts.cancel(_cancel_of(command), now=utcnow())

    again = await attempts.cancel(_cancel_of(command), now=utcnow())

    assert isinstance(first, Cancelled)
    assert first.recorded_now
    # The same decision, found recorded: a repeat (counted so by the batch path).
    assert again == Cancelled(first.decision, recorded_now=False)


async def test_a_replay_cancelled_after_a_give_up_that_billed_its_tokens_bills_nothing_again(
    make_deps: Deps, attempts: Attempts
) -> None:
    """Generation 0 retried (billed); its next attempt was given up and the database would
    not record the give-up, whose `task.failed` carried those tokens (`spent` marked
    published). The DLQ replay (generation 1), cancelled before any scorer claimed it, bills
    nothing: a cancellation that ignored the mark (a mutant that survived the suite) billed
    them a second time."""
    command, _ = _task(RETRIED)
    retry = await score_text(command, deps=make_deps("scorer-a"))
    assert isinstance(retry, Retry)
    given_up = retry.next_command
    assert isinstance(
        await attempts.claim(given_up, now=utcnow(), lease=LEASE, owner="scorer-a"), Claimed
    )
    assert await attempts.note_spent_published(given_up)

    # The give-up's claim, never decided, holds until its lease ends; the replay comes later.
    later = utcnow() + LEASE + timedelta(seconds=1)
    cancelled = _cancellation(
        await attempts.cancel(_cancel_of(command, generation=1), now=later),
        generation=1,
        attempt=1,
    )

    assert cancelled.usage.total_tokens == 0


async def test_a_retrying_task_is_cancelled_at_its_next_attempt_with_what_it_was_billed(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    command, marker = _task(RETRIED)
    retry = await score_text(command, deps=make_deps("scorer-a"))
    assert isinstance(retry, Retry)
    assert _calls(fake_llm, marker) == 2  # the unusable answer and its repair

    cancelled = _cancellation(
        await attempts.cancel(_cancel_of(command), now=utcnow()), generation=0, attempt=2
    )

    assert cancelled.sequence > retry.event.sequence
    # The retry published nothing metered: the cancellation is the generation's outcome.
    assert cancelled.usage == _billed(command.text, unusable=True)
    assert await _carried_out(_due(retry.next_command), make_deps) == cancelled
    # A copy of the retried attempt (a redelivery) finds the finish ahead and carries it out.
    assert await _carried_out(_due(command), make_deps) == cancelled
    assert _calls(fake_llm, marker) == 2


async def test_an_attempt_whose_lease_expired_is_cancelled_and_its_late_decision_fenced_out(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    command, marker = _task()
    now = utcnow()
    claim = await attempts.claim(command, now=now - LEASE * 2, lease=LEASE, owner="dead-worker")
    assert isinstance(claim, Claimed)

    _cancellation(await attempts.cancel(_cancel_of(command), now=now), generation=0, attempt=1)

    completed = Finish(
        TaskCompleted(
            task_id=command.task_id,
            sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
            attempt=1,
            submitted_at=command.submitted_at,
            result=ScoreResult(score=5, comment="late", model="m"),
        )
    )
    late = await attempts.decide(
        command, completed, now=now, raw_output=None, owner="dead-worker", claim=claim
    )
    assert late is False
    await _carried_out(_due(command), make_deps)
    assert _calls(fake_llm, marker) == 0


async def test_a_running_model_call_is_not_cancelled(attempts: Attempts) -> None:
    command, _ = _task()
    await attempts.claim(command, now=utcnow(), lease=LEASE, owner="scorer-a")
    before = await attempts.find(command.task_id)
    assert before is not None

    outcome = await attempts.cancel(_cancel_of(command), now=utcnow())

    assert isinstance(outcome, TooLate)
    after = await attempts.find(command.task_id)
    assert after is not None
    noted = after.pop(CANCEL_REQUESTED)  # for a retry it may end in: the attempt stands
    assert noted["generation"] == command.generation
    assert after == before


class _HeldModel:
    """The model, each call held until `answer` is set (`calling` tells it started)."""

    def __init__(self, inner: ScoreModel) -> None:
        self.inner = inner
        self.name = inner.name
        self.calling = asyncio.Event()
        self.answer = asyncio.Event()

    async def score(self, request: ScoringRequest) -> ModelVerdict:
        self.calling.set()
        await self.answer.wait()
        return await self.inner.score(request)

    async def check(self, model: str | None = None) -> None:
        await self.inner.check(model)


async def _cancelled_during_the_call(
    command: ScoreText, deps: ScorerDeps, attempts: Attempts
) -> tuple[object, Decision]:
    """The cancel's outcome when it came while the command's model call ran, and the
    decision of that call's delivery."""
    model = _HeldModel(deps.model)
    scoring = asyncio.create_task(score_text(command, deps=replace(deps, model=model)))
    await asyncio.wait_for(model.calling.wait(), timeout=30)
    outcome = await attempts.cancel(_cancel_of(command), now=utcnow())
    model.answer.set()
    return outcome, await asyncio.wait_for(scoring, timeout=60)


@pytest.mark.parametrize("faults", [RETRIED, ""], ids=["retried", "completed"])
async def test_a_cancel_during_a_model_call_cancels_the_retry_it_decides(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM, faults: str
) -> None:
    """The client was answered 202 `cancelling`; the call under way was found too late and
    the cancellation forgotten, so when that call ended in a retry the next attempt called
    the model again (found in review). Noted on the attempt, it cancels the next attempt
    as soon as the retry is recorded (not when it comes due: hours, after a long
    Retry-After), billed for what was spent; a call that completes still decides."""
    command, marker = _task(faults)
    outcome, decision = await _cancelled_during_the_call(command, make_deps("scorer-a"), attempts)

    assert isinstance(outcome, TooLate)
    calls = _calls(fake_llm, marker)
    assert isinstance(decision, Finish), decision
    if not faults:
        assert isinstance(decision.event, TaskCompleted)
        return
    cancelled = decision.event
    assert isinstance(cancelled, TaskFailed)
    assert cancelled.error.code == CANCELLED_CODE
    assert (cancelled.generation, cancelled.attempt) == (0, 2)
    assert cancelled.usage == _billed(command.text, unusable=True)
    # The retry's next attempt (a copy sent before the cancel landed) finds it decided.
    next_attempt = command.model_copy(update={"attempt": 2, "message_id": new_id()})
    assert await _carried_out(next_attempt, make_deps) == cancelled
    assert _calls(fake_llm, marker) == calls


async def test_a_cancel_during_the_last_attempts_call_keeps_its_give_up_out_of_the_dlq(
    make_deps: Deps, attempts: Attempts
) -> None:
    """The call failed with the task's attempts spent: its give-up was dead-lettered, and a
    replay of the DLQ (after an outage, say) scored and billed the task its client had
    cancelled (review of cancellation). The failure stands, without its dead letter."""
    command, _ = _task("[[fake:500]]")
    command = command.model_copy(update={"max_attempts": 1})
    outcome, decision = await _cancelled_during_the_call(command, make_deps("scorer-a"), attempts)

    assert isinstance(outcome, TooLate)
    assert isinstance(decision, Finish), decision
    assert decision.dead_letter_error is None
    failed = decision.event
    assert isinstance(failed, TaskFailed)
    assert failed.error.code != CANCELLED_CODE  # the call had started: its own failure
    assert failed.dead_lettered is False
    recorded = await recorded_decision(command, deps=make_deps("scorer-b"))
    assert recorded == decision  # carried out again as it was decided


class CancelledAsItDecides(Attempts):
    """The scorer's attempts, a client's cancellation noted just before the first decision
    is recorded (its call still `running`)."""

    def __init__(self, attempts: Attempts) -> None:  # shares the real one's collections
        self.__dict__.update(attempts.__dict__)
        self.outcomes: list[object] = []

    async def decide(self, command: ScoreText, decision: Finish | Retry, **kwargs: Any) -> bool:
        if not self.outcomes:
            self.outcomes.append(await self.cancel(_cancel_of(command), now=utcnow()))
        return await super().decide(command, decision, **kwargs)


async def test_a_cancel_noted_as_the_last_attempts_give_up_is_recorded_keeps_it_unlettered(
    make_deps: Deps, attempts: Attempts
) -> None:
    """The note was looked for before the record only: noted in between, the give-up was
    dead-lettered all the same, for a replay to score (re-read)."""
    command, _ = _task("[[fake:500]]")
    command = command.model_copy(update={"max_attempts": 1})
    racing = CancelledAsItDecides(attempts)
    decision = await score_text(command, deps=replace(make_deps("scorer-a"), attempts=racing))

    assert [type(outcome) for outcome in racing.outcomes] == [TooLate]
    assert isinstance(decision, Finish), decision
    assert decision.dead_letter_error is None
    assert isinstance(decision.event, TaskFailed)
    assert decision.event.dead_lettered is False
    # Recorded with its letter: a redelivery carrying it out again looks again (re-read).
    replayed = await recorded_decision(command, deps=make_deps("scorer-b"))
    assert isinstance(replayed, Finish), replayed
    assert replayed.dead_letter_error is None


async def test_a_cancel_noted_while_a_dead_workers_call_was_under_way_cancels_the_takeover(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """A scorer claimed the first attempt and died in its model call; the client's cancel,
    handled while that claim's lease still held, was noted on the attempt (too late for the
    call under way). The delivery came back, took the claim over once the lease ended, and
    called the model: the first attempt read nothing before its call, so the note went
    unseen and the cancelled task was scored (32 of a batch cancelled while every scorer was
    down, in a walkthrough)."""
    command, marker = _task()
    claimed_at = utcnow() - 2 * LEASE  # the dead worker's claim: its lease is over now
    claim = await attempts.claim(command, now=claimed_at, lease=LEASE, owner="dead-scorer")
    assert isinstance(claim, Claimed)
    assert claim.made_the_record
    noted = await attempts.cancel(_cancel_of(command), now=claimed_at + LEASE / 2)
    assert isinstance(noted, TooLate)

    cancelled = await _carried_out(command, make_deps)

    assert (cancelled.generation, cancelled.attempt) == (0, 1)
    assert _calls(fake_llm, marker) == 0


class _NoteUnread(Attempts):
    """The note cannot be read when the retry lands (the database away that moment)."""

    async def cancel_requested_at(self, command: ScoreText) -> datetime | None:
        raise AutoReconnect("the database went away")


async def test_a_noted_cancel_missed_at_the_retry_cancels_the_next_attempt_at_its_claim(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM, mongo: Any, db_prefix: str
) -> None:
    command, marker = _task(RETRIED)
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        store = _NoteUnread(client, f"{db_prefix}_scorer", retention=timedelta(hours=1))
        unread = replace(make_deps("scorer-a"), attempts=store)
        outcome, retry = await _cancelled_during_the_call(command, unread, attempts)
    finally:
        await client.close()

    assert isinstance(outcome, TooLate)
    assert isinstance(retry, Retry), retry
    calls = _calls(fake_llm, marker)
    cancelled = await _carried_out(_due(retry.next_command), make_deps)
    assert (cancelled.generation, cancelled.attempt) == (0, 2)
    assert cancelled.usage == _billed(command.text, unusable=True)
    assert _calls(fake_llm, marker) == calls  # the next attempt called no model


async def test_a_rescore_running_or_retrying_over_a_completion_is_not_cancelled(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """Its claim replaced the stored completion, and a cancel found it running (noted, then
    its retry cancelled) or retrying (cancelled at once): its failure replaced the task's
    result (a documented limit, then found widened by the note in review)."""
    command, _ = _task()
    completed = await score_text(command, deps=make_deps("scorer-a"))
    assert isinstance(completed, Finish)
    rescore = command.model_copy(
        update={"generation": 1, "message_id": new_id(), "text": command.text + " " + RETRIED}
    )
    outcome, decision = await _cancelled_during_the_call(rescore, make_deps("scorer-b"), attempts)

    assert outcome == TooLate(COMPLETION_STANDS)
    assert isinstance(decision, Retry), decision  # the re-score goes on
    retrying = await attempts.cancel(_cancel_of(rescore), now=utcnow())
    assert retrying == TooLate(COMPLETION_STANDS)
    held = await attempts.find(command.task_id)
    assert held is not None
    assert CANCEL_REQUESTED not in held


async def test_a_finished_task_is_not_cancelled(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    command, marker = _task()
    finished = await score_text(command, deps=make_deps("scorer-a"))
    assert isinstance(finished, Finish)
    assert isinstance(finished.event, TaskCompleted)

    outcome = await attempts.cancel(_cancel_of(command), now=utcnow())

    assert isinstance(outcome, TooLate)
    assert await score_text(_due(command), deps=make_deps("scorer-b")) == finished
    assert _calls(fake_llm, marker) == 1


async def test_a_cancel_of_an_older_generation_is_too_late(attempts: Attempts) -> None:
    command, _ = _task()
    rescored = command.model_copy(update={"generation": 1, "message_id": new_id()})
    await attempts.claim(rescored, now=utcnow() - LEASE * 2, lease=LEASE, owner="dead-worker")

    outcome = await attempts.cancel(_cancel_of(command, generation=0), now=utcnow())

    assert isinstance(outcome, TooLate)


async def test_a_rescore_of_a_completed_task_is_not_cancelled_and_its_completion_stands(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """Generation 0 completed; a re-score took generation 1, not claimed yet. Cancelling it
    recorded a failure over the completion: the projection showed the task failed
    (`cancelled`), its result gone."""
    command, marker = _task()
    completed = await score_text(command, deps=make_deps("scorer-a"))
    assert isinstance(completed, Finish)
    assert isinstance(completed.event, TaskCompleted)
    before = await attempts.find(command.task_id)

    outcome = await attempts.cancel(_cancel_of(command, generation=1), now=utcnow())

    assert outcome == TooLate(COMPLETION_STANDS)
    assert await attempts.find(command.task_id) == before
    # The re-score is scored as any: its command claims generation 1 and calls the model.
    rescore = command.model_copy(update={"generation": 1, "message_id": new_id()})
    rescored = await score_text(rescore, deps=make_deps("scorer-b"))
    assert isinstance(rescored, Finish)
    assert isinstance(rescored.event, TaskCompleted)
    assert _calls(fake_llm, marker) == 2


async def test_a_replay_of_a_failed_generation_is_cancelled(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """A failure stored for generation 0 (a DLQ replay takes generation 1 to run it again)
    does not stand in a cancellation's way, as a completion does."""
    command, marker = _task("[[fake:reject]]")
    failed = await score_text(command, deps=make_deps("scorer-a"))
    assert isinstance(failed, Finish)
    assert isinstance(failed.event, TaskFailed)

    cancelled = _cancellation(
        await attempts.cancel(_cancel_of(command, generation=1), now=utcnow()),
        generation=1,
        attempt=1,
    )

    replay = command.model_copy(update={"generation": 1, "message_id": new_id()})
    assert await _carried_out(replay, make_deps) == cancelled
    assert _calls(fake_llm, marker) == 1


async def test_a_newer_generation_is_cancelled_over_a_retrying_one_with_its_tokens(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """Generation 0 retried (billed, no outcome); the re-score's generation 1 is cancelled
    before any scorer claimed it: its failure meters generation 0's tokens, and generation
    0's next attempt is superseded."""
    command, marker = _task(RETRIED)
    retry = await score_text(command, deps=make_deps("scorer-a"))
    assert isinstance(retry, Retry)

    cancelled = _cancellation(
        await attempts.cancel(_cancel_of(command, generation=1), now=utcnow()),
        generation=1,
        attempt=1,
    )

    assert cancelled.usage == _billed(command.text, unusable=True)
    rescore = command.model_copy(update={"generation": 1, "message_id": new_id()})
    assert await _carried_out(rescore, make_deps) == cancelled
    dropped = await score_text(_due(retry.next_command), deps=make_deps("scorer-b"))
    assert isinstance(dropped, Drop)
    assert _calls(fake_llm, marker) == 2


# --- The consumer of score.cancel, handed deliveries directly, on the real broker -----------


async def _handled(attempts: Attempts, broker: RabbitBroker, delivery: HandedDelivery) -> None:
    """`delivery` handled by the consumer of `score.cancel`, which publishes on `broker`."""
    handler = HandlerOnly()
    cancels = TaskCancels(attempts=attempts, broker=broker, clock=utcnow, timeout_s=5)
    subscribe_cancels(cast(ScoreboxBroker, handler), cancels)
    async with asyncio.timeout(HANDLER_DEADLINE_S):
        await handler.handler(delivery)


async def _cancel_letters(amqp_url: str, body: bytes) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """The letters in the cancels' DLQ whose body is `body` (all drained)."""
    letters = await drain(amqp_url, TASK_CANCELS.dead_letter_routing_key)
    return [letter for letter in letters if letter.body == body]


class AckedAfterItsLetter(HandedDelivery):
    """A delivery that, when acked, takes its letters off the cancels' DLQ (`letters_at_ack`):
    acked before the broker confirmed its letter, it finds none there."""

    def __init__(self, amqp_url: str, body: bytes, **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self._amqp_url = amqp_url
        self.letters_at_ack: list[aio_pika.abc.AbstractIncomingMessage] | None = None

    @override
    async def ack(self) -> None:
        self.letters_at_ack = await _cancel_letters(self._amqp_url, self.body)
        await super().ack()


async def test_an_unreadable_cancel_is_dead_lettered_with_its_error_then_acked(
    attempts: Attempts, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """The letter goes through the DLX to the cancels' DLQ, where a broken binding would
    return it unroutable; the delivery is acked once it is there."""
    body = b'{"task_id": "not a cancellation"}'
    delivery = AckedAfterItsLetter(
        amqp_url, body, routing_key=CancelTask.routing_key, message_id="m-1"
    )

    await _handled(attempts, task_broker, delivery)

    assert delivery.settled == ["ack"]
    assert delivery.letters_at_ack is not None, "acked"
    [letter] = delivery.letters_at_ack
    assert (letter.exchange, letter.routing_key) == (DLX.name, TASK_CANCELS.dead_letter_routing_key)
    assert (letter.body, letter.message_id) == (body, "m-1")
    assert letter.headers[DEAD_LETTERED_FROM_HEADER] == TASK_CANCELS.name
    error = str(letter.headers[ERROR_HEADER])
    assert error.startswith("unreadable score.cancel: ")
    assert "validation error" in error


async def test_a_cancellation_the_database_refuses_for_good_is_returned_as_failed(
    attempts: Attempts, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """Not waited out as an outage (which held the delivery for ever): returned as failed,
    for the queue's delivery limit to dead-letter it."""
    command, _ = _task()
    # The store's own group writer, over the refusing collection.
    refusing = RefusingCollection(attempts._collection)
    attempts._writes = GroupWriter(cast("AsyncCollection[dict[str, Any]]", refusing))
    body = _cancel_of(command).model_dump_json().encode()
    delivery = HandedDelivery(body)

    async with outcomes(amqp_url) as published:
        await _handled(attempts, task_broker, delivery)
        await published.read_for(command.task_id)  # a confirmed event is in the queue by now

    assert refusing.bulk_writes == 1
    assert delivery.settled == RETURNED_AS_FAILED
    assert published.of(command.task_id) == []  # no failure published
    assert await _cancel_letters(amqp_url, body) == []  # left to the queue's delivery limit
    assert await attempts.find(command.task_id) is None


# --- The whole scorer on the real broker -----------------------------------------------------


class Scorer:
    def __init__(
        self,
        amqp_url: str,
        llm: FakeLLM,
        attempts: AsyncCollection[dict[str, Any]],
        http: httpx.AsyncClient,
    ) -> None:
        self.amqp_url = amqp_url
        self.llm = llm
        self.attempts = attempts  # the scorer's own attempts store, read only
        self.http = http  # its HTTP API (metrics)

    async def drops(self) -> float:
        exposition = (await self.http.get("/metrics")).text
        return metric_sum(exposition, "scorebox_scorer_decisions_total", decision="drop")

    async def send(self, message: ScoreText | CancelTask) -> None:
        broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": self.amqp_url}))
        async with broker:
            await broker.connect()
            if isinstance(message, CancelTask):
                await publish_cancel(broker, message, timeout=10)
            else:
                await publish_command(broker, message, now=utcnow(), timeout=10)


@pytest.fixture(scope="module")
async def scorer(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Scorer]:
    llm = await start_fake_llm(FakeLLMConfig())
    setup = scorer_over(llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix)
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    async with running(setup.app()) as http:
        attempts = client[setup.settings.database_name("scorer")]["attempts"]
        yield Scorer(amqp_url, llm, attempts, http)
    await client.close()
    await llm.stop()


async def test_a_delayed_task_cancelled_is_failed_and_its_command_calls_no_model(
    scorer: Scorer,
) -> None:
    """The command is delivered only once the cancellation's failure has been seen, as the
    wait ladder delivers a task due later (it raced a 2 s delay against the cancel). Once
    due, it collides with the cancellation, which its consumer published and noted so: it
    is dropped. Published again, days after the status service had let the failed task
    expire, it brought the task back there, and its webhook perhaps a second time (found in
    review)."""
    command, marker = _task()
    delayed = command.model_copy(update={"not_before": utcnow() + timedelta(hours=1)})
    async with outcomes(scorer.amqp_url) as published:
        await scorer.send(_cancel_of(delayed))
        cancelled: TaskFailed = await published.next_of(command.task_id, TaskFailed)

        async def noted() -> bool:
            held = await scorer.attempts.find_one({"_id": command.task_id}) or {}
            return bool(held.get("decision", {}).get(PUBLISHED))

        await eventually(noted, what="the cancellation noted as published")
        drops = await scorer.drops()
        await scorer.send(_due(delayed))

        async def dropped() -> bool:
            return await scorer.drops() > drops

        await eventually(dropped, what="the due command dropped")
        await published.read_for(command.task_id)

    assert cancelled.error.code == CANCELLED_CODE
    assert [type(event) for event in published.seen] == [TaskFailed]
    assert _calls(scorer.llm, marker) == 0


# How long the fake model takes to answer the call a cancellation arrives during.
CALL_LATENCY_MS = 5000


async def test_a_cancel_arriving_during_the_model_call_lets_the_task_complete(
    scorer: Scorer, caplog: pytest.LogCaptureFixture
) -> None:
    """The cancel is sent once the attempt holds a live claim and its model call has reached
    the model, and found too late for that reason (not because the task finished)."""
    caplog.set_level(logging.DEBUG, logger="scorebox.scorer")  # the reason is logged at DEBUG
    command, marker = _task()
    scorer.llm.config.latency_ms = CALL_LATENCY_MS  # read as the call arrives
    try:
        async with outcomes(scorer.amqp_url) as published:
            await scorer.send(command)

            async def calling() -> bool:
                held = await scorer.attempts.find_one({"_id": command.task_id})
                return (
                    held is not None
                    and (held["generation"], held["attempt"], held["state"]) == (0, 1, "running")
                    and held["lease_until"] > utcnow()
                    and _calls(scorer.llm, marker) == 1
                )

            await eventually(calling, what="the model call under a live claim")
            scorer.llm.config.latency_ms = 0.0
            await scorer.send(_cancel_of(command))

            async def too_late() -> str | None:
                found = [
                    record.getMessage()
                    for record in caplog.records
                    if record.getMessage().startswith(f"cancellation of {command.task_id} too late")
                ]
                return found[0] if found else None

            reason = await eventually(too_late, what="the cancellation found too late")
            completed: TaskCompleted = await published.next_of(command.task_id, TaskCompleted)
    finally:
        scorer.llm.config.latency_ms = 0.0

    assert "attempt 1 is running (its model call under way)" in reason
    assert completed.attempt == 1
    assert not [event for event in published.seen if not isinstance(event, TaskCompleted)]
    assert _calls(scorer.llm, marker) == 1


async def test_the_cancellation_that_replaced_a_retry_is_carried_out_again_at_the_limit(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """This attempt's delivery carried out the cancellation of the next attempt (which
    replaced its retry); should its publish be lost and the delivery come back at its limit,
    the recorded cancellation was taken for a newer attempt's, whose own delivery would carry
    it out, and dropped: no next attempt was ever sent (found in review)."""
    command, _ = _task(RETRIED)
    deps = make_deps("scorer-a")
    outcome, decision = await _cancelled_during_the_call(command, deps, attempts)
    assert isinstance(outcome, TooLate)
    assert isinstance(decision, Finish)

    again = await recorded_decision(_due(command), deps=deps)

    assert again == decision


async def _rescore_retrying_over_a_completion(command: ScoreText, make_deps: Deps) -> ScoreText:
    """Generation 0 completed, then a re-score (generation 1) decided a retry: returned."""
    assert isinstance(await score_text(command, deps=make_deps("scorer-a")), Finish)
    rescore = command.model_copy(
        update={"generation": 1, "message_id": new_id(), "text": f"{command.text} {RETRIED}"}
    )
    assert isinstance(await score_text(rescore, deps=make_deps("scorer-a")), Retry)
    return rescore


async def test_a_newer_generation_over_a_retrying_rescore_of_a_completion_is_not_cancelled(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """The completion is still the task's latest outcome: cancelling generation 2 (a replay)
    over the re-score's retry wrote a failure that replaced the result (found in review)."""
    command, _ = _task()
    await _rescore_retrying_over_a_completion(command, make_deps)

    outcome = await attempts.cancel(_cancel_of(command, generation=2), now=utcnow())

    assert outcome == TooLate(COMPLETION_STANDS)


async def test_a_mark_left_by_a_document_written_over_it_says_nothing(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM, mongo: Any, db_prefix: str
) -> None:
    """`over_completion` names the generation it belongs to. Generation 1, a re-score over a
    completion, failed (its failure replaced the result); generation 2, its replay, was
    claimed by a scorer of an earlier build, whose claim sets only its own fields and left
    the mark. As a flag it refused the cancel of generation 2 (found in review)."""
    command, _ = _task()
    assert isinstance(await score_text(command, deps=make_deps("scorer-a")), Finish)
    rescore = command.model_copy(
        update={"generation": 1, "message_id": new_id(), "text": f"{command.text} [[fake:reject]]"}
    )
    failed = await score_text(rescore, deps=make_deps("scorer-a"))
    assert isinstance(failed, Finish)
    assert isinstance(failed.event, TaskFailed)
    long_ago = utcnow() - 2 * LEASE
    earlier_build_claim: list[dict[str, Any]] = [
        {"$set": {"generation": 2, "attempt": 1, "state": "running", "owner": "dead-worker"}},
        {"$set": {"lease_until": long_ago + LEASE, "updated_at": long_ago}},
        {"$unset": ["decision", "raw_output"]},
    ]
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        documents = client[f"{db_prefix}_scorer"]["attempts"]
        await documents.update_one({"_id": command.task_id}, earlier_build_claim)
    finally:
        await client.close()

    outcome = await attempts.cancel(_cancel_of(command, generation=2), now=utcnow())

    _cancellation(outcome, generation=2, attempt=1)


async def test_a_mark_of_a_generation_stored_as_int64_still_stands(
    attempts: Attempts, mongo: Any, db_prefix: str
) -> None:
    """A generation past 2^31 is stored, and read back, as `bson.Int64`, which a strict
    `int` type check took for no mark (found in review)."""
    command, _ = _task()
    generation = Int64(2**31)
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        await client[f"{db_prefix}_scorer"]["attempts"].insert_one(
            {
                "_id": command.task_id,
                "generation": generation,
                "attempt": 1,
                "state": "running",
                "owner": "scorer-a",
                "lease_until": utcnow() + LEASE,
                "over_completion": generation,
            }
        )
    finally:
        await client.close()

    outcome = await attempts.cancel(_cancel_of(command, generation=2**31), now=utcnow())

    assert outcome == TooLate(COMPLETION_STANDS)
