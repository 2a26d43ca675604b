"""Rate-limit pauses (`services/scorer/throttle.py`): after a 429 no model call starts until
the pause ends, then one probe goes first and its answer lets the others through.

The clock is a test-held number; the waits themselves are real and short (the pause a
waiter sleeps is read from that clock, and the test moves it on and wakes them with the next
report)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import pytest

from services.scorer.errors import ModelUnavailable
from services.scorer.scoring import _tell_the_throttle
from services.scorer.slots import SlotsClosed
from services.scorer.throttle import (
    GIVING_WAY_LEAST_S,
    GIVING_WAY_SHARE,
    GO,
    OUTAGE_PAUSE_CAP_S,
    PAUSE_CAP_S,
    PAUSE_LOG_EVERY_S,
    PROBE,
    PROBE_PATIENCE_S,
    TRIP_AFTER,
    TRIP_WINDOW_S,
    ModelThrottle,
    ProviderCheck,
    ProviderFound,
    PutOff,
    Turn,
)
from shared.contracts import ScoreText
from tests.support import eventually, none_done

# Only keeps a failing test from waiting for ever.
GUARD_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _throttle(clock: Clock, *, hold_s: float = 30.0) -> ModelThrottle:
    return ModelThrottle(hold_s=hold_s, base_s=1.0, rng=random.Random(0), clock=clock)


async def test_without_a_rate_limit_every_call_goes_at_once() -> None:
    throttle = _throttle(Clock())
    turns = await asyncio.gather(*(throttle.wait_turn(asyncio.Event()) for _ in range(5)))
    assert turns == [Turn()] * 5
    assert not throttle.paused


def _starting(clock: Clock) -> ModelThrottle:
    return ModelThrottle(
        hold_s=30.0, base_s=1.0, rng=random.Random(0), clock=clock, probe_first=True
    )


async def _start_probe_out(
    throttle: ModelThrottle, count: int, *, tenant: str | None = None
) -> tuple[Turn | PutOff, list[asyncio.Future[Turn | PutOff]]]:
    """`count` deliveries asking for a turn at once on a replica that just started: the
    first goes alone, the others wait for its answer. Of no text, or of texts of their own
    (100, 101, ...) of `tenant` when given."""
    closing = asyncio.Event()
    waiters: list[asyncio.Future[Turn | PutOff]] = [
        asyncio.ensure_future(
            throttle.wait_turn(closing)
            if tenant is None
            else throttle.wait_turn(closing, text_key=100 + n, tenant_key=tenant)
        )
        for n in range(count)
    ]
    await eventually(lambda: _any_done(waiters), what="the start's probe")
    [probe] = [waiter for waiter in waiters if waiter.done()]
    others = [waiter for waiter in waiters if waiter is not probe]
    await eventually(partial(_waiting, throttle, count - 1), what="the others waiting")
    assert not any(waiter.done() for waiter in others)
    assert not throttle.paused  # not a pause: the probe of one
    return probe.result(), others


async def test_a_replica_starting_during_a_rate_limit_sends_one_call_not_a_slot_each() -> None:
    """Another replica's pause began before this one started and was not heard: every slot
    called at once and the provider answered a round of 429s as wide as the slots (a
    walkthrough: 16 at each restart during a limit). The first call goes alone; its 429
    pauses the others before they call."""
    clock = Clock()
    throttle = _starting(clock)
    probe, others = await _start_probe_out(throttle, 4)
    assert probe == PROBE

    throttle.rate_limited(probe, retry_after_s=20)
    throttle.done(probe)

    assert throttle.paused
    assert throttle.pause_left_s() == pytest.approx(20)
    assert await none_done(*others)
    for waiter in others:
        waiter.cancel()


@pytest.mark.parametrize("answer", ["answered", "failed on its own"])
async def test_a_start_probe_not_answered_429_lets_the_others_through(answer: str) -> None:
    """A text's own 5xx says nothing of a pause: it neither pauses the others nor counts
    as an outage's probe."""
    throttle = _starting(Clock())
    probe, others = await _start_probe_out(throttle, 3)
    assert isinstance(probe, Turn)

    if answer == "answered":
        throttle.answered(probe, text_key=1)
    else:
        assert _fails(throttle, 1, turn=probe) == [False]
    throttle.done(probe)

    assert await asyncio.wait_for(asyncio.gather(*others), GUARD_S) == [GO, GO]
    assert not throttle.paused
    assert throttle.pause_left_s() == 0


async def test_a_slow_start_probe_lets_the_others_go_as_calls_not_probes() -> None:
    """The first answer slower than the patience: the others went, the start still "due",
    and one text's own 5xx among them paused the whole replica (the re-read: 30 s with a
    `Retry-After`). Past the patience the start is over; a 5xx then pauses nothing."""
    clock = Clock()
    throttle = _starting(clock)
    probe, others = await _start_probe_out(throttle, 3)
    clock.now += PROBE_PATIENCE_S + 1

    assert await asyncio.wait_for(asyncio.gather(*others), GUARD_S) == [GO, GO]
    throttle.unavailable(GO, retry_after_s=30, text_key=7, task_key="task-7")

    assert not throttle.paused
    assert throttle.pause_left_s() == 0
    assert isinstance(probe, Turn)
    throttle.rate_limited(probe, retry_after_s=None)  # the slow probe's 429 still pauses
    assert throttle.paused


async def test_a_start_waiting_for_its_broker_keeps_its_probe() -> None:
    """Marked when the throttle was built, a start that waited past `TRIP_WINDOW_S` for its
    database or broker had its probe forgotten, every slot calling at once (the re-read).
    It counts from the first delivery's wait."""
    clock = Clock()
    throttle = _starting(clock)
    clock.now += TRIP_WINDOW_S * 2

    probe, others = await _start_probe_out(throttle, 2)

    assert probe == PROBE
    for waiter in others:
        waiter.cancel()


async def test_once_started_a_pauses_probe_failing_lengthens_it_as_usual() -> None:
    """The start over (its probe answered), a later pause is a pause: its probe failing
    lengthens it, not taken for the start's."""
    clock = Clock()
    throttle = _starting(clock)
    start = await asyncio.wait_for(throttle.wait_turn(asyncio.Event()), GUARD_S)
    assert start == PROBE
    throttle.answered(start, text_key=1)
    throttle.done(start)
    assert await asyncio.wait_for(throttle.wait_turn(asyncio.Event()), GUARD_S) == GO

    assert throttle.paused_elsewhere(5.0, outage=False)  # another replica's 429
    clock.now += 6
    probe = await asyncio.wait_for(throttle.wait_turn(asyncio.Event()), GUARD_S)
    assert probe == PROBE
    _fails(throttle, 2, turn=probe)
    assert throttle.pause_left_s() > 0


async def test_after_a_429_one_probe_goes_first_and_its_answer_lets_the_others_through() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=None)
    assert throttle.paused
    assert 0.5 <= throttle.pause_left_s() <= 1.0

    closing = asyncio.Event()
    waiters = [asyncio.ensure_future(throttle.wait_turn(closing)) for _ in range(4)]
    assert await none_done(*waiters)  # paused: nobody calls

    clock.now += 2  # the pause is over; the waiters find out at their wake-up
    await eventually(lambda: _any_done(waiters), what="a probe")
    done = [waiter.result() for waiter in waiters if waiter.done()]
    assert done == [Turn(probe=True)]  # one, and only one, goes first

    probe = Turn(probe=True)
    throttle.answered(probe)
    throttle.done(probe)
    await eventually(lambda: _all_done(waiters), what="the others let through")
    results = [waiter.result() for waiter in waiters]
    assert sorted(results, key=str) == sorted([Turn(probe=True)] + [Turn()] * 3, key=str)
    assert not throttle.paused


async def test_a_probe_answered_429_starts_a_longer_pause_and_the_next_probe() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=None)
    first_pause = throttle.pause_left_s()
    clock.now += 2
    probe = await throttle.wait_turn(asyncio.Event())
    assert isinstance(probe, Turn)
    assert probe.probe

    throttle.rate_limited(probe, retry_after_s=None)
    throttle.done(probe)
    assert throttle.pause_left_s() > first_pause  # doubled (within its jitter)

    clock.now += throttle.pause_left_s() + 0.01
    assert await throttle.wait_turn(asyncio.Event()) == Turn(probe=True)


async def test_the_calls_running_when_the_limit_came_do_not_grow_the_pause() -> None:
    """All of them come back 429 together; the pause grows with pauses in a row only."""
    clock = Clock()
    throttle = _throttle(clock)
    for _ in range(64):
        throttle.rate_limited(Turn(), retry_after_s=None)
    # Grown with each of them, the 64th would have paused for the cap (PAUSE_CAP_S).
    assert throttle.pause_left_s() <= 1.0 < PAUSE_CAP_S / 2


async def test_a_retry_after_is_the_pause_and_one_beyond_the_hold_puts_calls_off() -> None:
    clock = Clock()
    throttle = _throttle(clock, hold_s=30)
    throttle.rate_limited(Turn(), retry_after_s=20)
    assert throttle.pause_left_s() == pytest.approx(20)

    throttle.rate_limited(Turn(), retry_after_s=120)  # a call that was running answers later
    turn = await throttle.wait_turn(asyncio.Event())
    assert isinstance(turn, PutOff)
    assert turn.left_s == pytest.approx(120)


async def test_a_probe_that_never_called_lets_another_delivery_probe() -> None:
    """A probe's claim can be held elsewhere, or its database call fail: nothing answers."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=None)
    clock.now += 2
    probe = await throttle.wait_turn(asyncio.Event())
    assert isinstance(probe, Turn)
    waiter = asyncio.ensure_future(throttle.wait_turn(asyncio.Event()))
    assert await none_done(waiter)  # waits for the probe's answer

    throttle.done(probe)
    assert await asyncio.wait_for(waiter, timeout=10) == Turn(probe=True)


async def test_a_stop_turns_the_waiting_deliveries_away() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=25)
    closing = asyncio.Event()
    waiter = asyncio.ensure_future(throttle.wait_turn(closing))
    await eventually(lambda: _waiting(throttle, 1), what="the delivery waiting")

    closing.set()
    with pytest.raises(SlotsClosed):
        await asyncio.wait_for(waiter, timeout=10)


async def _any_done(waiters: Sequence[asyncio.Future[Turn | PutOff]]) -> bool:
    return any(waiter.done() for waiter in waiters)


async def _waiting(throttle: ModelThrottle, count: int) -> bool:
    return throttle.waiting == count


async def _all_done(waiters: Sequence[asyncio.Future[Turn | PutOff]]) -> bool:
    return all(waiter.done() for waiter in waiters)


async def test_a_pause_begun_while_none_lasted_is_told_once_with_its_length() -> None:
    """Not the 429s of the calls running when the limit came, nor a probe's 429 (every
    replica is paused by then); the next pause after the limit ended is told again."""
    clock = Clock()
    begun: list[float] = []
    throttle = ModelThrottle(
        base_s=1.0,
        rng=random.Random(0),
        clock=clock,
        on_pause=lambda pause_s, _: begun.append(pause_s),
    )
    throttle.rate_limited(Turn(), retry_after_s=20)
    for _ in range(10):
        throttle.rate_limited(Turn(), retry_after_s=20)
    assert begun == [pytest.approx(20)]

    clock.now += 21
    probe = await throttle.wait_turn(asyncio.Event())
    assert isinstance(probe, Turn)
    assert probe.probe
    throttle.rate_limited(probe, retry_after_s=40)
    throttle.done(probe)
    assert begun == [pytest.approx(20)]

    clock.now += 41
    probe = await throttle.wait_turn(asyncio.Event())
    assert isinstance(probe, Turn)
    throttle.answered(probe)
    throttle.done(probe)
    assert not throttle.paused
    throttle.rate_limited(Turn(), retry_after_s=5)
    assert begun == [pytest.approx(20), pytest.approx(5)]


async def test_a_probe_answered_while_a_longer_pause_was_heard_is_followed_by_another() -> None:
    """The probe says the limit is gone, but another replica was refused since: the calls
    wait out that pause, and one probe goes first again."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=5)
    clock.now += 6
    probe = await throttle.wait_turn(asyncio.Event())
    assert isinstance(probe, Turn)
    assert probe.probe
    assert throttle.paused_elsewhere(1.0)  # heard while the probe's call runs

    throttle.answered(probe)
    throttle.done(probe)
    assert throttle.paused
    clock.now += 2
    assert await throttle.wait_turn(asyncio.Event()) == Turn(probe=True)


async def test_a_pause_told_by_another_replica_holds_calls_until_its_end_then_a_probe() -> None:
    clock = Clock()
    begun: list[float] = []
    throttle = ModelThrottle(
        base_s=1.0,
        rng=random.Random(0),
        clock=clock,
        on_pause=lambda pause_s, _: begun.append(pause_s),
    )
    assert throttle.paused_elsewhere(1.0)
    assert throttle.paused
    assert throttle.pause_left_s() == pytest.approx(1.0)
    assert begun == []  # not told back: the replica that began it told everyone

    waiters = [asyncio.ensure_future(throttle.wait_turn(asyncio.Event())) for _ in range(3)]
    assert await none_done(*waiters)
    clock.now += 2  # the pause is over; the waiters find out at their wake-up
    await eventually(lambda: _any_done(waiters), what="a probe")
    assert [waiter.result() for waiter in waiters if waiter.done()] == [Turn(probe=True)]
    for waiter in waiters:
        waiter.cancel()


async def test_a_pause_told_again_or_shorter_than_this_ones_changes_nothing() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=30)
    assert not throttle.paused_elsewhere(20)
    assert throttle.pause_left_s() == pytest.approx(30)
    assert throttle.paused_elsewhere(45)
    assert throttle.pause_left_s() == pytest.approx(45)
    assert not throttle.paused_elsewhere(45)


async def test_a_pause_told_by_another_replica_beyond_the_hold_puts_calls_off() -> None:
    throttle = _throttle(Clock(), hold_s=30)
    throttle.paused_elsewhere(120)
    turn = await throttle.wait_turn(asyncio.Event())
    assert isinstance(turn, PutOff)
    assert turn.left_s == pytest.approx(120)


async def test_a_delivery_waits_hold_s_in_all_not_per_pause() -> None:
    """Each pause was checked against the hold alone: with `hold_s` above the longest
    back-off, a delivery waited pause after pause for as long as the limit lasted (until
    RabbitMQ's consumer timeout closed the channel). Two pauses of 3 s against a hold of 5 s:
    the second puts it off."""
    clock = Clock()
    throttle = _throttle(clock, hold_s=5.0)
    throttle.rate_limited(Turn(), retry_after_s=3)
    closing = asyncio.Event()
    waiter = asyncio.ensure_future(throttle.wait_turn(closing))
    assert await none_done(waiter)

    clock.now += 3.01  # the first pause is over; another delivery takes the probe first
    probe = await throttle.wait_turn(closing)
    assert probe == Turn(probe=True)
    throttle.rate_limited(probe, retry_after_s=3)  # the limit lasts: a second pause
    throttle.done(probe)

    put_off = await asyncio.wait_for(waiter, 10)  # a hang guard: the pause is 3 s
    assert isinstance(put_off, PutOff)
    assert put_off.left_s == pytest.approx(3, abs=0.1)


async def test_a_delivery_waiting_on_a_probe_that_never_answers_is_put_off_after_the_hold() -> None:
    """The wait for the probe's answer was unbounded: a probe whose call hung held every
    other delivery in hand with it."""
    throttle = ModelThrottle(hold_s=0.2, base_s=0.01, rng=random.Random(0))  # the real clock
    throttle.rate_limited(Turn(), retry_after_s=None)
    closing = asyncio.Event()
    waiters = [asyncio.ensure_future(throttle.wait_turn(closing)) for _ in range(2)]

    await eventually(lambda: _all_done(waiters), what="the probe taken, the other put off")
    turns = sorted((waiter.result() for waiter in waiters), key=lambda turn: str(type(turn)))
    assert turns == [PutOff(0.0), Turn(probe=True)]


async def test_a_rate_limits_probe_unanswered_for_a_while_lets_the_others_through() -> None:
    """A provider still limiting answers 429 at once: a probe not answered by then is being
    scored. Waited for in full, one slow text taken as the probe held every other call for
    up to the hold (30 s) after a 1 s pause (a walkthrough)."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=None)
    clock.now += 2
    closing = asyncio.Event()
    probe = await asyncio.wait_for(throttle.wait_turn(closing), GUARD_S)
    assert probe == PROBE
    others = [asyncio.ensure_future(throttle.wait_turn(closing)) for _ in range(3)]
    assert await none_done(*others)  # the probe just went: awaited

    clock.now += PROBE_PATIENCE_S
    await eventually(lambda: _all_done(others), what="the others let through")
    assert [other.result() for other in others] == [GO] * 3
    throttle.answered(probe)
    throttle.done(probe)
    assert not throttle.paused


async def test_an_outages_probe_is_waited_for_however_long_it_takes() -> None:
    """A provider that does not answer in time is down: calls sent next to its probe would
    each spend their task's attempt."""
    clock = Clock()
    throttle = _throttle(clock)
    assert _fails(throttle, 1, 2, 3)[-1]  # an outage
    clock.now += PAUSE_CAP_S
    closing = asyncio.Event()
    probe = await asyncio.wait_for(throttle.wait_turn(closing, text_key=4), GUARD_S)
    assert probe == PROBE
    other = asyncio.ensure_future(throttle.wait_turn(closing, text_key=5))
    clock.now += PROBE_PATIENCE_S * 5
    # Its wake-up past the patience (real time, waited for twice over: a wake-up later than
    # the wait would leave nothing checked) finds it still waiting on the probe.
    done, _ = await asyncio.wait({other}, timeout=PROBE_PATIENCE_S * 2)
    assert not done
    throttle.answered(probe)
    throttle.done(probe)
    assert await asyncio.wait_for(other, GUARD_S) == GO


def _fails(
    throttle: ModelThrottle, *texts: int, turn: Turn = GO, task: str | None = None
) -> list[bool]:
    """Calls of the texts `texts` finding the provider unavailable, one after another, each
    of a task of its own text (or of `task`); whether each was the outage's."""
    return [
        throttle.unavailable(
            turn, retry_after_s=None, text_key=text, task_key=task or f"task-{text}"
        )
        for text in texts
    ]


def test_the_provider_unavailable_to_three_texts_in_a_row_pauses_the_calls() -> None:
    """An unavailable provider spent the attempts of every task consumed while it was down
    (four within the retries' back-off of about 14 s, then the DLQ): it now pauses the calls
    as a 429 does, once calls of `TRIP_AFTER` texts in a row found it so."""
    throttle = _throttle(Clock())
    assert _fails(throttle, *range(TRIP_AFTER - 1)) == [False] * (TRIP_AFTER - 1)
    assert not throttle.paused
    assert _fails(throttle, TRIP_AFTER) == [True]  # it began the outage: not its task's
    assert throttle.paused
    assert 0.5 <= throttle.pause_left_s() <= 1.0


async def test_a_pause_and_its_end_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Only a gauge showed that every model call was held back (an acceptance run)."""
    clock = Clock()
    throttle = _throttle(clock)
    with caplog.at_level("INFO", logger="scorebox.scorer.throttle"):
        _fails(throttle, *range(TRIP_AFTER))
        await _probe(throttle, clock)
        throttle.answered(PROBE)
        throttle.rate_limited(Turn(), retry_after_s=None)
    messages = [record.getMessage() for record in caplog.records]
    assert "an outage" in messages[0]
    assert "resumed" in messages[1]
    assert "429" in messages[2]


async def test_a_steady_rate_limit_is_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A limit that lets each probe through and answers the burst after it 429 paused the
    calls every second or so: a line each time (a review counted 7,300 an hour)."""
    clock = Clock()
    throttle = _throttle(clock)
    with caplog.at_level("INFO", logger="scorebox.scorer.throttle"):
        for _ in range(30):
            throttle.rate_limited(Turn(), retry_after_s=None)
            await _probe(throttle, clock)
            throttle.answered(PROBE)
            throttle.done(PROBE)
        clock.now += PAUSE_LOG_EVERY_S
        throttle.rate_limited(Turn(), retry_after_s=None)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert "(30 pause(s) since the last such line)" in messages[1]


async def test_a_pause_longer_than_a_minute_is_logged_whenever_it_begins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 429 asking for two minutes, within a minute of the last line, paused every call
    unlogged (a walkthrough: the log's last line was a 1 s pause)."""
    clock = Clock()
    throttle = _throttle(clock)
    with caplog.at_level("INFO", logger="scorebox.scorer.throttle"):
        throttle.rate_limited(Turn(), retry_after_s=1.0)
        await _probe(throttle, clock)
        throttle.answered(PROBE)
        throttle.done(PROBE)
        throttle.rate_limited(Turn(), retry_after_s=120.0)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert "paused for 120.0 s" in messages[1]


async def test_an_outage_going_on_is_logged_with_its_pause_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only an outage's beginning was logged: a pause its probes kept going for minutes read
    as 0.6 s in the log (found in a walkthrough)."""
    clock = Clock()
    throttle = _throttle(clock)
    with caplog.at_level("INFO", logger="scorebox.scorer.throttle"):
        _fails(throttle, *range(TRIP_AFTER))
        for text in range(10, 13):  # three probes, each finding the provider still down
            await _probe(throttle, clock)
            _fails(throttle, text, turn=PROBE)
            throttle.done(PROBE)
        clock.now += PAUSE_LOG_EVERY_S
        await _probe(throttle, clock)
        _fails(throttle, 13, turn=PROBE)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 3, messages
    assert "an outage" in messages[0]
    assert "stay paused for" in messages[1]
    assert "(1 probe(s) since the last such line)" in messages[1]
    assert "(3 probe(s) since the last such line)" in messages[2]
    left = float(messages[2].split("stay paused for ")[1].split(" s")[0])
    assert left == pytest.approx(throttle.pause_left_s(), abs=0.1)

    # The outage ends; the next one's probes share the minute with the last ones' line: a
    # provider down and up every few seconds wrote one with each outage (a walkthrough).
    throttle.done(PROBE)
    await _probe(throttle, clock)
    throttle.answered(PROBE)
    throttle.done(PROBE)
    caplog.clear()
    with caplog.at_level("INFO", logger="scorebox.scorer.throttle"):
        _fails(throttle, *range(20, 20 + TRIP_AFTER))
        await _probe(throttle, clock)
        _fails(throttle, 30, turn=PROBE)
        throttle.done(PROBE)
        clock.now += PAUSE_LOG_EVERY_S
        await _probe(throttle, clock)
        _fails(throttle, 31, turn=PROBE)
    later = [record.getMessage() for record in caplog.records if "stay paused" in record.message]
    assert len(later) == 1, later
    assert "(2 probe(s) since the last such line)" in later[0]


async def test_an_outage_whose_only_line_says_it_goes_on_has_its_end_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its begin line left out (a minute's limit), its "stay paused" written: the log ended
    there while the calls went on (a walkthrough)."""
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, *range(TRIP_AFTER))  # the minute's begin line
    await _probe(throttle, clock)
    throttle.answered(PROBE)
    throttle.done(PROBE)
    caplog.clear()
    with caplog.at_level("INFO", logger="scorebox.scorer.throttle"):
        _fails(throttle, *range(10, 10 + TRIP_AFTER))  # no line: within the minute
        clock.now += PAUSE_LOG_EVERY_S
        await _probe(throttle, clock)
        _fails(throttle, 20, turn=PROBE)  # "stay paused"
        throttle.done(PROBE)
        await _probe(throttle, clock)
        throttle.answered(PROBE)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert "stay paused" in messages[0]
    assert "model calls resumed" in messages[1]


def test_one_text_failing_again_and_again_pauses_nothing_however_many_tasks_hold_it() -> None:
    """A text the provider fails every time, scored as several tasks (three rubrics, or a
    client resubmitting it), their retries the only calls of a quiet hour, paused everyone's
    calls (it counted tasks), and its retries then probed for free, twenty times each."""
    throttle = _throttle(Clock())
    for _ in range(10):
        _fails(throttle, 7, 8)
    assert not throttle.paused


def test_failures_further_apart_than_the_window_are_not_in_a_row() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    for text in range(TRIP_AFTER):
        _fails(throttle, text)
        clock.now += TRIP_WINDOW_S
    assert not throttle.paused


def test_any_other_answer_between_them_starts_the_count_again() -> None:
    """A provider failing now and then, among answers, is not paused."""
    throttle = _throttle(Clock())
    for round_ in range(5):
        _fails(throttle, *(round_ * 10 + n for n in range(TRIP_AFTER - 1)))
        throttle.answered(Turn())
    assert not throttle.paused


def test_a_429_between_them_starts_the_count_again() -> None:
    """A provider answering 429 is up: two 5xx before it and one after were taken for three
    in a row, an outage's, the third call free and the other replicas told of an outage."""
    throttle = _throttle(Clock())
    _fails(throttle, *range(TRIP_AFTER - 1))
    throttle.rate_limited(Turn(), retry_after_s=None)
    assert _fails(throttle, TRIP_AFTER) == [False]


async def test_a_probe_finding_the_provider_still_down_is_the_outages_and_pauses_longer() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, *range(TRIP_AFTER))
    first_pause = throttle.pause_left_s()
    clock.now += first_pause + 0.01
    probe = await throttle.wait_turn(asyncio.Event())
    assert probe == Turn(probe=True)

    assert _fails(throttle, 0, turn=PROBE) == [True]
    throttle.done(PROBE)
    assert throttle.paused
    assert throttle.pause_left_s() > first_pause  # doubled (within its jitter)

    clock.now += throttle.pause_left_s() + 0.01
    second = await throttle.wait_turn(asyncio.Event())
    assert second == Turn(probe=True)
    throttle.answered(second)  # back: the pause is over for all
    throttle.done(second)
    assert not throttle.paused
    assert _fails(throttle, 5, 6) == [False, False]  # counted afresh


async def test_a_429s_pause_turns_into_an_outages_when_three_texts_find_the_provider_down() -> None:
    """Overloaded providers mix 429s and 503s: a pause begun by a 429 stayed a rate limit's,
    and every probe finding the provider down was charged to its task; the other replicas
    are told it is an outage now."""
    clock = Clock()
    told: list[tuple[float, bool]] = []
    throttle = ModelThrottle(
        base_s=1.0, rng=random.Random(0), clock=clock, on_pause=lambda s, o: told.append((s, o))
    )
    throttle.rate_limited(Turn(), retry_after_s=1)
    owned = []
    for text in range(TRIP_AFTER + 1):
        clock.now += throttle.pause_left_s() + 0.01
        probe = await throttle.wait_turn(asyncio.Event())
        assert probe == PROBE
        owned += _fails(throttle, text, turn=PROBE)
        throttle.done(PROBE)
    assert owned == [False] * (TRIP_AFTER - 1) + [True, True]
    assert [outage for _, outage in told] == [False, True]


async def test_an_outage_heard_from_another_replica_makes_the_probes_here_its_own() -> None:
    """The outage was one process's: another replica paused by its announcement charged
    every probe of the outage to its task."""
    clock = Clock()
    throttle = _throttle(clock)
    assert throttle.paused_elsewhere(2.0, outage=True)
    clock.now += 2.01
    probe = await throttle.wait_turn(asyncio.Event())
    assert probe == PROBE
    assert _fails(throttle, 5, turn=PROBE) == [True]


async def test_a_5xx_during_a_rate_limits_pause_is_its_tasks() -> None:
    """The fault test saw a task failing every call make six calls where four were due, its
    failures during another task's rate-limit pause taken for an outage's."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=1)
    clock.now += 1.01
    probe = await throttle.wait_turn(asyncio.Event())
    assert probe == PROBE
    assert _fails(throttle, 0, turn=PROBE) == [False]
    throttle.done(PROBE)


async def test_a_replica_idle_since_a_pause_does_not_show_as_paused() -> None:
    """`paused` (the `scorebox_model_calls_paused` gauge) stayed true on a replica with no
    call to make after its pause, for as long as it stayed idle."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=5)
    assert throttle.paused
    clock.now += 5.01  # over, and nobody called
    assert not throttle.paused

    probe = await throttle.wait_turn(asyncio.Event())
    assert probe == Turn(probe=True)
    assert throttle.paused  # the others wait for its answer


async def test_an_outage_and_its_pause_long_over_are_forgotten_by_an_idle_replica() -> None:
    """An outage heard from another replica was kept until a probe here was answered: on a
    replica idle since, the next call, a probe, failing with one text's own 5xx was taken
    for the outage's (free) and paused everyone's calls, its retries probing for free in
    turn (24 attempts where 4 were due)."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.paused_elsewhere(5.0, outage=True)
    clock.now += 5 + TRIP_WINDOW_S + 1  # idle since

    turn = await throttle.wait_turn(asyncio.Event())

    assert turn == GO  # no probe of a pause long over
    assert _fails(throttle, 1, turn=turn) == [False]
    assert not throttle.paused


async def test_an_outage_is_the_probes_own_within_the_window_after_its_pause() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    throttle.paused_elsewhere(5.0, outage=True)
    clock.now += 5 + TRIP_WINDOW_S - 1

    assert await throttle.wait_turn(asyncio.Event()) == PROBE
    assert _fails(throttle, 1, turn=PROBE) == [True]


async def test_a_probe_whose_call_outlasts_the_window_is_still_the_outages() -> None:
    """The outage ran out `TRIP_WINDOW_S` after its pause, while its probe's call could take
    longer (`LLM_TIMEOUT_S` up to 540 s): a probe timing out after 150 s was charged to its
    task, and every probe after it until three texts tripped the breaker again."""
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, *range(TRIP_AFTER))
    clock.now += throttle.pause_left_s() + 0.01
    assert await throttle.wait_turn(asyncio.Event()) == PROBE

    clock.now += 150  # the probe's call times out
    assert _fails(throttle, 0, turn=PROBE) == [True]
    throttle.done(PROBE)
    clock.now += throttle.pause_left_s() + 0.01
    assert await throttle.wait_turn(asyncio.Event()) == PROBE
    assert _fails(throttle, 1, turn=PROBE) == [True]  # the outage goes on


async def test_an_outage_heard_during_a_longer_pause_here_lasts_as_long() -> None:
    """An outage heard from another replica lasted the other's pause: this replica, waiting
    out a 429's Retry-After of 300 s, charged its probe at the end of it to its task."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=300)
    assert not throttle.paused_elsewhere(5.0, outage=True)  # shorter than the pause here
    clock.now += 300.01

    assert await throttle.wait_turn(asyncio.Event()) == PROBE
    assert _fails(throttle, 1, turn=PROBE) == [True]


async def test_a_pause_forgotten_by_an_idle_replica_leaves_no_back_off_behind() -> None:
    """The next pause starts from the base again, not where a long-gone limit left it."""
    clock = Clock()
    throttle = _throttle(clock)
    for _ in range(5):  # a limit that lasted: its back-off grown to 16-32 s
        throttle.rate_limited(PROBE, retry_after_s=None)
    clock.now += throttle.pause_left_s() + TRIP_WINDOW_S + 1
    assert await throttle.wait_turn(asyncio.Event()) == GO

    throttle.rate_limited(Turn(), retry_after_s=None)
    assert 0.5 <= throttle.pause_left_s() <= 1.0


async def test_a_peers_pause_heard_by_an_idle_replica_starts_from_the_base_back_off() -> None:
    """A pause long over was forgotten only when a call came: a peer's pause heard first
    made it recent again, and the next pause here began where a limit gone an hour before
    had left the back-off (16-32 s for a 1 s one)."""
    clock = Clock()
    throttle = _throttle(clock)
    for _ in range(5):
        throttle.rate_limited(PROBE, retry_after_s=None)
    clock.now += throttle.pause_left_s() + TRIP_WINDOW_S + 3600  # idle for an hour
    assert throttle.paused_elsewhere(1.0)
    clock.now += 1.01
    probe = await throttle.wait_turn(asyncio.Event())
    assert probe == PROBE

    throttle.rate_limited(probe, retry_after_s=None)  # the second pause in a row
    throttle.done(probe)
    assert throttle.pause_left_s() <= 2.0


async def test_a_probe_answered_ends_the_outage_whatever_pause_goes_on() -> None:
    """A peer's 429 pause heard while the outage's probe ran kept the outage after the
    provider answered the probe: the next probe's own 5xx (one text's) was the outage's,
    free, though a 5xx during a rate limit's pause is its task's."""
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, *range(TRIP_AFTER))
    clock.now += throttle.pause_left_s() + 0.01
    assert await throttle.wait_turn(asyncio.Event()) == PROBE
    assert throttle.paused_elsewhere(5.0)  # a rate limit elsewhere, heard meanwhile
    throttle.answered(PROBE)  # the provider is back
    throttle.done(PROBE)

    clock.now += 5.01
    assert await throttle.wait_turn(asyncio.Event()) == PROBE
    assert _fails(throttle, 99, turn=PROBE) == [False]


async def test_a_pause_ending_as_the_hold_ends_lets_the_delivery_call() -> None:
    """With `Retry-After` equal to the hold (30 s each by default), every delivery waiting
    from the 429 on was put off at the pause's end, a timer's lateness making what was left
    of its hold negative, and none of them probed."""
    turns = []
    for _ in range(20):
        throttle = ModelThrottle(hold_s=0.05, base_s=0.001, rng=random.Random(0))  # real clock
        throttle.rate_limited(GO, retry_after_s=0.05)
        turns.append(await throttle.wait_turn(asyncio.Event()))
    assert turns == [PROBE] * 20


async def _probe(throttle: ModelThrottle, clock: Clock) -> None:
    """The pause waited out, the probe taken."""
    clock.now += throttle.pause_left_s() + 0.01
    assert await throttle.wait_turn(asyncio.Event()) == PROBE


async def test_one_text_probing_again_and_again_does_not_keep_an_outage_going_for_free() -> None:
    """Only the start of an outage needed three texts: one text failing every time, its retry
    due at each pause's end and so the probe, was free at each probe, twenty times. A
    text's call is the outage's once; the pause goes on all the same (the provider is still
    down: a first version of this rule stopped pausing, and the calls went on one after
    another, each charged)."""
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, *range(TRIP_AFTER))
    await _probe(throttle, clock)
    assert _fails(throttle, 7, turn=PROBE) == [True]
    throttle.done(PROBE)
    await _probe(throttle, clock)

    assert _fails(throttle, 7, turn=PROBE) == [False]  # again: its task's
    throttle.done(PROBE)
    assert throttle.pause_left_s() > 0  # no probe before a new pause ends


async def test_the_calls_a_text_was_charged_before_the_outage_began_are_refunded_by_probes() -> (
    None
):
    """The first task of an outage, its retries failing while the next texts arrived, spent
    three attempts before three texts had found the provider down, then the fourth on a
    probe: failed, in an outage it should have waited out (a fault test under load). Each
    call charged before the outage makes one more probe of its text the outage's; the text
    that began it gets no more than its own calls before."""
    clock = Clock()
    throttle = _throttle(clock)
    assert _fails(throttle, 0, 0, 0, 1, 2) == [False, False, False, False, True]
    outcomes = []
    for _ in range(5):
        await _probe(throttle, clock)
        outcomes += _fails(throttle, 0, turn=PROBE)
        throttle.done(PROBE)
    assert outcomes == [True, True, True, True, False]  # its first, and three refunded

    for text, free in ((1, 2), (2, 0)):  # charged once; the one that began it: its call free
        outcomes = []
        for _ in range(free + 1):
            await _probe(throttle, clock)
            outcomes += _fails(throttle, text, turn=PROBE)
            throttle.done(PROBE)
        assert outcomes == [True] * free + [False], text


async def _probes(
    throttle: ModelThrottle, clock: Clock, text: int, task: str, n: int
) -> list[bool]:
    """`n` probes of task `task` (text `text`) finding the provider still down: whether each
    was the outage's."""
    outcomes = []
    for _ in range(n):
        await _probe(throttle, clock)
        outcomes += _fails(throttle, text, turn=PROBE, task=task)
        throttle.done(PROBE)
    return outcomes


async def test_the_calls_of_a_texts_other_tasks_refund_nothing() -> None:
    """Refunds pooled by text: the calls of its earlier tasks (dead-lettered, say) made a new
    task's probes free as many times, twenty and more (a review of the first version)."""
    clock = Clock()
    throttle = _throttle(clock)
    for earlier in "abcde":
        _fails(throttle, 0, task=earlier)
    _fails(throttle, 1, 2)

    assert await _probes(throttle, clock, 0, "f", 2) == [True, False]  # the text's first only


async def test_a_call_running_when_the_outage_began_is_the_outages() -> None:
    """Charged and refunded by a later probe, it failed a task on its last attempt all the
    same (a review)."""
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, 1, 2, 3)  # the outage begins
    assert _fails(throttle, 0, task="running") == [True]

    assert await _probes(throttle, clock, 0, "running", 2) == [True, False]


async def test_a_probe_out_when_the_outage_began_is_the_outages() -> None:
    """A 429's probe of text 7 is out; calls running meanwhile, one of them of text 7 too,
    begin an outage: the probe's failure was charged, its text taken already (a review)."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(GO, retry_after_s=1)
    await _probe(throttle, clock)
    _fails(throttle, 1, 2)
    assert _fails(throttle, 7, task="another of text 7") == [True]  # begins the outage

    assert _fails(throttle, 7, turn=PROBE, task="probing") == [True]
    throttle.done(PROBE)
    assert await _probes(throttle, clock, 7, "probing", 1) == [False]


async def test_an_outage_heard_from_another_replica_refunds_the_calls_charged_here() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    assert _fails(throttle, 0, 0, 0) == [False, False, False]  # one text: no outage here
    throttle.paused_elsewhere(1.0, outage=True)

    assert await _probes(throttle, clock, 0, "task-0", 5) == [True] * 4 + [False]


async def test_a_delivery_of_a_text_not_seen_failing_probes_first() -> None:
    """Three texts failing on their own were taken for an outage; their retries, due at
    each pause's end, probed pause after pause, doubling it, while every other task waited
    for minutes (an acceptance run). The probe now goes to a text not seen failing when one
    waits; a text seen failing waits for its answer."""
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, *range(TRIP_AFTER))
    seen = asyncio.ensure_future(throttle.wait_turn(asyncio.Event(), text_key=0))

    await eventually(
        partial(_waiting, throttle, 1), what="the retry of a text seen failing waiting"
    )
    fresh = asyncio.ensure_future(throttle.wait_turn(asyncio.Event(), text_key=99))
    await eventually(partial(_waiting, throttle, 2), what="another text waiting")
    clock.now += throttle.pause_left_s() + 0.01  # the pause is over: each wakes at its end

    assert await asyncio.wait_for(fresh, timeout=GUARD_S) == PROBE
    assert not seen.done()  # gives way, waiting for the probe's answer
    throttle.answered(PROBE)
    throttle.done(PROBE)
    assert await asyncio.wait_for(seen, timeout=GUARD_S) == GO


async def test_a_text_seen_failing_probes_when_no_other_waits() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, *range(TRIP_AFTER))
    clock.now += throttle.pause_left_s() + 0.01
    turn = await asyncio.wait_for(throttle.wait_turn(asyncio.Event(), text_key=0), GUARD_S)
    assert turn == PROBE


async def _probes_of_texts_seen_failing(throttle: ModelThrottle, clock: Clock, rounds: int) -> None:
    """The outage's three texts, each probing `rounds` times, each finding it still down."""
    for _ in range(rounds):
        for text in range(TRIP_AFTER):
            await _probe(throttle, clock)
            _fails(throttle, text, turn=PROBE)
            throttle.done(PROBE)


async def test_probes_of_the_texts_seen_failing_still_double_the_pause() -> None:
    """A provider really down on a quiet system: the tasks that began the outage are the only
    calls, their retries its probes. Holding the pause at its length for them (a first
    mend of the case below) spent their attempts within the retries' back-off, every task
    of a 60 s outage failed (a review's simulation); the pause doubles as before."""
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, *range(TRIP_AFTER))
    await _probes_of_texts_seen_failing(throttle, clock, rounds=2)
    assert throttle.pause_left_s() > OUTAGE_PAUSE_CAP_S / 2  # doubled up to its cap


async def test_a_text_not_seen_failing_cuts_short_a_pause_only_texts_seen_failing_lengthened() -> (
    None
):
    """Three texts failing on their own were taken for an outage; their retries, the only
    calls of a quiet pause, probed it pause after pause, doubling it up to a minute, while a
    healthy task submitted meanwhile was put off again and again (92 s and over 200 s in a
    walkthrough). A delivery of a text not seen failing now probes at once, and its answer
    ends the pause for all."""
    clock = Clock()
    throttle = _throttle(clock, hold_s=0.5)
    _fails(throttle, *range(TRIP_AFTER))
    await _probes_of_texts_seen_failing(throttle, clock, rounds=2)
    assert throttle.pause_left_s() > 1.0

    turn = await asyncio.wait_for(throttle.wait_turn(asyncio.Event(), text_key=99), GUARD_S)
    assert turn == PROBE
    throttle.answered(PROBE)
    throttle.done(PROBE)
    assert not throttle.paused
    assert await asyncio.wait_for(throttle.wait_turn(asyncio.Event(), text_key=0), GUARD_S) == GO


async def test_a_pause_is_cut_short_once_and_a_failing_probe_proves_the_next() -> None:
    """In a real outage the text not seen failing fails too: the pause it begins stands for
    the next texts (or each new text would call a provider that is down)."""
    clock = Clock()
    throttle = _throttle(clock, hold_s=0.5)
    _fails(throttle, *range(TRIP_AFTER))
    await _probes_of_texts_seen_failing(throttle, clock, rounds=1)
    assert await throttle.wait_turn(asyncio.Event(), text_key=99) == PROBE
    assert _fails(throttle, 99, turn=PROBE) == [True]  # the outage's: its first probe
    throttle.done(PROBE)

    assert isinstance(await throttle.wait_turn(asyncio.Event(), text_key=98), PutOff)


async def test_the_pause_three_texts_began_is_not_cut_short() -> None:
    """Three texts in a row are the outage's evidence: its first pause is waited out."""
    clock = Clock()
    throttle = _throttle(clock, hold_s=0.1)
    _fails(throttle, *range(TRIP_AFTER))

    assert isinstance(await throttle.wait_turn(asyncio.Event(), text_key=99), PutOff)


async def test_a_probe_cutting_a_pause_short_that_never_called_lets_another_do_so() -> None:
    clock = Clock()
    throttle = _throttle(clock, hold_s=0.5)
    _fails(throttle, *range(TRIP_AFTER))
    await _probes_of_texts_seen_failing(throttle, clock, rounds=1)
    assert await throttle.wait_turn(asyncio.Event(), text_key=99) == PROBE
    throttle.done(PROBE)  # its claim was held elsewhere, say

    assert await throttle.wait_turn(asyncio.Event(), text_key=98) == PROBE


async def _unproven(clock: Clock, *, hold_s: float = 0.5, rounds: int = 1) -> ModelThrottle:
    """A throttle whose outage's pause only a text seen failing lengthened, last."""
    throttle = _throttle(clock, hold_s=hold_s)
    _fails(throttle, *range(TRIP_AFTER))
    await _probes_of_texts_seen_failing(throttle, clock, rounds=rounds)
    return throttle


async def test_a_429_heard_during_an_unproven_pause_is_not_cut_short() -> None:
    """A call running since before the outage came back 429, `Retry-After: 600`: a text not
    seen failing still probed at once, and its answer ended the 600 s pause for all (a
    review). A limit is news of the provider: the pause stands."""
    clock = Clock()
    throttle = await _unproven(clock)
    throttle.rate_limited(GO, retry_after_s=600)

    assert isinstance(await throttle.wait_turn(asyncio.Event(), text_key=99), PutOff)


@pytest.mark.parametrize("outage", [False, True], ids=["a 429", "an outage"])
async def test_a_pause_told_by_another_replica_is_not_cut_short(outage: bool) -> None:
    """Shorter than this one's or not, the other replica's pause is news of the provider."""
    clock = Clock()
    throttle = await _unproven(clock)
    throttle.paused_elsewhere(0.1, outage=outage)

    assert isinstance(await throttle.wait_turn(asyncio.Event(), text_key=99), PutOff)


async def test_a_cut_short_probe_that_never_called_does_not_reopen_a_pause_told_meanwhile() -> None:
    """Another replica's outage was told while the probe was out; the probe then never
    called (its claim held elsewhere), and the next text cut the 300 s pause short (a
    review)."""
    clock = Clock()
    throttle = await _unproven(clock)
    assert await throttle.wait_turn(asyncio.Event(), text_key=99) == PROBE
    throttle.paused_elsewhere(300.0, outage=True)
    throttle.done(PROBE)

    assert isinstance(await throttle.wait_turn(asyncio.Event(), text_key=98), PutOff)


async def test_healthy_deliveries_wait_in_hand_for_the_probe_cutting_the_pause_short() -> None:
    """Put off down the ladder while that probe was out, a burst of healthy tasks came back
    half a minute later though it was answered in two seconds (a review)."""
    clock = Clock()
    throttle = await _unproven(clock, hold_s=GUARD_S, rounds=2)
    assert throttle.pause_left_s() > GUARD_S  # past the hold: a delivery would be put off
    assert await throttle.wait_turn(asyncio.Event(), text_key=99) == PROBE
    healthy = asyncio.ensure_future(throttle.wait_turn(asyncio.Event(), text_key=98))

    async def waiting() -> bool:
        return throttle.waiting == 1

    await eventually(waiting, what="the healthy delivery waiting for the probe's answer")
    assert not healthy.done()
    throttle.answered(PROBE)
    throttle.done(PROBE)
    assert await asyncio.wait_for(healthy, timeout=GUARD_S) == GO


async def test_a_call_failing_while_the_pause_is_cut_short_does_not_keep_it_going() -> None:
    """A call of a text seen failing, running since before the pause, failed while the
    healthy probe cutting it short was out: it lengthened the pause a little, and the
    probe's answer, the provider up, no longer ended it; the deliveries waiting for that
    answer waited the pause out or went down the ladder (a review)."""
    clock = Clock()
    throttle = await _unproven(clock, hold_s=GUARD_S, rounds=2)
    assert await throttle.wait_turn(asyncio.Event(), text_key=99) == PROBE
    healthy = asyncio.ensure_future(throttle.wait_turn(asyncio.Event(), text_key=98))

    async def waiting() -> bool:
        return throttle.waiting == 1

    await eventually(waiting, what="the healthy delivery waiting for the probe's answer")
    clock.now += throttle.pause_left_s() - 0.5  # near its end: the failure lengthens it
    _fails(throttle, 0, task="running since before the pause")
    throttle.answered(PROBE)
    throttle.done(PROBE)

    assert not throttle.paused
    assert await asyncio.wait_for(healthy, timeout=GUARD_S) == GO


async def test_a_delivery_put_off_is_back_in_hand_before_the_pause_ends_and_probes_first() -> None:
    """Brought back after the pause's end, a healthy delivery put off came second to the
    retries of texts failing on their own, due at that very end: one probed and failed, the
    pause began again, and the healthy one was put off again (a walkthrough). It is now back
    with part of the hold left, waiting, and the probe goes to it."""
    clock = Clock()
    throttle = _throttle(clock, hold_s=2.0)  # short: the waiter sleeps what is left for real
    _fails(throttle, *range(TRIP_AFTER))
    throttle.paused_elsewhere(6.0, outage=True)
    put_off = await throttle.wait_turn(asyncio.Event(), text_key=99)
    assert isinstance(put_off, PutOff)

    clock.now += throttle.back_in_s(put_off, random.Random(0))
    healthy = asyncio.ensure_future(throttle.wait_turn(asyncio.Event(), text_key=99))

    await eventually(partial(_waiting, throttle, 1), what="the delivery back in hand, waiting")
    assert not healthy.done()  # not put off again
    clock.now += throttle.pause_left_s()  # the retry of a text seen failing, due at the end
    retry = asyncio.ensure_future(throttle.wait_turn(asyncio.Event(), text_key=0))
    await eventually(partial(_waiting, throttle, 2), what="the retry waiting too")
    clock.now += 0.01

    assert await asyncio.wait_for(healthy, timeout=GUARD_S) == PROBE
    assert not retry.done()
    throttle.answered(PROBE)
    throttle.done(PROBE)
    assert await asyncio.wait_for(retry, timeout=GUARD_S) == GO


@pytest.mark.parametrize("news", ["a 429 to the probe", "another replica's 429"])
async def test_the_provider_answering_a_429_ends_the_outage(news: str) -> None:
    """The outage outlived evidence that the provider was reachable: the next probe's own
    5xx (one text's) was still the outage's, free."""
    clock = Clock()
    throttle = _throttle(clock)
    _fails(throttle, *range(TRIP_AFTER))
    await _probe(throttle, clock)
    if news == "a 429 to the probe":
        throttle.rate_limited(PROBE, retry_after_s=None)
    else:
        throttle.paused_elsewhere(throttle.pause_left_s() + 5.0)
    throttle.done(PROBE)

    await _probe(throttle, clock)
    assert _fails(throttle, 99, turn=PROBE) == [False]


async def test_an_outage_heard_while_the_probe_was_out_outlives_its_answer() -> None:
    """Another replica's outage heard while this one's probe ran was ended by that probe's
    answer, though the pause it brought went on: its probe was charged."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=1)
    await _probe(throttle, clock)
    assert throttle.paused_elsewhere(5.0, outage=True)
    throttle.answered(PROBE)
    throttle.done(PROBE)

    await _probe(throttle, clock)
    assert _fails(throttle, 1, turn=PROBE) == [True]


async def test_an_outage_heard_during_a_probe_that_outlasts_its_pause_ends_with_the_answer() -> (
    None
):
    """The outage was kept with no pause left to be an outage's: nothing ended it, and this
    replica's breaker never tripped again (`began` needs no outage)."""
    clock = Clock()
    throttle = _throttle(clock)
    throttle.rate_limited(Turn(), retry_after_s=1)
    await _probe(throttle, clock)
    assert throttle.paused_elsewhere(1.0, outage=True)
    clock.now += 2  # the probe's call outlasts the other's pause
    throttle.answered(PROBE)
    throttle.done(PROBE)

    clock.now += 3600
    assert _fails(throttle, *range(TRIP_AFTER)) == [False] * (TRIP_AFTER - 1) + [True]


async def test_a_tasks_refunds_are_its_generations_own() -> None:
    """Keyed by task id alone, a generation's refunds, left when it failed (its last attempt
    charged), made the probes of its re-score or replay free (a review)."""
    clock = Clock()
    throttle = _throttle(clock)
    task = ScoreText(task_id="t-1", text="the same text")
    down = ModelUnavailable("503 from the provider")
    assert [await _tell_the_throttle(throttle, GO, down, task) for _ in range(2)] == [
        False,
        False,
    ]
    for text in ("one", "two"):  # the outage begins: generation 0 owed two probes
        await _tell_the_throttle(throttle, GO, down, ScoreText(task_id=f"other {text}", text=text))

    rescore = task.model_copy(update={"generation": 1})
    outcomes = []
    for _ in range(2):
        await _probe(throttle, clock)
        outcomes.append(await _tell_the_throttle(throttle, PROBE, down, rescore))
        throttle.done(PROBE)
    assert outcomes == [True, False]  # the text's first probe only


def _fails_of(throttle: ModelThrottle, tenant: str, *texts: int, turn: Turn = GO) -> list[bool]:
    """Calls of the texts `texts` of the tenant `tenant` finding the provider unavailable,
    each of a task of its own text; whether each was the outage's."""
    return [
        throttle.unavailable(
            turn, retry_after_s=None, text_key=text, task_key=f"task-{text}", tenant_key=tenant
        )
        for text in texts
    ]


async def _turn_of(throttle: ModelThrottle, tenant: str, text: int) -> Turn | PutOff:
    waiting = throttle.wait_turn(asyncio.Event(), text_key=text, tenant_key=tenant)
    return await asyncio.wait_for(waiting, timeout=GUARD_S)


async def _probe_fails(throttle: ModelThrottle, clock: Clock, tenant: str, text: int) -> bool:
    """The pause waited out, a delivery of `text` probes and finds the provider down;
    whether the call was the outage's."""
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, tenant, text) == PROBE
    [outages] = _fails_of(throttle, tenant, text, turn=PROBE)
    throttle.done(PROBE)
    return outages


async def _probe_answered(throttle: ModelThrottle, clock: Clock, tenant: str, text: int) -> None:
    """The pause waited out, a delivery of `text` probes and is answered: the pause ends."""
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, tenant, text) == PROBE
    throttle.answered(PROBE)
    throttle.done(PROBE)


async def _one_tenants_batch_failing(
    clock: Clock,
    *,
    probes: int,
    hold_s: float = 0.5,
    active: Sequence[str] = (),
    idle_s: float = 0.0,
) -> ModelThrottle:
    """Tenant a's batch of texts each failing on its own: three of them trip the outage, and
    each probe after it is a fresh text of the batch, failing too. The `active` tenants'
    deliveries were called `idle_s` before."""
    throttle = _throttle(clock, hold_s=hold_s)
    for text, tenant in enumerate(active, start=900):
        assert await _turn_of(throttle, tenant, text) == GO
    clock.now += idle_s
    _fails_of(throttle, "a", *range(TRIP_AFTER))
    for text in range(100, 100 + probes):
        assert await _probe_fails(throttle, clock, "a", text)  # a fresh text's: the outage's
    return throttle


async def test_another_tenant_cuts_short_a_pause_one_tenants_fresh_texts_lengthened() -> None:
    """A batch of 60 texts each answered 500, all fresh, proved the outage at each probe,
    doubling the pause to a minute, and another tenant's 100 healthy texts, submitted a
    second later, finished after 152 and 209 s (session 46's walkthrough). A fresh text of a
    tenant seen failing is no news to the other tenants: a delivery of one not seen failing
    probes at once, and its answer ends the pause for all."""
    clock = Clock()
    throttle = await _one_tenants_batch_failing(clock, probes=4)
    assert throttle.pause_left_s() > 1.0  # past the hold: a delivery would be put off

    assert await _turn_of(throttle, "b", 999) == PROBE
    throttle.answered(PROBE)
    throttle.done(PROBE)
    assert not throttle.paused
    assert await _turn_of(throttle, "a", 200) == GO


async def test_a_tenant_seen_failing_gives_way_to_another_tenant_active_meanwhile() -> None:
    """Held the whole hold, the failing batch's deliveries kept every model slot and the
    prefetch for the last half minute of each pause, and the other tenant's texts, which
    would end it, reached the scorer after about 45 s (`devtools.poison_batch`, session 47).
    While a tenant not seen failing is active, a delivery that may not cut the pause short
    is put off at once, and comes back within a sixth of the hold of the pause's end."""
    clock = Clock()
    throttle = await _one_tenants_batch_failing(clock, probes=4, hold_s=30.0, active=["b"])
    left = throttle.pause_left_s()
    assert 30.0 * GIVING_WAY_SHARE < left < 30.0  # within the whole hold, past the share

    put_off = await _turn_of(throttle, "a", 300)
    assert put_off == PutOff(left, giving_way=True)
    back_in = throttle.back_in_s(put_off, random.Random(0))
    assert left - 30.0 * GIVING_WAY_SHARE <= back_in <= left - 30.0 * GIVING_WAY_SHARE / 2
    assert await _turn_of(throttle, "b", 999) == PROBE


async def test_a_single_tenants_deliveries_give_way_to_nobody() -> None:
    """Put off at once with nobody to give way to, a single tenant's whole backlog went down
    the ladder and back in each pause of 5 to 30 s, which it waited out in the queue before
    (a review). So does a tenant idle for longer than the trip window count for nobody."""
    clock = Clock()
    throttle = await _one_tenants_batch_failing(
        clock, probes=4, hold_s=30.0, active=["b"], idle_s=TRIP_WINDOW_S
    )
    await _in_hand_until_the_scorer_stops(throttle, "a", 300)


async def test_a_tenant_gives_way_to_no_tenant_but_itself() -> None:
    """Tenant b's text that tenant a failed first may not cut the pause short, b itself not
    seen failing: counted as the other tenant active, b gave way to itself (a review)."""
    clock = Clock()
    throttle = await _one_tenants_batch_failing(clock, probes=4, hold_s=30.0, active=["b"])
    assert 30.0 * GIVING_WAY_SHARE * 0.9 + GIVING_WAY_LEAST_S < throttle.pause_left_s() < 30.0

    await _in_hand_until_the_scorer_stops(throttle, "b", 0)  # text 0: a's, seen failing


async def test_a_tenant_idle_for_the_trip_window_is_given_way_to_no_longer() -> None:
    clock = Clock()
    throttle = _throttle(clock, hold_s=30.0)
    clock.now += TRIP_WINDOW_S * 0.8
    assert await _turn_of(throttle, "b", 900) == GO
    clock.now += TRIP_WINDOW_S * 0.4
    assert await _turn_of(throttle, "a", 901) == GO  # tenants idle forgotten now, b kept
    clock.now += TRIP_WINDOW_S * 0.7  # b idle for 1.1 windows, the next forgetting not due
    _fails_of(throttle, "a", *range(TRIP_AFTER))
    for text in range(100, 104):
        await _probe_fails(throttle, clock, "a", text)
    assert 30.0 * GIVING_WAY_SHARE * 0.9 + GIVING_WAY_LEAST_S < throttle.pause_left_s() < 30.0

    await _in_hand_until_the_scorer_stops(throttle, "a", 300)


async def _in_hand_until_the_scorer_stops(throttle: ModelThrottle, tenant: str, text: int) -> None:
    """The delivery waits in hand (not put off) until the scorer stops."""
    closing = asyncio.Event()
    waiting = asyncio.ensure_future(throttle.wait_turn(closing, text_key=text, tenant_key=tenant))
    await eventually(partial(_waiting, throttle, 1), what="the delivery in hand")
    closing.set()
    with pytest.raises(SlotsClosed):
        await asyncio.wait_for(waiting, timeout=GUARD_S)


async def test_a_text_seen_failing_gives_way_in_a_pause_a_fresh_text_may_cut_short() -> None:
    clock = Clock()
    throttle = _throttle(clock, hold_s=3.0)
    assert await _turn_of(throttle, "c", 900) == GO
    _fails_of(throttle, "a", *range(TRIP_AFTER))
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, "a", 0) == PROBE
    _fails_of(throttle, "a", 0, turn=PROBE)  # a text seen failing: news to nobody
    throttle.done(PROBE)
    left = throttle.pause_left_s()
    assert 3.0 * GIVING_WAY_SHARE * 0.9 + GIVING_WAY_LEAST_S < left < 3.0

    assert await _turn_of(throttle, "a", 1) == PutOff(left, giving_way=True)
    assert await _turn_of(throttle, "a", 500) == PROBE


async def test_a_delivery_giving_way_is_never_put_off_for_less_than_a_second() -> None:
    """Waiting in hand for the outage's probe, deliveries gave way when it failed, their
    share of the hold long spent: each put off for nothing, straight back to the queue, and
    put off again while the pause was just over the share (a review)."""
    clock = Clock()
    throttle = _throttle(clock, hold_s=10.0)
    share_s = 10.0 * GIVING_WAY_SHARE
    assert await _turn_of(throttle, "b", 900) == GO
    _fails_of(throttle, "a", *range(TRIP_AFTER))
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, "a", 100) == PROBE
    waiting = asyncio.ensure_future(
        throttle.wait_turn(asyncio.Event(), text_key=101, tenant_key="a")
    )
    await eventually(partial(_waiting, throttle, 1), what="tenant a's delivery in hand")
    _fails_of(throttle, "a", 100, turn=PROBE)
    throttle.done(PROBE)
    left = throttle.pause_left_s()
    assert share_s < left < share_s * 0.9 + GIVING_WAY_LEAST_S  # past the share, barely
    clock.now += left + 0.01  # it wakes at the pause's end, read from the real clock

    assert await asyncio.wait_for(waiting, timeout=GUARD_S) == PROBE


async def test_a_delivery_that_may_cut_the_pause_short_later_is_held_the_whole_hold() -> None:
    """While the pause's probe is out no delivery may cut it short; another tenant's
    delivery waits in hand the whole hold all the same, for once the probe is back."""
    clock = Clock()
    throttle = await _one_tenants_batch_failing(clock, probes=4, hold_s=30.0)
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, "a", 600) == PROBE
    _fails_of(throttle, "a", 700)  # a call running meanwhile: the pause lasts again
    assert 30.0 * GIVING_WAY_SHARE < throttle.pause_left_s() < 30.0

    waiting = asyncio.ensure_future(
        throttle.wait_turn(asyncio.Event(), text_key=999, tenant_key="b")
    )
    await eventually(partial(_waiting, throttle, 1), what="tenant b's delivery waiting")
    throttle.done(PROBE)  # the probe never called (its claim held elsewhere, say)
    assert await asyncio.wait_for(waiting, timeout=GUARD_S) == PROBE


async def test_a_tenants_own_fresh_texts_do_not_cut_short_the_pause_its_fresh_text_began() -> None:
    """A single tenant's deployment behaves as before: the pause a fresh text of its own
    began stands for its other texts (each would call a provider that is down)."""
    clock = Clock()
    throttle = await _one_tenants_batch_failing(clock, probes=1)

    assert isinstance(await _turn_of(throttle, "a", 300), PutOff)


async def test_in_a_real_outage_each_tenant_cuts_a_pause_short_once() -> None:
    """Another tenant's probe that fails is news of the provider: the pause it begins stands
    for every tenant, until a probe of a tenant seen failing begins the next."""
    clock = Clock()
    throttle = await _one_tenants_batch_failing(clock, probes=1)
    assert await _turn_of(throttle, "b", 999) == PROBE
    assert _fails_of(throttle, "b", 999, turn=PROBE) == [True]  # the outage's: its first
    throttle.done(PROBE)

    assert isinstance(await _turn_of(throttle, "b", 998), PutOff)
    assert isinstance(await _turn_of(throttle, "c", 997), PutOff)
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, "a", 301) == PROBE
    _fails_of(throttle, "a", 301, turn=PROBE)
    throttle.done(PROBE)
    assert isinstance(await _turn_of(throttle, "b", 998), PutOff)  # seen failing now
    assert await _turn_of(throttle, "c", 997) == PROBE


async def test_the_tenants_of_the_texts_that_began_the_outage_are_seen_failing() -> None:
    clock = Clock()
    throttle = _throttle(clock, hold_s=0.5)
    _fails_of(throttle, "a", 0)
    _fails_of(throttle, "b", 1)
    _fails_of(throttle, "a", 2)
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, "a", 100) == PROBE
    _fails_of(throttle, "a", 100, turn=PROBE)
    throttle.done(PROBE)

    assert isinstance(await _turn_of(throttle, "b", 999), PutOff)
    assert await _turn_of(throttle, "c", 998) == PROBE


async def test_a_delivery_of_a_tenant_not_seen_failing_probes_first() -> None:
    """At the pause's end a fresh text of the failing batch's tenant probed as readily as
    another tenant's text: failing, it doubled the pause for all."""
    clock = Clock()
    throttle = _throttle(clock, hold_s=GUARD_S)
    _fails_of(throttle, "a", *range(TRIP_AFTER))
    batch = asyncio.ensure_future(throttle.wait_turn(asyncio.Event(), text_key=100, tenant_key="a"))

    await eventually(partial(_waiting, throttle, 1), what="a fresh text of tenant a waiting")
    other = asyncio.ensure_future(throttle.wait_turn(asyncio.Event(), text_key=999, tenant_key="b"))
    await eventually(partial(_waiting, throttle, 2), what="tenant b's text waiting")
    clock.now += throttle.pause_left_s() + 0.01  # the pause is over: each wakes at its end

    assert await asyncio.wait_for(other, timeout=GUARD_S) == PROBE
    assert not batch.done()  # gives way, waiting for the probe's answer
    throttle.answered(PROBE)
    throttle.done(PROBE)
    assert await asyncio.wait_for(batch, timeout=GUARD_S) == GO


async def test_a_probe_cutting_a_tenants_pause_short_that_never_called_lets_another_do_so() -> None:
    """The pause it cut short is again no news to the other tenants, and only to them."""
    clock = Clock()
    throttle = await _one_tenants_batch_failing(clock, probes=1)
    assert await _turn_of(throttle, "b", 999) == PROBE
    throttle.done(PROBE)  # its claim was held elsewhere, say

    assert isinstance(await _turn_of(throttle, "a", 400), PutOff)
    assert await _turn_of(throttle, "c", 998) == PROBE


async def test_a_fresh_text_of_a_tenant_seen_failing_is_news_to_that_tenant_only() -> None:
    """A call running since before the pause, of a fresh text of a tenant seen failing,
    fails during a pause a text seen failing began: its tenant's other texts now wait the
    pause out, another tenant's may still cut it short."""
    clock = Clock()
    throttle = _throttle(clock, hold_s=0.5)
    _fails_of(throttle, "a", *range(TRIP_AFTER))
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, "a", 0) == PROBE
    _fails_of(throttle, "a", 0, turn=PROBE)  # a text seen failing: news to nobody
    throttle.done(PROBE)
    _fails_of(throttle, "a", 500)

    assert isinstance(await _turn_of(throttle, "a", 501), PutOff)
    assert await _turn_of(throttle, "b", 999) == PROBE


async def test_the_scorer_tells_the_throttle_the_tasks_tenant() -> None:
    clock = Clock()
    throttle = _throttle(clock, hold_s=0.5)
    down = ModelUnavailable("500 from the provider")
    for n in range(TRIP_AFTER):
        task = ScoreText(task_id=f"a-{n}", text=f"text {n}", tenant_id="a")
        await _tell_the_throttle(throttle, GO, down, task)
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, "a", hash("text 9")) == PROBE
    await _tell_the_throttle(
        throttle, PROBE, down, ScoreText(task_id="a-9", text="text 9", tenant_id="a")
    )
    throttle.done(PROBE)

    assert await _turn_of(throttle, "b", hash("another text")) == PROBE


async def test_outages_begun_and_ended_again_and_again_are_a_line_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Texts failing on their own among another tenant's healthy ones began an "outage"
    about once a second, each line followed by its "resumed" (a walkthrough: 106 lines in
    110 s, while the provider answered all along)."""
    clock = Clock()
    throttle = _throttle(clock)
    with caplog.at_level(logging.INFO, logger="scorebox.scorer.throttle"):
        for round_ in range(10):
            _fails_of(throttle, "a", *range(round_ * 10, round_ * 10 + TRIP_AFTER))
            await _probe_answered(throttle, clock, "b", 1000 + round_)
            clock.now += 1
        clock.now += PAUSE_LOG_EVERY_S
        _fails_of(throttle, "a", *range(500, 500 + TRIP_AFTER))
    lines = [record.getMessage() for record in caplog.records]
    begun = [line for line in lines if "(an outage;" in line]
    assert len(begun) == 2
    assert "10 outage(s) since the last such line" in begun[1]
    assert len([line for line in lines if line.startswith("model calls resumed")]) == 1


async def test_an_outage_whose_begin_was_logged_has_its_end_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Limited apart, an outage's begin line came a minute after the last one, its end
    line less than a minute after the last end line, and was dropped: the log ended on
    "paused" (a review)."""
    clock = Clock()
    throttle = _throttle(clock)
    began = clock.now
    with caplog.at_level(logging.INFO, logger="scorebox.scorer.throttle"):
        _fails_of(throttle, "a", *range(TRIP_AFTER))  # a first outage, ended seconds later
        for text in (100, 101, 102):
            await _probe_fails(throttle, clock, "a", text)
        await _probe_answered(throttle, clock, "b", 900)
        ended_first = clock.now
        clock.now = began + PAUSE_LOG_EVERY_S  # the next begin line is due, the end line not
        _fails_of(throttle, "a", *range(200, 200 + TRIP_AFTER))
        clock.now += throttle.pause_left_s() + 0.01
        assert clock.now < ended_first + PAUSE_LOG_EVERY_S
        assert await _turn_of(throttle, "b", 901) == PROBE
        throttle.answered(PROBE)
        throttle.done(PROBE)
    lines = [record.getMessage() for record in caplog.records]
    assert len([line for line in lines if "(an outage;" in line]) == 2
    assert len([line for line in lines if line.startswith("model calls resumed")]) == 2


class Checks:
    """A `check_provider` answering what it is told, each call counted."""

    def __init__(self, *found: ProviderCheck) -> None:
        self._found = list(found)
        self.made = 0
        self.models: list[str | None] = []

    async def __call__(self, model: str | None) -> ProviderCheck:
        self.made += 1
        self.models.append(model)
        return self._found.pop(0)


def _checking(clock: Clock, checks: Checks, *, hold_s: float = 30.0) -> ModelThrottle:
    return ModelThrottle(
        hold_s=hold_s, base_s=1.0, rng=random.Random(0), clock=clock, check_provider=checks
    )


ANSWERED = ProviderCheck(ProviderFound.ANSWERED)
STILL_DOWN = ProviderCheck(ProviderFound.UNAVAILABLE)


async def test_an_outage_only_texts_seen_failing_wait_on_is_probed_by_a_check() -> None:
    """Their calls say nothing of the provider: a batch of texts each failing on its own, the
    only calls, probed one pause after another, up to a minute apart (session 48). A check
    of the provider probes instead; answered, it ends the pause, and they all go."""
    clock, checks = Clock(), Checks(ANSWERED)
    throttle = _checking(clock, checks)
    assert _fails_of(throttle, "a", 1, 2, 3)[-1]  # an outage
    clock.now += throttle.pause_left_s() + 0.01

    turns = await asyncio.gather(*(_turn_of(throttle, "a", text) for text in (1, 2, 3)))

    assert turns == [GO, GO, GO]
    assert checks.made == 1
    assert not throttle.paused


async def test_a_check_finding_the_provider_still_down_doubles_the_pause() -> None:
    clock, checks = Clock(), Checks(STILL_DOWN, ANSWERED)
    throttle = _checking(clock, checks, hold_s=600)
    _fails_of(throttle, "a", 1, 2, 3)
    first = throttle.pause_left_s()
    clock.now += first + 0.01
    waiting = asyncio.ensure_future(_turn_of(throttle, "a", 1))

    await eventually(lambda: _checks_made(checks, 1), what="the first check")
    assert throttle.pause_left_s() > first  # doubled, within its jitter
    assert not waiting.done()
    clock.now += throttle.pause_left_s() + 0.01  # seen at the waiter's wake-up
    assert await asyncio.wait_for(waiting, GUARD_S) == GO
    assert checks.made == 2


async def _checks_made(checks: Checks, count: int) -> bool:
    return checks.made >= count


async def test_a_fresh_text_of_another_tenant_probes_with_its_own_call() -> None:
    """Its call is news of the provider, and scores its text: no check is made."""
    clock, checks = Clock(), Checks()
    throttle = _checking(clock, checks)
    _fails_of(throttle, "a", 1, 2, 3)
    clock.now += throttle.pause_left_s() + 0.01

    assert await _turn_of(throttle, "b", 4) == PROBE
    assert checks.made == 0


async def test_a_check_answered_429_turns_the_outage_into_a_rate_limits_pause() -> None:
    clock = Clock()
    checks = Checks(ProviderCheck(ProviderFound.RATE_LIMITED, retry_after_s=5))
    throttle = _checking(clock, checks, hold_s=1)
    _fails_of(throttle, "a", 1, 2, 3)
    clock.now += throttle.pause_left_s() + 0.01

    put_off = await _turn_of(throttle, "a", 1)

    assert isinstance(put_off, PutOff)
    assert put_off.left_s == pytest.approx(5)
    # A rate limit's pause: the texts' next failures start a count of their own.
    assert _fails_of(throttle, "a", 5, 6) == [False, False]
    assert checks.made == 1


async def _disproved(throttle: ModelThrottle, clock: Clock, *texts: int) -> None:
    """An outage `texts` begin, ended by a check answered."""
    assert _fails_of(throttle, "a", *texts)[-1]
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, "a", texts[0]) == GO  # the check answered


async def test_the_texts_of_an_outage_a_check_ended_tell_the_next_one() -> None:
    """A provider flapping: its texts' failures are news again once a check answered, and
    three in a row pause the calls, those calls the outage's, spending no attempt. (Taken
    for texts failing on their own at once, their calls charged and counting towards no
    outage, the tasks of a provider down again as a check answered spent every attempt
    within the retries' back-off: a review, and a walkthrough.) The calls charged before
    the first outage was told are given back at their tasks' next failures."""
    clock = Clock()
    throttle = _checking(clock, Checks(ANSWERED))
    await _disproved(throttle, clock, 1, 2, 3)

    assert _fails_of(throttle, "a", 1, 2, 3) == [True, True, True]  # given back; the outage's
    assert throttle.paused


async def test_a_call_charged_before_an_outage_was_told_is_given_back_within_the_window() -> None:
    """An outage a check ended gave its texts no probe to spend their refunds on: a task's
    call charged before the outage was told is given back at its next failure, within
    `TRIP_WINDOW_S` of the outage."""
    clock = Clock()
    throttle = _checking(clock, Checks(ANSWERED, ANSWERED))
    await _disproved(throttle, clock, 1, 2, 3)  # the calls of 1 and 2 charged
    assert _fails_of(throttle, "a", 1) == [True]
    assert _fails_of(throttle, "a", 1) == [False]  # one call given back, not two
    clock.now += TRIP_WINDOW_S
    assert _fails_of(throttle, "a", 2) == [False]  # too late


async def test_texts_of_two_outages_checks_ended_are_suspects_charged_for_their_calls() -> None:
    """A batch failing on its own, the only calls, tripped an outage every few seconds, each
    ended by a check, its calls the outages' (free): 40 such tasks were not all
    dead-lettered in ten minutes. A text seen failing in two such outages is a suspect: its
    calls are charged, and still tell the next outage (a provider down again)."""
    clock = Clock()
    throttle = _checking(clock, Checks(ANSWERED, ANSWERED))
    await _disproved(throttle, clock, 1, 2, 3)
    await _disproved(throttle, clock, 1, 2, 3)

    assert _fails_of(throttle, "a", 1, 2, 4) == [False, False, True]  # 4: the outage's
    assert throttle.paused
    assert _fails_of(throttle, "a", 3, 5) == [False, True]  # running when it began


async def _suspects(clock: Clock, *texts: int) -> ModelThrottle:
    throttle = _checking(clock, Checks(ANSWERED, ANSWERED))
    await _disproved(throttle, clock, *texts)
    await _disproved(throttle, clock, *texts)
    return throttle


async def test_a_suspect_answered_is_one_no_more() -> None:
    clock = Clock()
    throttle = await _suspects(clock, 1, 2, 3)
    throttle.answered(GO, text_key=1)
    assert _fails_of(throttle, "a", 2, 4, 1) == [False, False, True]  # 1's call the outage's


@pytest.mark.parametrize(
    ("elapsed_s", "suspect"), [(TRIP_WINDOW_S - 1, True), (TRIP_WINDOW_S, False)]
)
async def test_a_suspect_is_one_for_the_trip_window_after_its_last_outage(
    elapsed_s: float, suspect: bool
) -> None:
    clock = Clock()
    throttle = await _suspects(clock, 1, 2, 3)
    clock.now += elapsed_s
    # 1 the third in a row: it trips the outage either way, its call the outage's unless
    # a suspect's.
    assert _fails_of(throttle, "a", 4, 5, 1) == [False, False, not suspect]
    assert throttle.paused


async def test_an_outage_a_check_finds_going_on_makes_its_suspects_none() -> None:
    """A check finding the provider still down proves the outage: the outages ended before
    say nothing of its texts, whose calls are the outage's again."""
    clock = Clock()
    checks = Checks(ANSWERED, ANSWERED, STILL_DOWN)
    throttle = _checking(clock, checks)
    await _disproved(throttle, clock, 1, 2, 3)
    await _disproved(throttle, clock, 1, 2, 3)
    assert _fails_of(throttle, "a", 4, 5, 6)[-1]
    clock.now += throttle.pause_left_s() + 0.01
    waiting = asyncio.ensure_future(_turn_of(throttle, "a", 4))
    await eventually(partial(_checks_made, checks, 3), what="the check finding it down")
    waiting.cancel()

    assert _fails_of(throttle, "a", 1) == [True]  # running during the outage: its own


async def test_an_outage_a_fresh_texts_probe_finds_going_on_makes_its_suspects_none() -> None:
    clock = Clock()
    throttle = await _suspects(clock, 1, 2, 3)
    assert _fails_of(throttle, "a", 4, 5, 6)[-1]
    clock.now += throttle.pause_left_s() + 0.01
    assert await _turn_of(throttle, "b", 7) == PROBE  # a tenant not seen failing
    _fails_of(throttle, "b", 7, turn=PROBE)
    throttle.done(PROBE)

    assert _fails_of(throttle, "a", 1) == [True]


async def test_refunds_not_given_back_are_kept_through_the_next_outage() -> None:
    """Replaced at each outage, a task's refunds were lost when the next began before it
    failed again (a review)."""
    clock = Clock()
    throttle = _checking(clock, Checks(ANSWERED, ANSWERED))
    _fails_of(throttle, "a", 1)
    await _disproved(throttle, clock, 1, 2, 3)  # task-1: two calls charged before
    await _disproved(throttle, clock, 7, 8, 9)

    assert _fails_of(throttle, "a", 1, 1, 1) == [True, True, False]


async def test_refunds_last_through_a_long_outage_and_the_window_after_it() -> None:
    """Counted from its beginning, an outage probed by checks for over two minutes kept none
    (a review)."""
    clock = Clock()
    checks = Checks(STILL_DOWN, ANSWERED)
    throttle = _checking(clock, checks, hold_s=600)
    assert _fails_of(throttle, "a", 1, 2, 3)[-1]  # task-1 and task-2: charged before
    clock.now += TRIP_WINDOW_S - 1  # the outage goes on
    waiting = asyncio.ensure_future(_turn_of(throttle, "a", 1))
    await eventually(partial(_checks_made, checks, 1), what="the check finding it down")
    clock.now += throttle.pause_left_s() + 0.01  # seen at the waiter's wake-up
    assert await asyncio.wait_for(waiting, GUARD_S) == GO  # back

    clock.now += TRIP_WINDOW_S - 1
    assert _fails_of(throttle, "a", 1) == [True]
    clock.now += 1
    assert _fails_of(throttle, "a", 2) == [False]


async def test_an_outage_whose_probe_is_answered_429_logs_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The log ended on "paused": the outage over, the rate limit's pause went unsaid, its
    own line being for a pause begun while none lasted (a review)."""
    clock = Clock()
    throttle = _checking(clock, Checks(ProviderCheck(ProviderFound.RATE_LIMITED, 5)), hold_s=1)
    with caplog.at_level("INFO", logger="scorebox.scorer.throttle"):
        _fails_of(throttle, "a", 1, 2, 3)
        clock.now += throttle.pause_left_s() + 0.01
        await _turn_of(throttle, "a", 1)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert "the outage is over: the provider answered its probe 429" in messages[1]


async def test_the_check_is_of_the_model_the_waiting_delivery_calls() -> None:
    """One model down while the default answered: a check of the default ended that
    model's outage at each pause (a review)."""
    clock, checks = Clock(), Checks(ANSWERED)
    throttle = _checking(clock, checks)
    _fails_of(throttle, "a", 1, 2, 3)
    clock.now += throttle.pause_left_s() + 0.01

    waiting = throttle.wait_turn(asyncio.Event(), text_key=1, tenant_key="a", model="other-1")
    assert await asyncio.wait_for(waiting, GUARD_S) == GO
    assert checks.models == ["other-1"]


async def test_an_outages_pause_grows_to_a_quarter_of_a_rate_limits() -> None:
    """Probed by a text's first call or a one-token check, an outage is probed every 15 s at
    most: its pause doubling to a minute, a provider back after 40 s was found back after
    80 (session 48's walkthrough). A rate limit's pause still grows to `PAUSE_CAP_S`."""
    clock, checks = Clock(), Checks(*[STILL_DOWN] * 8)
    throttle = _checking(clock, checks, hold_s=600)
    _fails_of(throttle, "a", 1, 2, 3)
    pauses = []
    for made in range(1, 9):
        clock.now += throttle.pause_left_s() + 0.01
        waiting = asyncio.ensure_future(_turn_of(throttle, "a", 1))
        await eventually(partial(_checks_made, checks, made), what=f"check {made}")
        pauses.append(throttle.pause_left_s())
        waiting.cancel()

    assert max(pauses) <= OUTAGE_PAUSE_CAP_S < PAUSE_CAP_S
    assert max(pauses) > OUTAGE_PAUSE_CAP_S / 2  # grown to it
    limited = _throttle(clock)
    for _ in range(8):
        limited.rate_limited(PROBE, retry_after_s=None)
    assert limited.pause_left_s() > OUTAGE_PAUSE_CAP_S


class CheckHanging:
    """A `check_provider` whose first check never answers (until cancelled); those after it
    answer."""

    def __init__(self) -> None:
        self.made = 0
        self.in_flight = asyncio.Event()
        self.cancelled = False
        self._never = asyncio.Event()

    async def __call__(self, _model: str | None) -> ProviderCheck:
        self.made += 1
        if self.made == 1:
            self.in_flight.set()
            try:
                await self._never.wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return ANSWERED


async def test_a_stop_cuts_a_check_short_and_it_proves_nothing() -> None:
    """Waited for, a check in flight held a stopping scorer for up to `LLM_TIMEOUT_S`. Now
    the stop cancels the check and turns its delivery away at once; the pause and the
    outage stand as they were, and the next delivery's check probes again."""
    clock, checks = Clock(), CheckHanging()
    throttle = ModelThrottle(
        hold_s=600, base_s=1.0, rng=random.Random(0), clock=clock, check_provider=checks
    )
    _fails_of(throttle, "a", 1, 2, 3)
    clock.now += throttle.pause_left_s() + 0.01
    closing = asyncio.Event()
    waiting = asyncio.ensure_future(throttle.wait_turn(closing, text_key=1, tenant_key="a"))
    await asyncio.wait_for(checks.in_flight.wait(), GUARD_S)

    closing.set()

    with pytest.raises(SlotsClosed):
        await asyncio.wait_for(waiting, timeout=5)
    await eventually(partial(_cancelled, checks), what="the check cancelled")
    assert throttle.pause_left_s() == 0  # not found still down: the pause not lengthened
    assert not throttle.paused  # the probe no longer out
    assert await _turn_of(throttle, "a", 1) == GO  # not answered: the next check probes
    assert checks.made == 2


async def _cancelled(checks: CheckHanging) -> bool:
    return checks.cancelled


# A replica starting into an outage (`ModelThrottle.found_unavailable`).

START_TASK = ScoreText(task_id="t-start", text="The start's text.", model="judge-2")


def _nothing_told() -> list[tuple[float, bool]]:
    """The pauses a throttle told the other replicas of (`on_pause`): none yet."""
    return []


def _starting_checked(
    clock: Clock,
    checks: Callable[[str | None], Awaitable[ProviderCheck]] | None,
    told: list[tuple[float, bool]],
) -> ModelThrottle:
    """A replica just started, its outages' probes made by `checks`, its pauses `told`."""
    return ModelThrottle(
        hold_s=30.0,
        base_s=1.0,
        rng=random.Random(0),
        clock=clock,
        on_pause=lambda pause_s, outage: told.append((pause_s, outage)),
        check_provider=checks,
        probe_first=True,
    )


async def _start_fails(
    throttle: ModelThrottle, probe: Turn | PutOff, closing: asyncio.Event | None = None
) -> bool:
    """The start's probe finds the provider unavailable (a 503), told as the scorer tells it;
    whether its call was the outage's."""
    assert probe == PROBE
    down = ModelUnavailable("503 from the provider")
    return await _tell_the_throttle(throttle, PROBE, down, START_TASK, closing)


async def test_a_replica_starting_into_an_outage_pauses_after_its_first_call_and_a_check(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The other replicas' outage was told as it began, before this one listened: its start
    probe's 5xx let every slot through, and the calls of `TRIP_AFTER` texts, their attempts
    spent, told it. A check of the provider confirms the 5xx: the outage begins at once, the
    start's call the outage's (free, as the call beginning any outage is), the others paused
    before they call, and the other replicas told."""
    clock, checks, told = Clock(), Checks(STILL_DOWN), _nothing_told()
    throttle = _starting_checked(clock, checks, told)
    probe, others = await _start_probe_out(throttle, 4, tenant="a")

    with caplog.at_level("WARNING", logger="scorebox.scorer.throttle"):
        owned = await _start_fails(throttle, probe)
    throttle.done(PROBE)

    assert owned  # the outage's, not its task's
    assert checks.models == ["judge-2"]  # of the model its text asked for
    assert throttle.paused
    assert told == [(throttle.pause_left_s(), True)]
    assert "this scorer's first call and a check" in caplog.records[0].getMessage()
    assert await none_done(*others)

    clock.now += throttle.pause_left_s() + 0.01  # seen at their wake-up
    await eventually(lambda: _any_done(others), what="the outage's probe")
    [first] = [waiter for waiter in others if waiter.done()]
    assert first.result() == PROBE  # an outage's pause: one probe, the others wait on it
    # The start's text probing again is charged: its call was the outage's once, as the
    # call of any text beginning one is, and no call of its task was charged before.
    assert _fails(throttle, hash(START_TASK.text), turn=PROBE, task="t-start:0") == [False]
    throttle.done(PROBE)
    for waiter in others:
        waiter.cancel()


@pytest.mark.parametrize("checked", [True, False], ids=["check-answered", "no-check"])
async def test_a_start_probes_5xx_with_the_provider_up_lets_the_others_through(
    checked: bool,
) -> None:
    """A text failing on its own is no outage: the check answered (or, with none to make,
    as before it), the others go, nothing pauses, and the call is its task's."""
    clock, checks, told = Clock(), Checks(ANSWERED), _nothing_told()
    throttle = _starting_checked(clock, checks if checked else None, told)
    probe, others = await _start_probe_out(throttle, 3)

    owned = await _start_fails(throttle, probe)
    throttle.done(PROBE)

    assert not owned
    assert await asyncio.wait_for(asyncio.gather(*others), GUARD_S) == [GO, GO]
    assert not throttle.paused
    assert throttle.pause_left_s() == 0
    assert told == []
    assert checks.made == (1 if checked else 0)


async def test_a_start_probes_5xx_with_a_check_answered_429_pauses_as_its_429_would() -> None:
    clock, told = Clock(), _nothing_told()
    checks = Checks(ProviderCheck(ProviderFound.RATE_LIMITED, retry_after_s=20))
    throttle = _starting_checked(clock, checks, told)
    probe, others = await _start_probe_out(throttle, 3)

    owned = await _start_fails(throttle, probe)
    throttle.done(PROBE)

    assert not owned  # its own 5xx: the provider answered the check
    assert throttle.paused
    assert throttle.pause_left_s() == pytest.approx(20)
    [(told_s, outage)] = told
    assert told_s == pytest.approx(20)
    assert not outage  # a rate limit's pause, told as one
    assert await none_done(*others)
    for waiter in others:
        waiter.cancel()


class CheckHeld:
    """A `check_provider` answering what the test gives it, when it does."""

    def __init__(self) -> None:
        self.made = 0
        self.in_flight = asyncio.Event()
        self.answer: asyncio.Future[ProviderCheck] = asyncio.get_running_loop().create_future()

    async def __call__(self, _model: str | None) -> ProviderCheck:
        self.made += 1
        self.in_flight.set()
        return await self.answer


async def test_the_others_wait_for_a_start_probes_check_within_a_patience_of_its_own() -> None:
    """The probe's 5xx came late in its patience: the others wait for the check as for the
    probe's answer, the patience counted again from the check (a provider down answers
    both at once). A check slower than that lets them go, as a slow probe does; found down
    then, the outage begins all the same, and their calls running then are its own."""
    clock, checks, told = Clock(), CheckHeld(), _nothing_told()
    throttle = _starting_checked(clock, checks, told)
    probe, others = await _start_probe_out(throttle, 2)
    clock.now += PROBE_PATIENCE_S - 0.1  # the start's 5xx, late
    failing = asyncio.ensure_future(_start_fails(throttle, probe))
    await asyncio.wait_for(checks.in_flight.wait(), GUARD_S)

    clock.now += 0.5  # the probe out past its patience, the check within its own
    late = asyncio.ensure_future(throttle.wait_turn(asyncio.Event()))
    assert await none_done(late)  # waits for the check's answer
    clock.now += PROBE_PATIENCE_S  # the check out past its patience: seen at their wake-up
    assert await asyncio.wait_for(asyncio.gather(*others, late), GUARD_S) == [GO, GO]
    assert not throttle.paused

    checks.answer.set_result(STILL_DOWN)
    assert await asyncio.wait_for(failing, GUARD_S)  # the outage's
    throttle.done(PROBE)
    assert throttle.paused
    assert [outage for _, outage in told] == [True]
    assert _fails(throttle, 2, 3) == [True, True]  # the calls let through, running then


async def test_a_call_answered_while_a_start_probes_check_is_out_keeps_it_from_an_outage() -> None:
    """The others let through past the check's patience, one of them answered: the provider
    answers, and the check's "down" after that is no outage (any other answer starts the
    count again; the re-read of that change)."""
    clock, checks, told = Clock(), CheckHeld(), _nothing_told()
    throttle = _starting_checked(clock, checks, told)
    probe, _ = await _start_probe_out(throttle, 1)
    failing = asyncio.ensure_future(_start_fails(throttle, probe))
    await asyncio.wait_for(checks.in_flight.wait(), GUARD_S)
    clock.now += 2 * PROBE_PATIENCE_S  # the check out past its patience
    late = asyncio.ensure_future(throttle.wait_turn(asyncio.Event()))
    [other] = await asyncio.wait_for(asyncio.gather(late), GUARD_S)
    assert other == GO
    throttle.answered(GO, text_key=7)

    checks.answer.set_result(STILL_DOWN)

    assert not await asyncio.wait_for(failing, GUARD_S)  # its task's, as a text's own 5xx
    throttle.done(PROBE)
    assert not throttle.paused
    assert told == []


async def test_a_pause_heard_while_a_start_probes_check_is_out_keeps_it_from_an_outage() -> None:
    """Another replica's rate-limit pause heard meanwhile: the provider answered it, and the
    check's "down" after that begins no outage."""
    clock, checks, told = Clock(), CheckHeld(), _nothing_told()
    throttle = _starting_checked(clock, checks, told)
    probe, _ = await _start_probe_out(throttle, 1)
    failing = asyncio.ensure_future(_start_fails(throttle, probe))
    await asyncio.wait_for(checks.in_flight.wait(), GUARD_S)
    throttle.paused_elsewhere(5.0)

    checks.answer.set_result(STILL_DOWN)

    await asyncio.wait_for(failing, GUARD_S)
    throttle.done(PROBE)
    assert [outage for _, outage in told if outage] == []


async def test_a_stop_cuts_a_start_probes_check_short_and_nothing_pauses() -> None:
    """Cut short, the check says nothing of the provider: as with none to make."""
    clock, checks, told = Clock(), CheckHanging(), _nothing_told()
    throttle = _starting_checked(clock, checks, told)
    probe, others = await _start_probe_out(throttle, 2)
    closing = asyncio.Event()
    failing = asyncio.ensure_future(_start_fails(throttle, probe, closing))
    await asyncio.wait_for(checks.in_flight.wait(), GUARD_S)

    closing.set()

    assert not await asyncio.wait_for(failing, GUARD_S)
    throttle.done(PROBE)
    assert checks.cancelled
    assert await asyncio.wait_for(asyncio.gather(*others), GUARD_S) == [GO]
    assert not throttle.paused
    assert told == []


async def test_once_started_a_5xx_makes_no_check() -> None:
    """Only the start's probe is confirmed: once started, one text's 5xx is one in a row, as
    ever, and needs no call of the provider to say so."""
    clock, checks, told = Clock(), Checks(), _nothing_told()
    throttle = _starting_checked(clock, checks, told)
    start = await asyncio.wait_for(throttle.wait_turn(asyncio.Event()), GUARD_S)
    assert start == PROBE
    throttle.answered(start, text_key=1)
    throttle.done(start)
    turn = await asyncio.wait_for(throttle.wait_turn(asyncio.Event()), GUARD_S)
    assert turn == GO

    down = ModelUnavailable("503 from the provider")
    assert not await _tell_the_throttle(throttle, turn, down, START_TASK)

    assert checks.made == 0
    assert not throttle.paused
    assert told == []
