"""Refused requests whose records may still be in the database, written off in the background.

A submission or batch answered with an error (429, 503) keeps nothing: its records are removed
on the spot. When that removal fails (the database is slow or down), or when a record's insert
itself failed without an answer (a timeout, a lost connection: the server may have applied it,
or may apply it later), those records would be left `accepting`, and the outbox sweep would
send them: a request answered 503 would be scored after all, and a client retrying without an
Idempotency-Key would have its text scored twice. So the request is noted here instead (an
insert that never left, no server having been selected, is not: a database that was down
would otherwise get a tombstone for every request refused meanwhile), and `write_off`
settles all that is noted once the database takes writes again:

1. the in-flight slots it may hold are released (idempotent per task, `limits.InFlight`);
2. each of its submissions becomes an `abandoned` tombstone (`Submissions.abandon`, with
   those of the refusals written off with it, a round trip's worth at a time, through the
   group writer), an upsert by task id: it holds whether it lands before or after a late
   insert (which then fails on its `_id`); it frees the idempotency key and keeps no text;
3. its batch record becomes one as well (`Batches.abandon`).

A replay of a batch's request that fails on the database is noted too (unless its one write
was never sent: it recorded nothing), but it does not own the batch: the batch is its first
request's, which may have been answered 202 and sent. Its write-off never touches the batch;
the submissions the replay may have recorded are written off only if the batch was refused
(a tombstone, or discarded), and otherwise are left to the outbox sweep with the batch's
others (`Refusal.owns_batch`).

The outbox sweep of this process skips every task noted here and not yet written off, and
every task whose request is still running here (`holding`).

Limits (the fallback in each case is the behaviour without this module: the sweep sends the
records, each is scored once, and its end releases its slot):
- pending write-offs live in this process's memory; a gateway that dies first loses them;
- another gateway replica's sweep may send them if this replica cannot write for longer than
  the outbox grace period (`OUTBOX_GRACE_S`) while that one can;
- at most `MAX_PENDING_TASKS` task ids wait; beyond that the oldest refusals are dropped, with
  a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, Protocol

from pymongo.errors import ServerSelectionTimeoutError

from services.gateway.limits import RECENT_RELEASES
from shared.group_writes import MAX_BATCH as GROUP_WRITE_BATCH

log = logging.getLogger("scorebox.gateway")

MAX_PENDING_TASKS: Final = 100_000
# Slots released together (one round trip): as many as one merged release of a tenant's
# counter takes.
RELEASE_CHUNK: Final = RECENT_RELEASES
# Tombstones queued together: one round trip of the group writer (`shared.group_writes`).
TOMBSTONE_CHUNK: Final = GROUP_WRITE_BATCH


@dataclass
class Released:
    """The task ids of a refusal whose slot was released: a release is idempotent only while
    the tenant's counter remembers the task among its latest ones, so a release that
    succeeded is never repeated by a later pass."""

    ids: set[str] = field(default_factory=set)

    @property
    def count(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Refusal:
    """A refused request's records: its submissions' task ids and its batch, if any."""

    tenant_id: str
    task_ids: tuple[str, ...]
    counted: bool = False  # its in-flight slots may be counted: release them first
    batch_id: str | None = None
    # False for a replay's: the batch is another request's, to be followed, never refused.
    owns_batch: bool = True
    released: Released = field(default_factory=Released, compare=False)

    def to_release(self) -> tuple[str, ...]:
        if not self.counted:
            return ()
        return tuple(task_id for task_id in self.task_ids if task_id not in self.released.ids)


class Refusals:
    """Refusals waiting to be written off, oldest first."""

    def __init__(self, *, max_pending_tasks: int = MAX_PENDING_TASKS) -> None:
        self._max_pending_tasks = max_pending_tasks
        self._pending: deque[Refusal] = deque()
        # task id → how many pending refusals and running requests (`holding`) name it
        self._held: dict[str, int] = {}
        # The task ids of the pending refusals alone: the cap is on those. Counting the held
        # ids instead, running requests (a hundred batches of 1,000 items) pushed refusals
        # out that were far from it, and the sweep sent them (found in review).
        self._pending_tasks = 0

    def note(self, refusal: Refusal) -> None:
        self._pending.append(refusal)
        self._pending_tasks += len(refusal.task_ids)
        for task_id in refusal.task_ids:
            self._held[task_id] = self._held.get(task_id, 0) + 1
        while self._pending_tasks > self._max_pending_tasks and len(self._pending) > 1:
            dropped = self._pending[0]
            self._forget(dropped)
            log.warning(
                "too many refusals to write off: %d task(s) of tenant %s left to the outbox",
                len(dropped.task_ids),
                dropped.tenant_id,
            )

    @contextlib.contextmanager
    def holding(self, task_ids: tuple[str, ...]) -> Iterator[None]:
        """Keep the sweep of this process off `task_ids` while their request runs here: it
        may yet refuse what it recorded, and undoing that (a withdrawal, a batch's slots
        released one by one) may outlast the outbox grace period; the sweep then sent what
        the client was told was not kept."""
        for task_id in task_ids:
            self._held[task_id] = self._held.get(task_id, 0) + 1
        try:
            yield
        finally:
            self._unhold(task_ids)

    def holds(self, task_id: str) -> bool:
        """Whether the task belongs to a refusal not yet written off (not to be sent)."""
        return task_id in self._held

    def pending(self) -> list[Refusal]:
        return list(self._pending)

    def written_off(self, refusal: Refusal) -> None:
        self._forget(refusal)

    def _forget(self, refusal: Refusal) -> None:
        try:
            self._pending.remove(refusal)
        except ValueError:
            return
        self._pending_tasks -= len(refusal.task_ids)
        self._unhold(refusal.task_ids)

    def _unhold(self, task_ids: tuple[str, ...]) -> None:
        for task_id in task_ids:
            left = self._held.pop(task_id) - 1
            if left:
                self._held[task_id] = left


def may_have_been_written(error: BaseException) -> bool:
    """Whether a failed write may reach the database all the same: anything but a server never
    selected, so never sent (a retried write that fails to select one raises its first error).
    Refusals of writes never sent need no writing off: a database that was down would
    otherwise get a tombstone for every request refused meanwhile."""
    return not isinstance(error.__cause__, ServerSelectionTimeoutError)


class SlotReleaser(Protocol):
    async def release(self, tenant_id: str, task_id: str) -> None: ...


class SubmissionTombstones(Protocol):
    async def abandon(self, task_ids: tuple[str, ...], *, now: datetime) -> set[str]: ...
    async def uncount(self, task_ids: Collection[str]) -> None: ...


class BatchTombstones(Protocol):
    async def abandon(self, batch_id: str, *, now: datetime) -> bool: ...
    async def refused(self, batch_id: str) -> bool: ...


async def write_off(
    refusals: Refusals,
    *,
    submissions: SubmissionTombstones,
    batches: BatchTombstones,
    in_flight: SlotReleaser | None,
    now: datetime,
) -> int:
    """Settle the pending refusals, a group at a time (`_groups`): release the slots, write
    the tombstones of the group's batches, then of its submissions together
    (group-committed); returns how many were written off. Each group is forgotten as soon as
    it is settled; a `DatabaseUnavailable` leaves it and the groups after it pending for the
    next call (each step may be repeated: releases and tombstones are idempotent).

    A group at a time because all at once, a backlog of refusals (a slow database under
    load notes thousands) queued every tombstone in the submissions' group writer together:
    those still queued after `MONGO_TIMEOUT_S` failed, the pass with them, and the next
    pass queued the whole backlog again, never done, and each holding back every
    submission's write queued behind it (found in review).

    A batch goes first: a replay of its request (after `OUTBOX_GRACE_S`, perhaps on another
    replica) may have completed and accepted it meanwhile, and then its submissions stay, to
    be sent. The other way round, an accepted batch lost its submissions to tombstones, and a
    replay answered 200 for items never scored. A replay's refusal follows its batch, so it
    is settled after every batch's own refusal (in a later group, or later in the same)."""
    owners_first = sorted(refusals.pending(), key=lambda refusal: not refusal.owns_batch)
    written = 0
    for group in _groups(owners_first):
        await _settle(group, submissions=submissions, batches=batches, in_flight=in_flight, now=now)
        for refusal in group:
            refusals.written_off(refusal)
        written += len(group)
    return written


def _groups(refusals: list[Refusal]) -> Iterator[list[Refusal]]:
    """Consecutive refusals holding up to `TOMBSTONE_CHUNK` task ids together (a larger
    refusal alone)."""
    group: list[Refusal] = []
    size = 0
    for refusal in refusals:
        if group and size + len(refusal.task_ids) > TOMBSTONE_CHUNK:
            yield group
            group, size = [], 0
        group.append(refusal)
        size += len(refusal.task_ids)
    if group:
        yield group


async def _settle(
    group: list[Refusal],
    *,
    submissions: SubmissionTombstones,
    batches: BatchTombstones,
    in_flight: SlotReleaser | None,
    now: datetime,
) -> None:
    if in_flight is not None:
        for refusal in group:
            await release_slots(refusal, in_flight)
    refused = [refusal for refusal in group if await _stands(refusal, batches, now)]
    task_ids = tuple(task_id for refusal in refused for task_id in refusal.task_ids)
    left: set[str] = set()
    for start in range(0, len(task_ids), TOMBSTONE_CHUNK):
        left |= await submissions.abandon(task_ids[start : start + TOMBSTONE_CHUNK], now=now)
    # Every slot of a request's own refusal is released by now, or was never taken (a 429, an
    # acquire never sent): a submission of it kept after all (its batch accepted by a replay
    # or sent by another replica's sweep, a single one left to the sweep by a replay) must
    # not release one at its outcome. A tombstone keeps no mark; a replay's refusal is not
    # the owner: its tasks' marks are their first request's.
    kept = {
        task
        for refusal in group
        if refusal.owns_batch
        for task in refusal.task_ids
        if refusal not in refused or task in left
    }
    if kept:
        await submissions.uncount(kept)


async def release_slots(refusal: Refusal, in_flight: SlotReleaser) -> None:
    """Release the slots of `refusal` not yet released, `RELEASE_CHUNK` at a time, noting
    each one done as it is: a failure leaves the ones that failed for the next try, never
    the done ones again (each is guarded while among its tenant's last releases only: a
    chunk tried again whole, after other tasks' releases, counted some twice; found in
    review).

    Together, so that a chunk's releases share one round trip (`GuardedReleases` merges
    them): one at a time, a refused batch of 1,000 items took a thousand round trips, and
    outlasted `OUTBOX_GRACE_S` on a slow database, when another replica's sweep sent its
    items while this one went on to answer 503 "nothing was kept" (found in review)."""
    to_release = refusal.to_release()
    for start in range(0, len(to_release), RELEASE_CHUNK):
        chunk = to_release[start : start + RELEASE_CHUNK]
        outcomes = await asyncio.gather(
            *(in_flight.release(refusal.tenant_id, task) for task in chunk),
            return_exceptions=True,
        )
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        refusal.released.ids.update(
            task for task, outcome in zip(chunk, outcomes, strict=True) if outcome is None
        )
        if failures:
            raise failures[0]


async def _stands(refusal: Refusal, batches: BatchTombstones, now: datetime) -> bool:
    """Whether the refusal's submissions are to be written off: not a batch's; its own batch,
    written off now (not accepted); or a replay's, whose batch was refused by its owner."""
    if refusal.batch_id is None:
        return True
    if refusal.owns_batch:
        return await batches.abandon(refusal.batch_id, now=now)
    return await batches.refused(refusal.batch_id)
