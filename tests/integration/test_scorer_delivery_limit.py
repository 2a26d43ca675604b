"""At the score queue's delivery limit, the scorer carries out the attempt's recorded decision
when it has one, sends an attempt never claimed again with its count cleared (a bounded
number of times), and gives the message up only when nothing was decided.

Each loss of the connection while a delivery is in hand counts towards the limit, the last
one possibly after the decision was recorded and before it was carried out. Giving up
regardless published `task.failed` for a task whose result was stored (or next to the retry
it had scheduled). `recorded_decision` runs here on the real database (MongoDB or the
stand-in), and the scorer's broker actions publish on the real broker: a copy handed back is
read from a queue bound where it is sent, a dead letter from the score queue's DLQ. The
delivery-limit path itself, with nothing decided, is the fault test
`test_message_that_kills_the_scorer_every_time_stops_at_the_delivery_limit`.

A delivery at the limit (or at the crash limit) never waits for another claim's lease or a
database outage: held, it came back past the limit when its connection dropped, for RabbitMQ
to dead-letter without a reason. It is handed back as a copy carrying its count, which
comes back at the limit and looks again (the broker's side: `test_scorer_limit_hand_back.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import datetime
from typing import Any, override

import pytest
from faststream.rabbit import RabbitBroker
from pymongo.errors import AutoReconnect

from devtools.fake_llm import FakeLLM
from services.scorer import consumer
from services.scorer.attempts import Attempts, Busy, Cancelled, Claimed, ClaimResult, TooLate
from services.scorer.consumer import (
    AT_CRASH_LIMIT_HEADER,
    CRASH_RETRY_DELAY,
    CRASHES_HEADER,
    UNSTARTED_RESETS,
    UNSTARTED_RESETS_HEADER,
    _at_delivery_limit,
    subscribe_scorer,
)
from services.scorer.decisions import Decision, Drop, Finish, Retry
from services.scorer.scoring import (
    DUE_SLACK,
    ScorerDeps,
    _cancel_requested,
    recorded_decision,
    score_text,
)
from services.scorer.slots import ModelSlots
from shared.consumers import Delivery
from shared.contracts import (
    CANCELLED_CODE,
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskError,
    TaskEvent,
    TaskFailed,
    TaskRetrying,
    event_sequence,
    utcnow,
)
from shared.topology import (
    DEAD_LETTERED_FROM_HEADER,
    EARLIER_DELIVERIES_HEADER,
    ERROR_HEADER,
    SCORE_REQUESTS,
    deliveries_lost,
)
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.test_scorer_own_claims import (
    LEASE,
    CarriedOut,
    Deps,
    _calls,
    _command,
    _letters,
    watching_commands,
)
from tests.support import HandedDelivery, HandlerOnly, eventually

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps

CRASH_LIMIT = 3
# Shorter than the other claims' lease (`LEASE`): a delivery held for it fails the test.
HANG_GUARD_S = 30


async def test_a_decided_attempt_is_carried_out_again(make_deps: Deps) -> None:
    deps = make_deps("proc-a")
    command, _ = _command("Decided before the connection was lost.")
    decided = await score_text(command, deps=deps)
    assert isinstance(decided, Finish)

    assert await recorded_decision(command, deps=deps) == decided


async def test_an_attempt_claimed_but_not_decided_is_given_up_once_its_lease_ended(
    make_deps: Deps, attempts: Attempts, amqp_url: str, task_broker: RabbitBroker
) -> None:
    command, _ = _command("Its consumer died holding it, every time.")
    await attempts.claim(command, now=utcnow() - 2 * LEASE, lease=LEASE, owner="proc-b:1:dead")
    assert isinstance(await recorded_decision(command, deps=make_deps("proc-a")), Busy)
    actions = Recording(task_broker)

    await _at_limit(command, make_deps("proc-a"), actions)

    assert actions.done == ["dead-lettered", "failed"]
    [letter] = await _letters(amqp_url, command.model_dump_json().encode())
    assert letter.headers[DEAD_LETTERED_FROM_HEADER] == SCORE_REQUESTS.name
    assert str(letter.headers[ERROR_HEADER]).startswith(
        "its consumer died or lost its connection holding it"
    )


async def test_an_attempt_cancelled_during_its_dead_workers_call_is_cancelled_at_the_limit(
    make_deps: Deps, attempts: Attempts, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """Its give-up was dead-lettered as an internal error, and a replay of the DLQ scored
    the task its client had cancelled (review of cancellation)."""
    command, _ = _command("Its consumer died calling the model; its client cancelled it.")
    await attempts.claim(command, now=utcnow(), lease=LEASE, owner="proc-b:1:dead")
    assert isinstance(
        await attempts.cancel(_cancel_requested(command, utcnow()), now=utcnow()), TooLate
    )
    later = replace(make_deps("proc-a"), clock=lambda: utcnow() + 2 * LEASE)  # its lease over
    actions = Recording(task_broker)

    await _at_limit(command, later, actions)

    assert actions.done == ["failed"]
    assert await _letters(amqp_url, command.model_dump_json().encode()) == []  # nothing to replay
    decided = await recorded_decision(command, deps=later)
    assert isinstance(decided, Finish), decided
    assert isinstance(decided.event, TaskFailed)
    assert decided.event.error.code == CANCELLED_CODE
    assert decided.dead_letter_error is None


class DecidedAfterFirstLook(Attempts):
    """The scorer's attempts, where the claim's holder records its decision right after the
    delivery at the limit first looked (the shielded decision of a delivery whose connection
    dropped, its model call still running)."""

    def __init__(self, attempts: Attempts, decide: Callable[[], Awaitable[object]]) -> None:
        self.__dict__.update(attempts.__dict__)  # shares the real one's collections
        self.decide_later: Callable[[], Awaitable[object]] | None = decide

    async def standing(self, command: ScoreText) -> ClaimResult:
        standing = await super().standing(command)
        if self.decide_later is not None:
            decide, self.decide_later = self.decide_later, None
            await decide()
        return standing


async def test_an_attempt_still_running_at_the_limit_is_handed_back_and_its_copy_carries_it_out(
    make_deps: Deps, attempts: Attempts, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """Given up while the shielded call went on: its decision was recorded a moment later and
    carried out by nobody, the task read failed with its result stored. Waited for with the
    delivery held (up to the lease), the delivery came back past the limit when its
    connection dropped meanwhile, dead-lettered by RabbitMQ: no delivery was left to carry
    the decision out (found in review). Its copy, due when the lease ends, does."""
    command, _ = _command("Still being scored when its last delivery came.")
    claim = await _claimed(attempts, command, owner="proc-a:1:shielded")
    deps, actions = make_deps("proc-a"), Recording(task_broker)

    async with watching_commands(amqp_url) as commands:
        await _at_limit(command, deps, actions)
        [copy] = await commands.taken()

    assert actions.done == ["resent"]
    assert copy.headers[EARLIER_DELIVERIES_HEADER] == SCORE_REQUESTS.delivery_limit
    assert copy.command.not_before == await _lease_until(attempts, command) + DUE_SLACK
    assert (copy.command.task_id, copy.command.attempt) == (command.task_id, command.attempt)

    await _decided(attempts, command, _completion(command), claim, owner="proc-a:1:shielded")
    await _at_limit(copy.command, deps, actions, headers=copy.headers, count=0)

    assert actions.done == ["resent", "Finish"]


async def test_a_claim_decided_right_after_the_look_at_the_limit_is_carried_out_by_the_copy(
    make_deps: Deps, attempts: Attempts, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """The race the hand-back leaves: the decision lands between the look and the copy."""
    command, _ = _command("Decided right after its last delivery looked.")
    claim = await _claimed(attempts, command, owner="proc-a:1:shielded")
    deps, actions = make_deps("proc-a"), Recording(task_broker)

    async def shielded_call_ends() -> object:
        return await _decided(
            attempts, command, _completion(command), claim, owner="proc-a:1:shielded"
        )

    async with watching_commands(amqp_url) as commands:
        await _at_limit(
            command,
            replace(deps, attempts=DecidedAfterFirstLook(attempts, shielded_call_ends)),
            actions,
        )
        [copy] = await commands.taken()
    await _at_limit(copy.command, deps, actions, headers=copy.headers, count=0)

    assert actions.done == ["resent", "Finish"]


async def test_at_the_crash_limit_another_claim_hands_the_message_back_to_come_back_there(
    make_deps: Deps, attempts: Attempts, fake_llm: Any, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """The give-up refused (another worker's claim holds the attempt), the delivery was held
    for that claim's lease. Its copy carries the crashes that reached the limit: it looks
    again there, and carries the other worker's decision out, never calling the model."""
    command, marker = _command("Crashed on, while another worker calls the model.")
    claim = await _claimed(attempts, command, owner="proc-b:1:live")
    deps, actions = make_deps("proc-a"), Recording(task_broker)
    handler = HandlerOnly()
    crashing = replace(deps, attempts=CrashesOnClaim(attempts))
    subscribe_scorer(handler, crashing, actions, crash_limit=CRASH_LIMIT)  # type: ignore[arg-type]
    body = command.model_dump_json().encode()
    last_crash = HandedDelivery(body, headers={CRASHES_HEADER: CRASH_LIMIT - 1})

    async with watching_commands(amqp_url) as commands:
        async with asyncio.timeout(HANG_GUARD_S):
            await handler.handler(last_crash)
        [copy] = await commands.taken()

    assert (actions.done, last_crash.settled) == (["resent"], ["ack"])
    assert copy.headers[CRASHES_HEADER] == CRASH_LIMIT
    assert copy.headers[AT_CRASH_LIMIT_HEADER] == 1
    assert copy.command.not_before == await _lease_until(attempts, command) + DUE_SLACK

    await _decided(attempts, command, _completion(command), claim, owner="proc-b:1:live")
    came_back = HandedDelivery(copy.command.model_dump_json().encode(), headers=copy.headers)
    async with asyncio.timeout(HANG_GUARD_S):
        await handler.handler(came_back)

    assert (actions.done, came_back.settled) == (["resent", "Finish"], ["ack"])
    assert _calls(fake_llm, marker) == 0


async def test_a_message_crashed_on_as_often_as_a_lowered_limit_gets_its_try(
    make_deps: Deps, fake_llm: Any, task_broker: RabbitBroker
) -> None:
    """Only a copy the crash limit handed back skips the model: one that counts as many
    crashes as a limit lowered since (a deploy) was given up at arrival, though it had one
    more try coming under the limit it crashed under (a review)."""
    command, marker = _command("Crashed on under a higher limit.")
    deps, actions = make_deps("proc-a"), Recording(task_broker)
    handler = HandlerOnly()
    subscribe_scorer(handler, deps, actions, crash_limit=CRASH_LIMIT)  # type: ignore[arg-type]
    delivery = HandedDelivery(
        command.model_dump_json().encode(), headers={CRASHES_HEADER: CRASH_LIMIT}
    )

    async with asyncio.timeout(HANG_GUARD_S):
        await handler.handler(delivery)

    assert (actions.done, delivery.settled) == (["Finish"], ["ack"])
    assert _calls(fake_llm, marker) == 1


class CrashesOnClaim(Attempts):
    """The scorer's attempts, its first claim crashing (a bug), the later ones real."""

    def __init__(self, attempts: Attempts) -> None:
        self.__dict__.update(attempts.__dict__)  # shares the real one's collections
        self.crashed = False

    async def claim(self, command: ScoreText, **kwargs: Any) -> ClaimResult:
        if not self.crashed:
            self.crashed = True
            raise RuntimeError("a bug in the claim")
        return await super().claim(command, **kwargs)


async def test_a_newer_attempts_decision_at_the_limit_drops_the_message(
    make_deps: Deps,
) -> None:
    """Attempt 1's retry was carried out but its ack lost; attempt 2 completed; attempt 1's
    message then reached the limit and was given up: a failed outcome next to a completion."""
    deps = make_deps("proc-a")
    command, _ = _command("Retried, then completed.")
    retried = command.model_copy(update={"attempt": command.attempt + 1})
    assert isinstance(await score_text(retried, deps=deps), Finish)

    assert isinstance(await recorded_decision(command, deps=deps), Drop)


async def test_an_attempt_never_claimed_is_sent_again_with_its_count_cleared(
    make_deps: Deps, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """Its deliveries were lost waiting in a prefetch (each drop of the connection returns
    every delivery in hand), not working: given up, a task that never started failed."""
    command, _ = _command("Waited in a prefetch through five dropped connections.")
    actions = Recording(task_broker)

    async with watching_commands(amqp_url) as commands:
        await _at_limit(
            command, make_deps("proc-a"), actions, headers={EARLIER_DELIVERIES_HEADER: 2}
        )
        [copy] = await commands.taken()

    assert actions.done == ["resent"]
    assert (copy.command.task_id, copy.command.attempt) == (command.task_id, command.attempt)
    assert copy.headers[UNSTARTED_RESETS_HEADER] == 1
    assert EARLIER_DELIVERIES_HEADER not in copy.headers
    assert await _letters(amqp_url, command.model_dump_json().encode()) == []


async def test_a_next_attempt_never_claimed_is_sent_again_with_its_count_cleared(
    make_deps: Deps, amqp_url: str, task_broker: RabbitBroker
) -> None:
    deps = make_deps("proc-a")
    command, _ = _command("Retried, and the retry waited through dropped connections.")
    retry = Retry(_retrying(command), command.model_copy(update={"attempt": 2}))
    claim = await _claimed(deps.attempts, command, owner=deps.owner)
    await _decided(deps.attempts, command, retry, claim, owner=deps.owner)
    actions = Recording(task_broker)

    async with watching_commands(amqp_url) as commands:
        await _at_limit(retry.next_command, deps, actions)
        [copy] = await commands.taken()

    assert actions.done == ["resent"]
    assert (copy.command.task_id, copy.command.attempt) == (command.task_id, 2)
    assert copy.headers[UNSTARTED_RESETS_HEADER] == 1
    assert EARLIER_DELIVERIES_HEADER not in copy.headers


async def test_an_attempt_never_claimed_is_given_up_once_its_resets_are_spent(
    make_deps: Deps, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """A message that kills the scorer before its claim must stop too."""
    command, _ = _command("Killed the scorer before its claim, every time.")
    actions = Recording(task_broker)
    spent = {UNSTARTED_RESETS_HEADER: UNSTARTED_RESETS}

    await _at_limit(command, make_deps("proc-a"), actions, headers=spent)

    assert actions.done == ["dead-lettered", "failed"]
    [letter] = await _letters(amqp_url, command.model_dump_json().encode())
    assert letter.headers[DEAD_LETTERED_FROM_HEADER] == SCORE_REQUESTS.name
    assert letter.headers[UNSTARTED_RESETS_HEADER] == UNSTARTED_RESETS
    assert letter.headers[EARLIER_DELIVERIES_HEADER] == SCORE_REQUESTS.delivery_limit


async def test_an_attempt_a_newer_one_superseded_is_dropped(
    make_deps: Deps,
    attempts: Attempts,
) -> None:
    command, _ = _command("Retried since.")
    newer = command.model_copy(update={"attempt": command.attempt + 1})
    await attempts.claim(newer, now=utcnow(), lease=LEASE, owner="proc-b:1:live")

    assert isinstance(await recorded_decision(command, deps=make_deps("proc-a")), Drop)


async def test_a_new_generation_at_the_limit_is_not_given_the_earlier_ones_decision(
    make_deps: Deps,
) -> None:
    """A re-score (generation 1) that reached the delivery limit before any scorer claimed it
    was answered with generation 0's recorded completion: published again (stale, ignored)
    and acked, so the re-score never ran and no outcome of it was ever published."""
    deps = make_deps("proc-a")
    command, _ = _command("Scored, then re-scored.")
    assert isinstance(await score_text(command, deps=deps), Finish)
    rescore = command.model_copy(update={"generation": command.generation + 1, "attempt": 1})

    assert await recorded_decision(rescore, deps=deps) is None


async def test_a_cancellation_published_already_is_dropped_at_the_limit(
    make_deps: Deps, attempts: Attempts, task_broker: RabbitBroker
) -> None:
    """Carried out again, a command reaching its limit after its task was cancelled
    republished `task.failed` (cancelled), possibly days later, as a delayed task's command
    did on the normal path until `_not_claimed` dropped it (found in review)."""
    command, _ = _command("Cancelled, its failure published, then at its delivery limit.")
    cancel = _cancel_requested(command, utcnow())
    outcome = await attempts.cancel(cancel, now=utcnow())
    assert isinstance(outcome, Cancelled)
    await attempts.note_cancellation_published(cancel, outcome.decision)
    actions = Recording(task_broker)

    await _at_limit(command, make_deps("proc-a"), actions)

    assert actions.done == ["Drop"]


class AwayOnce(Attempts):
    """The scorer's attempts, the database away for the first look at one."""

    def __init__(self, attempts: Attempts) -> None:  # shares the real one's collections
        self.__dict__.update(attempts.__dict__)
        self.failed = False

    async def standing(self, command: ScoreText) -> ClaimResult:
        if not self.failed:
            self.failed = True
            raise AutoReconnect("the database is away")
        return await super().standing(command)


class Recording(CarriedOut):
    """The scorer's broker actions (`BrokerActions`) on `broker`, noting in `done`, in order,
    what each one carried out once the broker confirmed it. What they published (a copy, a
    dead letter) is read from the broker's queues: recorded alone, a letter sent to the
    wrong queue passed."""

    def __init__(self, broker: RabbitBroker) -> None:
        super().__init__(broker)
        self.done: list[str] = []

    @override
    async def resend(self, command: ScoreText, *, headers: dict[str, Any]) -> None:
        await super().resend(command, headers=headers)
        self.done.append("resent")

    @override
    async def carry_out(self, decision: Decision, message: Delivery) -> bool | None:
        lettered = await super().carry_out(decision, message)
        self.done.append(type(decision).__name__)
        return lettered

    @override
    async def dead_letter(self, message: Delivery, error: str) -> bool:
        lettered = await super().dead_letter(message, error)
        self.done.append("dead-lettered" if lettered else "returned as failed")
        return lettered

    @override
    async def fail_task(self, failed: TaskEvent) -> None:
        await super().fail_task(failed)
        self.done.append("failed")


async def test_a_database_away_at_the_limit_is_waited_out_not_taken_for_nothing_decided(
    make_deps: Deps, attempts: Attempts, task_broker: RabbitBroker
) -> None:
    """The task of a decided attempt was dead-lettered and failed when the database did not
    answer at that moment, though its result was stored."""
    deps = make_deps("proc-a")
    command, _ = _command("Decided, then the database blinked.")
    assert isinstance(await score_text(command, deps=deps), Finish)
    actions = Recording(task_broker)
    limit = SCORE_REQUESTS.delivery_limit

    await _at_delivery_limit(
        command,
        HandedDelivery.redelivery(command.model_dump_json().encode(), count=limit),
        replace(deps, attempts=AwayOnce(attempts)),
        actions,
        limit,
    )

    assert actions.done == ["Finish"]


class Away(Attempts):
    """The scorer's attempts, the database away for every read."""

    def __init__(self, attempts: Attempts) -> None:  # shares the real one's collections
        self.__dict__.update(attempts.__dict__)

    async def find(self, task_id: str) -> dict[str, Any] | None:
        raise AutoReconnect("the database is away")

    async def standing(self, command: ScoreText) -> ClaimResult:
        raise AutoReconnect("the database is away")


async def test_a_database_away_for_long_at_the_limit_hands_the_delivery_back(
    make_deps: Deps,
    attempts: Attempts,
    monkeypatch: pytest.MonkeyPatch,
    amqp_url: str,
    task_broker: RabbitBroker,
) -> None:
    """Waited out with the delivery held for as long as the outage lasted: a connection
    dropped meanwhile (or the broker's consumer timeout, 30 min) returned it past the limit,
    for RabbitMQ to dead-letter without a reason (found in review)."""
    monkeypatch.setattr(consumer, "LIMIT_DATABASE_WAIT_S", 0.5)
    command, _ = _command("At its delivery limit, the database away.")
    actions = Recording(task_broker)
    sent_at = utcnow()

    async with watching_commands(amqp_url) as commands:
        await _at_limit(command, replace(make_deps("proc-a"), attempts=Away(attempts)), actions)
        [copy] = await commands.taken()

    assert actions.done == ["resent"]
    assert (copy.command.task_id, copy.command.attempt) == (command.task_id, command.attempt)
    assert copy.headers[EARLIER_DELIVERIES_HEADER] == SCORE_REQUESTS.delivery_limit
    assert copy.command.not_before is not None
    assert copy.command.not_before >= sent_at + CRASH_RETRY_DELAY  # due shortly, not now
    assert await _letters(amqp_url, command.model_dump_json().encode()) == []


def _completion(command: ScoreText) -> Finish:
    return Finish(
        TaskCompleted(
            task_id=command.task_id,
            sequence=1,
            attempt=command.attempt,
            generation=command.generation,
            submitted_at=command.submitted_at,
            occurred_at=utcnow(),
            result=ScoreResult(score=5, comment="ok", model="m"),
        )
    )


async def _lease_until(attempts: Attempts, command: ScoreText) -> datetime:
    held = await attempts.find(command.task_id)
    assert held is not None
    lease_until: datetime = held["lease_until"]
    return lease_until


def _retrying(command: ScoreText) -> TaskRetrying:
    return TaskRetrying(
        task_id=command.task_id,
        sequence=event_sequence(generation=0, attempt=command.attempt, phase=Phase.RETRYING),
        attempt=command.attempt,
        submitted_at=command.submitted_at,
        error=TaskError(code="model_unavailable", message="down", retryable=True),
        next_attempt_at=utcnow(),
    )


async def _at_limit(
    command: ScoreText,
    deps: ScorerDeps,
    actions: Recording,
    *,
    headers: dict[str, Any] | None = None,
    count: int = SCORE_REQUESTS.delivery_limit,
) -> None:
    """`command` handled at the limit, handed out `count` times, with `headers` (those of a
    copy handed back carry the count)."""
    delivery = HandedDelivery.redelivery(command.model_dump_json().encode(), count=count)
    delivery.headers.update(headers or {})
    deliveries = deliveries_lost(delivery.headers)
    async with asyncio.timeout(HANG_GUARD_S):  # the lease is 60 s, decided at once here
        await _at_delivery_limit(command, delivery, deps, actions, deliveries)


async def test_a_give_up_never_claims_an_attempt_another_delivery_here_holds(
    make_deps: Deps,
    attempts: Attempts,
    fake_llm: FakeLLM,
    amqp_url: str,
    task_broker: RabbitBroker,
) -> None:
    """A live copy of the attempt waits here for a model slot when a copy reaches the
    delivery limit (its consumer died holding it: a claim whose lease is over). The give-up
    claimed it all the same; the holder, claiming as its process's own, took that claim
    over and called the model, and both decisions were recorded and carried out: the task
    dead-lettered and failed, then completed (a review). Now the copy is handed back, and
    back it carries out the holder's decision."""
    command, marker = _command("Its consumer died holding it, and a copy waits here.")
    await attempts.claim(command, now=utcnow() - 2 * LEASE, lease=LEASE, owner="proc-b:1:dead")
    deps = replace(make_deps("proc-a"), model_slots=ModelSlots(1))
    actions = Recording(task_broker)
    # The one model slot busy with another task's call.
    async with deps.model_slots.held(), watching_commands(amqp_url) as commands:
        holder = asyncio.create_task(score_text(command, deps=deps))

        async def held_here() -> bool:
            return len(deps.in_hand) == 1

        await eventually(held_here, what="the live copy in hand, waiting for the slot")
        await _at_limit(command, deps, actions)
        [copy] = await commands.taken()
    assert actions.done == ["resent"]  # handed back, due shortly: nothing given up
    assert (copy.command.task_id, copy.command.attempt) == (command.task_id, command.attempt)
    assert await _letters(amqp_url, command.model_dump_json().encode()) == []

    decided = await asyncio.wait_for(holder, HANG_GUARD_S)
    assert isinstance(decided, Finish)
    assert isinstance(decided.event, TaskCompleted)
    await _at_limit(copy.command, deps, actions, headers=copy.headers)
    assert actions.done == ["resent", "Finish"]  # the completion, carried out again
    assert _calls(fake_llm, marker) == 1


async def _claimed(attempts: Attempts, command: ScoreText, *, owner: str) -> Claimed:
    claim = await attempts.claim(command, now=utcnow(), lease=LEASE, owner=owner)
    assert isinstance(claim, Claimed), claim
    return claim


async def _decided(
    attempts: Attempts,
    command: ScoreText,
    decision: Finish | Retry,
    claim: Claimed,
    *,
    owner: str,
) -> bool:
    return await attempts.decide(
        command, decision, now=utcnow(), raw_output=None, owner=owner, claim=claim
    )
