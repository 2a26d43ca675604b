"""A publish's turn with its message id (`shared.bus._Turn`): after waiting for an earlier
publish of its id, a publish left too little of its deadline to be written is not begun (a
TimeoutError, nothing sent): begun, aiormq's own timeout ran out before the frames were
written, and that read as "unconfirmed, may be queued" (found in review)."""

from __future__ import annotations

import asyncio

import pytest

from shared.bus import MIN_PUBLISH_S, _Turn


async def test_after_a_wait_a_sliver_of_the_deadline_is_no_time_to_publish() -> None:
    soon = asyncio.get_running_loop().time() + MIN_PUBLISH_S / 2
    with pytest.raises(TimeoutError):
        _Turn({}, "id", soon, waited=True).time_left()
    assert 0 < _Turn({}, "id", soon, waited=False).time_left() <= MIN_PUBLISH_S / 2


async def test_a_deadline_passed_is_no_time_to_publish() -> None:
    past = asyncio.get_running_loop().time() - 1
    with pytest.raises(TimeoutError):
        _Turn(None, None, past).time_left()
