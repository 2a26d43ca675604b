"""A service's clock is the database's as last measured, advanced by a clock that no step of
the wall clock moves: a scorer whose wall clock was stepped ahead while it ran took over
another replica's live claim (a re-read)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from shared import clock_offset
from shared.clock_offset import ANCHOR_TOLERANCE_S, ClockWatch, DatabaseClock, Measure

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


class Machine:
    """A wall clock that can be stepped and a tick count that only moves on."""

    def __init__(self) -> None:
        self.wall = T0
        self.ticks = 1_000.0

    def run(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.ticks += seconds

    def clock(self) -> DatabaseClock:
        return DatabaseClock(ticks=lambda: self.ticks)

    def measure(self, offset_s: float, *, round_trip_s: float = 0.002) -> Measure:
        """The database's clock found `offset_s` ahead of the wall clock now."""
        server = self.wall + timedelta(seconds=offset_s)
        return Measure(server, self.wall, self.ticks, round_trip_s)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Machine:
    machine = Machine()
    monkeypatch.setattr(clock_offset, "wall_clock", lambda: machine.wall)
    return machine


def test_unmeasured_it_reads_the_wall_clock(machine: Machine) -> None:
    clock = machine.clock()
    assert clock() == T0
    machine.run(3)
    assert clock() == T0 + timedelta(seconds=3)


def test_measured_it_reads_the_databases_time_and_runs_on(machine: Machine) -> None:
    clock = machine.clock()
    clock.anchor(machine.measure(2.0))  # the database's clock 2 s ahead of this machine's
    assert clock() == T0 + timedelta(seconds=2)
    machine.run(30)
    assert clock() == T0 + timedelta(seconds=32)


def test_a_step_of_the_wall_clock_moves_nothing(machine: Machine) -> None:
    clock = machine.clock()
    clock.anchor(machine.measure(0.0))
    machine.wall += timedelta(seconds=5)  # NTP stepped it, a VM resumed
    machine.run(1)
    assert clock() == T0 + timedelta(seconds=1)
    clock.anchor(machine.measure(-5.0))  # the next measure finds the step: the same time
    assert clock() == T0 + timedelta(seconds=1)


def test_a_measure_within_its_error_keeps_the_clock_as_it_runs(machine: Machine) -> None:
    """Half a round trip is a measure's error, a busy event loop's time included: taken
    for the database's, a 0.4 s lag moved the clock by 0.2 s, and the next measure moved it
    back (a re-read)."""
    clock = machine.clock()
    clock.anchor(machine.measure(0.0))
    clock.anchor(machine.measure(ANCHOR_TOLERANCE_S / 2))
    clock.anchor(machine.measure(0.2, round_trip_s=0.4))
    assert clock() == T0
    clock.anchor(machine.measure(1.0))  # the database's clock moved: followed
    assert clock() == T0 + timedelta(seconds=1)


def test_a_step_of_the_databases_clock_is_followed_at_the_next_measure(
    machine: Machine,
) -> None:
    """Refused past `MAX_CLOCK_OFFSET_S`, as once built, a step split the fleet for good
    where one machine's wall clock agreed with it and another's did not (a re-read):
    followed, replicas differ by it only until each has measured again."""
    clock = machine.clock()
    clock.anchor(machine.measure(0.0))
    clock.anchor(machine.measure(3600.0))
    assert clock() == T0 + timedelta(hours=1)
    clock.anchor(machine.measure(0.0))  # and back
    assert clock() == T0


def test_a_clock_a_paused_vm_left_behind_is_set_right(machine: Machine) -> None:
    """A VM its host paused counts no ticks meanwhile: its clock fell a minute behind, and
    refused as the database's step, it stayed there for good, this scorer's leases short in
    every other's eyes (a re-read). The next measure sets it right."""
    clock = machine.clock()
    clock.anchor(machine.measure(0.0))
    machine.wall += timedelta(seconds=60)  # paused a minute; the wall clock set right after
    clock.anchor(machine.measure(0.0))
    assert clock() == T0 + timedelta(seconds=60)


def test_a_first_measure_off_by_more_than_the_maximum_is_set_right(machine: Machine) -> None:
    """Its first measure slow (a cold start under load), the clock was anchored 1.4 s off,
    and every later, better measure was refused as a step past a 1 s maximum (a re-read)."""
    clock = machine.clock()
    clock.anchor(machine.measure(1.4, round_trip_s=3.0))
    clock.anchor(machine.measure(0.0))
    assert clock() == T0


@pytest.mark.parametrize(("max_offset_s", "kept"), [(5.0, T0), (0.0, T0 + timedelta(hours=1))])
def test_a_watch_anchors_its_services_clock_unless_the_check_is_off(
    machine: Machine, max_offset_s: float, kept: datetime
) -> None:
    """`MAX_CLOCK_OFFSET_S` 0 is how an operator says the database host's clock alone is off:
    followed, every time a client reads or sends (`not_before`) would be off with it."""
    clock = machine.clock()
    watch = _watch(clock, max_offset_s=max_offset_s)
    machine.wall += timedelta(hours=1)
    watch.measured(machine.measure(-3600.0))
    assert clock() == kept


def _watch(clock: DatabaseClock, *, max_offset_s: float) -> ClockWatch:
    return ClockWatch(
        cast(Any, None),  # measures are handed in here, not taken
        max_offset_s=max_offset_s,
        service="test",
        registry=CollectorRegistry(),
        keeping=clock,
    )
