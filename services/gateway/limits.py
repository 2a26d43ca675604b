"""Limits and back-pressure: per-key request rate, per-tenant tasks in flight, slow bodies.

Both counting limits live in the gateway's MongoDB, so every gateway replica enforces the same
numbers; over either one the client gets 429 problem+json with `Retry-After` and
`"limit": "rate" | "in_flight"`.

Request rate (`RATE_LIMIT_PER_MIN`, 0 = off): a fixed one-minute window per key, one counter
document `{_id: "<key_id>:<window start>", count, expires_at}` removed by a TTL index once the
window is over. A request is let through by bumping the counter only while it is below the
limit (`{count: {$lt: limit}}` + `$inc` + upsert: when the window is full, the upsert collides
on `_id`), the same conditional update as the in-flight count; refused requests do not count.
That write needs no answer but its own success or `DuplicateKeyError`, so concurrent requests
of one key become one conditional `$inc` of their number (`services/gateway/counters.py`),
each tried on its own when they do not all fit. A fixed window lets a key spend up to twice
its rate across a window boundary; that is the price of at most one write per request.
Once a key's window refused a request, each replica remembers it full until the window ends
(`FullWindows`) and refuses the key's further requests in it without a write.

Tasks in flight (`MAX_IN_FLIGHT_PER_TENANT`, 0 = off): a task is in flight from its acceptance
(queued or scheduled) until its `task.completed` or `task.failed` reaches the gateway. Two
places keep the count:

- the task's submission (`services/gateway/submissions.py`) carries the mark `in_flight: true`,
  written with the submission itself, so counting a task costs no write of its own;
- `in_flight_tenants`: one counter `{_id: tenant_id, count, recent_releases}` per tenant.

Admitting tasks (one, or a batch's, all or none) records their marked submissions, then bumps
the counter by their number only while it stays within the limit (`{count: {$lte: max - n}}` +
upsert: when the counter is too full, the upsert collides on `_id`); that single conditional
update is the check, so concurrent replicas never admit past the limit.
An outcome (`services/gateway/submit.py`, `settle_outcome`) reads the mark, decrements the
counter and records the task id in `recent_releases` in one atomic update guarded by
`recent_releases: {$ne: task_id}` (`release`), then removes the mark together with the
submission's other bookkeeping. So a duplicate `task.completed`, a `task.failed` after it, or
a redelivery after a crash between the two writes decrements at most once.
Concurrent admissions of one tenant, and concurrent releases, are merged into one update each
(`services/gateway/counters.py`) under the same guards.

Crashes and database failures between steps can only ever under-count, never over-count for
good (an under-count lets a tenant briefly exceed its limit; an over-count would shrink it
forever):

- a crash after the marked submission but before the counter: the task is not counted, and
  its end will decrement a count that never included it (the counter never goes below 0);
- a failed or unknown counter update, a refused publish (503), a full queue: the submission
  releases its slot (which may decrement once too often) and only then forgets the
  submission; when even the release fails, the request is written off later
  (`services/gateway/refusals.py`: the slot released, then the submission abandoned), or, if
  the gateway dies first, the outbox sweep sends the task and its end releases the slot;
- a crash after the counter but before the broker confirm: the submission stays `accepting`,
  the outbox sweep sends it, its end releases the slot;
- a redelivered outcome whose task id has left `recent_releases` (the last
  `RECENT_RELEASES` releases of the tenant) while its mark survived: one decrement too many.

Tasks answered from the result cache are never counted; a task replayed from the dead-letter
queue is not counted again (its first end released it).

Slow clients (`REQUEST_BODY_TIMEOUT_S`): `RequestBodyTimeout` is a pure ASGI middleware that
bounds how long receiving a request's body may take and answers 408 problem+json when a client
sends it too slowly; the size of a body is bounded where it is read (`shared.bodies`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from pymongo import ASCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import PyMongoError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.counters import BoundedCounters, GuardedReleases
from services.gateway.errors import DatabaseUnavailable, GatewayError, database_known_away
from shared.away_gate import AwayGate
from shared.http import Problem, problem_instance, problem_response

log = logging.getLogger("scorebox.gateway.limits")

Document = dict[str, Any]
Limit = Literal["rate", "in_flight", "unknown_keys"]

RATE_WINDOW_S = 60
# Counter documents outlive their window by more than the clock skew tolerated between a
# replica and the database, whose clock the TTL monitor goes by: a window removed while a
# replica behind still counts in it restarts at zero (a minute's grace let a replica two
# minutes behind take the limit again each minute).
RATE_DOCUMENT_GRACE = timedelta(minutes=15)
# Nobody knows when a tenant's tasks will finish; a short, fixed hint keeps clients polite.
IN_FLIGHT_RETRY_AFTER_S = 5
# A tenant refused for its in-flight limit has its counter read before its next submissions
# are recorded, for this long (`InFlight.refuse_if_full`): a 429 came only after the
# submission (a batch: its record and every item, texts and all) was written and deleted
# again, the dearest answer at the moment the tenant was over its limit (review of
# admission). Remembered per replica, for this many tenants at most.
RECENTLY_FULL_S = 60.0
RECENTLY_FULL_TENANTS = 10_000
RECENT_RELEASES = 64
OUTCOME_RETRY_DELAY_S = 1.0


class LimitExceeded(GatewayError):
    """429: a limit is reached; nothing was kept."""

    def __init__(self, limit: Limit, detail: str, *, maximum: int, retry_after_s: int) -> None:
        super().__init__(detail)
        self.limit = limit
        self.detail = detail
        self.maximum = maximum
        self.retry_after_s = retry_after_s


LIMIT_KINDS: dict[Limit, str] = {
    "rate": "rate-limited",
    "in_flight": "too-many-tasks-in-flight",
    "unknown_keys": "too-many-unknown-keys",
}


def limit_problem(error: LimitExceeded) -> Problem:
    return Problem(
        429,
        error.detail,
        kind=LIMIT_KINDS[error.limit],
        headers={"Retry-After": str(error.retry_after_s)},
        limit=error.limit,
        maximum=error.maximum,
    )


# --------------------------------------------------------------------------- request rate


@dataclass(frozen=True)
class Window:
    start: datetime
    end: datetime


def fixed_window(now: datetime, seconds: int) -> Window:
    """The fixed window of `seconds` that holds `now` (windows start at multiples of it)."""
    epoch = now.timestamp()
    start = datetime.fromtimestamp(epoch - epoch % seconds, tz=UTC)
    return Window(start=start, end=start + timedelta(seconds=seconds))


def retry_after_s(now: datetime, until: datetime) -> int:
    """Whole seconds from `now` until `until`, at least 1 (what `Retry-After` carries)."""
    return max(1, math.ceil((until - now).total_seconds()))


def rate_counter_id(key_id: str, window: Window) -> str:
    return f"{key_id}:{int(window.start.timestamp())}"


class FullWindows:
    """The keys whose rate window this replica saw refuse a request, for the latest window.

    A rate counter only rises within its window (nothing decrements it), so a window found
    full stays full until it ends: further requests of the key in it are refused from memory,
    where each one used to cost two colliding upserts (`BoundedCounters.add` on its own). Only
    the latest window is kept, so memory holds at most the keys refused in one minute, and a
    key's next window starts afresh.
    """

    def __init__(self) -> None:
        self._window: Window | None = None
        self._keys: set[str] = set()

    def is_full(self, key_id: str, window: Window) -> bool:
        return window == self._window and key_id in self._keys

    def mark_full(self, key_id: str, window: Window) -> None:
        if self._window is None or window.start > self._window.start:
            self._window, self._keys = window, set()  # the past windows' keys are dropped
        if window == self._window:
            self._keys.add(key_id)


class RateLimiter:
    """At most `per_minute` requests per key and fixed minute window, across replicas."""

    def __init__(
        self,
        client: AsyncMongoClient[Document],
        database: str,
        *,
        per_minute: int,
        clock: Callable[[], datetime],
        gate: AwayGate | None = None,
    ) -> None:
        self._collection: AsyncCollection[Document] = client[database]["rate_windows"]
        self._counters = BoundedCounters(self._collection)
        self._gate = gate or AwayGate(known=lambda: True, refusal=database_known_away)
        self._full = FullWindows()
        self._per_minute = per_minute
        self._clock = clock

    async def ensure_indexes(self) -> None:
        await self._collection.create_index([("expires_at", ASCENDING)], expireAfterSeconds=0)

    async def hit(self, key_id: str) -> None:
        """Count one request of `key_id`; `LimitExceeded` (not counted) when it is one too many."""
        if self._per_minute <= 0:
            return
        now = self._clock()
        window = fixed_window(now, RATE_WINDOW_S)
        if not self._full.is_full(key_id, window):
            self._gate.check()  # the database known away: the 503 now, not in 5 s
            if await self._count_one(rate_counter_id(key_id, window), window):
                return
            self._full.mark_full(key_id, window)
        raise self._exceeded(now, window)

    def refuse_if_full(self, key_id: str) -> None:
        """`LimitExceeded` when this replica has seen the key's current window full, from
        memory: a submission is counted only once its body is in, and a key over its limit
        had every body read, up to 16 MiB a batch, before its 429 (a review)."""
        if self._per_minute <= 0:
            return
        now = self._clock()
        window = fixed_window(now, RATE_WINDOW_S)
        if self._full.is_full(key_id, window):
            raise self._exceeded(now, window)

    def _exceeded(self, now: datetime, window: Window) -> LimitExceeded:
        wait = retry_after_s(now, window.end)
        return LimitExceeded(
            "rate",
            f"Rate limit reached: this API key may make {self._per_minute} requests per "
            f"minute; retry in {wait} s.",
            maximum=self._per_minute,
            retry_after_s=wait,
        )

    async def _count_one(self, counter_id: str, window: Window) -> bool:
        """True when the request fits in its window (and is counted)."""
        try:
            fits = await self._counters.add(
                counter_id,
                1,
                ceiling=self._per_minute,
                on_insert={"expires_at": window.end + RATE_DOCUMENT_GRACE},
            )
        except PyMongoError as error:
            self._gate.note(error)
            raise DatabaseUnavailable(str(error)) from error
        self._gate.answered()
        return fits


# --------------------------------------------------------------------------- tasks in flight


class InFlight:
    """Per-tenant count of tasks in flight, shared by every replica (module docstring).

    The marks live on the submissions (`Submissions`, field `in_flight`); this class keeps
    the counters.
    """

    def __init__(
        self, client: AsyncMongoClient[Document], database: str, *, max_per_tenant: int
    ) -> None:
        self._counters: AsyncCollection[Document] = client[database]["in_flight_tenants"]
        self._max = max_per_tenant
        self._counts = BoundedCounters(self._counters)
        self._releases = GuardedReleases(self._counters, remembered=RECENT_RELEASES)
        self._refused_at: OrderedDict[str, float] = OrderedDict()  # tenant: monotonic time

    @property
    def enabled(self) -> bool:
        """Whether tasks are counted at all (`MAX_IN_FLIGHT_PER_TENANT` > 0)."""
        return self._max > 0

    async def ensure_indexes(self) -> None:
        """The counters are addressed by `_id` only; nothing to index."""

    async def acquire(self, tenant_id: str, tasks: int) -> None:
        """Count `tasks` more (one, or a batch's) against the tenant, all or none:
        `LimitExceeded` and nothing counted when they do not all fit. Their submissions are
        marked first (`in_flight`), so that their ends release them.

        On `DatabaseUnavailable` they may or may not be counted: `release` each of them.
        """
        if not self.enabled or tasks <= 0:
            return
        try:
            admitted = await self._counts.add(tenant_id, tasks, ceiling=self._max)
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        if admitted:
            return
        self._refused_at.pop(tenant_id, None)
        self._refused_at[tenant_id] = time.monotonic()
        while len(self._refused_at) > RECENTLY_FULL_TENANTS:
            self._refused_at.popitem(last=False)
        raise self._exceeded(tasks)

    async def refuse_if_full(self, tenant_id: str, tasks: int) -> None:
        """`LimitExceeded` before anything is recorded, when a tenant refused within
        `RECENTLY_FULL_S` still has no room for `tasks`: one read of its counter, for those
        tenants only. `acquire` stays the check that counts; a read the database fails says
        nothing."""
        refused_at = self._refused_at.get(tenant_id)
        if not self.enabled or refused_at is None:
            return
        if time.monotonic() - refused_at > RECENTLY_FULL_S:
            del self._refused_at[tenant_id]
            return
        try:
            count = await self.count(tenant_id)
        except DatabaseUnavailable:
            return
        if count + tasks > self._max:
            raise self._exceeded(tasks)

    def _exceeded(self, tasks: int) -> LimitExceeded:
        return LimitExceeded(
            "in_flight",
            f"This tenant may have at most {self._max} tasks in flight; "
            f"{'this one does' if tasks == 1 else f'these {tasks} do'} not fit now. "
            "Retry when some have finished.",
            maximum=self._max,
            retry_after_s=IN_FLIGHT_RETRY_AFTER_S,
        )

    async def release(self, tenant_id: str, task_id: str) -> None:
        """Take the slot of a marked task back: at most once, however often it is released
        (while the task is among the tenant's last `RECENT_RELEASES`). The caller unmarks
        the submission afterwards."""
        try:
            await self._releases.release(tenant_id, task_id)
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error

    async def count(self, tenant_id: str) -> int:
        try:
            document = await self._counters.find_one({"_id": tenant_id})
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        return int(document["count"]) if document else 0


# --------------------------------------------------------------------------- slow bodies


class BodyTimeout(HTTPException):
    """408: the client took too long to send its body. An HTTPException, so that FastAPI's own
    body parsing lets it through and the problem+json handlers answer it."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"The request body was not received within {timeout_s:g} s.",
            headers={"Connection": "close"},
        )


def install_body_timeout(app: FastAPI, timeout_s: float) -> None:
    """Bound how long receiving a request body may take (`RequestBodyTimeout`), and answer a
    timeout raised inside a route the same way as one this middleware answers itself."""

    async def on_body_timeout(request: Request, error: Exception) -> Response:
        assert isinstance(error, BodyTimeout)
        return problem_response(_timeout_problem(error), problem_instance(request.scope))

    app.add_middleware(RequestBodyTimeout, timeout_s=timeout_s)
    app.add_exception_handler(BodyTimeout, on_body_timeout)


def _timeout_problem(error: BodyTimeout) -> Problem:
    return Problem(408, str(error.detail), kind="request-timeout", headers=error.headers)


class RequestBodyTimeout:
    """Pure ASGI middleware: receiving a request's body may take at most `timeout_s`.

    The clock starts at the application's first `receive()`; once the body is complete,
    `receive()` passes through untouched (streaming responses wait on it for a disconnect).
    A timeout raises `BodyTimeout` inside the application's read, which answers 408; if the
    exception escapes before a response started, this middleware answers the 408 itself.
    """

    def __init__(self, app: ASGIApp, *, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        body_done = False
        started = False

        async def bounded_receive() -> Message:
            nonlocal deadline, body_done
            if body_done:
                return await receive()
            if deadline is None:
                deadline = loop.time() + self.timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except BodyTimeout as error:
            if started:
                raise
            await problem_response(_timeout_problem(error))(scope, receive, send)
