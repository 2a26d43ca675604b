"""`shared.in_hand.InHand`: one holder per key in a process, released however its block ends."""

from __future__ import annotations

import pytest

from shared.in_hand import InHand


def test_a_key_already_held_is_not_held_again() -> None:
    in_hand: InHand[str] = InHand()
    with in_hand.holding("a") as first:
        with in_hand.holding("a") as second:
            assert (first, second) == (True, False)
        assert len(in_hand) == 1  # the second block held nothing, so released nothing
        with in_hand.holding("b") as other:
            assert other
    assert len(in_hand) == 0


def test_a_key_is_released_when_its_block_raises() -> None:
    in_hand: InHand[str] = InHand()
    with pytest.raises(RuntimeError), in_hand.holding("a"):
        raise RuntimeError("the attempt failed")
    with in_hand.holding("a") as again:
        assert again
