"""The jobs a scheduler runs for its cron deliveries, at its stop (`CronRunsInHand`)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from services.scheduler.dispatcher import run_command_for
from services.scheduler.errors import PermanentJobError
from services.scheduler.in_hand import CronRunsInHand, CutShort
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.runs import Finished, GiveUp, RetryPolicy, RunDecision, run_cron_job
from tests.unit.test_scheduler_dispatch import FakeFirings
from tests.unit.test_usage_meter_permanent_errors import NOW


def _in(seconds: float) -> float:
    """Event-loop time `seconds` from now."""
    return asyncio.get_running_loop().time() + seconds


async def _ends_when(released: asyncio.Event, started: asyncio.Event | None = None) -> RunDecision:
    if started is not None:
        started.set()
    await released.wait()
    return Finished({"ended": True})


async def test_a_job_that_ends_within_the_grace_keeps_its_decision() -> None:
    in_hand = CronRunsInHand()
    released = asyncio.Event()
    started = asyncio.Event()
    running = asyncio.create_task(in_hand.run(_ends_when(released, started)))
    await started.wait()
    stopping = asyncio.create_task(in_hand.cut_short_by(_in(30), hand_back_by=_in(30)))
    released.set()
    assert await stopping == 0
    assert await running == Finished({"ended": True})


async def test_a_job_still_running_after_the_grace_is_cut_short() -> None:
    in_hand = CronRunsInHand()
    started = asyncio.Event()
    running = asyncio.create_task(in_hand.run(_ends_when(asyncio.Event(), started)))
    await started.wait()
    assert await in_hand.cut_short_by(_in(0), hand_back_by=_in(0)) == 1
    with pytest.raises(CutShort):
        await running


async def test_a_job_taken_after_the_stop_began_is_cut_short_unstarted() -> None:
    in_hand = CronRunsInHand()
    await in_hand.cut_short_by(_in(0), hand_back_by=_in(0))
    released = asyncio.Event()
    released.set()
    with pytest.raises(CutShort):
        await in_hand.run(_ends_when(released))


async def test_a_delivery_cancelled_otherwise_is_cancelled_not_cut_short() -> None:
    """A consumer's own cancellation (its channel closed) is no stop's: it propagates."""
    in_hand = CronRunsInHand()
    started = asyncio.Event()
    running = asyncio.create_task(in_hand.run(_ends_when(asyncio.Event(), started)))
    await started.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


class FinishAnsweredLate(FakeFirings):
    """The firings, the answer to the write of a run's end held back until released."""

    def __init__(self) -> None:
        super().__init__()
        self.finishing = asyncio.Event()
        self.answer = asyncio.Event()

    async def finish(self, run_id: str, **kwargs: Any) -> bool:
        applied = await super().finish(run_id, **kwargs)
        self.finishing.set()
        await self.answer.wait()
        return applied


async def test_a_stop_does_not_cut_short_a_decision_being_recorded() -> None:
    """Cut short while its give-up was written, the delivery was handed back: the copy found
    the run failed and was dropped, and the run had no dead letter to replay."""
    firings = FinishAnsweredLate()
    firing = await firings.claim("rollup", NOW, now=NOW, owner="a")
    assert firing is not None
    in_hand = CronRunsInHand()

    async def broken(run: JobRun) -> JobOutcome:
        raise PermanentJobError("configuration missing")

    deciding = asyncio.create_task(
        run_cron_job(
            run_command_for(firing),
            handlers={"rollup": broken},
            firings=firings,
            retry=RetryPolicy(3, timedelta(seconds=5), timedelta(minutes=10)),
            clock=lambda: NOW,
            in_hand=in_hand,
        )
    )
    await firings.finishing.wait()
    assert await in_hand.cut_short_by(_in(0), hand_back_by=_in(0)) == 0
    firings.answer.set()
    assert isinstance(await deciding, GiveUp)
