"""A service's clock against its database's, checked at start-up.

Replicas judge each other's records by their own clocks: the outbox sweep takes a submission
older than `OUTBOX_GRACE_S` for one its request left (and sends it), a keyed replay takes an
earlier request for one still running while it is young, scorers take over a claim whose
lease has run out, and the scheduler's runs and leases are dated the same way. A replica
whose clock ran 90 s behind the others' had its requests' records, still being refused
("nothing was kept"), swept and scored by another replica (a review). A service therefore
compares its wall clock with the database server's (`hello`'s `localTime`, the mid-point of
the round trip taken for its own time) and refuses to start when they differ by more than
`MAX_CLOCK_OFFSET_S`, as CockroachDB refuses a node whose clock is past its maximum offset;
a smaller offset over `WARN_CLOCK_OFFSET_S` is logged.

While it runs, the service measures the offset again every `CLOCK_RECHECK_S` (`ClockWatch`):
a clock that drifts after the start (NTP stopped, a VM resumed) is exported as the gauge
`scorebox_clock_offset_seconds` and logged when it crosses either bound. It does not stop
the service: measured against one server, a database host whose clock alone drifted would
stop every replica at once, where an alert on the gauge or the error line lets an operator
see which clock it is.

Nor does such a drift make a replica misjudge the others' records: a service keeps time by
the database's clock (`DatabaseClock`), as each measure found it, advanced since by a clock
that no step of the wall clock moves. Checked only at the start, a scorer whose wall clock
was stepped 5 s ahead while it ran took over another replica's live claim, and the model was
called twice for one task (a re-read, shown with two scorers and a 3 s lease).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from shared.contracts import utcnow

log = logging.getLogger("scorebox.clock")
# This machine's clock, not a service's injected one (tests run services on clocks of their
# own); a module attribute so that a test can set it back or ahead.
wall_clock: Callable[[], datetime] = utcnow

WARN_CLOCK_OFFSET_S = 1.0
# How often a running service measures the offset again: also how long replicas may keep
# time apart after a step of the database's clock, each following it at its next measure.
CLOCK_RECHECK_S = 5.0
# While the offset stays past the maximum, how often its error line is repeated.
OFFSET_RELOG_S = 600.0
# A level of the offset is left downwards only below this share of its bound.
CALMER_SHARE = 0.8


# A measure moves the database clock only when it finds it this far off, beyond the
# measure's own error (half its round trip, which includes any time the event loop was
# busy): re-anchored at every one, the clock would jitter, and go back now and then.
ANCHOR_TOLERANCE_S = 0.05
# Round trips taken per measure; the shortest one's reading is kept (the least error).
MEASURE_SAMPLES = 3


def ticks_s() -> float:
    """Seconds on a clock that no step of the wall clock moves; counting the time a machine
    that suspended itself slept where the platform tells it (Linux's `CLOCK_BOOTTIME`). A VM
    its host paused counts nothing meanwhile: the next measure sets it right
    (`DatabaseClock.anchor`)."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.monotonic()


@dataclass(frozen=True)
class Measure:
    """The database server's time (`server`) at the mid-point of a round trip, with this
    machine's wall clock (`wall`) and `ticks_s` there, and the round trip's length."""

    server: datetime
    wall: datetime
    ticks: float
    round_trip_s: float

    @property
    def offset_s(self) -> float:
        """How far the server's clock is ahead of the wall clock (negative: behind)."""
        return (self.server - self.wall).total_seconds()


class DatabaseClock:
    """The database server's time, as this process last measured it (`anchor`, by its
    `ClockWatch`), advanced since by `ticks`; the wall clock until a first measure (a
    database that does not tell its time leaves it there). A service's clock: a step of
    this machine's wall clock while the service runs moves nothing the service judges."""

    def __init__(self, *, ticks: Callable[[], float] = ticks_s) -> None:
        self.ticks = ticks
        self._anchor: tuple[datetime, float] | None = None

    def __call__(self) -> datetime:
        if self._anchor is None:
            return wall_clock()
        return self._at(self.ticks())

    def _at(self, ticks: float) -> datetime:
        assert self._anchor is not None
        anchored_at, ticked = self._anchor
        return anchored_at + timedelta(seconds=ticks - ticked)

    def anchor(self, measure: Measure) -> None:
        """Take `measure` (its `ticks` read on this clock's `ticks`): the first always; a
        later one when it finds this clock further off than its own error and
        `ANCHOR_TOLERANCE_S`, whatever the distance. Refusing a step of the database's clock
        past `MAX_CLOCK_OFFSET_S`, as once built, split the fleet for good wherever one
        machine's wall clock agreed with the step and another's did not, and left a VM its
        host paused (no ticks counted meanwhile) behind for good (its re-read, simulated):
        followed, replicas differ by a step only until each has measured again, within
        `CLOCK_RECHECK_S` of each other."""
        if self._anchor is not None:
            drift_s = abs(self.off_by_s(measure))
            if drift_s <= ANCHOR_TOLERANCE_S + measure.round_trip_s / 2:
                return
        self._anchor = (measure.server, measure.ticks)

    def off_by_s(self, measure: Measure) -> float:
        """How far `measure` finds this clock behind the database's (0 before a first)."""
        if self._anchor is None:
            return 0.0
        return (measure.server - self._at(measure.ticks)).total_seconds()


class ClockNotTold(Exception):
    """The server's answer to `hello` carries no `localTime` (a stand-in or proxy of
    another kind): nothing to compare with."""


class ClockOffsetTooLarge(RuntimeError):
    """The service's clock is further from the database's than `MAX_CLOCK_OFFSET_S`."""


async def measure_clock(
    client: AsyncMongoClient[Any],
    *,
    now: Callable[[], datetime] | None = None,
    ticks: Callable[[], float] = ticks_s,
    samples: int = MEASURE_SAMPLES,
) -> Measure:
    """The database server's clock against this machine's (`now`, the wall clock; `ticks`),
    by `hello`'s `localTime`: of `samples` round trips, the shortest one's reading, to
    within half of it and the millisecond `localTime` keeps. The wall clock, not a
    service's injected one: tests run services on clocks of their own."""
    now = now or wall_clock
    best: Measure | None = None
    for _ in range(samples):
        wall_before, ticks_before = now(), ticks()
        answer = await client.admin.command("hello")
        wall_after, ticks_after = now(), ticks()
        server = answer.get("localTime")
        if not isinstance(server, datetime):
            raise ClockNotTold(f"the server's `hello` gave no localTime: {server!r}")
        if server.tzinfo is None:
            server = server.replace(tzinfo=UTC)
        round_trip_s = ticks_after - ticks_before
        if best is None or round_trip_s < best.round_trip_s:
            wall = wall_before + (wall_after - wall_before) / 2
            best = Measure(server, wall, ticks_before + round_trip_s / 2, round_trip_s)
    assert best is not None, "no sample taken"
    return best


async def clock_offset_s(
    client: AsyncMongoClient[Any], *, now: Callable[[], datetime] | None = None
) -> float:
    """How far the database server's clock is ahead of this process's wall clock (`now`;
    negative: behind), as `measure_clock` finds it."""
    return (await measure_clock(client, now=now)).offset_s


def check_clock_offset(offset_s: float, *, max_offset_s: float, service: str) -> None:
    """`ClockOffsetTooLarge` past `max_offset_s` (0: not checked), a warning past
    `WARN_CLOCK_OFFSET_S`."""
    if max_offset_s <= 0:
        return
    if abs(offset_s) > max_offset_s:
        raise ClockOffsetTooLarge(
            f"{service}'s clock is {_words(offset_s)} the database server's, more than "
            f"MAX_CLOCK_OFFSET_S ({max_offset_s:g} s), so it does not start: one of the two "
            "machines is misconfigured. Synchronise their clocks (NTP); should the database "
            "host's clock alone be off, MAX_CLOCK_OFFSET_S=0 on every replica at once has "
            "each service keep its own clock"
        )
    if abs(offset_s) > WARN_CLOCK_OFFSET_S:
        _warn_of(offset_s, max_offset_s=max_offset_s, service=service)


async def check_clock(
    client: AsyncMongoClient[Any],
    *,
    max_offset_s: float,
    service: str,
    ticks: Callable[[], float] = ticks_s,
) -> Measure | None:
    """Measure the offset and check it (`check_clock_offset`); logged as an error first when
    it stops the service, for the operator reading the service's log. The measure, or None
    when it was not taken."""
    if max_offset_s <= 0:
        return None
    try:
        measure = await measure_clock(client, ticks=ticks)
    except (PyMongoError, ClockNotTold) as error:  # it just answered the start-up's writes
        log.warning("%s: its clock not checked against the database's: %r", service, error)
        return None
    try:
        check_clock_offset(measure.offset_s, max_offset_s=max_offset_s, service=service)
    except ClockOffsetTooLarge as refused:
        log.error("%s", refused)  # noqa: TRY400 - the reason, not a traceback of ours
        raise
    return measure


class ClockWatch:
    """The offset measured again every `interval_s` (`CLOCK_RECHECK_S`) while the service
    runs (module docstring). Built with the service, so that its gauge is registered once;
    `checked()` takes the start-up's measure, `start()` is the start's last step (a start
    that fails before it leaves nothing running), `stop()` the stop's. With
    `MAX_CLOCK_OFFSET_S` 0 it still measures and exports, and logs nothing: the gauge is
    what tells the operator whose clock is off. The gauge is NaN until measured and while
    measuring fails (0 read as "in step")."""

    def __init__(
        self,
        client: AsyncMongoClient[Any],
        *,
        max_offset_s: float,
        service: str,
        registry: CollectorRegistry,
        interval_s: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        keeping: Callable[[], datetime] | None = None,
    ) -> None:
        self._client = client
        # The service's clock, anchored at each measure when it is the database's; not with
        # the check off (0), which is how an operator says the database host's clock is off.
        self._keeping = keeping if isinstance(keeping, DatabaseClock) and max_offset_s > 0 else None
        self._max_offset_s = max_offset_s
        self._service = service
        self._interval_s = CLOCK_RECHECK_S if interval_s is None else interval_s
        self._monotonic = monotonic
        self._level = 0  # 0 within the warning bound, 1 past it, 2 past the maximum
        self._last_error_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self.offset = Gauge(
            "scorebox_clock_offset_seconds",
            "The database server's clock minus this process's wall clock, as last measured "
            "(positive: this clock is behind); measured every 5 s, NaN while it cannot be.",
            registry=registry,
        )
        self.offset.set(math.nan)

    @property
    def ticks(self) -> Callable[[], float]:
        """What the service's clock counts by: the one its measures are read on."""
        return self._keeping.ticks if self._keeping is not None else ticks_s

    def checked(self, measure: Measure | None) -> None:
        """The start-up's measure, which `check_clock` logged (None: not taken)."""
        if measure is not None:
            self.offset.set(measure.offset_s)
            self._level = self._level_of(measure.offset_s)
            if self._keeping is not None:
                self._keeping.anchor(measure)

    def measured(self, measure: Measure) -> None:
        """A measure while the service runs: exported and logged (`observe`), and taken by
        the service's clock."""
        self.observe(measure.offset_s)
        if self._keeping is not None:
            self._keeping.anchor(measure)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._keep_measuring())

    async def stop(self) -> None:
        """Cancel the measuring; never raises what the task did (a stop goes on to close the
        clients)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})

    async def _keep_measuring(self) -> None:
        while True:
            try:
                self.measured(await measure_clock(self._client, ticks=self.ticks))
            except (PyMongoError, ClockNotTold) as error:  # the database's own trouble
                self.offset.set(math.nan)
                log.debug("%s: its clock not measured: %r", self._service, error)
            except Exception as error:  # noqa: BLE001 - the watch must outlive any answer
                self.offset.set(math.nan)
                log.warning("%s: its clock not measured: %r", self._service, error)
            await asyncio.sleep(self._interval_s)

    def _level_of(self, offset_s: float) -> int:
        """0 within `WARN_CLOCK_OFFSET_S`, 1 past it, 2 past the maximum; a level is left
        downwards only below `CALMER_SHARE` of its bound, so that an offset hovering at one
        logs once, not at every other measure."""
        size = abs(offset_s)
        level = 2 if size > self._max_offset_s else int(size > WARN_CLOCK_OFFSET_S)
        if level >= self._level:
            return level
        bound = self._max_offset_s if self._level == 2 else WARN_CLOCK_OFFSET_S
        return level if size < CALMER_SHARE * bound else self._level

    def observe(self, offset_s: float) -> None:
        """Export `offset_s`; log it when it crosses a bound, or back within them, and
        while it stays past the maximum again every `OFFSET_RELOG_S` (an offset held at its
        level by the hysteresis, within the maximum now, is not called past it)."""
        self.offset.set(offset_s)
        if self._max_offset_s <= 0:
            return
        level = self._level_of(offset_s)
        now = self._monotonic()
        past_the_maximum = abs(offset_s) > self._max_offset_s
        if past_the_maximum and (
            self._level < 2
            or self._last_error_at is None
            or now - self._last_error_at >= OFFSET_RELOG_S
        ):
            self._last_error_at = now
            log.error(
                "%s's clock is %s the database server's, more than MAX_CLOCK_OFFSET_S (%g s), "
                "while it runs: synchronise the clocks (NTP), whichever is off (every service "
                "reporting the same offset points at the database host's)",
                self._service,
                _words(offset_s),
                self._max_offset_s,
            )
        elif level == 1 and self._level != 1:
            _warn_of(offset_s, max_offset_s=self._max_offset_s, service=self._service)
        elif level == 0 and self._level != 0:
            log.info(
                "%s's clock is back within %g s of the database server's",
                self._service,
                WARN_CLOCK_OFFSET_S,
            )
        self._level = level


def _warn_of(offset_s: float, *, max_offset_s: float, service: str) -> None:
    log.warning(
        "%s's clock is %s the database server's (MAX_CLOCK_OFFSET_S: %g s)",
        service,
        _words(offset_s),
        max_offset_s,
    )


def _words(offset_s: float) -> str:
    """The offset from this clock's side: the server ahead means this clock is behind."""
    return f"{abs(offset_s):.1f} s {'behind' if offset_s > 0 else 'ahead of'}"
