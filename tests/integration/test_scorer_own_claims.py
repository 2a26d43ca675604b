"""A claim whose answer was lost is the scorer's own to take over at once, not after its lease.

When the database answers slowly, a claim's write can reach it after the scorer gave up on
the answer; the scorer sends the message again, and its next delivery finds the attempt
claimed by this very process, which works on nothing of it. It used to wait for the claim's
lease to expire (`LLM_TIMEOUT_S` * 2 + `LEASE_MARGIN_S`: 90 s by default) before scoring the
task. `score_text` runs here on the real database and calls the fake model over HTTP; the
handler's decisions are carried out on the real broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, override

import aio_pika
import pytest
from faststream.rabbit import RabbitBroker
from prometheus_client import CollectorRegistry
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.scorer.attempts import Attempts, Claimed, ClaimResult, TooLate
from services.scorer.consumer import CRASHES_HEADER, BrokerActions, subscribe_scorer
from services.scorer.decisions import Decision, Defer, Drop, Finish, Retry, is_cancellation
from services.scorer.metrics import ScorerMetrics
from services.scorer.scoring import ScorerDeps, _cancel_requested, recorded_decision, score_text
from services.scorer.slots import ModelSlots
from services.scorer.throttle import ModelThrottle, Turn
from shared.consumers import Delivery
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskError,
    TaskFailed,
    TaskRetrying,
    event_sequence,
    new_id,
    utcnow,
)
from shared.topology import DELAY, ERROR_HEADER, SCORE_REQUESTS, TASKS, wait_tier_for
from tests.integration.scorer_parts import attempts_store, fake_model, scorer_deps
from tests.support import (
    HandedDelivery,
    HandlerOnly,
    completion_ids,
    drain,
    eventually,
    sample,
    watching,
    watching_completions,
)

LEASE = timedelta(seconds=60)
Deps = Callable[[str], ScorerDeps]


@pytest.fixture
async def attempts(mongo: Any, db_prefix: str) -> AsyncIterator[Attempts]:
    async with attempts_store(mongo.url, db_prefix) as store:
        yield store


@pytest.fixture
async def make_deps(fake_llm: FakeLLM, attempts: Attempts) -> AsyncIterator[Deps]:
    async with fake_model(fake_llm, timeout_s=10) as model:

        def deps(owner: str) -> ScorerDeps:
            return scorer_deps(
                attempts=attempts,
                model=model,
                lease=LEASE,
                owner=owner,
                started_after=timedelta(seconds=30),
            )

        yield deps


def _completed(command: ScoreText) -> Finish:
    return Finish(
        TaskCompleted(
            task_id=command.task_id,
            sequence=1,
            submitted_at=command.submitted_at,
            occurred_at=utcnow(),
            result=ScoreResult(score=5, comment="ok", model="m"),
        )
    )


def _command(text: str) -> tuple[ScoreText, str]:
    marker = f"o{uuid.uuid4().hex[:12]}"
    return ScoreText(task_id=new_id(), text=f"{text} [[id:{marker}]]"), marker


def _calls(fake_llm: FakeLLM, marker: str) -> int:
    return int(fake_llm.stats()["by_id"].get(marker, 0))


@dataclass(frozen=True)
class Copy:
    """A score command as the broker took it: the command, and the headers it carries."""

    command: ScoreText
    headers: dict[str, Any]


class Commands:
    """What `watching_commands` caught."""

    def __init__(self, queue: aio_pika.abc.AbstractQueue) -> None:
        self._queue = queue

    async def taken(self) -> list[Copy]:
        """Those published since the last look (each confirmed publish is in the queue by
        then; one the broker took without a confirm, soon after)."""
        found = []
        while (message := await self._queue.get(no_ack=True, fail=False, timeout=10)) is not None:
            found.append(Copy(ScoreText.model_validate_json(message.body), dict(message.headers)))
        return found


@asynccontextmanager
async def watching_commands(amqp_url: str) -> AsyncIterator[Commands]:
    """Every score command published while the block lasts, sent now (`scorebox.tasks`, as
    submitted or sent again) or down the wait ladder (`scorebox.delay`): a queue of its own,
    bound to both."""
    routes = (
        (TASKS.name, ScoreText.routing_key),
        (TASKS.name, ScoreText.resubmission_routing_key),
        (DELAY.name, f"*.{ScoreText.routing_key}"),
    )
    async with watching(amqp_url, *routes) as queue:
        yield Commands(queue)


async def completion_seen(
    watched: list[aio_pika.abc.AbstractIncomingMessage], task_id: str
) -> bool:
    """Whether `watching_completions` saw the task's `task.completed`."""
    return any(task_id in completion_ids(message) for message in watched)


async def test_a_claim_of_ours_whose_answer_was_lost_is_taken_over_at_once(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    command, marker = _command("An essay whose claim landed unanswered.")
    await attempts.claim(command, now=utcnow(), lease=LEASE, owner="scorer-a")  # it landed

    decision = await score_text(command, deps=make_deps("scorer-a"))

    assert isinstance(decision, Finish)
    assert isinstance(decision.event, TaskCompleted)
    assert _calls(fake_llm, marker) == 1


async def test_a_redelivered_attempt_whose_retry_is_recorded_replays_it(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    """Attempt 1 decided a retry and its ack was lost: its redelivery (here on another
    scorer) carries the recorded retry out again. A claim filter taking a decided retry's own
    attempt for claimable (`$lte`, a mutant that survived the suite) called the model a
    second time and sent a second attempt 2."""
    command, marker = _command("An essay whose first answer is a 503. [[fake:503x1]]")
    retried = await score_text(command, deps=make_deps("scorer-a"))
    assert isinstance(retried, Retry)

    again = await score_text(command, deps=make_deps("scorer-b"), redelivered=True)

    assert isinstance(again, Retry)
    assert again.next_command.message_id == retried.next_command.message_id
    assert _calls(fake_llm, marker) == 1


async def test_another_processs_claim_still_holds_until_its_lease_ends(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    command, marker = _command("An essay another scorer is working on.")
    now = utcnow()
    await attempts.claim(command, now=now, lease=LEASE, owner="scorer-b")

    decision = await score_text(command, deps=make_deps("scorer-a"))

    assert isinstance(decision, Defer)
    assert decision.command.not_before is not None
    assert decision.command.not_before >= now + LEASE - timedelta(seconds=1)
    assert _calls(fake_llm, marker) == 0


async def test_two_deliveries_of_one_attempt_in_one_process_call_the_model_once(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    deps = make_deps("scorer-a")
    command, marker = _command("An essay delivered twice [[fake:slow]].")  # answered 2 s late
    first = asyncio.create_task(score_text(command, deps=deps))
    async with asyncio.timeout(30):
        await fake_llm.wait_for_stats(lambda stats: stats["by_id"].get(marker, 0) >= 1)

    second = await score_text(command, deps=deps)  # while the first one's call is in flight

    assert second == Drop("another delivery in this process is working on this attempt")
    assert isinstance(await first, Finish)
    assert _calls(fake_llm, marker) == 1
    assert len(deps.in_hand) == 0  # released


class FirstClaimHeldBack(Attempts):
    """The attempts store, with its first claim held back until `release` is set."""

    def __init__(self, client: AsyncMongoClient[dict[str, Any]], database: str) -> None:
        super().__init__(client, database, retention=timedelta(hours=1))
        self.holding_back = asyncio.Event()
        self.release = asyncio.Event()

    async def claim(
        self,
        command: ScoreText,
        *,
        now: datetime,
        lease: timedelta,
        owner: str,
        reclaim_own: bool = False,
    ) -> ClaimResult:
        if not self.holding_back.is_set():
            self.holding_back.set()
            await self.release.wait()
        return await super().claim(
            command, now=now, lease=lease, owner=owner, reclaim_own=reclaim_own
        )


async def test_a_delivery_arriving_while_the_first_one_claims_leaves_the_attempt_to_it(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM, mongo: Any, db_prefix: str
) -> None:
    """Two deliveries of one attempt in one process, the second while the first one's claim
    is on its way. The second's claim used to land first, and the first one's then took it
    over as a stale claim of this process: two model calls."""
    command, marker = _command("An essay delivered twice at once [[fake:slow]].")
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    held_back = FirstClaimHeldBack(client, f"{db_prefix}_scorer")
    deps = replace(make_deps("scorer-a"), attempts=held_back)
    try:
        first = asyncio.create_task(score_text(command, deps=deps))
        await asyncio.wait_for(held_back.holding_back.wait(), timeout=10)
        copy = command.model_copy(update={"message_id": new_id()})
        second = asyncio.create_task(score_text(copy, deps=deps))

        async def second_done_or_calling() -> bool:
            return second.done() or _calls(fake_llm, marker) > 0

        await eventually(second_done_or_calling, what="the second delivery's turn")
        held_back.release.set()
        decisions = await asyncio.wait_for(asyncio.gather(first, second), timeout=30)
    finally:
        await client.close()

    assert isinstance(decisions[0], Finish)
    assert decisions[1] == Drop("another delivery in this process is working on this attempt")
    assert _calls(fake_llm, marker) == 1


async def test_a_copy_deferred_near_the_lease_end_waits_past_it(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """Deferred to the lease's end with less than half a second left, the copy was sent
    straight back (no wait tier that short), found the claim still held, and spun like
    that, a claim and a confirmed publish each time, until the lease ran out."""
    command, marker = _command("An essay another scorer is about to let go of.")
    claimed_at = utcnow()
    await attempts.claim(command, now=claimed_at, lease=LEASE, owner="scorer-b")
    near_the_end = claimed_at + LEASE - timedelta(milliseconds=200)
    deps = replace(make_deps("scorer-a"), clock=lambda: near_the_end)

    decision = await score_text(command, deps=deps)

    assert isinstance(decision, Defer)
    assert decision.command.not_before is not None
    assert wait_tier_for((decision.command.not_before - near_the_end).total_seconds())
    assert _calls(fake_llm, marker) == 0


class CarriedOut(BrokerActions):
    """The scorer's broker actions on `broker`, remembering the decisions they carried out
    (the broker confirmed each)."""

    def __init__(self, broker: RabbitBroker) -> None:
        super().__init__(broker=broker, timeout_s=10, clock=utcnow)
        self.decisions: list[Decision] = []

    @override
    async def carry_out(self, decision: Decision, message: Delivery) -> bool | None:
        lettered = await super().carry_out(decision, message)
        self.decisions.append(decision)
        return lettered


async def test_a_redelivery_after_the_connection_dropped_carries_the_decision_out(
    make_deps: Deps, fake_llm: FakeLLM, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """The connection dropping cancels the handler while its shielded decision goes on (and
    holds the attempt here); the broker redelivers the message to this process. It used to
    be dropped as a second copy: the decision, recorded, was carried out by nobody."""
    broker, actions = HandlerOnly(), CarriedOut(task_broker)
    subscribe_scorer(broker, make_deps("scorer-a"), actions, crash_limit=3)  # type: ignore[arg-type]
    command, marker = _command("An essay whose connection dropped [[fake:slow]].")
    async with watching_completions(amqp_url) as watched:
        first = asyncio.create_task(
            broker.handler(HandedDelivery(command.model_dump_json().encode()))
        )
        async with asyncio.timeout(30):
            await fake_llm.wait_for_stats(lambda stats: stats["by_id"].get(marker, 0) >= 1)
        first.cancel()  # as aiormq cancels a closed channel's consumers
        with contextlib.suppress(asyncio.CancelledError):
            await first

        redelivery = HandedDelivery.redelivery(command.model_dump_json().encode())
        await asyncio.wait_for(broker.handler(redelivery), timeout=30)
        await eventually(
            lambda: completion_seen(watched, command.task_id), what="the task.completed published"
        )

    assert [type(decision) for decision in actions.decisions] == [Finish]
    assert redelivery.settled == ["ack"]
    assert _calls(fake_llm, marker) == 1


async def test_a_delivery_lost_while_it_waited_for_a_model_slot_starts_nothing(
    make_deps: Deps, fake_llm: FakeLLM, mongo: Any, db_prefix: str, task_broker: RabbitBroker
) -> None:
    """Its decision is shielded from the lost connection like any other; it used to take
    the slot once one was free, and claim and call for a delivery already redelivered."""
    deps = replace(make_deps("scorer-a"), model_slots=ModelSlots(1))
    broker, actions = HandlerOnly(), CarriedOut(task_broker)
    subscribe_scorer(broker, deps, actions, crash_limit=3)  # type: ignore[arg-type]
    command, marker = _command("An essay whose delivery was lost while it waited.")
    async with deps.model_slots.held():  # every slot busy
        first = asyncio.create_task(
            broker.handler(HandedDelivery(command.model_dump_json().encode()))
        )
        await eventually(lambda: _is_in_hand(deps), what="the delivery in hand")
        first.cancel()  # as aiormq cancels a closed channel's consumers
        with contextlib.suppress(asyncio.CancelledError):
            await first
    # The slot queue is first come, first served: the lost decision had its turn first.
    async with asyncio.timeout(30), deps.model_slots.held():
        pass
    await eventually(lambda: _is_in_hand(deps, expected=False), what="the attempt let go")

    assert _calls(fake_llm, marker) == 0
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url)
    try:
        claim = await client[f"{db_prefix}_scorer"]["attempts"].find_one({"_id": command.task_id})
    finally:
        await client.close()
    assert claim is None
    assert actions.decisions == []


async def test_a_delivery_lost_while_it_waited_out_a_rate_limit_pause_starts_nothing(
    make_deps: Deps, fake_llm: FakeLLM, task_broker: RabbitBroker
) -> None:
    """The pause (`services/scorer/throttle.py`) is waited out inside the model slot, after
    the check for a lost delivery: it claimed and called for a delivery redelivered since."""
    deps = replace(make_deps("scorer-a"), throttle=ModelThrottle(base_s=1.0))
    deps.throttle.rate_limited(Turn(), retry_after_s=2)  # the provider said 429 just now
    broker, actions = HandlerOnly(), CarriedOut(task_broker)
    subscribe_scorer(broker, deps, actions, crash_limit=3)  # type: ignore[arg-type]
    command, marker = _command("An essay whose delivery was lost during a rate-limit pause.")
    first = asyncio.create_task(broker.handler(HandedDelivery(command.model_dump_json().encode())))
    await eventually(lambda: _is_in_hand(deps), what="the delivery in hand")
    first.cancel()  # as aiormq cancels a closed channel's consumers
    with contextlib.suppress(asyncio.CancelledError):
        await first

    await eventually(
        lambda: _is_in_hand(deps, expected=False), timeout_s=30, what="the attempt let go"
    )
    assert _calls(fake_llm, marker) == 0
    assert actions.decisions == []


async def _is_in_hand(deps: ScorerDeps, *, expected: bool = True) -> bool:
    return (len(deps.in_hand) == 1) is expected


class GivesUp(CarriedOut):
    """Also remembers the reasons of what the handler dead-lettered (the broker confirmed
    each letter)."""

    def __init__(self, broker: RabbitBroker) -> None:
        super().__init__(broker)
        self.given_up: list[str] = []

    @override
    async def dead_letter(self, message: Delivery, error: str) -> bool:
        lettered = await super().dead_letter(message, error)
        self.given_up.append(error)
        return lettered


class Crashing(Attempts):
    @override
    async def claim(self, command: ScoreText, **_: Any) -> ClaimResult:
        raise RuntimeError("a bug in the claim")


async def _letters(amqp_url: str, *bodies: bytes) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """The letters in the score queue's DLQ whose body is one of `bodies` (all drained)."""
    letters = await drain(amqp_url, SCORE_REQUESTS.dead_letter_routing_key)
    return [letter for letter in letters if letter.body in bodies]


async def test_deliveries_given_up_are_counted_as_dead_lettered(
    make_deps: Deps, mongo: Any, db_prefix: str, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """The failures that matter most (unreadable, at the crash limit) were never counted:
    an alert on the decisions metric missed every dead-lettered task."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    crashing = Crashing(client, f"{db_prefix}_scorer", retention=timedelta(hours=1))
    registry = CollectorRegistry()
    deps = replace(make_deps("scorer-a"), attempts=crashing, metrics=ScorerMetrics(registry))
    broker, actions = HandlerOnly(), GivesUp(task_broker)
    subscribe_scorer(broker, deps, actions, crash_limit=3)  # type: ignore[arg-type]
    command, _ = _command("An essay the scorer crashes on.")
    body, unreadable = command.model_dump_json().encode(), b'{"not": "a command"}'
    try:
        async with watching_commands(amqp_url) as commands:
            await broker.handler(HandedDelivery(unreadable))
            await broker.handler(HandedDelivery(body, headers={CRASHES_HEADER: 1}))  # resent
            await broker.handler(HandedDelivery(body, headers={CRASHES_HEADER: 2}))  # given up
            [resent] = await commands.taken()
    finally:
        await client.close()
    counted = "scorebox_scorer_decisions_total"
    assert sample(registry, counted, decision="dead_lettered") == 2
    assert sample(registry, counted, decision="resent") == 1
    letters = await _letters(amqp_url, unreadable, body)
    assert [letter.headers[ERROR_HEADER] for letter in letters] == actions.given_up
    assert len(actions.given_up) == 2
    assert (resent.command.task_id, resent.headers[CRASHES_HEADER]) == (command.task_id, 2)


async def test_a_decision_landing_after_the_attempt_was_taken_over_gives_way(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """The model answered after the claim's lease ended and another scorer claimed the
    attempt: the late decision overwrote that claim, and both scorers carried out their own
    decision, two outcomes of one attempt."""
    command, marker = _command("An essay whose scorer was too slow [[fake:slow]].")
    scoring = asyncio.create_task(score_text(command, deps=make_deps("scorer-a")))
    async with asyncio.timeout(30):
        await fake_llm.wait_for_stats(lambda stats: stats["by_id"].get(marker, 0) >= 1)
    taken_over_at = utcnow() + 2 * LEASE  # as scorer-b sees it: scorer-a's lease has ended
    taken_over = await attempts.claim(command, now=taken_over_at, lease=LEASE, owner="scorer-b")
    assert isinstance(taken_over, Claimed)
    assert not taken_over.made_the_record

    decision = await asyncio.wait_for(scoring, timeout=30)

    assert isinstance(decision, Drop)
    held = await attempts.find(command.task_id)
    assert held is not None
    assert (held["owner"], held["state"]) == ("scorer-b", "running")
    # Its own decision, written again after an answer was lost, is still its own.
    finish = _completed(command)

    def decided_by(owner: str) -> Awaitable[bool]:
        return attempts.decide(
            command, finish, now=utcnow(), raw_output=None, owner=owner, claim=taken_over
        )

    assert await decided_by("scorer-b")
    assert await decided_by("scorer-b")
    assert not await decided_by("scorer-a")


async def test_a_decision_of_an_earlier_claim_of_this_process_gives_way_to_its_claim_again(
    attempts: Attempts,
) -> None:
    """A delivery's decision write failed at its deadline while still on its way; the message
    was sent again, and its next delivery in the same process claimed the attempt again
    (`reclaim_own`) and called the model. Fenced by the owner alone, the late write landed as
    that claim's decision, and a copy arriving then replayed an outcome the re-claim
    overwrote with another (a re-read). Each claim's own token fences it out."""
    command, _ = _command("An essay whose first decision landed late.")
    first = await attempts.claim(command, now=utcnow(), lease=LEASE, owner="scorer-a")
    again = await attempts.claim(
        command, now=utcnow(), lease=LEASE, owner="scorer-a", reclaim_own=True
    )
    assert isinstance(first, Claimed)
    assert isinstance(again, Claimed)
    finish = _completed(command)

    def decided_under(claim: Claimed) -> Awaitable[bool]:
        return attempts.decide(
            command, finish, now=utcnow(), raw_output=None, owner="scorer-a", claim=claim
        )

    assert not await decided_under(first)
    held = await attempts.find(command.task_id)
    assert held is not None
    assert held["state"] == "running"
    assert await decided_under(again)


async def test_a_stale_copy_of_an_earlier_attempt_drops_a_later_attempts_outcome(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM
) -> None:
    """Attempt 2 was given up and dead-lettered; a copy of attempt 1 then arrives (sent
    again, or swept): it carried attempt 2's outcome out once more, its message
    dead-lettered again with attempt 2's reason (a review). Its own delivery carries an
    outcome out; at the limit such a copy was dropped already."""
    first, marker = _command("An essay whose attempt 2 was given up.")
    second = first.model_copy(update={"attempt": 2})
    claim = await attempts.claim(second, now=utcnow(), lease=LEASE, owner="scorer-b")
    assert isinstance(claim, Claimed)
    failed = TaskFailed(
        task_id=second.task_id,
        sequence=event_sequence(generation=0, attempt=2, phase=Phase.TERMINAL),
        attempt=2,
        submitted_at=second.submitted_at,
        error=TaskError(code="model_unavailable", message="down", retryable=True),
        dead_lettered=True,
    )
    given_up = Finish(failed, dead_letter_error="model_unavailable: down (attempts spent)")
    assert await attempts.decide(
        second, given_up, now=utcnow(), raw_output=None, owner="scorer-b", claim=claim
    )

    stale = await score_text(first, deps=make_deps("scorer-a"))

    assert isinstance(stale, Drop)
    assert _calls(fake_llm, marker) == 0


@pytest.mark.parametrize("path", ["redelivered", "at the limit"])
async def test_a_replayed_retry_is_cancelled_by_a_cancel_noted_while_it_was_decided(
    make_deps: Deps, attempts: Attempts, fake_llm: FakeLLM, path: str
) -> None:
    """A client cancelled while the attempt called the model, which answered 429 with a
    day's `Retry-After`; the retry was recorded and its process died before it looked for
    the cancel. Its redelivery carried the retry out as recorded: the task read `retrying`,
    its tenant's slot held for the day, after a cancel answered 202 (a review)."""
    command, marker = _command("An essay cancelled while its call ran into a 429.")
    now = utcnow()
    claim = await attempts.claim(command, now=now, lease=LEASE, owner="scorer-dead")
    assert isinstance(claim, Claimed)
    assert isinstance(await attempts.cancel(_cancel_requested(command, now), now=now), TooLate)
    due = now + timedelta(hours=24)
    retry = Retry(
        event=TaskRetrying(
            task_id=command.task_id,
            sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
            attempt=1,
            submitted_at=command.submitted_at,
            error=TaskError(code="model_rate_limited", message="429", retryable=True),
            next_attempt_at=due,
        ),
        next_command=command.model_copy(update={"attempt": 2, "not_before": due}),
    )
    assert await attempts.decide(
        command, retry, now=now, raw_output=None, owner="scorer-dead", claim=claim
    )

    deps = make_deps("scorer-a")
    replayed: object
    if path == "redelivered":
        replayed = await score_text(command, deps=deps, redelivered=True)
    else:
        replayed = await recorded_decision(command, deps=deps)

    assert isinstance(replayed, Finish)
    assert is_cancellation(replayed)
    assert _calls(fake_llm, marker) == 0
