"""What this process is working on, to tell a stale claim of its own from a live one.

A claim whose write reached the database but whose answer was lost stays in the database
under this process's name while nothing here works on it; the next try may take it over at
once instead of waiting for its lease. A claim held by another delivery of this process
(two copies of one message) is live, and must not be taken over: the second copy makes no
claim at all, since its claim could land before the holder's, which would then take it over.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class InHand[Key: Hashable]:
    """The keys (task attempts, webhook attempts) that deliveries of this process hold."""

    def __init__(self) -> None:
        self._keys: set[Key] = set()

    def __len__(self) -> int:
        return len(self._keys)

    @contextmanager
    def holding(self, key: Key) -> Iterator[bool]:
        """Hold `key` while the block runs. Yields whether this block holds it: False when
        another delivery of this process already does (then this one holds nothing)."""
        if key in self._keys:
            yield False
            return
        self._keys.add(key)
        try:
            yield True
        finally:
            self._keys.discard(key)
