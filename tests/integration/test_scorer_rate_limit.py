"""A provider-wide rate limit (every call answered 429 for a while) spends no task's attempts.

It used to: each 429 cost an attempt, came back at once, and the slot took the next delivery,
so every task consumed while the limit lasted was failed and dead-lettered within seconds,
though the provider answered normally right after. Now a 429 pauses the process's model
calls (`services/scorer/throttle.py`), and an attempt a rate limit ended is not counted
against `max_attempts` while the scorer's `RATE_LIMIT_RETRIES` last.

`score_text` runs on the real database and calls the fake model server over HTTP; the fake
answers the next N calls 429 whatever their task (`rate_limited_calls`). A retry's next
attempt is taken at once here (its `not_before` cleared), as the wait ladder would hand it
back when due."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest

from devtools.fake_llm import FakeLLM
from services.scorer.decisions import Decision, Defer, Finish, Retry
from services.scorer.metrics import ScorerMetrics
from services.scorer.provider_checks import provider_checks
from services.scorer.scoring import RetryPolicy, ScorerDeps, score_text
from services.scorer.throttle import (
    OUTAGE_PAUSE_CAP_S,
    SUSPECT_AFTER,
    TRIP_AFTER,
    ModelThrottle,
    ProviderCheck,
    ProviderFound,
)
from shared.contracts import ScoreText, TaskCompleted, TaskFailed, new_id, utcnow
from tests.integration.scorer_parts import attempts_store, fake_model, scorer_deps

pytestmark = pytest.mark.integration

Deps = Callable[..., ScorerDeps]
# The provider flapping: down this long, again each time a check finds it back, so often.
FLAP_DOWN_S = 0.3
FLAPS = 4


@pytest.fixture
async def make_deps(fake_llm: FakeLLM, mongo: Any, db_prefix: str) -> AsyncIterator[Deps]:
    async with fake_model(fake_llm) as model, attempts_store(mongo.url, db_prefix) as attempts:

        def deps(
            *,
            rate_limit_retries: int = 20,
            hold_s: float = 30,
            pause_base_s: float = 0.02,
            checked: list[str | None] | None = None,
            after_check: Callable[[ProviderCheck], None] = lambda _check: None,
        ) -> ScorerDeps:
            """`checked`: the outage is probed by checks of the provider, each noting there
            the model it named, then handed to `after_check`."""
            metrics = ScorerMetrics()
            checks = provider_checks(model, metrics)

            async def check_provider(named: str | None) -> ProviderCheck:
                assert checked is not None
                checked.append(named)
                check = await checks(named)
                after_check(check)
                return check

            return scorer_deps(
                attempts=attempts,
                model=model,
                retry_policy=RetryPolicy(
                    base_s=0.01, cap_s=0.05, rate_limit_retries=rate_limit_retries
                ),
                throttle=ModelThrottle(
                    hold_s=hold_s,
                    base_s=pause_base_s,
                    rng=random.Random(0),
                    check_provider=check_provider if checked is not None else None,
                ),
                metrics=metrics,
            )

        yield deps


async def _until_decided(command: ScoreText, deps: ScorerDeps) -> tuple[Finish, ScoreText]:
    """Each retry's next attempt, taken at once, until the task ends; its last command."""
    for _ in range(50):
        decision: Decision = await score_text(command, deps=deps)
        if isinstance(decision, Finish):
            return decision, command
        assert isinstance(decision, Retry), decision
        command = decision.next_command.model_copy(update={"not_before": None})
    raise AssertionError("the task never ended")


async def test_a_rate_limit_spends_none_of_the_tasks_attempts(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    fake_llm.config.rate_limited_calls = 3
    command = ScoreText(task_id=new_id(), text="An essay.", max_attempts=2)

    finish, last = await _until_decided(command, make_deps())

    assert isinstance(finish.event, TaskCompleted)  # it used to fail at its second 429
    assert (last.attempt, last.rate_limited_retries) == (4, 3)
    assert fake_llm.stats()["status_counts"] == {"429": 3, "200": 1}


async def test_rate_limited_attempts_count_again_once_their_budget_is_spent(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    fake_llm.config.rate_limited_calls = 100
    command = ScoreText(task_id=new_id(), text="An essay.", max_attempts=2)

    finish, last = await _until_decided(command, make_deps(rate_limit_retries=1))

    # One free attempt, then max_attempts counted ones: three calls, then dead-lettered.
    assert isinstance(finish.event, TaskFailed)
    assert finish.event.dead_lettered
    assert finish.event.error.code == "model_rate_limited"
    assert (last.attempt, last.rate_limited_retries) == (3, 1)
    assert fake_llm.stats()["status_counts"] == {"429": 3}


async def test_a_pause_beyond_the_hold_puts_deliveries_off_without_calling(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    """`Retry-After: 120`, deliveries may wait 30 s in hand: the next one is sent down the
    wait ladder until the pause has 15 to 27 s left (back in hand before its end, waiting
    for the probe), and the provider sees no call of it."""
    fake_llm.config.rate_limited_calls = 1
    fake_llm.config.rate_limit_retry_s = 120
    deps = make_deps(hold_s=30)
    started = utcnow()

    retried = await score_text(ScoreText(task_id=new_id(), text="First."), deps=deps)
    put_off = await score_text(ScoreText(task_id=new_id(), text="Second."), deps=deps)

    assert isinstance(retried, Retry)
    assert retried.next_command.not_before is not None
    assert retried.next_command.not_before >= started + timedelta(seconds=119)
    assert isinstance(put_off, Defer)
    assert put_off.command.not_before is not None
    assert started + timedelta(seconds=120 - 27 - 1) <= put_off.command.not_before
    assert put_off.command.not_before <= utcnow() + timedelta(seconds=120 - 15)
    assert put_off.command.attempt == 1  # no attempt spent
    assert fake_llm.stats()["calls"] == 1


async def test_a_provider_unavailable_three_times_in_a_row_pauses_the_next_calls(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    """Every call failed (a provider restarting): each task's attempts were spent within the
    retries' back-off and it was dead-lettered, though the provider was back moments later.
    After three failures in a row the calls pause: the next delivery (the pause longer than
    it may wait in hand here) is put off without a call, its attempt unspent, and the
    retries of the three are due no sooner than the pause's end."""
    fake_llm.config.fail_rate = 1.0
    deps = make_deps(hold_s=1, pause_base_s=60)

    retried = [
        await score_text(ScoreText(task_id=new_id(), text=f"Essay {n}."), deps=deps)
        for n in range(TRIP_AFTER)
    ]
    put_off = await score_text(ScoreText(task_id=new_id(), text="The next one."), deps=deps)

    assert all(isinstance(decision, Retry) for decision in retried)
    last = retried[-1]
    assert isinstance(last, Retry)
    assert last.next_command.not_before is not None
    # The base of 60 s capped at an outage's 15 s, jittered: 7.5 to 15 s.
    assert last.next_command.not_before >= utcnow() + timedelta(seconds=OUTAGE_PAUSE_CAP_S / 4)
    assert isinstance(put_off, Defer)
    assert put_off.command.attempt == 1
    assert fake_llm.stats()["status_counts"] == {"500": TRIP_AFTER}
    # The calls before the pause spent their attempts; the one that paused the calls did not.
    spent = [
        decision.next_command.rate_limited_retries
        for decision in retried
        if isinstance(decision, Retry)
    ]
    assert spent == [0] * (TRIP_AFTER - 1) + [1]


async def test_texts_failing_on_their_own_with_no_other_traffic_spend_their_attempts(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    """Texts each failing on their own, the only calls, were taken for an outage, and their
    calls were its probes: one per pause, shared by them all, the pause doubling up to a
    minute; a batch of them took an hour or more to be dead-lettered (session 48's
    walkthrough). The outage is probed by a check of the provider instead, of the model the
    texts ask for; it answers, every text calls again, and a text seen failing in two such
    outages is a suspect, its calls charged. Held in hand 1 s at most, a delivery finding a
    longer pause would be put off (`Defer`), as every one was here."""
    checked: list[str | None] = []
    deps = make_deps(hold_s=1, checked=checked)
    commands = [
        ScoreText(
            task_id=new_id(), text=f"Essay {n}. [[fake:500]]", model="judge-2", max_attempts=3
        )
        for n in range(2 * TRIP_AFTER)
    ]

    ended = await asyncio.gather(*(_until_decided(command, deps) for command in commands))

    failures = [decision.event for decision, _ in ended]
    assert all(isinstance(event, TaskFailed) and event.dead_lettered for event in failures)
    # Free calls: those of the outages before each text was a suspect, one each at most.
    assert max(last.rate_limited_retries for _, last in ended) <= SUSPECT_AFTER
    assert checked
    assert set(checked) == {"judge-2"}
    assert fake_llm.stats()["status_counts"]["200"] == len(checked)
    # No outage is left standing: a healthy text goes through within its hold. (The last
    # failures may begin a pause with nobody left to check it, under load; asserting no
    # pause right here failed so in a CI run.)
    healthy, _ = await _until_decided(ScoreText(task_id=new_id(), text="Healthy."), deps)
    assert isinstance(healthy.event, TaskCompleted)
    assert not deps.throttle.paused


async def test_a_provider_down_again_as_each_check_answers_fails_no_task(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    """A provider flapping at the worst moments: each check that finds it back is followed at
    once by the next outage, and only the texts of the last outage call. Taken for texts
    failing on their own after one such check, their calls charged and telling no outage,
    they spent every attempt within the retries' back-off (a review; a walkthrough saw 8 to
    13 of 60 healthy tasks dead-lettered). Each outage still trips on them, and the
    suspects' attempts are the calls under way as it does."""
    outages_left = [FLAPS]

    def down_again(check: ProviderCheck) -> None:
        if check.found is ProviderFound.ANSWERED and outages_left[0] > 0:
            outages_left[0] -= 1
            fake_llm.config.unavailable_until = time.monotonic() + FLAP_DOWN_S

    deps = make_deps(checked=[], after_check=down_again)
    fake_llm.config.unavailable_until = time.monotonic() + FLAP_DOWN_S
    commands = [
        ScoreText(task_id=new_id(), text=f"Healthy essay {n}.") for n in range(2 * TRIP_AFTER)
    ]

    ended = await asyncio.gather(*(_until_decided(command, deps) for command in commands))

    assert outages_left == [0]  # every outage came
    events = [decision.event for decision, _ in ended]
    assert all(isinstance(event, TaskCompleted) for event in events), [
        (type(event).__name__, event.attempt, last.rate_limited_retries)
        for event, (_, last) in zip(events, ended, strict=True)
    ]


async def test_replies_the_provider_could_not_make_usable_pause_nothing(make_deps: Deps) -> None:
    """A provider that answers, with a completion holding no choice (or a 4xx of no other
    class, a reply over the size bound), is up: three such texts in a row were taken for an
    outage, pausing every model call and the third call spending no attempt."""
    throttle_deps = make_deps()
    retried = [
        await score_text(
            ScoreText(task_id=new_id(), text=f"Essay {n}. [[fake:nochoices]]"), deps=throttle_deps
        )
        for n in range(TRIP_AFTER)
    ]

    assert not throttle_deps.throttle.paused
    spent = [d.next_command.rate_limited_retries for d in retried if isinstance(d, Retry)]
    assert spent == [0] * TRIP_AFTER  # each its task's attempt


async def test_a_probe_finding_the_provider_still_down_spends_no_attempt(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    """The probes of an outage went to whichever delivery came first, and a task that took
    three of them was dead-lettered, the provider back moments later (seen in the fault
    test): they are counted as a 429's are, within `RATE_LIMIT_RETRIES`."""
    fake_llm.config.fail_rate = 1.0
    deps = make_deps()
    for n in range(TRIP_AFTER):
        await score_text(ScoreText(task_id=new_id(), text=f"Essay {n}."), deps=deps)
    command = ScoreText(task_id=new_id(), text="A task probing.", max_attempts=1)

    probed = await score_text(command, deps=deps)  # waits out the short pause, then probes

    assert isinstance(probed, Retry)  # its one attempt unspent: it was the probe's
    assert probed.next_command.rate_limited_retries == 1
    assert fake_llm.stats()["status_counts"] == {"500": TRIP_AFTER + 1}


async def test_a_probe_getting_no_answer_in_time_keeps_the_outages_pause(
    fake_llm: FakeLLM, mongo: Any, db_prefix: str
) -> None:
    """A timeout was taken for an answer: a probe that hung until the model's timeout ended
    the outage's pause for every call (and reset its back-off), and timeouts between 5xx
    kept the outage from being noticed at all. A call without an answer in time counts as
    the provider found unavailable."""
    async with (
        fake_model(fake_llm, timeout_s=0.5) as model,
        attempts_store(mongo.url, db_prefix) as attempts,
    ):
        # The throttle's own clock, moved by hand: read on the machine's, a pause of tens of
        # milliseconds could end before it was looked at on a busy machine.
        now = [0.0]
        throttle = ModelThrottle(hold_s=30, base_s=0.02, rng=random.Random(0), clock=lambda: now[0])
        deps = scorer_deps(
            attempts=attempts,
            model=model,
            retry_policy=RetryPolicy(base_s=0.01, cap_s=0.05, rate_limit_retries=20),
            throttle=throttle,
        )
        hung = [
            await score_text(
                ScoreText(task_id=new_id(), text=f"Essay {n}. [[fake:hang]]"), deps=deps
            )
            for n in range(TRIP_AFTER)
        ]
        assert throttle.paused  # three texts found it silent: an outage
        now[0] += 60  # the pause over: the next call is its probe
        probe = await score_text(
            ScoreText(task_id=new_id(), text="Another. [[fake:hang]]", max_attempts=1), deps=deps
        )

    assert all(isinstance(decision, Retry) for decision in hung)
    assert isinstance(probe, Retry)  # the outage's: its one attempt unspent
    assert probe.next_command.rate_limited_retries == 1
    assert throttle.paused  # the pause goes on, longer
