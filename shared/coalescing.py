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

Such a member is told whether its write may have been applied only as far as the driver
says: with `COMMANDS_SENT` among the client's listeners (`shared.runtime.make_mongo` adds it),
a round trip for which PyMongo has started no command yet (it is still selecting a server:
the database is down) fails its member with `NotSentInTime`, never sent, as PyMongo's own
error says at the latest deadline. Without it, or once a command has started, the member
gets `TimedOutInFlight`: the write may have landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pymongo
from pymongo import monitoring
from pymongo.errors import NetworkTimeout, ServerSelectionTimeoutError


class QueuedPastDeadline(ServerSelectionTimeoutError):
    """The operation was never sent: it waited behind earlier round trips until its deadline
    had passed. To its caller it is a server not selected in time: nothing reached the
    database."""


class NotSentInTime(ServerSelectionTimeoutError):
    """The operation's deadline passed while the round trip carrying it was still selecting
    a server (bounded by a later member's deadline): no command of it had started, so
    nothing reached the database."""


class TimedOutInFlight(NetworkTimeout):
    """The operation's deadline passed while the round trip carrying it (bounded by a later
    member's deadline) was in flight: it may or may not have been applied, as after any
    network timeout."""


@dataclass(slots=True)
class _RoundTrip:
    """Whether PyMongo has started a command for a round trip, and for those whose members
    it carries (a coalescer sending through another); and its limit (`deadline`, event-loop
    time: its latest member's), which what it sends through another coalescer keeps to."""

    started: bool = False
    carried: list[_RoundTrip] = field(default_factory=list)
    deadline: float | None = None

    def mark_started(self) -> None:
        self.started = True
        for outer in self.carried:
            outer.mark_started()


_ROUND_TRIP: contextvars.ContextVar[_RoundTrip | None] = contextvars.ContextVar(
    "scorebox_round_trip", default=None
)


class _CommandsSent(monitoring.CommandListener):
    """Marks the round trip being flushed as started when PyMongo starts one of its commands,
    which it announces before writing the command to the connection."""

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        round_trip = _ROUND_TRIP.get()
        if round_trip is not None:
            round_trip.mark_started()

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


COMMANDS_SENT: monitoring.CommandListener = _CommandsSent()


def commands_watched(client: pymongo.AsyncMongoClient[Any]) -> bool:
    """Whether `client` tells group commit when a round trip's commands start."""
    # PyMongo types the list as `_EventListeners`, though it holds the listeners given.
    listeners: list[object] = list(client.options.event_listeners)
    return any(listener is COMMANDS_SENT for listener in listeners)


@dataclass(frozen=True, slots=True)
class Queued[Op, Result]:
    op: Op
    outcome: asyncio.Future[Result]
    deadline: float | None = None  # event-loop time
    within: _RoundTrip | None = None  # the round trip of a coalescer that submitted it


class Coalescer[Op, Result](ABC):
    """Queues operations and sends them `max_batch` at a time, one batch after another; each
    within `deadline_s` of its submission, queueing included, when one is given."""

    def __init__(
        self, *, max_batch: int, deadline_s: float | None = None, watched: bool = False
    ) -> None:
        self._max_batch = max_batch
        self._deadline_s = deadline_s
        self._watched = watched  # its client has `COMMANDS_SENT`
        self._queued: list[Queued[Op, Result]] = []
        self._flusher: asyncio.Task[None] | None = None

    @property
    def deadline_s(self) -> float | None:
        return self._deadline_s

    async def submit(self, op: Op) -> Result:
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[Result] = loop.create_future()
        deadline = None if self._deadline_s is None else loop.time() + self._deadline_s
        within = _ROUND_TRIP.get()
        if within is not None and within.deadline is not None:
            # Sent for another coalescer's round trip: answered within that one's limit, or
            # its members would wait past their deadlines for a deadline counted afresh here.
            deadline = within.deadline if deadline is None else min(deadline, within.deadline)
        self._queued.append(Queued(op, outcome, deadline, within))
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
        latest = _latest_deadline(batch)
        carried = [queued.within for queued in batch if queued.within is not None]
        round_trip = _RoundTrip(carried=carried, deadline=latest)
        watched = round_trip if self._watched else None
        timers = _each_answered_by_its_deadline(batch, latest, watched)
        marking = _ROUND_TRIP.set(round_trip)
        try:
            with _within(latest):
                await self._send(batch)
        except asyncio.CancelledError:
            for queued in batch:
                queued.outcome.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - the batch's failure is each caller's failure
            for queued in batch:
                fail(queued, error)
        finally:
            _ROUND_TRIP.reset(marking)
            for timer in timers:
                timer.cancel()


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


def _latest_deadline[Op, Result](batch: Sequence[Queued[Op, Result]]) -> float | None:
    """The latest deadline in `batch`; None when a member has none (nothing is bounded)."""
    deadlines = [queued.deadline for queued in batch]
    if not deadlines or None in deadlines:
        return None
    return max(deadline for deadline in deadlines if deadline is not None)


def _within(latest: float | None) -> contextlib.AbstractContextManager[None]:
    """The round trip's time limit: what is left of its latest deadline."""
    if latest is None:
        return contextlib.nullcontext()
    return pymongo.timeout(max(latest - asyncio.get_running_loop().time(), 0.001))


def _each_answered_by_its_deadline[Op, Result](
    batch: Sequence[Queued[Op, Result]], latest: float | None, watched: _RoundTrip | None
) -> list[asyncio.TimerHandle]:
    """Timers failing each member of `batch` whose deadline comes before the round trip's
    limit (`latest`), should the round trip outlast it (a member already answered is left as
    it is). The members with the latest deadline get PyMongo's own error at that limit, which
    tells an operation never sent (no server selected) from one that may have been applied;
    the others are told so by `watched` (None: not known, so maybe applied)."""
    if latest is None:
        return []
    loop = asyncio.get_running_loop()
    return [
        loop.call_at(queued.deadline, _timed_out, queued, watched)
        for queued in batch
        if queued.deadline is not None and queued.deadline < latest
    ]


def _timed_out[Op, Result](queued: Queued[Op, Result], watched: _RoundTrip | None) -> None:
    if watched is not None and not watched.started:
        fail(queued, NotSentInTime("its deadline passed while its round trip awaited a server"))
    else:
        fail(queued, TimedOutInFlight("its deadline passed while its round trip was in flight"))
