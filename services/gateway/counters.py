"""Bounded counters whose concurrent changes to one document share one write.

The gateway's limits (`services/gateway/limits.py`) keep one counter document per key and
window, and one per tenant, and every request or task changes one of them: a hot document,
which MongoDB updates one write at a time. Group commit (`shared.group_writes`) already
shares the round trip, but still sends one update per request; here the changes queued for
the same counter while the previous round trip was in flight become one update:

- `BoundedCounters.add`: increments go out as one conditional `$inc` of their sum
  (`{count: {$lte: ceiling - sum}}`, upsert). When the sum does not fit (the upsert collides
  on `_id`: too full, or another replica created the document at the same moment), each
  increment is tried on its own, as before, so merging never refuses one that fits alone.
- `GuardedReleases.release`: decrements, each recorded once by its id in a bounded list of
  recent releases, go out as one update guarded by none of their ids being recorded and the
  count covering them all. When that guard fails (a redelivered release, or a count lower
  than the sum), each is applied on its own, as before.

Neither ever retries a failed round trip: the caller owns that retry.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError

from shared.coalescing import Coalescer, Queued, fail, server_watch, settle
from shared.group_writes import GroupWriter

Document = dict[str, Any]
MAX_BATCH = 500


class _PerCounter[Op: (Increment, Release), Result](Coalescer[Op, Result]):
    """The changes of one round trip, grouped by counter: each group as one merged update
    when `_merge` can apply it, else each change on its own (`_alone`)."""

    def __init__(
        self, collection: AsyncCollection[Document], *, max_batch: int, merged_result: Result
    ) -> None:
        # The client's timeout bounds a change queueing included, as for a `GroupWriter`: a
        # change waiting behind stalled round trips is never sent (nothing to undo), rather
        # than applied half a minute after its request, past the outbox's grace period.
        client = collection.database.client
        super().__init__(
            max_batch=max_batch,
            deadline_s=client.options.timeout,
            server=server_watch(client),
        )
        self._merged_result = merged_result

    async def _send(self, batch: list[Queued[Op, Result]]) -> None:
        groups: dict[str, list[Queued[Op, Result]]] = {}
        for queued in batch:
            groups.setdefault(queued.op.counter_id, []).append(queued)
        await asyncio.gather(*(self._send_group(group) for group in groups.values()))

    async def _send_group(self, group: list[Queued[Op, Result]]) -> None:
        try:
            merged = len(group) > 1 and await self._merge(group)
        except Exception as error:  # noqa: BLE001 - the round trip's failure is each caller's
            for queued in group:
                fail(queued, error)
            return
        if merged:
            for queued in group:
                settle(queued, self._merged_result)
        else:
            await asyncio.gather(*(self._alone(queued) for queued in group))

    @abstractmethod
    async def _merge(self, group: list[Queued[Op, Result]]) -> bool:
        """Apply the whole group as one update: True if it did, False (nothing changed) if
        it cannot."""

    @abstractmethod
    async def _alone(self, queued: Queued[Op, Result]) -> None:
        """Apply one change by itself, settling or failing its caller."""


@dataclass(frozen=True, slots=True)
class Increment:
    counter_id: str
    amount: int
    ceiling: int  # the count may reach it, not pass it
    on_insert: Mapping[str, Any] = field(default_factory=dict)


class BoundedCounters(_PerCounter[Increment, bool]):
    """Counters `{_id, count}` in `collection` that never pass their ceiling."""

    def __init__(self, collection: AsyncCollection[Document], *, max_batch: int = MAX_BATCH):
        super().__init__(collection, max_batch=max_batch, merged_result=True)
        self._writes = GroupWriter(collection, max_batch=max_batch)

    async def add(
        self,
        counter_id: str,
        amount: int,
        *,
        ceiling: int,
        on_insert: Mapping[str, Any] | None = None,
    ) -> bool:
        """Add `amount` when the count stays within `ceiling`: True if added, False (and
        nothing added) if not. Fields of `on_insert` are set when this creates the counter.
        A failed round trip raises; then the amount may or may not have been added."""
        if amount > ceiling:
            return False
        return await self.submit(Increment(counter_id, amount, ceiling, on_insert or {}))

    async def _merge(self, group: list[Queued[Increment, bool]]) -> bool:
        first = group[0].op
        total = sum(queued.op.amount for queued in group)
        ceiling = min(queued.op.ceiling for queued in group)
        return total <= ceiling and await self._try_add(
            Increment(first.counter_id, total, ceiling, first.on_insert)
        )

    async def _alone(self, queued: Queued[Increment, bool]) -> None:
        op = queued.op
        try:
            # A collision means full, or two first increments raced to create the counter:
            # the guarded upsert's second try tells the two apart.
            added = await self._writes.guarded_upsert(*self._add(op))
        except Exception as error:  # noqa: BLE001
            fail(queued, error)
        else:
            settle(queued, added)

    async def _try_add(self, op: Increment) -> bool:
        """One try (a merged group falls back to its increments alone when it collides)."""
        try:
            await self._writes.update_one(*self._add(op), upsert=True)
        except DuplicateKeyError:
            return False
        return True

    @staticmethod
    def _add(op: Increment) -> tuple[Document, Document]:
        """The increment as a guarded upsert: (filter, update)."""
        update: Document = {"$inc": {"count": op.amount}}
        if op.on_insert:
            update["$setOnInsert"] = dict(op.on_insert)
        return {"_id": op.counter_id, "count": {"$lte": op.ceiling - op.amount}}, update


@dataclass(frozen=True, slots=True)
class Release:
    counter_id: str
    release_id: str


class GuardedReleases(_PerCounter[Release, None]):
    """Decrements of counters `{_id, count, recent_releases}` in `collection`, each at most
    once per release id while that id is among the counter's last `remembered` releases, and
    never below 0."""

    def __init__(self, collection: AsyncCollection[Document], *, remembered: int) -> None:
        # A merged update records at most `remembered` ids, so a batch holds at most that many.
        super().__init__(collection, max_batch=remembered, merged_result=None)
        self._collection = collection
        self._writes = GroupWriter(collection, max_batch=remembered)
        self._remembered = remembered

    async def release(self, counter_id: str, release_id: str) -> None:
        """Decrement `counter_id` once for `release_id` (nothing if it was already)."""
        await self.submit(Release(counter_id, release_id))

    async def _merge(self, group: list[Queued[Release, None]]) -> bool:
        """One update for the whole group when none of its ids was released before and the
        count covers them all; False (nothing changed) otherwise."""
        ids = [queued.op.release_id for queued in group]
        if len(set(ids)) < len(ids):
            return False
        guard: Document = {
            "_id": group[0].op.counter_id,
            "count": {"$gte": len(ids)},
            "recent_releases": {"$nin": ids},
        }
        result = await self._collection.update_one(guard, self._decrement(ids))
        return result.matched_count == 1

    async def _alone(self, queued: Queued[Release, None]) -> None:
        op = queued.op
        try:
            # Grouped: two releases of one id in one round trip are applied one after the
            # other, so the second one's guard sees the first one's `recent_releases`.
            await self._writes.update_one(
                {
                    "_id": op.counter_id,
                    "count": {"$gt": 0},
                    "recent_releases": {"$ne": op.release_id},
                },
                self._decrement([op.release_id]),
            )
        except Exception as error:  # noqa: BLE001
            fail(queued, error)
        else:
            settle(queued, None)

    def _decrement(self, ids: list[str]) -> Document:
        return {
            "$inc": {"count": -len(ids)},
            "$push": {"recent_releases": {"$each": ids, "$slice": -self._remembered}},
        }
