"""A service's clock is the database's as last measured, advanced by a clock that no step of
the wall clock moves: a scorer whose wall clock was stepped ahead while it ran took over
another replica's live claim (a re-read)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from shared import clock_offset
from shared.clock_offset import ANCHOR_TOLERANCE_S, ClockWatch, DatabaseClock

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


class Machine:
    """A wall clock that can be stepped and a tick count that only moves on."""

    def __init__(self) -> None:
        self.wall = T0
        self.ticks = 1_000.0

    def run(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.ticks += seconds


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Machine:
    machine = Machine()
    monkeypatch.setattr(clock_offset, "wall_clock", lambda: machine.wall)
    return machine


def test_unmeasured_it_reads_the_wall_clock(machine: Machine) -> None:
    clock = DatabaseClock(ticks=lambda: machine.ticks)
    assert clock() == T0
    machine.run(3)
    assert clock() == T0 + timedelta(seconds=3)


def test_measured_it_reads_the_databases_time_and_runs_on(machine: Machine) -> None:
    clock = DatabaseClock(ticks=lambda: machine.ticks)
    clock.anchor(offset_s=2.0)  # the database's clock 2 s ahead of this machine's
    assert clock() == T0 + timedelta(seconds=2)
    machine.run(30)
    assert clock() == T0 + timedelta(seconds=32)


def test_a_step_of_the_wall_clock_moves_nothing(machine: Machine) -> None:
    clock = DatabaseClock(ticks=lambda: machine.ticks)
    clock.anchor(offset_s=0.0)
    machine.wall += timedelta(seconds=5)  # NTP stepped it, a VM resumed
    machine.run(1)
    assert clock() == T0 + timedelta(seconds=1)
    clock.anchor(offset_s=-5.0)  # the next measure finds the step: the same time
    assert clock() == T0 + timedelta(seconds=1)


def test_a_measure_within_its_error_keeps_the_clock_as_it_runs(machine: Machine) -> None:
    clock = DatabaseClock(ticks=lambda: machine.ticks)
    clock.anchor(offset_s=0.0)
    clock.anchor(offset_s=ANCHOR_TOLERANCE_S / 2)  # a measure's own error: no jitter
    assert clock() == T0
    clock.anchor(offset_s=1.0)  # the database's clock moved: followed
    assert clock() == T0 + timedelta(seconds=1)


@pytest.mark.parametrize(("max_offset_s", "kept"), [(5.0, T0), (0.0, T0 + timedelta(hours=1))])
def test_a_watch_anchors_its_services_clock_unless_the_check_is_off(
    machine: Machine, max_offset_s: float, kept: datetime
) -> None:
    """`MAX_CLOCK_OFFSET_S` 0 is how an operator says the database host's clock alone is off:
    followed, every time a client reads or sends (`not_before`) would be off with it."""
    clock = DatabaseClock(ticks=lambda: machine.ticks)
    watch = ClockWatch(
        cast(Any, None),  # measures are handed in here, not taken
        max_offset_s=max_offset_s,
        service="test",
        registry=CollectorRegistry(),
        keeping=clock,
    )
    machine.wall += timedelta(hours=1)
    watch.observe(-3600.0)
    assert clock() == kept
