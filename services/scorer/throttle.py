"""Rate-limit pauses: after the provider answers 429, this process starts no model call until
the pause ends, and then one call (a probe) before all the others. The provider found
unavailable by the calls of `TRIP_AFTER` texts in a row (a 5xx, a refused connection, no
answer in time: `unavailable`) pauses the calls the same way, as a circuit breaker does.

Without it, a provider's rate limit of a few seconds met every model slot of every scorer at
full speed: each 429 came back at once, the slot took the next delivery, and every task
consumed while the limit lasted spent its attempts in seconds and was dead-lettered, though
the provider recovered moments later. A pause is the provider's `Retry-After` when it gives
one, or a back-off that doubles with each 429 in a row (jittered, up to `PAUSE_CAP_S`; an
outage's up to `OUTAGE_PAUSE_CAP_S`).
Deliveries wait for their turn in their model slot, before their claim (the lease counts
from the call); one whose wait would end more than `hold_s` after it began, pause after pause
or waiting on the probe's answer, is put off down the wait ladder instead (`PutOff`), back
in hand shortly before the pause ends (`back_in_s`), so that no delivery is held near
RabbitMQ's consumer timeout. When the pause ends, one call goes
first: its answer ends the pause for all, a 429 starts the next.

Calls already running when a 429 comes back are not stopped: their own answers count as they
come. A pause begun while none lasted is told to the other replicas (`on_pause`, see
`services/scorer/shared_pauses.py`), and one they tell of pauses this one as long
(`paused_elsewhere`), its end probed here as after a pause of its own: a rate limit is the
provider account's, and without it each replica spent a round of 429s, all its model slots'
worth, learning it. The longer pauses of a probe answered 429 are not told: by then each
replica is paused and spends one probe per pause, whatever the others learn.

An unavailable provider spends the attempts of the calls it fails (unlike a 429's), so
without a pause an outage longer than the retries' back-off (about 14 s with the defaults)
failed every task consumed during it, each after its four attempts, though the provider came
back moments later (a self-hosted model restarting). With the pause, the calls stop once
those of `TRIP_AFTER` texts in a row found it unavailable (any other answer between them
starts the count again, so a provider failing now and then is not paused, nor is one failing
a single text, however many tasks hold it), and the probes that find it still down spend no
attempt (the scorer counts them as it counts a 429's, within `RATE_LIMIT_RETRIES`), on every
replica: an outage's pause is told to the others as one. Texts failing on their own look
like an outage too; the probe goes to a text not seen failing when one waits (of a tenant not
seen failing first), and one arriving during a pause that only such texts' probes began
probes at once, as does one of another tenant during a pause that only fresh texts of tenants
seen failing began (`_may_cut_short`). While another tenant is active, the deliveries that
may not cut such a pause short give way: put off at once, back shortly before it ends
(`_gives_way`). When only texts, or tenants, seen failing wait, a check of the provider that
is no text's call probes instead (`check_provider`, `_checks_first`).

A replica starting calls the model once, alone, before the others (`probe_first`): a pause
of the other replicas, announced before it listened, is found so. A 429 pauses the rest; a
5xx is confirmed by a check of the provider first (`found_unavailable`): found down too, the
outage begins at once, told to the others, rather than after the calls of `TRIP_AFTER` texts
let through; answered, the text failed on its own, and the others go.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

from services.scorer.slots import SlotsClosed
from shared.backoff import capped_exponential_s, jittered_s
from shared.log_rate import Tally

log = logging.getLogger("scorebox.scorer.throttle")

PAUSE_BASE_S = 1.0
# Texts whose calls found the provider unavailable in a row, no other answer between them,
# that pause the calls (an outage); failures further apart than the window are not in a row.
TRIP_AFTER = 3
TRIP_WINDOW_S = 120.0
PAUSE_CAP_S = 60.0
# An outage's pauses grow to a quarter of that at most: its probe is a text's first call,
# free, or a check of one token, and a provider back after 40 s was found back 80 s in, a
# probe just before its recovery having doubled the pause (session 48's walkthrough).
OUTAGE_PAUSE_CAP_S = 15.0
# A steady rate limit pauses the calls every second or so: its pauses are logged once a
# minute at most, each line with how many there were.
PAUSE_LOG_EVERY_S = 60.0
# The longest `Retry-After` a pause honours; longer hints are for the task's retry (the
# scorer's `MAX_RETRY_AFTER_S`), the pause puts its deliveries off.
MAX_PAUSE_S = 3600.0
# How long the others wait for the answer of a rate limit's probe: a provider still limiting
# answers 429 at once, so a probe not answered by then is being scored, and the limit is
# over. Waited for in full, one slow or hung text taken as the probe held every other call
# of the scorer for up to `hold_s` (30 s) after a 1 s pause (a walkthrough).
PROBE_PATIENCE_S = 2.0
# The share of `hold_s` within which a delivery giving way (`_gives_way`) is back in hand
# before the pause ends: a sixth, so that it is down the ladder for most of the pause, and
# the deliveries behind it in the queue reach a model slot.
GIVING_WAY_SHARE = 1 / 6
# The least time a delivery giving way spends down the ladder: put off for less, it came
# straight back (the ladder's shortest wait is 0.5 s) and was put off again (a review).
GIVING_WAY_LEAST_S = 1.0
# The outages a text is seen failing in, each ended by a probe's answer, that make it a
# suspect (`_is_suspect`): a batch of texts each failing on its own is each such outage's.
SUSPECT_AFTER = 2


@dataclass(frozen=True)
class Turn:
    """Leave to call the model; `probe`: the first call after a pause."""

    probe: bool = False


# The two turns there are, made once: every model call asks for one.
GO = Turn()
PROBE = Turn(probe=True)


class Unproven(Enum):
    """Whom a pause begun by a probe is no news of the provider to (`_may_cut_short`)."""

    TO_OTHER_TEXTS = "texts"  # its text was seen failing in the outage
    TO_OTHER_TENANTS = "tenants"  # a fresh text, but of a tenant seen failing in it


@dataclass(frozen=True)
class PutOff:
    """The pause outlasts what a delivery may wait in hand: send it down the wait ladder.
    `giving_way`: it gives way to other tenants' deliveries (`_gives_way`)."""

    left_s: float
    giving_way: bool = False


class ProviderFound(Enum):
    """What a check of the provider (`ProviderCheck`) found."""

    ANSWERED = "answered"  # any answer but a 429: the provider is up
    RATE_LIMITED = "rate_limited"
    UNAVAILABLE = "unavailable"  # a 5xx, a refused connection, no answer in time


@dataclass(frozen=True)
class ProviderCheck:
    found: ProviderFound
    retry_after_s: float | None = None


# A call of the provider that is no text's, of the model named (None: the default), from
# `services/scorer/provider_checks.py`.
CheckProvider = Callable[[str | None], Awaitable[ProviderCheck]]


class ModelThrottle:
    def __init__(
        self,
        *,
        hold_s: float = 30.0,
        base_s: float = PAUSE_BASE_S,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_pause: Callable[[float, bool], object] = lambda _pause_s, _outage: None,
        check_provider: CheckProvider | None = None,
        probe_first: bool = False,
    ) -> None:
        self.hold_s = hold_s
        self._base_s = base_s
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self._clock = clock
        self._paused_until = 0.0
        self._rate_limits_in_a_row = 0
        # The texts whose calls found the provider unavailable in a row, and when; and the
        # tasks whose calls did, when last and how many.
        self._unavailable: dict[int, float] = {}
        self._tasks_found_down: dict[str, tuple[float, int]] = {}
        # The tenants of those texts, and when last (`_tenants_seen_failing` once an outage).
        self._tenants_found_down: dict[str, float] = {}
        # The pause is an outage's: until a probe is answered, or the pause is forgotten as
        # stale (kept past that on a replica idle since, an outage made a single text's 5xx
        # at its next call the outage's: free, and pausing everyone).
        self._outage = False
        # The texts whose calls the outage took for its own, once each: the one that began
        # it, and each probe's that found the provider still down (one text failing every
        # time, its retries the probes of a quiet pause, kept an outage going, free).
        self._outage_texts: set[int] = set()
        # The calls of each task charged to it before the outage could be told (three texts
        # were needed), or running when it began: as many of its probes are the outage's
        # too. A task submitted first, its retries failing while the next texts arrived,
        # spent its attempts before and during the outage (a fault test under load). By
        # task, not text: a text's calls over its many tasks (and hours) made one task's
        # probes free twenty times (a review of the first version). Kept past the outage,
        # until `_refunds_until`: an outage a check ended gave its texts no probe to spend
        # them on, and a provider flapping dead-lettered tasks with the calls charged before
        # each of its outages was told (`_refunded`).
        self._refunds: Counter[str] = Counter()
        self._refunds_until = 0.0
        self._probe_out_when_it_began = False
        # Another replica's outage heard while this one's probe was out: that probe's answer
        # does not end it (the other's news may be the newer).
        self._outage_heard_while_probing = False
        # The texts seen failing since the outage began (those of the calls that began it
        # too), and the texts of the deliveries waiting for their turn: a probe goes to a
        # text not seen failing when one waits (`_may_probe`).
        self._seen_failing: set[int] = set()
        # The tenants of the texts seen failing since the outage began: a fresh text of one of
        # them failing says nothing of the provider to the other tenants (`_may_cut_short`).
        self._tenants_seen_failing: set[str] = set()
        self._waiting: Counter[tuple[int | None, str | None]] = Counter()
        # When each tenant's delivery last waited for its turn (`_gives_way`).
        self._tenants_active: dict[str, float] = {}
        self._tenants_pruned_at = clock()
        self._probe_due = False  # a pause ended and no call has answered since
        # Whom the outage's pause is no news to, when a probe that says nothing new of the
        # provider began it: one of a text seen failing in it (the other texts), or a fresh
        # text of a tenant seen failing (the other tenants). A delivery of theirs may probe
        # before its end, once (`_may_cut_short`); and what the probe out cut short.
        self._unproven: Unproven | None = None
        self._cut_short_of: Unproven | None = None
        # A probe cutting the pause short is out, and whether news of the provider came
        # since it went (a 429, another replica's pause): its answer ends the pause unless
        # some did. Not a comparison of the pause's ends: a call running since before the
        # pause, failing meanwhile, lengthened it, and the healthy answer was thrown away
        # (a review).
        self._cut_short_out = False
        self._news_since_cut = False
        self._probe_out = False  # the probe's call is running
        self._probe_sent_at = 0.0
        self._rate_limit_pauses = Tally(PAUSE_LOG_EVERY_S, clock)
        self._outage_probes = Tally(PAUSE_LOG_EVERY_S, clock)
        self._outages_begun = Tally(PAUSE_LOG_EVERY_S, clock)
        # Whether the outage's begin line was written: its end line is then written too,
        # and an outage whose begin line was not, ends unsaid (counted in the next).
        self._outage_begin_logged = False
        self._outages_ended_unsaid = 0
        self._changed = asyncio.Event()
        # Called with its length when a pause begins while none lasted, and whether it is an
        # outage's (also when a pause lasting turns into an outage's).
        self._on_pause = on_pause
        # The outage's probe when no text that would be news waits (`_checks_first`).
        self._check_provider = check_provider
        # For each text seen failing in outages a probe's answer ended since it was last
        # answered: how many, and when the last ended (`_is_suspect`).
        self._disproven: dict[int, tuple[int, float]] = {}
        # Starting, the first call goes alone, as a pause's probe: the other replicas may be
        # paused since before this one started, and it did not hear of it (a pause is
        # announced as it begins). Every slot called at once, and a provider's rate limit
        # answered a round of 429s as wide as the slots, each counted against the account
        # (a walkthrough, at each restart of a replica during a limit). A 429 pauses the
        # rest before they call; a 5xx (or no answer in time) is confirmed by a check of the
        # provider while they wait, and found down too begins an outage
        # (`found_unavailable`); any other answer lets them through, and so does its
        # patience running out (`PROBE_PATIENCE_S`). Counted from the first delivery.
        self._starting = self._probe_due = probe_first  # its time: the first `wait_turn`
        # Calls answered so far (`answered`): a start probe's check confirms an outage only
        # if none was meanwhile (`found_unavailable`).
        self._answers = 0

    def back_in_s(self, put_off: PutOff, rng: random.Random) -> float:
        """How long a delivery put off waits down the ladder: until the pause has between a
        half and nine tenths of `hold_s` left, so that it is back in hand, waiting, when the
        probe is chosen. Brought back after the pause's end, it came second to the retries of
        the texts failing on their own, due at that very end, and their probes went on while
        it was put off again, pause after pause (a walkthrough). One giving way comes back
        within `GIVING_WAY_SHARE` of the hold before the end."""
        hold_s = self.hold_s * (GIVING_WAY_SHARE if put_off.giving_way else 1.0)
        return max(0.0, put_off.left_s - hold_s * rng.uniform(0.5, 0.9))

    def pause_left_s(self) -> float:
        return max(0.0, self._paused_until - self._clock())

    @property
    def waiting(self) -> int:
        """The deliveries waiting for their turn now."""
        return self._waiting.total()

    @property
    def paused(self) -> bool:
        """Whether calls are held back now: a pause lasts, or its probe's answer is awaited.
        (`_probe_due` alone stayed true on a replica idle since a pause, which then showed
        as paused for as long as it had no call to make.)"""
        return (
            self._probe_due and not self._starting and (self.pause_left_s() > 0 or self._probe_out)
        )

    async def wait_turn(
        self,
        closing: asyncio.Event,
        *,
        text_key: int | None = None,
        tenant_key: str | None = None,
        model: str | None = None,
    ) -> Turn | PutOff:
        """Wait until a model call of the text `text_key` (of the tenant `tenant_key`, to the
        model `model`, None for the default) may start, for `hold_s` at most in all;
        `SlotsClosed` when the scorer stops meanwhile.
        Bounding each pause alone held a delivery for ever with `hold_s` above the longest
        back-off (`PAUSE_CAP_S`): pause after pause while the limit lasted, until RabbitMQ's
        consumer timeout closed the channel."""
        waiter = (text_key, tenant_key)
        self._waiting[waiter] += 1
        try:
            now = self._clock()
            if self._starting and not self._paused_until:
                # From the first delivery, not the construction: a start that waited for its
                # broker or database past `TRIP_WINDOW_S` had its probe forgotten (re-read).
                self._paused_until = now
            if tenant_key is not None:
                self._note_active(tenant_key, now)
            return await self._turn_within(now + self.hold_s, closing, waiter, model)
        finally:
            self._waiting[waiter] -= 1
            if not self._waiting[waiter]:
                del self._waiting[waiter]
            if self._probe_due:
                self._notify()  # one that gave way to it may probe now

    async def _turn_within(
        self,
        held_until: float,
        closing: asyncio.Event,
        waiter: tuple[int | None, str | None],
        model: str | None,
    ) -> Turn | PutOff:
        text_key, tenant_key = waiter
        self._forget_a_stale_pause()
        while True:
            if closing.is_set():
                raise SlotsClosed
            left = self.pause_left_s()
            hold_left = held_until - self._clock()
            if left > 0 and self._may_cut_short(text_key, tenant_key):
                return self._cut_short()
            if left > 0 and hold_left > 0 and self._cut_short_answer_awaited(text_key):
                await self._until_changed(closing, timeout_s=hold_left)
                continue
            if left > 0 and (left > hold_left or self._gives_way(text_key, tenant_key, left)):
                return PutOff(left, giving_way=left <= hold_left)
            if left > 0:
                await self._until_changed(closing, timeout_s=left)
            elif not self._probe_due:
                return GO
            elif not self._probe_out and self._may_probe(waiter):
                if self._check_provider is not None and self._checks_first(waiter):
                    await self._probe_by_check(self._check_provider, model, closing)
                    continue
                self._probe_sent()
                return PROBE
            elif self._rate_limit_probe_unanswered_s() >= PROBE_PATIENCE_S:
                return self._past_patience()
            elif hold_left <= 0:
                return PutOff(0.0)  # the probe's answer is late: back of the queue
            else:
                patience_left = PROBE_PATIENCE_S - self._rate_limit_probe_unanswered_s()
                # The probe's answer, or the end of the patience a rate limit's probe is given.
                await self._until_changed(closing, timeout_s=min(hold_left, patience_left))

    def _checks_first(self, waiter: tuple[int | None, str | None]) -> bool:
        """Whether the outage is probed by a check of the provider (`check_provider`) rather
        than by this delivery's call: its text, or its tenant, was seen failing, and the
        delivery is the best probe there is (`_may_probe`). Such a text's call says nothing
        of the provider: with no other traffic, a batch of texts each failing on its own was
        taken for an outage, and their calls, one per pause of up to a minute shared by them
        all, would have taken an hour or more to spend their attempts (session 48's
        walkthrough). A check answered ends the pause for all."""
        return self._outage and self._probe_rank(waiter) < 2

    async def _probe_by_check(
        self, check_provider: CheckProvider, model: str | None, closing: asyncio.Event
    ) -> None:
        """The outage's probe, made by a call of the provider that is no text's, to the
        waiting delivery's model: one model down while the default answered, a check of the
        default ended that model's outage at each pause, its tasks' calls failing again (a
        review). Waited for as a text's probe is, the check's own timeout bounding it; a stop
        of the scorer cuts it short, and a check cut short proves nothing (waited for, a stop
        took up to `LLM_TIMEOUT_S`)."""
        self._probe_sent()
        try:
            check = await _unless_closing(check_provider(model), closing)
            if check is None:
                return
            match check.found:
                case ProviderFound.ANSWERED:
                    self.answered(PROBE)
                case ProviderFound.RATE_LIMITED:
                    self.rate_limited(PROBE, check.retry_after_s)
                case ProviderFound.UNAVAILABLE:
                    self._still_unavailable(check.retry_after_s)
        finally:
            self.done(PROBE)

    def _still_unavailable(self, retry_after_s: float | None) -> None:
        """A check found the provider still down: news of it, to every text and tenant. The
        outage is proven: the outages ended before it say nothing of its texts
        (`_disproven`)."""
        self._disproven.clear()
        self._unproven = None
        self._news_since_cut = True
        self._lengthen(PROBE, retry_after_s)
        self._log_outage_going_on()

    def _gives_way(self, text_key: int | None, tenant_key: str | None, left_s: float) -> bool:
        """Whether this delivery is put off at once, to come back shortly before the pause
        ends (`GIVING_WAY_SHARE` of the hold), rather than held in hand up to `hold_s`: the
        pause is one it may not cut short (its text, or its tenant, seen failing in an
        unproven pause), and a tenant not seen failing, whose deliveries may, was active
        within `TRIP_WINDOW_S`. Held the whole hold, a tenant's batch of texts each failing
        on its own kept every model slot and the prefetch for the last half minute of each
        pause, and another tenant's texts, which would have ended it, waited about 45 s
        behind them in the queue (`python -m devtools.poison_batch`, session 47). With no
        such tenant (a single tenant's outage) nobody is given way to: put off at once, its
        whole backlog went down the ladder and back in each pause of 5 to 30 s, which
        before it waited out in the queue (a review)."""
        if self._unproven is None or self._pause_is_no_news_to(text_key, tenant_key):
            return False
        share_s = self.hold_s * GIVING_WAY_SHARE
        return left_s - 0.9 * share_s >= GIVING_WAY_LEAST_S and self._another_tenant_active(
            besides=tenant_key
        )

    def _note_active(self, tenant_key: str, now: float) -> None:
        """A delivery of `tenant_key` waits for its turn; tenants idle for `TRIP_WINDOW_S`
        are forgotten, at most once per window."""
        self._tenants_active[tenant_key] = now
        if now - self._tenants_pruned_at >= TRIP_WINDOW_S:
            self._tenants_active = {
                tenant: at
                for tenant, at in self._tenants_active.items()
                if now - at < TRIP_WINDOW_S
            }
            self._tenants_pruned_at = now

    def _another_tenant_active(self, *, besides: str | None) -> bool:
        """Whether a tenant not seen failing, other than `besides`, had a delivery wait for
        its turn within `TRIP_WINDOW_S`: one whose deliveries may cut an unproven pause
        short. Not the delivery's own: a tenant's text another tenant failed first cannot
        cut the pause short, and it gave way to its own tenant (a review)."""
        now = self._clock()
        return any(
            now - at < TRIP_WINDOW_S and tenant not in self._tenants_seen_failing
            for tenant, at in self._tenants_active.items()
            if tenant != besides
        )

    def _rate_limit_probe_unanswered_s(self) -> float:
        """How long the probe of a rate limit's pause has been out unanswered; 0 for an
        outage's, whose probe is waited for (a provider that does not answer in time is
        down, and each call sent to it would spend its task's attempt)."""
        if not self._probe_out or self._outage:
            return 0.0
        return self._clock() - self._probe_sent_at

    def _may_cut_short(self, text_key: int | None, tenant_key: str | None) -> bool:
        """Whether this delivery may probe before the pause ends: the pause is unproven
        (begun by a probe of a text seen failing in the outage) and its text is not seen
        failing. Three texts failing on their own were taken for an outage, and their
        retries, the only calls of a quiet pause, probed it pause after pause, doubling it up
        to a minute, while a healthy task submitted meanwhile waited (92 s and over 200 s in
        a walkthrough). Their failures say nothing of the provider, but they do keep their
        own tasks' retries apart in a real outage, so they still double the pause (holding it
        at its length instead failed every task of a quiet outage within the retries'
        back-off: a review). One such probe per unproven pause: in a real outage it fails,
        and the pause it begins is proven.

        The same between tenants: a pause begun by a fresh text of a tenant seen failing in the
        outage is no news to the other tenants, and a delivery of one not seen failing may
        cut it short. A batch of 60 texts each failing on its own, all fresh, proved the
        outage 60 times, doubling the pause to a minute, and another tenant's 100 healthy
        texts finished after 152 and 209 s (session 46's walkthrough). In a real outage each
        tenant's first delivery so probes once, and fails: its tenant is seen failing too. A
        single tenant's pauses are never cut short so: its tenant is seen failing."""
        return not self._probe_out and self._pause_is_no_news_to(text_key, tenant_key)

    def _pause_is_no_news_to(self, text_key: int | None, tenant_key: str | None) -> bool:
        """Whether the pause is unproven to this delivery: a probe of it would be news."""
        if text_key is None or text_key in self._seen_failing:
            return False
        if self._unproven is Unproven.TO_OTHER_TEXTS:
            return True
        return (
            self._unproven is Unproven.TO_OTHER_TENANTS
            and tenant_key is not None
            and tenant_key not in self._tenants_seen_failing
        )

    def _cut_short_answer_awaited(self, text_key: int | None) -> bool:
        """Whether this delivery waits in hand for the answer of a probe cutting the pause
        short, its text not seen failing either: put off down the ladder, a burst of healthy
        tasks came back half a minute later though the probe was answered in two seconds (a
        review)."""
        if not self._cut_short_out or not self._probe_out or text_key is None:
            return False
        return text_key not in self._seen_failing

    def _probe_sent(self) -> None:
        self._probe_out, self._probe_sent_at = True, self._clock()

    def _cut_short(self) -> Turn:
        self._probe_sent()
        self._cut_short_of, self._unproven = self._unproven, None
        self._cut_short_out = True
        self._news_since_cut = False
        return PROBE

    def _may_probe(self, waiter: tuple[int | None, str | None]) -> bool:
        """Whether this delivery may be the probe: none waiting ranks above it. A text not
        seen failing since the outage began ranks above one seen failing, and among those a
        tenant not seen failing above one seen failing. A text failing on its own says
        nothing of the provider: three such texts were taken for an outage, and their
        retries, due at each pause's end, probed pause after pause, doubling it, while every
        other task waited for minutes (found in an acceptance run); and a batch of texts
        failing on their own, all fresh, probed one after another (session 46's
        walkthrough)."""
        rank = self._probe_rank(waiter)
        return all(self._probe_rank(other) <= rank for other in self._waiting)

    def _probe_rank(self, waiter: tuple[int | None, str | None]) -> int:
        text_key, tenant_key = waiter
        if text_key in self._seen_failing:
            return 0
        if tenant_key is None or tenant_key in self._tenants_seen_failing:
            return 1
        return 2

    def _forget_a_stale_pause(self) -> None:
        """A pause over for `TRIP_WINDOW_S` with no probe since (the replica idle) is
        forgotten: its probe would say nothing of it, and one text's own 5xx at the next
        call would lengthen a pause long over, and everyone's wait with it."""
        stale = self._clock() - self._paused_until > TRIP_WINDOW_S
        if self._outage and not self._probe_due:
            self._end_outage()  # an outage is a pause's: none lasts
        if self._probe_due and not self._probe_out and stale:
            self._probe_due = self._starting = False
            self._rate_limits_in_a_row = 0
            self._end_outage()

    def rate_limited(self, turn: Turn, retry_after_s: float | None) -> None:
        """A call came back 429: pause, or lengthen the pause. The back-off grows with each
        pause in a row (a probe answered 429), not with each call that was running when the
        limit came: those all come back 429 at once."""
        self._forget_a_stale_pause()
        self._forget_failures()  # the provider answers: no run of calls finding it down
        self._unproven = None  # its limit is news: a `Retry-After` stands
        self._news_since_cut = True
        if turn.probe:
            if self._outage:
                self._log_outage_over(rate_limited=True)
            self._end_outage()  # a rate limit's pause from now on
            self._cut_short_out = False
        first = not self._probe_due or self._starting
        self._starting = False
        self._lengthen(turn, retry_after_s)
        if first:
            self._log_rate_limit_pause()
            self._on_pause(self.pause_left_s(), False)

    def _log_outage_going_on(self) -> None:
        """The outage's probe found the provider still down: the pause is longer now. Only
        its beginning was logged, and a pause that went on for minutes read as 0.6 s (found
        in a walkthrough); a line at most once per `PAUSE_LOG_EVERY_S`, whatever the outages
        (counted afresh for each, a provider down and up every few seconds wrote one with each
        outage, and the log ended on "stay paused", the line of an outage whose begin line was
        not written: a walkthrough). An outage with a line written has its end line too."""
        probes = self._outage_probes.count()
        if probes is None:
            return
        self._outage_begin_logged = True
        log.warning(
            "model calls stay paused for %.1f s: the outage's probe found the provider still "
            "unavailable (%d probe(s) since the last such line)",
            self.pause_left_s(),
            probes,
        )

    def _log_outage_begun(self, *, confirmed: bool = False) -> None:
        """Once a `PAUSE_LOG_EVERY_S` at most, with the count: texts failing on their own
        among another tenant's healthy ones began an "outage" about once a second, each
        line followed by its "resumed" (a walkthrough: 106 lines in 110 s). `confirmed`: a
        start's probe and a check told it (`found_unavailable`), not three texts."""
        outages = self._outages_begun.count()
        self._outage_begin_logged = outages is not None
        if outages is None:
            return
        told_by = (
            "this scorer's first call and a check of it"
            if confirmed
            else f"the calls of {TRIP_AFTER} texts in a row"
        )
        log.warning(
            "model calls paused for %.1f s: the provider found unavailable by %s (an outage; "
            "one probe at the pause's end; %d outage(s) since the last such line)",
            self.pause_left_s(),
            told_by,
            outages,
        )

    def _log_outage_over(self, *, rate_limited: bool = False) -> None:
        """The end of an outage whose begin line was written, with the ends unsaid since:
        limited apart, one outage's begin line was written and its end line dropped, the
        log ending on "paused" (a review). Its probe answered 429 (`rate_limited`), the log
        ended on "paused" as well, the rate limit's pause going unsaid (a review)."""
        self._outages_ended_unsaid += 1
        if not self._outage_begin_logged:
            return
        ended, self._outages_ended_unsaid = self._outages_ended_unsaid, 0
        self._outage_begin_logged = False
        if rate_limited:
            log.warning(
                "the outage is over: the provider answered its probe 429; model calls stay "
                "paused for %.1f s, a rate limit's pause (%d outage(s) ended since the last "
                "such line)",
                self.pause_left_s(),
                ended,
            )
            return
        log.info(
            "model calls resumed: the provider answered the outage's probe (%d outage(s) "
            "ended since the last such line)",
            ended,
        )

    def _log_rate_limit_pause(self) -> None:
        pauses = self._rate_limit_pauses.count()
        if pauses is None:
            # A pause that outlasts the next line's due time is logged all the same: a
            # Retry-After of two minutes within a minute of the last line stopped every
            # call unlogged (a walkthrough).
            if self.pause_left_s() < PAUSE_LOG_EVERY_S:
                return
            pauses = self._rate_limit_pauses.report()
        log.warning(
            "model calls paused for %.1f s: the provider answered 429 (%d pause(s) since the "
            "last such line)",
            self.pause_left_s(),
            pauses,
        )

    def _lengthen(self, turn: Turn, retry_after_s: float | None) -> None:
        if turn.probe or not self._probe_due:
            self._rate_limits_in_a_row += 1
        # At 0 in a row (a call running when another replica's pause was heard): the base.
        cap_s = OUTAGE_PAUSE_CAP_S if self._outage else PAUSE_CAP_S
        backoff = capped_exponential_s(self._rate_limits_in_a_row, base_s=self._base_s, cap_s=cap_s)
        self._pause_for(max(jittered_s(backoff, self._rng), min(retry_after_s or 0.0, MAX_PAUSE_S)))

    def unavailable(
        self,
        turn: Turn,
        retry_after_s: float | None,
        *,
        text_key: int,
        task_key: str,
        tenant_key: str | None = None,
    ) -> bool:
        """A call found the provider unavailable, or got no answer in time (its text's key
        `text_key`): an outage once the calls of `TRIP_AFTER` texts in a row did, within
        `TRIP_WINDOW_S` (texts, not tasks or calls: one text the provider fails every time,
        scored as several tasks, its retries the only calls of a quiet hour, would pause
        everyone's); the calls pause as after a 429, or a pause lasting (a 429's, another
        replica's) turns into an outage's. A probe's call, or one running during a pause,
        lengthens it; a probe doubles it. A probe of a text seen failing in this outage
        already says nothing new of the provider (its text is not `fresh`): the pause it
        begins is unproven, and a delivery of a text not seen failing may cut it short
        (`_may_cut_short`); so does one of a fresh text of a tenant (`tenant_key`) seen
        failing in it, to the other tenants. True when the call is the outage's rather than
        its task's: it began the outage, or probed one and found the provider still down."""
        return self._call_found_down(
            turn, retry_after_s, text_key=text_key, task_key=task_key, tenant_key=tenant_key
        )

    async def found_unavailable(
        self,
        turn: Turn,
        retry_after_s: float | None,
        *,
        text_key: int,
        task_key: str,
        tenant_key: str | None = None,
        model: str | None = None,
        closing: asyncio.Event | None = None,
    ) -> bool:
        """`unavailable`, a start's probe first confirmed by a check of the provider that is
        no text's (`check_provider`, of the call's `model`). A replica starting into an
        outage the others knew of (told as it began, before this one listened) let every slot
        through at its probe's 5xx, and learnt it from `TRIP_AFTER` texts, spending their
        attempts (the gap the start probe left). The check found it down too: the outage
        begins at once, the start's call its own as the call that begins one is, and told to
        the others; answered (the text failed on its own, or the check was cut short by a
        stop), all goes on as `unavailable` says; answered 429, the start pauses as on its
        probe's 429. The others wait for the check as for the probe's answer, its patience
        (`PROBE_PATIENCE_S`) counted afresh: a provider down answers both at once. A start
        whose patience ran out before its probe failed is over: no check."""
        confirmed, check = False, None
        if self._check_provider is not None and self._start_probe_out(turn):
            answers = self._answers
            self._probe_sent_at = self._clock()
            check = await _unless_closing(self._check_provider(model), closing or asyncio.Event())
            # Only while nothing else was learnt meanwhile: a call answered (which starts the
            # count again), a pause begun (the re-read of this change).
            confirmed = (
                check is not None
                and check.found is ProviderFound.UNAVAILABLE
                and self._answers == answers
                and not self._outage
                and self.pause_left_s() <= 0
            )
        owned = self._call_found_down(
            turn,
            _longest(retry_after_s, check.retry_after_s) if confirmed and check else retry_after_s,
            text_key=text_key,
            task_key=task_key,
            tenant_key=tenant_key,
            confirmed=confirmed,
        )
        if check is not None and check.found is ProviderFound.RATE_LIMITED:
            self.rate_limited(PROBE, check.retry_after_s)
        return owned

    def _start_probe_out(self, turn: Turn) -> bool:
        """Whether `turn` is the start's probe, out, the start not over (no pause since, its
        patience not run out)."""
        return (
            turn.probe
            and self._starting
            and self._probe_out
            and not self._outage
            and self.pause_left_s() <= 0
        )

    def _call_found_down(
        self,
        turn: Turn,
        retry_after_s: float | None,
        *,
        text_key: int,
        task_key: str,
        tenant_key: str | None,
        confirmed: bool = False,
    ) -> bool:
        """`unavailable`; `confirmed`: a check found the provider down too, and the call
        begins an outage unless one lasts (`found_unavailable`)."""
        self._forget_a_stale_pause()
        suspect = self._is_suspect(text_key)
        probed_an_outage = (
            not suspect and turn.probe and self._outage and self._probe_is_free(text_key, task_key)
        )
        fresh = text_key not in self._seen_failing  # news of the provider, in an outage
        # News to the other tenants too (a call of no known tenant is taken for news to all).
        tenant_fresh = tenant_key is None or tenant_key not in self._tenants_seen_failing
        was_on = self._outage
        began = not was_on and (
            self._in_a_row(text_key, task_key, tenant_key) >= TRIP_AFTER or confirmed
        )
        # Running when the outage began (started before it): the outage's. Charged and
        # refunded by a later probe, it failed a task on its last attempt all the same.
        running_when_it_began = was_on and not turn.probe
        refunded = not (
            suspect or began or probed_an_outage or running_when_it_began
        ) and self._refunded(task_key)
        if began:
            self._outage, self._outage_texts = True, {text_key}
            self._seen_failing = set(self._unavailable)
            self._tenants_seen_failing = set(self._tenants_found_down)
            self._refund_the_calls_before()
            self._refunds[task_key] -= 1  # this call: the outage's already
            self._probe_out_when_it_began = self._probe_out
            if confirmed:
                self._disproven.clear()  # proven by the check, as `_still_unavailable` says
        if self._outage:
            self._seen_failing.add(text_key)
            if tenant_key is not None:
                self._tenants_seen_failing.add(tenant_key)
        if self._starting and turn.probe and not began and self.pause_left_s() <= 0:
            self._started()  # a start's probe failing says nothing of a pause
        elif began or self._probe_due:
            self._lengthen(turn, retry_after_s)
        if turn.probe:
            self._unproven = self._unproven_by(fresh=fresh, tenant_fresh=tenant_fresh)
            self._cut_short_out = False
        elif fresh and (tenant_fresh or self._unproven is None):
            self._unproven = None  # a call running since before, of another text
        elif fresh:
            self._unproven = Unproven.TO_OTHER_TENANTS  # of another text of a tenant seen failing
        if was_on and turn.probe:
            if fresh and tenant_fresh:
                self._disproven.clear()  # a probe that is news proves the outage
            self._log_outage_going_on()
        if began:
            self._log_outage_begun(confirmed=confirmed)
            self._on_pause(self.pause_left_s(), True)
        return not suspect and (began or probed_an_outage or running_when_it_began or refunded)

    def _refunded(self, task_key: str) -> bool:
        """Whether a call of the task is given back one charged before an outage was told
        (`_refunds`), within `TRIP_WINDOW_S` of the outage's end (counted from its
        beginning, an outage probed by checks for longer kept none: a review)."""
        if self._clock() >= self._refunds_until:
            self._refunds.clear()
            return False
        if self._refunds[task_key] <= 0:
            return False
        self._refunds[task_key] -= 1
        return True

    def _is_suspect(self, text_key: int) -> bool:
        """Whether the text was seen failing in `SUSPECT_AFTER` outages a probe's answer ended
        (the last within `TRIP_WINDOW_S`), and not answered since: its calls are charged to
        its task, though they count towards an outage as any text's do. A batch of texts each
        failing on its own, the only calls, tripped an outage every few seconds, each ended by
        a check; their calls, each the outage's, spent only free calls, and 40 such tasks
        were not all dead-lettered in ten minutes (`python -m devtools.poison_batch`). Taken
        for suspects after one such outage, and their failures counting towards none, the
        tasks of a provider down again as a check answered spent every attempt within the
        retries' back-off (a review, and a walkthrough: 8 to 13 of 60 healthy tasks
        dead-lettered); now a second outage must be ended so too, and a suspect's failure
        still trips the next, paying an attempt for the calls under way when it does."""
        disproven = self._disproven.get(text_key)
        if disproven is None:
            return False
        outages, last_at = disproven
        return outages >= SUSPECT_AFTER and self._clock() - last_at < TRIP_WINDOW_S

    def _disproved(self) -> None:
        """A probe's answer ends the outage: each text seen failing in it is counted
        (`_disproven`), and texts counted longer than `TRIP_WINDOW_S` ago are forgotten."""
        now = self._clock()
        self._disproven = {
            text: (outages, at)
            for text, (outages, at) in self._disproven.items()
            if now - at < TRIP_WINDOW_S
        }
        for text in self._seen_failing:
            outages, _ = self._disproven.get(text, (0, now))
            self._disproven[text] = (outages + 1, now)

    def _unproven_by(self, *, fresh: bool, tenant_fresh: bool) -> Unproven | None:
        """Whom the pause a probe found the provider still down in is no news to."""
        if not self._outage:
            return None
        if not fresh:
            return Unproven.TO_OTHER_TEXTS
        return None if tenant_fresh else Unproven.TO_OTHER_TENANTS

    def _probe_is_free(self, text_key: int, task_key: str) -> bool:
        """Whether a probe of the text `text_key` (task `task_key`) that found the provider
        still down is the outage's: a text's first, and one more for each call of the task
        charged before the outage began (`_refunds`). Not more: one text failing every time,
        its retries the probes of a quiet pause, kept an outage going for free. A probe out
        when the outage began (a 429's) is the outage's too."""
        if self._probe_out_when_it_began:
            self._probe_out_when_it_began = False
            return True
        if text_key not in self._outage_texts:
            self._outage_texts.add(text_key)
            return True
        if self._refunds[task_key] > 0:
            self._refunds[task_key] -= 1
            return True
        return False

    def _refund_the_calls_before(self) -> None:
        """An outage begins: the calls charged in the run that told it become refunds, added
        to those of the outages before not yet given back (replaced, a task's refunds of one
        outage were lost at the next, begun before it failed again: a review)."""
        now = self._clock()
        if now >= self._refunds_until:
            self._refunds.clear()
        self._refunds.update({task: calls for task, (_, calls) in self._tasks_found_down.items()})
        self._refunds_until = now + TRIP_WINDOW_S  # and again from its end (`_end_outage`)
        self._forget_failures()

    def _forget_failures(self) -> None:
        self._unavailable.clear()
        self._tasks_found_down.clear()
        self._tenants_found_down.clear()

    def _end_outage(self) -> None:
        if self._outage:
            self._refunds_until = self._clock() + TRIP_WINDOW_S
        self._outage = False
        self._unproven = None
        self._outage_texts.clear()
        self._probe_out_when_it_began = False
        self._seen_failing.clear()
        self._tenants_seen_failing.clear()
        self._outage_heard_while_probing = False

    def _in_a_row(self, text_key: int, task_key: str, tenant_key: str | None) -> int:
        """The texts whose calls found the provider unavailable in a row, this one's
        included, within `TRIP_WINDOW_S` (and the task's calls that did, counted; and their
        tenants)."""
        now = self._clock()
        self._unavailable = {
            key: at for key, at in self._unavailable.items() if now - at < TRIP_WINDOW_S
        }
        self._tasks_found_down = {
            task: (at, calls)
            for task, (at, calls) in self._tasks_found_down.items()
            if now - at < TRIP_WINDOW_S
        }
        self._tenants_found_down = {
            tenant: at
            for tenant, at in self._tenants_found_down.items()
            if now - at < TRIP_WINDOW_S
        }
        self._unavailable[text_key] = now
        if tenant_key is not None:
            self._tenants_found_down[tenant_key] = now
        _, calls = self._tasks_found_down.get(task_key, (now, 0))
        self._tasks_found_down[task_key] = (now, calls + 1)
        return len(self._unavailable)

    def paused_elsewhere(self, pause_s: float, *, outage: bool = False) -> bool:
        """Another replica calling the same provider was answered 429 (or found it down:
        `outage`) and pauses `pause_s` more: pause as long, then probe. False when this
        process's pause already lasts as long (it heard of the limit itself, or from another
        replica first); an outage is taken for one all the same, so that the probes here
        that find the provider still down are the outage's too."""
        self._forget_a_stale_pause()
        longer = self._clock() + min(pause_s, MAX_PAUSE_S) > self._paused_until
        self._unproven = None  # the other replica's news, longer or not
        self._news_since_cut = True
        if longer:
            self._pause_for(pause_s)
        if outage:
            if not self._outage:  # this replica's run of failures: charged before it was told
                self._seen_failing = set(self._unavailable)
                self._tenants_seen_failing = set(self._tenants_found_down)
                self._refund_the_calls_before()
            self._outage = True
            self._outage_heard_while_probing = self._probe_out
        elif longer:
            self._end_outage()  # the provider answered the other replica: a rate limit
        return longer

    def _pause_for(self, pause_s: float) -> None:
        self._paused_until = max(self._paused_until, self._clock() + min(pause_s, MAX_PAUSE_S))
        self._probe_due, self._starting = True, False  # a pause of its own now
        self._notify()

    def answered(self, turn: Turn, *, text_key: int | None = None) -> None:
        """A call (of the text `text_key`) came back with anything but a 429. The probe's
        answer ends the pause, unless another replica's pause heard meanwhile outlasts it
        (then another probe follows that one); a call started before the pause says nothing
        of it. A text answered is no suspect (`_is_suspect`)."""
        self._answers += 1
        self._forget_failures()
        if text_key is not None:
            self._disproven.pop(text_key, None)
        if turn.probe:
            self._starting = False
            if self._cut_short_out and not self._news_since_cut:
                self._paused_until = min(self._paused_until, self._clock())
            self._cut_short_out = False
            self._probe_due = self.pause_left_s() > 0
            if not self._probe_due and self._outage:
                self._log_outage_over()
            # An outage heard meanwhile stands while its pause does; the answer ends any other.
            if not (self._outage_heard_while_probing and self._probe_due):
                self._disproved()
                self._end_outage()
            self._rate_limits_in_a_row = 0
            self._notify()
        elif not self._probe_due:
            self._rate_limits_in_a_row = 0

    def done(self, turn: Turn) -> None:
        """The turn is over, whether or not it called the model (a claim held elsewhere, a
        database error): a probe that did not answer lets another delivery probe."""
        if turn.probe and self._probe_out:
            if self._cut_short_out:  # it never called: another may cut short, unless news
                self._unproven = (
                    self._cut_short_of if self._outage and not self._news_since_cut else None
                )
                self._cut_short_of = None
                self._cut_short_out = False
            self._probe_out = False
            self._outage_heard_while_probing = False
            self._probe_out_when_it_began = False
            self._notify()

    def _past_patience(self) -> Turn:
        """No 429 back at once: the limit is over (`PROBE_PATIENCE_S`). A start's slow first
        answer ends the start: its others' calls are calls, not a pause's probes."""
        if self._starting:
            self._started()
        return GO

    def _started(self) -> None:
        self._starting = self._probe_due = False
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until_changed(self, closing: asyncio.Event, *, timeout_s: float | None) -> None:
        await _unless_closing(self._changed.wait(), closing, timeout_s=timeout_s)


def _longest(*waits_s: float | None) -> float | None:
    """The longest of the `Retry-After`s given; None when none is."""
    given = [wait_s for wait_s in waits_s if wait_s is not None]
    return max(given) if given else None


async def _unless_closing[T](
    work: Awaitable[T], closing: asyncio.Event, *, timeout_s: float | None = None
) -> T | None:
    """What `work` gives; None, `work` cancelled, when the scorer stops first or `timeout_s`
    passes."""
    working = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait(
            {working, stopping}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        return working.result() if working.done() else None
    finally:
        working.cancel()
        stopping.cancel()
