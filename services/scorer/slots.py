"""Model slots: at most `SCORER_CONCURRENCY` attempts claim and call the model at once.

A scorer holds more deliveries than it calls the model for (`SCORER_PREFETCH`, twice the
concurrency by default), so that the model is kept busy while finished attempts record their
decisions and publish their outcomes, and the next ones arrive from the broker: with one
delivery per model call, every call's database and broker round trips left its slot idle,
and the throughput fell short of C/L by their share. The deliveries beyond the slots wait
here, holding nothing: the claim (and its lease) is taken once a slot is, and a slot is given
back when the call ends, before its decision is recorded.

At stop, `close()` turns the waiting deliveries away (`SlotsClosed`) without waiting for a
slot, so that no model call starts that the stop's grace period would cut short.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class SlotsClosed(Exception):
    """The scorer is stopping: no new model call starts."""


class ModelSlots:
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"at least one model slot is needed, got {size}")
        self._free = asyncio.Semaphore(size)
        self._closed = False
        self.closing = asyncio.Event()  # set by `close()`: for waits inside a slot
        self.busy = 0  # slots held now

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Hold a slot for the block; `SlotsClosed` once `close()` was called."""
        if self._closed:
            raise SlotsClosed
        await self._free.acquire()
        self.busy += 1
        try:
            if self._closed:
                raise SlotsClosed
            yield
        finally:
            self.busy -= 1
            self._free.release()

    @property
    def closed(self) -> bool:
        """Whether the scorer is stopping (`close()` was called): no wait should outlast it."""
        return self._closed

    def close(self) -> None:
        """Turn away every delivery waiting for a slot, and every later one.

        One slot more is released: a waiter wakes, finds the slots closed and gives its slot
        back on leaving, which wakes the next (no model call starts any more, so the extra
        slot lets none through)."""
        if self._closed:
            return
        self._closed = True
        self.closing.set()
        self._free.release()
