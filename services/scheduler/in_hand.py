"""The cron jobs this process runs, for its stop (`CronRunsInHand`).

At stop the jobs in hand get a grace to end; those still running are cancelled (`CutShort`)
and their deliveries handed back as fresh copies rather than left for the broker to return,
which counts towards the queue's delivery limit. Only a job's handler is cut short: the
writes that start a run and record its decision, and the carrying out of that decision, are
not (a decision recorded and then handed back as well lost its dead letter, or forked the
run).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any


class CutShort(Exception):
    """The stop cancelled the job of a delivery in hand."""


class CronRunsInHand:
    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()
        self._by_key: dict[str, asyncio.Task[Any]] = {}
        self._cut_short: set[asyncio.Task[Any]] = set()
        self._closed = False
        # Event-loop time by which a delivery cut short must be handed back.
        self.hand_back_by: float | None = None

    async def run[T](self, job: Awaitable[T], *, key: str | None = None) -> T:
        """The job's result; `CutShort` when the stop cancelled it (or came first), or
        `cut_short(key)` did."""
        if self._closed:
            if inspect.iscoroutine(job):
                job.close()
            raise CutShort
        task = asyncio.ensure_future(job)
        self._running.add(task)
        if key is not None:
            self._by_key[key] = task
        try:
            return await task
        except asyncio.CancelledError:
            if task in self._cut_short and not _being_cancelled():
                raise CutShort from None
            task.cancel()
            raise
        finally:
            self._running.discard(task)
            self._cut_short.discard(task)
            if key is not None:
                self._by_key.pop(key, None)

    def cut_short(self, key: str) -> bool:
        """Cancel the job run under `key` (its delivery lost its hold on the run); False
        when none runs."""
        task = self._by_key.get(key)
        if task is None or task.done():
            return False
        self._cut_short.add(task)
        task.cancel()
        return True

    async def cut_short_by(self, deadline: float, *, hand_back_by: float) -> int:
        """Take no more; wait until `deadline` (event-loop time) for the jobs in hand, then
        cancel the rest, to be handed back by `hand_back_by`; how many were cut short."""
        self._closed = True
        self.hand_back_by = hand_back_by
        if not self._running:
            return 0
        grace_s = max(0.0, deadline - asyncio.get_running_loop().time())
        _, late = await asyncio.wait(set(self._running), timeout=grace_s)
        for task in late:
            self._cut_short.add(task)
            task.cancel()
        return len(late)


def _being_cancelled() -> bool:
    current = asyncio.current_task()
    return current is not None and current.cancelling() > 0
