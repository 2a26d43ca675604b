"""Coalescing concurrent single-document operations into one round trip.

An operation waits only while the previous round trip is in flight, so an idle service sends
at once and a busy one sends everything that queued up meanwhile together. `GroupWriter`
(`shared.group_writes`) and `GroupReader` (`shared.group_reads`) build on it.

With a deadline (the client's `timeoutMS`), the wait in the queue counts against it: an
operation whose deadline passed while it waited is not sent at all (`QueuedPastDeadline`), and
each caller is answered by its own deadline. Without this, an operation queued behind a
stalled round trip waited for that one's timeout and then for its own, twice the deadline or
more. A round trip is sent with what is left of its latest deadline (`pymongo.timeout`), and a
member whose own deadline passes while it is in flight fails then (`TimedOutInFlight`), the
others still waiting for their answer. Bounded by its earliest deadline instead, a round trip
failed whole whenever the database took more than half the timeout to answer: the oldest
member had waited through the previous round trip, and its remainder cut short every write
sent with it, each of which would have been answered in time on its own. An operation a
round trip sends through another coalescer (the gateway's counters through a `GroupWriter`)
keeps to that round trip's limit rather than counting a deadline afresh.

Whether such a member's write may have been applied is what the round trip's limit decides.
While the client knows a server to send to, the limit is the latest deadline and a member
failed before the round trip ends is told its write may have landed (`TimedOutInFlight`):
once a round trip is in the driver's hands, nothing withdraws one of its writes. While the
client knows none (the database down, or not reached yet), the limit is the earliest
deadline: should no server answer by then, every member gets PyMongo's own
`ServerSelectionTimeoutError`, never sent, and each one told so is truly never written.
Bounded by the latest deadline then, members told "never sent" by their own deadlines were
sent after all when the database came back before the latest.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pymongo
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import NetworkTimeout, ServerSelectionTimeoutError


class QueuedPastDeadline(ServerSelectionTimeoutError):
    """The operation was never sent: it waited behind earlier round trips until its deadline
    had passed. To its caller it is a server not selected in time: nothing reached the
    database."""


class TimedOutInFlight(NetworkTimeout):
    """The operation's deadline passed while the round trip carrying it (bounded by a later
    member's deadline) was in flight: it may or may not have been applied, as after any
    network timeout."""


# The limit of the round trip being sent (event-loop time), in its flusher's context: what it
# sends through another coalescer keeps to it.
_ROUND_TRIP_LIMIT: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "scorebox_round_trip_limit", default=None
)


def server_known_for_writes(client: pymongo.AsyncMongoClient[Any]) -> Callable[[], bool]:
    """Whether `client` knows a server it could send a write to now."""
    # Read afresh each time: the client replaces its description as it learns.
    return lambda: client.topology_description.has_writable_server()  # noqa: PLW0108


def server_known_for_reads(collection: AsyncCollection[Any]) -> Callable[[], bool]:
    """Whether `collection`'s client knows a server it could read the collection from now."""
    client, preference = collection.database.client, collection.read_preference
    return lambda: client.topology_description.has_readable_server(preference)


@dataclass(frozen=True, slots=True)
class Queued[Op, Result]:
    op: Op
    outcome: asyncio.Future[Result]
    deadline: float | None = None  # event-loop time


class Coalescer[Op, Result](ABC):
    """Queues operations and sends them `max_batch` at a time, one batch after another; each
    within `deadline_s` of its submission, queueing included, when one is given.
    `server_known`: whether the client knows a server to send to now (None: taken as known)."""

    def __init__(
        self,
        *,
        max_batch: int,
        deadline_s: float | None = None,
        server_known: Callable[[], bool] | None = None,
    ) -> None:
        self._max_batch = max_batch
        self._deadline_s = deadline_s
        self._server_known = server_known
        self._queued: list[Queued[Op, Result]] = []
        self._flusher: asyncio.Task[None] | None = None

    @property
    def deadline_s(self) -> float | None:
        return self._deadline_s

    async def submit(self, op: Op) -> Result:
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[Result] = loop.create_future()
        deadline = None if self._deadline_s is None else loop.time() + self._deadline_s
        within = _ROUND_TRIP_LIMIT.get()
        if within is not None:
            # Sent for another coalescer's round trip: answered within that one's limit, or
            # its members would wait past their deadlines for a deadline counted afresh here.
            deadline = within if deadline is None else min(deadline, within)
        self._queued.append(Queued(op, outcome, deadline))
        if self._flusher is None or self._flusher.done():
            # In a context of its own: it serves every caller queued while it runs, not only
            # the first (its correlation id in log lines, its `pymongo.timeout`).
            self._flusher = asyncio.create_task(self._flush_queued(), context=contextvars.Context())
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
        batch = _unexpired(batch)
        if not batch:
            return
        limit = self._limit_of(batch)
        timers = _each_answered_by_its_deadline(batch, limit)
        marking = _ROUND_TRIP_LIMIT.set(limit)
        try:
            with _within(limit):
                await self._send(batch)
        except asyncio.CancelledError:
            for queued in batch:
                queued.outcome.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - the batch's failure is each caller's failure
            for queued in batch:
                fail(queued, error)
        finally:
            _ROUND_TRIP_LIMIT.reset(marking)
            for timer in timers:
                timer.cancel()

    def _limit_of(self, batch: Sequence[Queued[Op, Result]]) -> float | None:
        """The round trip's limit: its latest deadline, or its earliest while the client
        knows no server to send to (see the module's docstring); None when a member has no
        deadline (nothing is bounded)."""
        deadlines = [queued.deadline for queued in batch]
        if not deadlines or None in deadlines:
            return None
        bounded = [deadline for deadline in deadlines if deadline is not None]
        if self._server_known is None or self._server_known():
            return max(bounded)
        return min(bounded)


def settle[Op, Result](queued: Queued[Op, Result], result: Result) -> None:
    if not queued.outcome.done():  # its caller was cancelled; the operation went ahead anyway
        queued.outcome.set_result(result)


def fail[Op, Result](queued: Queued[Op, Result], error: Exception) -> None:
    if not queued.outcome.done():
        queued.outcome.set_exception(error)


def _unexpired[Op, Result](batch: list[Queued[Op, Result]]) -> list[Queued[Op, Result]]:
    """The operations of `batch` still within their deadlines; the others fail unsent."""
    now = asyncio.get_running_loop().time()
    kept = []
    for queued in batch:
        if queued.deadline is not None and queued.deadline <= now:
            fail(queued, QueuedPastDeadline("waited past its deadline for earlier round trips"))
        else:
            kept.append(queued)
    return kept


def _within(limit: float | None) -> contextlib.AbstractContextManager[None]:
    """The round trip's time limit: what is left of `limit`."""
    if limit is None:
        return contextlib.nullcontext()
    return pymongo.timeout(max(limit - asyncio.get_running_loop().time(), 0.001))


def _each_answered_by_its_deadline[Op, Result](
    batch: Sequence[Queued[Op, Result]], limit: float | None
) -> list[asyncio.TimerHandle]:
    """Timers failing each member of `batch` whose deadline comes before the round trip's
    `limit`, should the round trip outlast it (a member already answered is left as it is);
    the others get the round trip's own outcome, PyMongo's error at the limit included."""
    if limit is None:
        return []
    loop = asyncio.get_running_loop()
    return [
        loop.call_at(queued.deadline, _timed_out, queued)
        for queued in batch
        if queued.deadline is not None and queued.deadline < limit
    ]


def _timed_out[Op, Result](queued: Queued[Op, Result]) -> None:
    fail(queued, TimedOutInFlight("its deadline passed while its round trip was in flight"))
