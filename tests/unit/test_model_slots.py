"""`ModelSlots`: at most `size` holders at once; closing turns the waiters away at once."""

from __future__ import annotations

import asyncio

import pytest

from services.scorer.slots import ModelSlots, SlotsClosed


async def _hold_until(slots: ModelSlots, release: asyncio.Event, held: list[int]) -> None:
    async with slots.held():
        held.append(1)
        await release.wait()
        held.pop()


async def test_no_more_than_size_hold_a_slot_at_once() -> None:
    slots, release = ModelSlots(2), asyncio.Event()
    held: list[int] = []
    holders = [asyncio.create_task(_hold_until(slots, release, held)) for _ in range(5)]
    for _ in range(10):
        await asyncio.sleep(0)  # let every holder run as far as it can
    assert len(held) == 2
    release.set()
    await asyncio.gather(*holders)
    assert held == []


async def test_closing_turns_the_waiters_away_while_the_holders_go_on() -> None:
    slots, release = ModelSlots(1), asyncio.Event()
    held: list[int] = []
    holder = asyncio.create_task(_hold_until(slots, release, held))
    waiters = [asyncio.create_task(_hold_until(slots, release, [])) for _ in range(3)]
    for _ in range(10):
        await asyncio.sleep(0)
    slots.close()
    # The holder has not let go; the waiters leave anyway.
    results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 5)
    assert all(isinstance(result, SlotsClosed) for result in results), results
    assert held == [1]
    with pytest.raises(SlotsClosed):
        async with slots.held():
            pass
    release.set()
    await holder


def test_a_slot_is_needed() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ModelSlots(0)
