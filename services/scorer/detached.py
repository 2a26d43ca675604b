"""Decisions that may outlive their delivery, for the stop to wait for.

A handler runs its decision (claim, model call, record) shielded: losing the broker
connection cancels the handler, and the decision goes on and is recorded, for the redelivery
to replay. Once its handler is gone, nothing held it: a stop that came before the
redelivery found no delivery in hand and closed the model client under its call, which was
then recorded as a retry of an unavailable model, the call billed and made again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Detached:
    """The decisions of this process still running, whether or not a handler awaits them."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()

    def start[T](self, decision: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(decision)
        self._running.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        # Taken here so that one whose handler is gone does not log "never retrieved": its
        # handler reported it when there was one, and a redelivery decides again otherwise.
        if not task.cancelled():
            task.exception()

    async def ended(self, *, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every decision running now to end; how many have not."""
        if self._running and timeout_s > 0:
            await asyncio.wait(set(self._running), timeout=timeout_s)
        return len(self._running)
