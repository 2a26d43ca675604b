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

from services.scorer.attempts import Attempts
from services.scorer.decisions import Drop, Finish
from services.scorer.scoring import recorded_decision, score_text
from shared.contracts import utcnow
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.test_scorer_own_claims import LEASE, Deps, _command

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
