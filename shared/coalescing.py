"""Coalescing concurrent single-document operations into one round trip.

An operation waits only while the previous round trip is in flight, so an idle service sends
at once and a busy one sends everything that queued up meanwhile together. `GroupWriter`
(`shared.group_writes`) and `GroupReader` (`shared.group_reads`) build on it.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Queued[Op, Result]:
    op: Op
    outcome: asyncio.Future[Result]


class Coalescer[Op, Result](ABC):
    """Queues operations and sends them `max_batch` at a time, one batch after another."""

    def __init__(self, *, max_batch: int) -> None:
        self._max_batch = max_batch
        self._queued: list[Queued[Op, Result]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, op: Op) -> Result:
        outcome: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._queued.append(Queued(op, outcome))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_queued())
        return await outcome

    @abstractmethod
    async def _send(self, batch: list[Queued[Op, Result]]) -> None:
        """One round trip for `batch`; settles every outcome (see `settle`), or raises to
        fail them all with the same error."""

    async def _flush_queued(self) -> None:
        try:
            while self._queued:
                batch = self._queued[: self._max_batch]
                del self._queued[: self._max_batch]
                await self._flush(batch)
        except asyncio.CancelledError:
            for queued in self._queued:
                queued.outcome.cancel()
            self._queued.clear()
            raise

    async def _flush(self, batch: list[Queued[Op, Result]]) -> None:
        try:
            await self._send(batch)
        except asyncio.CancelledError:
            for queued in batch:
                queued.outcome.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - the batch's failure is each caller's failure
            for queued in batch:
                fail(queued, error)


def settle[Op, Result](queued: Queued[Op, Result], result: Result) -> None:
    if not queued.outcome.done():  # its caller was cancelled; the operation went ahead anyway
        queued.outcome.set_result(result)


def fail[Op, Result](queued: Queued[Op, Result], error: Exception) -> None:
    if not queued.outcome.done():
        queued.outcome.set_exception(error)
