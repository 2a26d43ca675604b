"""One delivery at a time runs a cron run, and no step of it is lost (`Firings.begin` with a
`Hold`), on the real database (MongoDB or the stand-in).

A publish the broker confirmed too late was sent again, and every copy of it that reached
the queue ran the job, at once: a copy now runs only once it takes the run's hold, waits
(`Held`) while another delivery holds it, and is dropped once the run has passed its step.
A replica without the run's job (a rolling deploy) sends a copy of a held run back without
marking it `retrying`, and drops one of a step handed on.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from services.scheduler.dispatcher import run_command_for
from services.scheduler.firings import Firing, Firings, FiringState, Held, Hold
from services.scheduler.runs import (
    UNKNOWN_JOB_MAX_WAIT,
    Defer,
    Drop,
    GiveUp,
    Retry,
    RetryPolicy,
    RunDecision,
    give_up_at_delivery_limit,
    run_cron_job,
)
from shared.contracts import RunCronJob, new_id
from tests.integration import test_scheduler
from tests.integration.test_scheduler import Env

mongo_client = test_scheduler.mongo_client  # fixtures
topology = test_scheduler.topology
env = test_scheduler.env

NOW = datetime(2030, 1, 1, 10, 5, tzinfo=UTC)
LEASE = timedelta(seconds=60)


@pytest.fixture
async def firings(env: Env) -> Firings:
    store = Firings(env.mongo, env.database)
    await store.ensure_indexes()
    return store


async def _claimed(firings: Firings) -> Firing:
    firing = await firings.claim("rollup", NOW, now=NOW, owner="a", exclusive=True)
    assert firing is not None
    return firing


def _bid(step: int | None, *, message_id: str | None = None) -> Hold:
    return Hold(handling=new_id(), message_id=message_id or new_id(), step=step, until=NOW + LEASE)


async def test_a_copy_waits_while_another_delivery_holds_the_run(firings: Firings) -> None:
    firing = await _claimed(firings)
    holder, copy = _bid(0, message_id="m0"), _bid(0, message_id="m0")
    assert isinstance(await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder), Firing)

    waits = await firings.begin(firing.run_id, attempt=1, now=NOW, hold=copy)

    assert waits == Held(until=NOW + LEASE)


async def test_a_copy_handed_back_takes_the_run_once_its_holder_lets_go(firings: Firings) -> None:
    firing = await _claimed(firings)
    holder = _bid(0)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder)
    await firings.release(firing.run_id, handling=holder.handling)

    taken = await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(0))

    assert isinstance(taken, Firing)


async def test_a_hold_not_renewed_lapses_and_a_copy_takes_over(firings: Firings) -> None:
    """Its holder died, or a hand-back could not let go (the database away): not lost."""
    firing = await _claimed(firings)
    holder = _bid(0)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder)
    later = NOW + LEASE + timedelta(seconds=1)
    assert not await firings.renew(firing.run_id, handling="someone else", until=later, now=later)

    taken = await firings.begin(firing.run_id, attempt=1, now=later, hold=_bid(0))

    assert isinstance(taken, Firing)


async def test_a_renewed_hold_keeps_copies_waiting(firings: Firings) -> None:
    firing = await _claimed(firings)
    holder = _bid(0)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder)
    later = NOW + LEASE + timedelta(seconds=1)
    assert await firings.renew(
        firing.run_id, handling=holder.handling, until=later + LEASE, now=later
    )

    waits = await firings.begin(firing.run_id, attempt=1, now=later, hold=_bid(0))

    assert isinstance(waits, Held)


async def test_the_broker_redelivering_the_holders_message_waits_for_its_lease(
    firings: Firings,
) -> None:
    """Its consumer may only have lost its connection while the job runs on: taken over at
    once, the run ran twice at the same time."""
    firing = await _claimed(firings)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(0, message_id="m0"))
    redelivery = _bid(0, message_id="m0")

    assert isinstance(await firings.begin(firing.run_id, attempt=1, now=NOW, hold=redelivery), Held)
    later = NOW + LEASE + timedelta(seconds=1)
    assert isinstance(
        await firings.begin(firing.run_id, attempt=1, now=later, hold=redelivery), Firing
    )


async def test_the_step_handed_on_takes_the_run_at_once_and_its_past_copies_are_dropped(
    firings: Firings,
) -> None:
    firing = await _claimed(firings)
    holder = _bid(0)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder)
    assert await firings.hand_on(firing.run_id, handling=holder.handling, step=1, now=NOW)

    next_step = await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(1))

    assert isinstance(next_step, Firing)
    assert next_step.step == 1
    assert await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(0)) is None
    later = NOW + LEASE + timedelta(seconds=1)  # even once the hold has lapsed
    assert await firings.begin(firing.run_id, attempt=1, now=later, hold=_bid(0)) is None


async def test_a_next_step_published_before_its_hand_on_waits_for_it(firings: Firings) -> None:
    """Published, then the holder named it a moment later, or died before naming it: it
    waits (looked at again as soon as the ladder allows) for the name, or for the hold to
    lapse."""
    firing = await _claimed(firings)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(0))

    assert await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(1)) == Held(
        until=NOW + LEASE, next_step=True
    )
    later = NOW + LEASE + timedelta(seconds=1)
    assert isinstance(
        await firings.begin(firing.run_id, attempt=1, now=later, hold=_bid(1)), Firing
    )


async def test_a_holder_whose_hold_lapsed_and_was_taken_cannot_hand_the_run_on(
    firings: Firings,
) -> None:
    firing = await _claimed(firings)
    first = _bid(0)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=first)
    later = NOW + LEASE + timedelta(seconds=1)
    await firings.begin(firing.run_id, attempt=1, now=later, hold=_bid(0))

    assert not await firings.hand_on(firing.run_id, handling=first.handling, step=1, now=later)


async def test_a_message_of_an_earlier_build_is_fenced_by_the_hold_alone(firings: Firings) -> None:
    """It numbers no step: it runs whatever the run's step once nobody holds the run."""
    firing = await _claimed(firings)
    holder = _bid(0)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder)
    await firings.hand_on(firing.run_id, handling=holder.handling, step=1, now=NOW)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(1))

    assert isinstance(await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(None)), Held)
    later = NOW + LEASE + timedelta(seconds=1)
    taken = await firings.begin(firing.run_id, attempt=1, now=later, hold=_bid(None))
    assert isinstance(taken, Firing)
    assert taken.step == 1  # kept


async def test_a_run_ended_drops_every_copy(firings: Firings) -> None:
    firing = await _claimed(firings)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(0))
    await firings.finish(firing.run_id, state=FiringState.SUCCEEDED, now=NOW)

    later = NOW + LEASE + timedelta(seconds=1)
    assert await firings.begin(firing.run_id, attempt=1, now=later, hold=_bid(0)) is None


async def test_a_stale_copy_at_its_delivery_limit_does_not_fail_the_run(firings: Firings) -> None:
    """Its give-up recorded the run failed while another delivery carried it on."""
    firing = await _claimed(firings)
    holder = _bid(0)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder)
    await firings.hand_on(firing.run_id, handling=holder.handling, step=1, now=NOW)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(1))
    stale = run_command_for(firing)  # step 0

    decision = await give_up_at_delivery_limit(
        stale, deliveries=5, limit=5, firings=firings, clock=lambda: NOW
    )

    assert isinstance(decision, Drop)
    still = await firings.find(firing.run_id)
    assert still is not None
    assert not still.state.is_final


async def test_a_copy_of_a_step_handed_on_is_dropped_even_once_the_hold_lapses(
    firings: Firings,
) -> None:
    """Taken, it ran the step again while the next one waited (a retry's back-off)."""
    firing = await _claimed(firings)
    holder = _bid(0, message_id="m0")
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder)
    await firings.hand_on(firing.run_id, handling=holder.handling, step=1, now=NOW)
    later = NOW + LEASE + timedelta(seconds=1)

    assert await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(0)) is None
    assert await firings.begin(firing.run_id, attempt=1, now=later, hold=_bid(0)) is None
    # Its own message too: the next step was published before it was named.
    own = _bid(0, message_id="m0")
    assert await firings.begin(firing.run_id, attempt=1, now=later, hold=own) is None


async def test_a_copy_at_its_delivery_limit_waits_while_the_run_is_held(firings: Firings) -> None:
    """Dropped, the run lost its only message when its holder had died (its lease running
    out); given up, it failed a run its holder carried on. Once the hold lapses with nothing
    handed on, it is given up."""
    firing = await _claimed(firings)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=_bid(0))
    copy = run_command_for(firing)

    waits = await give_up_at_delivery_limit(
        copy, deliveries=5, limit=5, firings=firings, clock=lambda: NOW
    )
    later = NOW + LEASE + timedelta(seconds=1)
    given_up = await give_up_at_delivery_limit(
        copy, deliveries=5, limit=5, firings=firings, clock=lambda: later
    )

    assert isinstance(waits, Defer)
    assert isinstance(given_up, GiveUp)


async def _without_the_job(copy: RunCronJob, firings: Firings, now: datetime) -> RunDecision:
    """The decision on `copy` of a replica that has no handler for its job (an earlier
    build's, in a rolling deploy that adds the job)."""
    retry = RetryPolicy(max_attempts=3, base=timedelta(seconds=5), cap=timedelta(minutes=10))
    return await run_cron_job(copy, handlers={}, firings=firings, retry=retry, clock=lambda: now)


async def test_a_replica_without_the_job_leaves_a_run_another_holds_running(
    firings: Firings,
) -> None:
    """Each bounce of a copy through such a replica marked the run a replica knowing the job
    was running `retrying`. Now it is sent back and the run left as it is, past
    `UNKNOWN_JOB_MAX_WAIT` too (its holder carries it on)."""
    firing = await _claimed(firings)
    holder = _bid(0)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder)
    copy = run_command_for(firing)
    late = NOW + UNKNOWN_JOB_MAX_WAIT + timedelta(seconds=1)

    early_decision = await _without_the_job(copy, firings, NOW)
    early = await firings.find(firing.run_id)
    await firings.renew(firing.run_id, handling=holder.handling, until=late + LEASE, now=late)
    late_decision = await _without_the_job(copy, firings, late)
    still = await firings.find(firing.run_id)

    assert isinstance(early_decision, Retry)
    assert isinstance(late_decision, Retry)
    assert early is not None
    assert still is not None
    assert (early.state, still.state) == (FiringState.RUNNING, FiringState.RUNNING)
    assert (early.error, still.error) == (None, None)


async def test_a_replica_without_the_job_drops_a_copy_of_a_step_handed_on(
    firings: Firings,
) -> None:
    """It was sent back, the run marked `retrying`, until the wait had passed."""
    firing = await _claimed(firings)
    holder = _bid(0)
    await firings.begin(firing.run_id, attempt=1, now=NOW, hold=holder)
    await firings.hand_on(firing.run_id, handling=holder.handling, step=1, now=NOW)

    decision = await _without_the_job(run_command_for(firing), firings, NOW)

    assert isinstance(decision, Drop)
    still = await firings.find(firing.run_id)
    assert still is not None
    assert still.state is FiringState.RUNNING
