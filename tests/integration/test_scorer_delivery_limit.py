"""At the score queue's delivery limit, the scorer carries out the attempt's recorded decision
when it has one, sends an attempt never claimed again with its count cleared (a bounded
number of times), and gives the message up only when nothing was decided.

Each loss of the connection while a delivery is in hand counts towards the limit, the last
one possibly after the decision was recorded and before it was carried out. Giving up
regardless published `task.failed` for a task whose result was stored (or next to the retry
it had scheduled). `recorded_decision` runs here on the real database (MongoDB or the
stand-in); the delivery-limit path itself, with nothing decided, is the fault test
`test_message_that_kills_the_scorer_every_time_stops_at_the_delivery_limit`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, cast

from pymongo.errors import AutoReconnect

from services.scorer.attempts import Attempts, Busy, ClaimResult
from services.scorer.consumer import (
    UNSTARTED_RESETS,
    UNSTARTED_RESETS_HEADER,
    BrokerActions,
    _at_delivery_limit,
)
from services.scorer.decisions import Decision, Drop, Finish, Retry
from services.scorer.scoring import ScorerDeps, recorded_decision, score_text
from shared.consumers import Delivery
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskError,
    TaskEvent,
    TaskRetrying,
    event_sequence,
    utcnow,
)
from shared.topology import EARLIER_DELIVERIES_HEADER, SCORE_REQUESTS
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.test_scorer_own_claims import LEASE, Deps, _command
from tests.support import HandedDelivery

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps


async def test_a_decided_attempt_is_carried_out_again(make_deps: Deps) -> None:
    deps = make_deps("proc-a")
    command, _ = _command("Decided before the connection was lost.")
    decided = await score_text(command, deps=deps)
    assert isinstance(decided, Finish)

    assert await recorded_decision(command, deps=deps) == decided


async def test_an_attempt_claimed_but_not_decided_is_given_up_once_its_lease_ended(
    make_deps: Deps,
    attempts: Attempts,
) -> None:
    command, _ = _command("Its consumer died holding it, every time.")
    await attempts.claim(command, now=utcnow() - 2 * LEASE, lease=LEASE, owner="proc-b:1:dead")
    assert isinstance(await recorded_decision(command, deps=make_deps("proc-a")), Busy)
    actions = Recording()

    await _at_limit(command, make_deps("proc-a"), actions)

    assert actions.done == ["dead-lettered", "failed"]


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


async def test_an_attempt_still_running_at_the_limit_is_waited_for_and_carried_out(
    make_deps: Deps, attempts: Attempts
) -> None:
    """Given up while the shielded call went on: its decision was recorded a moment later and
    carried out by nobody, the task read failed with its result stored."""
    command, _ = _command("Still being scored when its last delivery came.")
    await attempts.claim(command, now=utcnow(), lease=LEASE, owner="proc-a:1:shielded")
    deps = make_deps("proc-a")
    decision = Finish(
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

    async def shielded_call_ends() -> object:
        return await attempts.decide(
            command, decision, now=utcnow(), raw_output=None, owner="proc-a:1:shielded"
        )

    actions = Recording()
    await _at_limit(
        command,
        replace(deps, attempts=DecidedAfterFirstLook(attempts, shielded_call_ends)),
        actions,
    )

    assert actions.done == ["Finish"]


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
    make_deps: Deps,
) -> None:
    """Its deliveries were lost waiting in a prefetch (each drop of the connection returns
    every delivery in hand), not working: given up, a task that never started failed."""
    command, _ = _command("Waited in a prefetch through five dropped connections.")
    actions = Recording()

    await _at_limit(command, make_deps("proc-a"), actions, headers={EARLIER_DELIVERIES_HEADER: 2})

    assert actions.done == ["resent"]
    (headers,) = actions.resent_headers
    assert headers[UNSTARTED_RESETS_HEADER] == 1
    assert EARLIER_DELIVERIES_HEADER not in headers


async def test_a_next_attempt_never_claimed_is_sent_again_with_its_count_cleared(
    make_deps: Deps,
) -> None:
    deps = make_deps("proc-a")
    command, _ = _command("Retried, and the retry waited through dropped connections.")
    retry = Retry(_retrying(command), command.model_copy(update={"attempt": 2}))
    await deps.attempts.claim(command, now=utcnow(), lease=LEASE, owner=deps.owner)
    await deps.attempts.decide(command, retry, now=utcnow(), raw_output=None, owner=deps.owner)
    actions = Recording()

    await _at_limit(retry.next_command, deps, actions)

    assert actions.done == ["resent"]


async def test_an_attempt_never_claimed_is_given_up_once_its_resets_are_spent(
    make_deps: Deps,
) -> None:
    """A message that kills the scorer before its claim must stop too."""
    command, _ = _command("Killed the scorer before its claim, every time.")
    actions = Recording()
    spent = {UNSTARTED_RESETS_HEADER: UNSTARTED_RESETS}

    await _at_limit(command, make_deps("proc-a"), actions, headers=spent)

    assert actions.done == ["dead-lettered", "failed"]


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


class Recording:
    """The scorer's broker actions, recorded instead of carried out."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.resent_headers: list[dict[str, Any]] = []

    async def resend(self, command: ScoreText, *, headers: dict[str, Any]) -> None:
        self.done.append("resent")
        self.resent_headers.append(headers)

    async def carry_out(self, decision: Decision, message: Delivery) -> None:
        self.done.append(type(decision).__name__)

    async def dead_letter(self, message: Delivery, error: str) -> None:
        self.done.append("dead-lettered")

    async def fail_task(self, failed: TaskEvent) -> None:
        self.done.append("failed")


async def test_a_database_away_at_the_limit_is_waited_out_not_taken_for_nothing_decided(
    make_deps: Deps, attempts: Attempts
) -> None:
    """The task of a decided attempt was dead-lettered and failed when the database did not
    answer at that moment, though its result was stored."""
    deps = make_deps("proc-a")
    command, _ = _command("Decided, then the database blinked.")
    assert isinstance(await score_text(command, deps=deps), Finish)
    actions = Recording()
    limit = SCORE_REQUESTS.delivery_limit

    await _at_delivery_limit(
        command,
        HandedDelivery.redelivery(command.model_dump_json().encode(), count=limit),
        replace(deps, attempts=AwayOnce(attempts)),
        cast("BrokerActions", actions),
        limit,
    )

    assert actions.done == ["Finish"]


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
) -> None:
    limit = SCORE_REQUESTS.delivery_limit
    delivery = HandedDelivery.redelivery(command.model_dump_json().encode(), count=limit)
    delivery.headers.update(headers or {})
    async with asyncio.timeout(60):  # a hang guard: the lease is 60 s, decided at once here
        await _at_delivery_limit(command, delivery, deps, cast("BrokerActions", actions), limit)
