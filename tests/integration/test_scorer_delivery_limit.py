"""At the score queue's delivery limit, the scorer carries out the attempt's recorded decision
when it has one, and gives the message up only when nothing was decided.

Each loss of the connection while a delivery is in hand counts towards the limit, the last
one possibly after the decision was recorded and before it was carried out. Giving up
regardless published `task.failed` for a task whose result was stored (or next to the retry
it had scheduled). `recorded_decision` runs here on the real database (MongoDB or the
stand-in); the delivery-limit path itself, with nothing decided, is the fault test
`test_message_that_kills_the_scorer_every_time_stops_at_the_delivery_limit`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from pymongo.errors import AutoReconnect

from services.scorer.attempts import Attempts, ClaimResult
from services.scorer.consumer import BrokerActions, _at_delivery_limit
from services.scorer.decisions import Decision, Drop, Finish
from services.scorer.scoring import recorded_decision, score_text
from shared.consumers import Delivery
from shared.contracts import ScoreText, TaskError, utcnow
from shared.topology import SCORE_REQUESTS
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


async def test_an_attempt_claimed_but_not_decided_is_given_up(
    make_deps: Deps,
    attempts: Attempts,
) -> None:
    command, _ = _command("Its consumer died holding it, every time.")
    await attempts.claim(command, now=utcnow(), lease=LEASE, owner="proc-b:1:dead")

    assert await recorded_decision(command, deps=make_deps("proc-a")) is None


async def test_an_unknown_attempt_is_given_up(make_deps: Deps) -> None:
    command, _ = _command("Never claimed.")
    assert await recorded_decision(command, deps=make_deps("proc-a")) is None


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

    async def carry_out(self, decision: Decision, message: Delivery) -> None:
        self.done.append(type(decision).__name__)

    async def dead_letter(self, message: Delivery, error: str) -> None:
        self.done.append("dead-lettered")

    async def fail_task(self, command: ScoreText, error: TaskError, *, dead_lettered: bool) -> None:
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
