"""`GET /v1/scores/{task_id}/events`: a task's state changes as Server-Sent Events.

A stream first replays the changes the client has not seen (those after `Last-Event-ID`, from
the status service's history of the task), then sends the live ones as this replica hears
them, and ends after the terminal state. Each event's `id:` is the change's sequence, so a
client that reconnects with `Last-Event-ID` gets exactly what it missed; one that reconnects
after the terminal state gets `204 No Content`, which tells an `EventSource` to stop. A
change heard live that the status service has not recorded yet (it lags by more than
`LIVE_SETTLE_S`, or is away) is sent without an `id:` (its data carries its `sequence`): a
reconnection resumes from the last recorded change and may see it again.

A client that reconnects by itself (an `EventSource`: it asks for `text/event-stream`, or
sends `Last-Event-ID`) is never answered 429 or 503, which would make it stop for good: when
the status service is away as a stream starts, the replica's or the tenant's waiters are at
their limit, or the authentication in front of the route refuses the request for now (the
key's request rate, the key store or rate counter away, too many unknown keys), it gets a 200
stream holding only `retry:` and no event, so that it comes back (`EventSourceRoute`). Any
other client gets the problem; a 401 or a refusal for good (500) reaches an `EventSource`
too, which should stop. A `retry:`-only answer counts against the key's rate as any request
that passed authentication does (a refused one does not count); its `retry:` is the
Retry-After, at least `SSE_RETRY_MS` (a stream's own reconnection delay) and up to half as
long again at random, so that the streams turned away together do not come back together,
nor at the waiter limit's 1 s pace spend their key's budget.

When the replica stops, its streams end at once (the client resumes elsewhere with
`Last-Event-ID`) rather than being cut off when the HTTP server's drain runs out.

Limits: a comment line every `SSE_HEARTBEAT_S` keeps proxies from closing an idle stream; a
stream lasts at most `SSE_MAX_STREAM_S` (the client resumes with `Last-Event-ID`); the waiters
of a replica and of a tenant are bounded (`LIVE_MAX_WAITERS*`). A client that disconnects
ends its stream at once (the ASGI server reports the disconnect and the stream is cancelled).
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Annotated, Any, ClassVar

import orjson
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask

from services.gateway.api import TASK_ID, GatewayDeps, read_unavailable, waiter_problem
from services.gateway.auth import Caller
from services.gateway.errors import Unavailable
from services.gateway.push import (
    HistoryPolicy,
    HistoryReader,
    HistorySource,
    LiveUpdates,
    Settled,
    Waiter,
    WaiterLimitReached,
    history_settled,
    listen_within,
    read_history,
)
from shared.contracts import StateChange, TaskEvent, TaskHistory
from shared.http import Problem, problem_responses, quoted

EVENT_STREAM = "text/event-stream"
# A stream re-reads the history this often even without a live event (a lost live event
# costs at most this much latency).
RESYNC_S = 60.0
# How long a stream's heartbeat waits for the live queue's binding when it is not bound.
REBIND_WITHIN_S = 1.0
LAST_EVENT_ID = re.compile(r"^[0-9]{1,18}$")  # ASCII digits: `\d` takes any script's

_EXAMPLE_STREAM = (
    "retry: 3000\n\n"
    'id: 0\ndata: {"task_id": "6f1c…", "sequence": 0, "status": "queued", '
    '"occurred_at": "2025-01-01T12:00:00Z", "attempt": 0}\n\n'
    'id: 110\ndata: {"task_id": "6f1c…", "sequence": 110, "status": "processing", '
    '"occurred_at": "2025-01-01T12:00:01Z", "attempt": 1}\n\n'
    ": keep-alive\n\n"
    'id: 190\ndata: {"task_id": "6f1c…", "sequence": 190, "status": "completed", '
    '"occurred_at": "2025-01-01T12:00:03Z", "attempt": 1, '
    '"result": {"score": 7.5, "comment": "Clear.", "model": "gpt-4o-mini"}}\n\n'
)


def _after(last_event_id: str | None) -> int:
    if last_event_id is None or not last_event_id.strip():
        return -1
    if not LAST_EVENT_ID.match(last_event_id.strip()):
        raise Problem(400, "Last-Event-ID must be the id of an event of this stream (a number).")
    return int(last_event_id)


def _frame(task_id: str, change: StateChange, *, resumable: bool = True) -> bytes:
    """One SSE frame; `resumable=False` for a change heard live that the status service has
    not recorded yet: no `id`, so a reconnection resumes from the last recorded one (and may
    see this change again, once recorded)."""
    data = orjson.dumps({"task_id": task_id, **change.model_dump(mode="json", exclude_none=True)})
    if not resumable:
        return b"data: %s\n\n" % data
    return b"id: %d\ndata: %s\n\n" % (change.sequence, data)


def event_routes(
    deps: GatewayDeps,
    live: LiveUpdates,
    history: HistorySource,
    authenticated: Any,
    still_valid: Callable[[Caller], Awaitable[bool]],
) -> APIRouter:
    """The SSE route; `history` is the status service's history reader."""
    settings = deps.settings
    router = APIRouter(
        prefix="/v1", tags=["scores"], route_class=event_source_route(settings.sse_retry_ms)
    )
    policy = HistoryPolicy(window=timedelta(seconds=settings.read_your_writes_window_s))

    @router.get(
        "/scores/{task_id}/events",
        response_class=StreamingResponse,
        summary="Stream the task's state changes (Server-Sent Events)",
        description="Replays the changes after `Last-Event-ID` (all of them without it), then "
        "streams each new one, and ends after `completed` or `failed`. Each event's `id` is its "
        "sequence and its `data` a JSON object: `task_id`, `sequence`, `status`, "
        "`occurred_at`, `attempt`, and `error`/`next_attempt_at` (retrying, failed) or "
        "`result` (completed). Comment lines are heartbeats.",
        responses={
            200: {
                "description": "The event stream.",
                "content": {
                    EVENT_STREAM: {"schema": {"type": "string"}, "example": _EXAMPLE_STREAM}
                },
            },
            204: {"description": "The task finished and the client has seen every change."},
            **problem_responses(400, 401, 404, 429, 503),
        },
    )
    async def stream_task_events(
        task_id: str,
        caller: Caller = authenticated,
        last_event_id: str | None = Header(default=None, alias="Last-Event-ID"),
        last_event_id_query: Annotated[
            str | None,
            Query(
                alias="lastEventId",
                description="`Last-Event-ID` for clients that cannot send headers on a "
                "reconnection (EventSource polyfills add it to the URL); the header wins.",
            ),
        ] = None,
    ) -> Response:
        after = _after(last_event_id if last_event_id is not None else last_event_id_query)
        if not TASK_ID.match(task_id):
            raise Problem(404, f"No task {quoted(task_id)} is known (or it has expired).")

        async def read(since: int) -> TaskHistory | None:
            return await read_history(
                task_id,
                tenant_id=caller.tenant_id,
                after=since,
                status=history,
                submissions=deps.submissions,
                clock=deps.clock,
                policy=policy,
            )

        try:
            waiter = live.open(task_id, caller.tenant_id)  # before the read: no event slips by
        except WaiterLimitReached as error:
            raise waiter_problem(error) from error
        try:
            # Bounded: a bind stuck on a broker away held the stream's headers (and its waiter
            # place) for as long as the bind took; one not bound yet is retried at heartbeats.
            await listen_within(live, REBIND_WITHIN_S)
            first = await read(after)
        except Unavailable as error:
            live.close(waiter)
            raise read_unavailable(error) from error
        except BaseException:
            live.close(waiter)
            raise
        if first is None:
            live.close(waiter)
            raise Problem(404, f"No task {quoted(task_id)} is known (or it has expired).")
        if after > first.sequence:  # no event of the task has that id: nothing would match
            live.close(waiter)
            raise Problem(
                400,
                f"Last-Event-ID {after} is ahead of the task's latest event ({first.sequence}).",
            )
        if first.status.is_terminal and not first.changes:
            live.close(waiter)
            return Response(status_code=204)

        async def authorised() -> bool:
            return await still_valid(caller)

        stream = _stream(
            task_id,
            first,
            after=after,
            waiter=waiter,
            read=read,
            authorised=authorised,
            live=live,
            heartbeat_s=settings.sse_heartbeat_s,
            max_stream_s=settings.sse_max_stream_s,
            retry_ms=settings.sse_retry_ms,
            settle_s=settings.live_settle_s,
        )

        async def close_waiter() -> None:
            live.close(waiter)

        return StreamingResponse(
            stream,
            media_type=EVENT_STREAM,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            # Also closes the waiter of a stream that never started (client gone at once). A
            # coroutine function, so that it runs on the event loop: Starlette runs a plain
            # function in a worker thread, where the close raced the loop's `open`/`deliver`
            # on the registry's sets and counters.
            background=BackgroundTask(close_waiter),
        )

    return router


def event_source_route(min_retry_ms: int) -> type[APIRoute]:
    """`EventSourceRoute` telling clients to come back after at least `min_retry_ms`."""

    class Route(EventSourceRoute):
        pass

    Route.min_retry_ms = min_retry_ms
    return Route


class EventSourceRoute(APIRoute):
    """The events route, whose refusals for now (429, 503) reach a client that reconnects by
    itself as `_come_back_later`: those of the route (waiters at their limit, the status
    service away) and those of the caller dependency in front of it (the key's request rate,
    the key store or rate counter away, too many unknown keys). A dependency cannot catch
    what a dependency of its own raises (FastAPI answers it first), hence a route class: one
    rule, wherever the refusal comes from. A 401 and a refusal for good (500) pass as they are."""

    min_retry_ms: ClassVar[int] = 0

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        min_retry_ms = self.min_retry_ms

        async def handle_or_come_back_later(request: Request) -> Response:
            try:
                return await handle(request)
            except Problem as problem:
                if problem.status not in {429, 503} or not _reconnects_by_itself(request):
                    raise
                return _come_back_later(problem, min_retry_ms=min_retry_ms)

        return handle_or_come_back_later


def _reconnects_by_itself(request: Request) -> bool:
    """An `EventSource` (it asks for `text/event-stream`, and sends `Last-Event-ID` when it
    reconnects, a polyfill as `?lastEventId=`): it stops for good on any answer but 200 or
    204, a 503 included."""
    accepts = request.headers.get("accept", "")
    reconnecting = "last-event-id" in request.headers or "lastEventId" in request.query_params
    return EVENT_STREAM in accepts or reconnecting


# The longest `retry:` a refusal tells an EventSource: it reconnects on its own, and a long
# Retry-After (an HTTP date, a large number) must not leave it silent for hours.
MAX_RETRY_MS = 60_000
_jitter = random.Random()  # noqa: S311 - spreading reconnections out, not cryptography


def _come_back_later(problem: Problem, *, min_retry_ms: int) -> Response:
    """A stream with nothing in it but when to reconnect, instead of `problem` (a refusal for
    now): the client comes back with the same `Last-Event-ID`, as after any stream's end. It
    says nothing of the task (not even whether it exists). `retry:` is the problem's
    Retry-After, at least `min_retry_ms`, and up to half as long again at random."""
    retry_after = problem.headers.get("Retry-After", str(Unavailable.retry_after_s))
    retry_ms = max(_delay_ms(retry_after), min_retry_ms)
    retry_ms = min(retry_ms + int(retry_ms * _jitter.random() / 2), MAX_RETRY_MS)
    body = b": %s; reconnecting\nretry: %d\n\n" % (problem.kind.encode(), retry_ms)
    return Response(
        body,
        media_type=EVENT_STREAM,
        headers={"Cache-Control": "no-cache", "Retry-After": retry_after},
    )


def _delay_ms(retry_after: str) -> int:
    """A Retry-After of seconds in milliseconds, up to `MAX_RETRY_MS`; one that is no number
    of seconds (an HTTP date) is 0, for the caller's least."""
    if not (retry_after.isascii() and retry_after.isdigit()):
        return 0
    return min(int(retry_after) * 1000, MAX_RETRY_MS)


async def _stream(
    task_id: str,
    first: TaskHistory,
    *,
    after: int,
    waiter: Waiter,
    read: HistoryReader,
    authorised: Callable[[], Awaitable[bool]],
    live: LiveUpdates,
    heartbeat_s: float,
    max_stream_s: float,
    retry_ms: int,
    settle_s: float,
) -> AsyncIterator[bytes]:
    clock = asyncio.get_running_loop().time
    last = after
    try:
        yield b"retry: %d\n\n" % retry_ms
        for change in first.changes:
            yield _frame(task_id, change)
            last = change.sequence
        if first.status.is_terminal:
            return
        ends_at, resync_at = clock() + max_stream_s, clock() + RESYNC_S
        # Every `heartbeat_s`, whatever came meanwhile: each event restarted the wait, and a
        # stream hearing events it skipped (seen already) more often than that sent no
        # keep-alive and never asked after its key (review of live updates).
        beat_at = clock() + heartbeat_s
        while ends_at - clock() > 0:
            event = await waiter.next(min(beat_at, ends_at) - clock())
            if waiter.stopped:
                return  # the replica is stopping: the client resumes on another
            if event is None:
                if not await authorised():
                    return  # its key was revoked
                yield b": keep-alive\n\n"
                beat_at = clock() + heartbeat_s
                await _bind_if_unbound(live)
                if not waiter.missed and clock() < resync_at:
                    continue
                waiter.missed, resync_at = False, clock() + RESYNC_S
            elif event.sequence <= last:
                continue
            settled = await _changes_after(last, event, read=read, settle_s=settle_s)
            # Expired meanwhile (nothing more will come), or its key revoked: the key is asked
            # before changes are sent, not only at heartbeats (a task whose changes came within
            # a heartbeat of each other streamed on, its result included, to a revoked key).
            if settled is None or (settled.changes and not await authorised()):
                return
            changes = settled.changes
            for change in changes:
                yield _frame(task_id, change, resumable=change.sequence <= settled.recorded)
                last = change.sequence
            if changes and changes[-1].status.is_terminal:
                return
    finally:
        live.close(waiter)


async def _bind_if_unbound(live: LiveUpdates) -> None:
    """Bind the live queue if nothing has since a failed bind: a stream opened while the
    broker was away heard changes only at its periodic re-read, for its whole life. A bind
    marks every waiter `missed` (`LiveUpdates.note_bound`), whoever made it: the stream then
    re-reads what changed before it."""
    if not live.listening:
        await listen_within(live, REBIND_WITHIN_S)


async def _changes_after(
    last: int, event: TaskEvent | None, *, read: HistoryReader, settle_s: float
) -> Settled | None:
    """The changes after `last`: once they include `event`, or as they are (a resync)."""
    if event is not None:
        settled = await history_settled(read, after=last, event=event, settle_s=settle_s)
    else:
        try:
            history = await read(last)
        except Unavailable:
            return Settled([], last)  # the status service is away: live events go on
        if history is None:
            return None
        settled = Settled(history.changes, max([last, *(c.sequence for c in history.changes)]))
    newer = [change for change in settled.changes if change.sequence > last]
    return Settled(newer, settled.recorded)
