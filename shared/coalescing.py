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

A member failed before its round trip ends is told its write may have landed
(`TimedOutInFlight`): once a round trip is in the driver's hands, nothing withdraws one of
its writes. So a batch is handed over only once a server is there to take it: while the
client knows none (the database down, or not reached yet; `ServerWatch`), the batch is held
and one cheap command probes for a server, and each member whose deadline passes meanwhile
is failed by its own deadline as never sent (`QueuedPastDeadline`), which is true. Bounded by
its latest deadline in the driver's hands instead, members were told "maybe written" during
every outage; told "never sent" there (by a command listener, before their command started),
they were sent after all when the database came back before the latest deadline; and
bounded by its earliest, whole batches failed before their members' deadlines, some answered
half a second past theirs (PyMongo's server selection waits in such steps) (all found in
review).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pymongo
from pymongo.errors import (
    InvalidOperation,
    NetworkTimeout,
    OperationFailure,
    PyMongoError,
    ServerSelectionTimeoutError,
)


class QueuedPastDeadline(ServerSelectionTimeoutError):
    """The operation was never sent: it waited behind earlier round trips, or for a server
    to answer, until its deadline had passed. To its caller it is a server not selected in
    time: nothing reached the database."""


class TimedOutInFlight(NetworkTimeout):
    """The operation's deadline passed while the round trip carrying it was in flight: it
    may or may not have been applied, as after any network timeout."""


PROBE_PAUSE_S = 0.25  # between probes that failed without waiting for a server
LIMIT_GRACE_S = 0.05  # past a round trip's limit, for PyMongo's own error to arrive

# The limit of the round trip being sent (event-loop time), in its flusher's context: what it
# sends through another coalescer keeps to it.
_ROUND_TRIP_LIMIT: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "scorebox_round_trip_limit", default=None
)


@dataclass(frozen=True, slots=True)
class ServerWatch:
    """Whether a client knows a server to send writes to now (`known`), and one cheap command
    such a server answers (`answered`), which makes the client look for one."""

    known: Callable[[], bool]
    answered: Callable[[], Awaitable[object]]


def server_watch(client: pymongo.AsyncMongoClient[Any]) -> ServerWatch:
    """The watch of `client`'s servers that take writes (its primary)."""
    return ServerWatch(
        # Read afresh each time: the client replaces its description as it learns.
        known=lambda: client.topology_description.has_writable_server(),  # noqa: PLW0108
        answered=lambda: client.admin.command("ping"),
    )


@dataclass(slots=True)
class Queued[Op, Result]:
    op: Op
    outcome: asyncio.Future[Result]
    deadline: float | None = None  # event-loop time
    # Fails it at its deadline while it waits in the queue behind a round trip that outlasted
    # its limit (`_expire_while_queued`); cancelled once it is taken.
    expiry: asyncio.TimerHandle | None = None


class Coalescer[Op, Result](ABC):
    """Queues operations and sends them `max_batch` at a time, one batch after another; each
    within `deadline_s` of its submission, queueing included, when one is given. With
    `server`, a batch is sent only once a server is there to take it (the module's
    docstring); without, it is handed to the driver at once."""

    def __init__(
        self,
        *,
        max_batch: int,
        deadline_s: float | None = None,
        server: ServerWatch | None = None,
    ) -> None:
        self._max_batch = max_batch
        self._deadline_s = deadline_s
        self._server = server
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
                for queued in batch:
                    if queued.expiry is not None:
                        queued.expiry.cancel()
                await self._flush(batch)
        except asyncio.CancelledError:
            for queued in self._queued:
                queued.outcome.cancel()
            self._queued.clear()
            raise

    async def _flush(self, batch: list[Queued[Op, Result]]) -> None:
        batch = _unexpired(batch)
        try:
            batch = await self._once_a_server_answers(batch)
            if batch:
                await self._round_trip(batch)
        except asyncio.CancelledError:
            for queued in batch:
                queued.outcome.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - the batch's failure is each caller's failure
            for queued in batch:
                fail(queued, error)

    async def _round_trip(self, batch: list[Queued[Op, Result]]) -> None:
        """`batch` in the driver's hands, within what is left of its latest deadline."""
        limit = _latest_deadline(batch)
        timers = _each_answered_by_its_deadline(batch, limit)
        if limit is not None:
            overrun = asyncio.get_running_loop().call_at(
                limit + LIMIT_GRACE_S, self._expire_while_queued
            )
            timers.append(overrun)
        marking = _ROUND_TRIP_LIMIT.set(limit)
        try:
            with _within(limit):
                await self._send(batch)
        finally:
            _ROUND_TRIP_LIMIT.reset(marking)
            for timer in timers:
                timer.cancel()

    def _expire_while_queued(self) -> None:
        """The round trip being sent has outlasted its limit (PyMongo's server selection
        overshoots it by up to half a second): each write queued behind it is answered at
        its own deadline where it waits, not when the flusher reaches it. Armed only then:
        a timer for every write would put two event-loop calls on the hot path for a rare
        case."""
        loop = asyncio.get_running_loop()
        for queued in self._queued:
            if queued.deadline is not None and queued.expiry is None:
                queued.expiry = loop.call_at(queued.deadline, _expired_in_queue, queued)

    async def _once_a_server_answers(
        self, batch: list[Queued[Op, Result]]
    ) -> list[Queued[Op, Result]]:
        """The members of `batch` still waiting once a server answers; each member whose
        deadline passes before that is failed then, never sent. At once while the client
        knows a server (or nothing is bounded: the driver's own selection timeout is)."""
        if self._server is None or not batch or self._server.known():
            return batch  # the usual case: no list of deadlines built for it
        latest = _latest_deadline(batch)
        if latest is None:
            return batch
        loop = asyncio.get_running_loop()
        timers = [
            loop.call_at(queued.deadline, _never_sent, queued)
            for queued in batch
            if queued.deadline is not None  # every one: `latest` is not None
        ]
        try:
            answered = await self._probe(until=latest)
        finally:
            for timer in timers:
                timer.cancel()
        if not answered:  # out of time: failed unsent, should the clock pass a timer's moment
            for queued in batch:
                _never_sent(queued)
            return []
        # A member whose caller was cancelled goes ahead, as it would have in the driver.
        return [queued for queued in batch if not _failed_unsent(queued)]

    async def _probe(self, *, until: float) -> bool:
        """Whether a server answered the watch's command before `until` (event-loop time).
        A try that failed waiting in server selection is tried again at once; one that
        failed at once, after a pause (`PROBE_PAUSE_S`). A closed client raises."""
        assert self._server is not None
        loop = asyncio.get_running_loop()
        while (left := until - loop.time()) > 0:
            began = loop.time()
            try:
                with pymongo.timeout(left):
                    await asyncio.wait_for(self._server.answered(), timeout=left)
            except OperationFailure:
                return True  # a server answered, if only to refuse the command
            except InvalidOperation:
                raise  # the client is closed: nothing will answer
            except (PyMongoError, TimeoutError):
                if self._server.known():
                    return True  # found, though the command failed: the driver takes it on
                if (pause := began + PROBE_PAUSE_S - loop.time()) > 0:
                    await asyncio.sleep(min(pause, max(until - loop.time(), 0)))
                continue
            return True
        return False


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


def _never_sent[Op, Result](queued: Queued[Op, Result]) -> None:
    fail(queued, QueuedPastDeadline("no server answered before its deadline"))


def _expired_in_queue[Op, Result](queued: Queued[Op, Result]) -> None:
    # Answered now rather than when the flusher reaches it (after a round trip that may
    # outlast its limit); `_unexpired` then leaves it out.
    fail(queued, QueuedPastDeadline("waited past its deadline for earlier round trips"))


def _failed_unsent[Op, Result](queued: Queued[Op, Result]) -> bool:
    outcome = queued.outcome
    return outcome.done() and not outcome.cancelled() and outcome.exception() is not None


def _within(limit: float | None) -> contextlib.AbstractContextManager[None]:
    """The round trip's time limit: what is left of `limit`."""
    if limit is None:
        return contextlib.nullcontext()
    return pymongo.timeout(max(limit - asyncio.get_running_loop().time(), 0.001))


def _each_answered_by_its_deadline[Op, Result](
    batch: Sequence[Queued[Op, Result]], limit: float | None
) -> list[asyncio.TimerHandle]:
    """Timers failing each member of `batch` at its deadline should the round trip outlast
    it (a member already answered is left as it is). Those whose deadline is the round
    trip's `limit` are given `LIMIT_GRACE_S` more for PyMongo's own error, which tells a
    write never sent from one that may have landed, but may come late: its server selection
    waits in steps of half a second, not cut at the limit."""
    if limit is None:
        return []
    loop = asyncio.get_running_loop()
    return [
        loop.call_at(_answer_by(queued.deadline, limit), _timed_out, queued)
        for queued in batch
        if queued.deadline is not None
    ]


def _answer_by(deadline: float, limit: float) -> float:
    return deadline if deadline < limit else limit + LIMIT_GRACE_S


def _timed_out[Op, Result](queued: Queued[Op, Result]) -> None:
    fail(queued, TimedOutInFlight("its deadline passed while its round trip was in flight"))
