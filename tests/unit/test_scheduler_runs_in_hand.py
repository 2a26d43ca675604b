"""The jobs a scheduler runs for its cron deliveries, at its stop (`CronRunsInHand`)."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.consumer import CronRunsInHand, CutShort
from services.scheduler.runs import Finished, RunDecision


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
    stopping = asyncio.create_task(in_hand.cut_short_after(30))
    released.set()
    assert await stopping == 0
    assert await running == Finished({"ended": True})


async def test_a_job_still_running_after_the_grace_is_cut_short() -> None:
    in_hand = CronRunsInHand()
    started = asyncio.Event()
    running = asyncio.create_task(in_hand.run(_ends_when(asyncio.Event(), started)))
    await started.wait()
    assert await in_hand.cut_short_after(0) == 1
    with pytest.raises(CutShort):
        await running


async def test_a_job_taken_after_the_stop_began_is_cut_short_unstarted() -> None:
    in_hand = CronRunsInHand()
    await in_hand.cut_short_after(0)
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
